// Native CPU kernels for servelab: paged attention over the block table, and the fused
// element-wise ops of a Llama layer (residual add + RMSNorm, rotary embedding, SiLU x up).
//
// Built on first use by kernels/cpu_ops.py (torch.utils.cpp_extension, -O3 -march=native,
// CPU_CAPABILITY set to torch's so at::vec::Vectorized uses the widest SIMD of the host)
// and registered as torch.ops.servelab_cpu.*. Every op reads and writes float32, bfloat16
// or float16 tensors and computes in float32; the element-wise ops round intermediate
// results to the tensor dtype exactly where the Hugging Face reference does, so greedy
// outputs stay identical in reduced precision too.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
// Sentinel for masked scores (finite, so no inf arithmetic is needed).
constexpr float kMasked = -1e30f;
// Query rows of one request processed together (they share every key/value load).
constexpr int64_t kQueryTile = 8;
// Context positions scored before each softmax update.
constexpr int64_t kSpan = 256;

// ---- scalar and vector conversions between T and float32 ----

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <typename T>
inline float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }

template <typename T>
inline Vec load_vec(const T* src) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(src);
  } else {
    Vec out;
    at::vec::load_to_float<T>(src, out);
    return out;
  }
}

// dst[0:n] = src[0:n] converted to float32.
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) load_vec(src + i).store(dst + i);
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

// dst[0:n] = src[0:n] rounded to T (two vectors at a time: full-width stores).
template <typename T>
inline void store_row(T* dst, const float* src, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + kLanes <= n; i += kLanes) Vec::loadu(src + i).store(dst + i);
  } else {
    for (; i + 2 * kLanes <= n; i += 2 * kLanes)
      at::vec::convert_from_float<T>(Vec::loadu(src + i), Vec::loadu(src + i + kLanes)).store(dst + i);
  }
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// x[0:n] rounded through T in place, as storing an intermediate tensor in T does.
template <typename T>
inline void round_row(float* x, int64_t n) {
  int64_t i = 0;
  if constexpr (!std::is_same_v<T, float>) {
    for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
      const auto [low, high] = at::vec::convert_to_float<T>(
          at::vec::convert_from_float<T>(Vec::loadu(x + i), Vec::loadu(x + i + kLanes)));
      low.store(x + i);
      high.store(x + i + kLanes);
    }
    for (; i < n; ++i) x[i] = round_to<T>(x[i]);
  }
}

inline float sum_lanes(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// Calls f(T{}) with T the C++ type of `type` (float32, bfloat16 or float16).
template <typename F>
void dispatch_dtype(at::ScalarType type, const char* op, F&& f) {
  switch (type) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": dtype must be float32, bfloat16 or float16, got ", type);
  }
}

// ---- paged attention ----

// One unit of attention work: query rows [row_begin, row_end) of request `request` for the
// query heads that share KV heads [head_begin, head_end).
struct AttentionItem {
  int64_t request;
  int64_t head_begin;
  int64_t head_end;
  int64_t row_begin;
  int64_t row_end;
};

// Per-thread scratch for one work item.
struct AttentionScratch {
  std::vector<float> query, acc, scores, row_max, row_sum;
  std::vector<int64_t> offsets;  // element offset of each span position's key row in the cache
};

// Span positions ahead whose key/value rows are prefetched: blocks are scattered pages,
// which the hardware prefetcher does not follow.
constexpr int64_t kPrefetchAhead = 8;

template <typename T, int C>
inline void prefetch_row(const T* row) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < C * kLanes * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b, 0, 3);
}

