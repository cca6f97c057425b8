// The CUDA library's entry points (include/dualkv/cuda.h): argument checks, the parameter block,
// and dispatch to the per-(dtype, head dim) instantiations. No host synchronisation, no allocation.
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "dualkv/cuda.h"
#include "dualkv/error.h"
#include "env_switch.h"
#include "launch.h"
#if DUALKV_HAS_SM90A
#include "sm90/sm90_ws.h"
#endif

namespace dualkv::cuda {
namespace detail {

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": CUDA launch failed: " + cudaGetErrorString(e));
  }
}

namespace {

// Head dims compiled in (DUALKV_CUDA_HEAD_DIMS at configure time).
constexpr bool head_dim_built(int d) {
  switch (d) {
#if DUALKV_HAS_HD64
    case 64:
      return true;
#endif
#if DUALKV_HAS_HD128
    case 128:
      return true;
#endif
#if DUALKV_HAS_HD256
    case 256:
      return true;
#endif
#if DUALKV_HAS_HD512
    case 512:
      return true;
#endif
    default:
      return false;
  }
}

template <typename T>
bool aligned16(const T* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

void check_common(DType dtype, const Shape& s, const ScoreParams& sc, const LayoutView& lv) {
  DUALKV_CHECK(dtype == DType::kBFloat16 || dtype == DType::kFloat16,
               "dtype: the CUDA kernels take float16 or bfloat16, got ", dtype_name(dtype));
  DUALKV_CHECK(supports(dtype, s.head_dim), "head_dim ", s.head_dim,
               " is not supported by the CUDA kernels of this build (built: 64/128/256/512 as "
               "configured by DUALKV_CUDA_HEAD_DIMS)");
  DUALKV_CHECK(s.tokens >= 0, "shape.tokens must be >= 0, got ", s.tokens);
  DUALKV_CHECK(s.num_q_heads > 0 && s.num_kv_heads > 0,
               "num_q_heads and num_kv_heads must be > 0, got ", s.num_q_heads, " and ",
               s.num_kv_heads);
  DUALKV_CHECK(s.num_q_heads % s.num_kv_heads == 0, "num_q_heads (", s.num_q_heads,
               ") must be a multiple of num_kv_heads (", s.num_kv_heads, ")");
  DUALKV_CHECK(sc.mask.window >= 1, "window must be >= 1, got ", sc.mask.window);
  DUALKV_CHECK(sc.softcap >= 0.f && sc.softcap < INFINITY, "softcap must be finite and >= 0, got ",
               sc.softcap);
  DUALKV_CHECK(lv.total_tokens == s.tokens, "layout has ", lv.total_tokens,
               " tokens but the tensors have ", s.tokens);
  DUALKV_CHECK(
      s.tokens == 0 || (lv.segments && lv.query_tiles && lv.key_tiles),
      "layout tables (segments, query_tiles, key_tiles) must be device pointers, got null");
  // The tables live on the device (not read here); tiles of at most kTileSize tokens cannot cover
  // T tokens with fewer than T / kTileSize of them (a launch over too few would leave outputs
  // unwritten).
  DUALKV_CHECK(s.tokens == 0 ||
                   (lv.num_segments > 0 && int64_t(lv.num_query_tiles) * kTileSize >= s.tokens &&
                    int64_t(lv.num_key_tiles) * kTileSize >= s.tokens),
               "layout has ", lv.num_segments, " segments, ", lv.num_query_tiles,
               " query tiles and ", lv.num_key_tiles, " key tiles: too few for ", s.tokens,
               " tokens (tiles of at most ", kTileSize, ")");
  // (Up to 8 CTAs per tile: D = 512's small sm_80 configs.)
  DUALKV_CHECK(int64_t(lv.num_query_tiles) * s.num_q_heads * 8 < (int64_t(1) << 31) &&
                   int64_t(lv.num_key_tiles) * 8 * s.num_kv_heads < (int64_t(1) << 31),
               "too many tiles x heads for one launch");
}

void check_qkv(const void* q, const void* k, const void* v, const TokenHeadStrides& qs,
               const TokenHeadStrides& ks, const TokenHeadStrides& vs) {
  DUALKV_CHECK(q && k && v, "q, k and v must be non-null device pointers");
  auto ok = [](const void* p, const TokenHeadStrides& st) {
    return aligned16(p) && st.token % 8 == 0 && st.head % 8 == 0;
  };
  DUALKV_CHECK(ok(q, qs),
               "q must be 16-byte aligned with token and head strides that are multiples of 8 "
               "elements (got strides ",
               qs.token, ", ", qs.head, ")");
  DUALKV_CHECK(ok(k, ks),
               "k must be 16-byte aligned with token and head strides that are multiples of 8 "
               "elements (got strides ",
               ks.token, ", ", ks.head, ")");
  DUALKV_CHECK(ok(v, vs),
               "v must be 16-byte aligned with token and head strides that are multiples of 8 "
               "elements (got strides ",
               vs.token, ", ", vs.head, ")");
}

// The kernel parameters both passes share (the base of FwdParams and BwdParams): layout, shape,
// score, q/k/v and their strides (ForwardArgs and BackwardArgs name these fields alike).
template <typename Args>
Params make_params(const Args& a) {
  const Shape& s = a.shape;
  const ScoreParams& sc = a.score;
  const LayoutView& lv = a.layout;
  Params p{};
  p.segs = lv.segments;
  p.qtiles = lv.query_tiles;
  p.ktiles = lv.key_tiles;
  p.nseg = lv.num_segments;
  p.nqt = lv.num_query_tiles;
  p.nkt = lv.num_key_tiles;
  p.T = s.tokens;
  p.Hq = s.num_q_heads;
  p.Hkv = s.num_kv_heads;
  p.group = s.num_q_heads / s.num_kv_heads;
  p.scale = sc.softmax_scale;
  p.scale_log2 = sc.softmax_scale * kLog2e;
  p.softcap = sc.softcap;
  p.cap_inv = sc.softcap > 0.f ? sc.softmax_scale / sc.softcap : 0.f;
  p.cap_log2 = sc.softcap * kLog2e;
  p.mask = sc.mask;
  p.q = a.q, p.k = a.k, p.v = a.v;
  p.q_tok = a.q_stride.token, p.q_head = a.q_stride.head;
  p.k_tok = a.k_stride.token, p.k_head = a.k_stride.head;
  p.v_tok = a.v_stride.token, p.v_head = a.v_stride.head;
  return p;
}

// The wgmma path: built for sm_90a, device of compute capability 9.x, not forced off.
bool sm90_device(bool force_sm80) {
#if DUALKV_HAS_SM90A
  if (force_sm80) return false;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  static std::atomic<int> major_of[64];  // 0 = unknown
  int major = dev < 64 ? major_of[dev].load(std::memory_order_relaxed) : 0;
  if (major == 0) {
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
      return false;
    if (dev < 64) major_of[dev].store(major, std::memory_order_relaxed);
  }
  return major == 9;
#else
  (void)force_sm80;
  return false;
#endif
}

// The current device's opt-in shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin,
// cached per device); 0 when it cannot be read (the launch then reports the error).
int smem_optin() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  static std::atomic<int> optin_of[64];  // 0 = unknown
  int optin = dev < 64 ? optin_of[dev].load(std::memory_order_relaxed) : 0;
  if (optin == 0) {
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
        cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    if (dev < 64) optin_of[dev].store(optin, std::memory_order_relaxed);
  }
  return optin;
}

// Prints `msg` on stderr, once per process for each distinct message.
void warn_once(const std::string& msg) {
  static std::mutex mu;
  static std::set<std::string> printed;
  const std::lock_guard<std::mutex> lock(mu);
  if (printed.insert(msg).second) std::fprintf(stderr, "%s\n", msg.c_str());
}

// The setting of switch `name` (env_switch.h: one of its digits, or kSwitchUnset; a value it
// does not accept warns once and reads as unset).
int env_switch(const char* name) {
  std::string warning;
  const int v = parse_switch(name, std::getenv(name), &warning);
  if (!warning.empty()) warn_once(warning);
  return v;
}

}  // namespace

