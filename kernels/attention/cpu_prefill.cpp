// Prefill attention on the CPU in bf16 with AVX512-BF16 (vdpbf16ps): many query rows over one K/V
// (a group's shared prefix, or one sequence causally). cascade.attend_lse's kernel form.
//
// Why: torch's CPU flash-attention op was most of a dense agent-workload step on a CPU without AMX
// (its bf16 GEMMs are oneDNN calls on 64-wide blocks, and its softmax a pass of its own). Here the two products run as register-blocked
// vdpbf16ps micro-kernels over K and V packed once per call, and the online softmax stays in L1
// between them.
//
// q: [T, Hq, D] bf16 (any strides but the last);  k, v: [S, Hkv, D] bf16 (the same)
// q_pos: [T] int64 (key j visible to query t iff j <= q_pos[t]) or empty (every key visible)
// slots: [S] int64: key j is row slots[j] of k and v (a shared prefix read where it lies in the pool,
// not gathered: a gather would copy the whole prefix at every decode step), or empty: key j is row j
// o: [T, Hq, D] fp32 contiguous, written;  lse: [T, Hq] fp32 contiguous, written: the natural log of
// the softmax's denominator (cascade's merge), -inf with o = 0 for a row that sees no key.
// Numerics as torch's op on bf16 inputs: q.k accumulated in fp32, the exponentials summed in fp32
// and rounded to bf16 for the product with V, accumulated in fp32.
// Uses exp_fast, to_bf16x16, shared_for and RF_BF16_VECTOR from elementwise/cpu_fused.cpp (one
// translation unit).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
namespace rf_attn {

constexpr int64_t kKeyBlock = 64;   // keys per packed K block: the QK micro-kernels' 4 vectors of 16

constexpr float kLog2e = 1.44269504088896341f;

// 2^t for t <= 0 (the softmax's exponent in base 2): 2^round(t) by scalef times 2^f, f in
// [-0.5, 0.5], by its Taylor polynomial of degree 5 (relative error below 3e-6, far below the bf16
// rounding P gets next; in fp32 ~25 ulp of a weight, below the 1e-5 the fp32 kernel is held to).
// Half the instructions of exp_fast16, which was a sixth of the bf16 kernel's time.
static inline __m512 exp2_16(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}


// Scratch of n words for one call's packed K or V, kept by the calling thread and only grown, up to
// 32 MB (a larger one is the call's own: its page faults are small beside its work). A fresh buffer
// per call goes back to the system when freed (glibc trims the heap's top past twice the mmap
// threshold) and is faulted in anew each time, at a cost well beyond a decode row's work. `Which`
// tells a call's buffers apart.
template <int Which>
class Scratch {
 public:
  explicit Scratch(size_t n) {
    constexpr size_t kKeep = size_t(8) << 20;
    if (n > kKeep) {
      own_.reset(new uint32_t[n]);
      p_ = own_.get();
      return;
    }
    thread_local std::unique_ptr<uint32_t[]> kept;
    thread_local size_t cap = 0;
    if (cap < n) {
      kept.reset(new uint32_t[n]);
      cap = n;
    }
    p_ = kept.get();
  }
  uint32_t* get() const { return p_; }
  float* f32() const { return reinterpret_cast<float*>(p_); }

 private:
  std::unique_ptr<uint32_t[]> own_;
  uint32_t* p_;
};

// the K/V row of key j: slots[j], or j where there are no slots
static inline int64_t row_of(const int64_t* slots, int64_t j) { return slots ? slots[j] : j; }

// a 16 x 16 block of 32-bit values transposed in registers: r[c] becomes what was column c
static inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
  }
}

// K of one kv head as 32-bit words (bf16 pairs along the head dim, or fp32 values), 64 keys side by
// side: out[(b * W + w) * 64 + j] = word w of key 64b + j's row (W words a row; key j's row is
// row_of(slots, j)); keys past S are zero.
// By 16 x 16 register transposes: a decode step's shared prefix is packed anew for its few query
// rows, and the scalar form took as long as the products
static void pack_k(const char* k, int64_t row_bytes, const int64_t* slots, int64_t S, int64_t Sp, int64_t W,
                   uint32_t* out) {
  __m512i r[16];
  for (int64_t j0 = 0; j0 < Sp; j0 += 16) {
    uint32_t* blk = out + (j0 / kKeyBlock) * W * kKeyBlock + j0 % kKeyBlock;
    for (int64_t c0 = 0; c0 < W; c0 += 16) {
      for (int i = 0; i < 16; ++i)
        r[i] = j0 + i < S ? _mm512_loadu_si512(reinterpret_cast<const uint32_t*>(k + row_of(slots, j0 + i) * row_bytes) + c0)
                          : _mm512_setzero_si512();
      transpose16(r);
      for (int c = 0; c < 16; ++c) _mm512_storeu_si512(blk + (c0 + c) * kKeyBlock, r[c]);
    }
  }
}

}  // namespace rf_attn
#endif