// Scores of `count` span positions for `vectors` query vectors (float32, scaled, contiguous
// rows of D = C * kLanes) against the key rows at cache + offsets[t]; written to
// scores[j * kSpan + t]. C is a template argument so the key row stays in registers.
template <typename T, int C>
void score_span(const T* cache, const int64_t* offsets, int64_t count, const float* query, int64_t vectors,
                float* scores) {
  for (int64_t t = 0; t < count; ++t) {
    if (t + kPrefetchAhead < count) prefetch_row<T, C>(cache + offsets[t + kPrefetchAhead]);
    const T* key = cache + offsets[t];
    Vec k[C];
    for (int c = 0; c < C; ++c) k[c] = load_vec(key + c * kLanes);
    for (int64_t j = 0; j < vectors; ++j) {
      const float* qv = query + j * C * kLanes;
      Vec sum = Vec::loadu(qv) * k[0];
      for (int c = 1; c < C; ++c) sum = at::vec::fmadd(Vec::loadu(qv + c * kLanes), k[c], sum);
      scores[j * kSpan + t] = sum_lanes(sum);
    }
  }
}

// acc[j] += sum_t weights[j * kSpan + t] * value row at cache + offsets[t], for `vectors`
// accumulators of D = C * kLanes floats; two at a time held in registers over the span.
template <typename T, int C>
void accumulate_span(const T* cache, const int64_t* offsets, int64_t count, const float* weights, int64_t vectors,
                     float* acc) {
  int64_t j = 0;
  for (; j + 2 <= vectors; j += 2) {
    Vec a0[C], a1[C];
    for (int c = 0; c < C; ++c) {
      a0[c] = Vec::loadu(acc + j * C * kLanes + c * kLanes);
      a1[c] = Vec::loadu(acc + (j + 1) * C * kLanes + c * kLanes);
    }
    const float* w0 = weights + j * kSpan;
    const float* w1 = w0 + kSpan;
    for (int64_t t = 0; t < count; ++t) {
      if (t + kPrefetchAhead < count) prefetch_row<T, C>(cache + offsets[t + kPrefetchAhead]);
      const T* value = cache + offsets[t];
      const Vec p0(w0[t]), p1(w1[t]);
      for (int c = 0; c < C; ++c) {
        const Vec v = load_vec(value + c * kLanes);
        a0[c] = at::vec::fmadd(p0, v, a0[c]);
        a1[c] = at::vec::fmadd(p1, v, a1[c]);
      }
    }
    for (int c = 0; c < C; ++c) {
      a0[c].store(acc + j * C * kLanes + c * kLanes);
      a1[c].store(acc + (j + 1) * C * kLanes + c * kLanes);
    }
  }
  for (; j < vectors; ++j) {
    Vec a[C];
    for (int c = 0; c < C; ++c) a[c] = Vec::loadu(acc + j * C * kLanes + c * kLanes);
    const float* w = weights + j * kSpan;
    for (int64_t t = 0; t < count; ++t) {
      const T* value = cache + offsets[t];
      for (int c = 0; c < C; ++c) a[c] = at::vec::fmadd(Vec(w[t]), load_vec(value + c * kLanes), a[c]);
    }
    for (int c = 0; c < C; ++c) a[c].store(acc + j * C * kLanes + c * kLanes);
  }
}

// Head sizes the span loops are instantiated for: 1-6, 8 or 16 SIMD vectors.
bool head_dim_supported(int64_t head_dim) {
  const int64_t chunks = head_dim / kLanes;
  return head_dim % kLanes == 0 && ((chunks >= 1 && chunks <= 6) || chunks == 8 || chunks == 16);
}

template <typename T>
using ScoreFn = void (*)(const T*, const int64_t*, int64_t, const float*, int64_t, float*);
template <typename T>
using AccumulateFn = void (*)(const T*, const int64_t*, int64_t, const float*, int64_t, float*);

// The span loops instantiated for a head size of `chunks` vectors.
template <typename T>
std::pair<ScoreFn<T>, AccumulateFn<T>> span_loops(int64_t chunks) {
  switch (chunks) {
    case 1: return {score_span<T, 1>, accumulate_span<T, 1>};
    case 2: return {score_span<T, 2>, accumulate_span<T, 2>};
    case 3: return {score_span<T, 3>, accumulate_span<T, 3>};
    case 4: return {score_span<T, 4>, accumulate_span<T, 4>};
    case 5: return {score_span<T, 5>, accumulate_span<T, 5>};
    case 6: return {score_span<T, 6>, accumulate_span<T, 6>};
    case 8: return {score_span<T, 8>, accumulate_span<T, 8>};
    case 16: return {score_span<T, 16>, accumulate_span<T, 16>};
    default: TORCH_CHECK(false, "paged_attention: head_dim ", chunks * kLanes, " is not supported here");
  }
}

