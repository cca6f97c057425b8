// Warp roles of the warp-specialised sm_90a kernels: warpgroup 0 produces, the others consume;
// setmaxnreg moves registers from the producer warpgroup to the consumers within the CTA's pool
// (NOTES.md, "The warp-specialised kernels").
#pragma once

#include "sm90/sm90_common.cuh"

namespace dualkv::cuda::detail {

// The roles of a kernel config (its base class): warpgroup 0 produces and NWG warpgroups consume;
// setmaxnreg gives the producer warpgroup PR registers per thread and each consumer CR, within
// the CTA's pool of THREADS x the launch bound's allocation (65536 / THREADS in steps of 8: 168
// at 384 threads, 128 at 512). More would leave a consumer warp waiting in setmaxnreg.inc forever.
template <int PR, int CR, int NWG = 2>
struct WsRoles {
  static constexpr int THREADS = 128 * (NWG + 1);
  static constexpr int CONSUMERS = 128 * NWG;
  static constexpr int PRODUCER_REGS = PR;
  static constexpr int CONSUMER_REGS = CR;
  static constexpr int REG_POOL = 65536 / THREADS / 8 * 8;
  static_assert(PR + NWG * CR <= (NWG + 1) * REG_POOL, "register pool of one CTA");
};

}  // namespace dualkv::cuda::detail

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
