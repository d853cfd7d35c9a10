// Fused elementwise ops on the CPU (fp32 or bf16, math in fp32, rounded where the torch forms
// round): each reads its inputs once and writes its output once.
// At these models' widths (hidden 256) the torch forms (reference.py) cost as much as the matmuls
// beside them: F.rms_norm is six ops on the CPU, SiLU-and-multiply three passes over the MLP's
// widest tensor, the gated norm eight; each op a pass over memory.
//
// Row layout: x, z are [A, B, D] with strides (sa, sb, 1) (a split or a head view of a projection's
// output needs no copy); outputs are contiguous.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

// Tasks handed out one at a time from a shared counter, to each of torch's threads (the kernels of
// this translation unit whose work splits unevenly: prefill attention, the linear layers): `body(next)`
// runs once per thread, next() gives a task index or -1. Under `radixflow up` the event loop shares
// these cores, and with torch's static split (parallel_for) a whole call waited for the one thread
// the loop had preempted; here the other thread takes over its share.
template <typename F>
static void shared_for(int64_t n, F&& body) {
  std::atomic<int64_t> counter{0};
  auto next = [&]() -> int64_t {
    const int64_t i = counter.fetch_add(1, std::memory_order_relaxed);
    return i < n ? i : -1;
  };
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) { body(next); });
}

// e^x as Cephes' expf (range reduction by ln 2, a degree-6 polynomial, the exponent set by bits):
// within 2 ulp over [-87, 88] and branch-free, so that GCC vectorizes the loops it sits in
// (std::exp is a call per element).
static inline float exp_fast(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   // round to nearest
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(float));
  return p * scale;
}

static inline float silu(float x) { return x / (1.0f + exp_fast(-x)); }

// fp32 or bf16 storage (bf16 as its 16 bits), fp32 math. round() rounds a value through the
// storage type where the torch form stores an intermediate in the model's dtype: to nearest even,
// as torch's casts (a NaN stays a NaN). Written with bit operations, so that the loops vectorize
// (c10::BFloat16's conversions did not: the bf16 forms ran slower than torch's).
struct F32 {
  using S = float;
  static inline float load(S v) { return v; }
  static inline float round(float f) { return f; }
  static inline S store(float f) { return f; }
};
struct BF16 {
  using S = uint16_t;
  static inline float load(S v) {
    const uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
  static inline uint32_t rounded_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    // a NaN's rounding could carry into the exponent (an infinity): keep it a quiet NaN instead
    const uint32_t nan = static_cast<uint32_t>(-static_cast<int32_t>(f != f));
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    return (r & ~nan) | (((u | 0x00400000u) & 0xFFFF0000u) & nan);
  }
  static inline float round(float f) {
    const uint32_t u = rounded_bits(f);
    float r;
    std::memcpy(&r, &u, sizeof(r));
    return r;
  }
  static inline S store(float f) { return static_cast<S>(rounded_bits(f) >> 16); }
};

// out[t, i] = silu(h[t, i]) * h[t, I + i];  h [T, 2I] contiguous, out [T, I] (torch: silu's result
// is stored in the dtype, then multiplied)
template <typename IO>
static void silu_mul_impl(const at::Tensor& h, at::Tensor& out) {
  using S = typename IO::S;
  const int64_t T = h.size(0), I = h.size(1) / 2;
  const S* hp = reinterpret_cast<const S*>(h.data_ptr());
  S* op = reinterpret_cast<S*>(out.data_ptr());
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const S* __restrict__ g = hp + t * 2 * I;
      const S* __restrict__ u = g + I;
      S* __restrict__ o = op + t * I;
      for (int64_t i = 0; i < I; ++i) o[i] = IO::store(IO::round(silu(IO::load(g[i]))) * IO::load(u[i]));
    }
  });
}

#if defined(__AVX512F__)
#include <immintrin.h>

// exp_fast, 16 lanes at once (the same reduction and polynomial)
static inline __m512 exp_fast16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define RF_BF16_VECTOR 1

static inline __m512 load_bf16x16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// to bf16 by the CPU's own conversion: to nearest even, a NaN stays a NaN (as torch's casts)
static inline __m256i to_bf16x16(__m512 f) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(f)); }

static inline __m512 bf16_round16(__m512 f) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(f)), 16));
}

// bf16 SiLU-and-multiply with explicit 16-lane code: GCC leaves the generic loop scalar in bf16
// (the conversions' bit operations), where it ran slower than torch's two vectorized ops
static void silu_mul_bf16(const at::Tensor& h, at::Tensor& out) {
  const int64_t T = h.size(0), I = h.size(1) / 2;
  const uint16_t* hp = reinterpret_cast<const uint16_t*>(h.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t begin, int64_t end) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* g = hp + t * 2 * I;
      const uint16_t* u = g + I;
      uint16_t* o = op + t * I;
      int64_t i = 0;
      for (; i + 16 <= I; i += 16) {
        const __m512 x = load_bf16x16(g + i);
        const __m512 s = bf16_round16(_mm512_div_ps(x, _mm512_add_ps(one, exp_fast16(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), to_bf16x16(_mm512_mul_ps(s, load_bf16x16(u + i))));
      }
      for (; i < I; ++i) o[i] = BF16::store(BF16::round(silu(BF16::load(g[i]))) * BF16::load(u[i]));
    }
  });
}
#endif