template <typename T>
void paged_attention_kernel(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_table, const at::Tensor& query_start_loc,
                            const at::Tensor& seq_lens, const at::Tensor& requests, double scale,
                            int64_t window) {
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = q.size(2);
  const int64_t chunks = head_dim / kLanes;
  const int64_t block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_row_stride = q.stride(0);
  const int64_t q_head_stride = q.stride(1);
  const int64_t out_row_stride = out.stride(0);
  const int64_t out_head_stride = out.stride(1);
  const int64_t token_stride = num_kv_heads * head_dim;  // the cache is contiguous
  const int64_t block_stride = block_size * token_stride;
  const int64_t value_offset = kv_cache.size(1) * block_stride;
  const int64_t table_stride = block_table.stride(0);
  const auto [score, accumulate] = span_loops<T>(chunks);

  const T* q_data = q.data_ptr<T>();
  const T* cache = kv_cache.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* selected = requests.data_ptr<int32_t>();

  // Items take every KV head of a row tile (whole cache rows, read in order) unless that
  // leaves too few items to keep the threads busy.
  int64_t tiles = 0;
  for (int64_t i = 0; i < requests.size(0); ++i) {
    const int64_t r = selected[i];
    tiles += (starts[r + 1] - starts[r] + kQueryTile - 1) / kQueryTile;
  }
  const int64_t heads_per_item = tiles >= 4 * at::get_num_threads() ? num_kv_heads : 1;
  std::vector<AttentionItem> items;
  for (int64_t i = 0; i < requests.size(0); ++i) {
    const int64_t r = selected[i];
    for (int64_t h = 0; h < num_kv_heads; h += heads_per_item)
      for (int64_t row = starts[r]; row < starts[r + 1]; row += kQueryTile)
        items.push_back({r, h, h + heads_per_item, row, std::min<int64_t>(row + kQueryTile, starts[r + 1])});
  }

  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    AttentionScratch s;
    s.offsets.resize(kSpan);
    const Vec scale_vec(static_cast<float>(scale));
    for (int64_t w = begin; w < end; ++w) {
      const AttentionItem& item = items[w];
      const int64_t rows = item.row_end - item.row_begin;
      const int64_t heads = item.head_end - item.head_begin;
      const int64_t vectors = rows * heads * group;  // query vectors: row, then KV head, then group member
      s.query.resize(vectors * head_dim);
      s.acc.assign(vectors * head_dim, 0.f);
      s.scores.resize(vectors * kSpan);
      s.row_max.assign(vectors, kMasked);
      s.row_sum.assign(vectors, 0.f);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t hg = 0; hg < heads * group; ++hg) {
          const T* src = q_data + (item.row_begin + i) * q_row_stride + (item.head_begin * group + hg) * q_head_stride;
          float* dst = s.query.data() + (i * heads * group + hg) * head_dim;
          for (int64_t c = 0; c < chunks; ++c) (load_vec(src + c * kLanes) * scale_vec).store(dst + c * kLanes);
        }
      // Row i of the tile sits at position first_pos + i of its sequence.
      const int64_t query_len = starts[item.request + 1] - starts[item.request];
      const int64_t first_pos = lens[item.request] - query_len + (item.row_begin - starts[item.request]);
      const int64_t last_pos = first_pos + rows - 1;
      const int64_t lowest = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
      const int32_t* blocks = table + item.request * table_stride;
      const int64_t head_offset = item.head_begin * head_dim;

      for (int64_t span_begin = lowest; span_begin <= last_pos; span_begin += kSpan) {
        const int64_t count = std::min(kSpan, last_pos + 1 - span_begin);
        for (int64_t t = 0, pos = span_begin; t < count;) {
          const int64_t base = static_cast<int64_t>(blocks[pos / block_size]) * block_stride;
          for (int64_t offset = pos % block_size; offset < block_size && t < count; ++offset, ++t, ++pos)
            s.offsets[t] = base + offset * token_stride;
        }
        // Scores q . k for every query vector and span position, by (row, KV head).
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t hh = 0; hh < heads; ++hh) {
            const int64_t j = (i * heads + hh) * group;
            score(cache + head_offset + hh * head_dim, s.offsets.data(), count, s.query.data() + j * head_dim,
                  group, s.scores.data() + j * kSpan);
          }
        // Causal and window masks: only partly visible spans need one.
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t pos = first_pos + i;
          const int64_t visible_begin = window > 0 ? std::max<int64_t>(0, pos - window + 1 - span_begin) : 0;
          const int64_t visible_end = std::min(count, pos + 1 - span_begin);
          if (visible_begin == 0 && visible_end == count) continue;
          for (int64_t j = i * heads * group; j < (i + 1) * heads * group; ++j) {
            float* sc = s.scores.data() + j * kSpan;
            std::fill(sc, sc + std::min(std::max<int64_t>(visible_begin, 0), count), kMasked);
            std::fill(sc + std::max<int64_t>(visible_end, 0), sc + count, kMasked);
          }
        }
        // Online softmax: turn scores into weights, rescale what was accumulated.
        for (int64_t j = 0; j < vectors; ++j) {
          float* sc = s.scores.data() + j * kSpan;
          Vec max_lanes(kMasked);
          int64_t t = 0;
          for (; t + kLanes <= count; t += kLanes) max_lanes = at::vec::maximum(max_lanes, Vec::loadu(sc + t));
          float span_max = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); },
                                                          max_lanes);
          for (; t < count; ++t) span_max = std::max(span_max, sc[t]);
          if (span_max <= kMasked) {
            std::fill(sc, sc + count, 0.f);
            continue;
          }
          const float new_max = std::max(s.row_max[j], span_max);
          const float rescale = std::exp(s.row_max[j] - new_max);
          const Vec max_vec(new_max);
          Vec total(0.f);
          for (t = 0; t + kLanes <= count; t += kLanes) {
            const Vec raw = Vec::loadu(sc + t);
            const Vec weight = Vec::blendv(Vec(0.f), (raw - max_vec).exp_u20(), raw > Vec(kMasked));
            weight.store(sc + t);
            total = total + weight;
          }
          float sum = sum_lanes(total);
          for (; t < count; ++t) {
            sc[t] = sc[t] <= kMasked ? 0.f : std::exp(sc[t] - new_max);
            sum += sc[t];
          }
          s.row_sum[j] = s.row_sum[j] * rescale + sum;
          s.row_max[j] = new_max;
          if (rescale != 1.f) {
            float* a = s.acc.data() + j * head_dim;
            const Vec r(rescale);
            for (int64_t c = 0; c < chunks; ++c) (Vec::loadu(a + c * kLanes) * r).store(a + c * kLanes);
          }
        }
        // Weighted sum of the values, by (row, KV head).
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t hh = 0; hh < heads; ++hh) {
            const int64_t j = (i * heads + hh) * group;
            accumulate(cache + value_offset + head_offset + hh * head_dim, s.offsets.data(), count,
                       s.scores.data() + j * kSpan, group, s.acc.data() + j * head_dim);
          }
      }
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t hg = 0; hg < heads * group; ++hg) {
          const int64_t j = i * heads * group + hg;
          const Vec inv(s.row_sum[j] > 0.f ? 1.f / s.row_sum[j] : 0.f);
          T* dst = out_data + (item.row_begin + i) * out_row_stride + (item.head_begin * group + hg) * out_head_stride;
          float* a = s.acc.data() + j * head_dim;
          for (int64_t c = 0; c < chunks; ++c) (Vec::loadu(a + c * kLanes) * inv).store(a + c * kLanes);
          store_row(dst, a, head_dim);
        }
    }
  });
}