#ifdef RF_BF16_VECTOR
namespace rf_attn {

constexpr int64_t KB = kKeyBlock;
constexpr int64_t QB = 32;   // query rows per task (rows are (token, query head) pairs of one kv head)
constexpr int64_t SB = 128;  // keys per softmax block: scores [QB, SB] fp32 and P [QB, SB] bf16 stay in L1

// V of one kv head as bf16 pairs along the keys: out[jp * D + d] = (v[2jp, d], v[2jp + 1, d]) (rows
// by row_of)
static void pack_v(const uint16_t* v, int64_t vs, const int64_t* slots, int64_t S, int64_t Sp, int64_t D,
                   uint32_t* out) {
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t jp = 0; jp < Sp / 2; ++jp) {
    const int64_t a = 2 * jp, b = 2 * jp + 1;
    uint32_t* dst = out + jp * D;
    for (int64_t d = 0; d < D; d += 16) {
      const __m256i lo = a < S ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + row_of(slots, a) * vs + d)) : zero;
      const __m256i hi = b < S ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + row_of(slots, b) * vs + d)) : zero;
      _mm512_storeu_si512(dst + d, _mm512_or_si512(_mm512_cvtepu16_epi32(lo),
                                                   _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16)));
    }
  }
}

static inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// scores s[r, 0:64] = q[r] . K block, for 4 rows r (q rows contiguous bf16, D wide)
static inline void qk_4x64(const uint16_t* q, int64_t D, const uint32_t* kb, float* s, int64_t ss) {
  __m512 acc[4][4];
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(q);
  const int64_t DP = D / 2, qs = D / 2;
  for (int64_t p = 0; p < DP; ++p) {
    const uint32_t* kr = kb + p * KB;
    const __m512i k0 = _mm512_loadu_si512(kr), k1 = _mm512_loadu_si512(kr + 16), k2 = _mm512_loadu_si512(kr + 32),
                  k3 = _mm512_loadu_si512(kr + 48);
    for (int r = 0; r < 4; ++r) {
      const __m512i qb = _mm512_set1_epi32(static_cast<int>(q32[r * qs + p]));
      acc[r][0] = dp(acc[r][0], qb, k0);
      acc[r][1] = dp(acc[r][1], qb, k1);
      acc[r][2] = dp(acc[r][2], qb, k2);
      acc[r][3] = dp(acc[r][3], qb, k3);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * ss + 16 * c, acc[r][c]);
}

// o[r, :] += P[r, 0:n] V[0:n] for R rows (P bf16 rows of stride ps, n even), DV vectors of 16 wide
template <int R, int DV>
static inline void pv(const uint16_t* P, int64_t ps, const uint32_t* vp, int64_t n, float* o) {
  constexpr int64_t D = 16 * DV;
  __m512 acc[R][DV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + 16 * c);
  for (int64_t jp = 0; jp < n / 2; ++jp) {
    __m512i vv[DV];
    for (int c = 0; c < DV; ++c) vv[c] = _mm512_loadu_si512(vp + jp * D + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512i pb = _mm512_set1_epi32(static_cast<int>(reinterpret_cast<const uint32_t*>(P + r * ps)[jp]));
      for (int c = 0; c < DV; ++c) acc[r][c] = dp(acc[r][c], pb, vv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]);
}

template <int DV>
static void pv_rows(const uint16_t* P, int64_t ps, const uint32_t* vp, int64_t n, float* o, int64_t rows) {
  constexpr int R = DV <= 4 ? 4 : DV <= 8 ? 2 : 1;   // R x DV accumulators: at most 16 of 32 registers
  int64_t r = 0;
  for (; r + R <= rows; r += R) pv<R, DV>(P + r * ps, ps, vp, n, o + r * 16 * DV);
  for (; r < rows; ++r) pv<1, DV>(P + r * ps, ps, vp, n, o + r * 16 * DV);
}


struct Task {
  const uint16_t* q;
  int64_t qs0, qs1;
  const int64_t* pos;   // nullptr: no mask
  int64_t T, G, D, S, Sp;
  float scale;
};

// one task: QB rows (t * G + g for t in tokens, g in the kv head's query heads) of kv head h
template <int DV>
static void rows_task(const Task& a, int64_t h, int64_t r0, const uint32_t* kp, const uint32_t* vp,
                      float* op, float* lsep, int64_t Hq, uint16_t* qbuf, float* s, uint16_t* P, float* o,
                      float* m, float* l) {
  const int64_t D = a.D, n = std::min(QB, a.T * a.G - r0);
  int64_t lim = a.S;                                        // keys [0, lim) may be visible to a row
  int64_t full = a.S;                                       // keys [0, full) visible to every row
  if (a.pos != nullptr) {
    int64_t hi = -1, lo = a.S;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = a.pos[(r0 + i) / a.G];
      hi = std::max(hi, p);
      lo = std::min(lo, p + 1);
    }
    lim = std::min(a.S, hi + 1);
    full = std::max<int64_t>(0, std::min(lo, a.S));
  }
  for (int64_t i = 0; i < QB; ++i) {
    uint16_t* dst = qbuf + i * D;
    if (i < n) {
      const int64_t t = (r0 + i) / a.G, g = (r0 + i) % a.G;
      const uint16_t* src = a.q + t * a.qs0 + (h * a.G + g) * a.qs1;
      std::copy(src, src + D, dst);
    } else {
      std::fill(dst, dst + D, 0);
    }
    m[i] = -INFINITY;
    l[i] = 0.f;
  }
  std::fill(o, o + QB * D, 0.f);
  const __m512 sl = _mm512_set1_ps(a.scale * kLog2e), ninf = _mm512_set1_ps(-INFINITY);
  for (int64_t j0 = 0; j0 < lim; j0 += SB) {
    const int64_t nk = std::min(SB, a.Sp - j0);           // a multiple of KB (Sp is)
    for (int64_t b = 0; b < nk / KB; ++b)
      for (int64_t i = 0; i < QB; i += 4)
        qk_4x64(qbuf + i * D, D, kp + (j0 / KB + b) * (D / 2) * KB, s + i * SB + b * KB, SB);
    const bool masked = j0 + nk > full;
    for (int64_t i = 0; i < n; ++i) {
      const float* si = s + i * SB;
      const int64_t vis = std::min(a.pos ? a.pos[(r0 + i) / a.G] + 1 : a.S, a.S) - j0;   // visible keys of this block
      // the keys of 16-key chunk c this row sees (all of them outside a masked block)
      auto keep = [&](int64_t c) -> __mmask16 {
        const int64_t left = vis - c;
        return !masked || left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
      };
      __m512 mx = ninf;
      for (int64_t c = 0; c < nk; c += 16) mx = _mm512_mask_max_ps(mx, keep(c), mx, _mm512_loadu_ps(si + c));
      const float mnew = std::max(m[i], _mm512_reduce_max_ps(mx) * a.scale);   // scale > 0: the max commutes
      uint16_t* pi = P + i * SB;
      if (mnew == -INFINITY) {                             // nothing visible yet: P = 0
        std::fill(pi, pi + nk, 0);
        continue;
      }
      const float alpha = m[i] == -INFINITY ? 0.f : exp_fast(m[i] - mnew);
      const __m512 off = _mm512_set1_ps(-mnew * kLog2e);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = 0; c < nk; c += 16) {
        const __m512 e = _mm512_maskz_mov_ps(keep(c), exp2_16(_mm512_fmadd_ps(_mm512_loadu_ps(si + c), sl, off)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pi + c), to_bf16x16(e));
      }
      l[i] = l[i] * alpha + _mm512_reduce_add_ps(sum);
      m[i] = mnew;
      if (alpha != 1.f) {
        const __m512 av = _mm512_set1_ps(alpha);
        for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(o + i * D + c, _mm512_mul_ps(_mm512_loadu_ps(o + i * D + c), av));
      }
    }
    pv_rows<DV>(P, SB, vp + (j0 / 2) * D, nk, o, n);
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = (r0 + i) / a.G, hq = h * a.G + (r0 + i) % a.G;
    float* dst = op + (t * Hq + hq) * D;
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    for (int64_t d = 0; d < D; ++d) dst[d] = o[i * D + d] * inv;
    lsep[t * Hq + hq] = l[i] > 0.f ? m[i] + std::log(l[i]) : -INFINITY;
  }
}

