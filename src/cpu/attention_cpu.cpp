// The CPU backend: reference implementation and test oracle of the DualKV contract.
//
// Inputs are widened once to the accumulation type (fp32 for fp16/bf16/fp32, fp64 for fp64) and
// laid out per head; the blocked kernels (kernels_impl.h) then run over the layout's tile work
// lists with OpenMP. Every output element is produced by exactly one task in a fixed order, so
// results are bitwise independent of the thread count and schedule (no atomics):
//   forward       tasks (query tile, q head)
//   backward dq   tasks (query tile, q head)
//   backward dkdv tasks (key tile, kv head), each looping over every query that sees the tile.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "dualkv/cpu.h"
#include "dualkv/error.h"
#include "kernels.h"

namespace dualkv::cpu::detail {

namespace generic {
#include "kernels_impl.h"  // NOLINT(build/include): compiled once per instruction set
}  // namespace generic

// A second copy of the kernels for AVX2+FMA, picked at run time, so the library itself can be
// built for a baseline x86-64 target and still run wide vectors where they exist.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DUALKV_CPU_AVX2 1
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
namespace avx2 {
#include "kernels_impl.h"  // NOLINT(build/include)
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

}  // namespace dualkv::cpu::detail

namespace dualkv::cpu {
namespace {

using detail::kBlock;
using detail::Problem;
using detail::Scratch;

template <class A>
struct Kernels {
  void (*forward)(const Problem<A>&, const Segment&, int32_t, int, int, Scratch<A>&);
  void (*dq)(const Problem<A>&, const Segment&, int32_t, int, int, Scratch<A>&);
  void (*dkdv)(const Problem<A>&, int32_t, int32_t, int, int, A*, A*, Scratch<A>&);
};

template <class A>
Kernels<A> select_kernels() {
#ifdef DUALKV_CPU_AVX2
  // DUALKV_CPU_NO_AVX2 forces the generic kernels (used by the tests to cover both paths).
  static const bool have_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (have_avx2 && std::getenv("DUALKV_CPU_NO_AVX2") == nullptr) {
    namespace k = detail::avx2;
    return {&k::forward_rows<A>, &k::dq_rows<A>, &k::dkdv_block<A>};
  }
#endif
  namespace k = detail::generic;
  return {&k::forward_rows<A>, &k::dq_rows<A>, &k::dkdv_block<A>};
}

// ---- argument validation --------------------------------------------------------------------

void check_layout(const LayoutView& lv, int32_t T, const char* fn) {
  DUALKV_CHECK(lv.num_segments >= 0 && lv.num_query_tiles >= 0 && lv.num_key_tiles >= 0, fn,
               ": layout table sizes must be non-negative");
  if (T == 0) return;
  DUALKV_CHECK(lv.segments != nullptr && lv.query_tiles != nullptr && lv.key_tiles != nullptr, fn,
               ": layout.segments, layout.query_tiles and layout.key_tiles must not be null");
  // The walks follow the table's links: it must be exactly the table of its own forest.
  check_segment_table(lv.segments, lv.num_segments, T,
                      (std::string(fn) + ": layout.segments").c_str());
  // Each tile table must cover every token exactly once: otherwise outputs would be left unwritten
  // or written twice.
  std::vector<uint8_t> seen(static_cast<size_t>(T));
  auto check_tiles = [&](const Tile* tiles, int32_t n, const char* name) {
    std::fill(seen.begin(), seen.end(), uint8_t(0));
    int64_t covered = 0;
    for (int32_t i = 0; i < n; ++i) {
      const Tile& t = tiles[i];
      DUALKV_CHECK(t.segment >= 0 && t.segment < lv.num_segments, fn, ": layout.", name, "[", i,
                   "].segment = ", t.segment, " is out of range [0, ", lv.num_segments, ")");
      const Segment& s = lv.segments[t.segment];
      DUALKV_CHECK(t.begin >= s.start && t.begin < t.end && t.end <= s.start + s.len, fn,
                   ": layout.", name, "[", i, "] = [", t.begin, ", ", t.end,
                   ") is not inside its segment");
      for (int32_t x = t.begin; x < t.end; ++x) {
        DUALKV_CHECK(!seen[size_t(x)], fn, ": layout.", name, " covers token ", x, " twice");
        seen[size_t(x)] = 1;
      }
      covered += t.end - t.begin;
    }
    DUALKV_CHECK(covered == T, fn, ": layout.", name, " covers ", covered, " of ", T, " tokens");
  };
  check_tiles(lv.query_tiles, lv.num_query_tiles, "query_tiles");
  check_tiles(lv.key_tiles, lv.num_key_tiles, "key_tiles");
}

void check_common(DType dtype, const Shape& sh, const ScoreParams& sc, const LayoutView& lv,
                  const char* fn) {
  DUALKV_CHECK(dtype == DType::kFloat16 || dtype == DType::kBFloat16 || dtype == DType::kFloat32 ||
                   dtype == DType::kFloat64,
               fn, ": unsupported dtype ", int(dtype));
  DUALKV_CHECK(sh.tokens >= 0, fn, ": shape.tokens must be >= 0, got ", sh.tokens);
  DUALKV_CHECK(sh.num_q_heads > 0, fn, ": shape.num_q_heads must be > 0, got ", sh.num_q_heads);
  DUALKV_CHECK(sh.num_kv_heads > 0, fn, ": shape.num_kv_heads must be > 0, got ", sh.num_kv_heads);
  DUALKV_CHECK(sh.num_q_heads % sh.num_kv_heads == 0, fn, ": shape.num_q_heads (", sh.num_q_heads,
               ") must be a multiple of shape.num_kv_heads (", sh.num_kv_heads, ")");
  DUALKV_CHECK(sh.head_dim > 0, fn, ": shape.head_dim must be > 0, got ", sh.head_dim);
  DUALKV_CHECK(sh.tokens == lv.total_tokens, fn, ": shape.tokens (", sh.tokens,
               ") does not match layout.total_tokens (", lv.total_tokens, ")");
  DUALKV_CHECK(sc.mask.window >= 1, fn, ": window must be >= 1, got ", sc.mask.window);
  DUALKV_CHECK(std::isfinite(sc.softcap) && sc.softcap >= 0, fn,
               ": softcap must be finite and >= 0, got ", sc.softcap);
  DUALKV_CHECK(std::isfinite(sc.softmax_scale), fn, ": softmax_scale must be finite, got ",
               sc.softmax_scale);
  check_layout(lv, sh.tokens, fn);
}

template <class A>
Problem<A> make_problem(const Shape& sh, const ScoreParams& sc, const LayoutView& lv) {
  Problem<A> p;
  p.T = sh.tokens;
  p.Hq = sh.num_q_heads;
  p.Hkv = sh.num_kv_heads;
  p.D = sh.head_dim;
  p.Dp = detail::padded_head_dim(sh.head_dim, detail::kPad<A>);
  p.group = sh.num_q_heads / sh.num_kv_heads;
  p.scale = A(sc.softmax_scale);
  p.softcap = A(sc.softcap);
  p.mask = sc.mask;
  p.segs = lv.segments;
  p.nseg = lv.num_segments;
  return p;
}

// ---- data movement --------------------------------------------------------------------------

// Widens a strided [T, H, D] tensor to A, per head: y[(h * T + t) * Dp + d], zero-padded.
template <class S, class A>
std::unique_ptr<A[]> to_heads(const void* src, TokenHeadStrides st, int32_t T, int32_t H, int32_t D,
                              int32_t Dp) {
  std::unique_ptr<A[]> y(new A[size_t(H) * size_t(T) * size_t(Dp)]);
  const S* x = static_cast<const S*>(src);
#pragma omp parallel for schedule(static)
  for (int32_t t = 0; t < T; ++t) {
    for (int32_t h = 0; h < H; ++h) {
      const S* xr = x + t * st.token + h * st.head;
      A* yr = y.get() + (int64_t(h) * T + t) * Dp;
      for (int32_t d = 0; d < D; ++d) yr[d] = load<A>(xr[d]);
      for (int32_t d = D; d < Dp; ++d) yr[d] = A(0);
    }
  }
  return y;
}

// q, k, v of a forward or backward call widened with to_heads (owned here); the problem points
// at them.
template <class A>
struct WidenedQkv {
  std::unique_ptr<A[]> q, k, v;
};
template <class S, class A, class Args>
WidenedQkv<A> widen_qkv(const Args& args, Problem<A>& p) {
  WidenedQkv<A> w{to_heads<S, A>(args.q, args.q_stride, p.T, p.Hq, p.D, p.Dp),
                  to_heads<S, A>(args.k, args.k_stride, p.T, p.Hkv, p.D, p.Dp),
                  to_heads<S, A>(args.v, args.v_stride, p.T, p.Hkv, p.D, p.Dp)};
  p.q = w.q.get();
  p.k = w.k.get();
  p.v = w.v.get();
  return w;
}

// Every block of up to kTileSize queries of every (query tile, q head), dynamically scheduled
// over the enclosing parallel region's threads (an orphaned `omp for`, implicit barrier at the
// end): fn(segment, first token, count, q head).
template <class F>
void query_blocks_omp_for(const LayoutView& lv, int Hq, F&& fn) {
  const int64_t tasks = int64_t(lv.num_query_tiles) * Hq;
#pragma omp for schedule(dynamic, 1)
  for (int64_t task = 0; task < tasks; ++task) {
    const Tile& tile = lv.query_tiles[task / Hq];
    const int h = int(task % Hq);
    const Segment& seg = lv.segments[tile.segment];
    for (int32_t t0 = tile.begin; t0 < tile.end; t0 += kTileSize)
      fn(seg, t0, std::min(kTileSize, tile.end - t0), h);
  }
}

// ---- forward --------------------------------------------------------------------------------

template <class S, class A>
void forward_typed(const ForwardArgs& args) {
  const Shape& sh = args.shape;
  const LayoutView& lv = args.layout;
  Problem<A> p = make_problem<A>(sh, args.score, lv);
  const WidenedQkv<A> qkv = widen_qkv<S, A>(args, p);
  const Kernels<A> ks = select_kernels<A>();
  S* out = static_cast<S*>(args.out);
  // fp64 writes lse64 (and lse too when given); the others write the fp32 lse.
  constexpr bool kFp64 = std::is_same_v<A, double>;
#pragma omp parallel
  {
    Scratch<A> sc(p.Dp);
    query_blocks_omp_for(lv, p.Hq, [&](const Segment& seg, int32_t t0, int n, int h) {
      ks.forward(p, seg, t0, n, h, sc);
      for (int i = 0; i < n; ++i) {
        const int64_t t = t0 + i;
        const A* o = sc.o.data() + int64_t(i) * p.Dp;
        const A l = sc.l[i];
        S* y = out + (t * p.Hq + h) * p.D;
        A lse;
        if (l == A(0)) {  // no visible key: impossible with window >= 1, but never garbage
          for (int d = 0; d < p.D; ++d) y[d] = store<S>(A(0));
          lse = -std::numeric_limits<A>::infinity();
        } else {  // (a NaN input gives l = NaN and so NaN outputs, never a silent 0)
          for (int d = 0; d < p.D; ++d) y[d] = store<S>(o[d] / l);
          lse = sc.m[i] + std::log(l);
        }
        const int64_t row = int64_t(h) * p.T + t;
        if constexpr (kFp64) args.lse64[row] = lse;
        if (args.lse) args.lse[row] = float(lse);
      }
    });
  }
}

// ---- backward -------------------------------------------------------------------------------

template <class S, class A>
void backward_typed(const BackwardArgs& args) {
  const Shape& sh = args.shape;
  const LayoutView& lv = args.layout;
  Problem<A> p = make_problem<A>(sh, args.score, lv);
  const WidenedQkv<A> qkv = widen_qkv<S, A>(args, p);
  const TokenHeadStrides contiguous{int64_t(p.Hq) * p.D, p.D};
  const auto dout = to_heads<S, A>(args.dout, contiguous, p.T, p.Hq, p.D, p.Dp);
  const int64_t rows = int64_t(p.Hq) * p.T;
  std::unique_ptr<A[]> delta(new A[size_t(rows)]);
  std::unique_ptr<A[]> lse(new A[size_t(rows)]);
  const S* out = static_cast<const S*>(args.out);
  // fp64 reads the fp64 lse64 / dlse64: an fp32 lse would cap its gradients at fp32 accuracy.
  constexpr bool kFp64 = std::is_same_v<A, double>;
  auto lse_in = [&](int64_t row) { return kFp64 ? A(args.lse64[row]) : A(args.lse[row]); };
  auto dlse_in = [&](int64_t row) {
    if (kFp64 && args.dlse64) return A(args.dlse64[row]);
    return args.dlse ? A(args.dlse[row]) : A(0);
  };
  // delta = rowsum(dO * O) - dlse: with it, dS = P (dP - delta) also carries the lse gradient.
  // Summed in double: dP - delta cancels, and an fp32 chain over D = 512 cost fp32 gradients
  // several times the accuracy of a plain PyTorch implementation.
#pragma omp parallel for schedule(static)
  for (int32_t t = 0; t < p.T; ++t) {
    for (int32_t h = 0; h < p.Hq; ++h) {
      const int64_t row = int64_t(h) * p.T + t;
      const S* o = out + (int64_t(t) * p.Hq + h) * p.D;
      const A* g = dout.get() + row * p.Dp;
      double acc = 0;
      for (int32_t d = 0; d < p.D; ++d) acc += double(g[d]) * double(load<A>(o[d]));
      delta[size_t(row)] = A(acc - double(dlse_in(row)));
      lse[size_t(row)] = lse_in(row);
    }
  }
  p.dout = dout.get();
  p.delta = delta.get();
  p.lse = lse.get();
  const Kernels<A> ks = select_kernels<A>();
  S* dq = static_cast<S*>(args.dq);
  S* dk = static_cast<S*>(args.dk);
  S* dv = static_cast<S*>(args.dv);
  const A scale = p.scale;
  const int64_t kv_tasks = int64_t(lv.num_key_tiles) * p.Hkv;
#pragma omp parallel
  {
    Scratch<A> sc(p.Dp);
    query_blocks_omp_for(lv, p.Hq, [&](const Segment& seg, int32_t t0, int n, int h) {
      ks.dq(p, seg, t0, n, h, sc);
      for (int i = 0; i < n; ++i) {
        const A* g = sc.o.data() + int64_t(i) * p.Dp;
        S* y = dq + ((t0 + i) * int64_t(p.Hq) + h) * p.D;
        for (int d = 0; d < p.D; ++d) y[d] = store<S>(g[d] * scale);
      }
    });
    // (implicit barrier between the passes)
    std::vector<A> gk(size_t(kBlock<A>) * p.Dp), gv(size_t(kBlock<A>) * p.Dp);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < kv_tasks; ++task) {
      const Tile& tile = lv.key_tiles[task / p.Hkv];
      const int hk = int(task % p.Hkv);
      for (int32_t k0 = tile.begin; k0 < tile.end; k0 += kBlock<A>) {
        const int nk = std::min(kBlock<A>, tile.end - k0);
        std::fill(gk.begin(), gk.end(), A(0));
        std::fill(gv.begin(), gv.end(), A(0));
        ks.dkdv(p, tile.segment, k0, nk, hk, gk.data(), gv.data(), sc);
        for (int j = 0; j < nk; ++j) {
          const int64_t off = ((k0 + j) * int64_t(p.Hkv) + hk) * p.D;
          for (int d = 0; d < p.D; ++d) {
            dk[off + d] = store<S>(gk[size_t(j) * p.Dp + d] * scale);
            dv[off + d] = store<S>(gv[size_t(j) * p.Dp + d]);
          }
        }
      }
    }
  }
}

template <class S, class A>
struct Forward {
  static void run(const ForwardArgs& a) { forward_typed<S, A>(a); }
};
template <class S, class A>
struct Backward {
  static void run(const BackwardArgs& a) { backward_typed<S, A>(a); }
};

}  // namespace

void attention_forward(const ForwardArgs& args) {
  constexpr const char* fn = "dualkv::cpu::attention_forward";
  check_common(args.dtype, args.shape, args.score, args.layout, fn);
  if (args.shape.tokens == 0) return;
  DUALKV_CHECK(args.q && args.k && args.v, fn, ": q, k and v must not be null");
  DUALKV_CHECK(args.out, fn, ": out must not be null");
  if (args.dtype == DType::kFloat64) {
    DUALKV_CHECK(args.lse64, fn, ": lse64 must not be null for float64 inputs");
  } else {
    DUALKV_CHECK(args.lse, fn, ": lse must not be null");
  }
  dispatch<Forward>(args);
}

void attention_backward(const BackwardArgs& args) {
  constexpr const char* fn = "dualkv::cpu::attention_backward";
  check_common(args.dtype, args.shape, args.score, args.layout, fn);
  if (args.shape.tokens == 0) return;
  DUALKV_CHECK(args.q && args.k && args.v, fn, ": q, k and v must not be null");
  DUALKV_CHECK(args.out && args.dout, fn, ": out and dout must not be null");
  if (args.dtype == DType::kFloat64) {
    DUALKV_CHECK(args.lse64, fn, ": lse64 must not be null for float64 inputs");
  } else {
    DUALKV_CHECK(args.lse, fn, ": lse must not be null");
  }
  DUALKV_CHECK(args.dq && args.dk && args.dv, fn, ": dq, dk and dv must not be null");
  dispatch<Backward>(args);
}

}  // namespace dualkv::cpu