void check_attention_args(const at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                          const at::Tensor& block_table, const at::Tensor& query_start_loc,
                          const at::Tensor& seq_lens, const at::Tensor& requests) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_attention: q must be [T, H, D] with unit last stride");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1, "paged_attention: out must match q's shape");
  TORCH_CHECK(head_dim_supported(q.size(2)), "paged_attention: head_dim ", q.size(2), " is not supported here");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "paged_attention: kv_cache must be a contiguous [2, blocks, block_size, Hkv, D] tensor");
  TORCH_CHECK(kv_cache.size(4) == q.size(2), "paged_attention: head_dim of q and kv_cache differ");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "paged_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "paged_attention: q, out and kv_cache must share a dtype");
  for (const at::Tensor* t : {&block_table, &query_start_loc, &seq_lens, &requests})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(),
                "paged_attention: block_table, query_start_loc, seq_lens and requests must be contiguous int32");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == seq_lens.size(0) &&
                  query_start_loc.size(0) == seq_lens.size(0) + 1,
              "paged_attention: block_table [R, blocks], query_start_loc [R+1] and seq_lens [R] disagree");
}

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache,
                     const at::Tensor& block_table, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, const at::Tensor& requests, double scale, int64_t window) {
  check_attention_args(out, q, kv_cache, block_table, query_start_loc, seq_lens, requests);
  dispatch_dtype(q.scalar_type(), "paged_attention", [&](auto tag) {
    using scalar_t = decltype(tag);
    paged_attention_kernel<scalar_t>(out, q, kv_cache, block_table, query_start_loc, seq_lens, requests,
                                     scale, window);
  });
}