template <int DV>
static void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_pos,
                   const int64_t* slots, int64_t S, double scale, at::Tensor& o, at::Tensor& lse) {
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1), G = Hq / Hkv;
  const int64_t Sp = (S + KB - 1) / KB * KB;
  const Task a{reinterpret_cast<const uint16_t*>(q.data_ptr()), q.stride(0), q.stride(1),
               q_pos.numel() ? q_pos.data_ptr<int64_t>() : nullptr, T, G, D, S, Sp, static_cast<float>(scale)};
  // not zeroed: the packs write every element (a zeroing pass of 1.6 MB per call cost as much as them)
  const Scratch<0> kp(Hkv * Sp * D / 2);
  const Scratch<1> vp(Hkv * Sp * D / 2);
  const uint16_t* kd = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const uint16_t* vd = reinterpret_cast<const uint16_t*>(v.data_ptr());
  shared_for(2 * Hkv, [&](auto next) {
    for (int64_t i = next(); i >= 0; i = next()) {
      const int64_t h = i / 2;
      if (i % 2 == 0) pack_k(reinterpret_cast<const char*>(kd + h * k.stride(1)), 2 * k.stride(0), slots, S, Sp,
                             D / 2, kp.get() + h * Sp * D / 2);
      else pack_v(vd + h * v.stride(1), v.stride(0), slots, S, Sp, D, vp.get() + h * Sp * D / 2);
    }
  });
  const int64_t nq = (T * G + QB - 1) / QB, tasks = Hkv * nq;
  float* op = o.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  shared_for(tasks, [&](auto next) {
    std::vector<uint16_t> qbuf(QB * D), P(QB * SB);
    std::vector<float> s(QB * SB), ob(QB * D), m(QB), l(QB);
    for (int64_t i = next(); i >= 0; i = next()) {
      // causal blocks cost in proportion to their position: the dearest first, so that the
      // threads finish together
      const int64_t h = i % Hkv, b = nq - 1 - i / Hkv;
      rows_task<DV>(a, h, b * QB, kp.get() + h * Sp * D / 2, vp.get() + h * Sp * D / 2, op, lsep, Hq, qbuf.data(),
                    s.data(), P.data(), ob.data(), m.data(), l.data());
    }
  });
}

}  // namespace rf_attn
#endif

