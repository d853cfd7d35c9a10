// Decode attention on the CPU: one query token per sequence over the K/V slots its row of a table
// names, read where they lie in the pool (no gather), in fp32 whatever the pool's dtype.
// The torch forms gather each row's slots into a padded batch (index_select per layer and step),
// build a mask, and run one flash-attention call per batch entry: most of a tiny model's decode step
// for a few MFLOP of work.
//
// q: [N, Hq, D] contiguous (fp32 or bf16, the pool's dtype);  k_cache, v_cache: [S, Hkv, D] contiguous
// table: [N, L] int64, row n's first lens[n] entries are its slots in order (the rest never read)
// o: [N, Hq, D] fp32, written;  lse: [N, Hq] fp32, written: the natural log of the softmax's
// denominator (what cascade's merge takes), -inf with o = 0 for a row of no slots.
// Uses F32 / BF16 (storage loads) and exp_fast from elementwise/cpu_fused.cpp: the kernels build
// as one translation unit (kernels/cpu_ext.py), that file before this one.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
// 16 lanes of a row in fp32, from its storage type
template <typename IO>
static inline __m512 load16(const typename IO::S* p);
template <>
inline __m512 load16<F32>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<BF16>(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// The rows a task reads lie at its slots, scattered over pages (a page's slots hold every kv head's
// rows, so one head's rows are not even contiguous within it): the hardware prefetchers do not
// follow them, and each row waited on the cache or memory in turn, far longer than its arithmetic.
// The row PREFETCH keys ahead is asked for early.
constexpr int64_t PREFETCH = 8;

template <typename S>
static inline void prefetch_row(const S* p, int64_t D) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(S)); b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// the scores and the weighted sum of one (sequence, kv head) with 16-lane vectors over the head
// dim (D a multiple of 16, at most 256): a K or V row is loaded and converted once for the G query
// heads that read it; the generic loops below leave each score to a scalar reduction
// CC: D / 16 fixed at compile time (0: read from D): at the model's head sizes the row stays in
// registers and the loops over it unroll; with C read at run time the row goes through the stack
// and the loops' bounds are compared per vector
template <typename IO, int CC = 0>
static void rows_avx512(const float* qf, const typename IO::S* kp, const int64_t* slots, int64_t len, int64_t Hkv,
                        int64_t h, int64_t G, int64_t D, float* s) {
  const int64_t C = CC > 0 ? CC : D / 16;
  __m512 row[16];
  for (int64_t j = 0; j < std::min(len, PREFETCH); ++j) prefetch_row(kp + (slots[j] * Hkv + h) * D, D);
  for (int64_t j = 0; j < len; ++j) {
    if (j + PREFETCH < len) prefetch_row(kp + (slots[j + PREFETCH] * Hkv + h) * D, D);
    const typename IO::S* kr = kp + (slots[j] * Hkv + h) * D;
    for (int64_t c = 0; c < C; ++c) row[c] = load16<IO>(kr + 16 * c);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), row[0]);
      for (int64_t c = 1; c < C; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), row[c], a);
      s[g * len + j] = _mm512_reduce_add_ps(a);
    }
  }
}

