// Standalone test and benchmark of the CUDA library (no torch).
//
//   dualkv_cuda_test [--seed S] [--quick] [--small] [--no-check] [--race N] [--random N]
//                    [--trees N] [--bench] [--bench-reps N] [--bench-rounds N]
//                    [--path default|sm80|sm90-nopp|sm90-sepdq|sm90-d512-sm80|key-chunk0|
//                            key-chunk16|key-chunk32|key-chunk64|sm80-d512-small|
//                            sm80-d256-small|d64-fwd192|
//                            d64-bwd128|d64-tiles]
//                    [--shape N,P,R,Hq,Hkv,D | multi,Hq,Hkv,D | tree,Hq,Hkv,D]...
//   (--small: the quick matrix and 3 race repeats, for compute-sanitizer; --path: those kernel
//   paths only (comma-separated); --random N: instead of the matrix, N rounds of its random-layout
//   cases; --trees N: likewise its random prefix-tree forests (Layout::tree); a failed check
//   prints where its largest error is, and the seed that reproduces the run;
//   --shape: bench only these single-group shapes, with a 1-row reference; multi,Hq,Hkv,D: the
//   realistic micro-batch of bench/attention.py; tree,Hq,Hkv,D: issue 33's branching rollouts, a
//   4K prompt with 4 branches at each of 3 depths of 512-1024 tokens)
//
// Correctness: random layouts over a case matrix (the prompt/response layout and prefix-tree
// forests of Layout::tree); every output is compared with the CPU backend
// run in float64 on the same (rounded) inputs (the reference), and the GPU's max error must be at
// most 2x (forward) / 3x (gradients) the max error of DESIGN.md's baseline, a plain
// implementation in the same 16-bit precision (`run_plain`: the unshared rows with every product,
// softmax and backward step rounded to the dtype, as PyTorch runs python/dualkv/reference.py in
// the Python tests), plus a tiny slack (1/16 of the dtype's epsilon times the reference's max
// magnitude). A failed check prints where its largest error is, to tell a layout edge (an error
// at a segment or window boundary) from rounding.
// Outputs are poisoned with NaN before every run; NaN never passes. Deterministic mode must be
// bitwise reproducible; the race test repeats a run many times and requires bitwise-equal results.
// Bench: CUDA events, warm-up, median of repeats, useful TFLOP/s (Layout::forward_flops).
// Kernel paths, each checked (default and deterministic mode) and timed (backward in both modes):
// the default (sm_90a on Hopper: fused dQ at D = 64/128 unless deterministic, the wgmma D = 512
// backward), the sm_80 one (DUALKV_FORCE_SM80=1), ping-pong off (DUALKV_SM90_PINGPONG=0: forward
// and dQ kernels), and for A/B: at D <= 128 the separate dQ pass in the default mode
// (DUALKV_FUSED_DQ=0), at D = 512 the sm_80 backward (DUALKV_SM90_D512_BWD=0); the dK/dV CTAs
// in chunks of key tiles with the kv heads outer (key-chunk16/32/64: DUALKV_BWD_KEY_ORDER=1/2/3;
// 32 at every head dim, the others at 64/128; key-chunk0 at D = 64, where the default is 32: the
// kv heads side by side); at D = 512 the sm_80 kernels' small shared-memory configs, which GPUs
// with less than 227 KB per block run (sm80-d512-small: DUALKV_SM80_SMALL_SMEM=1, which implies the
// sm_80 path), and at D = 256 those that GPUs with less than 128 KB run (sm80-d256-small, the same
// switch); at D = 64 the experimental tiles (d64-fwd192 / d64-bwd128 / d64-tiles:
// DUALKV_SM90_D64_TILES=1 / 2 / 3).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cpu/convert.h"
#include "dualkv/cpu.h"
#include "dualkv/cuda.h"
#include "dualkv/error.h"
#include "dualkv/layout.h"

using namespace dualkv;

#define CK(x)                                                                                \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, \
                   __LINE__, #x);                                                            \
      std::exit(2);                                                                          \
    }                                                                                        \
  } while (0)

