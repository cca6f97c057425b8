// Experimental sm_90a kernels (FlashAttention-3 style: TMA, warp specialisation, ping-pong),
// chosen at run time only with DUALKV_SM90_EXPERIMENTAL=1. Not yet verified on a GPU: the
// default path never reaches them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common.cuh"

struct CUtensorMap_st;

namespace dualkv::cuda::detail {

// DUALKV_SM90_EXPERIMENTAL=1 in the environment.
bool sm90_experimental();

// Encodes a 3-D TMA map over a [T][H][D] 16-bit tensor (strides in elements, D contiguous):
// box = 64 columns x 1 head x `rows` tokens, 128-byte swizzle (the SW128 tile layout of
// sm90_common.cuh, one 64-column block per copy). False when the driver rejects it.
bool encode_tmap_thd(CUtensorMap_st* map, const void* base, int T, int H, int D, int64_t tok_stride,
                     int64_t head_stride, int rows);

// Warns once on stderr that the experimental path was asked for but could not run.
void warn_experimental_fallback(const char* why);

// Warp-specialised TMA forward. Returns false (nothing launched) when a tensor map cannot be
// encoded; the caller then runs the verified path.
template <typename T, int D>
bool launch_forward_sm90_ws(const Params& p, cudaStream_t stream);

// Backward with the warp-specialised dK/dV kernel (D <= 128; the preprocess and dQ pass are the
// verified ones). False (nothing launched) for D = 256 or when a tensor map cannot be encoded.
template <typename T, int D>
bool launch_backward_sm90_ws(const Params& p, cudaStream_t stream);

}  // namespace dualkv::cuda::detail
