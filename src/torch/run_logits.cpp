// The device-independent part of dualkv::logit_stats / dualkv::logit_grad_: validate, allocate
// outputs, fill the core's argument structs, then hand them to a backend launcher.
#include "run.h"

namespace dualkv::torch_ops {
namespace {

// logits [rows, vocab] of a floating dtype; labels [rows] of integer token ids, same device.
void check_logits(const at::Tensor& logits, const at::Tensor& labels) {
  TORCH_CHECK_VALUE(logits.dim() == 2, "logits must be [rows, vocab], got ", logits.sizes());
  TORCH_CHECK_VALUE(logits.size(1) >= 1, "logits need a vocabulary of at least 1, got ",
                    logits.sizes());
  to_dtype(logits.scalar_type(), "logits");
  TORCH_CHECK_VALUE(labels.dim() == 1 && labels.size(0) == logits.size(0),
                    "labels must be [rows] = [", logits.size(0), "], got ", labels.sizes());
  TORCH_CHECK_TYPE(!at::isFloatingType(labels.scalar_type()) && labels.scalar_type() != at::kBool,
                   "labels must be integer token ids, got ", labels.scalar_type());
  TORCH_CHECK_VALUE(labels.device() == logits.device(), "labels must be on the logits' device ",
                    logits.device(), ", got ", labels.device());
}

// A per-row vector of the accumulation type: [rows], contiguous, on the logits' device.
at::Tensor row_vector(const at::Tensor& t, const at::Tensor& logits, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == logits.size(0), name, " must be [rows] = [",
                    logits.size(0), "], got ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == logits.device(), name, " must be on the logits' device ",
                    logits.device(), ", got ", t.device());
  return t.to(lse_dtype(logits.scalar_type())).contiguous();
}

// The fields LogitStatsArgs and LogitGradArgs share: the rows (logits with a unit column
// stride), their int64 labels and the logit map.
template <typename Args>
void fill_rows(Args& a, const at::Tensor& logits, const at::Tensor& labels, double temperature,
               double softcap) {
  a.dtype = to_dtype(logits.scalar_type(), "logits");
  a.rows = logits.size(0), a.vocab = logits.size(1);
  a.row_stride = a.rows <= 1 ? a.vocab : logits.stride(0);
  a.logits = logits.data_ptr();
  a.labels = labels.data_ptr<int64_t>();
  a.temperature = temperature, a.softcap = softcap;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> logit_stats_outputs(const at::Tensor& logits,
                                                                   bool entropy) {
  const auto opts = logits.options().dtype(lse_dtype(logits.scalar_type()));
  const c10::SymInt rows = logits.sym_size(0);
  return {at::empty_symint({rows}, opts), at::empty_symint({rows}, opts),
          at::empty_symint({entropy ? rows : c10::SymInt(0)}, opts)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> run_logit_stats(
    const at::Tensor& logits_in, const at::Tensor& labels_in, double temperature, double softcap,
    bool entropy, const std::function<void(const LogitStatsArgs&)>& launch) {
  check_logits(logits_in, labels_in);
  const at::Tensor logits = logits_in.stride(1) == 1 ? logits_in : logits_in.contiguous();
  const at::Tensor labels = labels_in.to(at::kLong).contiguous();
  auto [logp, lse, ent] = logit_stats_outputs(logits, entropy);
  LogitStatsArgs a;
  fill_rows(a, logits, labels, temperature, softcap);
  a.logp = logp.data_ptr(), a.lse = lse.data_ptr();
  a.entropy = entropy ? ent.data_ptr() : nullptr;
  launch(a);
  return {logp, lse, ent};
}

void run_logit_grad(const at::Tensor& logits, const at::Tensor& labels_in, const at::Tensor& lse_in,
                    const at::Tensor& g_logp_in, const std::optional<at::Tensor>& g_entropy_in,
                    const std::optional<at::Tensor>& entropy_in, double temperature, double softcap,
                    const std::function<void(const LogitGradArgs&)>& launch) {
  check_logits(logits, labels_in);
  TORCH_CHECK_VALUE(logits.stride(1) == 1,
                    "logit_grad_ writes the gradient into logits in place: they need a unit "
                    "column stride, got strides ",
                    logits.strides());
  const at::Tensor labels = labels_in.to(at::kLong).contiguous();
  const at::Tensor lse = row_vector(lse_in, logits, "lse");
  const at::Tensor g_logp = row_vector(g_logp_in, logits, "g_logp");
  at::Tensor g_ent, ent;
  if (g_entropy_in.has_value()) {
    TORCH_CHECK_VALUE(entropy_in.has_value(), "g_entropy needs the forward's entropy");
    g_ent = row_vector(*g_entropy_in, logits, "g_entropy");
    ent = row_vector(*entropy_in, logits, "entropy");
  }
  LogitGradArgs a;
  fill_rows(a, logits, labels, temperature, softcap);
  a.lse = lse.data_ptr(), a.g_logp = g_logp.data_ptr();
  a.g_entropy = g_ent.defined() ? g_ent.data_ptr() : nullptr;
  a.entropy = ent.defined() ? ent.data_ptr() : nullptr;
  launch(a);
}

}  // namespace dualkv::torch_ops
