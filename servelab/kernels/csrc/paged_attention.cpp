// paged_attention: attention of the query rows of the selected requests over their whole
// context, read in place through the block table (decodes, chunked prefills, prefix-cache
// hits, speculative verification); causal within the new rows, optional sliding window,
// and token trees: the last tree_lens[r] keys of request r are read by row t only where
// tree_mask[t, key - (seq_len - tree_lens[r])] is set (its ancestors and itself).
// Work items of (request, KV head, up to kQueryTile rows) on torch's threads, each walking
// its context in spans of kSpan positions: scores (paged_attention_scores.h), masks, an
// online softmax, the weighted values (paged_attention_values.h).

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops.h"
#include "paged_attention_scores.h"
#include "paged_attention_values.h"

namespace servelab_cpu {
namespace {

// Query rows of one request processed together (they share every key/value load).
constexpr int64_t kQueryTile = 8;

// One unit of attention work: query rows [row_begin, row_end) of request `request` for the
// query heads that share KV head `kv_head`.
struct AttentionItem {
  int64_t request;
  int64_t kv_head;
  int64_t row_begin;
  int64_t row_end;
};

// Per-thread scratch for one work item.
struct AttentionScratch {
  std::vector<float> query, acc, scores, row_max, row_sum, keys;
  std::vector<uint32_t> query_pairs;  // bfloat16 query pairs, for pair dot products
  std::vector<Segment> segments;
  std::vector<int64_t> value_offsets;  // element offset of each span position's value row
  std::vector<float> value_scales;     // each span position's value scale (quantized caches)
  std::vector<float> key_rows;         // the span's keys row-major, as values (values are keys)
};

// The keys of slots [slot, slot + length) of a key tile as float32 rows of D at `rows`: a
// cache whose values are its keys gives them to the value loop this way.
template <typename C>
inline void key_rows_of(const C* tile, int64_t slot, int64_t length, int64_t block_size, int64_t head_dim,
                        float* rows) {
  for (int64_t d = 0; d < head_dim; ++d)
    for (int64_t l = 0; l < length; ++l) rows[l * head_dim + d] = to_float(tile[key_offset<C>(d, slot + l, block_size)]);
}

// Turns the scores of `vectors` query vectors into softmax weights over the span (online:
// running max and sum per vector), rescaling what `acc` holds when the max grows.
inline void softmax_span(AttentionScratch& s, int64_t vectors, int64_t count, int64_t head_dim) {
  for (int64_t j = 0; j < vectors; ++j) {
    float* sc = s.scores.data() + j * kSpan;
    // The last vector's lanes past `count` read as masked.
    const auto load_scores = [&](int64_t t) {
      return t + kLanes <= count ? Vec::loadu(sc + t) : Vec::set(Vec(kMasked), Vec::loadu(sc + t, count - t), count - t);
    };
    Vec max_lanes(kMasked);
    for (int64_t t = 0; t < count; t += kLanes) max_lanes = at::vec::maximum(max_lanes, load_scores(t));
    const float span_max =
        at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, max_lanes);
    if (span_max <= kMasked) {
      std::fill(sc, sc + count, 0.f);
      continue;
    }
    const float new_max = std::max(s.row_max[j], span_max);
    const float rescale = std::exp(s.row_max[j] - new_max);
    const Vec max_vec(new_max);
    Vec total(0.f);
    for (int64_t t = 0; t < count; t += kLanes) {
      const Vec raw = load_scores(t);
      const Vec weight = Vec::blendv(Vec(0.f), (raw - max_vec).exp_u20(), raw > Vec(kMasked));
      weight.store(sc + t, static_cast<int>(std::min(kLanes, count - t)));
      total = total + weight;
    }
    s.row_sum[j] = s.row_sum[j] * rescale + sum_lanes(total);
    s.row_max[j] = new_max;
    if (rescale != 1.f) {
      float* a = s.acc.data() + j * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) a[d] *= rescale;
    }
  }
}

