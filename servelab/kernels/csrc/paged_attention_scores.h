// paged_attention, part 1: the scores of a span of context positions for a group of query
// vectors, read in place from the key tiles of their blocks (paged_cache.h): float32
// FMAs over keys converted once per kLanes positions, bfloat16 pair dot products
// (AVX512-BF16), or tile dot products (AMX).
#pragma once

#include <algorithm>
#include <vector>

#include "amx.h"
#include "paged_cache.h"

namespace servelab_cpu {
namespace {

// Context positions scored before each softmax update.
constexpr int64_t kSpan = 256;

// Consecutive span positions [span_begin, span_begin + length) stored in one block, from
// slot `first_slot` of block `block`.
struct Segment {
  int64_t block;
  int64_t first_slot;
  int64_t length;
  int64_t span_begin;
};

// Blocks are scattered pages, which the hardware prefetcher does not follow: the next
// segment's key tile and the value rows kPrefetchAhead positions ahead are prefetched.
constexpr int64_t kPrefetchAhead = 8;

inline void prefetch(const void* data, int64_t bytes) {
  const char* p = static_cast<const char*>(data);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

// Calls visit(tile, slot, lanes, span_offset) for each run of up to kLanes consecutive
// span positions in `segments`: `tile` is the key tile of the run's block (`key_tiles` +
// block * block_stride, `tile_elements` long), `slot` its first slot, `span_offset` its
// first position in the span. The next segment's key tile is prefetched meanwhile.
template <typename T, typename Visit>
inline void for_each_key_run(const T* key_tiles, int64_t block_stride, int64_t tile_elements,
                             const std::vector<Segment>& segments, Visit&& visit) {
  for (size_t n = 0; n < segments.size(); ++n) {
    const Segment& seg = segments[n];
    if (n + 1 < segments.size())
      prefetch(key_tiles + segments[n + 1].block * block_stride, tile_elements * static_cast<int64_t>(sizeof(T)));
    const T* tile = key_tiles + seg.block * block_stride;
    for (int64_t o = 0; o < seg.length; o += kLanes)
      visit(tile, seg.first_slot + o, std::min(kLanes, seg.length - o), seg.span_begin + o);
  }
}

// NV query vectors scored together, their accumulators in registers while the keys of
// kLanes positions stream through: scores[j * kSpan + t] = q_j . k_t for the NV vectors (float32, scaled, rows of D) and
// the kLanes (or fewer, `lanes`) positions whose float32 keys are `keys` [D][kLanes].
template <int NV>
inline void score_lanes(const float* keys, int64_t head_dim, const float* query, int64_t lanes, float* scores) {
  VecRegister even[NV], odd[NV];
  for (int v = 0; v < NV; ++v) even[v] = odd[v] = Vec(0.f);
  int64_t d = 0;
  for (; d + 2 <= head_dim; d += 2) {
    const VecRegister k0 = Vec::loadu(keys + d * kLanes);
    const VecRegister k1 = Vec::loadu(keys + (d + 1) * kLanes);
    for (int v = 0; v < NV; ++v) {
      even[v] = fmadd_register(query[v * head_dim + d], k0, even[v]);
      odd[v] = fmadd_register(query[v * head_dim + d + 1], k1, odd[v]);
    }
  }
  for (; d < head_dim; ++d)
    for (int v = 0; v < NV; ++v) even[v] = fmadd_register(query[v * head_dim + d], Vec::loadu(keys + d * kLanes), even[v]);
  for (int v = 0; v < NV; ++v) {
    const Vec total = Vec(even[v]) + Vec(odd[v]);
    if (lanes == kLanes) {
      total.store(scores + v * kSpan);
    } else {
      total.store(scores + v * kSpan, static_cast<int>(lanes));
    }
  }
}

#ifdef SERVELAB_AVX512_BF16
// NV query vectors scored with bfloat16 pair dot products: scores[j * kSpan + t] = scale *
// q_j . k_t for the `lanes` positions whose pair rows start at `keys` (pair p of a position
// at keys[p * block_size], as 32-bit words) and the queries' pairs `query` [NV][pairs].
template <int NV>
inline void score_pair_lanes(const uint32_t* keys, int64_t block_size, int64_t pairs, const uint32_t* query,
                             int64_t lanes, float scale, float* scores) {
  const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
  __m512 even[NV], odd[NV];
  for (int v = 0; v < NV; ++v) even[v] = odd[v] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + 2 <= pairs; p += 2) {
    const __m512bh k0 = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi32(mask, keys + p * block_size));
    const __m512bh k1 = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi32(mask, keys + (p + 1) * block_size));
    for (int v = 0; v < NV; ++v) {
      even[v] = _mm512_dpbf16_ps(even[v], k0, reinterpret_cast<__m512bh>(_mm512_set1_epi32(query[v * pairs + p])));
      odd[v] = _mm512_dpbf16_ps(odd[v], k1, reinterpret_cast<__m512bh>(_mm512_set1_epi32(query[v * pairs + p + 1])));
    }
  }
  for (; p < pairs; ++p) {
    const __m512bh k = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi32(mask, keys + p * block_size));
    for (int v = 0; v < NV; ++v)
      even[v] = _mm512_dpbf16_ps(even[v], k, reinterpret_cast<__m512bh>(_mm512_set1_epi32(query[v * pairs + p])));
  }
  const __m512 scale_vec = _mm512_set1_ps(scale);
  for (int v = 0; v < NV; ++v)
    _mm512_mask_storeu_ps(scores + v * kSpan, mask, _mm512_mul_ps(_mm512_add_ps(even[v], odd[v]), scale_vec));
}

