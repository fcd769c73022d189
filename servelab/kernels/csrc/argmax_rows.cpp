// argmax_rows: the greedy sampler's argmax over float32 logits, as torch.argmax answers.

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "ops.h"
#include "vec.h"

namespace servelab_cpu {

// out[r] = the first index of the largest value of row r of float32 `logits` [N, V], or of
// its first NaN (torch.argmax's answer): one vector pass for the maximum, a second that
// stops at its first occurrence.
void argmax_rows(at::Tensor out, const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat &&
                  logits.size(1) > 0,
              "argmax_rows: logits must be a contiguous float32 [N, V] tensor with V > 0");
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous() && out.scalar_type() == at::kLong && out.size(0) == logits.size(0),
              "argmax_rows: out must be a contiguous int64 [N] tensor");
  const int64_t vocab = logits.size(1);
  const float* data = logits.data_ptr<float>();
  int64_t* result = out.data_ptr<int64_t>();
  at::parallel_for(0, logits.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = data + r * vocab;
      Vec best_lanes(-std::numeric_limits<float>::infinity());
      int64_t i = 0;
      for (; i + kLanes <= vocab; i += kLanes) best_lanes = at::vec::maximum(best_lanes, Vec::loadu(row + i));
      float best = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); },
                                                  best_lanes);
      for (; i < vocab; ++i) best = (std::isnan(row[i]) || row[i] > best) ? row[i] : best;
      int64_t index = 0;
      if (std::isnan(best)) {
        while (!std::isnan(row[index])) ++index;
      } else {
        while (row[index] != best) ++index;
      }
      result[r] = index;
    }
  });
}

}  // namespace servelab_cpu
