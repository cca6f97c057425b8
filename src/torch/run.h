// The device-independent part of the ops: validate, allocate outputs, fill the core's argument
// structs, then hand them to a backend launcher (CPU or CUDA).
#pragma once

#include <functional>
#include <tuple>

#include "checks.h"

namespace dualkv::torch_ops {

std::tuple<at::Tensor, at::Tensor> run_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const LayoutTensors& layout,
    const ScoreOptions& opts, const std::function<void(const ForwardArgs&)>& launch);

std::tuple<at::Tensor, at::Tensor, at::Tensor> run_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
    const LayoutTensors& layout, const ScoreOptions& opts, bool deterministic,
    const std::function<void(const BackwardArgs&)>& launch);

}  // namespace dualkv::torch_ops