// The only reader of the environment (the switches are documented in docs/kernels.md and policy.h;
// env_switch.h lists the settings each accepts). A setting is one digit, blanks around it
// ignored; unset or empty = the default; any other value, and a removed switch that is set, warn
// once on stderr and are ignored.
KernelPolicy resolve_policy(bool deterministic) {
  for (const RemovedSwitch& r : kRemovedSwitches) {
    const std::string warning = removed_switch_warning(r.name, std::getenv(r.name));
    if (!warning.empty()) warn_once(warning);
  }
  auto is = [](const char* name, char c) { return env_switch(name) == c - '0'; };
  KernelPolicy pol;
  const bool small_smem = is("DUALKV_SM80_SMALL_SMEM", '1');
  pol.sm90 = sm90_device(is("DUALKV_FORCE_SM80", '1') || small_smem);
  const int optin = smem_optin();
  pol.sm80_force_small_smem = small_smem;
  pol.smem_optin = optin;
  pol.pingpong = !is("DUALKV_SM90_PINGPONG", '0');
  pol.fused_dq = !deterministic && !is("DUALKV_FUSED_DQ", '0');
  pol.d512_bwd_sm90 = !is("DUALKV_SM90_D512_BWD", '0');
  pol.bwd_key_chunk = is("DUALKV_BWD_KEY_ORDER", '0')   ? 0
                      : is("DUALKV_BWD_KEY_ORDER", '1') ? 16
                      : is("DUALKV_BWD_KEY_ORDER", '2') ? 32
                      : is("DUALKV_BWD_KEY_ORDER", '3') ? 64
                                                        : -1;
  pol.d64_fwd_bm192 = is("DUALKV_SM90_D64_TILES", '1') || is("DUALKV_SM90_D64_TILES", '3');
  pol.d64_bwd_bm128 = is("DUALKV_SM90_D64_TILES", '2') || is("DUALKV_SM90_D64_TILES", '3');
  return pol;
}

