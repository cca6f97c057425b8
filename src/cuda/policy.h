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
  // dQ strategy: 0 (default) a separate dQ pass (7 matmul units per block pair, no atomics, every
  // output bitwise reproducible); DUALKV_ATOMIC_DQ=1 (never with deterministic=true) the fused
  // variant (5 units + fp32 atomics into dq_accum, then a conversion) where a kernel has it: the
  // warp-specialised sm_90a dK/dV kernel (D <= 128) and the sm_80 one; DUALKV_ATOMIC_DQ=2 the
  // sm_90a kernel hands its dQ blocks to reducer warps that add them with bulk async reductions
  // (elsewhere 2 acts as 1). Neither beat the separate pass (H200, bf16, D=128, Hq=32, Hkv=8,
  // N=16 P=8192 R=1024 backward: 19.3 ms separate, 19.5 ms mode 1, 19.2 ms mode 2, and the
  // separate pass has since gained ping-pong: 18.3 ms; sm_80 47.8 vs 37.0 ms): A/B switches, see
  // src/cuda/NOTES.md. DUALKV_ATOMIC_DQ=3: mode 2 in FlashAttention-3's order (dK from registers,
  // retired within the block) with conflict-free dQ stores (dq_accum's swizzled layout);
  // DUALKV_ATOMIC_DQ=4: mode 2's order with those stores; DUALKV_ATOMIC_DQ=5: mode 3 with an
  // L2 evict_last policy on the reductions (elsewhere 3-5 act as 1).
  int dq_mode = 0;
  // D = 512 backward on sm_90a (sm90/sm90_bwd512_ws.cuh, 2-CTA clusters splitting the head dim;
  // with dq_mode 0 only): DUALKV_SM90_D512_BWD=1 runs its wgmma dK/dV and dQ kernels, =2 its dK/dV
  // kernel with the sm_80 dQ pass (A/B). 0 (unset) by default: compiled, not yet run on a GPU, so
  // the sm_80 D = 512 backward stays the default until measured.
  // =3: both wgmma kernels with the exchange behind the previous block's products (kPipe).
  int d512_bwd_ws = 0;
  // D = 512 forward on sm_90a: 2 (default) sm90/sm90_fwd512_cluster.cuh (2-CTA clusters
  // splitting the head dim, partial S over distributed shared memory, BN = 64, ping-pong; H200:
  // 25.7 vs 29.0 ms at (16, 8192, 1024)); DUALKV_SM90_D512_FWD=0 fwd_ws_kernel_sm90's single-CTA
  // KSPLIT = 2 kernel (A/B).
  int d512_fwd = 2;
};

// The policy for one call; deterministic = the call's `deterministic` (forces dq_mode 0).
KernelPolicy resolve_policy(bool deterministic);

}  // namespace dualkv::cuda::detail