// bf16: by the 16-lane form where the CPU has AVX-512 with its bf16 conversion (the wrapper asks
// `silu_mul_takes_bf16` first; elsewhere torch's ops serve)
void silu_mul(const at::Tensor& h, at::Tensor& out) {
#ifdef RF_BF16_VECTOR
  if (h.scalar_type() == at::kBFloat16) return silu_mul_bf16(h, out);
#endif
  TORCH_CHECK(h.scalar_type() == at::kFloat, "silu_mul: fp32, or bf16 on a CPU with AVX512-BF16");
  silu_mul_impl<F32>(h, out);
}

bool silu_mul_takes_bf16() {
#ifdef RF_BF16_VECTOR
  return true;
#else
  return false;
#endif
}

// out = x / rms(x) * w per row of D (w fp32: the weight as the torch form multiplies by it, e.g.
// 1 + weight for a zero-centered norm); CAST_FIRST: the normalized row is stored in the dtype
// before the weight multiplies it (Qwen3's order). GATED: then times silu(z) (the gated norm of a
// DeltaNet head's output, its first product stored in the dtype).
// ADD: x += z first, in place (the residual stream's sum, stored in the dtype as torch's add stores
// it), and the sum normalized: the pre-norm blocks' add and norm in one pass (z: what a block adds).
template <typename IO, bool CAST_FIRST, bool GATED, bool ADD = false>
static void norm_rows(const at::Tensor& x, const at::Tensor* z, const at::Tensor& w, double eps, at::Tensor& out) {
  using S = typename IO::S;
  const int64_t A = x.size(0), B = x.size(1), D = x.size(2);
  const int64_t sa = x.stride(0), sb = x.stride(1);
  const int64_t za = GATED || ADD ? z->stride(0) : 0, zb = GATED || ADD ? z->stride(1) : 0;
  S* xp = reinterpret_cast<S*>(x.data_ptr());
  const S* zp = GATED || ADD ? reinterpret_cast<const S*>(z->data_ptr()) : nullptr;
  const float* __restrict__ wp = w.data_ptr<float>();
  S* op = reinterpret_cast<S*>(out.data_ptr());
  const float e = static_cast<float>(eps);
  at::parallel_for(0, A * B, std::max<int64_t>(1, 8192 / std::max<int64_t>(D, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t a = r / B, b = r % B;
      S* __restrict__ xr = xp + a * sa + b * sb;
      S* __restrict__ o = op + r * D;
      if constexpr (ADD) {
        const S* __restrict__ zr = zp + a * za + b * zb;
        for (int64_t d = 0; d < D; ++d) xr[d] = IO::store(IO::load(xr[d]) + IO::load(zr[d]));
      }
      // 16 partial sums: a float sum in one accumulator is a chain GCC may not reorder (nor vectorize)
      float part[16] = {};
      int64_t d0 = 0;
      for (; d0 + 16 <= D; d0 += 16)
        for (int j = 0; j < 16; ++j) {
          const float v = IO::load(xr[d0 + j]);
          part[j] += v * v;
        }
      float ss = 0.f;
      for (int j = 0; j < 16; ++j) ss += part[j];
      for (int64_t d = d0; d < D; ++d) ss += IO::load(xr[d]) * IO::load(xr[d]);
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + e);
      if constexpr (GATED) {
        const S* __restrict__ zr = zp + a * za + b * zb;
        for (int64_t d = 0; d < D; ++d) {
          const float n = IO::load(xr[d]) * inv;
          const float y = (CAST_FIRST ? IO::round(n) : n) * wp[d];
          o[d] = IO::store(IO::round(y) * silu(IO::load(zr[d])));
        }
      } else {
        for (int64_t d = 0; d < D; ++d) {
          const float n = IO::load(xr[d]) * inv;
          o[d] = IO::store((CAST_FIRST ? IO::round(n) : n) * wp[d]);
        }
      }
    }
  });
}

void rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool cast_first, at::Tensor& out) {
  if (x.scalar_type() != at::kBFloat16) return norm_rows<F32, false, false>(x, nullptr, w, eps, out);
  if (cast_first) return norm_rows<BF16, true, false>(x, nullptr, w, eps, out);
  norm_rows<BF16, false, false>(x, nullptr, w, eps, out);
}

void add_rms_norm(at::Tensor& x, const at::Tensor& r, const at::Tensor& w, double eps, bool cast_first, at::Tensor& out) {
  if (x.scalar_type() != at::kBFloat16) return norm_rows<F32, false, false, true>(x, &r, w, eps, out);
  if (cast_first) return norm_rows<BF16, true, false, true>(x, &r, w, eps, out);
  norm_rows<BF16, false, false, true>(x, &r, w, eps, out);
}

