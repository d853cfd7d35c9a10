// Linear layers on the CPU: x [M, K] . W^T over weights packed once (the model's weights do not change
// between steps), fp32 by FMA on a CPU with AVX-512 and bf16 by vdpbf16ps on one with AVX512-BF16 but
// no AMX; in both the MLP's gate/up projection with SiLU-and-multiply in the same pass.
// reference.py's kernel form. Both dtypes share the micro-kernel's shape and the task split.
//
// fp32's gate/up form (the packed layout's lanes as bf16's below) runs silu_mul_impl<F32>'s arithmetic
// on the accumulators: the [T, 2I] product is never written and read back.
//
// fp32: MKL ran the model's fp32 products well below the FMA peak on an AMD EPYC (Zen 4), and a
// one-row decode product well below the memory's bandwidth; the kernel beats it on both there (on
// Intel CPUs MKL may do better). Packed layout: float [ceil(N / 64), K, 64], block b, row k, lane j =
// W[64 b + j, k].
//
// bf16: oneDNN, torch's bf16 matmul on such a CPU (an AMD EPYC, Zen 4), ran a decode step's thin
// products at about half the vdpbf16ps peak (it splits thin products coarsely and packs the weights
// again on every call); a register-blocked micro-kernel (6 rows x 64 columns: 24 accumulators, four
// weight vectors and a broadcast row pair) over weights in their packed layout runs them near the
// peak. On prefill-sized products both are near the peak; there the gain is the gate/up form, which
// writes half the bytes and needs no SiLU pass.
// Where the CPU has AMX, oneDNN's tile kernels are several times faster than any vdpbf16ps code,
// and `linear_takes_bf16` says no.
//
// bf16's packed layout, int32 [ceil(N / 64), K / 2, 64]: block b, pair p, lane j holds the bf16 pair
// (W[n, 2p], W[n, 2p + 1]) of row n = 64 b + j (zero past N). With `halves` = I (the gate/up form,
// W = [gate; up], [2I, K]) lanes 0-31 of block b are gate rows 32 b + j and lanes 32-63 the up rows
// I + 32 b + j, so that one block's accumulators hold both operands of 32 outputs.
//
// bf16's numerics: the products of bf16 pairs accumulated in fp32 in pair order, rounded to bf16 once at
// the end (as oneDNN's kernels on such a CPU; equal to torch's result on the model's shapes up to
// its own blocking of K). The gate/up form rounds g and u to bf16 first and then runs silu_mul_bf16's
// arithmetic (elementwise/cpu_fused.cpp): bit-equal to linear, then silu_mul.
// Uses exp_fast16, bf16_round16, to_bf16x16, shared_for and RF_BF16_VECTOR from
// elementwise/cpu_fused.cpp (one translation unit).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

#if defined(__AVX512F__)
namespace rf_gemm {

constexpr int64_t NB = 64;   // packed weight rows (output columns) per block: four vectors of 16
constexpr int MR = 6;        // rows per micro-tile: 6 x 4 accumulators + 4 weight vectors + 1 broadcast
constexpr int64_t RB = 96;   // rows per task (16 micro-tiles); a task is RB rows x one block

// the first min(n, 16) lanes (n > 0): a tile's last columns past the output's end are not stored
static inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1);
}

