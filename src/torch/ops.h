// Signatures of the dualkv:: torch ops, shared by their CPU, CUDA and Meta implementations.
#pragma once

#include <torch/library.h>

#include <tuple>

#include "checks.h"
#include "dualkv/error.h"

namespace dualkv::torch_ops {

using FwdResult = std::tuple<at::Tensor, at::Tensor>;
using BwdResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using LogitStatsResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// Argument lists exactly as in the schemas registered in ops.cpp.
#define DUALKV_FWD_PARAMS                                                                    \
  const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &segments, \
      const at::Tensor &query_tiles, const at::Tensor &key_tiles, c10::SymInt total_tokens,  \
      double softmax_scale, std::optional<int64_t> window, double softcap, bool deterministic
#define DUALKV_BWD_PARAMS                                                                     \
  const at::Tensor &dout, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,      \
      const at::Tensor &out, const at::Tensor &lse, const std::optional<at::Tensor>&dlse,     \
      const at::Tensor &segments, const at::Tensor &query_tiles, const at::Tensor &key_tiles, \
      c10::SymInt total_tokens, double softmax_scale, std::optional<int64_t> window,          \
      double softcap, bool deterministic
#define DUALKV_LOGIT_STATS_PARAMS                                                         \
  const at::Tensor &logits, const at::Tensor &labels, double temperature, double softcap, \
      bool entropy
#define DUALKV_LOGIT_GRAD_PARAMS                                             \
  const at::Tensor &logits, const at::Tensor &labels, const at::Tensor &lse, \
      const at::Tensor &g_logp, const std::optional<at::Tensor>&g_entropy,   \
      const std::optional<at::Tensor>&entropy, double temperature, double softcap

// Core errors (dualkv::Error) surface in Python as ValueError.
template <typename F>
auto translate_errors(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const dualkv::Error& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

}  // namespace dualkv::torch_ops