template <typename IO, int CC = 0>
static void weighted_avx512(const typename IO::S* vp, const int64_t* slots, int64_t len, int64_t Hkv, int64_t h,
                            int64_t G, int64_t D, const float* s, float* acc) {
  const int64_t C = CC > 0 ? CC : D / 16;
  if constexpr (CC > 0) {
    // head by head, its sum in registers across the keys (the rows, re-read per head, are in L1 or
    // L2 by then): a sum kept in memory made every key wait on the previous key's stores
    for (int64_t j = 0; j < std::min(len, PREFETCH); ++j) prefetch_row(vp + (slots[j] * Hkv + h) * D, D);
    for (int64_t g = 0; g < G; ++g) {
      __m512 a[CC];
      float* ag = acc + g * D;
      for (int c = 0; c < CC; ++c) a[c] = _mm512_loadu_ps(ag + 16 * c);
      const float* sg = s + g * len;
      for (int64_t j = 0; j < len; ++j) {
        if (g == 0 && j + PREFETCH < len) prefetch_row(vp + (slots[j + PREFETCH] * Hkv + h) * D, D);
        const typename IO::S* vr = vp + (slots[j] * Hkv + h) * D;
        const __m512 pj = _mm512_set1_ps(sg[j]);
        for (int c = 0; c < CC; ++c) a[c] = _mm512_fmadd_ps(pj, load16<IO>(vr + 16 * c), a[c]);
      }
      for (int c = 0; c < CC; ++c) _mm512_storeu_ps(ag + 16 * c, a[c]);
    }
    return;
  }
  __m512 row[16];
  for (int64_t j = 0; j < std::min(len, PREFETCH); ++j) prefetch_row(vp + (slots[j] * Hkv + h) * D, D);
  for (int64_t j = 0; j < len; ++j) {
    if (j + PREFETCH < len) prefetch_row(vp + (slots[j + PREFETCH] * Hkv + h) * D, D);
    const typename IO::S* vr = vp + (slots[j] * Hkv + h) * D;
    for (int64_t c = 0; c < C; ++c) row[c] = load16<IO>(vr + 16 * c);
    for (int64_t g = 0; g < G; ++g) {
      const __m512 pj = _mm512_set1_ps(s[g * len + j]);
      float* ag = acc + g * D;
      for (int64_t c = 0; c < C; ++c)
        _mm512_storeu_ps(ag + 16 * c, _mm512_fmadd_ps(pj, row[c], _mm512_loadu_ps(ag + 16 * c)));
    }
  }
}
#endif

// the same two loops, plain: any head size (GCC vectorizes the reductions under omp simd); `row`
// is scratch [D]
template <typename IO>
static void rows_plain(const float* qf, const typename IO::S* kp, const int64_t* slots, int64_t len, int64_t Hkv,
                       int64_t h, int64_t G, int64_t D, float* s, float* row) {
  for (int64_t j = 0; j < len; ++j) {
    const typename IO::S* kr = kp + (slots[j] * Hkv + h) * D;
    for (int64_t d = 0; d < D; ++d) row[d] = IO::load(kr[d]);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float a = 0.f;
#pragma omp simd reduction(+ : a)
      for (int64_t d = 0; d < D; ++d) a += qg[d] * row[d];
      s[g * len + j] = a;
    }
  }
}

template <typename IO>
static void weighted_plain(const typename IO::S* vp, const int64_t* slots, int64_t len, int64_t Hkv, int64_t h,
                           int64_t G, int64_t D, const float* s, float* acc, float* row) {
  for (int64_t j = 0; j < len; ++j) {
    const typename IO::S* vr = vp + (slots[j] * Hkv + h) * D;
    for (int64_t d = 0; d < D; ++d) row[d] = IO::load(vr[d]);
    for (int64_t g = 0; g < G; ++g) {
      const float p = s[g * len + j];
      float* ag = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];
    }
  }
}

template <typename IO>
static void decode_rows_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& table, const at::Tensor& lens, double scale, at::Tensor& o,
                             at::Tensor& lse) {
  using S = typename IO::S;
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1), G = Hq / Hkv;
  const int64_t L = table.size(1);
  const S* qp = reinterpret_cast<const S*>(q.data_ptr());
  const S* kp = reinterpret_cast<const S*>(k_cache.data_ptr());
  const S* vp = reinterpret_cast<const S*>(v_cache.data_ptr());
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = o.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
#if defined(__AVX512F__)
  const bool vec = D % 16 == 0 && D >= 16 && D <= 256;   // the 16-lane loops: whole vectors, row[16]
