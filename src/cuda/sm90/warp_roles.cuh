// Warp roles of the warp-specialised sm_90a kernels: setmaxnreg moves registers from the producer
// warpgroup to the consumers within the CTA's pool (each kernel's config static_asserts its
// budget; NOTES.md, "The warp-specialised kernels").
#pragma once

#include "sm90/sm90_common.cuh"

namespace dualkv::cuda::detail::ws {

#if DUALKV_SM90_BODY
template <int N>
__device__ __forceinline__ void reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
#endif  // DUALKV_SM90_BODY

}  // namespace dualkv::cuda::detail::ws
