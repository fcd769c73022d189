// causal_prefill_attention on the AMX tile unit: one request's query heads that share a KV
// head, as one work item (prefill_attention.cpp hands the items to the threads).
#pragma once

#include <algorithm>
#include <cstring>
#include <vector>

#include "amx.h"

#ifdef SERVELAB_AMX
namespace servelab_cpu {
namespace {

// On the tile unit (bfloat16, head_dim a multiple of 32), one work item is a request's
// query heads that share a KV head. Its keys are packed once into dimension pairs
// ([D/2][positions][2], the B operand of the scores) and its values into position pairs
// ([positions/2][D][2], the B operand of the output). Each block of 16 query rows then
// scores its causal prefix 16 x 16 at a time, takes a float32 softmax over whole rows,
// rounds the weights to bfloat16 (as torch's fused kernel does before its second matmul)
// and accumulates weights x values 32 positions x 16 dimensions per instruction.

// Every prefill tile is 16 rows of 64 bytes (configure_full_tiles). Scores: tmm3 queries
// (A), tmm0-tmm2 keys (B), tmm4-tmm7 the scores of four 16-key blocks (C). Output: tmm3
// weights (A), tmm0-tmm2 values (B), tmm4-tmm7 four 16-dimension output columns (C). Four
// independent accumulators keep the tile unit busy while each one's previous product
// completes.

// Per-thread buffers of the tile prefill; positions padded to 64 (keys, scores) and 32
// (values, weights), zero-filled so padded positions add nothing.
struct PrefillScratch {
  std::vector<uint32_t> keys, values;
  std::vector<c10::BFloat16> query, weights;
  std::vector<float> scores, row_sum;
  alignas(64) float output[16 * 64];
};

inline int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// scores [16][key_len] (columns key0 ..) = queries [16 rows][pairs] x keys [pairs][key_len]
// for `blocks` (1-4) blocks of 16 keys from key0.
void query_key_scores_amx(const c10::BFloat16* query, int64_t query_stride, const uint32_t* keys, int64_t key_len,
                          int64_t pairs, int64_t key0, int64_t blocks, float* scores) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t p = 0; p < pairs; p += kTilePairs) {
    _tile_loadd(3, query + 2 * p, query_stride * 2);
    const uint32_t* row = keys + p * key_len + key0;
    _tile_loadd(0, row, key_len * 4);
    _tile_dpbf16ps(4, 3, 0);
    if (blocks > 1) { _tile_loadd(1, row + 16, key_len * 4); _tile_dpbf16ps(5, 3, 1); }
    if (blocks > 2) { _tile_loadd(2, row + 32, key_len * 4); _tile_dpbf16ps(6, 3, 2); }
    if (blocks > 3) { _tile_loadd(0, row + 48, key_len * 4); _tile_dpbf16ps(7, 3, 0); }
  }
  float* dst = scores + key0;
  _tile_stored(4, dst, key_len * 4);
  if (blocks > 1) _tile_stored(5, dst + 16, key_len * 4);
  if (blocks > 2) _tile_stored(6, dst + 32, key_len * 4);
  if (blocks > 3) _tile_stored(7, dst + 48, key_len * 4);
}

// output [16][64] = weights [16][positions] x values for `tiles` (1-4) consecutive
// 16-dimension columns from `column`.
void weighted_values_amx(const c10::BFloat16* weights, int64_t weight_stride, const uint32_t* values,
                         int64_t head_dim, int64_t column, int64_t positions, int64_t tiles, float* output) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t pos = 0; pos < positions; pos += 32) {
    _tile_loadd(3, weights + pos, weight_stride * 2);
    const uint32_t* rows = values + (pos / 2) * head_dim + column;
    _tile_loadd(0, rows, head_dim * 4);
    _tile_dpbf16ps(4, 3, 0);
    if (tiles > 1) { _tile_loadd(1, rows + 16, head_dim * 4); _tile_dpbf16ps(5, 3, 1); }
    if (tiles > 2) { _tile_loadd(2, rows + 32, head_dim * 4); _tile_dpbf16ps(6, 3, 2); }
    if (tiles > 3) { _tile_loadd(0, rows + 48, head_dim * 4); _tile_dpbf16ps(7, 3, 0); }
  }
  _tile_stored(4, output, 256);
  _tile_stored(5, output + 16, 256);
  _tile_stored(6, output + 32, 256);
  _tile_stored(7, output + 48, 256);
}

// Row `row` of the weights: the bfloat16 softmax numerators of its `seen` scaled scores
// (zero up to `positions`); returns their float32 sum.
float softmax_numerators(float* scores, int64_t seen, int64_t positions, float scale, c10::BFloat16* weights) {
  const Vec scale_vec(scale);
  Vec max_lanes(kMasked);
  for (int64_t t = 0; t < seen; t += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, seen - t);
    const Vec scaled = Vec::loadu(scores + t, n) * scale_vec;
    scaled.store(scores + t, n);
    max_lanes = Vec::set(max_lanes, at::vec::maximum(max_lanes, scaled), n);
  }
  const Vec max_vec(
      at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, max_lanes));
  Vec total(0.f);
  for (int64_t t = 0; t < seen; t += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, seen - t);
    const Vec e = Vec::set(Vec(0.f), (Vec::loadu(scores + t, n) - max_vec).exp_u20(), n);
    e.store(scores + t, n);
    total = total + e;
  }
  store_row(weights, scores, seen);
  std::fill(weights + seen, weights + positions, c10::BFloat16(0.f));
  return sum_lanes(total);
}

