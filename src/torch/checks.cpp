#include "checks.h"

#include <cmath>
#include <limits>

namespace dualkv::torch_ops {

namespace {
void check_table(const at::Tensor& t, const char* name, int64_t fields, const at::Tensor& q) {
  TORCH_CHECK_VALUE(
      t.scalar_type() == at::kInt && t.dim() == 2 && t.sym_size(1) == fields && t.is_contiguous(),
      "layout table '", name, "' must be a contiguous int32 [n, ", fields,
      "] tensor; build it with dualkv.Layout");
  TORCH_CHECK_VALUE(t.device() == q.device(), "the layout is on ", t.device(), " but q is on ",
                    q.device(),
                    "; build the Layout with device=q.device or use layout.to(q.device)");
}
}  // namespace

DType to_dtype(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kFloat:
      return DType::kFloat32;
    case at::kDouble:
      return DType::kFloat64;
    default:
      TORCH_CHECK_TYPE(false, name, " has dtype ", t,
                       "; supported: bfloat16, float16 (CPU and CUDA), float32, float64 (CPU)");
  }
}

at::ScalarType lse_dtype(at::ScalarType input) {
  return input == at::kDouble ? at::kDouble : at::kFloat;
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const LayoutTensors& layout) {
  TORCH_CHECK_VALUE(q.dim() == 3, "q must have shape [T, Hq, D], got ", q.sym_sizes());
  TORCH_CHECK_VALUE(k.dim() == 3, "k must have shape [T, Hkv, D], got ", k.sym_sizes());
  TORCH_CHECK_VALUE(v.dim() == 3, "v must have shape [T, Hkv, D], got ", v.sym_sizes());
  TORCH_CHECK_VALUE(k.sym_sizes().equals(v.sym_sizes()), "k and v must have the same shape, got k ",
                    k.sym_sizes(), " and v ", v.sym_sizes());
  const c10::SymInt &tokens = q.sym_size(0), &hq = q.sym_size(1), &d = q.sym_size(2);
  const c10::SymInt& hkv = k.sym_size(1);
  TORCH_CHECK_VALUE(tokens == layout.total_tokens, "q has ", tokens,
                    " tokens but the layout has total_tokens=", layout.total_tokens);
  TORCH_CHECK_VALUE(k.sym_size(0) == tokens, "k has ", k.sym_size(0), " tokens but q has ", tokens);
  TORCH_CHECK_VALUE(d == k.sym_size(2), "q has head dim ", d, " but k and v have ", k.sym_size(2),
                    "; the head dim must be the same for q, k and v");
  TORCH_CHECK_VALUE(d > 0, "head dim must be positive, got ", d);
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  TORCH_CHECK_VALUE(d <= kMax32 && hq <= kMax32 && hkv <= kMax32,
                    "head dim and head counts must fit in 32 bits, got D=", d, ", Hq=", hq,
                    ", Hkv=", hkv);
  TORCH_CHECK_VALUE(hkv > 0 && hq > 0, "q and k need at least one head, got Hq=", hq,
                    ", Hkv=", hkv);
  TORCH_CHECK_VALUE(hq % hkv == 0, "Hq=", hq, " (q heads) must be a multiple of Hkv=", hkv,
                    " (k/v heads)");
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                   "q, k and v must have the same dtype, got ", q.scalar_type(), ", ",
                   k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK_VALUE(k.device() == q.device() && v.device() == q.device(),
                    "q, k and v must be on the same device, got ", q.device(), ", ", k.device(),
                    ", ", v.device());
  to_dtype(q.scalar_type());
  check_table(layout.segments, "segments", kSegmentFields, q);
  check_table(layout.query_tiles, "query_tiles", kTileFields, q);
  check_table(layout.key_tiles, "key_tiles", kTileFields, q);
}

Shape shape_of(const at::Tensor& q, const at::Tensor& k) {
  return Shape{int32_t(q.size(0)), int32_t(q.size(1)), int32_t(k.size(1)), int32_t(q.size(2))};
}

ScoreParams check_score(const ScoreOptions& opts, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(std::isfinite(opts.softmax_scale), "softmax_scale must be finite, got ",
                    opts.softmax_scale);
  TORCH_CHECK_VALUE(std::isfinite(opts.softcap) && opts.softcap >= 0.0,
                    "softcap must be >= 0 (0 disables it), got ", opts.softcap);
  if (dtype != at::kDouble) {
    // The float32 kernels scale by softmax_scale * log2(e) and divide by the softcap.
    constexpr double kLog2e = 1.4426950408889634;
    constexpr double kMax = std::numeric_limits<float>::max() / kLog2e;
    constexpr double kMinCap = std::numeric_limits<float>::min();
    TORCH_CHECK_VALUE(std::abs(opts.softmax_scale) <= kMax, "softmax_scale=", opts.softmax_scale,
                      " overflows the float32 score computation (", dtype,
                      " inputs): |softmax_scale| must be at most ", kMax);
    TORCH_CHECK_VALUE(opts.softcap == 0.0 || (opts.softcap >= kMinCap && opts.softcap <= kMax),
                      "softcap=", opts.softcap, " is outside float32's range for ", dtype,
                      " inputs: use 0 (no softcap) or a value in [", kMinCap, ", ", kMax, "]");
  }
  ScoreParams p;
  p.softmax_scale = opts.softmax_scale;
  p.softcap = opts.softcap;
  if (opts.window.has_value()) {
    TORCH_CHECK_VALUE(*opts.window >= 1 && *opts.window <= std::numeric_limits<int32_t>::max(),
                      "window must be None or a positive number of tokens, got ", *opts.window);
    p.mask.window = int32_t(*opts.window);
  }
  return p;
}

namespace {
bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }
}  // namespace

// A copy, not t.contiguous(): that returns t itself when torch calls it contiguous, which a view
// starting off a 16-byte boundary, or a size-1 head dim with stride 1, can be.
at::Tensor with_unit_inner_stride(const at::Tensor& t) {
  bool ok = t.stride(2) == 1;
  if (t.is_cuda()) {  // vector loads: 16-byte aligned rows
    const int64_t per16 = 16 / int64_t(t.element_size());
    ok = ok && t.stride(0) % per16 == 0 && t.stride(1) % per16 == 0 && aligned16(t);
  }
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

at::Tensor dense_aligned(const at::Tensor& t) {
  const bool ok = t.is_contiguous() && (!t.is_cuda() || aligned16(t));
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

TokenHeadStrides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1)}; }

LayoutView view_of(const LayoutTensors& layout) {
  LayoutView view;
  view.segments = reinterpret_cast<const Segment*>(layout.segments.data_ptr<int32_t>());
  view.query_tiles = reinterpret_cast<const Tile*>(layout.query_tiles.data_ptr<int32_t>());
  view.key_tiles = reinterpret_cast<const Tile*>(layout.key_tiles.data_ptr<int32_t>());
  view.num_segments = int32_t(layout.segments.size(0));
  view.num_query_tiles = int32_t(layout.query_tiles.size(0));
  view.num_key_tiles = int32_t(layout.key_tiles.size(0));
  view.total_tokens = int32_t(layout.total_tokens.expect_int());
  return view;
}

}  // namespace dualkv::torch_ops
