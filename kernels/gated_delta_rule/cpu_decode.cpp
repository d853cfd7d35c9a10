// Gated delta rule decode (and prefill, below) on the CPU, in place in the state pool.
// The torch form (naive.py: gated_delta_rule_decode_slots / _depths_slots) gathers the states of a
// step's sequences out of the pool, runs a handful of batched ops over them per token, and scatters
// them back: at a decode batch every op re-reads the states, and a jump-forward step pays the ops
// once per depth. Here each (sequence, head) state is read where it lives twice per token (S^T k;
// then the decayed write k delta^T, reading S^T q off it) and written once, with every depth of
// the sequence in one task.
//
// q, k: [T, Hk, K], v: [T, H, V] in the model's dtype (fp32 or bf16), views with row strides; value
// head h reads qk head h / (H / Hk); q and k are L2-normalized (q also scaled) in the kernel
// g, beta: [T, H] fp32
// pool: [P, H, K, V] fp32 contiguous, the states at `slots` ([N] int64) updated in place
// rows depth-major: sequence n's row at depth d is offsets[d] + n, for d < lens[n]
// o: [T, H, V] in the model's dtype, written
// saved: [S, H, K, V] fp32 or empty: with rows, the state of sequence n after depth d goes to row
//        soff[d] + n when the sequence has a depth after d (what undoing a rejected draft restores)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

// One token on one head's state S [K, V] (in place): S <- e^g S; delta = beta (v - S^T k);
// S <- S + k delta^T; out = S^T q. Two passes over S: the first only reads it (S^T k, the decay
// applied to the sum), the second writes it once and reads the output off the new rows.
// At the model's head sizes (template) the [V] accumulators are fixed-size local arrays that the
// compiler keeps in vector registers (V = 64: four AVX-512 registers each); in memory, as in the
// generic form below, every row of S also loads and stores them.
template <int K, int V>
static inline void delta_step_fixed(float* __restrict__ S, const float* __restrict__ qr, const float* __restrict__ kr,
                                    const float* __restrict__ vr, float decay, float b, float* __restrict__ out) {
  float kv[V] = {}, delta[V], acc[V] = {};
  for (int i = 0; i < K; ++i) {
    const float* __restrict__ Si = S + i * V;
    const float ki = kr[i];
    for (int j = 0; j < V; ++j) kv[j] += ki * Si[j];
  }
  for (int j = 0; j < V; ++j) delta[j] = b * (vr[j] - decay * kv[j]);
  for (int i = 0; i < K; ++i) {
    float* __restrict__ Si = S + i * V;
    const float ki = kr[i], qi = qr[i];
    for (int j = 0; j < V; ++j) {
      const float s = decay * Si[j] + ki * delta[j];
      Si[j] = s;
      acc[j] += qi * s;
    }
  }
  for (int j = 0; j < V; ++j) out[j] = acc[j];
}

// kv and delta are scratch [V] for head sizes without a template instance.
static inline void delta_step(float* __restrict__ S, const float* __restrict__ qr, const float* __restrict__ kr,
                              const float* __restrict__ vr, float decay, float b, float* __restrict__ out,
                              float* __restrict__ kv, float* __restrict__ delta, int64_t K, int64_t V) {
  if (K == 64 && V == 64) return delta_step_fixed<64, 64>(S, qr, kr, vr, decay, b, out);
  if (K == 128 && V == 128) return delta_step_fixed<128, 128>(S, qr, kr, vr, decay, b, out);
  if (K == 128 && V == 64) return delta_step_fixed<128, 64>(S, qr, kr, vr, decay, b, out);
  if (K == 64 && V == 128) return delta_step_fixed<64, 128>(S, qr, kr, vr, decay, b, out);
  std::fill(kv, kv + V, 0.f);
  for (int64_t i = 0; i < K; ++i) {
    const float* __restrict__ Si = S + i * V;
    const float ki = kr[i];
    for (int64_t j = 0; j < V; ++j) kv[j] += ki * Si[j];
  }
  for (int64_t j = 0; j < V; ++j) delta[j] = b * (vr[j] - decay * kv[j]);
  std::fill(out, out + V, 0.f);
  for (int64_t i = 0; i < K; ++i) {
    float* __restrict__ Si = S + i * V;
    const float ki = kr[i], qi = qr[i];
    for (int64_t j = 0; j < V; ++j) {
      const float s = decay * Si[j] + ki * delta[j];
      Si[j] = s;
      out[j] += qi * s;
    }
  }
}

