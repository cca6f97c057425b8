// The CUDA library's plain C++ entry points (no torch): raw device pointers, strides, the
// layout tables already on the device, and a stream. No host synchronisation, no allocation:
// the caller provides the workspace.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "dualkv/params.h"

namespace dualkv::cuda {

// Whether the kernels were built for this (dtype, head_dim); the op raises a clear error otherwise.
bool supports(DType dtype, int head_dim);

// Forward: out and lse for every token of the micro-batch, one launch.
void attention_forward(const ForwardArgs& args, cudaStream_t stream);

// Bytes of device workspace attention_backward needs (fp32 dq accumulator, rowsum(dO*O), ...).
size_t backward_workspace_bytes(const Shape& shape);

// Backward: dq, dk, dv. `workspace` holds backward_workspace_bytes(args.shape) bytes, 256-byte
// aligned; its contents on entry do not matter.
void attention_backward(const BackwardArgs& args, void* workspace, cudaStream_t stream);

}  // namespace dualkv::cuda
