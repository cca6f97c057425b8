// The backward preprocess every backward path starts with (delta = rowsum(dO * O) - dlse and
// lse2 = lse * log2(e) into the workspace; zeroes the fp32 dq accumulator for the fused dQ) and
// the conversion of that accumulator into dq (after the sm_90a dK/dV kernel with fused dQ).
#pragma once

#include "launch.h"

namespace dualkv::cuda::detail {

// EPT elements of a (token, head) row per thread (8, or D / 32 so that a row stays in one warp).
template <int D>
constexpr int kPreElems = D / 8 > 32 ? D / 32 : 8;

template <typename T, int D>
__global__ void __launch_bounds__(256)
    bwd_pre_kernel(const __grid_constant__ BwdParams p, bool zero_dq) {
  constexpr int EPT = kPreElems<D>;
  constexpr int TPR = D / EPT;  // threads per (token, head) row, <= 32
  const int64_t rows = int64_t(p.T) * p.Hq;
  const int64_t gt = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = gt / TPR;
  const int c = int(gt % TPR) * EPT;
  const bool valid = row < rows;
  float acc = 0.f;
  if (valid) {
#pragma unroll
    for (int v8 = 0; v8 < EPT / 8; ++v8) {
      const int cc = c + 8 * v8;
      const uint4 a = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.dout) + row * D + cc);
      const uint4 b = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.o) + row * D + cc);
      const uint32_t av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 x = unpack2<T>(av[i]), y = unpack2<T>(bv[i]);
        acc = fmaf(x.x, y.x, fmaf(x.y, y.y, acc));
      }
      if (zero_dq) {
        // Zeroes the accumulator (any layout: the threads cover all T * Hq * D elements).
        float4* z = reinterpret_cast<float4*>(p.dq_accum + row * D + cc);
        z[0] = make_float4(0.f, 0.f, 0.f, 0.f);
        z[1] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  }
#pragma unroll
  for (int off = TPR / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (valid && c == 0) {
    const int64_t t = row / p.Hq, h = row % p.Hq;
    const int64_t i = h * p.T + t;
    p.delta[i] = acc - (p.dlse ? p.dlse[i] : 0.f);
    const float l = p.lse_in[i];
    // A query with no visible key (lse = -inf) has P = 0 everywhere: lse2 = +inf gives that.
    p.lse2[i] = l == -INFINITY ? INFINITY : l * kLog2e;
  }
}

// dq = scale * dq_accum, from the accumulator's swizzled slab layout (dq_accum_at<D, true>) to
// dq's [T, Hq, D]; 8 elements per thread.
template <typename T, int D>
__global__ void __launch_bounds__(256) dq_convert_kernel(const __grid_constant__ BwdParams p) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = i / (D / 8);
  if (row >= int64_t(p.T) * p.Hq) return;
  const int c = int(i % (D / 8)) * 8;
  const float4* acc =
      reinterpret_cast<const float4*>(dq_accum_at<D, true>(p, row / p.Hq, int(row % p.Hq), c));
  const float4 a = acc[0], b = acc[1];
  uint4 r;
  r.x = pack2<T>(a.x * p.scale, a.y * p.scale);
  r.y = pack2<T>(a.z * p.scale, a.w * p.scale);
  r.z = pack2<T>(b.x * p.scale, b.y * p.scale);
  r.w = pack2<T>(b.z * p.scale, b.w * p.scale);
  reinterpret_cast<uint4*>(static_cast<T*>(p.dq))[i] = r;
}

// The preprocess every backward path starts with (bwd_pre_kernel; zeroes dq_accum when
// `fused_dq`).
template <typename T, int D>
void launch_bwd_pre(const BwdParams& p, bool fused_dq, cudaStream_t stream) {
  const int64_t threads = int64_t(p.T) * p.Hq * (D / kPreElems<D>);
  if (threads == 0) return;
  bwd_pre_kernel<T, D><<<unsigned((threads + 255) / 256), 256, 0, stream>>>(p, fused_dq);
  check_launch("dualkv backward preprocess");
}

// Converts dq_accum into dq (after the kernel with fused dQ).
template <typename T, int D>
void launch_dq_convert(const BwdParams& p, cudaStream_t stream) {
  const int64_t n8 = int64_t(p.T) * p.Hq * D / 8;
  if (n8 == 0) return;
  dq_convert_kernel<T, D><<<unsigned((n8 + 255) / 256), 256, 0, stream>>>(p);
  check_launch("dualkv backward dq convert");
}

}  // namespace dualkv::cuda::detail
