// Decode attention on the CPU: one query token per sequence over the K/V slots its row of a table
// names, read where they lie in the pool (no gather), in fp32 whatever the pool's dtype.
// The torch forms gather each row's slots into a padded batch (index_select per layer and step),
// build a mask, and run one flash-attention call per batch entry: at a decode step of 40 sequences
// with ~115 own tokens each that was ~1 ms per layer for ~5 MFLOP, most of a tiny model's step.
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
  // one task per (sequence, kv head): its G query heads share every K/V row it reads
  at::parallel_for(0, N * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), kf(D), vf(D), s;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / Hkv, h = task % Hkv, len = lp[n];
      const int64_t* slots = tp + n * L;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = IO::load(qp[(n * Hq + h * G + g) * D + d]) * sc;
      // scores s[g * len + j], then per head the max, the exponentials and their sum
      s.resize(G * len);
      for (int64_t j = 0; j < len; ++j) {
        const S* kr = kp + (slots[j] * Hkv + h) * D;
        for (int64_t d = 0; d < D; ++d) kf[d] = IO::load(kr[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float a = 0.f;
#pragma omp simd reduction(+ : a)
          for (int64_t d = 0; d < D; ++d) a += qg[d] * kf[d];
          s[g * len + j] = a;
        }
      }
      std::vector<float> m(G, -INFINITY), l(G, 0.f);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = s.data() + g * len;
        float mg = -INFINITY;
        for (int64_t j = 0; j < len; ++j) mg = std::max(mg, sg[j]);
        float lg = 0.f;
#pragma omp simd reduction(+ : lg)
        for (int64_t j = 0; j < len; ++j) {
          sg[j] = exp_fast(sg[j] - mg);
          lg += sg[j];
        }
        m[g] = mg;
        l[g] = lg;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < len; ++j) {
        const S* vr = vp + (slots[j] * Hkv + h) * D;
        for (int64_t d = 0; d < D; ++d) vf[d] = IO::load(vr[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = s[g * len + j];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * vf[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t row = n * Hq + h * G + g;
        const float inv = len > 0 ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) op[row * D + d] = acc[g * D + d] * inv;
        lsep[row] = len > 0 ? m[g] + std::log(l[g]) : -INFINITY;
      }
    }
  });
}

void decode_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& table,
                 const at::Tensor& lens, double scale, at::Tensor& o, at::Tensor& lse) {
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "decode_rows: q and the pool in one dtype");
  if (q.scalar_type() == at::kBFloat16) return decode_rows_impl<BF16>(q, k_cache, v_cache, table, lens, scale, o, lse);
  TORCH_CHECK(q.scalar_type() == at::kFloat, "decode_rows: fp32 or bf16");
  decode_rows_impl<F32>(q, k_cache, v_cache, table, lens, scale, o, lse);
}