// Causal attention of one request's rows [start, start + length) for the query heads of
// KV head `kv_head`, on tiles configured by configure_full_tiles.
void prefill_item_amx(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      int64_t start, int64_t length, int64_t kv_head, float scale, PrefillScratch& s) {
  using BF16 = c10::BFloat16;
  const int64_t head_dim = q.size(2), pairs = head_dim / 2;
  const int64_t group = q.size(1) / k.size(1);
  const int64_t key_len = round_up(length, 64), value_len = round_up(length, 32);
  const int64_t q_row = q.stride(0), q_head = q.stride(1), out_row = out.stride(0), out_head = out.stride(1);
  const int64_t k_row = k.stride(0), v_row = v.stride(0);
  const BF16* k_rows = k.data_ptr<BF16>() + start * k_row + kv_head * k.stride(1);
  const BF16* v_rows = v.data_ptr<BF16>() + start * v_row + kv_head * v.stride(1);
  const BF16* q_rows = q.data_ptr<BF16>() + start * q_row;
  BF16* out_rows = out.data_ptr<BF16>() + start * out_row;
  s.keys.assign(pairs * key_len, 0u);
  s.values.assign(value_len / 2 * head_dim, 0u);
  for (int64_t pos = 0; pos < length; ++pos) {
    const uint32_t* key = reinterpret_cast<const uint32_t*>(k_rows + pos * k_row);
    for (int64_t p = 0; p < pairs; ++p) s.keys[p * key_len + pos] = key[p];
    const uint16_t* value = reinterpret_cast<const uint16_t*>(v_rows + pos * v_row);
    uint16_t* dst = reinterpret_cast<uint16_t*>(s.values.data() + (pos / 2) * head_dim) + pos % 2;
    for (int64_t d = 0; d < head_dim; ++d) dst[2 * d] = value[d];
  }
  s.query.assign(16 * head_dim, BF16(0.f));
  s.scores.resize(16 * key_len);
  s.weights.resize(16 * value_len);
  s.row_sum.resize(16);
  for (int64_t g = 0; g < group; ++g) {
    const int64_t head = kv_head * group + g;
    for (int64_t row0 = 0; row0 < length; row0 += 16) {
      const int64_t rows = std::min<int64_t>(16, length - row0);
      const int64_t visible = row0 + rows;  // keys the block's last row sees
      // A full block of query rows is read in place; the last, shorter one from zero-padded scratch.
      const BF16* query = q_rows + row0 * q_row + head * q_head;
      int64_t query_stride = q_row;
      if (rows < 16) {
        for (int64_t i = 0; i < rows; ++i)
          std::memcpy(s.query.data() + i * head_dim, query + i * q_row, head_dim * sizeof(BF16));
        query = s.query.data();
        query_stride = head_dim;
      }
      for (int64_t key0 = 0; key0 < visible; key0 += 64)
        query_key_scores_amx(query, query_stride, s.keys.data(), key_len, pairs, key0,
                             std::min<int64_t>(4, (visible - key0 + 15) / 16), s.scores.data());
      const int64_t positions = round_up(visible, 32);
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t seen = i < rows ? row0 + i + 1 : 0;  // causal: keys 0..row
        s.row_sum[i] = softmax_numerators(s.scores.data() + i * key_len, seen, positions, scale,
                                          s.weights.data() + i * value_len);
      }
      for (int64_t column = 0; column < head_dim; column += 64) {
        const int64_t tiles = std::min<int64_t>(64, head_dim - column) / 16;
        weighted_values_amx(s.weights.data(), value_len, s.values.data(), head_dim, column, positions, tiles,
                            s.output);
        for (int64_t i = 0; i < rows; ++i) {
          const float inv = 1.f / s.row_sum[i];
          float* row = s.output + i * 64;
          for (int64_t d = 0; d < tiles * 16; ++d) row[d] *= inv;
          store_row(out_rows + (row0 + i) * out_row + head * out_head + column, row, tiles * 16);
        }
      }
    }
  }
}

// The tile unit serves these tensors: bfloat16, head_dim a multiple of 32 (whole tile
// rows), contiguous heads.
bool prefill_on_tile_unit(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out) {
  for (const at::Tensor* t : {&q, &k, &v, &out})
    if (t->scalar_type() != at::kBFloat16 || t->stride(2) != 1) return false;
  return q.size(2) % (2 * kTilePairs) == 0 && amx_available();
}

}  // namespace
}  // namespace servelab_cpu
#endif
