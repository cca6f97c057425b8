// Launchers of the per-(dtype, head dim) kernel instantiations (defined in the generated inst_*.cu
// files, declared here for the dispatcher in api.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdlib>

#include "common.cuh"

namespace dualkv::cuda::detail {

// dq strategy: by default a separate dq pass (7 matmul units per block pair, no atomics, every
// output bitwise reproducible); DUALKV_ATOMIC_DQ=1 (never with deterministic=true) selects the
// fused variant (5 units + fp32 atomics into dq_accum, then a conversion) where a kernel has it:
// the warp-specialised sm_90a dK/dV kernel (D <= 128) and the sm_80 one. DUALKV_ATOMIC_DQ=2: the
// sm_90a kernel hands its dQ blocks to reducer warps that add them with bulk async reductions
// (elsewhere 2 acts as 1). Neither beat the separate pass (H200, bf16, D=128, Hq=32, Hkv=8,
// N=16 P=8192 R=1024 backward: 19.3 ms separate, 19.5 ms mode 1, 19.2 ms mode 2, and the
// separate pass has since gained ping-pong: 18.3 ms; sm_80 47.8 vs 37.0 ms): A/B switches, see
// src/cuda/NOTES.md.
inline int atomic_dq_mode(bool deterministic) {
  if (deterministic) return 0;
  const char* e = std::getenv("DUALKV_ATOMIC_DQ");
  if (!e || e[0] == '\0' || e[1] != '\0') return 0;
  return e[0] == '1' ? 1 : e[0] == '2' ? 2 : 0;
}
inline bool use_atomic_dq(bool deterministic) { return atomic_dq_mode(deterministic) != 0; }

// Ping-pong of the two consumer warpgroups in the warp-specialised sm_90a forward and dQ kernels
// (they take turns issuing their GEMMs); DUALKV_SM90_PINGPONG=0 turns it off, for A/B timing.
inline bool use_pingpong() {
  const char* e = std::getenv("DUALKV_SM90_PINGPONG");
  return !(e && e[0] == '0');
}

// The most shared memory per block any D = 512 kernel asks for (each config static_asserts it).
constexpr int kSmemHeadDim512 = 227 * 1024;

// Throws std::runtime_error naming `what` when the last launch failed.
void check_launch(const char* what);

// kernel<<<grid, threads, smem, stream>>>(arg) with the kernel's dynamic shared-memory limit
// raised to `smem` first, then check_launch(what). The caller skips an empty grid. cluster > 1:
// thread-block clusters of `cluster` consecutive CTAs along x (grid a multiple of it).
template <typename Arg>
void launch_kernel(void (*kernel)(Arg), int64_t grid, int threads, int smem, cudaStream_t stream,
                   const Arg& arg, const char* what, int cluster = 1) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (cluster == 1) {
    kernel<<<unsigned(grid), threads, smem, stream>>>(arg);
  } else {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(unsigned(grid));
    cfg.blockDim = dim3(unsigned(threads));
    cfg.dynamicSmemBytes = size_t(smem);
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = unsigned(cluster);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    cudaLaunchKernelEx(&cfg, kernel, arg);
  }
  check_launch(what);
}

template <typename T, int D>
void launch_forward_sm80(const Params& p, cudaStream_t stream);

template <typename T, int D>
void launch_backward_sm80(const Params& p, bool deterministic, cudaStream_t stream);

// sm_90a (wgmma) path: built when CMAKE_CUDA_ARCHITECTURES has 90a (DUALKV_HAS_SM90A), chosen at
// run time on compute capability 9.x unless DUALKV_FORCE_SM80=1.
template <typename T, int D>
void launch_forward_sm90(const Params& p, cudaStream_t stream);

template <typename T, int D>
void launch_backward_sm90(const Params& p, cudaStream_t stream);

}  // namespace dualkv::cuda::detail
