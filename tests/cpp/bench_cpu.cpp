// Times the CPU backend's forward and backward on one layout (not part of ctest):
//   dualkv_cpu_bench [P N R Hq Hkv D dtype(f32|f64|bf16|f16) reps]
// Defaults: one group P=2048, N=6, R=1024 (T=8192), Hq=Hkv=8, D=128, fp32.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "convert.h"
#include "dualkv/cpu.h"
#include "dualkv/layout.h"

namespace {

// Wall-clock and process CPU time (all threads) of one call; CPU time is the steadier figure on
// a shared machine.
struct Timing {
  double wall = 1e30, cpu = 1e30;
};
template <class F>
void time_call(F f, Timing& best) {
  const auto w0 = std::chrono::steady_clock::now();
  const std::clock_t c0 = std::clock();
  f();
  const double cpu = double(std::clock() - c0) / CLOCKS_PER_SEC;
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
  best.wall = std::min(best.wall, wall);
  best.cpu = std::min(best.cpu, cpu);
}

}  // namespace

int main(int argc, char** argv) {
  auto arg = [&](int i, int def) { return argc > i ? std::atoi(argv[i]) : def; };
  const int P = arg(1, 2048), N = arg(2, 6), R = arg(3, 1024), Hq = arg(4, 8), Hkv = arg(5, 8),
            D = arg(6, 128);
  const std::string dt = argc > 7 ? argv[7] : "f32";
  const int reps = arg(8, 3);
  const dualkv::DType dtype = dt == "f64"    ? dualkv::DType::kFloat64
                              : dt == "bf16" ? dualkv::DType::kBFloat16
                              : dt == "f16"  ? dualkv::DType::kFloat16
                                             : dualkv::DType::kFloat32;
  const size_t esize = dtype == dualkv::DType::kFloat64   ? 8
                       : dtype == dualkv::DType::kFloat32 ? 4
                                                          : 2;

  dualkv::Layout layout({P}, {std::vector<int64_t>(size_t(N), R)});
  const int T = layout.total_tokens();
  const auto segs = layout.segments();
  const auto qt = layout.query_tiles();
  const auto kt = layout.key_tiles();
  dualkv::LayoutView lv{segs.data(),        qt.data(),          kt.data(), int32_t(segs.size()),
                        int32_t(qt.size()), int32_t(kt.size()), T};

  std::mt19937 rng(1234);
  std::normal_distribution<float> nd;
  auto make = [&](int H) {
    std::vector<unsigned char> buf(size_t(T) * H * D * esize);
    for (size_t i = 0; i < size_t(T) * H * D; ++i) {
      const float x = nd(rng);
      if (esize == 8) {
        const double d = x;
        std::memcpy(&buf[i * 8], &d, 8);
      } else if (esize == 4) {
        std::memcpy(&buf[i * 4], &x, 4);
      } else {
        const uint16_t b = dtype == dualkv::DType::kBFloat16 ? dualkv::cpu::float_to_bf16_bits(x)
                                                             : dualkv::cpu::float_to_half_bits(x);
        std::memcpy(&buf[i * 2], &b, 2);
      }
    }
    return buf;
  };
  auto q = make(Hq), k = make(Hkv), v = make(Hkv), dout = make(Hq);
  std::vector<unsigned char> out(q.size()), dq(q.size()), dk(k.size()), dv(v.size());
  std::vector<float> lse(size_t(Hq) * T);
  std::vector<double> lse64(lse.size());

  dualkv::ForwardArgs f;
  f.dtype = dtype;
  f.shape = {T, Hq, Hkv, D};
  f.score.softmax_scale = 1.0 / std::sqrt(double(D));
  f.layout = lv;
  f.q = q.data();
  f.k = k.data();
  f.v = v.data();
  f.q_stride = {int64_t(Hq) * D, D};
  f.k_stride = f.v_stride = {int64_t(Hkv) * D, D};
  f.out = out.data();
  f.lse = lse.data();
  f.lse64 = lse64.data();

  dualkv::BackwardArgs b;
  b.dtype = dtype;
  b.shape = f.shape;
  b.score = f.score;
  b.layout = lv;
  b.q = f.q;
  b.k = f.k;
  b.v = f.v;
  b.q_stride = f.q_stride;
  b.k_stride = f.k_stride;
  b.v_stride = f.v_stride;
  b.out = out.data();
  b.dout = dout.data();
  b.lse = lse.data();
  b.lse64 = lse64.data();
  b.dq = dq.data();
  b.dk = dk.data();
  b.dv = dv.data();

  Timing tf, tb;
  for (int r = 0; r < reps; ++r) {
    time_call([&] { dualkv::cpu::attention_forward(f); }, tf);
    time_call([&] { dualkv::cpu::attention_backward(b); }, tb);
  }
  const double ff = layout.forward_flops(D, Hq), bf = layout.backward_flops(D, Hq);
  std::printf("layout P=%d N=%d R=%d T=%d Hq=%d Hkv=%d D=%d %s, %d threads\n", P, N, R, T, Hq, Hkv,
              D, dualkv::dtype_name(dtype), omp_get_max_threads());
  std::printf("forward  wall %7.3f s  cpu %7.3f s  %6.1f GFLOP/s wall (useful %.1f GFLOP)\n",
              tf.wall, tf.cpu, ff / tf.wall * 1e-9, ff * 1e-9);
  std::printf("backward wall %7.3f s  cpu %7.3f s  %6.1f GFLOP/s wall (useful %.1f GFLOP)\n",
              tb.wall, tb.cpu, bf / tb.wall * 1e-9, bf * 1e-9);
  return 0;
}
