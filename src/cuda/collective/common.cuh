// Device helpers shared by the sm_80 kernels: PTX wrappers (mma.sync, ldmatrix, cp.async),
// swizzled shared-memory tiles, the kernel parameters of each pass (the base Params and the
// layout walks: collective/walks.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "collective/walks.h"
#include "dualkv/layout.h"
#include "dualkv/mask.h"

namespace dualkv::cuda::detail {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The forward's parameters.
struct FwdParams : Params {
  void* out;   // [T, Hq, D]
  float* lse;  // [Hq, T]
};

// The backward's parameters.
struct BwdParams : Params {
  const void* o;        // the forward output
  const void* dout;     // dO
  const float* lse_in;  // the forward lse
  const float* dlse;    // optional dlse
  float* delta;         // workspace [Hq, T]: rowsum(dO*O) - dlse
  float* lse2;          // workspace [Hq, T]: lse * log2(e)
  float* dq_accum;      // workspace fp32 [Hq, D / 64, T, 64]: see dq_accum_at
  void* dq;
  void* dk;
  void* dv;
};

// Element (token, head, col) of the fp32 dQ accumulator of the fused dQ (sm90_bwd_ws.cuh). Laid
// out [Hq][D / 64][T][64] so that the 64-column slab of consecutive queries of one head is one
// contiguous range: a block of dQ is then a single bulk reduction (kSwz = false gives a row's
// start). kSwz (the layout the kernel writes and dq_convert reads): within a token's 256-byte row
// of a slab, the 32-byte group of columns 8k..8k+7 is stored at group k ^ (token & 7). The block a
// warpgroup hands to its reducer is a copy of these rows, so its shared-memory image has the same
// permutation, which makes the accumulator fragment's stores conflict-free (8 consecutive rows hit
// 8 different groups, 2 per bank quarter: 2 wavefronts per 256-byte warp store instead of 8).
// 8 consecutive columns from a multiple of 8 stay contiguous (the conversion's two float4 loads).
template <int D, bool kSwz = false>
__device__ __forceinline__ float* dq_accum_at(const BwdParams& p, int64_t token, int head,
                                              int col) {
  static_assert(D % 64 == 0, "the slabs are 64 columns wide");
  const int c = col % 64;
  const int cs = kSwz ? (((c >> 3) ^ int(token & 7)) << 3) | (c & 7) : c;
  return p.dq_accum + ((int64_t(head) * (D / 64) + col / 64) * p.T + token) * 64 + cs;
}

// ---- type traits ---------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
// K-step kt of an n-tiled fp32 fragment f (its n-tiles 2 kt, 2 kt + 1) as the A fragment of an
// mma.sync m16n8k16.
template <typename T, int NT>
__device__ __forceinline__ void pack_a_ktile(uint32_t (&a)[4], const float (&f)[NT][4], int kt) {
  a[0] = pack2<T>(f[2 * kt][0], f[2 * kt][1]);
  a[1] = pack2<T>(f[2 * kt][2], f[2 * kt][3]);
  a[2] = pack2<T>(f[2 * kt + 1][0], f[2 * kt + 1][1]);
  a[3] = pack2<T>(f[2 * kt + 1][2], f[2 * kt + 1][3]);
}

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t u);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t u) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&u));
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t u) {
  return __half22float2(*reinterpret_cast<__half2*>(&u));
}

