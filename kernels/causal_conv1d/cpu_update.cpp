// Causal conv1d decode update on the CPU, in place in the state pool (see naive.py:
// causal_conv1d_update_slots / _depths_slots, which gather the states, shift them with a few
// batched ops per depth and scatter them back). Each sequence's W-1 carried inputs per channel are
// read where they live, every depth of the sequence runs on them in registers, and they are
// written back once.
//
// x: [T, C] fp32 (rows of any stride), rows depth-major: sequence n's row at depth d is offsets[d] + n,
//    d < lens[n]
// pool: [P, C, W-1] fp32 contiguous, updated in place at slots ([N] int64)
// weight: [C, W] fp32;  y: [T, C] fp32 written (SiLU applied when `silu`)
// saved: [S, C, W-1] fp32 or empty: the state of sequence n after depth d goes to row soff[d] + n
//        when the sequence has a depth after d
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#ifdef RF_BF16_VECTOR
template <bool silu>
static void conv4_update16(const at::Tensor& x, at::Tensor& pool, const at::Tensor& weight, const at::Tensor& slots,
                           const at::Tensor& offsets, const at::Tensor& lens, at::Tensor& y, at::Tensor& saved,
                           const at::Tensor& soff);
#endif

void conv_update_depths(const at::Tensor& x, at::Tensor& pool, const at::Tensor& weight, const at::Tensor& slots,
                        const at::Tensor& offsets, const at::Tensor& lens, at::Tensor& y, at::Tensor& saved,
                        const at::Tensor& soff, bool silu) {
#ifdef RF_BF16_VECTOR
  if (weight.size(1) == 4 && x.size(1) % 16 == 0) {
    if (silu) return conv4_update16<true>(x, pool, weight, slots, offsets, lens, y, saved, soff);
    return conv4_update16<false>(x, pool, weight, slots, offsets, lens, y, saved, soff);
  }
#endif
  const int64_t N = slots.size(0), C = x.size(1), W = weight.size(1), M = W - 1, xs = x.stride(0);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  const int64_t *sl = slots.data_ptr<int64_t>(), *off = offsets.data_ptr<int64_t>(), *ln = lens.data_ptr<int64_t>();
  const int64_t* so = soff.data_ptr<int64_t>();
  float* pp = pool.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* sp = saved.numel() ? saved.data_ptr<float>() : nullptr;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float* st = pp + sl[n] * C * M;
      for (int64_t c = 0; c < C; ++c) {
        float* s = st + c * M;
        const float* w = wp + c * W;
        for (int64_t d = 0; d < ln[n]; ++d) {
          const int64_t r = off[d] + n;
          const float xin = xp[r * xs + c];
          float a = w[M] * xin;
          for (int64_t j = 0; j < M; ++j) a += w[j] * s[j];
          for (int64_t j = 0; j + 1 < M; ++j) s[j] = s[j + 1];     // shift: drop the oldest input
          if (M > 0) s[M - 1] = xin;
          yp[r * C + c] = silu ? a / (1.f + std::exp(-a)) : a;
          if (sp != nullptr && d + 1 < ln[n])
            for (int64_t j = 0; j < M; ++j) sp[((so[d] + n) * C + c) * M + j] = s[j];
        }
      }
    }
  });
}

// Prefill: sequence n is rows [starts[n], ends[n]) of x / y, from the W-1 inputs at slots[n], which
// it leaves there; taps as in gdr_prefill (tap_at[j] tokens in: pool[tap_dst[j]] = the W-1 inputs
// before token tap_at[j]). Tasks are (sequence, block of channels); token by token, the block's
// channels side by side (contiguous in x and y), their windows in a small local array.
// x (rows of any stride) and y in the model's dtype (fp32 or bf16: F32 / BF16 of elementwise/cpu_fused.cpp, built
// before this file), the conv and the SiLU (when `silu`) in fp32, y rounded once: one pass over
// the rows, where casting x to fp32, a separate SiLU and casting back were four.
// The prefill forms' arguments as pointers (both read them alike).
template <typename S>
struct Rows {
  const S* xp;
  int64_t xs;     // x's row stride: the in-projection's output split, read where it lies
  S* yp;
  float* pp;
  const float* wp;
  const int64_t *st, *en, *sl, *tl, *ta, *td;
  Rows(const at::Tensor& x, at::Tensor& y, at::Tensor& pool, const at::Tensor& weight, const at::Tensor& starts,
       const at::Tensor& ends, const at::Tensor& slots, const at::Tensor& tap_lo, const at::Tensor& tap_at,
       const at::Tensor& tap_dst)
      : xp(reinterpret_cast<const S*>(x.data_ptr())), xs(x.stride(0)), yp(reinterpret_cast<S*>(y.data_ptr())),
        pp(pool.data_ptr<float>()), wp(weight.data_ptr<float>()), st(starts.data_ptr<int64_t>()),
        en(ends.data_ptr<int64_t>()), sl(slots.data_ptr<int64_t>()), tl(tap_lo.data_ptr<int64_t>()),
        ta(tap_at.data_ptr<int64_t>()), td(tap_dst.data_ptr<int64_t>()) {}
};

