#include "run.h"

namespace dualkv::torch_ops {

namespace {
// The fields ForwardArgs and BackwardArgs share: problem, options, layout and the q/k/v inputs.
template <typename Args>
void fill_inputs(Args& a, const Shape& shape, const ScoreParams& score, const LayoutTensors& layout,
                 const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  a.dtype = to_dtype(q.scalar_type());
  a.shape = shape;
  a.score = score;
  a.layout = view_of(layout);
  a.q = q.data_ptr(), a.k = k.data_ptr(), a.v = v.data_ptr();
  a.q_stride = strides_of(q), a.k_stride = strides_of(k), a.v_stride = strides_of(v);
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> run_forward(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const LayoutTensors& layout, const ScoreOptions& opts,
    const std::function<void(const ForwardArgs&)>& launch) {
  check_qkv(q_in, k_in, v_in, layout);
  const Shape shape = shape_of(q_in, k_in);
  const ScoreParams score = check_score(opts, q_in.scalar_type());
  const at::Tensor q = with_unit_inner_stride(q_in), k = with_unit_inner_stride(k_in),
                   v = with_unit_inner_stride(v_in);
  at::Tensor out = at::empty({shape.tokens, shape.num_q_heads, shape.head_dim}, q.options());
  at::Tensor lse =
      at::empty({shape.num_q_heads, shape.tokens}, q.options().dtype(lse_dtype(q.scalar_type())));
  if (shape.tokens == 0) return {out, lse};
  ForwardArgs a;
  fill_inputs(a, shape, score, layout, q, k, v);
  a.out = out.data_ptr();
  if (a.dtype == DType::kFloat64) {
    a.lse64 = lse.data_ptr<double>();
  } else {
    a.lse = lse.data_ptr<float>();
  }
  launch(a);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> run_backward(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse_in,
    const std::optional<at::Tensor>& dlse_in, const LayoutTensors& layout, const ScoreOptions& opts,
    bool deterministic, const std::function<void(const BackwardArgs&)>& launch) {
  check_qkv(q_in, k_in, v_in, layout);
  const Shape shape = shape_of(q_in, k_in);
  const ScoreParams score = check_score(opts, q_in.scalar_type());
  TORCH_CHECK_VALUE(dout_in.sizes() == q_in.sizes() && out_in.sizes() == q_in.sizes(),
                    "dout and out must have q's shape ", q_in.sizes(), ", got ", dout_in.sizes(),
                    " and ", out_in.sizes());
  TORCH_CHECK_TYPE(
      dout_in.scalar_type() == q_in.scalar_type() && out_in.scalar_type() == q_in.scalar_type(),
      "dout and out must have q's dtype ", q_in.scalar_type());
  const std::vector<int64_t> lse_shape{shape.num_q_heads, shape.tokens};
  const at::ScalarType lse_type = lse_dtype(q_in.scalar_type());
  TORCH_CHECK_VALUE(
      lse_in.sizes() == at::IntArrayRef(lse_shape) && lse_in.scalar_type() == lse_type,
      "lse must be ", lse_type, " [Hq, T] = ", at::IntArrayRef(lse_shape), ", got ",
      lse_in.scalar_type(), " ", lse_in.sizes());
  const at::Tensor q = with_unit_inner_stride(q_in), k = with_unit_inner_stride(k_in),
                   v = with_unit_inner_stride(v_in);
  const auto on_q = [&](const at::Tensor& t) { return t.device() == q_in.device(); };
  TORCH_CHECK_VALUE(
      on_q(dout_in) && on_q(out_in) && on_q(lse_in) && (!dlse_in.has_value() || on_q(*dlse_in)),
      "dout, out, lse and dlse must be on q's device ", q_in.device());
  const at::Tensor dout = dense_aligned(dout_in), out = dense_aligned(out_in),
                   lse = dense_aligned(lse_in);
  at::Tensor dlse;
  if (dlse_in.has_value()) {
    TORCH_CHECK_VALUE(dlse_in->sizes() == lse.sizes(), "dlse must have lse's shape ", lse.sizes(),
                      ", got ", dlse_in->sizes());
    dlse = dense_aligned(dlse_in->to(lse_type));
  }
  at::Tensor dq = at::empty({shape.tokens, shape.num_q_heads, shape.head_dim}, q.options());
  at::Tensor dk = at::empty({shape.tokens, shape.num_kv_heads, shape.head_dim}, q.options());
  at::Tensor dv = at::empty({shape.tokens, shape.num_kv_heads, shape.head_dim}, q.options());
  if (shape.tokens == 0) return {dq, dk, dv};
  BackwardArgs a;
  fill_inputs(a, shape, score, layout, q, k, v);
  a.out = out.data_ptr();
  a.dout = dout.data_ptr();
  if (a.dtype == DType::kFloat64) {
    a.lse64 = lse.data_ptr<double>();
    a.dlse64 = dlse.defined() ? dlse.data_ptr<double>() : nullptr;
  } else {
    a.lse = lse.data_ptr<float>();
    a.dlse = dlse.defined() ? dlse.data_ptr<float>() : nullptr;
  }
  a.dq = dq.data_ptr(), a.dk = dk.data_ptr(), a.dv = dv.data_ptr();
  a.deterministic = deterministic;
  launch(a);
  return {dq, dk, dv};
}

}  // namespace dualkv::torch_ops
