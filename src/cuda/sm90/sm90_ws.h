// Warp-specialised sm_90a kernels (FlashAttention-3 style: TMA, producer warps, ping-pong): the
// default path on Hopper. KernelPolicy::sm90_ws = false (DUALKV_SM90_WS=0) selects the synchronous
// wgmma kernels instead (sm90_fwd.cuh, sm90_bwd.cuh), which also run when a TMA tensor map cannot
// be encoded.
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

// Warns once on stderr that the warp-specialised path could not run (the synchronous one does).
void warn_ws_fallback(const char* why);

// Warp-specialised TMA forward. Returns false (nothing launched) when a tensor map cannot be
// encoded; the caller then runs the synchronous wgmma path.
template <typename T, int D>
bool launch_forward_sm90_ws(const Params& p, const KernelPolicy& policy, cudaStream_t stream);

// Backward: preprocess, the warp-specialised dK/dV and dQ kernels (D <= 128); with
// policy.dq_mode 1 or 2 the dK/dV kernel also adds up dQ in fp32 (non-deterministic dQ). False
// (nothing launched) for D = 256 or when a tensor map cannot be encoded.
template <typename T, int D>
bool launch_backward_sm90_ws(const Params& p, const KernelPolicy& policy, cudaStream_t stream);

// D = 512 backward with the wgmma dK/dV and dQ kernels of sm90_bwd512_ws.cuh (2-CTA clusters
// splitting the head dim; KernelPolicy::d512_bwd_ws 2: the sm_80 dQ pass); only when
// KernelPolicy::d512_bwd_ws != 0 (not the default yet).
// False (nothing launched) when a tensor map cannot be encoded.
template <typename T>
bool launch_backward_sm90_d512(const Params& p, const KernelPolicy& policy, cudaStream_t stream);

// D = 256 backward with sm90_bwd256_ws.cuh's warp-specialised dK/dV kernel and the synchronous
// dQ pass; only when KernelPolicy::d256_bwd_ws == 1 (not the default yet). False (nothing
// launched) when a tensor map cannot be encoded.
template <typename T>
bool launch_backward_sm90_d256ws(const Params& p, const KernelPolicy& policy, cudaStream_t stream);

// D = 512 forward of sm90_fwd512_cluster.cuh (2-CTA clusters splitting the head dim); only when
// KernelPolicy::d512_fwd == 2 (not the default yet). False (nothing launched) when a tensor map
// cannot be encoded.
template <typename T>
bool launch_forward_sm90_d512c(const Params& p, const KernelPolicy& policy, cudaStream_t stream);

}  // namespace dualkv::cuda::detail