// Queries and outputs of T, a cache of C (T, or int8 / float8_e4m3fn with scales: key
// scales multiply the scores, value scales the softmax weights). A cache of keys alone
// (values are keys) gives each span's keys to the value loop as float32 rows.
template <typename T, typename C>
void paged_attention_kernel(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_table, const at::Tensor& query_start_loc,
                            const at::Tensor& seq_lens, const at::Tensor& requests, double scale,
                            int64_t window, const bool* tree_mask, int64_t tree_stride, const int32_t* tree_lens) {
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = q.size(2);
  const int64_t num_kv_heads = kv_cache.size(1);
  const int64_t block_size = cache_block_size(kv_cache, head_dim);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_row_stride = q.stride(0);
  const int64_t q_head_stride = q.stride(1);
  const int64_t out_row_stride = out.stride(0);
  const int64_t out_head_stride = out.stride(1);
  const int64_t part = part_elements<C>(block_size, head_dim);
  const int64_t parts = kv_cache.size(2);
  const bool values_are_keys = parts == 1;
  const int64_t block_stride = num_kv_heads * parts * part;
  const int64_t table_stride = block_table.stride(0);
  const AccumulateFn<C> accumulate = accumulate_loop<C>(head_dim / kLanes);
  const AccumulateFn<float> accumulate_rows = accumulate_loop<float>(head_dim / kLanes);
  // bfloat16 keys in pairs are scored by pair dot products of the unscaled bfloat16 query.
  constexpr bool kPairScores = kBf16KeyPairs && std::is_same_v<C, c10::BFloat16>;

  const T* q_data = q.data_ptr<T>();
  const C* cache = kv_cache.data_ptr<C>();
  T* out_data = out.data_ptr<T>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* selected = requests.data_ptr<int32_t>();

  std::vector<AttentionItem> items;
  for (int64_t i = 0; i < requests.size(0); ++i) {
    const int64_t r = selected[i];
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t row = starts[r]; row < starts[r + 1]; row += kQueryTile)
        items.push_back({r, h, row, std::min<int64_t>(row + kQueryTile, starts[r + 1])});
  }

#ifdef SERVELAB_AMX
  // Runs of 16 positions need blocks of whole tile rows; up to 16 query vectors per tile;
  // a short run reads on into the value tile, which a cache of keys alone does not have.
  const bool use_tile_unit = kPairScores && block_size % 16 == 0 && head_dim % (2 * kTilePairs) == 0 &&
                           group <= 16 && !values_are_keys && amx_available();
#endif
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
#ifdef SERVELAB_AMX
    if (use_tile_unit) configure_score_tiles(group);
