// argmax_rows: the greedy sampler's argmax over float32 logits, as torch.argmax answers.

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace servelab_cpu {
namespace {

// Rows are scanned in chunks of this many logits (32 KiB: the second pass reads a chunk
// from L1), the chunks of a long row (a 150k vocabulary: 19) split over the threads, so a
// batch-1 step's argmax runs on both cores, each mostly over the logits its share of the
// LM head has just written into its own L2.
constexpr int64_t kChunk = 8192;

struct Best {
  float value;    // the chunk's largest value, or NaN where it holds one
  int64_t index;  // its first occurrence (of the first NaN where value is NaN)
};

// The largest value of row[begin, end) (NaN where there is one) in one vector pass over four
// accumulators, then a second that stops at its first occurrence.
Best chunk_argmax(const float* row, int64_t begin, int64_t end) {
  constexpr float kLowest = -std::numeric_limits<float>::infinity();
  Vec m0(kLowest), m1(kLowest), m2(kLowest), m3(kLowest);
  int64_t i = begin;
  for (; i + 4 * kLanes <= end; i += 4 * kLanes) {  // at::vec::maximum propagates NaN
    m0 = at::vec::maximum(m0, Vec::loadu(row + i));
    m1 = at::vec::maximum(m1, Vec::loadu(row + i + kLanes));
    m2 = at::vec::maximum(m2, Vec::loadu(row + i + 2 * kLanes));
    m3 = at::vec::maximum(m3, Vec::loadu(row + i + 3 * kLanes));
  }
  for (; i + kLanes <= end; i += kLanes) m0 = at::vec::maximum(m0, Vec::loadu(row + i));
  const Vec lanes = at::vec::maximum(at::vec::maximum(m0, m1), at::vec::maximum(m2, m3));
  float best = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, lanes);
  for (; i < end; ++i) best = (std::isnan(row[i]) || row[i] > best) ? row[i] : best;
  const bool nan = std::isnan(best);
  const Vec target(best);
  constexpr int kNoLane = (1 << kLanes) - 1;
  for (i = begin; i + kLanes <= end; i += kLanes) {
    const Vec v = Vec::loadu(row + i);
    const int misses = (nan ? v != v : v == target).zero_mask();  // a bit per lane that is not it
    if (misses != kNoLane) return {best, i + __builtin_ctz(~misses & kNoLane)};
  }
  for (; i < end; ++i) {
    if (nan ? std::isnan(row[i]) : row[i] == best) break;
  }
  return {best, i};
}

}  // namespace

// out[r] = the first index of the largest value of row r of float32 `logits` [N, V], or of
// its first NaN (torch.argmax's answer): each chunk's own answer, then per row the first
// chunk holding a NaN, else the first holding the largest value.
void argmax_rows(at::Tensor out, const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat &&
                  logits.size(1) > 0,
              "argmax_rows: logits must be a contiguous float32 [N, V] tensor with V > 0");
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous() && out.scalar_type() == at::kLong && out.size(0) == logits.size(0),
              "argmax_rows: out must be a contiguous int64 [N] tensor");
  const int64_t rows = logits.size(0), vocab = logits.size(1), chunks = (vocab + kChunk - 1) / kChunk;
  const float* data = logits.data_ptr<float>();
  std::vector<Best> found(rows * chunks);
  at::parallel_for(0, rows * chunks, (16 + chunks - 1) / chunks, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / chunks, first = item % chunks * kChunk;
      found[item] = chunk_argmax(data + r * vocab, first, std::min(vocab, first + kChunk));
    }
  });
  int64_t* result = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    Best best = found[r * chunks];
    for (int64_t c = 1; c < chunks && !std::isnan(best.value); ++c) {
      const Best& next = found[r * chunks + c];
      if (std::isnan(next.value) || next.value > best.value) best = next;
    }
    result[r] = best.index;
  }
}

}  // namespace servelab_cpu
