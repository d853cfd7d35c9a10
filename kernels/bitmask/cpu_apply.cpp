// A grammar's token bitmask applied to the logits on the CPU, in place: logits[rows[i], t] = -inf
// where bit t of bitmask[mask_rows[i]] is clear. The torch form (reference.py: apply_bitmask)
// takes several ops, gathers and scatters for what is here one pass over the rows:
// a clear 32-token word (nearly every word of a JSON grammar's mask) is 32 stores, a full one none.
//
// logits [R, V] fp32 contiguous; bitmask [B, W] int32 contiguous, W >= ceil(V / 32); rows,
// mask_rows [n] int64.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>

void apply_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows, const at::Tensor& mask_rows) {
  const int64_t n = rows.size(0), V = logits.size(1), W = bitmask.size(1);
  TORCH_CHECK(W * 32 >= V, "bitmask rows of ", W, " words for a vocabulary of ", V);
  float* lp = logits.data_ptr<float>();
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const int64_t *rp = rows.data_ptr<int64_t>(), *mp = mask_rows.data_ptr<int64_t>();
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* __restrict__ x = lp + rp[i] * V;
      const uint32_t* m = bp + mp[i] * W;
      for (int64_t lo = 0; lo < V; lo += 32) {
        const uint32_t word = m[lo / 32];
        const int64_t hi = std::min(V, lo + 32);
        if (word == 0xFFFFFFFFu) continue;
        if (word == 0) {
          std::fill(x + lo, x + hi, ninf);
          continue;
        }
        for (int64_t t = lo; t < hi; ++t)
          if (!((word >> (t - lo)) & 1u)) x[t] = ninf;
      }
    }
  });
}