namespace {

struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  DevBuf() = default;
  explicit DevBuf(size_t n) : bytes(n) { CK(cudaMalloc(&p, std::max<size_t>(n, 256))); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf(DevBuf&& o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr; }
  DevBuf& operator=(DevBuf&& o) noexcept {
    std::swap(p, o.p);
    std::swap(bytes, o.bytes);
    return *this;
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

template <class T>
DevBuf upload(const std::vector<T>& v) {
  DevBuf b(v.size() * sizeof(T));
  if (!v.empty()) CK(cudaMemcpy(b.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return b;
}
template <class T>
std::vector<T> download(const DevBuf& b, size_t n) {
  std::vector<T> v(n);
  if (n) CK(cudaMemcpy(v.data(), b.p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

float to_f(uint16_t b, DType t) {
  return t == DType::kBFloat16 ? cpu::bf16_bits_to_float(b) : cpu::half_bits_to_float(b);
}
uint16_t from_f(float f, DType t) {
  return t == DType::kBFloat16 ? cpu::float_to_bf16_bits(f) : cpu::float_to_half_bits(f);
}
double dtype_eps(DType t) { return t == DType::kBFloat16 ? 0x1p-8 : 0x1p-11; }

struct Case {
  std::string name;
  std::vector<int64_t> P;
  std::vector<std::vector<int64_t>> R;
  // A prefix-tree case (Layout::tree) when `lengths` is not empty; P and R are then unused.
  std::vector<int64_t> parents, lengths;
  int Hq = 4, Hkv = 2, D = 128;
  DType dt = DType::kBFloat16;
  int32_t window = kNoWindow;
  float softcap = 0.f;
  bool dlse = false;
  float mag = 1.f;  // input magnitude (large-magnitude cases)
};

Layout layout_of(const Case& c) {
  return c.lengths.empty() ? Layout(c.P, c.R) : Layout::tree(c.parents, c.lengths);
}

// The layout's tables on the host and the device.
struct Tables {
  std::vector<Segment> seg;
  std::vector<Tile> qt, kt;
  DevBuf dseg, dqt, dkt;
  LayoutView host_view(int T) const {
    return {seg.data(),         qt.data(),          kt.data(), int32_t(seg.size()),
            int32_t(qt.size()), int32_t(kt.size()), T};
  }
  LayoutView dev_view(int T) const {
    return {dseg.as<Segment>(),
            dqt.as<Tile>(),
            dkt.as<Tile>(),
            int32_t(seg.size()),
            int32_t(qt.size()),
            int32_t(kt.size()),
            T};
  }
};
Tables make_tables(const Layout& L) {
  Tables t;
  t.seg = L.segments();
  t.qt = L.query_tiles();
  t.kt = L.key_tiles();
  t.dseg = upload(t.seg);
  t.dqt = upload(t.qt);
  t.dkt = upload(t.kt);
  return t;
}

struct Err {
  double max_err = 0, max_ref = 0;
  bool nan = false;
  size_t at = 0;  // index of the largest error (the first non-finite value if any)
};
template <class Get>
Err max_error(size_t n, const std::vector<double>& ref, Get get) {
  Err e;
  for (size_t i = 0; i < n; ++i) {
    const double x = get(i);
    if (!std::isfinite(x) && !e.nan) e.nan = true, e.at = i;
    const double d = std::abs(x - ref[i]);
    if (!e.nan && d > e.max_err) e.at = i;
    e.max_err = std::max(e.max_err, d);
    e.max_ref = std::max(e.max_ref, std::abs(ref[i]));
  }
  if (e.nan) e.max_err = INFINITY;
  return e;
}

// The kernel paths: name, the environment variable that selects it (none: the default) and its
// value, and the head dims it applies to (elsewhere it would rerun the default).
struct KernelPath {
  const char* name;
  const char* env;
  const char* value;
  int min_dim, max_dim;
};
constexpr KernelPath kPaths[] = {{"default", nullptr, nullptr, 0, 512},
                                 {"sm80", "DUALKV_FORCE_SM80", "1", 0, 512},
                                 {"sm90-nopp", "DUALKV_SM90_PINGPONG", "0", 0, 512},
                                 {"sm90-sepdq", "DUALKV_FUSED_DQ", "0", 0, 128},
                                 {"sm90-d512-sm80", "DUALKV_SM90_D512_BWD", "0", 512, 512},
                                 {"key-chunk0", "DUALKV_BWD_KEY_ORDER", "0", 64, 64},
                                 {"key-chunk16", "DUALKV_BWD_KEY_ORDER", "1", 64, 128},
                                 {"key-chunk32", "DUALKV_BWD_KEY_ORDER", "2", 0, 512},
                                 {"key-chunk64", "DUALKV_BWD_KEY_ORDER", "3", 64, 128},
                                 {"sm80-d512-small", "DUALKV_SM80_SMALL_SMEM", "1", 512, 512},
                                 {"sm80-d256-small", "DUALKV_SM80_SMALL_SMEM", "1", 256, 256},
                                 {"d64-fwd192", "DUALKV_SM90_D64_TILES", "1", 64, 64},
                                 {"d64-bwd128", "DUALKV_SM90_D64_TILES", "2", 64, 64},
                                 {"d64-tiles", "DUALKV_SM90_D64_TILES", "3", 64, 64}};
// --path: run these only (a comma-separated list of names; empty: every path).
std::vector<std::string> g_only_paths;
bool path_listed(const char* name) {
  return std::find(g_only_paths.begin(), g_only_paths.end(), name) != g_only_paths.end();
}

bool path_selected(const KernelPath& k, int head_dim) {
  return (g_only_paths.empty() || path_listed(k.name)) && k.min_dim <= head_dim &&
         head_dim <= k.max_dim;
}

void select_path(const KernelPath& k) {
  for (const KernelPath& o : kPaths)
    if (o.env) unsetenv(o.env);
  if (k.env) setenv(k.env, k.value, 1);
}

int g_failures = 0;
int g_checks = 0;

bool judge(const std::string& what, const Err& gpu, const Err& plain, double factor, double slack) {
  ++g_checks;
  const double bound = factor * plain.max_err + slack;
  const bool ok = !gpu.nan && gpu.max_err <= bound;
  const double ratio =
      plain.max_err > 0 ? gpu.max_err / plain.max_err : (gpu.max_err > 0 ? INFINITY : 0);
  std::printf("    %-5s gpu_err %.3e plain_err %.3e ratio %5.2f bound %.3e max|ref| %.3e %s\n",
              what.c_str(), gpu.max_err, plain.max_err, ratio, bound, gpu.max_ref,
              ok ? "ok" : "FAIL");
  if (!ok) ++g_failures;
  return ok;
}
void expect(bool cond, const std::string& what) {
  ++g_checks;
  if (!cond) {
    ++g_failures;
    std::printf("    FAIL: %s\n", what.c_str());
  }
}

// Host-side inputs of one case (16-bit bits, strided like a real model's q and fused kv).
struct Inputs {
  int T, Hq, Hkv, D;
  int64_t q_tok, kv_tok;  // q: [T][Hq][D] + pad; kv: [T][2][Hkv][D]
  std::vector<uint16_t> q, kv, dout;
  std::vector<float> dlse;
};

Inputs make_inputs(const Case& c, int T, std::mt19937_64& rng) {
  Inputs in;
  in.T = T, in.Hq = c.Hq, in.Hkv = c.Hkv, in.D = c.D;
  in.q_tok = int64_t(c.Hq) * c.D + 8;
  in.kv_tok = int64_t(2) * c.Hkv * c.D;
  std::normal_distribution<float> nd(0.f, 1.f);
  in.q.resize(size_t(T) * in.q_tok);
  in.kv.resize(size_t(T) * in.kv_tok);
  in.dout.resize(size_t(T) * c.Hq * c.D);
  for (auto& x : in.q) x = from_f(c.mag * nd(rng), c.dt);
  for (auto& x : in.kv) x = from_f(c.mag * nd(rng), c.dt);
  for (auto& x : in.dout) x = from_f(nd(rng), c.dt);
  if (c.dlse) {
    in.dlse.resize(size_t(T) * c.Hq);
    for (auto& x : in.dlse) x = nd(rng);
  }
  return in;
}

ScoreParams score_of(const Case& c) {
  ScoreParams s;
  s.softmax_scale = float(1.0 / std::sqrt(double(c.D)));
  s.softcap = c.softcap;
  s.mask.window = c.window;
  return s;
}

// ---- host runs: the reference and the baseline ------------------------------------------------
struct HostOut {
  std::vector<double> out, lse, dq, dk, dv;  // as doubles, contiguous
};

// The reference: the CPU backend run in float64 on the same (rounded) inputs.
HostOut run_reference(const Case& c, const Inputs& in, const Tables& tb) {
  const int T = in.T;
  const size_t nq = size_t(T) * c.Hq * c.D, nk = size_t(T) * c.Hkv * c.D, nl = size_t(T) * c.Hq;
  Shape shape{T, c.Hq, c.Hkv, c.D};
  HostOut r;
  std::vector<double> q(in.q.size()), kv(in.kv.size()), dout(in.dout.size());
  for (size_t i = 0; i < q.size(); ++i) q[i] = to_f(in.q[i], c.dt);
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = to_f(in.kv[i], c.dt);
  for (size_t i = 0; i < dout.size(); ++i) dout[i] = to_f(in.dout[i], c.dt);
  std::vector<double> dlse(in.dlse.begin(), in.dlse.end());
  r.out.resize(nq), r.lse.assign(nl, NAN), r.dq.resize(nq), r.dk.resize(nk), r.dv.resize(nk);
  ForwardArgs f;
  f.dtype = DType::kFloat64;
  f.shape = shape;
  f.score = score_of(c);
  f.layout = tb.host_view(T);
  f.q_stride = {in.q_tok, c.D};
  f.k_stride = {in.kv_tok, c.D};
  f.v_stride = {in.kv_tok, c.D};
  f.q = q.data(), f.k = kv.data(), f.v = kv.data() + size_t(c.Hkv) * c.D;
  f.out = r.out.data();
  // The fp64 lse goes to lse64; lse (fp32) is passed too, for CPU versions that want it.
  std::vector<float> lse32(nl, NAN);
  f.lse = lse32.data();
  f.lse64 = r.lse.data();
  cpu::attention_forward(f);
  if (nl && std::isnan(r.lse[0]) && !std::isnan(lse32[0])) r.lse.assign(lse32.begin(), lse32.end());
  BackwardArgs b;
  b.dtype = f.dtype, b.shape = shape, b.score = f.score, b.layout = f.layout;
  b.q_stride = f.q_stride, b.k_stride = f.k_stride, b.v_stride = f.v_stride;
  b.q = f.q, b.k = f.k, b.v = f.v;
  b.out = r.out.data();
  b.dout = dout.data();
  b.lse = lse32.data();
  b.lse64 = r.lse.data();
  b.dlse = c.dlse ? in.dlse.data() : nullptr;
  b.dlse64 = c.dlse ? dlse.data() : nullptr;
  b.dq = r.dq.data(), b.dk = r.dk.data(), b.dv = r.dv.data();
  cpu::attention_backward(b);
  return r;
}

// DESIGN.md's baseline: a plain implementation run in the 16-bit dtype, as PyTorch runs
// python/dualkv/reference.py (what the Python tests compare with). Each segment is its row's
// queries on their own (its ancestors' tokens root first, then its own: [prompt] or
// [prompt | response] in the depth-two layout); every product, scale, softcap step
// and softmax rounds its result to the dtype (fp32 inside), and so does every step of autograd's
// backward; per-head key gradients are summed over the GQA group, then added into the shared
// prompt's gradients row by row, each add rounded.
HostOut run_plain(const Case& c, const Inputs& in, const Tables& tb) {
  const int D = c.D, Hq = c.Hq, Hkv = c.Hkv, T = in.T, G = Hq / Hkv;
  const ScoreParams sp = score_of(c);
  const float scale = sp.softmax_scale, cap = c.softcap;
  auto rd = [&](float x) { return to_f(from_f(x, c.dt), c.dt); };
  // Inputs widened once: q/dout [T][Hq][D], k/v [T][Hkv][D].
  std::vector<float> q(size_t(T) * Hq * D), dout(q.size()), k(size_t(T) * Hkv * D), v(k.size());
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < Hq * D; ++i) {
      q[size_t(t) * Hq * D + i] = to_f(in.q[size_t(t) * in.q_tok + i], c.dt);
      dout[size_t(t) * Hq * D + i] = to_f(in.dout[size_t(t) * Hq * D + i], c.dt);
    }
    for (int i = 0; i < Hkv * D; ++i) {
      k[size_t(t) * Hkv * D + i] = to_f(in.kv[size_t(t) * in.kv_tok + i], c.dt);
      v[size_t(t) * Hkv * D + i] = to_f(in.kv[size_t(t) * in.kv_tok + Hkv * D + i], c.dt);
    }
  }
  auto dot = [&](const float* a, const float* b) {
    float s = 0.f;
    for (int d = 0; d < D; ++d) s += a[d] * b[d];
    return s;
  };
  const size_t nq = size_t(T) * Hq * D, nk = size_t(T) * Hkv * D;
  HostOut r;
  r.out.assign(nq, 0.0), r.dq.assign(nq, 0.0), r.lse.assign(size_t(T) * Hq, -INFINITY);
  const int nseg = int(tb.seg.size());
  // Per segment: its row's key tokens and positions (every ancestor's tokens, root first, then its
  // own), and their gradients per q head (rounded per head), then per kv head (rounded per row).
  std::vector<std::vector<int>> keys(nseg), kpos(nseg);
  std::vector<std::vector<float>> dkh(nseg), dvh(nseg), dk_row(nseg), dv_row(nseg);
  for (int si = 0; si < nseg; ++si) {
    std::vector<int> row;  // the segments of the row, own first
    for (int a = si; a >= 0; a = tb.seg[a].parent) row.push_back(a);
    for (auto a = row.rbegin(); a != row.rend(); ++a) {
      const Segment& s = tb.seg[*a];
      for (int j = 0; j < s.len; ++j)
        keys[si].push_back(s.start + j), kpos[si].push_back(s.pos0 + j);
    }
    dkh[si].resize(keys[si].size() * Hq * D), dvh[si].resize(keys[si].size() * Hq * D);
  }
  const MaskRule rule = sp.mask;
  // One task per (segment, q head): its queries' out, lse and dq, and the head's key gradients.
#pragma omp parallel for schedule(dynamic, 1)
  for (int task = 0; task < nseg * Hq; ++task) {
    const int si = task / Hq, h = task % Hq, kh = h / G;
    const Segment& s = tb.seg[si];
    const std::vector<int>& kt = keys[si];
    const std::vector<int>& kp = kpos[si];
    const int Lq = s.len, Lk = int(kt.size());
    std::vector<float> p(size_t(Lq) * Lk), g(size_t(Lq) * Lk), th(size_t(Lq) * Lk), y(Lk);
    std::vector<float> acc(D), acc2(D);
    for (int i = 0; i < Lq; ++i) {
      const int tq = s.start + i, pq = s.pos0 + i;
      float* pi = &p[size_t(i) * Lk];
      float* ti = &th[size_t(i) * Lk];
      const float* qi = &q[(size_t(tq) * Hq + h) * D];
      const float* oi = &dout[(size_t(tq) * Hq + h) * D];
      // Forward: y = softcap(round(round(q.k) * scale)), P = round(softmax(y)), out = P V.
      float m = -INFINITY;
      for (int j = 0; j < Lk; ++j) {
        y[j] = -INFINITY;
        if (!rule.allowed(pq, kp[j])) continue;
        y[j] = rd(rd(dot(qi, &k[(size_t(kt[j]) * Hkv + kh) * D])) * scale);
        if (cap > 0) ti[j] = rd(std::tanh(rd(y[j] / cap))), y[j] = rd(cap * ti[j]);
        m = std::max(m, y[j]);
      }
      float sum = 0.f;
      for (int j = 0; j < Lk; ++j) sum += std::exp(y[j] - m);
      const float lse = m + std::log(sum);
      r.lse[size_t(h) * T + tq] = lse;
      for (int j = 0; j < Lk; ++j) pi[j] = rd(std::exp(y[j] - m) / sum);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int j = 0; j < Lk; ++j)
        for (int d = 0; d < D; ++d) acc[d] += pi[j] * v[(size_t(kt[j]) * Hkv + kh) * D + d];
      for (int d = 0; d < D; ++d) r.out[(size_t(tq) * Hq + h) * D + d] = rd(acc[d]);
      // Backward: dP = round(dO V^T); softmax backward; + the lse gradient; softcap; scale.
      float* gi = &g[size_t(i) * Lk];
      float pdp = 0.f;
      for (int j = 0; j < Lk; ++j) {
        gi[j] = pi[j] == 0.f ? 0.f : rd(dot(oi, &v[(size_t(kt[j]) * Hkv + kh) * D]));
        pdp += pi[j] * gi[j];
      }
      const float dl = c.dlse ? in.dlse[size_t(h) * T + tq] : 0.f;
      for (int j = 0; j < Lk; ++j) {
        if (y[j] == -INFINITY) {
          gi[j] = 0.f;
          continue;
        }
        float gy = rd(pi[j] * (gi[j] - pdp));
        if (c.dlse) gy = rd(gy + rd(dl * std::exp(y[j] - lse)));
        if (cap > 0) gy = rd(rd(rd(gy * cap) * (1.f - ti[j] * ti[j])) / cap);
        gi[j] = rd(gy * scale);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int j = 0; j < Lk; ++j)
        for (int d = 0; d < D; ++d) acc[d] += gi[j] * k[(size_t(kt[j]) * Hkv + kh) * D + d];
      for (int d = 0; d < D; ++d) r.dq[(size_t(tq) * Hq + h) * D + d] = rd(acc[d]);
    }
    // This head's key gradients over the row: dK = round(dS^T Q), dV = round(P^T dO).
    for (int j = 0; j < Lk; ++j) {
      std::fill(acc.begin(), acc.end(), 0.f), std::fill(acc2.begin(), acc2.end(), 0.f);
      for (int i = 0; i < Lq; ++i) {
        const float gij = g[size_t(i) * Lk + j], pij = p[size_t(i) * Lk + j];
        const size_t row = (size_t(s.start + i) * Hq + h) * D;
        for (int d = 0; d < D; ++d) acc[d] += gij * q[row + d], acc2[d] += pij * dout[row + d];
      }
      float* dkj = &dkh[si][(size_t(j) * Hq + h) * D];
      float* dvj = &dvh[si][(size_t(j) * Hq + h) * D];
      for (int d = 0; d < D; ++d) dkj[d] = rd(acc[d]), dvj[d] = rd(acc2[d]);
    }
  }
  // repeat_interleave's backward: the GQA group's heads summed, one rounding.
#pragma omp parallel for schedule(dynamic, 1)
  for (int si = 0; si < nseg; ++si) {
    const size_t Lk = keys[si].size();
    dk_row[si].assign(Lk * Hkv * D, 0.f), dv_row[si].assign(Lk * Hkv * D, 0.f);
    for (size_t j = 0; j < Lk; ++j)
      for (int kh = 0; kh < Hkv; ++kh)
        for (int d = 0; d < D; ++d) {
          float a = 0.f, b = 0.f;
          for (int h = kh * G; h < (kh + 1) * G; ++h)
            a += dkh[si][(j * Hq + h) * D + d], b += dvh[si][(j * Hq + h) * D + d];
          dk_row[si][(j * Hkv + kh) * D + d] = rd(a);
          dv_row[si][(j * Hkv + kh) * D + d] = rd(b);
        }
  }
  // Rows add into the shared gradients in row order, each add rounded.
  std::vector<float> dk(nk, 0.f), dv(nk, 0.f);
  for (int si = 0; si < nseg; ++si)
    for (size_t j = 0; j < keys[si].size(); ++j)
      for (int i = 0; i < Hkv * D; ++i) {
        const size_t at = size_t(keys[si][j]) * Hkv * D + i;
        dk[at] = rd(dk[at] + dk_row[si][j * Hkv * D + i]);
        dv[at] = rd(dv[at] + dv_row[si][j * Hkv * D + i]);
      }
  r.dk.assign(dk.begin(), dk.end()), r.dv.assign(dv.begin(), dv.end());
  return r;
}

// ---- GPU runs -----------------------------------------------------------------------------------
// ws grown to what a backward call with b needs under the switches set now (a path's switches
// change it: the fused dQ's accumulator).
void grow_workspace(DevBuf& ws, const BackwardArgs& b) {
  const size_t need = cuda::backward_workspace_bytes(b.shape, b.deterministic);
  if (ws.bytes < need) ws = DevBuf(need);
}

struct GpuCase {
  const Case& c;
  const Inputs& in;
  const Tables& tb;
  int T;
  size_t nq, nk, nl;
  DevBuf q, kv, dout, dlse, out, lse, dq, dk, dv, ws;
  GpuCase(const Case& c_, const Inputs& in_, const Tables& tb_)
      : c(c_), in(in_), tb(tb_), T(in_.T) {
    nq = size_t(T) * c.Hq * c.D, nk = size_t(T) * c.Hkv * c.D, nl = size_t(T) * c.Hq;
    q = upload(in.q), kv = upload(in.kv), dout = upload(in.dout);
    if (c.dlse) dlse = upload(in.dlse);
    out = DevBuf(nq * 2), lse = DevBuf(nl * 4), dq = DevBuf(nq * 2), dk = DevBuf(nk * 2),
    dv = DevBuf(nk * 2);
    ws = DevBuf(cuda::backward_workspace_bytes(Shape{T, c.Hq, c.Hkv, c.D}));
  }
  ForwardArgs fargs() const {
    ForwardArgs f;
    f.dtype = c.dt;
    f.shape = {T, c.Hq, c.Hkv, c.D};
    f.score = score_of(c);
    f.layout = tb.dev_view(T);
    f.q = q.p, f.k = kv.p, f.v = kv.as<uint16_t>() + size_t(c.Hkv) * c.D;
    f.q_stride = {in.q_tok, c.D};
    f.k_stride = {in.kv_tok, c.D};
    f.v_stride = {in.kv_tok, c.D};
    f.out = out.p;
    f.lse = lse.as<float>();
    return f;
  }
  BackwardArgs bargs(bool det) const {
    const ForwardArgs f = fargs();
    BackwardArgs b;
    b.dtype = f.dtype, b.shape = f.shape, b.score = f.score, b.layout = f.layout;
    b.q = f.q, b.k = f.k, b.v = f.v;
    b.q_stride = f.q_stride, b.k_stride = f.k_stride, b.v_stride = f.v_stride;
    b.out = out.p, b.dout = dout.p, b.lse = lse.as<float>();
    b.dlse = c.dlse ? dlse.as<float>() : nullptr;
    b.dq = dq.p, b.dk = dk.p, b.dv = dv.p;
    b.deterministic = det;
    return b;
  }
  void forward(bool poison) {
    if (poison) {
      CK(cudaMemset(out.p, 0xFF, nq * 2));
      CK(cudaMemset(lse.p, 0xFF, nl * 4));
    }
    cuda::attention_forward(fargs(), nullptr);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
  }
  void backward(bool det, bool poison) {
    if (poison) {
      CK(cudaMemset(dq.p, 0xFF, nq * 2));
      CK(cudaMemset(dk.p, 0xFF, nk * 2));
      CK(cudaMemset(dv.p, 0xFF, nk * 2));
      CK(cudaMemset(ws.p, 0xFF, ws.bytes));
    }
    grow_workspace(ws, bargs(det));
    cuda::attention_backward(bargs(det), ws.p, ws.bytes, nullptr);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
  }
  // A workspace one byte short of what the call needs is refused before any launch.
  bool short_workspace_refused() {
    const BackwardArgs b = bargs(false);
    grow_workspace(ws, b);
    try {
      cuda::attention_backward(b, ws.p, cuda::backward_workspace_bytes(b.shape, false) - 1,
                               nullptr);
    } catch (const Error& e) {
      std::printf("expected error: %s\n", e.what());
      return true;
    }
    return false;
  }
};

std::string describe(const Case& c, int T) {
  std::string s = c.name + " [T=" + std::to_string(T) + " Hq=" + std::to_string(c.Hq) +
                  " Hkv=" + std::to_string(c.Hkv) + " D=" + std::to_string(c.D) + " " +
                  dtype_name(c.dt);
  if (c.window != kNoWindow) s += " w=" + std::to_string(c.window);
  if (c.softcap > 0) s += " cap=" + std::to_string(int(c.softcap));
  if (c.dlse) s += " dlse";
  if (c.mag != 1.f) s += " mag=" + std::to_string(int(c.mag));
  if (!c.lengths.empty()) {
    s += " forest (parent:length):";
    for (size_t i = 0; i < c.lengths.size(); ++i)
      s += " " + std::to_string(c.parents[i]) + ":" + std::to_string(c.lengths[i]);
    return s + "]";
  }
  s += " groups:";
  for (size_t g = 0; g < c.P.size(); ++g) {
    s += " (P" + std::to_string(c.P[g]) + " R";
    for (size_t i = 0; i < c.R[g].size(); ++i) s += (i ? "," : "") + std::to_string(c.R[g][i]);
    s += ")";
  }
  return s + "]";
}

// After a failed check of a [T, heads, D] tensor: where its largest error is (token, its
// segment, head, column) and the three values there, to tell a layout edge from rounding.
void explain(const Case& c, const Tables& tb, int heads, const Err& e,
             const std::vector<uint16_t>& gpu, const std::vector<double>& ref,
             const std::vector<double>& plain) {
  const size_t i = e.at;
  const int64_t tok = int64_t(i / (size_t(heads) * c.D));
  const int head = int(i / c.D % heads), col = int(i % c.D);
  std::string seg = "?";
  for (size_t si = 0; si < tb.seg.size(); ++si) {
    const Segment& sg = tb.seg[si];
    if (tok >= sg.start && tok < sg.start + sg.len) {
      seg = "tree " + std::to_string(sg.group) + " segment " + std::to_string(si) + " (depth " +
            std::to_string(sg.depth) + ", parent " + std::to_string(sg.parent) + ") position " +
            std::to_string(sg.pos0 + (tok - sg.start)) + " of " + std::to_string(sg.pos0 + sg.len);
    }
  }
  std::printf("      worst at token %lld (%s), head %d, col %d: gpu %.6g ref %.6g plain %.6g\n",
              (long long)tok, seg.c_str(), head, col, double(to_f(gpu[i], c.dt)), ref[i], plain[i]);
}

void run_case(const Case& c, std::mt19937_64& rng) {
  const Layout L = layout_of(c);
  const int T = L.total_tokens();
  std::printf("%s\n", describe(c, T).c_str());
  if (!cuda::supports(c.dt, c.D)) {
    std::printf("    skipped: not built for this head dim\n");
    return;
  }
  if (std::none_of(std::begin(kPaths), std::end(kPaths),
                   [&](const KernelPath& k) { return path_selected(k, c.D); })) {
    std::printf("    skipped: no --path selected runs head dim %d\n", c.D);
    return;
  }
  const Tables tb = make_tables(L);
  const Inputs in = make_inputs(c, T, rng);
  const HostOut ref = run_reference(c, in, tb);
  const HostOut plain = run_plain(c, in, tb);
  GpuCase g(c, in, tb);
  static bool short_workspace_checked = false;
  if (!std::exchange(short_workspace_checked, true))
    expect(g.short_workspace_refused(), "a backward workspace one byte short must be refused");
  for (int path = 0; path < int(std::size(kPaths)); ++path) {
    if (!path_selected(kPaths[path], c.D)) continue;
    select_path(kPaths[path]);
    std::printf("  path %s\n", kPaths[path].name);
    g.forward(true);
    const auto out = download<uint16_t>(g.out, g.nq);
    const auto lse = download<float>(g.lse, g.nl);
    const double eps = dtype_eps(c.dt);
    auto err16 = [&](const std::vector<uint16_t>& v, const std::vector<double>& r) {
      return max_error(v.size(), r, [&](size_t i) { return double(to_f(v[i], c.dt)); });
    };
    auto errd = [&](const std::vector<double>& v, const std::vector<double>& r) {
      return max_error(v.size(), r, [&](size_t i) { return v[i]; });
    };
    {
      const Err ge = err16(out, ref.out), ce = errd(plain.out, ref.out);
      if (!judge("out", ge, ce, 2.0, eps / 16 * ge.max_ref))
        explain(c, tb, c.Hq, ge, out, ref.out, plain.out);
      const Err gl = max_error(lse.size(), ref.lse, [&](size_t i) { return double(lse[i]); });
      const Err cl = errd(plain.lse, ref.lse);
      // lse is fp32; the GPU's exp2 is approximate (2^-22 relative): slack 1e-5 * (1 + max|lse|).
      judge("lse", gl, cl, 2.0, 1e-5 * (1 + gl.max_ref));
    }
    std::vector<uint16_t> dq0, dk0, dv0;
    // Modes: 0 default, 1 deterministic.
    for (int det = 0; det < 2; ++det) {
      g.backward(det == 1, true);
      const auto dq = download<uint16_t>(g.dq, g.nq);
      const auto dk = download<uint16_t>(g.dk, g.nk);
      const auto dv = download<uint16_t>(g.dv, g.nk);
      std::printf("   backward (%s)\n", det == 1 ? "deterministic" : "default");
      const Err a = err16(dq, ref.dq), b = err16(dk, ref.dk), d = err16(dv, ref.dv);
      // Slack: eps/16 of the largest magnitude, and at least 1e-5 (fp32 rounding of O(1) sums:
      // with window 1, dS = P (dO.v - dO.o) is exactly 0 in the reference; the GPU's two fp32 dot
      // products of equal vectors in different orders leave ~1e-6).
      if (!judge("dq", a, errd(plain.dq, ref.dq), 3.0, std::max(1e-5, eps / 16 * a.max_ref)))
        explain(c, tb, c.Hq, a, dq, ref.dq, plain.dq);
      if (!judge("dk", b, errd(plain.dk, ref.dk), 3.0, std::max(1e-5, eps / 16 * b.max_ref)))
        explain(c, tb, c.Hkv, b, dk, ref.dk, plain.dk);
      if (!judge("dv", d, errd(plain.dv, ref.dv), 3.0, std::max(1e-5, eps / 16 * d.max_ref)))
        explain(c, tb, c.Hkv, d, dv, ref.dv, plain.dv);
      if (det == 1) {
        // Bitwise reproducible (dk/dv: the fused-dQ kernel may sum them in another order).
        g.backward(true, true);
        expect(download<uint16_t>(g.dq, g.nq) == dq, "deterministic dq differs between two runs");
        expect(download<uint16_t>(g.dk, g.nk) == dk && download<uint16_t>(g.dv, g.nk) == dv,
               "deterministic dk/dv differ between two runs");
        if (!(dk == dk0 && dv == dv0))
          std::printf("    note: dk/dv of the default and deterministic modes differ bitwise\n");
      } else {
        dq0 = dq, dk0 = dk, dv0 = dv;
      }
    }
  }
  select_path(kPaths[0]);
}

// Repeats the whole forward + backward `reps` times: out, lse, dk, dv (and dq in deterministic
// mode) must be bitwise equal every time. Case `tree`: a prefix-tree layout (depth 3, not
// depth-first), else the depth-two one.
void race_test(int reps, bool tree, std::mt19937_64& rng) {
  Case c;
  c.name = tree ? "race-tree" : "race";
  if (tree) {
    c.parents = {-1, 0, 0, 1, 1, -1, 5, 2, 3};
    c.lengths = {700, 129, 1, 300, 0, 90, 257, 64, 33};
  } else {
    c.P = {700, 129, 0};
    c.R = {{300, 1, 64, 0, 257}, {128, 127}, {90, 33}};
  }
  c.Hq = 8, c.Hkv = 2, c.D = 128;
  if (!cuda::supports(c.dt, c.D)) c.D = 64;
  if (!cuda::supports(c.dt, c.D)) c.D = 256;
  if (!cuda::supports(c.dt, c.D)) c.D = 512;
  // --path naming only head-dim-256 or only head-dim-512 paths: race those (at D = 128 they
  // would not run).
  for (const int d : {256, 512}) {
    const bool only = !g_only_paths.empty() &&
                      std::all_of(std::begin(kPaths), std::end(kPaths), [&](const auto& k) {
                        return !path_listed(k.name) || k.min_dim == d;
                      });
    if (only && cuda::supports(c.dt, d)) c.D = d;
  }
  const Layout L = layout_of(c);
  const Tables tb = make_tables(L);
  const Inputs in = make_inputs(c, L.total_tokens(), rng);
  GpuCase g(c, in, tb);
  std::printf("%s x %d repeats\n", describe(c, L.total_tokens()).c_str(), reps);
  std::vector<uint16_t> out0, dk0, dv0, dq0;
  std::vector<float> lse0;
  int bad = 0;
  // Each full (forward + backward) kernel path, default and deterministic mode.
  for (int mode = 0; mode < 2 * int(std::size(kPaths)); ++mode) {
    const int det = mode & 1;
    if (!path_selected(kPaths[mode / 2], c.D)) continue;
    select_path(kPaths[mode / 2]);
    for (int r = 0; r < reps; ++r) {
      g.forward(r == 0);
      g.backward(det, r == 0);
      auto out = download<uint16_t>(g.out, g.nq);
      auto lse = download<float>(g.lse, g.nl);
      auto dk = download<uint16_t>(g.dk, g.nk), dv = download<uint16_t>(g.dv, g.nk);
      auto dq = download<uint16_t>(g.dq, g.nq);
      if (r == 0) {
        // Each mode against its own first run (the fused-dQ kernel's dk/dv need not equal the
        // deterministic one's bitwise).
        out0 = out, lse0 = lse, dk0 = dk, dv0 = dv, dq0 = dq;
      } else {
        if (out != out0 || std::memcmp(lse.data(), lse0.data(), lse.size() * 4) != 0) ++bad;
        if (dk != dk0 || dv != dv0) ++bad;
        if (det && dq != dq0) ++bad;
      }
    }
  }
  select_path(kPaths[0]);
  expect(bad == 0, "race test: " + std::to_string(bad) + " mismatching repeats");
  std::printf("    %s\n", bad == 0 ? "ok: bitwise equal" : "FAIL");
}

// Random layouts (1-3 groups, P and R drawn with 0 and 1 likely) at the GQA ratios 1:1, 4:1, 8:1
// and MQA, over the head dims and dtypes, window and softcap on some: fresh every call.
std::vector<Case> random_cases(std::mt19937_64& rng) {
  const int dims[4] = {64, 128, 256, 512};
  const DType dts[2] = {DType::kBFloat16, DType::kFloat16};
  std::uniform_int_distribution<int> len(2, 300), nresp(0, 4);
  auto rand_layout = [&](Case& c, int groups) {
    c.P.clear(), c.R.clear();
    for (int g = 0; g < groups; ++g) {
      const int pick = int(rng() % 6);
      c.P.push_back(pick == 0 ? 0 : pick == 1 ? 1 : len(rng));
      std::vector<int64_t> r;
      const int n = nresp(rng);
      for (int i = 0; i < n; ++i) {
        const int k = int(rng() % 6);
        r.push_back(k == 0 ? 0 : k == 1 ? 1 : len(rng));
      }
      c.R.push_back(r);
    }
  };
  std::vector<Case> cs;
  const int gqa[4][2] = {{4, 4}, {8, 2}, {8, 1}, {16, 1}};
  for (int i = 0; i < 4; ++i) {
    Case c;
    c.name = "gqa-random";
    c.Hq = gqa[i][0], c.Hkv = gqa[i][1];
    c.D = dims[i % 4];
    c.dt = dts[i % 2];
    rand_layout(c, 1 + int(rng() % 3));
    if (i == 2) c.window = 1 + int(rng() % 200);
    if (i == 3) c.softcap = 30.f, c.dlse = true;
    cs.push_back(c);
  }
  return cs;
}

// A random forest for Layout::tree: 1-3 trees, the first with a chain down to depth max_depth,
// then fan-outs of 1-8 children under random segments, at most max_segments in all; lengths
// often 0 or 1, else short or crossing the 64-key blocks and 128-token tiles; listed in
// depth-first, breadth-first or a random order (parents always first).
void rand_forest(Case& c, std::mt19937_64& rng, int max_depth, int max_segments) {
  std::vector<int> par, depth;  // in the order made
  auto add = [&](int p) {
    par.push_back(p);
    depth.push_back(p < 0 ? 0 : depth[size_t(p)] + 1);
  };
  const int trees = 1 + int(rng() % 3);
  for (int t = 0; t < trees; ++t) add(-1);
  for (int d = 0; d < max_depth; ++d) add(d == 0 ? 0 : int(par.size()) - 1);
  for (int tries = 0; tries < 8 && int(par.size()) < max_segments; ++tries) {
    const int p = int(rng() % par.size());
    if (depth[size_t(p)] >= max_depth) continue;
    const int n = std::min(1 + int(rng() % 8), max_segments - int(par.size()));
    for (int i = 0; i < n; ++i) add(p);
  }
  const int n = int(par.size());
  std::vector<std::vector<int>> kids(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i)
    if (par[size_t(i)] >= 0) kids[size_t(par[size_t(i)])].push_back(i);
  // The listing order: 0 depth-first, 1 breadth-first, 2 any segment whose parent is listed.
  const int how = int(rng() % 3);
  std::vector<int> order, open;
  for (int i = 0; i < n; ++i)
    if (par[size_t(i)] < 0) open.push_back(i);
  std::reverse(open.begin(), open.end());
  while (!open.empty()) {
    size_t at = how == 0 ? open.size() - 1 : how == 1 ? 0 : size_t(rng() % open.size());
    const int i = open[at];
    open.erase(open.begin() + std::ptrdiff_t(at));
    order.push_back(i);
    const auto& k = kids[size_t(i)];
    if (how == 0)
      open.insert(open.end(), k.rbegin(), k.rend());
    else
      open.insert(open.end(), k.begin(), k.end());
  }
  std::vector<int> index(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) index[size_t(order[size_t(i)])] = i;
  std::uniform_int_distribution<int> short_len(2, 48), long_len(100, 220);
  c.parents.assign(size_t(n), -1), c.lengths.assign(size_t(n), 0);
  for (int i = 0; i < n; ++i) {
    const int o = order[size_t(i)];
    c.parents[size_t(i)] = par[size_t(o)] < 0 ? -1 : index[size_t(par[size_t(o)])];
    const int k = int(rng() % 8);
    c.lengths[size_t(i)] = k == 0 ? 0 : k == 1 ? 1 : k < 5 ? short_len(rng) : long_len(rng);
  }
}

// Random forests (rand_forest, depth 1-5) over every (head dim, dtype) pair, at the GQA ratios
// 1:1, 4:1, 8:1 and MQA; window (crossing segment ends) or softcap with dlse on some: fresh every
// call.
std::vector<Case> random_tree_cases(std::mt19937_64& rng) {
  const int dims[4] = {64, 128, 256, 512};
  const DType dts[2] = {DType::kBFloat16, DType::kFloat16};
  const int gqa[4][2] = {{4, 4}, {8, 2}, {8, 1}, {16, 1}};
  std::vector<Case> cs;
  for (int i = 0; i < 8; ++i) {
    Case c;
    c.name = "tree-random";
    c.D = dims[i % 4];
    c.dt = dts[(i + i / 4) % 2];
    c.Hq = gqa[(i + i / 4) % 4][0], c.Hkv = gqa[(i + i / 4) % 4][1];
    if (c.D == 512) c.Hq = std::min(c.Hq, 8);  // the CPU reference's time
    rand_forest(c, rng, 1 + int(rng() % 5), 24);
    if (i % 3 == 1) c.window = 1 + int(rng() % 300);
    if (i % 3 == 2) c.softcap = 30.f, c.dlse = true;
    cs.push_back(c);
  }
  return cs;
}

std::vector<Case> case_matrix(std::mt19937_64& rng, bool quick) {
  std::vector<Case> cs;
  auto add = [&](Case c) { cs.push_back(c); };
  const int dims[4] = {64, 128, 256, 512};
  const DType dts[2] = {DType::kBFloat16, DType::kFloat16};
  // Fixed shapes: single groups, edge lengths, GQA ratios, per head dim and dtype.
  for (int D : dims) {
    for (DType dt : dts) {
      Case c;
      c.D = D, c.dt = dt;
      c.name = "basic";
      c.P = {300};
      c.R = {{200, 129, 1, 0}};
      c.Hq = 4, c.Hkv = 1;
      add(c);
      // A forest listed out of depth-first order: an empty inner segment (its child hangs from
      // the root), one-token segments, tile-crossing lengths, depth 3, a second tree.
      Case t = c;
      t.name = "tree";
      t.parents = {-1, 0, 0, 1, 2, 1, 3, 4, -1, 8, 8, 5};
      t.lengths = {150, 70, 0, 129, 1, 64, 200, 33, 40, 0, 90, 1};
      t.Hq = 8, t.Hkv = 2;
      if (!quick || dt == DType::kBFloat16) add(t);  // --small (sanitizers): bf16 only
      if (quick) continue;
      // A chain down to depth 5 with MQA; the window crosses several segment ends.
      t.name = "tree-chain-window+cap";
      t.parents = {-1, 0, 1, 2, 3, 4, 0, 6};
      t.lengths = {100, 30, 1, 45, 70, 130, 200, 64};
      t.Hq = 4, t.Hkv = 1;
      t.window = 97;
      t.softcap = 20.f;
      t.dlse = true;
      add(t);
      c.name = "multigroup";
      c.P = {128, 0, 1, 257};
      c.R = {{128, 64}, {100, 5}, {1, 1, 0}, {}};
      c.Hq = 8, c.Hkv = 2;
      add(c);
      c.name = "window+cap";
      c.P = {400};
      c.R = {{150, 77}};
      c.Hq = 4, c.Hkv = 4;
      c.window = 97;
      c.softcap = 20.f;
      c.dlse = true;
      add(c);
    }
  }
  if (!quick) {
    for (Case& c : random_cases(rng)) add(c);
    for (Case& c : random_tree_cases(rng)) add(c);
    for (int D : dims) {
      Case c;
      c.name = "window=1";
      c.D = D, c.Hq = 2, c.Hkv = 1;
      c.P = {130};
      c.R = {{70, 1}};
      c.window = 1;
      add(c);
      c.name = "large-magnitude";
      c.window = kNoWindow;
      c.mag = 8.f;
      c.P = {257};
      c.R = {{129, 3}};
      add(c);
      c.name = "prompt-only";
      c.mag = 1.f;
      c.P = {1, 383};
      c.R = {{}, {}};
      add(c);
      c.name = "responses-only";
      c.P = {0};
      c.R = {{1, 200, 128}};
      add(c);
    }
  }
  return cs;
}

// ---- bench --------------------------------------------------------------------------------------
struct BenchShape {
  int N, P, R, Hq, Hkv, D;
  const char* ref;     // DESIGN.md figures
  bool multi = false;  // the realistic micro-batch (multi_group_layout) instead of N, P, R
  bool tree = false;   // the branching-rollout forest (branching_tree_layout) instead of N, P, R
};

// bench/attention.py's realistic micro-batch (`realistic_groups(seed=0)`: 4 groups, prompts 1K -
// 6K, 8-16 long-tailed responses each; T = 56,675), its lengths written out.
Layout multi_group_layout() {
  return Layout(
      {1024, 2560, 4096, 6144},
      {{235, 530, 450, 1427, 1239, 500, 99, 482, 213, 911, 877, 740, 2026, 1817, 532, 259},
       {525, 1737, 967, 1416, 316, 325, 282, 929},
       {650, 1748, 4096, 291, 543, 4096, 245, 2872, 2018},
       {564, 652, 348, 1060, 204, 790, 1084, 90, 839, 263, 423, 850, 291}});
}

// Issue 33's branching rollouts: a 4096-token prompt, 4 branches at each of 3 depths (84
// segments below the root, 512-1024 tokens each, fixed draws), listed depth-first.
Layout branching_tree_layout() {
  std::mt19937_64 rng(33);
  std::vector<int64_t> parents{-1}, lengths{4096};
  auto grow = [&](auto&& self, int64_t parent, int depth) -> void {
    for (int b = 0; b < 4; ++b) {
      const auto me = int64_t(parents.size());
      parents.push_back(parent);
      lengths.push_back(512 + int64_t(rng() % 513));
      if (depth < 3) self(self, me, depth + 1);
    }
  };
  grow(grow, 0, 1);
  return Layout::tree(parents, lengths);
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<BenchShape> g_shapes;  // --shape: bench only these

// --bench-rounds R: the paths of a shape take turns R times (path 1, path 2, ..., path 1, ...),
// each row the median of its R per-round medians, so that a drift of the GPU's clocks (the first
// path after the idle upload ran its forward ~12% faster than the same kernel in the next path)
// reaches every path alike.
void bench(int reps, int rounds) {
  const BenchShape all_shapes[] = {
      {16, 8192, 1024, 32, 8, 128, "3-pass cuDNN 21.0 ms (481 TF/s), Flex 26.5 ms"},
      {32, 4096, 2048, 32, 8, 128, "3-pass cuDNN 45.3 ms (435 TF/s), Flex 69.2 ms"},
      {8, 16384, 2048, 32, 8, 128, "3-pass cuDNN 46.3 ms (520 TF/s), Flex 74.3 ms"},
      {16, 2048, 2048, 16, 16, 64, "3-pass cuDNN 4.88 ms (302 TF/s), Flex 7.75 ms"},
      {16, 4096, 1024, 16, 8, 256, "3-pass cuDNN 14.3 ms (335 TF/s), Flex 35.3 ms"},
      // Gemma-4-31B's global layers (head dim 512, 32 q heads, 4 kv heads).
      {16, 8192, 1024, 32, 4, 512, "SDPA mem-efficient on the N rows ~2.1 s (19-23 TF/s)"},
      {8, 16384, 2048, 32, 4, 512, "SDPA mem-efficient on the N rows"},
  };
  std::vector<BenchShape> shapes = g_shapes;
  if (shapes.empty()) shapes.assign(std::begin(all_shapes), std::end(all_shapes));
  // Columns: the backward in the default mode and with deterministic=true.
  struct Row {
    std::string name;
    float fwd;
    float bwd[2];  // default, deterministic
    double ff, bf;
    const char* ref;
  };
  std::vector<Row> rows;
  for (const BenchShape& s : shapes) {
    if (!cuda::supports(DType::kBFloat16, s.D)) continue;
    const Layout L = s.multi  ? multi_group_layout()
                     : s.tree ? branching_tree_layout()
                              : Layout({s.P}, {std::vector<int64_t>(size_t(s.N), s.R)});
    const int T = L.total_tokens();
    const Tables tb = make_tables(L);
    const size_t nq = size_t(T) * s.Hq * s.D, nk = size_t(T) * s.Hkv * s.D;
    DevBuf q(nq * 2), k(nk * 2), v(nk * 2), dout(nq * 2), out(nq * 2), lse(size_t(T) * s.Hq * 4),
        dq(nq * 2), dk(nk * 2), dv(nk * 2),
        ws(cuda::backward_workspace_bytes({T, s.Hq, s.Hkv, s.D}));
    {
      // Random bf16 normals (a 16M-element block, repeated).
      std::mt19937_64 rng(123);
      std::normal_distribution<float> nd(0.f, 1.f);
      constexpr size_t kBlk = size_t(1) << 24, kShift = size_t(1) << 20;
      std::vector<uint16_t> blk(kBlk + kShift);
      for (auto& x : blk) x = cpu::float_to_bf16_bits(nd(rng));
      size_t which = 0;
      for (DevBuf* b : {&q, &k, &v, &dout}) {
        const size_t shift = (++which * 333331) % kShift;
        for (size_t off = 0; off < b->bytes; off += kBlk * 2) {
          const size_t n = std::min(kBlk * 2, b->bytes - off);
          CK(cudaMemcpy(static_cast<char*>(b->p) + off, blk.data() + shift, n,
                        cudaMemcpyHostToDevice));
        }
      }
    }
    ForwardArgs f;
    f.dtype = DType::kBFloat16;
    f.shape = {T, s.Hq, s.Hkv, s.D};
    f.score.softmax_scale = float(1.0 / std::sqrt(double(s.D)));
    f.layout = tb.dev_view(T);
    f.q = q.p, f.k = k.p, f.v = v.p;
    f.q_stride = {int64_t(s.Hq) * s.D, s.D};
    f.k_stride = f.v_stride = {int64_t(s.Hkv) * s.D, s.D};
    f.out = out.p, f.lse = lse.as<float>();
    BackwardArgs b;
    b.dtype = f.dtype, b.shape = f.shape, b.score = f.score, b.layout = f.layout;
    b.q = f.q, b.k = f.k, b.v = f.v, b.q_stride = f.q_stride, b.k_stride = f.k_stride,
    b.v_stride = f.v_stride;
    b.out = out.p, b.dout = dout.p, b.lse = lse.as<float>(), b.dq = dq.p, b.dk = dk.p, b.dv = dv.p;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    auto time = [&](auto&& fn) {
      for (int i = 0; i < 2; ++i) fn();
      std::vector<float> ts;
      for (int i = 0; i < reps; ++i) {
        CK(cudaEventRecord(e0));
        fn();
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        ts.push_back(ms);
      }
      CK(cudaGetLastError());
      return median(ts);
    };
    // Every kernel path of this head dim, in `rounds` turns.
    std::vector<const KernelPath*> paths;
    for (const KernelPath& kp : kPaths)
      if (path_selected(kp, s.D)) paths.push_back(&kp);
    std::vector<std::vector<float>> t_fwd(paths.size()), t_bwd[2];
    t_bwd[0].resize(paths.size()), t_bwd[1].resize(paths.size());
    for (int round = 0; round < rounds; ++round) {
      for (size_t i = 0; i < paths.size(); ++i) {
        select_path(*paths[i]);
        t_fwd[i].push_back(time([&] { cuda::attention_forward(f, nullptr); }));
        for (int det = 0; det < 2; ++det) {
          b.deterministic = det == 1;
          grow_workspace(ws, b);
          t_bwd[det][i].push_back(
              time([&] { cuda::attention_backward(b, ws.p, ws.bytes, nullptr); }));
        }
        b.deterministic = false;
        std::printf("bench %s (round %d): fwd %.2f ms, bwd %.2f ms, bwd deterministic %.2f ms\n",
                    paths[i]->name, round + 1, t_fwd[i].back(), t_bwd[0][i].back(),
                    t_bwd[1][i].back());
        std::fflush(stdout);
      }
    }
    for (size_t i = 0; i < paths.size(); ++i) {
      Row r;
      char name[128];
      if (s.multi || s.tree) {
        std::snprintf(name, sizeof name, "%s %s T=%d Hq=%d Hkv=%d D=%d", paths[i]->name,
                      s.multi ? "multi" : "tree", T, s.Hq, s.Hkv, s.D);
      } else {
        std::snprintf(name, sizeof name, "%s N=%d P=%d R=%d Hq=%d Hkv=%d D=%d", paths[i]->name, s.N,
                      s.P, s.R, s.Hq, s.Hkv, s.D);
      }
      r.name = name;
      r.fwd = median(t_fwd[i]);
      r.bwd[0] = median(t_bwd[0][i]), r.bwd[1] = median(t_bwd[1][i]);
      r.ff = L.forward_flops(s.D, s.Hq);
      r.bf = L.backward_flops(s.D, s.Hq);
      r.ref = s.ref;
      rows.push_back(r);
    }
    select_path(kPaths[0]);
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
  }
  // bwd ms (TF/s) and fwd+bwd ms (TF/s), default and deterministic mode.
  std::printf(
      "\n| layout | fwd ms (TF/s) | bwd | fwd+bwd | bwd deterministic | fwd+bwd deterministic "
      "| DESIGN.md fwd+bwd reference |\n|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    std::printf("| %s | %.2f (%.0f) |", r.name.c_str(), r.fwd, r.ff / r.fwd / 1e9);
    for (float t : r.bwd) {
      std::printf(" %.2f (%.0f) | %.2f (%.0f) |", t, r.bf / t / 1e9, r.fwd + t,
                  (r.ff + r.bf) / (r.fwd + t) / 1e9);
    }
    std::printf(" %s |\n", r.ref);
  }
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t seed = uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
  bool quick = false, check = true, do_bench = false;
  int race = 100, bench_reps = 10, bench_rounds = 1, random_rounds = 0, tree_rounds = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--seed" && i + 1 < argc)
      seed = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--quick")
      quick = true;
    else if (a == "--small")
      quick = true, race = 3;  // for compute-sanitizer
    else if (a == "--no-check")
      check = false;
    else if (a == "--race" && i + 1 < argc)
      race = std::atoi(argv[++i]);
    else if (a == "--bench")
      do_bench = true;
    else if (a == "--bench-reps" && i + 1 < argc)
      bench_reps = std::atoi(argv[++i]);
    else if (a == "--bench-rounds" && i + 1 < argc)
      bench_rounds = std::max(1, std::atoi(argv[++i]));
    else if (a == "--path" && i + 1 < argc)
      for (std::string rest = argv[++i]; !rest.empty();) {
        const size_t comma = rest.find(',');
        g_only_paths.push_back(rest.substr(0, comma));
        rest = comma == std::string::npos ? std::string() : rest.substr(comma + 1);
      }
    else if (a == "--random" && i + 1 < argc)
      random_rounds = std::atoi(argv[++i]);
    else if (a == "--trees" && i + 1 < argc)
      tree_rounds = std::atoi(argv[++i]);
    else if (a == "--shape" && i + 1 < argc) {
      BenchShape s{};
      const char* arg = argv[++i];
      s.multi = std::strncmp(arg, "multi,", 6) == 0;
      s.tree = std::strncmp(arg, "tree,", 5) == 0;
      const bool ok = s.multi  ? std::sscanf(arg + 6, "%d,%d,%d", &s.Hq, &s.Hkv, &s.D) == 3
                      : s.tree ? std::sscanf(arg + 5, "%d,%d,%d", &s.Hq, &s.Hkv, &s.D) == 3
                               : std::sscanf(arg, "%d,%d,%d,%d,%d,%d", &s.N, &s.P, &s.R, &s.Hq,
                                             &s.Hkv, &s.D) == 6;
      if (!ok || s.N < 0 || s.P < 0 || s.R < 0 || s.Hq <= 0 || s.Hkv <= 0 || s.Hq % s.Hkv != 0) {
        std::fprintf(stderr,
                     "--shape N,P,R,Hq,Hkv,D, multi,Hq,Hkv,D or tree,Hq,Hkv,D (Hkv divides Hq; "
                     "multi: the realistic micro-batch of bench/attention.py; tree: the "
                     "branching-rollout forest)\n");
        return 2;
      }
      s.ref = "-";
      g_shapes.push_back(s);
    } else {
      std::fprintf(stderr,
                   "usage: %s [--seed S] [--quick] [--small] [--no-check] [--race N] [--bench] "
                   "[--bench-reps N] [--bench-rounds N] [--path NAME[,NAME...]] [--random N] "
                   "[--trees N] "
                   "[--shape N,P,R,Hq,Hkv,D | multi,Hq,Hkv,D | tree,Hq,Hkv,D]...\n",
                   argv[0]);
      return 2;
    }
  }
  for (const std::string& name : g_only_paths) {
    if (std::none_of(std::begin(kPaths), std::end(kPaths),
                     [&](const KernelPath& k) { return name == k.name; })) {
      std::fprintf(stderr,
                   "unknown --path %s (default, sm80, sm90-nopp, sm90-sepdq, sm90-d512-sm80, "
                   "key-chunk0, key-chunk16, "
                   "key-chunk32, key-chunk64, sm80-d512-small, sm80-d256-small, d64-fwd192, "
                   "d64-bwd128, d64-tiles; or a "
                   "comma-separated list)\n",
                   name.c_str());
      return 2;
    }
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d, %d SMs), seed %llu\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, (unsigned long long)seed);
  std::mt19937_64 rng(seed);
  if (check) {
    // Argument errors are reported, not silently accepted.
    {
      ForwardArgs f;
      f.shape = {16, 4, 4, 96};
      bool threw = false;
      try {
        cuda::attention_forward(f, nullptr);
      } catch (const Error& e) {
        threw = true;
        std::printf("expected error: %s\n", e.what());
      }
      expect(threw && !cuda::supports(DType::kBFloat16, 96), "head_dim 96 must be rejected");
    }
    // A layout view whose tile tables are too short for T (here: none) is refused, not a
    // launch that leaves outputs unwritten (the forward returned silently before).
    for (const int d : {64, 128, 256, 512}) {
      if (!cuda::supports(DType::kBFloat16, d)) continue;
      static const int32_t dummy[64] = {};  // non-null tables, never read
      ForwardArgs f;
      f.shape = {300, 4, 4, d};
      f.layout.segments = reinterpret_cast<const Segment*>(dummy);
      f.layout.query_tiles = f.layout.key_tiles = reinterpret_cast<const Tile*>(dummy);
      f.layout.num_segments = 1;
      f.layout.num_key_tiles = 3;
      f.layout.num_query_tiles = 0;
      f.layout.total_tokens = 300;
      bool threw = false;
      try {
        cuda::attention_forward(f, nullptr);
      } catch (const Error& e) {
        threw = true;
        std::printf("expected error: %s\n", e.what());
      }
      expect(threw, "a layout with no query tiles for T > 0 must be rejected");
      break;
    }
    // --random N / --trees N: only N rounds of the random layouts / forests (a cheap hunt for
    // layout edge cases).
    const auto cases =
        random_rounds > 0 || tree_rounds > 0 ? std::vector<Case>{} : case_matrix(rng, quick);
    for (const Case& c : cases) {
      run_case(c, rng);
      std::fflush(stdout);
    }
    for (int r = 0; r < random_rounds; ++r) {
      for (const Case& c : random_cases(rng)) run_case(c, rng);
      std::fflush(stdout);
    }
    for (int r = 0; r < tree_rounds; ++r) {
      for (const Case& c : random_tree_cases(rng)) run_case(c, rng);
      std::fflush(stdout);
    }
    if (race > 0) {
      race_test(race, false, rng);
      race_test(race, true, rng);
    }
    std::printf("\ncorrectness: %d checks, %d failures\n", g_checks, g_failures);
    // The inputs are fresh every run: a failure is reproduced with the same seed and switches.
    if (g_failures > 0)
      std::printf("reproduce with: --seed %llu (and the same switches)\n",
                  (unsigned long long)seed);
  }
  if (do_bench) bench(bench_reps, bench_rounds);
  return g_failures == 0 ? 0 : 1;
}
