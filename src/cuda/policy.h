// Run-time kernel options: read from the environment in one place (resolve_policy, api.cu), once
// per entry-point call, and passed to the launchers; no launcher or kernel reads the environment.
// Unset = the fastest path; every switch is for A/B timing or cross-checking (every path computes
// the same function); docs/kernels.md lists them, env_switch.h the settings each accepts (others
// warn and are ignored).
#pragma once

namespace dualkv::cuda::detail {

// The most shared memory per block any D = 512 kernel asks for (each config static_asserts it):
// Hopper's kernels and the regular sm_80 configs.
constexpr int kSmemHeadDim512 = 227 * 1024;
// ... any regular sm_80 D = 256 kernel (FwdCfg<256>, DqCfg<256>: 128 KB).
constexpr int kSmemHeadDim256 = 128 * 1024;
// The small sm_80 configs (FwdCfg / DqCfg<256 or 512, true>, BwdCfg<512, true>; BwdCfg<256>
// itself fits), which run where a GPU offers less than the regular ones need
// (KernelPolicy::sm80_small_smem): 99 KB, what sm_86/89 GPUs offer (A100: 163 KB); every sm_80+
// GPU runs D = 256 and 512.
constexpr int kSmemSmall = 99 * 1024;
// The shared memory per block the regular configs of head dim d need at most (0: every GPU).
constexpr int smem_regular(int d) {
  return d == 512 ? kSmemHeadDim512 : d == 256 ? kSmemHeadDim256 : 0;
}
// Whether all of an sm_80 pass's configs Cfg<D, kSmall> (FwdCfg, DqCfg) fit the shared memory
// api.cu checks for: the regular ones of D = 256 / 512 smem_regular(D), the small ones
// kSmemSmall, and those of D = 64 / 128, which it does not check, what every sm_80+ GPU offers
// (kSmemSmall).
template <template <int, bool> class Cfg>
constexpr bool sm80_configs_fit() {
  return Cfg<512, false>::SMEM <= smem_regular(512) && Cfg<512, true>::SMEM <= kSmemSmall &&
         Cfg<256, false>::SMEM <= smem_regular(256) && Cfg<256, true>::SMEM <= kSmemSmall &&
         Cfg<128, false>::SMEM <= kSmemSmall && Cfg<64, false>::SMEM <= kSmemSmall;
}

struct KernelPolicy {
  // The wgmma paths: built for sm_90a, a device of compute capability 9.x, and not
  // DUALKV_FORCE_SM80=1 (the sm_80 kernels on any GPU: A100-class GPUs, and the cross-check).
  bool sm90 = false;
  // Ping-pong of the two consumer warpgroups in the warp-specialised forward and dQ kernels (they
  // take turns issuing their GEMMs); DUALKV_SM90_PINGPONG=0 turns it off.
  bool pingpong = true;
  // The sm_90a backward at D = 64, 128 computes dQ inside the dK/dV kernel (5 matmul units per
  // block pair instead of 7: the separate pass recomputes S and dP; bulk async fp32 reductions,
  // so not bitwise reproducible). It is the faster backward (bench/RESULTS.md, the deterministic
  // column; src/cuda/LAB_NOTEBOOK.md, "Defaults and deletions"). False when the call is
  // deterministic (the separate pass: no atomics, bitwise reproducible) or DUALKV_FUSED_DQ=0
  // (A/B). The other paths (sm_80, D = 256, D = 512) always run a separate, deterministic dQ pass.
  bool fused_dq = true;
  // D = 512 on sm_90a: the wgmma backward of sm90/sm90_bwd512_ws.cuh (2-CTA clusters splitting
  // the head dim, so that wgmma tiles fit; faster than the sm_80 mma.sync backward:
  // bench/RESULTS.md); DUALKV_SM90_D512_BWD=0 runs the sm_80 one (A/B, cross-check).
  bool d512_bwd_sm90 = true;
  // The order of the dK/dV kernels' CTAs (Params::key_chunk; every backward path): key tiles in
  // chunks of n, the kv heads outer within a chunk, so that the CTAs running together walk the
  // same kv head's queries (L2 reuse of Q, dO and the dQ reductions), or n = 0: the kv heads of a
  // key tile next to each other. -1 (unset): 32 for the fused sm_90a backward at D = 64, where
  // its L2 reuse made the backward faster, else 0 (no measurable difference at the other head
  // dims; src/cuda/LAB_NOTEBOOK.md, "The dK/dV kernels' CTA order");
  // DUALKV_BWD_KEY_ORDER=0|1|2|3 sets n = 0 / 16 / 32 / 64 (A/B).
  int bwd_key_chunk = -1;
  // Experimental D = 64 tiles on sm_90a (issue 32: FlashAttention-3/4's hdim-64 tiles; not yet
  // measured, so off by default), DUALKV_SM90_D64_TILES=1 (forward), 2 (backward) or 3 (both):
  //   - d64_fwd_bm192: the forward with three consumer warpgroups on 192-query wide tiles
  //     (FwdWsCfg<64, 3>, 512 threads), for three consumer warps per SM scheduler where two left
  //     it latency-bound (src/cuda/LAB_NOTEBOOK.md, "Fifth session"); not with softcap, whose
  //     consumers do not fit 160 registers (the default forward runs);
  //   - d64_bwd_bm128: the fused dK/dV kernel with 128-query blocks (DkdvWsCfg<64, true, 128>:
  //     S^T / dP^T as m64n128 products, each consumer warpgroup adds dQ of 64 query rows over all
  //     128 keys: half the dQ reduction bytes per FLOP, 2 stages); fused dQ only (deterministic
  //     calls and DUALKV_FUSED_DQ=0 keep 64-query blocks).
  bool d64_fwd_bm192 = false;
  bool d64_bwd_bm128 = false;
  // D = 256 and 512 on the sm_80 path: the small shared-memory configs (launch.h, kSmemSmall =
  // 99 KB per block instead of 128 / 227 KB), so that every sm_80+ GPU runs them. Used on a GPU
  // whose opt-in shared memory per block (smem_optin; 0 = unknown) is below what the regular
  // configs of the head dim need (A100, 163 KB: D = 512 only; sm_86/89, 99 KB: both), or with
  // DUALKV_SM80_SMALL_SMEM=1 (sm80_force_small_smem), which also forces the sm_80 path as
  // DUALKV_FORCE_SM80=1 does (the cross-check on Hopper).
  bool sm80_force_small_smem = false;
  int smem_optin = 0;
  bool sm80_small_smem(int head_dim) const {
    return smem_regular(head_dim) > 0 &&
           (sm80_force_small_smem || (smem_optin > 0 && smem_optin < smem_regular(head_dim)));
  }
};

// The policy for one call; deterministic = the call's `deterministic` (forces fused_dq off).
KernelPolicy resolve_policy(bool deterministic);

}  // namespace dualkv::cuda::detail