#if defined(__AVX512F__)
namespace rf_attn32 {
// The fp32 form (a CPU with AVX-512; the fp32 model's prefill). The same plan as the bf16 one above,
// by FMA: K packed once per call as fp32 blocks of 64 keys (rf_attn::pack_k), V read in place (its
// rows are the micro-kernel's vectors as they lie; rows at slots copied together first), and 6-row
// micro-tiles, the linear kernel's shape
// (24 accumulators, 4 vectors of K or V, 1 broadcast: 29 of 32 registers). torch's flash-attention op
// ran the agent workload's prefill attention at about half the FMA peak.
// Numerics: q.k and P.V accumulated in fp32 in key order, the exponentials by exp2_16 (relative
// error below 3e-6) on the scores scaled into base 2: 9 instructions where exp_fast16 (2 ulp) took
// 17; the softmax is what the kernel spends beside its FMAs.
using rf_attn::exp2_16;
using rf_attn::kKeyBlock;
using rf_attn::kLog2e;
constexpr int64_t KB = kKeyBlock;
constexpr int MR = 6;        // rows per micro-tile
constexpr int64_t QB = 36;   // rows per task (6 micro-tiles)
constexpr int64_t SB = 128;  // keys per softmax block: scores [QB, SB] fp32 (18 KB) stay in L1

// GCC folds a vector load into each FMA that reads it (a memory operand) unless the vector is
// pinned in a register: the micro-tiles then load each K or V vector 6 times, and the loads, not
// the FMAs, set the pace
static inline __m512 pinned(__m512 x) {
  asm("" : "+v"(x));
  return x;
}

// s[r, 0:64] = q[r] . K block (packed: [D, 64]), for R rows of q (contiguous, D wide)
template <int R>
static inline void qk(const float* q, int64_t D, const float* kb, float* s, int64_t ss) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const float* kr = kb + d * KB;
    const __m512 k0 = pinned(_mm512_loadu_ps(kr)), k1 = pinned(_mm512_loadu_ps(kr + 16)),
                 k2 = pinned(_mm512_loadu_ps(kr + 32)), k3 = pinned(_mm512_loadu_ps(kr + 48));
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(q[r * D + d]);
      acc[r][0] = _mm512_fmadd_ps(x, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(x, k1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(x, k2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(x, k3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * ss + 16 * c, acc[r][c]);
}

// o[r, 0:64] += P[r, 0:n] V[0:n, 0:64] for R rows (P rows of stride ps; V rows of stride vs)
template <int R>
static inline void pv(const float* P, int64_t ps, const float* v, int64_t vs, int64_t n, float* o, int64_t os) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_loadu_ps(o + r * os + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    const float* vr = v + j * vs;
    const __m512 v0 = pinned(_mm512_loadu_ps(vr)), v1 = pinned(_mm512_loadu_ps(vr + 16)),
                 v2 = pinned(_mm512_loadu_ps(vr + 32)), v3 = pinned(_mm512_loadu_ps(vr + 48));
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(P[r * ps + j]);
      acc[r][0] = _mm512_fmadd_ps(p, v0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(p, v1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(p, v2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(p, v3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + r * os + 16 * c, acc[r][c]);
}

// the first `rows` rows, MR at a time, then the rest in one smaller tile
template <typename Tile>
static inline void by_tiles(int64_t rows, Tile&& tile) {
  int64_t r = 0;
  for (; r + MR <= rows; r += MR) tile(std::integral_constant<int, MR>{}, r);
  switch (rows - r) {
    case 1: tile(std::integral_constant<int, 1>{}, r); break;
    case 2: tile(std::integral_constant<int, 2>{}, r); break;
    case 3: tile(std::integral_constant<int, 3>{}, r); break;
    case 4: tile(std::integral_constant<int, 4>{}, r); break;
    case 5: tile(std::integral_constant<int, 5>{}, r); break;
    default: break;
  }
}

// The online softmax of one task's rows (n <= QB: row i is (token t, query head g) of one kv head):
// their q rows, o unnormalized, the running max m and sum l; s is the scores' scratch [QB, SB]
struct Rows {
  float* q;
  float* s;
  float* o;
  float* m;
  float* l;
  int64_t* last;   // per row: the last key of the current run it sees (-1: none)
  int64_t* tok;    // per row: its token (q's first index) and query head
  int64_t* head;
  int64_t n, D;

  // rows [a, b) as a state of their own (what a run over keys only they see takes)
  Rows sub(int64_t a, int64_t b) const {
    return Rows{q + a * D, s + a * SB, o + a * D, m + a, l + a, last + a, tok + a, head + a, b - a, D};
  }
};

// the n rows named by st.tok / st.head into the state
static void begin(Rows& st, const float* q, int64_t qs0, int64_t qs1, int64_t n) {
  st.n = n;
  for (int64_t i = 0; i < n; ++i) {
    const float* src = q + st.tok[i] * qs0 + st.head[i] * qs1;
    std::copy(src, src + st.D, st.q + i * st.D);
    st.m[i] = -INFINITY;
    st.l[i] = 0.f;
  }
  std::fill(st.o, st.o + n * st.D, 0.f);
}

// one run of S keys through the state: K packed (rf_attn::pack_k, Sp keys), V rows of stride vs;
// row i sees keys [0, st.last[i]]
static void run(Rows& st, const float* kp, const float* v, int64_t vs, int64_t S, int64_t Sp, float scale) {
  const int64_t D = st.D, n = st.n;
  int64_t lim = 0, full = S;        // keys [0, lim) may be visible to a row, [0, full) are to every row
  for (int64_t i = 0; i < n; ++i) {
    lim = std::max(lim, st.last[i] + 1);
    full = std::min(full, st.last[i] + 1);
  }
  float* const s = st.s;
  for (int64_t j0 = 0; j0 < lim; j0 += SB) {
    const int64_t nk = std::min(SB, Sp - j0);             // a multiple of KB (Sp is)
    for (int64_t b = 0; b < nk / KB; ++b)
      by_tiles(n, [&](auto R, int64_t r) { qk<R>(st.q + r * D, D, kp + (j0 + b * KB) * D, s + r * SB + b * KB, SB); });
    const bool masked = j0 + nk > full;
    for (int64_t i = 0; i < n; ++i) {
      float* si = s + i * SB;
      const int64_t vis = st.last[i] + 1 - j0;             // visible keys of this block
      auto keep = [&](int64_t c) -> __mmask16 {
        const int64_t left = vis - c;
        return !masked || left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
      };
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int64_t c = 0; c < nk; c += 16) mx = _mm512_mask_max_ps(mx, keep(c), mx, _mm512_loadu_ps(si + c));
      const float mnew = std::max(st.m[i], _mm512_reduce_max_ps(mx) * scale);   // scale > 0: the max commutes
      if (mnew == -INFINITY) {                             // nothing visible yet: P = 0
        std::fill(si, si + nk, 0.f);
        continue;
      }
      const float alpha = st.m[i] == -INFINITY ? 0.f : exp_fast(st.m[i] - mnew);
      const __m512 sc = _mm512_set1_ps(scale * kLog2e), off = _mm512_set1_ps(-mnew * kLog2e);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = 0; c < nk; c += 16) {
        const __m512 e = _mm512_maskz_mov_ps(keep(c), exp2_16(_mm512_fmadd_ps(_mm512_loadu_ps(si + c), sc, off)));
        sum = _mm512_add_ps(sum, e);
        _mm512_storeu_ps(si + c, e);
      }
      st.l[i] = st.l[i] * alpha + _mm512_reduce_add_ps(sum);
      st.m[i] = mnew;
      if (alpha != 1.f) {
        const __m512 av = _mm512_set1_ps(alpha);
        float* oi = st.o + i * D;
        for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(oi + c, _mm512_mul_ps(_mm512_loadu_ps(oi + c), av));
      }
    }
    // keys past lim are invisible to every row (P = 0 there) and past S not in V at all
    const int64_t nv = std::min(nk, lim - j0);
    for (int64_t c0 = 0; c0 < D; c0 += 64)
      by_tiles(n, [&](auto R, int64_t r) { pv<R>(s + r * SB, SB, v + j0 * vs + c0, vs, nv, st.o + r * D + c0, D); });
  }
}

// the state's rows, normalized, into o [T, Hq, D] and their LSE into lse [T, Hq]
static void finish(const Rows& st, float* op, float* lsep, int64_t Hq) {
  const int64_t D = st.D;
  for (int64_t i = 0; i < st.n; ++i) {
    const int64_t r = st.tok[i] * Hq + st.head[i];
    const float inv = st.l[i] > 0.f ? 1.f / st.l[i] : 0.f;
    for (int64_t d = 0; d < D; ++d) op[r * D + d] = st.o[i * D + d] * inv;
    lsep[r] = st.l[i] > 0.f ? st.m[i] + std::log(st.l[i]) : -INFINITY;
  }
}

// a task's scratch, one per thread
struct TaskBuf {
  std::vector<float> q, s, o, m, l;
  std::vector<int64_t> last, tok, head;
  explicit TaskBuf(int64_t D) : q(QB * D), s(QB * SB), o(QB * D), m(QB), l(QB), last(QB), tok(QB), head(QB) {}
  Rows rows(int64_t D) {
    return Rows{q.data(), s.data(), o.data(), m.data(), l.data(), last.data(), tok.data(), head.data(), 0, D};
  }
};

// K of kv head h at `slots` (or rows 0..S-1) packed into kp, and, where there are slots, its V rows
// copied together into vg as [S, D] (read in place by every task: scattered rows were slower than a
// gather first)
static void pack_k(const at::Tensor& k, int64_t h, const int64_t* slots, int64_t S, int64_t Sp, float* kp) {
  rf_attn::pack_k(reinterpret_cast<const char*>(k.data_ptr<float>() + h * k.stride(1)), 4 * k.stride(0), slots, S, Sp,
                  k.size(2), reinterpret_cast<uint32_t*>(kp));
}

static void copy_v(const at::Tensor& v, int64_t h, const int64_t* slots, int64_t S, float* vg) {
  const float* vd = v.data_ptr<float>() + h * v.stride(1);
  const int64_t D = v.size(2);
  for (int64_t j = 0; j < S; ++j) std::copy(vd + slots[j] * v.stride(0), vd + slots[j] * v.stride(0) + D, vg + j * D);
}

static void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_pos,
                   const int64_t* slots, int64_t S, double scale, at::Tensor& o, at::Tensor& lse) {
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1), G = Hq / Hkv;
  const int64_t Sp = (S + KB - 1) / KB * KB;
  const int64_t* pos = q_pos.numel() ? q_pos.data_ptr<int64_t>() : nullptr;
  const rf_attn::Scratch<0> ks(Hkv * Sp * D);              // every element written by the pack
  const rf_attn::Scratch<1> vs(slots ? Hkv * S * D : 0);
  float* const kp = ks.f32();
  float* const vg = vs.f32();
  shared_for(Hkv * (slots ? 2 : 1), [&](auto next) {
    for (int64_t i = next(); i >= 0; i = next()) {
      if (i < Hkv) pack_k(k, i, slots, S, Sp, kp + i * Sp * D);
      else copy_v(v, i - Hkv, slots, S, vg + (i - Hkv) * S * D);
    }
  });
  const int64_t nq = (T * G + QB - 1) / QB, tasks = Hkv * nq;
  float* op = o.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  shared_for(tasks, [&](auto next) {
    TaskBuf buf(D);
    Rows st = buf.rows(D);
    for (int64_t i = next(); i >= 0; i = next()) {
      // causal blocks cost in proportion to their position: the dearest first, so that the threads
      // finish together
      const int64_t h = i % Hkv, r0 = (nq - 1 - i / Hkv) * QB, n = std::min(QB, T * G - r0);
      for (int64_t r = 0; r < n; ++r) {
        st.tok[r] = (r0 + r) / G;
        st.head[r] = h * G + (r0 + r) % G;
        st.last[r] = pos ? std::min(pos[st.tok[r]], S - 1) : S - 1;
      }
      begin(st, q.data_ptr<float>(), q.stride(0), q.stride(1), n);
      if (slots) run(st, kp + h * Sp * D, vg + h * S * D, D, S, Sp, sc);
      else run(st, kp + h * Sp * D, v.data_ptr<float>() + h * v.stride(1), v.stride(0), S, Sp, sc);
      finish(st, op, lsep, Hq);
    }
  });
}

// A group's rows in one pass (cascade.cascade_prefill's groups): sequence n's query rows bounds[n]
// see the shared prefix's S keys at `shared`, then its own keys own[own_off[n]:own_off[n+1]] up to
// own position q_off[n] + t for its token t, one online softmax over both runs. Tasks take QB rows
// of the group in order across sequences: the shared run for all of them, then each sequence's own
// run for its rows: one pass instead of the composition (the shared part over all rows, the own
// parts apart, a merge by their LSE, and the copies between). (Not for decode: a decode row's own
// keys, packed here for one use, cost more than cpu_decode.cpp reading them in place.)
static void cascade(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* shared, int64_t S,
                    const int64_t* bounds, const int64_t* own, const int64_t* own_off, const int64_t* q_off, int64_t N,
                    double scale, at::Tensor& o, at::Tensor& lse) {
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k.size(1), G = Hq / Hkv;
  const int64_t Sp = (S + KB - 1) / KB * KB;
  // packed own K of sequence n at kof[n] (a kv head's: + h * its Lp * D), V rows at vof[n]; its
  // rows from row0[n] in the group's order
  std::vector<int64_t> kof(N + 1, Hkv * Sp * D), vof(N + 1, Hkv * S * D), row0(N + 1, 0);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t L = own_off[n + 1] - own_off[n];
    kof[n + 1] = kof[n] + Hkv * ((L + KB - 1) / KB * KB) * D;
    vof[n + 1] = vof[n] + Hkv * L * D;
    row0[n + 1] = row0[n] + (bounds[2 * n + 1] - bounds[2 * n]) * G;
  }
  const rf_attn::Scratch<0> ks(kof[N]);
  const rf_attn::Scratch<1> vs(vof[N]);
  float* const kp = ks.f32();
  float* const vg = vs.f32();
  shared_for(2 * Hkv * (N + 1), [&](auto next) {
    for (int64_t i = next(); i >= 0; i = next()) {
      const int64_t n = i / (2 * Hkv) - 1, h = i % Hkv;      // n = -1: the shared prefix
      const bool is_k = i % (2 * Hkv) < Hkv;
      const int64_t* sl = n < 0 ? shared : own + own_off[n];
      const int64_t L = n < 0 ? S : own_off[n + 1] - own_off[n], Lp = (L + KB - 1) / KB * KB;
      if (is_k) pack_k(k, h, sl, L, Lp, kp + (n < 0 ? 0 : kof[n]) + h * Lp * D);
      else copy_v(v, h, sl, L, vg + (n < 0 ? 0 : vof[n]) + h * L * D);
    }
  });
  float* op = o.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t tiles = (row0[N] + QB - 1) / QB;
  shared_for(Hkv * tiles, [&](auto next) {
    TaskBuf buf(D);
    Rows st = buf.rows(D);
    std::vector<int64_t> seq(QB);
    int64_t n = 0;
    for (int64_t i = next(); i >= 0; i = next()) {
      const int64_t h = i % Hkv, R0 = i / Hkv * QB, rows = std::min(QB, row0[N] - R0);
      if (row0[n] > R0) n = 0;     // a guard: a thread takes its tasks in increasing order, n only moves on
      for (int64_t r = 0; r < rows; ++r) {
        while (row0[n + 1] <= R0 + r) ++n;
        const int64_t local = R0 + r - row0[n];
        seq[r] = n;
        st.tok[r] = bounds[2 * n] + local / G;
        st.head[r] = h * G + local % G;
        st.last[r] = S - 1;
      }
      begin(st, q.data_ptr<float>(), q.stride(0), q.stride(1), rows);
      run(st, kp + h * Sp * D, vg + h * S * D, D, S, Sp, sc);
      for (int64_t a = 0, b; a < rows; a = b) {             // each sequence's rows over its own keys
        const int64_t m = seq[a], L = own_off[m + 1] - own_off[m], Lp = (L + KB - 1) / KB * KB;
        for (b = a; b < rows && seq[b] == m; ++b) st.last[b] = std::min(q_off[m] + (R0 + b - row0[m]) / G, L - 1);
        Rows part = st.sub(a, b);
        run(part, kp + kof[m] + h * Lp * D, vg + vof[m] + h * L * D, D, L, Lp, sc);
      }
      finish(st, op, lsep, Hq);
    }
  });
}

}  // namespace rf_attn32
#endif

