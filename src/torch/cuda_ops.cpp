// CUDA implementations of the dualkv:: ops: dispatch into the CUDA library on the current
// stream; the backward workspace comes from torch's caching allocator.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "dualkv/cuda.h"
#include "ops.h"
#include "run.h"

namespace dualkv::torch_ops {
namespace {

void check_supported(const at::Tensor& q) {
  const DType dtype = to_dtype(q.scalar_type());
  TORCH_CHECK_VALUE(dtype == DType::kBFloat16 || dtype == DType::kFloat16,
                    "on CUDA, q/k/v must be bfloat16 or float16, got ", q.scalar_type());
  TORCH_CHECK_VALUE(q.dim() == 3, "q must have shape [T, Hq, D], got ", q.sizes());
  TORCH_CHECK_VALUE(cuda::supports(dtype, int(q.size(2))), "head dim ", q.size(2), " with ",
                    q.scalar_type(),
                    " is not supported yet by the CUDA kernels of this build (supported on CPU)");
}

FwdResult fwd_cuda(DUALKV_FWD_PARAMS) {
  (void)deterministic;  // the forward pass is always deterministic
  check_supported(q);
  const c10::cuda::CUDAGuard guard(q.device());
  return translate_errors([&] {
    return run_forward(q, k, v, {segments, query_tiles, key_tiles, total_tokens},
                       {softmax_scale, window, softcap}, [&](const ForwardArgs& a) {
                         cuda::attention_forward(a, at::cuda::getCurrentCUDAStream());
                       });
  });
}

BwdResult bwd_cuda(DUALKV_BWD_PARAMS) {
  check_supported(q);
  const c10::cuda::CUDAGuard guard(q.device());
  return translate_errors([&] {
    return run_backward(
        dout, q, k, v, out, lse, dlse, {segments, query_tiles, key_tiles, total_tokens},
        {softmax_scale, window, softcap}, deterministic, [&](const BackwardArgs& a) {
          const size_t bytes = cuda::backward_workspace_bytes(a.shape, a.deterministic);
          at::Tensor workspace = at::empty({int64_t(bytes)}, q.options().dtype(at::kByte));
          cuda::attention_backward(a, workspace.data_ptr(), bytes,
                                   at::cuda::getCurrentCUDAStream());
        });
  });
}

LogitStatsResult logit_stats_cuda(DUALKV_LOGIT_STATS_PARAMS) {
  const c10::cuda::CUDAGuard guard(logits.device());
  return translate_errors([&] {
    return run_logit_stats(
        logits, labels, temperature, softcap, entropy,
        [](const LogitStatsArgs& a) { cuda::logit_stats(a, at::cuda::getCurrentCUDAStream()); });
  });
}

void logit_grad_cuda(DUALKV_LOGIT_GRAD_PARAMS) {
  const c10::cuda::CUDAGuard guard(logits.device());
  translate_errors([&] {
    run_logit_grad(
        logits, labels, lse, g_logp, g_entropy, entropy, temperature, softcap,
        [](const LogitGradArgs& a) { cuda::logit_grad(a, at::cuda::getCurrentCUDAStream()); });
  });
}

}  // namespace
}  // namespace dualkv::torch_ops

TORCH_LIBRARY_IMPL(dualkv, CUDA, m) {
  m.impl("fwd", &dualkv::torch_ops::fwd_cuda);
  m.impl("bwd", &dualkv::torch_ops::bwd_cuda);
  m.impl("logit_stats", &dualkv::torch_ops::logit_stats_cuda);
  m.impl("logit_grad_", &dualkv::torch_ops::logit_grad_cuda);
}