namespace {

constexpr size_t align256(size_t n) { return (n + 255) & ~size_t(255); }

// The D = 256 / 512 kernels ask for up to 128 / 227 KB of shared memory per block; on a GPU that
// offers less (A100: 163 KB, sm_86/89: 99 KB) the sm_80 path runs its small configs
// (KernelPolicy::sm80_small_smem), which need kSmemSmall: a GPU below that (none of sm_80+)
// cannot run these head dims, so say so.
void check_smem_for(int head_dim) {
  if (smem_regular(head_dim) == 0) return;
  const int optin = smem_optin();
  if (optin == 0) return;  // unknown: the launch reports the error
  DUALKV_CHECK(optin >= kSmemSmall, "head_dim ", head_dim, " needs at least ", kSmemSmall / 1024,
               " KB of shared memory per block (the sm_80 kernels' small configs; the regular "
               "ones ",
               smem_regular(head_dim) / 1024, " KB), this GPU offers ", optin / 1024, " KB");
}

// f(T{}, std::integral_constant<int, D>{}) for the element type T of `dtype` and D = d, a head
// dim the library was built for (only those are instantiated: head_dim_built).
template <typename F>
void dispatch(DType dtype, int d, F&& f) {
  auto by_dim = [&](auto tag) {
    auto one = [&](auto dim) {
      if constexpr (head_dim_built(decltype(dim)::value)) {
        if (d == decltype(dim)::value) {
          f(tag, dim);
          return true;
        }
      }
      return false;
    };
    if (!(one(std::integral_constant<int, 64>{}) || one(std::integral_constant<int, 128>{}) ||
          one(std::integral_constant<int, 256>{}) || one(std::integral_constant<int, 512>{}))) {
      throw Error(
          ::dualkv::detail::concat("head_dim ", d, " is not supported by the CUDA kernels"));
    }
  };
  if (dtype == DType::kBFloat16) {
    by_dim(__nv_bfloat16{});
  } else {
    by_dim(__half{});
  }
}

}  // namespace
}  // namespace detail

bool supports(DType dtype, int head_dim) {
  return (dtype == DType::kBFloat16 || dtype == DType::kFloat16) &&
         detail::head_dim_built(head_dim);
}

void attention_forward(const ForwardArgs& a, cudaStream_t stream) {
  using namespace detail;
  check_common(a.dtype, a.shape, a.score, a.layout);
  if (a.shape.tokens == 0) return;
  check_qkv(a.q, a.k, a.v, a.q_stride, a.k_stride, a.v_stride);
  DUALKV_CHECK(a.out && a.lse, "out and lse must be non-null device pointers");
  DUALKV_CHECK(aligned16(a.out), "out must be 16-byte aligned");
  check_smem_for(a.shape.head_dim);
  FwdParams p{};
  static_cast<Params&>(p) = make_params(a);
  p.out = a.out;
  p.lse = a.lse;
  const KernelPolicy pol = resolve_policy(false);
  dispatch(a.dtype, a.shape.head_dim, [&](auto t, auto d) {
    using T = decltype(t);
    constexpr int D = decltype(d)::value;
#if DUALKV_HAS_SM90A
    // The warp-specialised FA3-style forward; D = 512 on 2-CTA clusters (false: a TMA map could
    // not be encoded).
    if constexpr (D == 512) {
      if (pol.sm90 && launch_forward_sm90_d512c<T>(p, pol, stream)) return;
    } else {
      if (pol.sm90 && launch_forward_sm90_ws<T, D>(p, pol, stream)) return;
    }
#endif
    launch_forward_sm80<T, D>(p, pol.sm80_small_smem(D), stream);
  });
}

