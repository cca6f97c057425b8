// The warp-specialised sm_90a kernels' parameter blocks (the common parameters plus the TMA maps,
// passed by value as __grid_constant__) and the host's builders that encode the maps: the
// forwards' (FwdWsArgs), the dK/dV kernels' and the D = 512 dQ kernel's (DkdvWsArgs), the separate
// dQ pass's (DqWsArgs).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "collective/common.cuh"
#include "policy.h"
#include "sm90/sm90_ws.h"

namespace dualkv::cuda::detail {

struct FwdWsArgs {
  CUtensorMap tq, tk, tv;
  FwdParams p;
  int pingpong;
  int prescale;  // 1: scale the scores first (scale <= 0: the FFMA fold needs scale > 0)
};

struct DkdvWsArgs {
  CUtensorMap tq, tdo, tk, tv;
  BwdParams p;
};

struct DqWsArgs {
  CUtensorMap tq, tdo, tk, tv;
  BwdParams p;
  int pingpong;
};

// The forwards' kernel arguments: the Q / K / V tensor maps (boxes of bm query and bn key rows
// of head dim d), the parameters, the ping-pong switch and whether the scores are pre-scaled.
// False (after the fallback warning) when a map cannot be encoded.
inline bool make_fwd_ws_args(FwdWsArgs& a, const FwdParams& p, const KernelPolicy& policy, int d,
                             int bm, int bn) {
  if (!encode_tmap_thd(&a.tq, p.q, p.T, p.Hq, d, p.q_tok, p.q_head, bm) ||
      !encode_tmap_thd(&a.tk, p.k, p.T, p.Hkv, d, p.k_tok, p.k_head, bn) ||
      !encode_tmap_thd(&a.tv, p.v, p.T, p.Hkv, d, p.v_tok, p.v_head, bn)) {
    warn_ws_fallback("cuTensorMapEncodeTiled failed or is unavailable");
    return false;
  }
  a.p = p;
  a.pingpong = policy.pingpong;
  a.prescale = !(p.scale_log2 > 0.f);
  return true;
}

// A backward kernel's tensor maps: Q and dO (boxes of bm rows), K and V (bn rows), d columns
// each. False when a map cannot be encoded.
inline bool encode_bwd_tmaps(CUtensorMap& tq, CUtensorMap& tdo, CUtensorMap& tk, CUtensorMap& tv,
                             const BwdParams& p, int d, int bm, int bn) {
  return encode_tmap_thd(&tq, p.q, p.T, p.Hq, d, p.q_tok, p.q_head, bm) &&
         encode_tmap_thd(&tdo, p.dout, p.T, p.Hq, d, int64_t(p.Hq) * d, d, bm) &&
         encode_tmap_thd(&tk, p.k, p.T, p.Hkv, d, p.k_tok, p.k_head, bn) &&
         encode_tmap_thd(&tv, p.v, p.T, p.Hkv, d, p.v_tok, p.v_head, bn);
}

// The dK/dV kernels' arguments (and the D = 512 dQ kernel's): p and encode_bwd_tmaps' maps.
// False, with the fallback warning, when a map cannot be encoded.
inline bool make_bwd_ws_args(DkdvWsArgs& a, const BwdParams& p, int d, int bm, int bn) {
  if (!encode_bwd_tmaps(a.tq, a.tdo, a.tk, a.tv, p, d, bm, bn)) {
    warn_ws_fallback("cuTensorMapEncodeTiled failed or is unavailable");
    return false;
  }
  a.p = p;
  return true;
}

// The separate dQ pass's arguments (maps as encode_bwd_tmaps, ping-pong); false when a map
// cannot be encoded (the caller warns).
inline bool make_dq_ws_args(DqWsArgs& a, const BwdParams& p, const KernelPolicy& policy, int d,
                            int bm, int bn) {
  if (!encode_bwd_tmaps(a.tq, a.tdo, a.tk, a.tv, p, d, bm, bn)) return false;
  a.p = p;
  a.pingpong = policy.pingpong;
  return true;
}

}  // namespace dualkv::cuda::detail