template <typename IO>
static void conv_prefill_impl(const at::Tensor& x, at::Tensor& y, at::Tensor& pool, const at::Tensor& weight,
                              const at::Tensor& starts, const at::Tensor& ends, const at::Tensor& slots,
                              const at::Tensor& tap_lo, const at::Tensor& tap_at, const at::Tensor& tap_dst, bool silu) {
  using S = typename IO::S;
  const int64_t N = slots.size(0), C = x.size(1), W = weight.size(1), M = W - 1;
  constexpr int64_t BLOCK = 64, MAXW = 8;
  TORCH_CHECK(W <= MAXW, "conv kernel width above ", MAXW);
  const int64_t blocks = (C + BLOCK - 1) / BLOCK;
  const Rows<S> r(x, y, pool, weight, starts, ends, slots, tap_lo, tap_at, tap_dst);
  at::parallel_for(0, N * blocks, 1, [&](int64_t begin, int64_t end) {
    float win[MAXW][BLOCK], wt[MAXW][BLOCK];      // win[i][c]: the i-th oldest input; wt[i][c] = weight[c, i]
    float xin[BLOCK], acc[BLOCK];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / blocks, c0 = (task % blocks) * BLOCK, B = std::min(C, c0 + BLOCK) - c0;
      float* s = r.pp + r.sl[n] * C * M;
      for (int64_t c = 0; c < B; ++c) {
        for (int64_t i = 0; i < M; ++i) win[i][c] = s[(c0 + c) * M + i];
        for (int64_t i = 0; i < W; ++i) wt[i][c] = r.wp[(c0 + c) * W + i];
      }
      int64_t j = r.tl[n];
      for (int64_t t = r.st[n]; t < r.en[n]; ++t) {
        const S* __restrict__ xr = r.xp + t * r.xs + c0;
        S* __restrict__ yr = r.yp + t * C + c0;
        for (int64_t c = 0; c < B; ++c) xin[c] = IO::load(xr[c]);
        for (int64_t c = 0; c < B; ++c) {
          float a = wt[M][c] * xin[c];
          for (int64_t i = 0; i < M; ++i) a += wt[i][c] * win[i][c];
          acc[c] = a;
        }
        if (silu)
          for (int64_t c = 0; c < B; ++c) acc[c] = acc[c] / (1.0f + exp_fast(-acc[c]));
        for (int64_t c = 0; c < B; ++c) yr[c] = IO::store(acc[c]);
        for (int64_t i = 0; i + 1 < M; ++i)
          for (int64_t c = 0; c < B; ++c) win[i][c] = win[i + 1][c];
        if (M > 0)
          for (int64_t c = 0; c < B; ++c) win[M - 1][c] = xin[c];
        if (j < r.tl[n + 1] && r.ta[j] == t + 1 - r.st[n]) {
          for (int64_t c = 0; c < B; ++c)
            for (int64_t i = 0; i < M; ++i) r.pp[(r.td[j] * C + c0 + c) * M + i] = win[i][c];
          ++j;
        }
      }
      for (int64_t c = 0; c < B; ++c)
        for (int64_t i = 0; i < M; ++i) s[(c0 + c) * M + i] = win[i][c];
    }
  });
}

#ifdef RF_BF16_VECTOR
// The same for Qwen3.5's width (4) and whole blocks of 16 channels, in AVX-512 registers: the
// window is three vectors and a token costs one load, four FMAs, the SiLU and one store. The loop
// above keeps its window in a local array with runtime bounds, which GCC neither keeps in registers
// nor vectorizes well: several times this.
static inline __m512 conv_ld16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 conv_ld16(const uint16_t* p) { return load_bf16x16(p); }
static inline void conv_st16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void conv_st16(uint16_t* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16x16(v)); }