// Prefill: sequence n is rows [starts[n], ends[n]) from the state at slots[n], left there; its
// taps tap_at[j] / tap_dst[j] for j in [tap_lo[n], tap_lo[n + 1]) (ascending) copy the state after
// its first tap_at[j] tokens to pool[tap_dst[j]] (a prefix-cache checkpoint inside the chunk).
// Token by token, where the torch reference runs the chunked form: at these head sizes the state
// stays in the L1 cache and the recurrence is two passes over it per token.
//
// Both forms read the layer's tensors as they are: q, k [T, Hk, K] and v [T, H, V]
// in the model's dtype (IO: F32 or BF16 of elementwise/cpu_fused.cpp), views with row strides (the
// conv output split per head); value head h reads qk head h / (H / Hk); q and k are L2-normalized
// here (when `l2norm`, eps inside the sqrt as in naive.l2norm) and q scaled by `scale`, in fp32.
// g, beta: [T, H] fp32 contiguous; o: [T, H, V] in the model's dtype, contiguous, rounded once.
// (Preparing fp32, normalized, head-expanded copies in torch first cost half the kernel's own time.)

// One token's q or k head into fp32 at dst, times `mul` and (l2norm) over its L2 norm. Fixed
// sizes for the model's head sizes: the loops vectorize (the bf16 loads are bit shifts).
template <typename IO, int K>
static inline void load_scaled_fixed(const typename IO::S* __restrict__ src, float* __restrict__ dst, bool l2norm,
                                     float mul) {
  float x[K], ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int i = 0; i < K; ++i) {
    x[i] = IO::load(src[i]);
    ss += x[i] * x[i];
  }
  const float f = (l2norm ? 1.f / std::sqrt(ss + 1e-6f) : 1.f) * mul;
#pragma omp simd
  for (int i = 0; i < K; ++i) dst[i] = x[i] * f;
}

template <typename IO>
static inline void load_scaled(const typename IO::S* __restrict__ src, float* __restrict__ dst, int64_t K, bool l2norm,
                               float mul) {
  if (K == 64) return load_scaled_fixed<IO, 64>(src, dst, l2norm, mul);
  if (K == 128) return load_scaled_fixed<IO, 128>(src, dst, l2norm, mul);
  float ss = 0.f;
  for (int64_t i = 0; i < K; ++i) {
    dst[i] = IO::load(src[i]);
    ss += dst[i] * dst[i];
  }
  const float f = (l2norm ? 1.f / std::sqrt(ss + 1e-6f) : 1.f) * mul;
  for (int64_t i = 0; i < K; ++i) dst[i] *= f;
}

// Both forms' tokens: the layer's views (see above) and the step of one token on one value head's
// state, from its inputs to its output row.
template <typename IO>
struct TokenRows {
  using S_ = typename IO::S;
  const S_ *qp, *kp, *vp;
  S_* op;
  const float *gp, *bp;
  int64_t qs0, qs1, ks0, ks1, vs0, vs1, H, G, K, V;
  bool l2norm;
  float scale;

  TokenRows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
            const at::Tensor& beta, at::Tensor& o, bool l2norm_, float scale_)
      : qp(reinterpret_cast<const S_*>(q.data_ptr())), kp(reinterpret_cast<const S_*>(k.data_ptr())),
        vp(reinterpret_cast<const S_*>(v.data_ptr())), op(reinterpret_cast<S_*>(o.data_ptr())),
        gp(g.data_ptr<float>()), bp(beta.data_ptr<float>()), qs0(q.stride(0)), qs1(q.stride(1)),
        ks0(k.stride(0)), ks1(k.stride(1)), vs0(v.stride(0)), vs1(v.stride(1)), H(v.size(1)),
        G(v.size(1) / q.size(1)), K(q.size(2)), V(v.size(2)), l2norm(l2norm_), scale(scale_) {}

  struct Scratch {
    std::vector<float> kv, delta, q, k, v, out;
    Scratch(int64_t K, int64_t V) : kv(V), delta(V), q(K), k(K), v(V), out(V) {}
  };

  // token t on value head h, whose state S is updated in place; its output row written
  void step(float* S, int64_t t, int64_t h, Scratch& w) const {
    const int64_t hk = h / G, r = t * H + h;
    load_scaled<IO>(qp + t * qs0 + hk * qs1, w.q.data(), K, l2norm, scale);
    load_scaled<IO>(kp + t * ks0 + hk * ks1, w.k.data(), K, l2norm, 1.f);
    const S_* vt = vp + t * vs0 + h * vs1;
#pragma omp simd
    for (int64_t i = 0; i < V; ++i) w.v[i] = IO::load(vt[i]);
    delta_step(S, w.q.data(), w.k.data(), w.v.data(), std::exp(gp[r]), bp[r], w.out.data(), w.kv.data(),
               w.delta.data(), K, V);
    S_* ot = op + r * V;
#pragma omp simd
    for (int64_t i = 0; i < V; ++i) ot[i] = IO::store(w.out[i]);
  }
};