// score_span for bfloat16 pair tiles: `query` holds the vectors' bfloat16 pairs, unscaled.
void score_pair_span(const c10::BFloat16* key_tiles, int64_t block_stride, int64_t block_size, int64_t head_dim,
                     const std::vector<Segment>& segments, const uint32_t* query, int64_t vectors, float scale,
                     float* scores) {
  const int64_t pairs = head_dim / 2;
  for_each_key_run(key_tiles, block_stride, head_dim * block_size, segments,
                   [&](const c10::BFloat16* tile, int64_t slot, int64_t lanes, int64_t span_offset) {
    const uint32_t* column = reinterpret_cast<const uint32_t*>(tile) + slot;
    float* out = scores + span_offset;
    int64_t j = 0;
    for (; j + 4 <= vectors; j += 4)
      score_pair_lanes<4>(column, block_size, pairs, query + j * pairs, lanes, scale, out + j * kSpan);
    for (; j + 2 <= vectors; j += 2)
      score_pair_lanes<2>(column, block_size, pairs, query + j * pairs, lanes, scale, out + j * kSpan);
    for (; j < vectors; ++j)
      score_pair_lanes<1>(column, block_size, pairs, query + j * pairs, lanes, scale, out + j * kSpan);
  });
}

#ifdef SERVELAB_AMX
// ---- scores on the AMX tile unit ----
//
// A key tile in pair layout is already the B operand of a tile dot product: row p holds
// dimension pair p of block_size positions, 64 bytes (16 positions) per tile row. With the
// query vectors' pairs as the A operand, one tdpbf16ps scores 16 positions of up to 16
// query vectors over 32 dimensions, where score_pair_lanes needs a vdpbf16ps per pair
// and vector.

// Shapes the score tiles for `vectors` query vectors (at most 16) on the calling thread.
// Tile registers (the intrinsics take them as literals): tmm0 scores (C), tmm1 query
// pairs (A), tmm2 key pairs (B).
void configure_score_tiles(int64_t vectors) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  config.colsb[0] = config.colsb[1] = config.colsb[2] = 64;
  config.rows[0] = config.rows[1] = static_cast<uint8_t>(vectors);
  config.rows[2] = kTilePairs;
  // GCC does not always see ldtilecfg read the configuration and may drop the stores
  // above (an all-zero configuration faults on the first tile instruction); the barrier
  // keeps them.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// score_pair_span on the tile unit, for tiles configured by configure_score_tiles(vectors);
