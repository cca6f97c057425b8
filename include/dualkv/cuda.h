// The CUDA library's plain C++ entry points (no torch): raw device pointers, strides, the
// layout tables already on the device, and a stream. No host synchronisation, no allocation:
// the caller provides the workspace.
//
// Kernels, chosen per call: on compute capability 9.x (built with 90a) the sm_90a kernels (TMA,
// producer warps, wgmma); DUALKV_FORCE_SM80=1, or any other GPU, the sm_80 (mma.sync) ones. The
// sm_90a backward at head dim 64/128 adds dQ up inside the dK/dV kernel (fp32 bulk reductions:
// not bitwise reproducible); `deterministic` (or DUALKV_FUSED_DQ=0) runs a separate dQ pass
// instead, as every other path does: bitwise reproducible. docs/kernels.md lists the switches.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "dualkv/logits.h"
#include "dualkv/params.h"

namespace dualkv::cuda {

// Whether the kernels were built for this (dtype, head_dim); the op raises a clear error otherwise.
bool supports(DType dtype, int head_dim);

// Forward: out and lse for every token of the micro-batch, one launch.
void attention_forward(const ForwardArgs& args, cudaStream_t stream);

// Bytes of device workspace attention_backward needs for a call with this shape and
// `deterministic` on the current device under the current switches: rowsum(dO*O) and lse in log2
// units, plus, when the fused sm_90a dQ runs (head dim 64/128, not deterministic), its fp32 dq
// accumulator (T x Hq x D x 4 bytes).
size_t backward_workspace_bytes(const Shape& shape, bool deterministic = false);

// Backward: dq, dk, dv. `workspace` holds `workspace_bytes` >= backward_workspace_bytes(args.shape,
// args.deterministic) bytes (checked: fewer raise), 256-byte aligned; its contents on entry do not
// matter.
void attention_backward(const BackwardArgs& args, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream);

// Log-prob statistics of a chunk of logit rows and their gradient, in place
// (include/dualkv/logits.h); all pointers on the device. A label outside the vocabulary gives a
// NaN log-prob (no host synchronisation to check it).
void logit_stats(const LogitStatsArgs& args, cudaStream_t stream);
void logit_grad(const LogitGradArgs& args, cudaStream_t stream);

}  // namespace dualkv::cuda
