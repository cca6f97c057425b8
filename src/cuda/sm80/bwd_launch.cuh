// The launcher of the sm_80 backward (no kernel of its own): the shared preprocess
// (collective/bwd_preprocess.cuh), then sm80_bwd.cuh's dK/dV and dQ passes, in the regular or the
// small shared-memory configs.
#pragma once

#include <cstdint>

#include "collective/bwd_preprocess.cuh"
#include "launch.h"
#include "sm80/sm80_bwd.cuh"

namespace dualkv::cuda::detail {

template <typename T, int D, bool kSmall>
void launch_backward_sm80_cfg(const BwdParams& p, cudaStream_t stream) {
  if (int64_t(p.T) * p.Hq == 0) return;
  launch_bwd_pre<T, D>(p, false, stream);
  const bool cap = p.softcap > 0.f;
  constexpr bool kSmallKv = kSmall && D >= 512;  // BwdCfg<256> fits where the small ones do
  using BC = BwdCfg<D, kSmallKv>;
  const int64_t grid_kv = int64_t(p.nkt) * (kTileSize / BC::BN) * p.Hkv;
  if (grid_kv > 0) {
    auto kernel =
        cap ? dkdv_kernel_sm80<T, D, true, kSmallKv> : dkdv_kernel_sm80<T, D, false, kSmallKv>;
    launch_kernel(
        kernel, grid_kv, BC::THREADS, BC::SMEM, stream, p,
        kSmallKv ? "dualkv backward dk/dv (sm80, small smem)" : "dualkv backward dk/dv (sm80)");
  }
  using QC = DqCfg<D, kSmall>;
  const int64_t grid_q = int64_t(p.nqt) * (kTileSize / QC::BM) * p.Hq;
  if (grid_q > 0) {
    auto kernel = cap ? dq_kernel_sm80<T, D, true, kSmall> : dq_kernel_sm80<T, D, false, kSmall>;
    launch_kernel(kernel, grid_q, QC::THREADS, QC::SMEM, stream, p,
                  kSmall ? "dualkv backward dq (sm80, small smem)" : "dualkv backward dq (sm80)");
  }
}

template <typename T, int D>
void launch_backward_sm80(const BwdParams& p, bool small_smem, cudaStream_t stream) {
  if constexpr (D >= 256) {
    if (small_smem) return launch_backward_sm80_cfg<T, D, true>(p, stream);
  }
  launch_backward_sm80_cfg<T, D, false>(p, stream);
}

}  // namespace dualkv::cuda::detail
