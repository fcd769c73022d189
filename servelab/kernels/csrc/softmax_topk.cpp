// softmax_topk: a mixture of experts' routing by softmax scores, for the Python router and
// the native decoder stack alike (so both route every token to the same experts with the
// same weights, to the bit).
//
// For each row of router logits [T, E] (float32, bfloat16 or float16): the softmax in
// float32 (max, exp of each logit less it, their sum in index order, each exp divided by
// it), the top_k scores in descending order (ties to the lower index, as one stable pass
// per choice), and their weights: the scores, or with `normalize` the scores divided by
// their sum (in choice order).

#include <cmath>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace servelab_cpu {
namespace {

// One row's routing; `scores` and `taken` are scratch of E entries. A NaN score ranks
// above every number, as in torch.topk.
template <typename T>
void route_row(const T* logits, int64_t experts, int64_t top_k, bool normalize, float* scores, char* taken,
               float* weights, int64_t* chosen) {
  float high = -INFINITY;
  for (int64_t e = 0; e < experts; ++e) high = std::max(high, static_cast<float>(logits[e]));
  float sum = 0.f;
  for (int64_t e = 0; e < experts; ++e) {
    scores[e] = std::exp(static_cast<float>(logits[e]) - high);
    sum += scores[e];
  }
  for (int64_t e = 0; e < experts; ++e) {
    scores[e] /= sum;
    taken[e] = 0;
  }
  float picked = 0.f;
  for (int64_t j = 0; j < top_k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < experts; ++e) {
      if (!taken[e] && (best < 0 || scores[e] > scores[best] || (std::isnan(scores[e]) && !std::isnan(scores[best])))) {
        best = e;
      }
    }
    taken[best] = 1;
    chosen[j] = best;
    weights[j] = scores[best];
    picked += scores[best];
  }
  if (normalize) {
    for (int64_t j = 0; j < top_k; ++j) weights[j] /= picked;
  }
}

}  // namespace

void softmax_topk(at::Tensor weights, at::Tensor experts, const at::Tensor& logits, int64_t top_k, bool normalize) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
              "softmax_topk: logits must be a contiguous [T, E] tensor with E > 0");
  const int64_t tokens = logits.size(0), count = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= count, "softmax_topk: top_k must be in [1, ", count, "], got ", top_k);
  TORCH_CHECK(weights.dim() == 2 && weights.is_contiguous() && weights.scalar_type() == at::kFloat &&
                  weights.size(0) == tokens && weights.size(1) == top_k,
              "softmax_topk: weights must be a contiguous float32 [T, top_k] tensor");
  TORCH_CHECK(experts.dim() == 2 && experts.is_contiguous() && experts.scalar_type() == at::kLong &&
                  experts.size(0) == tokens && experts.size(1) == top_k,
              "softmax_topk: experts must be a contiguous int64 [T, top_k] tensor");
  std::vector<float> scores(count);
  std::vector<char> taken(count);
  dispatch_dtype(logits.scalar_type(), "softmax_topk", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* rows = logits.data_ptr<scalar_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      route_row(rows + t * count, count, top_k, normalize, scores.data(), taken.data(),
                weights.data_ptr<float>() + t * top_k, experts.data_ptr<int64_t>() + t * top_k);
    }
  });
}

}  // namespace servelab_cpu