// fp32: C[R, 64] of block bp ([K, 64] floats) over rows a, one FMA per weight and row; each output
// sums its K products in order from 0, whatever the row count (a row's result does not depend on the
// batch it is in, unlike a GEMM library's blocking, so cache on and off compute the same numbers)
template <int R, bool SILU>
static inline void tile_f32(const float* a, int64_t as, const float* bp, int64_t K, float* c, int64_t cs,
                            int64_t cols) {
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* w = bp + k * NB;
    const __m512 b0 = _mm512_loadu_ps(w), b1 = _mm512_loadu_ps(w + 16), b2 = _mm512_loadu_ps(w + 32),
                 b3 = _mm512_loadu_ps(w + 48);
    for (int i = 0; i < R; ++i) {
      const __m512 x = _mm512_set1_ps(a[i * as + k]);
      acc[i][0] = _mm512_fmadd_ps(x, b0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(x, b1, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(x, b2, acc[i][2]);
      acc[i][3] = _mm512_fmadd_ps(x, b3, acc[i][3]);
    }
  }
  if constexpr (SILU) {
    // SiLU(gate) * up for the block's 32 outputs, in silu_mul_impl<F32>'s own expression (silu():
    // GCC contracts it into FMAs as it does there, and the result is bit-equal to linear, then silu_mul)
    alignas(64) float g[32], u[32], o[32];
    for (int i = 0; i < R; ++i) {
      for (int j = 0; j < 2; ++j) {
        _mm512_store_ps(g + 16 * j, acc[i][j]);
        _mm512_store_ps(u + 16 * j, acc[i][j + 2]);
      }
      for (int l = 0; l < 32; ++l) o[l] = silu(g[l]) * u[l];
      for (int j = 0; j < 2; ++j) {
        const int64_t left = cols - 16 * j;
        if (left <= 0) break;
        const __mmask16 m = first_lanes(left);
        _mm512_mask_storeu_ps(c + i * cs + 16 * j, m, _mm512_load_ps(o + 16 * j));
      }
    }
  } else {
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < 4; ++j) {
        const int64_t left = cols - 16 * j;
        if (left <= 0) break;
        const __mmask16 m = first_lanes(left);
        _mm512_mask_storeu_ps(c + i * cs + 16 * j, m, acc[i][j]);
      }
  }
}

template <bool SILU>
static void rows_f32(const float* a, int64_t as, const float* bp, int64_t K, float* c, int64_t cs, int64_t n,
                     int64_t cols) {
  int64_t r = 0;
  for (; r + MR <= n; r += MR) tile_f32<MR, SILU>(a + r * as, as, bp, K, c + r * cs, cs, cols);
  a += r * as;
  c += r * cs;
  switch (n - r) {
    case 1: tile_f32<1, SILU>(a, as, bp, K, c, cs, cols); break;
    case 2: tile_f32<2, SILU>(a, as, bp, K, c, cs, cols); break;
    case 3: tile_f32<3, SILU>(a, as, bp, K, c, cs, cols); break;
    case 4: tile_f32<4, SILU>(a, as, bp, K, c, cs, cols); break;
    case 5: tile_f32<5, SILU>(a, as, bp, K, c, cs, cols); break;
    default: break;
  }
}

template <bool SILU>
static void linear_f32(const at::Tensor& x, const at::Tensor& wp, int64_t n_out, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), nb = wp.size(0);
  const int64_t per = SILU ? NB / 2 : NB;        // outputs per block
  const float* a = x.data_ptr<float>();
  const float* bp = wp.data_ptr<float>();
  float* c = out.data_ptr<float>();
  const int64_t as = x.stride(0), cs = out.stride(0), nr = (M + RB - 1) / RB;
  shared_for(nr * nb, [&](auto next) {
    for (int64_t t = next(); t >= 0; t = next()) {
      const int64_t r = t / nb, b = t % nb;
      rows_f32<SILU>(a + r * RB * as, as, bp + b * K * NB, K, c + r * RB * cs + b * per, cs, std::min(RB, M - r * RB),
                     std::min(per, n_out - b * per));
    }
  });
}