// lane c holds c * m: the offsets of 16 channels' carried inputs in the pool (m = W - 1) or of
// their weights (m = W)
static inline __m512i lanes_by(int m) {
  return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(m));
}

// one token of the width-4 conv on 16 channels: w0 a0 + w1 a1 + w2 a2 + w3 x (a0 the oldest input),
// SiLU'd when asked; every form (prefill, decode) in this order, so a token comes out alike in both
template <bool silu>
static inline __m512 conv4_token(const __m512 w[4], __m512 a0, __m512 a1, __m512 a2, __m512 xin) {
  const __m512 acc = _mm512_fmadd_ps(w[0], a0, _mm512_fmadd_ps(w[1], a1, _mm512_fmadd_ps(w[2], a2, _mm512_mul_ps(w[3], xin))));
  if (!silu) return acc;
  return _mm512_div_ps(acc, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_fast16(_mm512_sub_ps(_mm512_setzero_ps(), acc))));
}

// the 16 channels' window (their three carried inputs) to or from the pool at d
static inline void window_to(float* d, __m512i lanes, __m512 a0, __m512 a1, __m512 a2) {
  _mm512_i32scatter_ps(d, lanes, a0, 4);
  _mm512_i32scatter_ps(d + 1, lanes, a1, 4);
  _mm512_i32scatter_ps(d + 2, lanes, a2, 4);
}
static inline void window_from(const float* d, __m512i lanes, __m512& a0, __m512& a1, __m512& a2) {
  a0 = _mm512_i32gather_ps(lanes, d, 4);
  a1 = _mm512_i32gather_ps(lanes, d + 1, 4);
  a2 = _mm512_i32gather_ps(lanes, d + 2, 4);
}
static inline void weights_from(const float* w, __m512i wlanes, __m512 out[4]) {
  for (int i = 0; i < 4; ++i) out[i] = _mm512_i32gather_ps(wlanes, w + i, 4);
}

// A task is G blocks of 16 channels side by side (64 channels: a row's 256 bytes, whole cache lines,
// where x is the in-projection's split and its rows are not line-aligned; one block a task read
// half-lines twice, slower than copying x first).
template <typename IO, bool silu, int G>
static void conv4_prefill16(const at::Tensor& x, at::Tensor& y, at::Tensor& pool, const at::Tensor& weight,
                            const at::Tensor& starts, const at::Tensor& ends, const at::Tensor& slots,
                            const at::Tensor& tap_lo, const at::Tensor& tap_at, const at::Tensor& tap_dst) {
  using S = typename IO::S;
  constexpr int W = 4, M = 3, L = 16;
  const int64_t N = slots.size(0), C = x.size(1), blocks = C / (L * G);
  const Rows<S> r(x, y, pool, weight, starts, ends, slots, tap_lo, tap_at, tap_dst);
  // lane c of the window vectors: channel c0 + c, whose M carried inputs are contiguous in the pool
  const __m512i lanes = lanes_by(M), wlanes = lanes_by(W);
  at::parallel_for(0, N * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / blocks, c0 = (task % blocks) * L * G;
      float* s = r.pp + (r.sl[n] * C + c0) * M;
      __m512 w[G][4], a0[G], a1[G], a2[G];
      for (int g = 0; g < G; ++g) {
        weights_from(r.wp + (c0 + g * L) * W, wlanes, w[g]);
        window_from(s + g * L * M, lanes, a0[g], a1[g], a2[g]);
      }
      int64_t j = r.tl[n];
      for (int64_t t = r.st[n]; t < r.en[n]; ++t) {
        const S* xr = r.xp + t * r.xs + c0;
        S* yr = r.yp + t * C + c0;
        for (int g = 0; g < G; ++g) {
          const __m512 xin = conv_ld16(xr + g * L);
          conv_st16(yr + g * L, conv4_token<silu>(w[g], a0[g], a1[g], a2[g], xin));
          a0[g] = a1[g];
          a1[g] = a2[g];
          a2[g] = xin;
        }
        if (j < r.tl[n + 1] && r.ta[j] == t + 1 - r.st[n]) {
          for (int g = 0; g < G; ++g) window_to(r.pp + (r.td[j] * C + c0 + g * L) * M, lanes, a0[g], a1[g], a2[g]);
          ++j;
        }
      }
      for (int g = 0; g < G; ++g) window_to(s + g * L * M, lanes, a0[g], a1[g], a2[g]);
    }
  });
}

