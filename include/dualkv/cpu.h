// The CPU backend: the reference implementation and the test oracle. Accumulates in fp32 for
// fp16/bf16/fp32 inputs and in fp64 for fp64 inputs; parallel with OpenMP; deterministic.
#pragma once

#include "dualkv/logits.h"
#include "dualkv/params.h"

namespace dualkv::cpu {

// Writes out and lse for every token. Throws dualkv::Error on invalid arguments.
void attention_forward(const ForwardArgs& args);
// Writes dq, dk, dv for every token (prompt dk/dv summed over all queries that see them).
void attention_backward(const BackwardArgs& args);

// Log-prob statistics of a chunk of logit rows and their gradient (include/dualkv/logits.h).
// Throws dualkv::Error on invalid arguments, including a label outside the vocabulary.
void logit_stats(const LogitStatsArgs& args);
void logit_grad(const LogitGradArgs& args);

}  // namespace dualkv::cpu
