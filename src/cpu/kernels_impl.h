// Hot loops of the CPU backend. No include guard on purpose: attention_cpu.cpp includes this
// file once per instruction set (generic, and AVX2+FMA where the compiler can target it), each
// time inside its own namespace, so every helper below is compiled, inlined and vectorized for
// that target. Everything is fixed-order arithmetic: results never depend on threads or schedule.
//
// Every stage of attention is a row vector times a small matrix, y = w . X, computed with the
// output chunk held in registers (gemv): scores s = q . K^T (K block transposed so the
// innermost loop runs over keys), dO . V^T, o += p . V, dq += dS . K, dv += P^T . dO,
// dk += dS^T . Q.
//
// Each key block is processed in phases so that the operand every row reuses stays in L1 (a K
// or V block is 32 KB at D = 128; both at once would not fit): first the scores of all rows
// against K^T, then dO . V^T against V^T, then the per-row softmax and the product with V (or K).

// y[0..C) (+)= sum_r w[r] * x[r * ld + 0..C). Not inlined and each partial sum starts from zero
// (added to y after it): both keep the C accumulators in registers; inlined into the kernels, or
// initialised from y (which GCC turns into a memcpy), they were spilled to the stack.
template <class A, int C, bool kAccumulate>
[[gnu::noinline]] void gemv_chunk(A* __restrict y, const A* __restrict w, const A* __restrict x,
                                  int m, int64_t ld) {
  // Partial sums of at most R rows: one fp32 chain over the D = 256/512 rows of a score was
  // several times less accurate than a BLAS product (with delta's fp32 sum, test_large_head_dims
  // failed on ~10% of its seeds). R = 128 keeps D <= 128 (and every other product) one pass.
  constexpr int R = 128;
  int r0 = 0;
  do {
    A acc[C] = {};
    const int r1 = std::min(m, r0 + R);
    for (int r = r0; r < r1; ++r) {
      const A wr = w[r];
      const A* __restrict xr = x + r * ld;
      for (int c = 0; c < C; ++c) acc[c] += wr * xr[c];
    }
    for (int c = 0; c < C; ++c) y[c] = (kAccumulate || r0 > 0) ? y[c] + acc[c] : acc[c];
  } while ((r0 += R) < m);
}

// y[0..n) (+)= sum_r w[r] * x[r * ld + 0..n); n is a multiple of kPad<A>.
template <class A, bool kAccumulate>
inline void gemv(A* y, const A* w, const A* x, int m, int64_t ld, int n) {
  int c = 0;
  for (; c + kBlock<A> <= n; c += kBlock<A>) {
    gemv_chunk<A, kBlock<A>, kAccumulate>(y + c, w, x + c, m, ld);
  }
  for (; c < n; c += kPad<A>) gemv_chunk<A, kPad<A>, kAccumulate>(y + c, w, x + c, m, ld);
}

// xt[d * kBlock + j] = x[j * Dp + d] for j < rows, zero for the rest of the block.
template <class A>
inline void transpose_block(const A* __restrict x, int rows, int Dp, A* __restrict xt) {
  constexpr int B = kBlock<A>;
  for (int d = 0; d < Dp; ++d) {
    A* __restrict t = xt + d * B;
    for (int j = 0; j < rows; ++j) t[j] = x[int64_t(j) * Dp + d];
    for (int j = rows; j < B; ++j) t[j] = A(0);
  }
}