#ifdef RF_BF16_VECTOR
// C[R, 64] of block bp over rows a (R rows, row stride as), KP pairs; stores `cols` outputs (plain)
// or min(cols, 32) SiLU(gate) * up outputs (SILU)
template <int R, bool SILU>
static inline void tile(const uint16_t* a, int64_t as, const uint32_t* bp, int64_t KP, uint16_t* c, int64_t cs,
                        int64_t cols) {
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint32_t* ar[R];
  for (int i = 0; i < R; ++i) ar[i] = reinterpret_cast<const uint32_t*>(a + i * as);
  for (int64_t p = 0; p < KP; ++p) {
    const uint32_t* w = bp + p * NB;
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w), b1 = (__m512bh)_mm512_loadu_si512(w + 16);
    const __m512bh b2 = (__m512bh)_mm512_loadu_si512(w + 32), b3 = (__m512bh)_mm512_loadu_si512(w + 48);
    for (int i = 0; i < R; ++i) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(ar[i][p]));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x, b1);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], x, b2);
      acc[i][3] = _mm512_dpbf16_ps(acc[i][3], x, b3);
    }
  }
  if constexpr (SILU) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < 2; ++j) {
        const int64_t left = cols - 16 * j;
        if (left <= 0) break;
        const __m512 g = bf16_round16(acc[i][j]), u = bf16_round16(acc[i][j + 2]);
        const __m512 s = bf16_round16(_mm512_div_ps(g, _mm512_add_ps(one, exp_fast16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
        const __mmask16 m = first_lanes(left);
        _mm256_mask_storeu_epi16(c + i * cs + 16 * j, m, to_bf16x16(_mm512_mul_ps(s, u)));
      }
  } else {
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < 4; ++j) {
        const int64_t left = cols - 16 * j;
        if (left <= 0) break;
        const __mmask16 m = first_lanes(left);
        _mm256_mask_storeu_epi16(c + i * cs + 16 * j, m, to_bf16x16(acc[i][j]));
      }
  }
}

template <bool SILU>
static void rows(const uint16_t* a, int64_t as, const uint32_t* bp, int64_t KP, uint16_t* c, int64_t cs, int64_t n,
                 int64_t cols) {
  int64_t r = 0;
  for (; r + MR <= n; r += MR) tile<MR, SILU>(a + r * as, as, bp, KP, c + r * cs, cs, cols);
  a += r * as;
  c += r * cs;
  switch (n - r) {
    case 1: tile<1, SILU>(a, as, bp, KP, c, cs, cols); break;
    case 2: tile<2, SILU>(a, as, bp, KP, c, cs, cols); break;
    case 3: tile<3, SILU>(a, as, bp, KP, c, cs, cols); break;
    case 4: tile<4, SILU>(a, as, bp, KP, c, cs, cols); break;
    case 5: tile<5, SILU>(a, as, bp, KP, c, cs, cols); break;
    default: break;
  }
}

template <bool SILU>
static void linear(const at::Tensor& x, const at::Tensor& wp, int64_t n_out, at::Tensor& out) {
  const int64_t M = x.size(0), KP = x.size(1) / 2, nb = wp.size(0);
  const int64_t per = SILU ? NB / 2 : NB;        // outputs per block
  const uint16_t* a = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(wp.data_ptr());
  uint16_t* c = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t as = x.stride(0), cs = out.stride(0), nr = (M + RB - 1) / RB;
  // row chunks outer: a thread's consecutive tasks share x's rows (in L1/L2) and walk the weight
  // blocks, which the whole layer's fit in L2 on the model's shapes
  shared_for(nr * nb, [&](auto next) {
    for (int64_t t = next(); t >= 0; t = next()) {
      const int64_t r = t / nb, b = t % nb;
      rows<SILU>(a + r * RB * as, as, bp + b * KP * NB, KP, c + r * RB * cs + b * per, cs, std::min(RB, M - r * RB),
                 std::min(per, n_out - b * per));
    }
  });
}
#endif  // RF_BF16_VECTOR

}  // namespace rf_gemm
#endif  // __AVX512F__

// vdpbf16ps code pays where the CPU has AVX512-BF16 and no AMX (cpuid leaf 7: EDX bit 22, AMX-BF16).
// Asked once: in a virtual machine cpuid traps to the hypervisor, and the wrapper asks on every
// layer's call
bool linear_takes_bf16() {
#if defined(RF_BF16_VECTOR) && defined(__x86_64__)
  static const bool takes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return !(__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)));
  }();
  return takes;
#else
  return false;
#endif
}

// fp32 by FMA where the CPU has AVX-512: MKL's fp32 products of the model's shapes ran well below the
// FMA peak, and a one-row decode product well below the memory's bandwidth
bool linear_takes_fp32() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

