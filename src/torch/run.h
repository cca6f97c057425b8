// The device-independent part of the ops: validate, allocate outputs, fill the core's argument
// structs, then hand them to a backend launcher (CPU or CUDA).
#pragma once

#include <functional>
#include <tuple>

#include "checks.h"
#include "dualkv/logits.h"

namespace dualkv::torch_ops {

std::tuple<at::Tensor, at::Tensor> run_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const LayoutTensors& layout,
    const ScoreOptions& opts, const std::function<void(const ForwardArgs&)>& launch);

std::tuple<at::Tensor, at::Tensor, at::Tensor> run_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
    const LayoutTensors& layout, const ScoreOptions& opts, bool deterministic,
    const std::function<void(const BackwardArgs&)>& launch);

// Uninitialised (logp, lse, entropy) for the rows of logits, in the accumulation dtype (entropy
// is [0] unless asked for); symbolic sizes for the Meta implementation, concrete otherwise.
std::tuple<at::Tensor, at::Tensor, at::Tensor> logit_stats_outputs(const at::Tensor& logits,
                                                                   bool entropy);

// (logp, lse, entropy) of each row of logits (entropy is [0] unless asked for).
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_logit_stats(
    const at::Tensor& logits, const at::Tensor& labels, double temperature, double softcap,
    bool entropy, const std::function<void(const LogitStatsArgs&)>& launch);

// Overwrites logits with the gradient of the rows' log-probs (and entropies).
void run_logit_grad(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& lse,
                    const at::Tensor& g_logp, const std::optional<at::Tensor>& g_entropy,
                    const std::optional<at::Tensor>& entropy, double temperature, double softcap,
                    const std::function<void(const LogitGradArgs&)>& launch);

}  // namespace dualkv::torch_ops