// exp in float: Cephes' expf polynomial (about 1.4 ulp), written so that softmax loops vectorize.
// Clamps and special cases use integer masks only: GCC turns float compare-selects into branches
// (and then cannot vectorize). Below -87 gives exactly 0, above 88 inf (arguments here are
// s - max <= ~0), NaN stays NaN.
inline int32_t ordered_bits(float x) {  // monotone map of non-NaN floats to int32
  const int32_t i = std::bit_cast<int32_t>(x);
  return i ^ ((i >> 31) & 0x7FFFFFFF);
}
inline float exp_approx(float x) {
  constexpr int32_t lo = int32_t(0xC2AE0000u ^ 0x7FFFFFFFu);  // ordered_bits(-87.0f)
  constexpr int32_t hi = 0x42B00000;                          // ordered_bits(88.0f)
  const int32_t kx = ordered_bits(x);
  const int32_t kc = kx < lo ? lo : (kx > hi ? hi : kx);  // integer min/max: no branch
  const float xc = std::bit_cast<float>(kc ^ ((kc >> 31) & 0x7FFFFFFF));
  const float t = xc * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23: rounds x/ln2 to int
  const float n = t - 12582912.0f;
  const int32_t ni = std::bit_cast<int32_t>(t) - 0x4B400000;  // the same integer, from the bits
  float r = xc - n * 0.693359375f;                            // Cody-Waite: x - n ln2
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const float e = y * std::bit_cast<float>((ni + 127) << 23);  // times 2^n, n in [-126, 127]
  const int32_t xi = std::bit_cast<int32_t>(x);
  const int32_t under = -int32_t(kx < lo), over = -int32_t(kx > hi);
  const int32_t nan = -int32_t((xi & 0x7FFFFFFF) > 0x7F800000);
  int32_t bits = std::bit_cast<int32_t>(e) & ~(under | over | nan);
  bits |= (0x7F800000 & over & ~nan) | (xi & nan);
  return std::bit_cast<float>(bits);
}
inline double exp_approx(double x) { return std::exp(x); }  // fp64 is the accuracy path

// Turns raw scores s = q.k over [a, b) into logits (scale, softcap) and returns their max.
// With softcap, th[j] keeps tanh(scale * s / softcap) for the backward.
template <class A>
inline A logits(const Problem<A>& p, A* __restrict s, A* __restrict th, int a, int b) {
  if (p.softcap > 0) {
    for (int j = a; j < b; ++j) {
      const A t = std::tanh(s[j] * p.scale / p.softcap);
      th[j] = t;
      s[j] = p.softcap * t;
    }
  } else {
#pragma omp simd
    for (int j = a; j < b; ++j) s[j] *= p.scale;
  }
  A mx = -std::numeric_limits<A>::infinity();
#pragma omp simd reduction(max : mx)
  for (int j = a; j < b; ++j) mx = s[j] > mx ? s[j] : mx;
  return mx;
}

// Softmax backward of one row over [a, b). In: s = raw scores q.k, dp = dO.v. Out: s = p,
// dp = dS = p (dp - delta) (1 - tanh^2), the gradient w.r.t. the raw scores divided by scale.
template <class A>
inline void softmax_grad(const Problem<A>& p, A* __restrict s, A* __restrict dp, A* __restrict th,
                         int a, int b, A lse, A delta) {
  logits(p, s, th, a, b);
#pragma omp simd
  for (int j = a; j < b; ++j) {
    const A pj = exp_approx(s[j] - lse);
    s[j] = pj;
    dp[j] = pj * (dp[j] - delta);
  }
  if (p.softcap > 0) {
#pragma omp simd
    for (int j = a; j < b; ++j) dp[j] *= A(1) - th[j] * th[j];
  }
}

// Keys of row pq inside the key block at positions [kb, kb + bk): [a, b) relative to kb, from
// MaskRule::lowest_key (window) and causality; empty when a >= b.
template <class A>
inline void row_keys(const Problem<A>& p, int32_t pq, int32_t kb, int bk, int& a, int& b) {
  a = int(std::max(p.mask.lowest_key(pq), kb) - kb);
  b = int(std::min<int64_t>(int64_t(pq) + 1, int64_t(kb) + bk) - kb);
}

// out[i * kBlock + j] = x_i . y_j for each of the n query rows i (logical positions pq0 + i, rows
// of x Dp apart) and the keys j of the block at [kb, kb + bk) that row sees (row_keys); yt is the
// block transposed ([Dp][kBlock]). Other entries are left as they are.
template <class A>
inline void block_products(const Problem<A>& p, int32_t pq0, int n, int32_t kb, int bk, const A* x,
                           const A* yt, A* out) {
  constexpr int B = kBlock<A>;
  for (int i = 0; i < n; ++i) {
    int a, b;
    row_keys(p, pq0 + i, kb, bk, a, b);
    if (a < b) gemv<A, false>(out + i * B, x + int64_t(i) * p.Dp, yt, p.Dp, B, B);
  }
}