void gated_rms_norm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& w, double eps, at::Tensor& out) {
  if (x.scalar_type() == at::kBFloat16) return norm_rows<BF16, true, true>(x, &z, w, eps, out);
  norm_rows<F32, false, true>(x, &z, w, eps, out);
}

// Rotary embedding, rotate-half layout, on the first R dims of every head (the rest copied):
// out[i] = x[i] cos[i] - x[i + R/2] sin[i] (i < R/2), x[i] cos[i] + x[i - R/2] sin[i] (R/2 <= i < R);
// each product and the sum rounded through the storage type, as torch's bf16 ops round them.
// x [T, H, D] (rows of any stride, the last dim contiguous); cos, sin [T, R] contiguous, in x's dtype;
// out [T, H, D] contiguous. The torch form (reference.rotary) is six passes over q or k (a negation,
// two concatenations, two products and a sum); this is one.
// no fused multiply-add: torch rounds each product before the sum (GCC contracts a*b + c*d by default)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename IO>
static void rotary_impl(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  using S = typename IO::S;
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), R = cos.size(1), half = R / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  const S* xp = reinterpret_cast<const S*>(x.data_ptr());
  const S* cp = reinterpret_cast<const S*>(cos.data_ptr());
  const S* sp = reinterpret_cast<const S*>(sin.data_ptr());
  S* op = reinterpret_cast<S*>(out.data_ptr());
  at::parallel_for(0, T, std::max<int64_t>(1, 8192 / std::max<int64_t>(H * D, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const S* __restrict__ c = cp + t * R;
      const S* __restrict__ s = sp + t * R;
      for (int64_t h = 0; h < H; ++h) {
        const S* __restrict__ xi = xp + t * s0 + h * s1;
        S* __restrict__ o = op + (t * H + h) * D;
        for (int64_t i = 0; i < half; ++i)
          o[i] = IO::store(IO::round(IO::load(xi[i]) * IO::load(c[i])) +
                           IO::round(-IO::load(xi[i + half]) * IO::load(s[i])));
        for (int64_t i = half; i < R; ++i)
          o[i] = IO::store(IO::round(IO::load(xi[i]) * IO::load(c[i])) +
                           IO::round(IO::load(xi[i - half]) * IO::load(s[i])));
        for (int64_t i = R; i < D; ++i) o[i] = xi[i];
      }
    }
  });
}
#pragma GCC pop_options

#if defined(RF_BF16_VECTOR) && defined(__AVX512BW__)
// bf16 with explicit 16-lane code, any R: GCC left the generic loop scalar where R / 2 is short
// (Qwen3.5's 16-dim rotary: 8 lanes a half), slower than torch's ops there
static inline __m512 load_bf16_masked(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static void rotary_bf16(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), R = cos.size(1), half = R / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* cp = reinterpret_cast<const uint16_t*>(cos.data_ptr());
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sin.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, T, std::max<int64_t>(1, 8192 / std::max<int64_t>(H * D, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* c = cp + t * R;
      const uint16_t* s = sp + t * R;
      for (int64_t h = 0; h < H; ++h) {
        const uint16_t* xi = xp + t * s0 + h * s1;
        uint16_t* o = op + (t * H + h) * D;
        for (int64_t i = 0; i < half; i += 16) {
          const __mmask16 m = half - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (half - i)) - 1);
          const __m512 a = load_bf16_masked(xi + i, m), b = load_bf16_masked(xi + half + i, m);
          const __m512 lo = _mm512_add_ps(bf16_round16(_mm512_mul_ps(a, load_bf16_masked(c + i, m))),
                                          bf16_round16(_mm512_mul_ps(_mm512_xor_ps(b, _mm512_set1_ps(-0.0f)),
                                                                     load_bf16_masked(s + i, m))));
          const __m512 hi = _mm512_add_ps(bf16_round16(_mm512_mul_ps(b, load_bf16_masked(c + half + i, m))),
                                          bf16_round16(_mm512_mul_ps(a, load_bf16_masked(s + half + i, m))));
          _mm256_mask_storeu_epi16(o + i, m, to_bf16x16(lo));
          _mm256_mask_storeu_epi16(o + half + i, m, to_bf16x16(hi));
        }
        std::memcpy(o + R, xi + R, (D - R) * sizeof(uint16_t));
      }
    }
  });
}
#endif

void rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0)
              && cos.size(1) % 2 == 0 && cos.size(1) <= x.size(2) && cos.is_contiguous() && sin.is_contiguous()
              && out.is_contiguous() && out.sizes() == x.sizes(), "rotary: shapes");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type()
              && out.scalar_type() == x.scalar_type(), "rotary: one dtype");
#if defined(RF_BF16_VECTOR) && defined(__AVX512BW__)
  if (x.scalar_type() == at::kBFloat16) return rotary_bf16(x, cos, sin, out);
#endif
  if (x.scalar_type() == at::kBFloat16) return rotary_impl<BF16>(x, cos, sin, out);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "rotary: fp32 or bf16");
  rotary_impl<F32>(x, cos, sin, out);
}