// D = A(16x16, row) * B(16x8, col) + C, fp32 accumulate.
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1);
template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                   uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes = 0 fills the destination with zeros (no global read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// One step of a two-stage cp.async pipeline: with a next block, issue its copies into the other
// stage (`issue_next()`) and wait for the current block's only; without one, wait for all.
template <class IssueNext>
__device__ __forceinline__ void cp_pipeline_step(bool has_next, IssueNext&& issue_next) {
  if (has_next) {
    issue_next();
    cp_commit();
    cp_wait<1>();
  } else {
    cp_wait<0>();
  }
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Swizzled [rows][D] tile of 16-bit elements: the 16-byte chunk c of row r lives at chunk
// c ^ (r & 7), so ldmatrix's 8 row addresses hit 8 different bank groups (D >= 64).
template <int D>
__device__ __forceinline__ uint32_t swz(int r,
                                        int c) {  // byte offset of element (r, c), c % 8 == 0
  return uint32_t((r * D + ((((c >> 3) ^ (r & 7))) << 3)) * 2);
}

// Loads rows [0, valid) of a [ROWS][D] tile from gmem (row r at base + r * row_stride elements)
// to shared memory with cp.async, zero-filling the rest; offset(r, c) is the byte offset of
// element (r, c) in the tile's swizzle. All THREADS threads take part. kFreshAddr: the row
// offsets are computed at each call (row_stride made opaque) instead of being hoisted out of the
// caller's loop, where 8+ 64-bit offsets per tile stay live (D = 512's small sm_80 configs: the
// difference between 0 and ~100 bytes of spills).
template <int ROWS, int D, int THREADS, bool kFreshAddr = false, typename T, typename Offset>
__device__ __forceinline__ void load_tile_swizzled(uint32_t s_base, const T* base,
                                                   int64_t row_stride, int valid, Offset offset) {
  constexpr int kChunks = D / 8;
  constexpr int kTotal = ROWS * kChunks;
  static_assert(kTotal % THREADS == 0, "tile chunks must divide by the thread count");
  if constexpr (kFreshAddr) asm volatile("" : "+l"(row_stride));
#pragma unroll
  for (int i = 0; i < kTotal / THREADS; ++i) {
    const int idx = i * THREADS + int(threadIdx.x);
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    const bool ok = r < valid;
    const T* src = base + (ok ? int64_t(r) * row_stride + c : 0);
    cp_async16(s_base + offset(r, c), src, ok);
  }
}

// load_tile_swizzled in the swz<D> layout of the ldmatrix (sm_80) kernels.
template <int ROWS, int D, int THREADS, bool kFreshAddr = false, typename T>
__device__ __forceinline__ void load_tile(uint32_t s_base, const T* base, int64_t row_stride,
                                          int valid) {
  load_tile_swizzled<ROWS, D, THREADS, kFreshAddr>(s_base, base, row_stride, valid,
                                                   [](int r, int c) { return swz<D>(r, c); });
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// An sm_80 backward kernel's cp.async of the Q and dO rows [qs, qs + nq) of q head h into the
// tiles sQ, sdO (BM rows of D columns, swz<D> layout).
template <typename T, int BM, int D, int THREADS, bool kFresh = false>
__device__ __forceinline__ void load_q_do_rows(const BwdParams& p, int qs, int nq, int h,
                                               uint32_t sQ, uint32_t sdO) {
  load_tile<BM, D, THREADS, kFresh>(
      sQ, static_cast<const T*>(p.q) + int64_t(qs) * p.q_tok + int64_t(h) * p.q_head, p.q_tok, nq);
  load_tile<BM, D, THREADS, kFresh>(
      sdO, static_cast<const T*>(p.dout) + (int64_t(qs) * p.Hq + h) * D, int64_t(p.Hq) * D, nq);
}

// The backward's statistics of a thread's query rows row0 and row0 + 8 (queries q0 + row of nq,
// q head h): lse in log2 units (+inf past nq, so that P = 0 there) and delta = rowsum(dO * O).
__device__ __forceinline__ void load_row_stats(const BwdParams& p, int h, int q0, int nq, int row0,
                                               float (&lse2)[2], float (&del)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    lse2[r] = row < nq ? p.lse2[int64_t(h) * p.T + q0 + row] : INFINITY;
    del[r] = row < nq ? p.delta[int64_t(h) * p.T + q0 + row] : 0.f;
  }
}

// The rows one CTA of a tile kernel owns: index (blockIdx.x; in the D = 512 backward's 2-CTA
// clusters, which split the head dim, blockIdx.x / 2; for the key-tile kernels the index after
// key_order, which renumbers the CTAs when Params::key_chunk > 0) = (tile * SPLIT + part) * heads +
// head, each 128-token tile cut into SPLIT parts of B rows. `valid` is false for a part that lies
// past its tile's end (only possible with SPLIT > 1); begin is then the part's would-be first row
// and count is unset.
template <int B>
struct TilePart {
  static constexpr int SPLIT = kTileSize / B;
  int head, begin, count, segment;
  bool valid;

  __device__ __forceinline__ TilePart(const Tile* tiles, int heads, unsigned index = blockIdx.x) {
    head = int(index % unsigned(heads));
    const int rest = int(index / unsigned(heads));
    const int tile_index = rest / SPLIT, part = rest % SPLIT;
    const Tile tile = tiles[tile_index];
    segment = tile.segment;
    if constexpr (SPLIT == 1) {
      begin = tile.begin, count = tile.end - tile.begin, valid = true;
    } else {
      begin = tile.begin + part * B;
      valid = begin < tile.end;
      if (valid) count = min(B, tile.end - begin);
    }
  }
};

// The queries one CTA of a query-tile kernel owns (q head h, its kv head hk); when `valid` is
// false the caller returns: nothing else is read. B <= kTileSize: a part of a tile (TilePart);
// B > kTileSize: the wide tile that the CTA's tile stands for (wide_query_tile: the grid is the
// same, and the CTAs of a segment's last ~1/3 of tiles find nothing).
template <int B>
struct QueryTileCta {
  int h, hk, q0, nq;
  Segment seg;
  bool valid;

  __device__ __forceinline__ explicit QueryTileCta(const Params& p, unsigned index = blockIdx.x) {
    if constexpr (B <= kTileSize) {
      const TilePart<B> part(p.qtiles, p.Hq, index);
      h = part.head, q0 = part.begin, nq = part.count, valid = part.valid;
      if (!valid) return;
      seg = p.segs[part.segment];
    } else {
      h = int(index % unsigned(p.Hq));
      const Tile tile = p.qtiles[index / unsigned(p.Hq)];
      seg = p.segs[tile.segment];
      valid = wide_query_tile<B>(seg, tile, &q0, &nq);
      if (!valid) return;
    }
    hk = h / p.group;
  }
};

// The K/V side of an sm_80 query-tile kernel (fwd_kernel_sm80, dq_kernel_sm80): the key-block
// walk of the CTA's queries and the cp.async of walk block j into a stage of the two-stage K and
// V tiles at Cfg::OFF_K / OFF_V of shared memory (Cfg::BN rows of D columns each, swz<D> layout;
// load_tile's kFreshAddr: Cfg::FRESH_ADDR).
template <typename T, int D, class Cfg>
struct QueryTileKv {
  static constexpr int BN = Cfg::BN;
  static constexpr int STAGE_BYTES = BN * D * 2;
  // (no memo of the last middle ancestor: it spills in these kernels; walks.h)
  KeyBlockWalk<BN, false> walk;
  const T* kg;  // row 0 of the kv head's K
  const T* vg;  // ... and V
  uint32_t sK0, sV0;

  template <int BM>
  __device__ __forceinline__ QueryTileKv(const Params& p, const QueryTileCta<BM>& cta,
                                         uint32_t smem)
      : walk(p, cta.seg, cta.q0, cta.nq),
        kg(static_cast<const T*>(p.k) + int64_t(cta.hk) * p.k_head),
        vg(static_cast<const T*>(p.v) + int64_t(cta.hk) * p.v_head),
        sK0(smem + Cfg::OFF_K),
        sV0(smem + Cfg::OFF_V) {}
  __device__ __forceinline__ uint32_t k_stage(int st) const { return sK0 + st * STAGE_BYTES; }
  __device__ __forceinline__ uint32_t v_stage(int st) const { return sV0 + st * STAGE_BYTES; }
  // Key block j's K and V rows into stage st.
  __device__ __forceinline__ void load(int j, int st) const {
    const KeyBlock<BN> kb = walk.at(j);
    const int nk = kb.count();
    const int64_t ks = kb.row();
    const Params& p = walk.p;
    load_tile<BN, D, Cfg::THREADS, Cfg::FRESH_ADDR>(k_stage(st), kg + ks * p.k_tok, p.k_tok, nk);
    load_tile<BN, D, Cfg::THREADS, Cfg::FRESH_ADDR>(v_stage(st), vg + ks * p.v_tok, p.v_tok, nk);
  }
};

// Params::key_chunk: CTA number -> the index TilePart decodes ((tile * SPLIT + part) * Hkv +
// head), with the units (tile * SPLIT + part, longest first) in chunks of key_chunk and, within a
// chunk, every unit of kv head 0, then of kv head 1, ... (the last chunk may be short).
template <int B>
__device__ __forceinline__ unsigned key_order(const Params& p, unsigned index) {
  if (p.key_chunk <= 0) return index;
  const unsigned heads = unsigned(p.Hkv), units = unsigned(p.nkt) * unsigned(kTileSize / B);
  const unsigned g = unsigned(p.key_chunk), c = index / (g * heads), in = index % (g * heads);
  const unsigned gc = min(g, units - c * g);
  return (c * g + in % gc) * heads + in / gc;
}

// The keys one CTA of a key-tile (dK/dV) kernel owns (kv head hk); pk_first/pk_last are the
// keys' logical positions.
template <int B>
struct KeyTileCta {
  int hk, k0, nk, ksi, pk_first, pk_last;
  Segment kseg;
  bool valid;

  __device__ __forceinline__ explicit KeyTileCta(const Params& p, unsigned index = blockIdx.x) {
    const TilePart<B> part(p.ktiles, p.Hkv, key_order<B>(p, index));
    hk = part.head, k0 = part.begin, nk = part.count, valid = part.valid;
    if (!valid) return;
    ksi = part.segment;
    kseg = p.segs[ksi];
    pk_first = kseg.pos0 + (k0 - kseg.start), pk_last = pk_first + nk - 1;
  }
};

}  // namespace dualkv::cuda::detail