bool attend_takes_bf16() {
#ifdef RF_BF16_VECTOR
  return true;
#else
  return false;
#endif
}

bool attend_takes_fp32() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

void attend_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_pos,
                    const at::Tensor& slots, double scale, at::Tensor& o, at::Tensor& lse) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(2) == k.size(2) && k.size(1) > 0
              && q.size(1) % k.size(1) == 0, "attend_prefill: shapes");
  const auto dt = q.scalar_type();
  TORCH_CHECK((dt == at::kBFloat16 || dt == at::kFloat) && k.scalar_type() == dt && v.scalar_type() == dt,
              "attend_prefill: bf16 or fp32, one dtype");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "attend_prefill: rows of the head dim contiguous");
  TORCH_CHECK(q_pos.numel() == 0 || (q_pos.numel() == q.size(0) && q_pos.scalar_type() == at::kLong
              && q_pos.is_contiguous()), "attend_prefill: q_pos");
  TORCH_CHECK(scale > 0, "attend_prefill: a positive scale");
  TORCH_CHECK(slots.numel() == 0 || (slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous()),
              "attend_prefill: slots [S] int64");
  const int64_t* sp = slots.numel() ? slots.data_ptr<int64_t>() : nullptr;
  const int64_t S = sp ? slots.numel() : k.size(0);
  for (int64_t j = 0; sp && j < S; ++j)
    TORCH_CHECK(0 <= sp[j] && sp[j] < k.size(0), "attend_prefill: slot ", sp[j], " outside K/V's ", k.size(0), " rows");
  TORCH_CHECK(o.is_contiguous() && o.scalar_type() == at::kFloat && o.sizes() == q.sizes() && lse.is_contiguous()
              && lse.scalar_type() == at::kFloat && lse.numel() == q.size(0) * q.size(1), "attend_prefill: outputs");
