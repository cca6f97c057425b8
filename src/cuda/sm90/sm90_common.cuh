// sm_90a helpers: wgmma fences, shared-memory matrix descriptors and the 128-byte-swizzled tile
// layout the descriptors describe. Kernels that use them are compiled for sm_90a only (their
// bodies are empty elsewhere) and selected at run time on compute capability 9.x.
#pragma once

#include "collective/common.cuh"
#include "collective/epilogue.cuh"
#include "sm90/wgmma_ops.cuh"

namespace dualkv::cuda::detail {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DUALKV_SM90_BODY 1
#else
#define DUALKV_SM90_BODY 0
#endif

#if DUALKV_SM90_BODY
__device__ __forceinline__ void wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
#else
__device__ __forceinline__ void wg_fence() {}
__device__ __forceinline__ void wg_commit() {}
template <int N>
__device__ __forceinline__ void wg_wait() {}
#endif
// A thread's 64 x N fp32 accumulator fragment f (N / 2 floats) as the A fragments of an RS
// wgmma over those N as its K dimension (N / 16 K-steps of 4 packed T pairs): P of S for P V,
// P^T / dS^T for the dV / dK products, dS for dQ.
template <typename T, int R, int KT>
__device__ __forceinline__ void pack_a_frag(uint32_t (&a)[KT][4], const float (&f)[R]) {
  static_assert(R == 8 * KT, "an m64nN fragment: N / 16 K-steps");
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
    for (int c = 0; c < 4; ++c) a[kt][c] = pack2<T>(f[8 * kt + 2 * c], f[8 * kt + 2 * c + 1]);
  }
}
// Keeps the compiler from moving accesses of accumulator registers across wgmma waits/fences.
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for 32-bit fragments that an RS wgmma reads asynchronously: fencing them after the
// wait keeps them live (unchanged, unreused) until the wgmma has consumed them.
template <int R, int C>
__device__ __forceinline__ void fence_regs(uint32_t (&a)[R][C]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < C; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}
// Several fragments, fenced in the order given.
template <class A, class B, class... Rest>
__device__ __forceinline__ void fence_regs(A& a, B& b, Rest&... rest) {
  fence_regs(a);
  fence_regs(b, rest...);
}
// Orders this thread's generic-proxy shared-memory writes (cp.async, st.shared) before later
// async-proxy reads (wgmma operands).
__device__ __forceinline__ void fence_proxy_async() {
#if DUALKV_SM90_BODY
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// Shared-memory stores by address (the fused dQ's dS^T and dQ hand-over buffers).
namespace ws {
#if DUALKV_SM90_BODY
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_f32x2(uint32_t addr, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(x), "f"(y) : "memory");
}
#endif
}  // namespace ws

// Tile layout ("SW128"): a [ROWS][D] 16-bit tile is stored as D/64 column blocks of ROWS x 128 B;
// in row r the 16-byte chunk c (of the block) lives at chunk c ^ (r & 7). The tile base must be
// 1024-byte aligned. This is the canonical 128B-swizzled wgmma layout, K-major when rows are the
// M/N dimension (Q, K as B of Q K^T) and MN-major when rows are the K dimension (V in P V).
template <int ROWS>
__device__ __forceinline__ uint32_t sw128(int r,
                                          int c) {  // byte offset of element (r, c), c % 8 == 0
  return uint32_t((c >> 6) * (ROWS * 128) + r * 128 + ((((c & 63) >> 3) ^ (r & 7)) << 4));
}

// A kernel's dynamic shared memory for its SharedStorage SS placed at the first 1024-byte aligned
// byte (the SW128 tiles' alignment): sizeof(SS) and the slack for that alignment.
template <class SS>
constexpr int smem_bytes() {
  static_assert(sizeof(SS) + 1024 <= 227 * 1024, "shared memory per block");
  return int(sizeof(SS)) + 1024;
}

#if DUALKV_SM90_BODY
// The CTA's dynamic shared memory from its first 1024-byte aligned byte, where a kernel's
// SharedStorage starts: `base` as a shared-memory address, `gbase` as a generic pointer to the
// same byte.
struct SmemBase {
  uint32_t base;
  unsigned char* gbase;
  __device__ __forceinline__ SmemBase() {
    extern __shared__ __align__(1024) unsigned char smem[];
    base = (smem_u32(smem) + 1023u) & ~1023u;
    gbase = smem + (base - smem_u32(smem));
  }
};
#endif