#endif
    AttentionScratch s;
    s.value_offsets.resize(kSpan);
    if constexpr (kQuantized<C>) s.value_scales.resize(kSpan);
    if (values_are_keys) s.key_rows.resize(kSpan * head_dim);
    s.keys.resize(head_dim * kLanes);
    const Vec scale_vec(static_cast<float>(scale));
    for (int64_t w = begin; w < end; ++w) {
      const AttentionItem& item = items[w];
      const int64_t rows = item.row_end - item.row_begin;
      const int64_t vectors = rows * group;  // query vectors: row, then group member
      if constexpr (kPairScores) {
        s.query_pairs.resize(vectors * head_dim / 2);
      } else {
        s.query.resize(vectors * head_dim);
      }
      s.acc.assign(vectors * head_dim, 0.f);
      s.scores.resize(vectors * kSpan);
      s.row_max.assign(vectors, kMasked);
      s.row_sum.assign(vectors, 0.f);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t g = 0; g < group; ++g) {
          const T* src = q_data + (item.row_begin + i) * q_row_stride + (item.kv_head * group + g) * q_head_stride;
          if constexpr (kPairScores) {
            std::memcpy(s.query_pairs.data() + (i * group + g) * head_dim / 2, src, head_dim * sizeof(T));
          } else {
            float* dst = s.query.data() + (i * group + g) * head_dim;
            load_row(src, dst, head_dim);
            for (int64_t d = 0; d < head_dim; ++d) dst[d] *= static_cast<float>(scale);
          }
        }
      // Row i of the tile sits at position first_pos + i of its sequence.
      const int64_t query_len = starts[item.request + 1] - starts[item.request];
      const int64_t first_pos = lens[item.request] - query_len + (item.row_begin - starts[item.request]);
      const int64_t last_pos = first_pos + rows - 1;
      const int64_t lowest = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
      const int64_t tree_begin = tree_lens != nullptr ? lens[item.request] - tree_lens[item.request] : last_pos + 1;
      const int32_t* blocks = table + item.request * table_stride;
      const C* key_tiles = cache + item.kv_head * parts * part;
      const C* value_tiles = values_are_keys ? key_tiles : key_tiles + part;

      for (int64_t span_begin = lowest; span_begin <= last_pos; span_begin += kSpan) {
        const int64_t count = std::min(kSpan, last_pos + 1 - span_begin);
        s.segments.clear();
        for (int64_t t = 0; t < count;) {
          const int64_t pos = span_begin + t;
          const int64_t slot = pos % block_size;
          const int64_t length = std::min(block_size - slot, count - t);
          const int64_t block = blocks[pos / block_size];
          s.segments.push_back({block, slot, length, t});
          if (values_are_keys) {
            key_rows_of(key_tiles + block * block_stride, slot, length, block_size, head_dim,
                        s.key_rows.data() + t * head_dim);
            for (int64_t l = 0; l < length; ++l) s.value_offsets[t + l] = (t + l) * head_dim;
          } else {
            for (int64_t l = 0; l < length; ++l)
              s.value_offsets[t + l] = block * block_stride + (slot + l) * head_dim;
          }
          if constexpr (kQuantized<C>) {
            const float* scales = tile_scales(value_tiles + block * block_stride, block_size, head_dim) + slot;
            std::copy(scales, scales + length, s.value_scales.data() + t);
          }
          t += length;
        }
        for (int64_t i = 0; i < rows; ++i) {
          float* scores = s.scores.data() + i * group * kSpan;
#ifdef SERVELAB_AVX512_BF16
          if constexpr (kPairScores) {
            const uint32_t* query = s.query_pairs.data() + i * group * head_dim / 2;
#ifdef SERVELAB_AMX
            if (use_tile_unit) {
              score_pair_span_amx(key_tiles, block_stride, block_size, head_dim, s.segments, query, group,
                                  static_cast<float>(scale), scores);
              continue;
            }
#endif
            score_pair_span(key_tiles, block_stride, block_size, head_dim, s.segments, query, group,
                            static_cast<float>(scale), scores);
            continue;
          }
#endif
          score_span(key_tiles, block_stride, block_size, head_dim, s.segments, s.query.data() + i * group * head_dim,
                     group, s.keys.data(), scores);
        }
        // Causal and window masks: only partly visible spans need one.
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t pos = first_pos + i;
          const int64_t visible_begin = window > 0 ? std::max<int64_t>(0, pos - window + 1 - span_begin) : 0;
          const int64_t visible_end = std::min(count, pos + 1 - span_begin);
          const int64_t tree_from = std::max<int64_t>(tree_begin - span_begin, 0);
          const bool in_tree = tree_from < std::min(count, visible_end);
          if (visible_begin == 0 && visible_end == count && !in_tree) continue;
          for (int64_t j = i * group; j < (i + 1) * group; ++j) {
            float* sc = s.scores.data() + j * kSpan;
            std::fill(sc, sc + std::min(visible_begin, count), kMasked);
            std::fill(sc + std::max<int64_t>(visible_end, 0), sc + count, kMasked);
            if (!in_tree) continue;
            const bool* reads = tree_mask + (item.row_begin + i) * tree_stride + (span_begin + tree_from - tree_begin);
            for (int64_t t = tree_from; t < count; ++t, ++reads)
              if (!*reads) sc[t] = kMasked;
          }
        }
        softmax_span(s, vectors, count, head_dim);
        if constexpr (kQuantized<C>) {
          for (int64_t j = 0; j < vectors; ++j)
            for (int64_t t = 0; t < count; ++t) s.scores[j * kSpan + t] *= s.value_scales[t];
        }
        if (values_are_keys) {
          accumulate_rows(s.key_rows.data(), s.value_offsets.data(), count, s.scores.data(), vectors, s.acc.data());
        } else {
          accumulate(value_tiles, s.value_offsets.data(), count, s.scores.data(), vectors, s.acc.data());
        }
      }
      for (int64_t j = 0; j < vectors; ++j) {
        const int64_t i = j / group, g = j % group;
        const float inv = s.row_sum[j] > 0.f ? 1.f / s.row_sum[j] : 0.f;
        T* dst = out_data + (item.row_begin + i) * out_row_stride + (item.kv_head * group + g) * out_head_stride;
        float* a = s.acc.data() + j * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) a[d] *= inv;
        store_row(dst, a, head_dim);
      }
    }
