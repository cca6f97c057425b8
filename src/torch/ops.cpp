// Registration of the dualkv:: torch ops (attention, log-prob statistics): schemas, the layout
// helpers, the Meta (fake) implementations used by torch.compile, and the CUDA placeholder when
// no CUDA library is built.
#include "ops.h"

#include <ATen/ATen.h>

#include "dualkv/layout.h"
#include "run.h"

namespace dualkv::torch_ops {
namespace {

Layout make_layout(at::IntArrayRef prefix_lens, at::IntArrayRef response_counts,
                   at::IntArrayRef response_lens) {
  TORCH_CHECK_VALUE(prefix_lens.size() == response_counts.size(), "prefix_lens has ",
                    prefix_lens.size(), " groups but response_lens has ", response_counts.size());
  std::vector<std::vector<int64_t>> nested;
  size_t at = 0;
  for (int64_t n : response_counts) {
    TORCH_CHECK_VALUE(n >= 0 && at + size_t(n) <= response_lens.size(),
                      "response counts do not match the flattened response_lens");
    nested.emplace_back(response_lens.begin() + at, response_lens.begin() + at + n);
    at += size_t(n);
  }
  TORCH_CHECK_VALUE(at == response_lens.size(),
                    "response counts do not match the flattened response_lens");
  return translate_errors(
      [&] { return Layout(std::vector<int64_t>(prefix_lens.begin(), prefix_lens.end()), nested); });
}

Layout make_tree(at::IntArrayRef parents, at::IntArrayRef lengths) {
  return translate_errors([&] {
    return Layout::tree(std::vector<int64_t>(parents.begin(), parents.end()),
                        std::vector<int64_t>(lengths.begin(), lengths.end()));
  });
}

template <typename T>
at::Tensor int32_table(const std::vector<T>& rows, int64_t fields) {
  at::Tensor t = at::empty({int64_t(rows.size()), fields}, at::kInt);
  if (!rows.empty()) std::memcpy(t.data_ptr<int32_t>(), rows.data(), rows.size() * sizeof(T));
  return t;
}

using Tables = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// (segments [S, kSegmentFields] int32, query_tiles [n, 4] int32, key_tiles [m, 4] int32,
// position_ids [T] int64)
Tables tables_of(const Layout& layout) {
  const std::vector<int64_t> pos = layout.position_ids();
  at::Tensor position_ids = at::empty({int64_t(pos.size())}, at::kLong);
  if (!pos.empty()) std::memcpy(position_ids.data_ptr<int64_t>(), pos.data(), pos.size() * 8);
  return {int32_table(layout.segments(), kSegmentFields),
          int32_table(layout.query_tiles(), kTileFields),
          int32_table(layout.key_tiles(), kTileFields), position_ids};
}

Tables layout_tables(at::IntArrayRef prefix_lens, at::IntArrayRef response_counts,
                     at::IntArrayRef response_lens) {
  return tables_of(make_layout(prefix_lens, response_counts, response_lens));
}

// The tables of Layout::tree and its unshared tokens (one row per root-to-leaf path).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t> tree_tables(
    at::IntArrayRef parents, at::IntArrayRef lengths) {
  const Layout layout = make_tree(parents, lengths);
  const auto [segments, query_tiles, key_tiles, position_ids] = tables_of(layout);
  return {segments, query_tiles, key_tiles, position_ids, layout.unshared_tokens()};
}

int64_t pairs_of(const Layout& layout, std::optional<int64_t> window) {
  const ScoreParams score = check_score({1.0, window, 0.0});
  return layout.allowed_pairs(score.mask);
}

int64_t layout_pairs(at::IntArrayRef prefix_lens, at::IntArrayRef response_counts,
                     at::IntArrayRef response_lens, std::optional<int64_t> window) {
  return pairs_of(make_layout(prefix_lens, response_counts, response_lens), window);
}

int64_t tree_pairs(at::IntArrayRef parents, at::IntArrayRef lengths,
                   std::optional<int64_t> window) {
  return pairs_of(make_tree(parents, lengths), window);
}

// The Meta implementations are what torch.compile traces with: output shapes from q's symbolic
// sizes, so one compiled graph serves every layout (no size of a layout table is read).
FwdResult fwd_meta(DUALKV_FWD_PARAMS) {
  check_score({softmax_scale, window, softcap}, q.scalar_type());
  check_qkv(q, k, v, {segments, query_tiles, key_tiles, total_tokens});
  const c10::SymInt &tokens = q.sym_size(0), &heads = q.sym_size(1);
  return {at::empty_symint({tokens, heads, q.sym_size(2)}, q.options()),
          at::empty_symint({heads, tokens}, q.options().dtype(lse_dtype(q.scalar_type())))};
}

BwdResult bwd_meta(DUALKV_BWD_PARAMS) {
  check_score({softmax_scale, window, softcap}, q.scalar_type());
  check_qkv(q, k, v, {segments, query_tiles, key_tiles, total_tokens});
  return {at::empty_like(q, at::MemoryFormat::Contiguous),
          at::empty_like(k, at::MemoryFormat::Contiguous),
          at::empty_like(v, at::MemoryFormat::Contiguous)};
}

LogitStatsResult logit_stats_meta(DUALKV_LOGIT_STATS_PARAMS) {
  (void)labels, (void)temperature, (void)softcap;
  TORCH_CHECK_VALUE(logits.dim() == 2, "logits must be [rows, vocab], got ", logits.sym_sizes());
  return logit_stats_outputs(logits, entropy);
}

void logit_grad_meta(DUALKV_LOGIT_GRAD_PARAMS) {
  (void)logits, (void)labels, (void)lse, (void)g_logp, (void)g_entropy, (void)entropy;
  (void)temperature, (void)softcap;
}

#ifndef DUALKV_WITH_CUDA
[[noreturn]] void no_cuda() {
  TORCH_CHECK(false,
              "DualKV: CUDA backend not built. This dualkv was built without its CUDA library "
              "(against a CPU-only torch, or with DUALKV_CUDA=OFF); reinstall it where nvcc and a "
              "CUDA build of torch are present, or run on CPU tensors.");
}
FwdResult fwd_no_cuda(DUALKV_FWD_PARAMS) { no_cuda(); }
BwdResult bwd_no_cuda(DUALKV_BWD_PARAMS) { no_cuda(); }
LogitStatsResult logit_stats_no_cuda(DUALKV_LOGIT_STATS_PARAMS) { no_cuda(); }
void logit_grad_no_cuda(DUALKV_LOGIT_GRAD_PARAMS) { no_cuda(); }
#endif

}  // namespace
}  // namespace dualkv::torch_ops

