// CPU implementations of the dualkv:: ops: the C++ reference backend.
#include "dualkv/cpu.h"
#include "ops.h"
#include "run.h"

namespace dualkv::torch_ops {
namespace {

FwdResult fwd_cpu(DUALKV_FWD_PARAMS) {
  (void)deterministic;  // the CPU backend is always deterministic
  return translate_errors([&] {
    return run_forward(q, k, v, {segments, query_tiles, key_tiles, total_tokens},
                       {softmax_scale, window, softcap},
                       [](const ForwardArgs& a) { cpu::attention_forward(a); });
  });
}

BwdResult bwd_cpu(DUALKV_BWD_PARAMS) {
  return translate_errors([&] {
    return run_backward(dout, q, k, v, out, lse, dlse,
                        {segments, query_tiles, key_tiles, total_tokens},
                        {softmax_scale, window, softcap}, deterministic,
                        [](const BackwardArgs& a) { cpu::attention_backward(a); });
  });
}

LogitStatsResult logit_stats_cpu(DUALKV_LOGIT_STATS_PARAMS) {
  return translate_errors([&] {
    return run_logit_stats(logits, labels, temperature, softcap, entropy,
                           [](const LogitStatsArgs& a) { cpu::logit_stats(a); });
  });
}

void logit_grad_cpu(DUALKV_LOGIT_GRAD_PARAMS) {
  translate_errors([&] {
    run_logit_grad(logits, labels, lse, g_logp, g_entropy, entropy, temperature, softcap,
                   [](const LogitGradArgs& a) { cpu::logit_grad(a); });
  });
}

}  // namespace
}  // namespace dualkv::torch_ops

TORCH_LIBRARY_IMPL(dualkv, CPU, m) {
  m.impl("fwd", &dualkv::torch_ops::fwd_cpu);
  m.impl("bwd", &dualkv::torch_ops::bwd_cpu);
  m.impl("logit_stats", &dualkv::torch_ops::logit_stats_cpu);
  m.impl("logit_grad_", &dualkv::torch_ops::logit_grad_cpu);
}
