// The accumulator fragment layout every kernel shares (mma.sync m16n8 and wgmma m64nN alike):
// element i = 4 nt + e of a thread (lane = 4 g + tq) holds row g + 8 (e >> 1), column
// nt * 8 + 2 * tq + (e & 1) (n-tile nt). An accumulator is held as a flat float[N] (wgmma
// kernels) or as float[N / 4][4] (n-tiles of the mma.sync kernels); frag_at reads and writes
// element i of either. (The kernels still spell the row and column out where they mask: through
// index helpers ptxas scheduled some loops differently.)
#pragma once

namespace dualkv::cuda::detail {

template <int N>
__device__ __forceinline__ float frag_at(const float (&f)[N], int i) {
  return f[i];
}
template <int N>
__device__ __forceinline__ float frag_at(const float (&f)[N][4], int i) {
  return f[i >> 2][i & 3];
}
template <int N>
__device__ __forceinline__ float& frag_at(float (&f)[N], int i) {
  return f[i];
}
template <int N>
__device__ __forceinline__ float& frag_at(float (&f)[N][4], int i) {
  return f[i >> 2][i & 3];
}

}  // namespace dualkv::cuda::detail
