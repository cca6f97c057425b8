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

// The per-column values (e.g. the lse2 of a query tile's columns, from v[0]) that a thread's
// fragment of N / 4 n-tiles uses, in registers: columns 8 (j / 2) + 2 tq + j % 2 for j < N / 2;
// element i of the fragment reads out[frag_col_slot(i)].
template <int N>
__device__ __forceinline__ void frag_cols_load(const float* v, int tq, float (&out)[N / 2]) {
#pragma unroll
  for (int j = 0; j < N / 2; ++j) out[j] = v[(j >> 1) * 8 + 2 * tq + (j & 1)];
}
__device__ __forceinline__ int frag_col_slot(int i) { return ((i >> 2) << 1) | (i & 1); }

// Zeroes a flat accumulator (before the loop that adds into it).
template <int N>
__device__ __forceinline__ void zero_frag(float (&f)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) f[i] = 0.f;
}

}  // namespace dualkv::cuda::detail