// ---- RMSNorm with optional residual add ----

// Rows of `x` [N, size] normalised into `out`: out = w * round(x / rms(x)). With `residual`,
// first residual = round(x + residual) in place and the norm is taken of the new residual.
template <typename T>
void rms_norm_kernel(at::Tensor& out, const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                     double eps) {
  const int64_t rows = x.size(0);
  const int64_t size = x.size(1);
  const T* x_data = x.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  T* res_data = residual ? residual->data_ptr<T>() : nullptr;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(size), other(size), w(size);
    load_row(weight.data_ptr<T>(), w.data(), size);
    for (int64_t r = begin; r < end; ++r) {
      load_row(x_data + r * size, row.data(), size);
      if (res_data) {
        load_row(res_data + r * size, other.data(), size);
        for (int64_t i = 0; i < size; ++i) row[i] += other[i];
        round_row<T>(row.data(), size);
        store_row(res_data + r * size, row.data(), size);
      }
      float squares = 0.f;
      for (int64_t i = 0; i < size; ++i) squares += row[i] * row[i];
      const float inv_rms = 1.f / std::sqrt(squares / static_cast<float>(size) + static_cast<float>(eps));
      for (int64_t i = 0; i < size; ++i) row[i] *= inv_rms;
      round_row<T>(row.data(), size);
      for (int64_t i = 0; i < size; ++i) row[i] *= w[i];
      store_row(out_data + r * size, row.data(), size);
    }
  });
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x must be a contiguous [N, size] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "rms_norm: weight must be [size]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: x and weight must share a dtype");
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && out.scalar_type() == x.scalar_type(),
              "rms_norm: out must be contiguous and match x");
  dispatch_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_kernel<scalar_t>(out, x, nullptr, weight, eps);
  });
}

void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must be contiguous and match x");
  dispatch_dtype(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_kernel<scalar_t>(x, x, &residual, weight, eps);
  });
}

// ---- rotary embedding ----