// Calls fn(kb, bk, row0) for each block of up to kBlock keys that query rows at logical positions
// [pq0, pq0 + n) of `seg` see, region by region in the order of the key walk; kb is the block's
// first logical position, bk its length, row0 its first packed token.
template <class A, class Fn>
void for_each_key_block(const Problem<A>& p, const Segment& seg, int32_t pq0, int n, Fn&& fn) {
  constexpr int B = kBlock<A>;
  for_each_key_region(p.segs, seg, [&](const Region& rg) {
    // Keys any row of the tile sees in this region, as logical positions [klo, khi).
    const int32_t klo = std::max(rg.pos0, p.mask.lowest_key(pq0));
    const int32_t khi = int32_t(std::min<int64_t>(int64_t(rg.pos0) + rg.len, int64_t(pq0) + n));
    for (int32_t kb = klo; kb < khi; kb += B) {
      fn(kb, int(std::min<int64_t>(B, int64_t(khi) - kb)), rg.start + (kb - rg.pos0));
    }
  });
}

// Forward for query rows [t0, t0 + n) of segment `seg`, q head h (n <= kTileSize). Leaves the
// unnormalised output in sc.o and the running max / sum of exp in sc.m / sc.l.
template <class A>
void forward_rows(const Problem<A>& p, const Segment& seg, int32_t t0, int n, int h,
                  Scratch<A>& sc) {
  constexpr int B = kBlock<A>;
  const int Dp = p.Dp;
  const int32_t pq0 = seg.pos0 + (t0 - seg.start);
  const A* q = p.q + (int64_t(h) * p.T + t0) * Dp;
  const int64_t kv_head = int64_t(h / p.group) * p.T * Dp;
  A* o = sc.o.data();
  A* m = sc.m.data();
  A* l = sc.l.data();
  A* s = sc.s.data();
  std::fill_n(o, int64_t(n) * Dp, A(0));
  std::fill_n(m, n, -std::numeric_limits<A>::infinity());
  std::fill_n(l, n, A(0));

  for_each_key_block(p, seg, pq0, n, [&](int32_t kb, int bk, int64_t row0) {
    const A* vblk = p.v + kv_head + row0 * Dp;
    transpose_block(p.k + kv_head + row0 * Dp, bk, Dp, sc.kt.data());
    block_products(p, pq0, n, kb, bk, q, sc.kt.data(), s);
    for (int i = 0; i < n; ++i) {
      int a, b;
      row_keys(p, pq0 + i, kb, bk, a, b);
      if (a >= b) continue;
      A* si = s + i * B;
      const A m_new = std::max(m[i], logits(p, si, sc.th.data(), a, b));
      const A alpha = m[i] == -std::numeric_limits<A>::infinity() ? A(0) : exp_approx(m[i] - m_new);
#pragma omp simd
      for (int j = a; j < b; ++j) si[j] = exp_approx(si[j] - m_new);
      A sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int j = a; j < b; ++j) sum += si[j];
      l[i] = alpha * l[i] + sum;
      m[i] = m_new;
      A* oi = o + int64_t(i) * Dp;
      if (alpha != A(1)) {
        for (int d = 0; d < Dp; ++d) oi[d] *= alpha;
      }
      gemv<A, true>(oi, si + a, vblk + int64_t(a) * Dp, b - a, Dp, Dp);
    }
  });
}