#if defined(__AVX512F__)
  if (dt == at::kFloat && q.size(2) % 64 == 0 && q.size(2) <= 256)
    return rf_attn32::attend(q, k, v, q_pos, sp, S, scale, o, lse);
#endif
#ifdef RF_BF16_VECTOR
  if (dt == at::kBFloat16) switch (q.size(2)) {
    case 64: return rf_attn::attend<4>(q, k, v, q_pos, sp, S, scale, o, lse);
    case 128: return rf_attn::attend<8>(q, k, v, q_pos, sp, S, scale, o, lse);
    case 256: return rf_attn::attend<16>(q, k, v, q_pos, sp, S, scale, o, lse);
    default: break;
  }
#endif
  TORCH_CHECK(false, "attend_prefill: head size 64, 128 or 256, in bf16 on a CPU with AVX512-BF16 or fp32 on one "
              "with AVX-512");
}

void attend_cascade(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& shared,
                    const at::Tensor& bounds, const at::Tensor& own, const at::Tensor& own_off,
                    const at::Tensor& q_off, double scale, at::Tensor& o, at::Tensor& lse) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && q.size(2) == k_cache.size(2)
              && k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0, "attend_cascade: shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat,
              "attend_cascade: fp32");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1,
              "attend_cascade: rows of the head dim contiguous");
  TORCH_CHECK(q.size(2) % 64 == 0 && q.size(2) <= 256, "attend_cascade: head size 64, 128, 192 or 256");
  TORCH_CHECK(scale > 0, "attend_cascade: a positive scale");
  for (const at::Tensor* t : {&shared, &bounds, &own, &own_off, &q_off})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "attend_cascade: int64 contiguous index tensors");
  const int64_t N = q_off.numel(), P = k_cache.size(0), T = q.size(0);
  TORCH_CHECK(bounds.numel() == 2 * N && own_off.numel() == N + 1, "attend_cascade: bounds [N, 2], own_off [N + 1]");
  const int64_t* bp = bounds.data_ptr<int64_t>();
  const int64_t* ofp = own_off.data_ptr<int64_t>();
  const int64_t* qo = q_off.data_ptr<int64_t>();
  TORCH_CHECK(ofp[0] == 0 && ofp[N] == own.numel(), "attend_cascade: own_off spans own");
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(0 <= bp[2 * n] && bp[2 * n] <= bp[2 * n + 1] && bp[2 * n + 1] <= T && ofp[n] <= ofp[n + 1] && qo[n] >= 0,
                "attend_cascade: sequence ", n, "'s bounds, own keys or offset");
  for (const at::Tensor* t : {&shared, &own}) {
    const int64_t* p = t->data_ptr<int64_t>();
    for (int64_t j = 0; j < t->numel(); ++j)
      TORCH_CHECK(0 <= p[j] && p[j] < P, "attend_cascade: slot ", p[j], " outside the pool's ", P, " rows");
  }
  TORCH_CHECK(o.is_contiguous() && o.scalar_type() == at::kFloat && o.sizes() == q.sizes() && lse.is_contiguous()
              && lse.scalar_type() == at::kFloat && lse.numel() == T * q.size(1), "attend_cascade: outputs");
#if defined(__AVX512F__)
  rf_attn32::cascade(q, k_cache, v_cache, shared.data_ptr<int64_t>(), shared.numel(), bp, own.data_ptr<int64_t>(), ofp,
                     qo, N, scale, o, lse);
#else
  TORCH_CHECK(false, "attend_cascade: a CPU with AVX-512");
#endif
}
