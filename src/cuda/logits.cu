// CUDA kernels of the log-prob statistics and their gradient (include/dualkv/logits.h): one block
// per row of logits, 16-byte loads and stores where the rows are aligned for them, and a fixed
// reduction order, so every output is bitwise reproducible. Memory-bound: each kernel reads the
// row once (the gradient also writes it once, in place).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "dualkv/cuda.h"
#include "dualkv/logits.h"
#include "launch.h"

namespace dualkv::cuda {
namespace detail {
namespace {

constexpr int kThreads = 256;

template <class T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};

__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ double widen(double x) { return x; }

template <class T>
__device__ __forceinline__ T narrow(typename AccOf<T>::type x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else {
    return x;
  }
}

// Calls f(element) for each element of a row of n elements: 16-byte vectors first when kVec
// (row 16-byte aligned), then the tail. Each thread visits its elements in increasing order.
template <class T, bool kVec, class F>
__device__ __forceinline__ void for_each_element(T* row, int64_t n, F&& f) {
  constexpr int kPer = kVec ? int(16 / sizeof(T)) : 1;
  const int64_t nvec = n / kPer;
  for (int64_t i = threadIdx.x; i < nvec; i += kThreads) {
    if constexpr (kVec) {
      using Vec = std::conditional_t<std::is_const_v<T>, const uint4, uint4>;
      uint4 raw = reinterpret_cast<Vec*>(row)[i];
      auto* e = reinterpret_cast<std::remove_const_t<T>*>(&raw);
#pragma unroll
      for (int j = 0; j < kPer; ++j) f(i * kPer + j, e[j]);
      if constexpr (!std::is_const_v<T>) reinterpret_cast<uint4*>(row)[i] = raw;
    } else {
      f(i, row[i]);
    }
  }
  for (int64_t v = nvec * kPer + threadIdx.x; v < n; v += kThreads) f(v, row[v]);
}

template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads) logit_stats_kernel(LogitStatsArgs a) {
  using A = typename AccOf<T>::type;
  const logits::LogitMap<A> f{A(a.temperature), A(a.softcap)};
  const int64_t r = blockIdx.x;
  const T* row = static_cast<const T*>(a.logits) + r * a.row_stride;
  logits::SoftmaxStats<A> st;
  for_each_element<const T, kVec>(row, a.vocab,
                                  [&](int64_t, const T& z) { st.add(f.value(widen(z))); });
  // Warp, then block: lane 0 of each warp, then thread 0 over the warps in order.
  for (int o = 16; o > 0; o >>= 1) {
    logits::SoftmaxStats<A> other;
    other.m = __shfl_down_sync(~0u, st.m, o);
    other.s = __shfl_down_sync(~0u, st.s, o);
    other.t = __shfl_down_sync(~0u, st.t, o);
    st.merge(other);
  }
  __shared__ A sm[kThreads / 32], ss[kThreads / 32], stt[kThreads / 32];
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) sm[warp] = st.m, ss[warp] = st.s, stt[warp] = st.t;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kThreads / 32; ++w) {
    logits::SoftmaxStats<A> other;
    other.m = sm[w], other.s = ss[w], other.t = stt[w];
    st.merge(other);
  }
  const A lse = st.lse();
  const int64_t label = a.labels[r];
  const bool valid = label >= 0 && label < a.vocab;
  static_cast<A*>(a.lse)[r] = lse;
  static_cast<A*>(a.logp)[r] =
      valid ? f.value(widen(row[label])) - lse : std::numeric_limits<A>::quiet_NaN();
  if (a.entropy) static_cast<A*>(a.entropy)[r] = lse - st.mean();
}

template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads) logit_grad_kernel(LogitGradArgs a) {
  using A = typename AccOf<T>::type;
  const logits::LogitMap<A> f{A(a.temperature), A(a.softcap)};
  const int64_t r = blockIdx.x;
  T* row = static_cast<T*>(a.logits) + r * a.row_stride;
  const A lse = static_cast<const A*>(a.lse)[r];
  const A g = static_cast<const A*>(a.g_logp)[r];
  const A ge = a.g_entropy ? static_cast<const A*>(a.g_entropy)[r] : A(0);
  const A mean = a.g_entropy ? lse - static_cast<const A*>(a.entropy)[r] : A(0);
  const int64_t label = a.labels[r];
  for_each_element<T, kVec>(row, a.vocab, [&](int64_t v, T& z) {
    z = narrow<T>(logits::logit_grad(f, widen(z), v == label, lse, g, ge, mean));
  });
}

template <class T, class Args>
bool rows_vectorisable(const Args& a) {
  return (reinterpret_cast<uintptr_t>(a.logits) & 15u) == 0 &&
         (a.row_stride * int64_t(sizeof(T))) % 16 == 0;
}

// One block per row; the 16-byte variant of the kernel where the rows allow it.
template <class T, class Args>
void launch_rows(const Args& a, void (*vec)(Args), void (*scalar)(Args), cudaStream_t stream,
                 const char* what) {
  (rows_vectorisable<T>(a) ? vec : scalar)<<<unsigned(a.rows), kThreads, 0, stream>>>(a);
  check_launch(what);
}

template <template <class> class Launch, class Args>
void dispatch_storage(const Args& a, cudaStream_t stream) {
  switch (a.dtype) {
    case DType::kFloat16:
      return Launch<__half>::run(a, stream);
    case DType::kBFloat16:
      return Launch<__nv_bfloat16>::run(a, stream);
    case DType::kFloat32:
      return Launch<float>::run(a, stream);
    case DType::kFloat64:
      return Launch<double>::run(a, stream);
  }
}

template <class T>
struct Stats {
  static void run(const LogitStatsArgs& a, cudaStream_t s) {
    launch_rows<T>(a, logit_stats_kernel<T, true>, logit_stats_kernel<T, false>, s,
                   "dualkv::cuda::logit_stats");
  }
};
template <class T>
struct Grad {
  static void run(const LogitGradArgs& a, cudaStream_t s) {
    launch_rows<T>(a, logit_grad_kernel<T, true>, logit_grad_kernel<T, false>, s,
                   "dualkv::cuda::logit_grad");
  }
};

// Both entry points: the argument checks (one block per row: at most 2^31 - 1 rows), then the
// launch of Launch's kernels for the storage dtype.
template <template <class> class Launch, class Args>
void run_rows(const Args& args, const char* fn, cudaStream_t stream) {
  logits::check(args, fn);
  DUALKV_CHECK(args.rows <= std::numeric_limits<int32_t>::max(), fn,
               ": at most 2^31 - 1 rows, got ", args.rows);
  if (args.rows == 0) return;
  dispatch_storage<Launch>(args, stream);
}

}  // namespace
}  // namespace detail

void logit_stats(const LogitStatsArgs& args, cudaStream_t stream) {
  detail::run_rows<detail::Stats>(args, "dualkv::cuda::logit_stats", stream);
}

void logit_grad(const LogitGradArgs& args, cudaStream_t stream) {
  detail::run_rows<detail::Grad>(args, "dualkv::cuda::logit_grad", stream);
}

}  // namespace dualkv::cuda
