// Run-time kernel options: read from the environment in one place (resolve_policy, api.cu), once
// per entry-point call, and passed to the launchers; no launcher or kernel reads the environment.
// Every switch is for A/B timing or cross-checking (unset = the fastest path; every path computes
// the same function); README.md lists them.
#pragma once

namespace dualkv::cuda::detail {

struct KernelPolicy {
  // The wgmma paths: built for sm_90a, a device of compute capability 9.x, and not
  // DUALKV_FORCE_SM80=1 (the sm_80 kernels on any GPU).
  bool sm90 = false;
  // The warp-specialised sm_90a kernels; DUALKV_SM90_WS=0 selects the synchronous wgmma ones.
  bool sm90_ws = true;
  // Ping-pong of the two consumer warpgroups in the warp-specialised forward and dQ kernels (they
  // take turns issuing their GEMMs); DUALKV_SM90_PINGPONG=0 turns it off.
  bool pingpong = true;
  // dQ strategy of the warp-specialised sm_90a backward (D <= 128): 5 (the default unless
  // deterministic) fuses dQ into the dK/dV kernel: dS K handed through shared memory to reducer
  // warps that add it into the fp32 dq_accum with bulk async reductions (FA3's order, swizzled
  // conflict-free stores, L2 evict_last), then a conversion; 16.07 vs 18.30 ms backward at
  // (16, 8192, 1024), Hq 32, Hkv 8, D 128, H200 (src/cuda/NOTES.md). 0 (deterministic=true, or
  // DUALKV_ATOMIC_DQ=0) the separate dQ pass: no atomics, bitwise reproducible. 1-4 older fused
  // variants (A/B; 1 and 2 also select the sm_80 kernel's atomic dQ, which measured slower).
  int dq_mode = 5;
  // D = 512 backward on sm_90a (sm90/sm90_bwd512_ws.cuh, 2-CTA clusters splitting the head dim):
  // 1 (default) its wgmma dK/dV and dQ kernels (126.9 vs 247.7 ms for the sm_80 backward at
  // (16, 8192, 1024), Hq 32, Hkv 4); DUALKV_SM90_D512_BWD=0 the sm_80 backward, =2 its dK/dV
  // kernel with the sm_80 dQ pass (A/B).
  int d512_bwd_ws = 1;
};

// The policy for one call; deterministic = the call's `deterministic` (forces dq_mode 0).
KernelPolicy resolve_policy(bool deterministic);

}  // namespace dualkv::cuda::detail