// Shared-memory matrix descriptor, 128-byte swizzle. lbo/sbo in bytes.
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = 0;
  d |= uint64_t((addr & 0x3FFFF) >> 4);
  d |= uint64_t((lbo & 0x3FFFF) >> 4) << 16;
  d |= uint64_t((sbo & 0x3FFFF) >> 4) << 32;
  d |= uint64_t(1) << 62;  // SWIZZLE_128B
  return d;
}
// K-major operand (rows = M or N, 16 columns of K from column k0 (multiple of 16)) of an SW128 tile
// with ROWS rows, starting at row r0 (multiple of 8).
template <int ROWS>
__device__ __forceinline__ uint64_t desc_kmajor(uint32_t tile, int r0, int k0) {
  return make_desc(tile + (k0 >> 6) * (ROWS * 128) + r0 * 128 + (k0 & 63) * 2, 16, 1024);
}
// MN-major operand (rows = K: 16 rows from k0 (multiple of 16); all D columns = N) of an SW128
// tile with ROWS rows.
template <int ROWS>
__device__ __forceinline__ uint64_t desc_mnmajor(uint32_t tile, int k0) {
  return make_desc(tile + k0 * 128, ROWS * 128, 1024);
}

// acc = A[a_row0, a_row0 + 64) . B[b_row0, b_row0 + N)^T over columns [k_begin, k_begin + KC)
// (the reduction dim; k_begin a multiple of 16): the KC / 16 wgmmas of one product of two K-major
// SW128 tiles (A of A_ROWS rows, B of B_ROWS rows), issued but not committed (the caller fences,
// commits and waits). KC = D, k_begin = 0: the whole product (wgmma_rows).
template <typename T, int N, int KC, int A_ROWS, int B_ROWS, int NACC>
__device__ __forceinline__ void wgmma_rows_cols(float (&acc)[NACC], uint32_t sA, int a_row0,
                                                uint32_t sB, int b_row0, int k_begin) {
#pragma unroll
  for (int kk = 0; kk < KC / 16; ++kk) {
    Wgmma<T, N>::template ss<0>(acc, desc_kmajor<A_ROWS>(sA, a_row0, k_begin + kk * 16),
                                desc_kmajor<B_ROWS>(sB, b_row0, k_begin + kk * 16), kk > 0);
  }
}
template <typename T, int N, int D, int A_ROWS, int B_ROWS, int NACC>
__device__ __forceinline__ void wgmma_rows(float (&acc)[NACC], uint32_t sA, int a_row0, uint32_t sB,
                                           int b_row0) {
  wgmma_rows_cols<T, N, D, A_ROWS, B_ROWS>(acc, sA, a_row0, sB, b_row0, 0);
}

// acc (+)= A B: A the KT m16k16 register fragments (the reduction dim, 16 KT), B the MN-major
// SW128 tile of ROWS rows at sB (its first N columns): KT accumulating RS wgmmas, issued but not
// committed.
template <typename T, int N, int ROWS, int KT>
__device__ __forceinline__ void wgmma_rs_acc(float (&acc)[N / 2], const uint32_t (&a)[KT][4],
                                             uint32_t sB) {
#pragma unroll
  for (int kt = 0; kt < KT; ++kt)
    Wgmma<T, N>::template rs<1>(acc, a[kt], desc_mnmajor<ROWS>(sB, kt * 16), 1);
}
// The same with fragment kt applied to B's rows [16 k16[kt], 16 k16[kt] + 16) (a run-time order
// of the reduction dim's 16-row steps).
template <typename T, int N, int ROWS, int KT>
__device__ __forceinline__ void wgmma_rs_acc_rows(float (&acc)[N / 2], const uint32_t (&a)[KT][4],
                                                  uint32_t sB, const int (&k16)[KT]) {
#pragma unroll
  for (int kt = 0; kt < KT; ++kt)
    Wgmma<T, N>::template rs<1>(acc, a[kt], desc_mnmajor<ROWS>(sB, k16[kt] * 16), 1);
}

}  // namespace dualkv::cuda::detail
