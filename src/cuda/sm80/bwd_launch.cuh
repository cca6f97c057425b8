// The launcher of the sm_80 backward (no kernel of its own): the shared preprocess
// (collective/bwd_preprocess.cuh), then sm80_bwd.cuh's dK/dV and dQ passes, in the regular or the
// small shared-memory configs.
#pragma once

#include <cstdint>

#include "collective/bwd_preprocess.cuh"
#include "launch.h"
#include "sm80/sm80_bwd.cuh"

namespace dualkv::cuda::detail {

template <typename T, int D>
void launch_backward_sm80(const BwdParams& p, bool small_smem, cudaStream_t stream) {
  if (int64_t(p.T) * p.Hq == 0) return;
  launch_bwd_pre<T, D>(p, false, stream);
  const bool cap = p.softcap > 0.f;
  with_sm80_smem_cfg<D>(small_smem, [&](auto small) {
    constexpr bool kSmall = decltype(small)::value;
    constexpr bool kSmallKv = kSmall && D >= 512;  // BwdCfg<256> fits where the small ones do
    using BC = BwdCfg<D, kSmallKv>;
    const int64_t grid_kv = int64_t(p.nkt) * (kTileSize / BC::BN) * p.Hkv;
    if (grid_kv > 0) {
      launch_kernel(
          cap ? dkdv_kernel_sm80<T, D, true, kSmallKv> : dkdv_kernel_sm80<T, D, false, kSmallKv>,
          grid_kv, BC::THREADS, BC::SMEM, stream, p,
          kSmallKv ? "dualkv backward dk/dv (sm80, small smem)" : "dualkv backward dk/dv (sm80)");
    }
    using QC = DqCfg<D, kSmall>;
    const int64_t grid_q = int64_t(p.nqt) * (kTileSize / QC::BM) * p.Hq;
    if (grid_q > 0) {
      launch_kernel(cap ? dq_kernel_sm80<T, D, true, kSmall> : dq_kernel_sm80<T, D, false, kSmall>,
                    grid_q, QC::THREADS, QC::SMEM, stream, p,
                    kSmall ? "dualkv backward dq (sm80, small smem)" : "dualkv backward dq (sm80)");
    }
  });
}

}  // namespace dualkv::cuda::detail