#endif
  // one task per (sequence, kv head): its G query heads share every K/V row it reads
  at::parallel_for(0, N * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), row(D), s, m(G), l(G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / Hkv, h = task % Hkv, len = lp[n];
      const int64_t* slots = tp + n * L;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = IO::load(qp[(n * Hq + h * G + g) * D + d]) * sc;
      // scores s[g * len + j], then per head the max, the exponentials and their sum
      s.resize(G * len);
#if defined(__AVX512F__)
      if (vec && D == 64) rows_avx512<IO, 4>(qf.data(), kp, slots, len, Hkv, h, G, D, s.data());
      else if (vec && D == 128) rows_avx512<IO, 8>(qf.data(), kp, slots, len, Hkv, h, G, D, s.data());
      else if (vec) rows_avx512<IO>(qf.data(), kp, slots, len, Hkv, h, G, D, s.data());
      else
#endif
        rows_plain<IO>(qf.data(), kp, slots, len, Hkv, h, G, D, s.data(), row.data());
      for (int64_t g = 0; g < G; ++g) {
        float* sg = s.data() + g * len;
        float mg = -INFINITY, lg = 0.f;
        int64_t j0 = 0;
#if defined(__AVX512F__)
        // 16 at a time: GCC left these loops scalar (a call-free exp, but a reduction it would not
        // reorder), which was most of the kernel's time at a few hundred slots per row
        if (len >= 16) {
          __m512 mv = _mm512_set1_ps(-INFINITY);
          int64_t j = 0;
          for (; j + 16 <= len; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sg + j));
          mg = _mm512_reduce_max_ps(mv);
          for (; j < len; ++j) mg = std::max(mg, sg[j]);
          const __m512 mb = _mm512_set1_ps(mg);
          __m512 lv = _mm512_setzero_ps();
          for (j = 0; j + 16 <= len; j += 16) {
            const __m512 e = exp_fast16(_mm512_sub_ps(_mm512_loadu_ps(sg + j), mb));
            _mm512_storeu_ps(sg + j, e);
            lv = _mm512_add_ps(lv, e);
          }
          lg = _mm512_reduce_add_ps(lv);
          j0 = j;
        }
#endif
        if (j0 == 0)
          for (int64_t j = 0; j < len; ++j) mg = std::max(mg, sg[j]);
        for (int64_t j = j0; j < len; ++j) {
          sg[j] = exp_fast(sg[j] - mg);
          lg += sg[j];
        }
        m[g] = mg;
        l[g] = lg;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
#if defined(__AVX512F__)
      if (vec && D == 64) weighted_avx512<IO, 4>(vp, slots, len, Hkv, h, G, D, s.data(), acc.data());
      else if (vec && D == 128) weighted_avx512<IO, 8>(vp, slots, len, Hkv, h, G, D, s.data(), acc.data());
      else if (vec) weighted_avx512<IO>(vp, slots, len, Hkv, h, G, D, s.data(), acc.data());
      else
#endif
        weighted_plain<IO>(vp, slots, len, Hkv, h, G, D, s.data(), acc.data(), row.data());
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = n * Hq + h * G + g;
        const float inv = len > 0 ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) op[r * D + d] = acc[g * D + d] * inv;
        lsep[r] = len > 0 ? m[g] + std::log(l[g]) : -INFINITY;
      }
    }
  });
}

void decode_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& table,
                 const at::Tensor& lens, double scale, at::Tensor& o, at::Tensor& lse) {
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "decode_rows: q and the pool in one dtype");
  // what the kernel reads, checked before it reads (the torch form raises on these too): a head
  // size, a row length past its table row, a slot outside the pool
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && q.size(2) == k_cache.size(2) && v_cache.sizes() == k_cache.sizes()
              && k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0, "decode_rows: shapes");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == q.size(0) && lens.numel() == q.size(0), "decode_rows: table rows");
  const int64_t L = table.size(1), S = k_cache.size(0);
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t n = 0; n < q.size(0); ++n) {
    TORCH_CHECK(0 <= lp[n] && lp[n] <= L, "decode_rows: row ", n, " has ", lp[n], " slots in a table of ", L);
    for (int64_t j = 0; j < lp[n]; ++j)
      TORCH_CHECK(0 <= tp[n * L + j] && tp[n * L + j] < S, "decode_rows: slot ", tp[n * L + j], " outside the pool");
  }
  if (q.scalar_type() == at::kBFloat16) return decode_rows_impl<BF16>(q, k_cache, v_cache, table, lens, scale, o, lse);
  TORCH_CHECK(q.scalar_type() == at::kFloat, "decode_rows: fp32 or bf16");
  decode_rows_impl<F32>(q, k_cache, v_cache, table, lens, scale, o, lse);
}