#ifdef SERVELAB_AMX
    if (use_tile_unit) _tile_release();
#endif
  });
}

void check_attention_args(const at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                          const at::Tensor& block_table, const at::Tensor& query_start_loc,
                          const at::Tensor& seq_lens, const at::Tensor& requests) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_attention: q must be [T, H, D] with unit last stride");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1, "paged_attention: out must match q's shape");
  TORCH_CHECK(head_dim_supported(q.size(2)), "paged_attention: head_dim ", q.size(2), " is not supported here");
  check_cache(kv_cache, kv_cache.size(1), q.size(2), "paged_attention");
  TORCH_CHECK(q.size(1) % kv_cache.size(1) == 0, "paged_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() &&
                  (kv_cache.scalar_type() == q.scalar_type() || quantized_cache(kv_cache)),
              "paged_attention: q and out must share a dtype, kv_cache the same or int8 / float8_e4m3fn");
  for (const at::Tensor* t : {&block_table, &query_start_loc, &seq_lens, &requests})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(),
                "paged_attention: block_table, query_start_loc, seq_lens and requests must be contiguous int32");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == seq_lens.size(0) &&
                  query_start_loc.size(0) == seq_lens.size(0) + 1,
              "paged_attention: block_table [R, blocks], query_start_loc [R+1] and seq_lens [R] disagree");
}

}  // namespace

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache,
                     const at::Tensor& block_table, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, const at::Tensor& requests, double scale, int64_t window,
                     const c10::optional<at::Tensor>& tree_mask, const c10::optional<at::Tensor>& tree_lens) {
  check_attention_args(out, q, kv_cache, block_table, query_start_loc, seq_lens, requests);
  TORCH_CHECK(tree_mask.has_value() == tree_lens.has_value(), "paged_attention: tree_mask and tree_lens go together");
  const bool* mask = nullptr;
  const int32_t* mask_lens = nullptr;
  int64_t mask_stride = 0;
  if (tree_mask.has_value()) {
    TORCH_CHECK(tree_mask->scalar_type() == at::kBool && tree_mask->dim() == 2 && tree_mask->is_contiguous() &&
                    tree_mask->size(0) == q.size(0),
                "paged_attention: tree_mask must be a contiguous bool [T, W]");
    TORCH_CHECK(tree_lens->scalar_type() == at::kInt && tree_lens->is_contiguous() &&
                    tree_lens->size(0) == seq_lens.size(0),
                "paged_attention: tree_lens must be contiguous int32 [R]");
    mask = tree_mask->data_ptr<bool>();
    mask_lens = tree_lens->data_ptr<int32_t>();
    mask_stride = tree_mask->size(1);
  }
  dispatch_dtype(q.scalar_type(), "paged_attention", [&](auto tag) {
    using scalar_t = decltype(tag);
    dispatch_cache_dtype<scalar_t>(kv_cache.scalar_type(), "paged_attention", [&](auto cache_tag) {
      paged_attention_kernel<scalar_t, decltype(cache_tag)>(out, q, kv_cache, block_table, query_start_loc,
                                                            seq_lens, requests, scale, window, mask, mask_stride,
                                                            mask_lens);
    });
  });
}

bool supports_head_dim(int64_t head_dim) { return head_dim_supported(head_dim); }

bool bf16_key_pairs() { return kBf16KeyPairs; }

}  // namespace servelab_cpu
