// Arguments of one attention call, as raw pointers and strides: what the CPU backend and the
// CUDA library take (no torch). Strides are in elements; indices into q/k/v/out are 64-bit.
#pragma once

#include <cstdint>

#include "dualkv/layout.h"
#include "dualkv/mask.h"

namespace dualkv {

enum class DType : int32_t { kFloat16, kBFloat16, kFloat32, kFloat64 };

const char* dtype_name(DType t);

// The layout as the kernels read it (pointers to host memory for the CPU backend, to device
// memory for the CUDA library).
struct LayoutView {
  const Segment* segments = nullptr;  // [num_segments]
  const Tile* query_tiles = nullptr;  // [num_query_tiles], longest-first
  const Tile* key_tiles = nullptr;    // [num_key_tiles], longest-first
  int32_t num_segments = 0;
  int32_t num_query_tiles = 0;
  int32_t num_key_tiles = 0;
  int32_t total_tokens = 0;
};

struct Shape {
  int32_t tokens = 0;        // T
  int32_t num_q_heads = 0;   // Hq
  int32_t num_kv_heads = 0;  // Hkv (Hq % Hkv == 0)
  int32_t head_dim = 0;      // D
};

// Kept in double so the fp64 CPU oracle is exact; fp32 backends convert once.
struct ScoreParams {
  double softmax_scale = 1.0;  // s = scale * q.k
  double softcap = 0.0;        // > 0: s = softcap * tanh(s / softcap)
  MaskRule mask{};
};

// Strides of a [T, H, D] tensor (D contiguous: stride 1).
struct TokenHeadStrides {
  int64_t token = 0;
  int64_t head = 0;
};

struct ForwardArgs {
  DType dtype = DType::kBFloat16;
  Shape shape{};
  ScoreParams score{};
  LayoutView layout{};
  const void* q = nullptr;  // [T, Hq, D]
  const void* k = nullptr;  // [T, Hkv, D]
  const void* v = nullptr;  // [T, Hkv, D]
  TokenHeadStrides q_stride{}, k_stride{}, v_stride{};
  void* out = nullptr;      // [T, Hq, D], contiguous
  float* lse = nullptr;     // [Hq, T], contiguous; -inf for a query with no visible key
  double* lse64 = nullptr;  // used instead of lse for kFloat64 inputs (CPU only): an fp64 oracle
                            // needs an fp64 lse, in forward and backward
};

struct BackwardArgs {
  DType dtype = DType::kBFloat16;
  Shape shape{};
  ScoreParams score{};
  LayoutView layout{};
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  TokenHeadStrides q_stride{}, k_stride{}, v_stride{};
  const void* out = nullptr;       // [T, Hq, D], contiguous (forward output)
  const void* dout = nullptr;      // [T, Hq, D], contiguous
  const float* lse = nullptr;      // [Hq, T]
  const float* dlse = nullptr;     // [Hq, T] or nullptr: gradient w.r.t. lse
  const double* lse64 = nullptr;   // instead of lse for kFloat64 inputs (CPU only)
  const double* dlse64 = nullptr;  // instead of dlse for kFloat64 inputs (CPU only)
  void* dq = nullptr;              // [T, Hq, D], contiguous
  void* dk = nullptr;              // [T, Hkv, D], contiguous
  void* dv = nullptr;              // [T, Hkv, D], contiguous
  bool deterministic = false;      // bitwise-reproducible dq too
};

}  // namespace dualkv