// `query` [vectors][pairs] bfloat16 pairs, pairs a multiple of 16. Each run reads the 16
// positions from its first slot on (the block's value tile, right after its key tile,
// supplies the rest of a short run) and keeps its `lanes`.
void score_pair_span_amx(const c10::BFloat16* key_tiles, int64_t block_stride, int64_t block_size,
                         int64_t head_dim, const std::vector<Segment>& segments, const uint32_t* query,
                         int64_t vectors, float scale, float* scores) {
  const int64_t pairs = head_dim / 2;
  alignas(64) float tile_scores[16 * 16];
  const __m512 scale_vec = _mm512_set1_ps(scale);
  for_each_key_run(key_tiles, block_stride, head_dim * block_size, segments,
                   [&](const c10::BFloat16* tile, int64_t slot, int64_t lanes, int64_t span_offset) {
    const uint32_t* column = reinterpret_cast<const uint32_t*>(tile) + slot;
    _tile_zero(0);
    for (int64_t p = 0; p < pairs; p += kTilePairs) {
      _tile_loadd(1, query + p, pairs * 4);
      _tile_loadd(2, column + p * block_size, block_size * 4);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, tile_scores, 64);
    const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
    for (int64_t v = 0; v < vectors; ++v)
      _mm512_mask_storeu_ps(scores + v * kSpan + span_offset, mask,
                            _mm512_mul_ps(_mm512_load_ps(tile_scores + v * 16), scale_vec));
  });
}
#endif
#endif

// Scores of every span position for `vectors` query vectors against one KV head's key
// tiles (`key_tiles` + block * block_stride), times each position's key scale when the
// cache is quantized; `keys` is scratch of D * kLanes floats.
template <typename T>
void score_span(const T* key_tiles, int64_t block_stride, int64_t block_size, int64_t head_dim,
                const std::vector<Segment>& segments, const float* query, int64_t vectors, float* keys,
                float* scores) {
  for_each_key_run(key_tiles, block_stride, head_dim * block_size, segments,
                   [&](const T* tile, int64_t slot, int64_t lanes, int64_t span_offset) {
    const T* column = tile + slot;
    if (lanes == kLanes) {
      for (int64_t d = 0; d < head_dim; ++d) load_vec(column + d * block_size).store(keys + d * kLanes);
    } else {
      for (int64_t d = 0; d < head_dim; ++d)
        for (int64_t l = 0; l < kLanes; ++l) keys[d * kLanes + l] = l < lanes ? to_float(column[d * block_size + l]) : 0.f;
    }
    float* out = scores + span_offset;
    int64_t j = 0;
    for (; j + 8 <= vectors; j += 8) score_lanes<8>(keys, head_dim, query + j * head_dim, lanes, out + j * kSpan);
    for (; j + 4 <= vectors; j += 4) score_lanes<4>(keys, head_dim, query + j * head_dim, lanes, out + j * kSpan);
    for (; j + 2 <= vectors; j += 2) score_lanes<2>(keys, head_dim, query + j * head_dim, lanes, out + j * kSpan);
    for (; j < vectors; ++j) score_lanes<1>(keys, head_dim, query + j * head_dim, lanes, out + j * kSpan);
    if constexpr (kQuantized<T>) {
      const Vec scales = Vec::loadu(tile_scales(tile, block_size, head_dim) + slot, static_cast<int>(lanes));
      for (j = 0; j < vectors; ++j)
        (Vec::loadu(out + j * kSpan, static_cast<int>(lanes)) * scales).store(out + j * kSpan, static_cast<int>(lanes));
    }
  });
}

}  // namespace
}  // namespace servelab_cpu
