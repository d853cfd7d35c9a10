// Causal conv1d decode update on the CPU, in place in the state pool (see naive.py:
// causal_conv1d_update_slots / _depths_slots, which gather the states, shift them with a few
// batched ops per depth and scatter them back). Each sequence's W-1 carried inputs per channel are
// read where they live, every depth of the sequence runs on them in registers, and they are
// written back once.
//
// x: [T, C] fp32, rows depth-major: sequence n's row at depth d is offsets[d] + n, d < lens[n]
// pool: [P, C, W-1] fp32 contiguous, updated in place at slots ([N] int64)
// weight: [C, W] fp32;  y: [T, C] fp32 written (SiLU applied when `silu`)
// saved: [S, C, W-1] fp32 or empty: the state of sequence n after depth d goes to row soff[d] + n
//        when the sequence has a depth after d
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

void conv_update_depths(const at::Tensor& x, at::Tensor& pool, const at::Tensor& weight, const at::Tensor& slots,
                        const at::Tensor& offsets, const at::Tensor& lens, at::Tensor& y, at::Tensor& saved,
                        const at::Tensor& soff, bool silu) {
  const int64_t N = slots.size(0), C = x.size(1), W = weight.size(1), M = W - 1;
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
          const float xin = xp[r * C + c];
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
