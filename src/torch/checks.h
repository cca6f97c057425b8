// Input validation and conversion from torch tensors to the core's raw-pointer arguments.
// Shared by the CPU and CUDA op implementations.
#pragma once

#include <torch/library.h>
#include <torch/types.h>

#include <optional>

#include "dualkv/params.h"

namespace dualkv::torch_ops {

// The layout tables as the ops receive them (int32 tensors on the same device as q). total_tokens
// is symbolic under torch.compile, so that one compiled graph serves every layout.
struct LayoutTensors {
  at::Tensor segments, query_tiles, key_tiles;
  c10::SymInt total_tokens;
};

struct ScoreOptions {
  double softmax_scale;
  std::optional<int64_t> window;
  double softcap;
};

// Validates q, k, v and the layout against each other. Errors name the argument and what was
// expected. Symbolic-safe (the Meta implementations run it under torch.compile): it compares
// sizes with each other, never specialises them to a value.
void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const LayoutTensors& layout);
// The problem shape of checked (real) q and k.
Shape shape_of(const at::Tensor& q, const at::Tensor& k);
// Validates the score options. For inputs other than float64 the scores are computed in float32,
// so a scale or softcap that does not fit float32 (e.g. 1e39, or a softcap that rounds to 0) is
// refused instead of turning every output into NaN.
ScoreParams check_score(const ScoreOptions& opts, at::ScalarType dtype = at::kDouble);
DType to_dtype(at::ScalarType t, const char* name = "q");
// lse is float32, except float64 for float64 inputs.
at::ScalarType lse_dtype(at::ScalarType input);

// q/k/v with a unit stride on the head dimension (and, on CUDA, 16-byte aligned rows).
at::Tensor with_unit_inner_stride(const at::Tensor& t);
// A dense tensor (and, on CUDA, 16-byte aligned): t, or a copy of it (dout, out, lse, dlse).
at::Tensor dense_aligned(const at::Tensor& t);
TokenHeadStrides strides_of(const at::Tensor& t);
LayoutView view_of(const LayoutTensors& layout);

}  // namespace dualkv::torch_ops
