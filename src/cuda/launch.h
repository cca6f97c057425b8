// Launchers of the per-(dtype, head dim) kernel instantiations (defined in the generated inst_*.cu
// files, declared here for the dispatcher in api.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <type_traits>

#include "collective/common.cuh"
#include "dualkv/error.h"
#include "policy.h"

namespace dualkv::cuda::detail {

// Throws std::runtime_error naming `what` when the last launch failed.
void check_launch(const char* what);

// kernel<<<grid, threads, smem, stream>>>(arg) with the kernel's dynamic shared-memory limit
// raised to `smem` first, then check_launch(what). The caller skips an empty grid. cluster > 1:
// thread-block clusters of `cluster` consecutive CTAs along x (grid a multiple of it).
template <typename Arg>
void launch_kernel(void (*kernel)(Arg), int64_t grid, int threads, int smem, cudaStream_t stream,
                   const Arg& arg, const char* what, int cluster = 1) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
      cudaSuccess) {
    cudaGetLastError();  // (e.g. head dim 256 on a GPU with 99 KB per block: sm_86/89)
    DUALKV_CHECK(false, what, ": its kernel needs ", smem / 1024,
                 " KB of shared memory per block, more than this GPU allows; this head dim is "
                 "not supported yet on this GPU");
  }
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

// f(std::bool_constant<kSmall>{}): kSmall = small_smem (KernelPolicy::sm80_small_smem(D)) at the
// head dims with small sm_80 configs (256, 512), false at the others.
template <int D, class F>
void with_sm80_smem_cfg(bool small_smem, F&& f) {
  if constexpr (D >= 256) {
    if (small_smem) return f(std::true_type{});
  }
  f(std::false_type{});
}

// small_smem (KernelPolicy::sm80_small_smem(D)): the small shared-memory configs of D = 256 and
// 512 (ignored at the other head dims).
template <typename T, int D>
void launch_forward_sm80(const FwdParams& p, bool small_smem, cudaStream_t stream);

// The sm_80 backward: separate dK/dV and dQ passes, bitwise reproducible.
template <typename T, int D>
void launch_backward_sm80(const BwdParams& p, bool small_smem, cudaStream_t stream);

// The sm_90a launchers (built when CMAKE_CUDA_ARCHITECTURES has 90a, DUALKV_HAS_SM90A; chosen at
// run time when KernelPolicy::sm90): sm90/sm90_ws.h.

}  // namespace dualkv::cuda::detail