namespace {
// The fp32 dQ accumulator (T x Hq x D floats): only the fused dQ of the sm_90a backward at head
// dim 64/128 adds into it (every other path, and deterministic calls, write dq directly).
bool needs_dq_accum(int head_dim, const detail::KernelPolicy& pol) {
  return head_dim <= 128 && pol.sm90 && pol.fused_dq;
}
size_t workspace_bytes(const Shape& s, const detail::KernelPolicy& pol) {
  const size_t rows =
      size_t(s.tokens > 0 ? s.tokens : 0) * size_t(s.num_q_heads > 0 ? s.num_q_heads : 0);
  const size_t accum =
      needs_dq_accum(s.head_dim, pol) ? rows * size_t(s.head_dim > 0 ? s.head_dim : 0) : 0;
  return 2 * detail::align256(rows * sizeof(float)) + detail::align256(accum * sizeof(float));
}
}  // namespace

size_t backward_workspace_bytes(const Shape& s, bool deterministic) {
  return workspace_bytes(s, detail::resolve_policy(deterministic));
}

void attention_backward(const BackwardArgs& a, void* workspace, size_t bytes, cudaStream_t stream) {
  using namespace detail;
  check_common(a.dtype, a.shape, a.score, a.layout);
  if (a.shape.tokens == 0) return;
  check_qkv(a.q, a.k, a.v, a.q_stride, a.k_stride, a.v_stride);
  DUALKV_CHECK(a.out && a.dout && a.lse && a.dq && a.dk && a.dv,
               "out, dout, lse, dq, dk and dv must be non-null device pointers");
  DUALKV_CHECK(aligned16(a.out) && aligned16(a.dout) && aligned16(a.dq) && aligned16(a.dk) &&
                   aligned16(a.dv),
               "out, dout, dq, dk and dv must be 16-byte aligned");
  DUALKV_CHECK(workspace && (reinterpret_cast<uintptr_t>(workspace) & 255u) == 0,
               "workspace must be a non-null, 256-byte aligned device pointer of "
               "backward_workspace_bytes()");
  check_smem_for(a.shape.head_dim);
  const KernelPolicy pol = resolve_policy(a.deterministic);
  const size_t needed = workspace_bytes(a.shape, pol);
  DUALKV_CHECK(bytes >= needed, "the backward workspace holds " + std::to_string(bytes) +
                                    " bytes; this call needs " + std::to_string(needed) +
                                    " (backward_workspace_bytes(shape, deterministic))");
  BwdParams p{};
  static_cast<Params&>(p) = make_params(a);
  p.o = a.out;
  p.dout = a.dout;
  p.lse_in = a.lse;
  p.dlse = a.dlse;
  p.dq = a.dq, p.dk = a.dk, p.dv = a.dv;
  const size_t rows = size_t(a.shape.tokens) * size_t(a.shape.num_q_heads);
  char* ws = static_cast<char*>(workspace);
  p.delta = reinterpret_cast<float*>(ws);
  p.lse2 = reinterpret_cast<float*>(ws + align256(rows * sizeof(float)));
  p.dq_accum = needs_dq_accum(a.shape.head_dim, pol)
                   ? reinterpret_cast<float*>(ws + 2 * align256(rows * sizeof(float)))
                   : nullptr;
  p.key_chunk = pol.bwd_key_chunk >= 0                               ? pol.bwd_key_chunk
                : a.shape.head_dim == 64 && pol.sm90 && pol.fused_dq ? 32
                                                                     : 0;
  dispatch(a.dtype, a.shape.head_dim, [&](auto t, auto d) {
    using T = decltype(t);
    constexpr int D = decltype(d)::value;
#if DUALKV_HAS_SM90A
    // Each launcher returns false when a TMA map could not be encoded: the sm_80 backward runs.
    if constexpr (D <= 128) {
      // Fused dQ unless deterministic (policy.h).
      if (pol.sm90 && launch_backward_sm90_ws<T, D>(p, pol, stream)) return;
    } else if constexpr (D == 256) {
      if (pol.sm90 && launch_backward_sm90_d256ws<T>(p, pol, stream)) return;
    } else {
      if (pol.sm90 && pol.d512_bwd_sm90 && launch_backward_sm90_d512<T>(p, stream)) return;
    }
#endif
    // Any GPU other than sm_90, DUALKV_FORCE_SM80=1, or D = 512 with DUALKV_SM90_D512_BWD=0.
    launch_backward_sm80<T, D>(p, pol.sm80_small_smem(D), stream);
  });
}

}  // namespace dualkv::cuda