// dq of query rows [t0, t0 + n) of `seg`, q head h, into sc.o (still to be multiplied by scale).
template <class A>
void dq_rows(const Problem<A>& p, const Segment& seg, int32_t t0, int n, int h, Scratch<A>& sc) {
  constexpr int B = kBlock<A>;
  const int Dp = p.Dp;
  const int32_t pq0 = seg.pos0 + (t0 - seg.start);
  const int64_t row_base = int64_t(h) * p.T + t0;
  const A* q = p.q + row_base * Dp;
  const A* dout = p.dout + row_base * Dp;
  const A* lse = p.lse + row_base;
  const A* delta = p.delta + row_base;
  const int64_t kv_head = int64_t(h / p.group) * p.T * Dp;
  A* dq = sc.o.data();
  A* s = sc.s.data();
  A* dp = sc.dp.data();
  std::fill_n(dq, int64_t(n) * Dp, A(0));

  for_each_key_block(p, seg, pq0, n, [&](int32_t kb, int bk, int64_t row0) {
    const A* kblk = p.k + kv_head + row0 * Dp;
    transpose_block(kblk, bk, Dp, sc.kt.data());
    transpose_block(p.v + kv_head + row0 * Dp, bk, Dp, sc.vt.data());
    block_products(p, pq0, n, kb, bk, q, sc.kt.data(), s);
    block_products(p, pq0, n, kb, bk, dout, sc.vt.data(), dp);
    for (int i = 0; i < n; ++i) {
      int a, b;
      row_keys(p, pq0 + i, kb, bk, a, b);
      if (a >= b) continue;
      softmax_grad(p, s + i * B, dp + i * B, sc.th.data(), a, b, lse[i], delta[i]);
      gemv<A, true>(dq + int64_t(i) * Dp, dp + i * B + a, kblk + int64_t(a) * Dp, b - a, Dp, Dp);
    }
  });
}

// dk, dv (accumulated into dk/dv [nk][Dp]; dk still to be multiplied by scale) of the keys
// [k0, k0 + nk) of segment seg_index, kv head hk, nk <= kBlock. Walks every query that sees these
// keys in a fixed order: q heads of the kv group; the segment's own later queries, then its
// descendants' queries in packed order (the query walk); clipped by MaskRule::highest_query.
template <class A>
void dkdv_block(const Problem<A>& p, int32_t seg_index, int32_t k0, int nk, int hk, A* dk, A* dv,
                Scratch<A>& sc) {
  constexpr int B = kBlock<A>;
  const int Dp = p.Dp;
  const Segment& seg = p.segs[seg_index];
  const int32_t kp0 = seg.pos0 + (k0 - seg.start);
  const int32_t qmax = p.mask.highest_query(kp0 + nk - 1);
  const int64_t kv_row = (int64_t(hk) * p.T + k0) * Dp;
  transpose_block(p.k + kv_row, nk, Dp, sc.kt.data());
  transpose_block(p.v + kv_row, nk, Dp, sc.vt.data());
  A* s = sc.s.data();
  A* dp = sc.dp.data();
  A* pt = sc.pt.data();
  A* dst = sc.dst.data();
  for (int r = 0; r < p.group; ++r) {
    const int h = hk * p.group + r;
    for_each_query_segment(p.segs, seg_index, [&](int32_t qi) {
      const Segment& qs = p.segs[qi];
      const int64_t lo = std::max(qs.pos0, kp0);
      const int64_t hi = std::min<int64_t>(int64_t(qs.pos0) + qs.len - 1, qmax);
      for (int64_t qb = lo; qb <= hi; qb += kQBlock) {
        const int nq = int(std::min<int64_t>(kQBlock, hi - qb + 1));
        const int64_t row_base = int64_t(h) * p.T + qs.start + (qb - qs.pos0);
        const A* q = p.q + row_base * Dp;
        const A* dout = p.dout + row_base * Dp;
        std::fill_n(pt, B * kQBlock, A(0));
        std::fill_n(dst, B * kQBlock, A(0));
        block_products(p, int32_t(qb), nq, kp0, nk, q, sc.kt.data(), s);
        block_products(p, int32_t(qb), nq, kp0, nk, dout, sc.vt.data(), dp);
        for (int i = 0; i < nq; ++i) {
          int a, b;
          row_keys(p, int32_t(qb + i), kp0, nk, a, b);
          if (a >= b) continue;
          A* si = s + i * B;
          A* dpi = dp + i * B;
          softmax_grad(p, si, dpi, sc.th.data(), a, b, p.lse[row_base + i], p.delta[row_base + i]);
          for (int j = a; j < b; ++j) {
            pt[j * kQBlock + i] = si[j];
            dst[j * kQBlock + i] = dpi[j];
          }
        }
        for (int j = 0; j < nk; ++j) {
          gemv<A, true>(dv + int64_t(j) * Dp, pt + j * kQBlock, dout, nq, Dp, Dp);
        }
        for (int j = 0; j < nk; ++j) {
          gemv<A, true>(dk + int64_t(j) * Dp, dst + j * kQBlock, q, nq, Dp, Dp);
        }
      }
    });
  }
}