static void check_views(const char* name, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& o) {
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
              q.scalar_type() == o.scalar_type(), name, ": q, k, v and o in one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, name, ": fp32 or bf16");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && o.is_contiguous(),
              name, ": unit-stride heads, o contiguous");
  TORCH_CHECK(v.size(1) % q.size(1) == 0, name, ": value heads a multiple of qk heads");
  TORCH_CHECK(k.size(1) == q.size(1) && k.size(2) == q.size(2) && k.size(0) == q.size(0) && v.size(0) == q.size(0),
              name, ": q and k of one shape, one row per token in q, k and v");
}

template <typename IO>
static void gdr_prefill_impl(const TokenRows<IO>& rows, at::Tensor& pool, const at::Tensor& starts,
                             const at::Tensor& ends, const at::Tensor& slots, const at::Tensor& tap_lo,
                             const at::Tensor& tap_at, const at::Tensor& tap_dst) {
  const int64_t N = slots.size(0), H = rows.H, K = rows.K, V = rows.V;
  const int64_t *st = starts.data_ptr<int64_t>(), *en = ends.data_ptr<int64_t>(), *sl = slots.data_ptr<int64_t>();
  const int64_t *tl = tap_lo.data_ptr<int64_t>(), *ta = tap_at.data_ptr<int64_t>(), *td = tap_dst.data_ptr<int64_t>();
  float* pp = pool.data_ptr<float>();
  at::parallel_for(0, N * H, 1, [&](int64_t begin, int64_t end) {
    typename TokenRows<IO>::Scratch w(K, V);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / H, h = task % H;
      float* S = pp + (sl[n] * H + h) * K * V;
      int64_t j = tl[n];
      for (int64_t t = st[n]; t < en[n]; ++t) {
        rows.step(S, t, h, w);
        if (j < tl[n + 1] && ta[j] == t + 1 - st[n]) {
          std::memcpy(pp + (td[j] * H + h) * K * V, S, K * V * sizeof(float));
          ++j;
        }
      }
    }
  });
}

void gdr_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                 const at::Tensor& beta, at::Tensor& o, at::Tensor& pool, const at::Tensor& starts,
                 const at::Tensor& ends, const at::Tensor& slots, const at::Tensor& tap_lo, const at::Tensor& tap_at,
                 const at::Tensor& tap_dst, bool l2norm, double scale) {
  check_views("gdr_prefill", q, k, v, o);
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == at::kBFloat16)
    return gdr_prefill_impl(TokenRows<BF16>(q, k, v, g, beta, o, l2norm, sc), pool, starts, ends, slots, tap_lo,
                            tap_at, tap_dst);
  gdr_prefill_impl(TokenRows<F32>(q, k, v, g, beta, o, l2norm, sc), pool, starts, ends, slots, tap_lo, tap_at,
                   tap_dst);
}

// Decode (and a jump-forward step's depths): rows depth-major, sequence n's row at depth d is
// t = offsets[d] + n, d < lens[n]; the inputs and o as gdr_prefill's; saved as in the header.
template <typename IO>
static void gdr_decode_impl(const TokenRows<IO>& rows, at::Tensor& pool, const at::Tensor& slots,
                            const at::Tensor& offsets, const at::Tensor& lens, at::Tensor& saved,
                            const at::Tensor& soff) {
  const int64_t N = slots.size(0), H = rows.H, K = rows.K, V = rows.V;
  const int64_t *sl = slots.data_ptr<int64_t>(), *off = offsets.data_ptr<int64_t>(), *ln = lens.data_ptr<int64_t>();
  const int64_t* so = soff.data_ptr<int64_t>();
  float* pp = pool.data_ptr<float>();
  float* sp = saved.numel() ? saved.data_ptr<float>() : nullptr;
  at::parallel_for(0, N * H, 1, [&](int64_t begin, int64_t end) {
    typename TokenRows<IO>::Scratch w(K, V);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / H, h = task % H;
      float* S = pp + (sl[n] * H + h) * K * V;
      for (int64_t d = 0; d < ln[n]; ++d) {
        rows.step(S, off[d] + n, h, w);
        if (sp != nullptr && d + 1 < ln[n])
          std::memcpy(sp + ((so[d] + n) * H + h) * K * V, S, K * V * sizeof(float));
      }
    }
  });
}

void gdr_decode_depths(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                       const at::Tensor& beta, at::Tensor& pool, const at::Tensor& slots, const at::Tensor& offsets,
                       const at::Tensor& lens, at::Tensor& o, at::Tensor& saved, const at::Tensor& soff, bool l2norm,
                       double scale) {
  check_views("gdr_decode_depths", q, k, v, o);
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == at::kBFloat16)
    return gdr_decode_impl(TokenRows<BF16>(q, k, v, g, beta, o, l2norm, sc), pool, slots, offsets, lens, saved, soff);
  gdr_decode_impl(TokenRows<F32>(q, k, v, g, beta, o, l2norm, sc), pool, slots, offsets, lens, saved, soff);
}
