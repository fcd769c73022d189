// sample_rows: the sampler's random rows in one call, as sampler.py's torch path takes them
// (apply_temperature_and_filters, then random_race): each row divided by its temperature,
// cut to its top-k tokens, then to the fewest leading ones whose probability mass before
// them is at most top_p (probabilities of the whole row, as the torch path's softmax of the
// sorted row), then to those at least min_p times as probable as the most probable, and the
// token drawn by the exponential race argmax(p / E) over what is left, E the row of `noise`
// (Exp(1) draws the caller takes from each request's generator, as the torch path does, so
// a seeded request draws the same tokens either way). A row of temperature 0 is greedy: its
// first largest logit (its noise is not read).
//
// At batch 1 on a small vocabulary the torch path is some thirty tensor calls, each slowed
// by caches the forward pass has just refilled (hundreds of microseconds a step); here it is
// one. Top-k and top-p sort only a leading part of the row: the top 64 tokens (or k), then
// four times more while their mass stays within top_p (and k allows).

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace servelab_cpu {
namespace {

constexpr int64_t kFirstCandidates = 64;
// Rows a thread takes at least: a few rows run on the calling thread, without waking the others.
constexpr int64_t kRowsPerTask = 4;

// The token of a sort key (the complement of its index in the low 32 bits).
int64_t token_of(uint64_t key) { return 0xFFFFFFFFu - static_cast<uint32_t>(key); }

// The token of one row (`vocab` logits and noise) under its temperature and filters.
int64_t sample_row(const float* logits, const float* noise, int64_t vocab, float temperature, int64_t top_k,
                   double top_p, double min_p, std::vector<float>& weights, std::vector<uint64_t>& order) {
  // weights[i] = exp(x_i - max x), x = logits / temperature: the row's unnormalized probabilities
  float* w = weights.data();
  Vec best_lanes(-std::numeric_limits<float>::infinity());
  const Vec scale(temperature);
  int64_t i = 0;
  for (; i + kLanes <= vocab; i += kLanes) {
    const Vec x = Vec::loadu(logits + i) / scale;
    x.store(w + i);
    best_lanes = at::vec::maximum(best_lanes, x);
  }
  float top = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, best_lanes);
  for (; i < vocab; ++i) {
    w[i] = logits[i] / temperature;
    top = std::max(top, w[i]);
  }
  const Vec top_vec(top);
  i = 0;
  for (; i + kLanes <= vocab; i += kLanes) (Vec::loadu(w + i) - top_vec).exp().store(w + i);
  for (; i < vocab; ++i) w[i] = std::exp(w[i] - top);

  // The kept tokens: all of them, or a leading run of the row sorted by probability (keys
  // of the weight's bits over the complement of the index: descending, ties to the lower
  // index, as one integer comparison), sorted a part at a time until the run ends.
  int64_t kept = vocab;
  const bool sorted = top_k < vocab || top_p < 1.0;
  if (sorted) {
    double total = 0.0;
    order.resize(vocab);
    for (int64_t j = 0; j < vocab; ++j) {
      total += w[j];
      uint32_t bits;
      std::memcpy(&bits, w + j, sizeof bits);
      order[j] = (static_cast<uint64_t>(bits) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(j));
    }
    double mass = 0.0;  // of the tokens before j
    int64_t j = 0, ready = 0;
    for (int64_t candidates = std::min(top_k, kFirstCandidates);; candidates = std::min(top_k, candidates * 4)) {
      std::nth_element(order.begin() + ready, order.begin() + candidates - 1, order.end(), std::greater<>());
      std::sort(order.begin() + ready, order.begin() + candidates, std::greater<>());
      ready = candidates;
      while (j < candidates && (j == 0 || mass <= top_p)) mass += w[token_of(order[j++])] / total;
      if (j < candidates || candidates == top_k) {
        kept = j;
        break;
      }
    }
  }
  // The race over the kept tokens at least min_p times as probable as the most probable:
  // p / E = w / E, a vector at a time where every token is kept.
  const float floor = static_cast<float>(min_p);
  int64_t token = sorted ? token_of(order[0]) : 0;
  float best = -1.0f;
  auto race = [&](int64_t t, float value) {
    if (w[t] >= floor && value > best) {
      best = value;
      token = t;
    }
  };
  int64_t j = 0;
  if (!sorted) {
    alignas(64) float values[kLanes];
    for (; j + kLanes <= kept; j += kLanes) {
      (Vec::loadu(w + j) / Vec::loadu(noise + j)).store(values);
      for (int64_t l = 0; l < kLanes; ++l) race(j + l, values[l]);
    }
  }
  for (; j < kept; ++j) {
    const int64_t t = sorted ? token_of(order[j]) : j;
    race(t, w[t] / noise[t]);
  }
  return token;
}

}  // namespace

void sample_rows(at::Tensor out, const at::Tensor& logits, const at::Tensor& noise, at::ArrayRef<double> temperatures,
                 at::IntArrayRef top_ks, at::ArrayRef<double> top_ps, at::ArrayRef<double> min_ps) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat &&
                  logits.size(1) > 0 && noise.sizes() == logits.sizes() && noise.is_contiguous() &&
                  noise.scalar_type() == at::kFloat,
              "sample_rows: logits and noise must be contiguous float32 [N, V] tensors with V > 0");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous() && out.scalar_type() == at::kLong && out.size(0) == rows,
              "sample_rows: out must be a contiguous int64 [N] tensor");
  TORCH_CHECK(static_cast<int64_t>(temperatures.size()) == rows && static_cast<int64_t>(top_ks.size()) == rows &&
                  static_cast<int64_t>(top_ps.size()) == rows && static_cast<int64_t>(min_ps.size()) == rows,
              "sample_rows: one temperature, top_k, top_p and min_p per row");
  const float* x = logits.data_ptr<float>();
  const float* e = noise.data_ptr<float>();
  int64_t* tokens = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(vocab);
    std::vector<uint64_t> order;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * vocab;
      if (temperatures[r] <= 0.0) {  // greedy: the first largest logit
        tokens[r] = std::max_element(row, row + vocab) - row;
        continue;
      }
      const int64_t top_k = top_ks[r] > 0 && top_ks[r] < vocab ? top_ks[r] : vocab;
      tokens[r] = sample_row(row, e + r * vocab, vocab, static_cast<float>(temperatures[r]), top_k,
                             top_ps[r], min_ps[r], weights, order);
    }
  });
}

}  // namespace servelab_cpu
