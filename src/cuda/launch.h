// Launchers of the per-(dtype, head dim) kernel instantiations (defined in the generated inst_*.cu
// files, declared here for the dispatcher in api.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "common.cuh"

namespace dualkv::cuda::detail {

// Throws std::runtime_error naming `what` when the last launch failed.
void check_launch(const char* what);

template <typename T, int D>
void launch_forward_sm80(const Params& p, cudaStream_t stream);

template <typename T, int D>
void launch_backward_sm80(const Params& p, bool deterministic, cudaStream_t stream);

}  // namespace dualkv::cuda::detail
