// causal_prefill_attention: causal attention of each plain prefill (context = its new
// tokens) over its own keys and values, all of a step's prefills in one call per layer:
// torch's fused SDPA per request, short requests side by side on the threads; bfloat16 on
// the AMX tile unit (prefill_attention_amx.h).

#include <ATen/Parallel.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "ops.h"
#include "prefill_attention_amx.h"

namespace servelab_cpu {
namespace {

// Requests of at least this many query rows keep all threads for their own attention
// call; shorter ones run side by side, one thread each (torch's fused kernel gains little
// from a second thread on a few hundred rows).
constexpr int64_t kSharedPrefillRows = 512;

// Sorts request indices longest first, the order in which the threads take them (the
// longest ones start early, so no thread is left with one at the end).
inline void sort_longest_first(std::vector<int64_t>& requests, at::IntArrayRef lengths) {
  std::sort(requests.begin(), requests.end(), [&](int64_t a, int64_t b) { return lengths[a] > lengths[b]; });
}

// Hands items 0..count-1, in order, to up to all of torch's threads: each thread calls
// worker(take) once, where take() returns the next item no thread has taken yet, or -1.
template <typename Worker>
void share_in_turn(int64_t count, const Worker& worker) {
  std::atomic<int64_t> next{0};
  const auto take = [&]() -> int64_t {
    const int64_t item = next++;
    return item < count ? item : -1;
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  if (threads <= 1) {
    worker(take);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { worker(take); });
}

#ifdef SERVELAB_AMX
// Work items (request, KV head), longest request first, taken by the threads in turn.
void causal_prefill_attention_amx(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  at::IntArrayRef starts, at::IntArrayRef lengths, float scale) {
  const int64_t num_kv_heads = k.size(1);
  std::vector<int64_t> order(starts.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  sort_longest_first(order, lengths);
  share_in_turn(static_cast<int64_t>(order.size()) * num_kv_heads, [&](const auto& take) {
    configure_full_tiles();
    PrefillScratch scratch;
    for (int64_t w = take(); w >= 0; w = take()) {
      const int64_t request = order[w / num_kv_heads];
      prefill_item_amx(out, q, k, v, starts[request], lengths[request], w % num_kv_heads, scale, scratch);
    }
    _tile_release();
  });
}
#endif

}  // namespace

// Causal attention of each request over its own new tokens: rows starts[i]..starts[i] +
// lengths[i] of q [T, H, D] against the same rows of k, v [T, Hkv, D], into those rows of
// out. bfloat16 on the tile unit: causal_prefill_attention_amx. Otherwise each request is
// one call of torch's fused SDPA kernel; short requests run concurrently on the threads
// (longest first, each thread taking the next one when done), so the results are exactly
// those of calling the kernel request by request.
void causal_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              at::IntArrayRef starts, at::IntArrayRef lengths, double scale) {
  TORCH_CHECK(starts.size() == lengths.size(), "causal_prefill_attention: starts and lengths differ in length");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.sizes() == q.sizes(),
              "causal_prefill_attention: q, out [T, H, D] and k, v [T, Hkv, D] expected");
#ifdef SERVELAB_AMX
  if (prefill_on_tile_unit(q, k, v, out)) {
    causal_prefill_attention_amx(out, q, k, v, starts, lengths, static_cast<float>(scale));
    return;
  }
#endif
  const bool gqa = q.size(1) != k.size(1);
  auto attend = [&](int64_t i) {
    const int64_t start = starts[i], length = lengths[i];
    auto rows = [&](const at::Tensor& t) { return t.narrow(0, start, length).transpose(0, 1).unsqueeze(0); };
    at::Tensor result = at::scaled_dot_product_attention(rows(q), rows(k), rows(v), std::nullopt, 0.0,
                                                         /*is_causal=*/true, scale, gqa);
    out.narrow(0, start, length).copy_(result.squeeze(0).transpose(0, 1));
  };
  std::vector<int64_t> shared, side_by_side;
  for (int64_t i = 0; i < static_cast<int64_t>(starts.size()); ++i)
    (lengths[i] >= kSharedPrefillRows ? shared : side_by_side).push_back(i);
  for (int64_t i : shared) attend(i);
  sort_longest_first(side_by_side, lengths);
  share_in_turn(static_cast<int64_t>(side_by_side.size()), [&](const auto& take) {
    c10::InferenceMode inference_mode;  // worker threads do not inherit the caller's mode
    for (int64_t w = take(); w >= 0; w = take()) attend(side_by_side[w]);
  });
}

}  // namespace servelab_cpu
