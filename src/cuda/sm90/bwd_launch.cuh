// The launchers of the sm_90a backward passes (no kernel of their own): the shared preprocess
// (collective/bwd_preprocess.cuh), a dK/dV kernel, then the dQ: at D <= 128 fused into the dK/dV
// kernel (then converted) or the separate pass; at D = 256 the separate pass; at D = 512 the
// cluster dQ kernel. Each encodes every tensor map before it launches anything and returns false
// (nothing launched) when one cannot be encoded: the caller then runs the sm_80 backward.
#pragma once

#include <cstdint>

#include "collective/bwd_preprocess.cuh"
#include "launch.h"
#include "sm90/sm90_bwd256_ws.cuh"
#include "sm90/sm90_bwd512_ws.cuh"
#include "sm90/sm90_bwd_ws.cuh"
#include "sm90/sm90_dq_ws.cuh"
#include "sm90/sm90_ws.h"
#include "sm90/ws_args.cuh"

namespace dualkv::cuda::detail {

// Preprocess, the warp-specialised dK/dV kernel, then (policy.fused_dq) the conversion of the dQ
// it added up, or the separate dQ pass (sm90_dq_ws.cuh). False (nothing launched) for D = 256
// (launch_backward_sm90_d256ws) or when a tensor map cannot be encoded: the caller then runs the
// sm_80 backward.
template <typename T, int D>
bool launch_backward_sm90_ws(const BwdParams& p, const KernelPolicy& policy, cudaStream_t stream) {
  if constexpr (D > 128) {
    return false;
  } else {
    const bool fused = policy.fused_dq, cap = p.softcap > 0.f;
    // The kernel, its query block and shared memory: 128-query blocks with d64_bwd_bm128 (fused
    // dQ, no softcap: DkdvWsCfg), else 64.
    auto kernel =
        fused
            ? (cap ? dkdv_ws_kernel_sm90<T, D, true, true> : dkdv_ws_kernel_sm90<T, D, false, true>)
            : (cap ? dkdv_ws_kernel_sm90<T, D, true, false>
                   : dkdv_ws_kernel_sm90<T, D, false, false>);
    int bm = DkdvWsCfg<D>::BM;
    int smem = fused ? DkdvWsCfg<D, true>::SMEM : DkdvWsCfg<D, false>::SMEM;
    if constexpr (D == 64) {
      if (policy.d64_bwd_bm128 && fused && !cap) {
        using C128 = DkdvWsCfg<D, true, 128>;
        kernel = dkdv_ws_kernel_sm90<T, D, false, true, C128::BM>;
        bm = C128::BM;
        smem = C128::SMEM;
      }
    }
    if (int64_t(p.T) * p.Hq == 0) return true;
    DkdvWsArgs a{};
    if (!make_bwd_ws_args(a, p, D, bm, DkdvWsCfg<D>::BN)) return false;
    DqWsArgs qa{};  // the separate dQ pass's maps, encoded before anything is launched
    if (!fused && !make_dq_ws_args(qa, p, policy, D, DqWsCfg<D>::BM, DqWsCfg<D>::BN)) {
      warn_ws_fallback("cuTensorMapEncodeTiled failed for the dQ pass");
      return false;
    }
    launch_bwd_pre<T, D>(p, fused, stream);
    const int64_t grid = int64_t(p.nkt) * p.Hkv;
    if (grid > 0) {
      launch_kernel(kernel, grid, DkdvWsCfg<D>::THREADS, smem, stream, a,
                    "dualkv backward dk/dv (sm90a, warp-specialised)");
    }
    if (fused) {
      launch_dq_convert<T, D>(p, stream);
    } else {
      launch_dq_sm90_ws<T, D>(qa, stream);
    }
    return true;
  }
}

// Preprocess, the warp-specialised D = 256 dK/dV kernel, then the warp-specialised dQ pass. False
// (nothing launched, with a warning) when a tensor map of either kernel cannot be encoded: the
// caller then runs the sm_80 backward.
template <typename T>
bool launch_backward_sm90_d256ws(const BwdParams& p, const KernelPolicy& policy,
                                 cudaStream_t stream) {
  using C = DkdvWs256Cfg;
  if (int64_t(p.T) * p.Hq == 0) return true;
  DkdvWsArgs a{};
  if (!make_bwd_ws_args(a, p, C::D, C::BM, C::BN)) return false;
  DqWsArgs qa{};  // the dQ pass's maps, encoded before anything is launched
  if (!make_dq_ws_args(qa, p, policy, C::D, DqWsCfg<C::D>::BM, DqWsCfg<C::D>::BN)) {
    warn_ws_fallback("cuTensorMapEncodeTiled failed for the dQ pass");
    return false;
  }
  launch_bwd_pre<T, C::D>(p, false, stream);
  const int64_t grid = int64_t(p.nkt) * (kTileSize / C::BN) * p.Hkv;
  if (grid > 0) {
    auto kernel =
        p.softcap > 0.f ? dkdv_ws256_kernel_sm90<T, true> : dkdv_ws256_kernel_sm90<T, false>;
    launch_kernel(kernel, grid, C::THREADS, C::SMEM, stream, a,
                  "dualkv backward dk/dv (sm90a, warp-specialised, D = 256)");
  }
  launch_dq_sm90_ws<T, C::D>(qa, stream);
  return true;
}

// D = 512 backward on wgmma: preprocess, the dK/dV kernel, then the dQ kernel (both in
// sm90_bwd512_ws.cuh). Atomic-free and bitwise reproducible. False (nothing launched) when a tensor
// map cannot be encoded: the caller then runs the sm_80 backward.
template <typename T>
bool launch_backward_sm90_d512(const BwdParams& p, cudaStream_t stream) {
  using C = DkdvWs512Cfg;
  constexpr int D = C::D;
  if (int64_t(p.T) * p.Hq == 0) return true;
  DkdvWsArgs a{};
  if (!make_bwd_ws_args(a, p, D, C::BM, C::BN)) return false;
  launch_bwd_pre<T, D>(p, false, stream);
  const bool cap = p.softcap > 0.f;
  // Both kernels: the same arguments (the dQ maps are the dK/dV kernel's: boxes of 64 rows for Q,
  // dO, K and V alike), 2-CTA clusters, `units` of them.
  static_assert(DqWs512Cfg::BM == C::BM && DqWs512Cfg::BN == C::BN, "shared tensor maps");
  auto launch = [&](void (*kernel)(DkdvWsArgs), int64_t units, auto cfg, const char* what) {
    using Cfg = decltype(cfg);
    if (units > 0)
      launch_kernel(kernel, units * Cfg::CLUSTER, Cfg::THREADS, Cfg::SMEM, stream, a, what,
                    Cfg::CLUSTER);
  };
  launch(cap ? dkdv_ws512_kernel_sm90<T, true> : dkdv_ws512_kernel_sm90<T, false>,
         int64_t(p.nkt) * (kTileSize / C::BN) * p.Hkv, C{},
         "dualkv backward dk/dv D=512 (sm90a, warp-specialised, 2-CTA clusters)");
  launch(cap ? dq_ws512_kernel_sm90<T, true> : dq_ws512_kernel_sm90<T, false>,
         int64_t(p.nqt) * (kTileSize / DqWs512Cfg::BM) * p.Hq, DqWs512Cfg{},
         "dualkv backward dq D=512 (sm90a, warp-specialised, 2-CTA clusters)");
  return true;
}

}  // namespace dualkv::cuda::detail
