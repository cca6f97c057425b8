// The CPU backend of the log-prob statistics and their gradient (include/dualkv/logits.h): one
// OpenMP task per row, each row summed left to right, so results do not depend on the thread
// count.
#include <cstdint>

#include "convert.h"
#include "dualkv/cpu.h"
#include "dualkv/error.h"
#include "dualkv/logits.h"

namespace dualkv::cpu {
namespace {

using logits::LogitMap;
using logits::SoftmaxStats;

void check_labels(const int64_t* labels, int64_t rows, int64_t vocab, const char* fn) {
  for (int64_t r = 0; r < rows; ++r) {
    DUALKV_CHECK(labels[r] >= 0 && labels[r] < vocab, fn, ": label ", labels[r], " of row ", r,
                 " is outside the vocabulary [0, ", vocab, ")");
  }
}

template <class S, class A>
void stats_typed(const LogitStatsArgs& a) {
  const LogitMap<A> f{A(a.temperature), A(a.softcap)};
  const S* z = static_cast<const S*>(a.logits);
  A* logp = static_cast<A*>(a.logp);
  A* lse = static_cast<A*>(a.lse);
  A* ent = static_cast<A*>(a.entropy);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    const S* row = z + r * a.row_stride;
    SoftmaxStats<A> st;
    for (int64_t v = 0; v < a.vocab; ++v) st.add(f.value(load<A>(row[v])));
    const A l = st.lse();
    lse[r] = l;
    logp[r] = f.value(load<A>(row[a.labels[r]])) - l;
    if (ent) ent[r] = l - st.mean();
  }
}

template <class S, class A>
void grad_typed(const LogitGradArgs& a) {
  const LogitMap<A> f{A(a.temperature), A(a.softcap)};
  S* z = static_cast<S*>(a.logits);
  const A* lse = static_cast<const A*>(a.lse);
  const A* g_logp = static_cast<const A*>(a.g_logp);
  const A* g_ent = static_cast<const A*>(a.g_entropy);
  const A* ent = static_cast<const A*>(a.entropy);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    S* row = z + r * a.row_stride;
    const A ge = g_ent ? g_ent[r] : A(0);
    const A mean = g_ent ? lse[r] - ent[r] : A(0);
    for (int64_t v = 0; v < a.vocab; ++v) {
      const A g =
          logits::logit_grad(f, load<A>(row[v]), v == a.labels[r], lse[r], g_logp[r], ge, mean);
      row[v] = store<S>(g);
    }
  }
}

template <class S, class A>
struct Stats {
  static void run(const LogitStatsArgs& a) { stats_typed<S, A>(a); }
};
template <class S, class A>
struct Grad {
  static void run(const LogitGradArgs& a) { grad_typed<S, A>(a); }
};

// Both entry points: the argument checks, then the typed implementation Op.
template <template <class, class> class Op, class Args>
void run_rows(const Args& args, const char* fn) {
  logits::check(args, fn);
  if (args.rows == 0) return;
  check_labels(args.labels, args.rows, args.vocab, fn);
  dispatch<Op>(args);
}

}  // namespace

void logit_stats(const LogitStatsArgs& args) { run_rows<Stats>(args, "dualkv::cpu::logit_stats"); }

void logit_grad(const LogitGradArgs& args) { run_rows<Grad>(args, "dualkv::cpu::logit_grad"); }

}  // namespace dualkv::cpu