at::Tensor linear_pack(const at::Tensor& w, int64_t halves) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "linear_pack: a contiguous [N, K] weight");
  if (w.scalar_type() == at::kFloat) {        // [nb, K, 64] floats, zero past N; lanes as bf16's below
    const int64_t N = w.size(0), K = w.size(1);
    TORCH_CHECK(halves == 0 || N == 2 * halves, "linear_pack: halves is half the rows");
    const int64_t nb = halves ? (halves + 31) / 32 : (N + 63) / 64;
    at::Tensor out = at::zeros({nb, K, 64}, at::kFloat);
    const float* src = w.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    for (int64_t n = 0; n < N; ++n) {
      const bool up = halves && n >= halves;
      const int64_t i = up ? n - halves : n;
      const int64_t b = halves ? i / 32 : n / 64, j = halves ? i % 32 + (up ? 32 : 0) : n % 64;
      for (int64_t k = 0; k < K; ++k) dst[(b * K + k) * 64 + j] = src[n * K + k];
    }
    return out;
  }
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.size(1) % 2 == 0,
              "linear_pack: a contiguous bf16 [N, K] weight, K even, or fp32");
  const int64_t N = w.size(0), KP = w.size(1) / 2;
  TORCH_CHECK(halves == 0 || N == 2 * halves, "linear_pack: halves is half the rows");
  const int64_t nb = halves ? (halves + 31) / 32 : (N + 63) / 64;
  at::Tensor out = at::zeros({nb, KP, 64}, at::kInt);
  const uint32_t* src = reinterpret_cast<const uint32_t*>(w.data_ptr());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr());
  for (int64_t n = 0; n < N; ++n) {
    // the block and lane of row n
    int64_t b, j;
    if (halves) {
      const bool up = n >= halves;
      const int64_t i = up ? n - halves : n;
      b = i / 32;
      j = i % 32 + (up ? 32 : 0);
    } else {
      b = n / 64;
      j = n % 64;
    }
    for (int64_t p = 0; p < KP; ++p) dst[(b * KP + p) * 64 + j] = src[n * KP + p];
  }
  return out;
}

// out [M, n_out] = x [M, K] . W^T in x's dtype (silu: SiLU(gate) * up, n_out = I) over
// linear_pack's wp
void linear_packed(const at::Tensor& x, const at::Tensor& wp, int64_t n_out, bool silu, at::Tensor& out) {
  if (x.scalar_type() == at::kFloat) {
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear_packed: fp32 rows [M, K], each row contiguous");
    TORCH_CHECK(wp.dim() == 3 && wp.scalar_type() == at::kFloat && wp.is_contiguous() && wp.size(1) == x.size(1)
                && wp.size(2) == 64 && wp.size(0) * (silu ? 32 : 64) >= n_out, "linear_packed: a packed fp32 weight for K");
    TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.size(0) == x.size(0) && out.size(1) == n_out
                && out.stride(1) == 1, "linear_packed: out [M, n_out] fp32");
#if defined(__AVX512F__)
    if (silu) return rf_gemm::linear_f32<true>(x, wp, n_out, out);
    return rf_gemm::linear_f32<false>(x, wp, n_out, out);
#else
    TORCH_CHECK(false, "linear_packed: fp32 on a CPU with AVX-512");
#endif
  }
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "linear_packed: bf16 rows [M, K], K even, each row contiguous");
  TORCH_CHECK(wp.dim() == 3 && wp.scalar_type() == at::kInt && wp.is_contiguous() && wp.size(1) == x.size(1) / 2
              && wp.size(2) == 64 && wp.size(0) * (silu ? 32 : 64) >= n_out, "linear_packed: a packed weight for K");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kBFloat16 && out.size(0) == x.size(0) && out.size(1) == n_out
              && out.stride(1) == 1, "linear_packed: out [M, n_out] bf16");
#ifdef RF_BF16_VECTOR
  if (silu) return rf_gemm::linear<true>(x, wp, n_out, out);
  return rf_gemm::linear<false>(x, wp, n_out, out);
#else
  TORCH_CHECK(false, "linear_packed: a CPU with AVX512-BF16");
#endif
}
