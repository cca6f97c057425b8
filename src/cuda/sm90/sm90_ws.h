// Warp-specialised sm_90a kernels (FlashAttention-3 style: TMA, producer warps, ping-pong): the
// path on Hopper. When a TMA tensor map cannot be encoded a launcher returns false and the caller
// runs the sm_80 kernels, with a warning.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "collective/common.cuh"
#include "policy.h"

struct CUtensorMap_st;

namespace dualkv::cuda::detail {

// Encodes a 3-D TMA map over a [T][H][D] 16-bit tensor (strides in elements, D contiguous):
// box = 64 columns x 1 head x `rows` tokens, 128-byte swizzle (the SW128 tile layout of
// sm90_common.cuh, one 64-column block per copy). False when the driver rejects it.
bool encode_tmap_thd(CUtensorMap_st* map, const void* base, int T, int H, int D, int64_t tok_stride,
                     int64_t head_stride, int rows);

// Warns once on stderr that the warp-specialised path could not run (the sm_80 one does).
void warn_ws_fallback(const char* why);

// Warp-specialised TMA forward, every head dim (64, 128, 256, 512). Returns false (nothing
// launched) when a tensor map cannot be encoded; the caller then runs the sm_80 forward.
template <typename T, int D>
bool launch_forward_sm90_ws(const FwdParams& p, const KernelPolicy& policy, cudaStream_t stream);

// Backward, D <= 128: preprocess and the warp-specialised dK/dV kernel, which with
// policy.fused_dq also adds up dQ in fp32 (then a conversion; not bitwise reproducible), else
// the separate warp-specialised dQ pass. False (nothing launched) for D = 256 or when a tensor
// map cannot be encoded.
template <typename T, int D>
bool launch_backward_sm90_ws(const BwdParams& p, const KernelPolicy& policy, cudaStream_t stream);

// D = 512 backward with the wgmma dK/dV and dQ kernels of sm90_bwd512_ws.cuh (2-CTA clusters
// splitting the head dim; the caller skips it when KernelPolicy::d512_bwd_sm90 is false).
// False (nothing launched) when a tensor map cannot be encoded.
template <typename T>
bool launch_backward_sm90_d512(const BwdParams& p, cudaStream_t stream);

// D = 256 backward with sm90_bwd256_ws.cuh's warp-specialised dK/dV kernel, then the
// warp-specialised dQ pass. False (nothing launched, with a warning) when a tensor map of either
// kernel cannot be encoded.
template <typename T>
bool launch_backward_sm90_d256ws(const BwdParams& p, const KernelPolicy& policy,
                                 cudaStream_t stream);

// D = 512 forward of sm90_fwd512_cluster.cuh (2-CTA clusters splitting the head dim). False
// (nothing launched) when a tensor map cannot be encoded.
template <typename T>
bool launch_forward_sm90_d512c(const FwdParams& p, const KernelPolicy& policy, cudaStream_t stream);

}  // namespace dualkv::cuda::detail