// Rotates x [T, heads, D] in place (rotate-half convention): for i < D/2,
//   x_i = round(round(x_i c_i) + round(-x_{i+D/2} s_i)),
//   x_{i+D/2} = round(round(x_{i+D/2} c_{i+D/2}) + round(x_i s_{i+D/2}))
// with c, s the rows of the cos/sin tables [positions, D] at each token's position.
template <typename T>
void rotary_one(at::Tensor& x, const int64_t* positions, const T* cos, const T* sin, int64_t table_stride) {
  const int64_t tokens = x.size(0);
  const int64_t heads = x.size(1);
  const int64_t dim = x.size(2);
  const int64_t half = dim / 2;
  const int64_t row_stride = x.stride(0);
  const int64_t head_stride = x.stride(1);
  T* data = x.data_ptr<T>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> c(dim), s(dim), v(dim), direct(dim), rotated(dim);
    for (int64_t t = begin; t < end; ++t) {
      load_row(cos + positions[t] * table_stride, c.data(), dim);
      load_row(sin + positions[t] * table_stride, s.data(), dim);
      for (int64_t h = 0; h < heads; ++h) {
        T* row = data + t * row_stride + h * head_stride;
        load_row(row, v.data(), dim);
        for (int64_t i = 0; i < dim; ++i) direct[i] = v[i] * c[i];
        for (int64_t i = 0; i < half; ++i) {
          rotated[i] = -v[i + half] * s[i];
          rotated[i + half] = v[i] * s[i + half];
        }
        round_row<T>(direct.data(), dim);
        round_row<T>(rotated.data(), dim);
        for (int64_t i = 0; i < dim; ++i) direct[i] += rotated[i];
        store_row(row, direct.data(), dim);
      }
    }
  });
}

void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.size(2) % 2 == 0,
              "rotary_embedding: q and k must be [T, heads, D] with unit last stride and even D");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2), "rotary_embedding: q and k disagree");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.size(0) == q.size(0),
              "rotary_embedding: positions must be contiguous int64 [T]");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(1) == q.size(2) && cos.is_contiguous() && sin.is_contiguous(),
              "rotary_embedding: cos and sin must be contiguous [positions, D]");
  TORCH_CHECK(cos.scalar_type() == q.scalar_type() && sin.scalar_type() == q.scalar_type() &&
                  k.scalar_type() == q.scalar_type(),
              "rotary_embedding: q, k and the tables must share a dtype");
  dispatch_dtype(q.scalar_type(), "rotary_embedding", [&](auto tag) {
    using scalar_t = decltype(tag);
    const int64_t* pos = positions.data_ptr<int64_t>();
    rotary_one<scalar_t>(q, pos, cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), cos.stride(0));
    rotary_one<scalar_t>(k, pos, cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), cos.stride(0));
  });
}

// ---- SiLU(gate) x up ----

// out [N, I] = round(round(silu(gate)) * up) for x [N, 2I] = [gate | up].
template <typename T>
void silu_and_mul_kernel(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0);
  const int64_t size = out.size(1);
  const T* in = x.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(size), up(size);
    const Vec one(1.f);
    for (int64_t r = begin; r < end; ++r) {
      load_row(in + r * 2 * size, gate.data(), size);
      load_row(in + r * 2 * size + size, up.data(), size);
      int64_t i = 0;
      for (; i + kLanes <= size; i += kLanes) {
        const Vec g = Vec::loadu(gate.data() + i);
        (g / (one + g.neg().exp())).store(gate.data() + i);
      }
      for (; i < size; ++i) gate[i] = gate[i] / (1.f + std::exp(-gate[i]));
      round_row<T>(gate.data(), size);
      for (i = 0; i < size; ++i) gate[i] *= up[i];
      store_row(dst + r * size, gate.data(), size);
    }
  });
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "silu_and_mul: x must be contiguous [N, 2I]");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0) && out.size(1) * 2 == x.size(1) &&
                  out.scalar_type() == x.scalar_type(),
              "silu_and_mul: out must be contiguous [N, I] of x's dtype");
  dispatch_dtype(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    silu_and_mul_kernel<scalar_t>(out, x);
  });
}

bool supports_head_dim(int64_t head_dim) { return head_dim_supported(head_dim); }

}  // namespace

TORCH_LIBRARY(servelab_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_table, Tensor query_start_loc, "
        "Tensor seq_lens, Tensor requests, float scale, int window) -> ()");
  m.def("supports_head_dim(int head_dim) -> bool");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
}

TORCH_LIBRARY_IMPL(servelab_cpu, CatchAll, m) {
  m.impl("supports_head_dim", &supports_head_dim);
}

TORCH_LIBRARY_IMPL(servelab_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
}