TORCH_LIBRARY(dualkv, m) {
  using namespace dualkv::torch_ops;
  m.def(
      "layout_tables(int[] prefix_lens, int[] response_counts, int[] response_lens) -> "
      "(Tensor segments, Tensor query_tiles, Tensor key_tiles, Tensor position_ids)",
      &layout_tables);
  m.def(
      "layout_pairs(int[] prefix_lens, int[] response_counts, int[] response_lens, "
      "int? window) -> int",
      &layout_pairs);
  m.def(
      "tree_tables(int[] parents, int[] lengths) -> (Tensor segments, Tensor query_tiles, "
      "Tensor key_tiles, Tensor position_ids, int unshared_tokens)",
      &tree_tables);
  m.def("tree_pairs(int[] parents, int[] lengths, int? window) -> int", &tree_pairs);
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor segments, Tensor query_tiles, "
      "Tensor key_tiles, SymInt total_tokens, float softmax_scale, int? window, float softcap, "
      "bool deterministic) -> (Tensor out, Tensor lse)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, "
      "Tensor segments, Tensor query_tiles, Tensor key_tiles, SymInt total_tokens, "
      "float softmax_scale, int? window, float softcap, bool deterministic) -> "
      "(Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "logit_stats(Tensor logits, Tensor labels, float temperature, float softcap, "
      "bool entropy) -> (Tensor logp, Tensor lse, Tensor entropy)");
  m.def(
      "logit_grad_(Tensor(a!) logits, Tensor labels, Tensor lse, Tensor g_logp, "
      "Tensor? g_entropy, Tensor? entropy, float temperature, float softcap) -> ()");
}

TORCH_LIBRARY_IMPL(dualkv, Meta, m) {
  m.impl("fwd", &dualkv::torch_ops::fwd_meta);
  m.impl("bwd", &dualkv::torch_ops::bwd_meta);
  m.impl("logit_stats", &dualkv::torch_ops::logit_stats_meta);
  m.impl("logit_grad_", &dualkv::torch_ops::logit_grad_meta);
}

#ifndef DUALKV_WITH_CUDA
TORCH_LIBRARY_IMPL(dualkv, CUDA, m) {
  m.impl("fwd", &dualkv::torch_ops::fwd_no_cuda);
  m.impl("bwd", &dualkv::torch_ops::bwd_no_cuda);
  m.impl("logit_stats", &dualkv::torch_ops::logit_stats_no_cuda);
  m.impl("logit_grad_", &dualkv::torch_ops::logit_grad_no_cuda);
}
#endif
