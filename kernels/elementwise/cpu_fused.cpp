// Fused elementwise ops on the CPU (fp32): each reads its inputs once and writes its output once.
// At these models' widths (hidden 256) the torch forms (reference.py) cost as much as the matmuls
// beside them: F.rms_norm is six ops on the CPU, SiLU-and-multiply three passes over the MLP's
// widest tensor, the gated norm eight; each op a pass over memory.
//
// Row layout: x, z are [A, B, D] with strides (sa, sb, 1) (a split or a head view of a projection's
// output needs no copy); outputs are contiguous.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

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

// out[t, i] = silu(h[t, i]) * h[t, I + i];  h [T, 2I] contiguous, out [T, I]
void silu_mul(const at::Tensor& h, at::Tensor& out) {
  const int64_t T = h.size(0), I = h.size(1) / 2;
  const float* hp = h.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict__ g = hp + t * 2 * I;
      const float* __restrict__ u = g + I;
      float* __restrict__ o = op + t * I;
      for (int64_t i = 0; i < I; ++i) o[i] = silu(g[i]) * u[i];
    }
  });
}

// out = x / rms(x) * w (w: [D], the weight as used: 1 + w for a zero-centered norm), per row of D;
// with z, also times silu(z) (the gated norm of a DeltaNet head's output).
static void norm_rows(const at::Tensor& x, const at::Tensor* z, const at::Tensor& w, double eps, at::Tensor& out) {
  const int64_t A = x.size(0), B = x.size(1), D = x.size(2);
  const int64_t sa = x.stride(0), sb = x.stride(1);
  const int64_t za = z ? z->stride(0) : 0, zb = z ? z->stride(1) : 0;
  const float* xp = x.data_ptr<float>();
  const float* zp = z ? z->data_ptr<float>() : nullptr;
  const float* __restrict__ wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, A * B, std::max<int64_t>(1, 8192 / std::max<int64_t>(D, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t a = r / B, b = r % B;
      const float* __restrict__ xr = xp + a * sa + b * sb;
      float* __restrict__ o = op + r * D;
      // 16 partial sums: a float sum in one accumulator is a chain GCC may not reorder (nor vectorize)
      float part[16] = {};
      int64_t d0 = 0;
      for (; d0 + 16 <= D; d0 += 16)
        for (int j = 0; j < 16; ++j) part[j] += xr[d0 + j] * xr[d0 + j];
      float ss = 0.f;
      for (int j = 0; j < 16; ++j) ss += part[j];
      for (int64_t d = d0; d < D; ++d) ss += xr[d] * xr[d];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + e);
      if (zp == nullptr) {
        for (int64_t d = 0; d < D; ++d) o[d] = xr[d] * inv * wp[d];
      } else {
        const float* __restrict__ zr = zp + a * za + b * zb;
        for (int64_t d = 0; d < D; ++d) o[d] = xr[d] * inv * wp[d] * silu(zr[d]);
      }
    }
  });
}

void rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out) {
  norm_rows(x, nullptr, w, eps, out);
}

void gated_rms_norm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& w, double eps, at::Tensor& out) {
  norm_rows(x, &z, w, eps, out);
}