// The decode update (and a jump-forward step's depths) in the same registers: a sequence's window
// is gathered from its slot once, every depth of it runs on the three vectors, and it is scattered
// back once. The loop above, a scalar exp per channel among them, took several times this.
template <bool silu>
static void conv4_update16(const at::Tensor& x, at::Tensor& pool, const at::Tensor& weight, const at::Tensor& slots,
                           const at::Tensor& offsets, const at::Tensor& lens, at::Tensor& y, at::Tensor& saved,
                           const at::Tensor& soff) {
  constexpr int W = 4, M = 3, L = 16;
  const int64_t N = slots.size(0), C = x.size(1), blocks = C / L, xs = x.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t *sl = slots.data_ptr<int64_t>(), *off = offsets.data_ptr<int64_t>(), *ln = lens.data_ptr<int64_t>();
  const int64_t* so = soff.data_ptr<int64_t>();
  float* pp = pool.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* sp = saved.numel() ? saved.data_ptr<float>() : nullptr;
  const __m512i lanes = lanes_by(M), wlanes = lanes_by(W);
  at::parallel_for(0, N * blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / blocks, c0 = (task % blocks) * L;
      float* s = pp + (sl[n] * C + c0) * M;
      __m512 w[4], a0, a1, a2;
      weights_from(wp + c0 * W, wlanes, w);
      window_from(s, lanes, a0, a1, a2);
      for (int64_t d = 0; d < ln[n]; ++d) {
        const int64_t r = off[d] + n;
        const __m512 xin = _mm512_loadu_ps(xp + r * xs + c0);
        _mm512_storeu_ps(yp + r * C + c0, conv4_token<silu>(w, a0, a1, a2, xin));
        a0 = a1;
        a1 = a2;
        a2 = xin;
        if (sp != nullptr && d + 1 < ln[n]) window_to(sp + ((so[d] + n) * C + c0) * M, lanes, a0, a1, a2);
      }
      window_to(s, lanes, a0, a1, a2);
    }
  });
}
#endif

template <typename IO>
static void conv_prefill_io(const at::Tensor& x, at::Tensor& y, at::Tensor& pool, const at::Tensor& weight,
                            const at::Tensor& starts, const at::Tensor& ends, const at::Tensor& slots,
                            const at::Tensor& tap_lo, const at::Tensor& tap_at, const at::Tensor& tap_dst, bool silu) {
#ifdef RF_BF16_VECTOR
  if (weight.size(1) == 4 && x.size(1) % 64 == 0) {
    if (silu)
      return conv4_prefill16<IO, true, 4>(x, y, pool, weight, starts, ends, slots, tap_lo, tap_at, tap_dst);
    return conv4_prefill16<IO, false, 4>(x, y, pool, weight, starts, ends, slots, tap_lo, tap_at, tap_dst);
  }
  if (weight.size(1) == 4 && x.size(1) % 16 == 0) {
    if (silu)
      return conv4_prefill16<IO, true, 1>(x, y, pool, weight, starts, ends, slots, tap_lo, tap_at, tap_dst);
    return conv4_prefill16<IO, false, 1>(x, y, pool, weight, starts, ends, slots, tap_lo, tap_at, tap_dst);
  }
#endif
  conv_prefill_impl<IO>(x, y, pool, weight, starts, ends, slots, tap_lo, tap_at, tap_dst, silu);
}

void conv_prefill(const at::Tensor& x, at::Tensor& y, at::Tensor& pool, const at::Tensor& weight,
                  const at::Tensor& starts, const at::Tensor& ends, const at::Tensor& slots, const at::Tensor& tap_lo,
                  const at::Tensor& tap_at, const at::Tensor& tap_dst, bool silu) {
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "conv_prefill: x and y in one dtype");
  if (x.scalar_type() == at::kBFloat16)
    return conv_prefill_io<BF16>(x, y, pool, weight, starts, ends, slots, tap_lo, tap_at, tap_dst, silu);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "conv_prefill: fp32 or bf16");
  conv_prefill_io<F32>(x, y, pool, weight, starts, ends, slots, tap_lo, tap_at, tap_dst, silu);
}
