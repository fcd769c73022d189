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
#include <c10/core/InferenceMode.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#include <immintrin.h>
#define SERVELAB_AVX512_BF16 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define SERVELAB_AMX 1
#endif
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
// The SIMD register a Vec wraps, and a multiply-add on it. Accumulator arrays that a loop
// updates are declared of this type: GCC keeps an array of Vec objects in memory (a store
// and reload around every update), an array of the raw register type in registers.
#if defined(CPU_CAPABILITY_AVX512)
using VecRegister = __m512;
inline VecRegister fmadd_register(float w, VecRegister v, VecRegister acc) {
  return _mm512_fmadd_ps(_mm512_set1_ps(w), v, acc);
}
#elif defined(CPU_CAPABILITY_AVX2)
using VecRegister = __m256;
inline VecRegister fmadd_register(float w, VecRegister v, VecRegister acc) {
  return _mm256_fmadd_ps(_mm256_set1_ps(w), v, acc);
}
#else
using VecRegister = Vec;
inline VecRegister fmadd_register(float w, VecRegister v, VecRegister acc) { return at::vec::fmadd(Vec(w), v, acc); }
#endif
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

// Two vectors of float32 values stored as 2 * kLanes values of T. CPUs with AVX512-BF16
// round 32 float32 values to bfloat16 (nearest even) in one instruction, where the generic
// conversion takes about ten per vector.
template <typename T>
inline void store_pair(T* dst, const Vec& low, const Vec& high) {
  if constexpr (std::is_same_v<T, float>) {
    low.store(dst);
    high.store(dst + kLanes);
  }
#ifdef SERVELAB_AVX512_BF16
  else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low)));
  }
#endif
  else {
    at::vec::convert_from_float<T>(low, high).store(dst);
  }
}

// Two vectors rounded through T in registers, as storing them in T and reading them back does.
template <typename T>
inline void round_pair(Vec& low, Vec& high) {
  if constexpr (std::is_same_v<T, float>) {
    return;
  }
#ifdef SERVELAB_AVX512_BF16
  else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
    low = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(packed)), 16));
    high = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(packed, 1)), 16));
  }
#endif
  else {
    std::tie(low, high) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(low, high));
  }
}

// dst[0:n] = src[0:n] rounded to T (two vectors at a time: full-width stores).
template <typename T>
inline void store_row(T* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) store_pair(dst + i, Vec::loadu(src + i), Vec::loadu(src + i + kLanes));
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

inline float sum_lanes(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// sum_i x_i^2 in float32, four vector accumulators wide (a scalar loop would be one chain
// of dependent adds: the compiler may not reorder float sums).
inline float sum_of_squares(const float* x, int64_t n) {
  Vec acc[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
  int64_t i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes)
    for (int a = 0; a < 4; ++a) {
      const Vec v = Vec::loadu(x + i + a * kLanes);
      acc[a] = at::vec::fmadd(v, v, acc[a]);
    }
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = Vec::loadu(x + i);
    acc[0] = at::vec::fmadd(v, v, acc[0]);
  }
  float total = sum_lanes((acc[0] + acc[1]) + (acc[2] + acc[3]));
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
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
//
// Cache layout (one tensor per layer): kv_cache[num_blocks, Hkv, 2, block_size * D]. Each
// (block, KV head) holds a key tile and, right after it, a value tile: a block's keys and
// values for all its heads are one contiguous stretch of memory (8 KB for 16 positions of
// two heads of 64 bfloat16 dimensions), read whole by the work items of one request, which
// run one after another on a thread. Keys are transposed, [D][block_size],
// so the scores of consecutive positions are SIMD lanes and need no horizontal sums; values
// row-major, [block_size][D], so a weighted row adds straight into the output accumulator. Where the
// CPU has AVX512-BF16, bfloat16 keys are stored as dimension pairs, [D/2][block_size][2]:
// one 32-bit lane holds a position's two dimensions, the operand of a bfloat16 pair dot
// product (vdpbf16ps), which scores 16 positions over two dimensions in one instruction.

// True when bfloat16 key tiles use the pair layout on this build.
constexpr bool kBf16KeyPairs =
#ifdef SERVELAB_AVX512_BF16
    true;
#else
    false;
#endif

// Offset of key dimension d of slot `slot` in a key tile of T.
template <typename T>
inline int64_t key_offset(int64_t d, int64_t slot, int64_t block_size) {
  if constexpr (kBf16KeyPairs && std::is_same_v<T, c10::BFloat16>) {
    return ((d / 2) * block_size + slot) * 2 + d % 2;
  } else {
    return d * block_size + slot;
  }
}

// One unit of attention work: query rows [row_begin, row_end) of request `request` for the
// query heads that share KV head `kv_head`.
struct AttentionItem {
  int64_t request;
  int64_t kv_head;
  int64_t row_begin;
  int64_t row_end;
};

// Consecutive span positions [span_begin, span_begin + length) stored in one block, from
// slot `first_slot` of block `block`.
struct Segment {
  int64_t block;
  int64_t first_slot;
  int64_t length;
  int64_t span_begin;
};

// Per-thread scratch for one work item.
struct AttentionScratch {
  std::vector<float> query, acc, scores, row_max, row_sum, keys;
  std::vector<uint32_t> query_pairs;  // bfloat16 query pairs, for pair dot products
  std::vector<Segment> segments;
  std::vector<int64_t> value_offsets;  // element offset of each span position's value row
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

// Tile registers (the intrinsics take them as literals): tmm0 scores (C), tmm1 query
// pairs (A), tmm2 key pairs (B).
constexpr int64_t kTilePairs = 16;  // dimension pairs per tile: 64-byte rows

// The tile unit is usable in this process (Linux grants its register state on request).
bool amx_available() {
  static const bool available = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return available;
}

// Shapes the score tiles for `vectors` query vectors (at most 16) on the calling thread.
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
// tiles (`key_tiles` + block * block_stride); `keys` is scratch of D * kLanes floats.
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
  });
}

// acc[j] += sum_t weights[j * kSpan + t] * value row at cache + offsets[t] for the NV
// accumulators of D = C * kLanes floats at `acc`, held in registers over the span: each
// value row is loaded (and converted to float32) once for all of them.
template <typename T, int C, int NV>
inline void accumulate_vectors(const T* cache, const int64_t* offsets, int64_t count, const float* weights,
                               float* acc) {
  VecRegister a[NV][C];
  for (int n = 0; n < NV; ++n)
    for (int c = 0; c < C; ++c) a[n][c] = Vec::loadu(acc + (n * C + c) * kLanes);
  for (int64_t t = 0; t < count; ++t) {
    if (t + kPrefetchAhead < count) prefetch(cache + offsets[t + kPrefetchAhead], C * kLanes * sizeof(T));
    const T* value = cache + offsets[t];
    for (int c = 0; c < C; ++c) {
      const VecRegister v = load_vec(value + c * kLanes);
      for (int n = 0; n < NV; ++n) a[n][c] = fmadd_register(weights[n * kSpan + t], v, a[n][c]);
    }
  }
  for (int n = 0; n < NV; ++n)
    for (int c = 0; c < C; ++c) Vec(a[n][c]).store(acc + (n * C + c) * kLanes);
}

// accumulate_vectors over `vectors` accumulators from the j-th on, NV at a time while at
// least NV are left, then fewer.
template <typename T, int C, int NV>
inline void accumulate_from(const T* cache, const int64_t* offsets, int64_t count, const float* weights,
                            int64_t vectors, float* acc, int64_t j) {
  for (; j + NV <= vectors; j += NV)
    accumulate_vectors<T, C, NV>(cache, offsets, count, weights + j * kSpan, acc + j * C * kLanes);
  if constexpr (NV > 1) accumulate_from<T, C, NV / 2>(cache, offsets, count, weights, vectors, acc, j);
}

// acc[j] += sum_t weights[j * kSpan + t] * value row at cache + offsets[t], for `vectors`
// accumulators of D = C * kLanes floats; as many at a time as 16 registers hold.
template <typename T, int C>
void accumulate_span(const T* cache, const int64_t* offsets, int64_t count, const float* weights, int64_t vectors,
                     float* acc) {
  constexpr int kVectorsAtOnce = std::max(1, std::min(8, 16 / C));
  accumulate_from<T, C, kVectorsAtOnce>(cache, offsets, count, weights, vectors, acc, 0);
}

// Head sizes the value loop is instantiated for: 1-6, 8 or 16 SIMD vectors.
bool head_dim_supported(int64_t head_dim) {
  const int64_t chunks = head_dim / kLanes;
  return head_dim % kLanes == 0 && ((chunks >= 1 && chunks <= 6) || chunks == 8 || chunks == 16);
}

template <typename T>
using AccumulateFn = void (*)(const T*, const int64_t*, int64_t, const float*, int64_t, float*);

// The value loop instantiated for a head size of `chunks` vectors.
template <typename T>
AccumulateFn<T> accumulate_loop(int64_t chunks) {
  switch (chunks) {
    case 1: return accumulate_span<T, 1>;
    case 2: return accumulate_span<T, 2>;
    case 3: return accumulate_span<T, 3>;
    case 4: return accumulate_span<T, 4>;
    case 5: return accumulate_span<T, 5>;
    case 6: return accumulate_span<T, 6>;
    case 8: return accumulate_span<T, 8>;
    case 16: return accumulate_span<T, 16>;
    default: TORCH_CHECK(false, "paged_attention: head_dim ", chunks * kLanes, " is not supported here");
  }
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

template <typename T>
void paged_attention_kernel(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_table, const at::Tensor& query_start_loc,
                            const at::Tensor& seq_lens, const at::Tensor& requests, double scale,
                            int64_t window) {
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = q.size(2);
  const int64_t num_kv_heads = kv_cache.size(1);
  const int64_t block_size = kv_cache.size(3) / head_dim;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_row_stride = q.stride(0);
  const int64_t q_head_stride = q.stride(1);
  const int64_t out_row_stride = out.stride(0);
  const int64_t out_head_stride = out.stride(1);
  const int64_t tile_size = block_size * head_dim;
  const int64_t block_stride = num_kv_heads * 2 * tile_size;
  const int64_t table_stride = block_table.stride(0);
  const AccumulateFn<T> accumulate = accumulate_loop<T>(head_dim / kLanes);
  // bfloat16 keys in pairs are scored by pair dot products of the unscaled bfloat16 query.
  constexpr bool kPairScores = kBf16KeyPairs && std::is_same_v<T, c10::BFloat16>;

  const T* q_data = q.data_ptr<T>();
  const T* cache = kv_cache.data_ptr<T>();
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
  // Runs of 16 positions need blocks of whole tile rows; up to 16 query vectors per tile.
  const bool use_tile_unit = kPairScores && block_size % 16 == 0 && head_dim % (2 * kTilePairs) == 0 &&
                           group <= 16 && amx_available();
#endif
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
#ifdef SERVELAB_AMX
    if (use_tile_unit) configure_score_tiles(group);
#endif
    AttentionScratch s;
    s.value_offsets.resize(kSpan);
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
      const int32_t* blocks = table + item.request * table_stride;
      const T* key_tiles = cache + item.kv_head * 2 * tile_size;
      const T* value_tiles = key_tiles + tile_size;

      for (int64_t span_begin = lowest; span_begin <= last_pos; span_begin += kSpan) {
        const int64_t count = std::min(kSpan, last_pos + 1 - span_begin);
        s.segments.clear();
        for (int64_t t = 0; t < count;) {
          const int64_t pos = span_begin + t;
          const int64_t slot = pos % block_size;
          const int64_t length = std::min(block_size - slot, count - t);
          const int64_t block = blocks[pos / block_size];
          s.segments.push_back({block, slot, length, t});
          for (int64_t l = 0; l < length; ++l)
            s.value_offsets[t + l] = block * block_stride + (slot + l) * head_dim;
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
          if (visible_begin == 0 && visible_end == count) continue;
          for (int64_t j = i * group; j < (i + 1) * group; ++j) {
            float* sc = s.scores.data() + j * kSpan;
            std::fill(sc, sc + std::min(visible_begin, count), kMasked);
            std::fill(sc + std::max<int64_t>(visible_end, 0), sc + count, kMasked);
          }
        }
        softmax_span(s, vectors, count, head_dim);
        accumulate(value_tiles, s.value_offsets.data(), count, s.scores.data(), vectors, s.acc.data());
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

void check_cache(const at::Tensor& kv_cache, int64_t num_kv_heads, int64_t head_dim, const char* op) {
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(1) == num_kv_heads && kv_cache.size(2) == 2 &&
                  kv_cache.is_contiguous() && kv_cache.size(3) % head_dim == 0,
              op, ": kv_cache must be a contiguous [blocks, Hkv, 2, block_size * D] tensor");
}

void check_attention_args(const at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                          const at::Tensor& block_table, const at::Tensor& query_start_loc,
                          const at::Tensor& seq_lens, const at::Tensor& requests) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_attention: q must be [T, H, D] with unit last stride");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1, "paged_attention: out must match q's shape");
  TORCH_CHECK(head_dim_supported(q.size(2)), "paged_attention: head_dim ", q.size(2), " is not supported here");
  check_cache(kv_cache, kv_cache.size(1), q.size(2), "paged_attention");
  TORCH_CHECK(q.size(1) % kv_cache.size(1) == 0, "paged_attention: query heads must be a multiple of KV heads");
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

// Stores k, v [T, Hkv, D] at their slots (block * block_size + offset; negative: skipped)
// in the tiled layout: keys transposed per (block, head) (in pairs: key_offset), values row-major.
template <typename T>
void write_kv_cache_kernel(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  const int64_t tokens = k.size(0);
  const int64_t num_kv_heads = k.size(1);
  const int64_t head_dim = k.size(2);
  const int64_t block_size = kv_cache.size(3) / head_dim;
  const int64_t tile_size = block_size * head_dim;
  const int64_t block_stride = num_kv_heads * 2 * tile_size;
  const int64_t* slot_data = slots.data_ptr<int64_t>();
  const T* k_data = k.data_ptr<T>();
  const T* v_data = v.data_ptr<T>();
  T* cache = kv_cache.data_ptr<T>();
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slot_data[t];
      if (slot < 0) continue;
      const int64_t block = slot / block_size;
      const int64_t offset = slot % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const T* key = k_data + t * k.stride(0) + h * k.stride(1);
        const T* value = v_data + t * v.stride(0) + h * v.stride(1);
        T* key_tile = cache + block * block_stride + h * 2 * tile_size;
        T* value_row = key_tile + tile_size + offset * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) key_tile[key_offset<T>(d, offset, block_size)] = key[d];
        std::copy(value, value + head_dim, value_row);
      }
    }
  });
}

void write_kv_cache(at::Tensor kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "write_kv_cache: k and v must be [T, Hkv, D] with unit last stride");
  check_cache(kv_cache, k.size(1), k.size(2), "write_kv_cache");
  TORCH_CHECK(k.scalar_type() == kv_cache.scalar_type() && v.scalar_type() == kv_cache.scalar_type(),
              "write_kv_cache: k, v and kv_cache must share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == k.size(0),
              "write_kv_cache: slot_mapping must be contiguous int64 [T]");
  dispatch_dtype(k.scalar_type(), "write_kv_cache", [&](auto tag) {
    using scalar_t = decltype(tag);
    write_kv_cache_kernel<scalar_t>(kv_cache, k, v, slots);
  });
}

// ---- RMSNorm with optional residual add ----

// Rows of `x` [N, size] normalised into `out`: out = w * round(x / rms(x)). With `residual`,
// first residual = round(x + residual) in place and the norm is taken of the new residual.
// Three passes per row, two vectors at a time: the (summed) row into float32, its sum of
// squares, the scaled, rounded and weighted output.
template <typename T>
void rms_norm_kernel(at::Tensor& out, const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                     double eps) {
  const int64_t rows = x.size(0);
  const int64_t size = x.size(1);
  const T* x_data = x.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  T* res_data = residual ? residual->data_ptr<T>() : nullptr;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(size), w(size);
    load_row(weight.data_ptr<T>(), w.data(), size);
    for (int64_t r = begin; r < end; ++r) {
      const T* src = x_data + r * size;
      if (res_data) {
        T* res = res_data + r * size;
        int64_t i = 0;
        for (; i + 2 * kLanes <= size; i += 2 * kLanes) {
          Vec low = load_vec(src + i) + load_vec(res + i);
          Vec high = load_vec(src + i + kLanes) + load_vec(res + i + kLanes);
          round_pair<T>(low, high);
          low.store(row.data() + i);
          high.store(row.data() + i + kLanes);
          store_pair(res + i, low, high);
        }
        for (; i < size; ++i) {
          row[i] = round_to<T>(to_float(src[i]) + to_float(res[i]));
          res[i] = static_cast<T>(row[i]);
        }
      } else {
        load_row(src, row.data(), size);
      }
      const float squares = sum_of_squares(row.data(), size);
      const float inv_rms = 1.f / std::sqrt(squares / static_cast<float>(size) + static_cast<float>(eps));
      const Vec scale(inv_rms);
      T* dst = out_data + r * size;
      int64_t i = 0;
      for (; i + 2 * kLanes <= size; i += 2 * kLanes) {
        Vec low = Vec::loadu(row.data() + i) * scale, high = Vec::loadu(row.data() + i + kLanes) * scale;
        round_pair<T>(low, high);
        store_pair(dst + i, low * Vec::loadu(w.data() + i), high * Vec::loadu(w.data() + i + kLanes));
      }
      for (; i < size; ++i) dst[i] = static_cast<T>(round_to<T>(row[i] * inv_rms) * w[i]);
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

// dst[0:2 * kLanes] = round(round(a * c) + round(b * s)) for two vectors of a and of b and
// the float32 table rows c and s.
template <typename T>
inline void store_rotated(T* dst, const Vec& a_low, const Vec& a_high, const float* c, const Vec& b_low,
                          const Vec& b_high, const float* s) {
  Vec direct_low = a_low * Vec::loadu(c), direct_high = a_high * Vec::loadu(c + kLanes);
  Vec turned_low = b_low * Vec::loadu(s), turned_high = b_high * Vec::loadu(s + kLanes);
  round_pair<T>(direct_low, direct_high);
  round_pair<T>(turned_low, turned_high);
  store_pair(dst, direct_low + turned_low, direct_high + turned_high);
}

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
    std::vector<float> c(dim), s(dim);
    for (int64_t t = begin; t < end; ++t) {
      load_row(cos + positions[t] * table_stride, c.data(), dim);
      load_row(sin + positions[t] * table_stride, s.data(), dim);
      for (int64_t h = 0; h < heads; ++h) {
        T* row = data + t * row_stride + h * head_stride;
        int64_t i = 0;
        for (; i + 2 * kLanes <= half; i += 2 * kLanes) {
          const Vec first_low = load_vec(row + i), first_high = load_vec(row + i + kLanes);
          const Vec second_low = load_vec(row + half + i), second_high = load_vec(row + half + i + kLanes);
          store_rotated(row + i, first_low, first_high, c.data() + i, second_low.neg(), second_high.neg(),
                        s.data() + i);
          store_rotated(row + half + i, second_low, second_high, c.data() + half + i, first_low, first_high,
                        s.data() + half + i);
        }
        for (; i < half; ++i) {
          const float first = to_float(row[i]), second = to_float(row[i + half]);
          row[i] = static_cast<T>(round_to<T>(first * c[i]) + round_to<T>(-second * s[i]));
          row[i + half] = static_cast<T>(round_to<T>(second * c[i + half]) + round_to<T>(first * s[i + half]));
        }
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

// silu(g) = g / (1 + exp(-g)) for a vector of float32 gates. float32 results use torch's
// own formula (exp to 1 ulp, exact division), so they equal F.silu bit for bit; results
// that are rounded to bfloat16 or float16 next take exp_u20 and a refined reciprocal,
// about 1e-6 relative error, far below the 8- or 11-bit rounding that follows.
template <typename T>
inline Vec silu_vec(const Vec& g) {
  const Vec one(1.f);
  if constexpr (std::is_same_v<T, float>) {
    return g / (one + g.neg().exp());
  } else {
    // exp's argument is capped where exp(-g) stays finite (g < -88 gives silu ~ 0 either way),
    // so the reciprocal step below never meets inf * 0.
    const Vec denom = one + at::vec::minimum(g.neg(), Vec(88.f)).exp_u20();
#if defined(CPU_CAPABILITY_AVX512)
    // rcp14 is good to 14 bits; one Newton step doubles that.
    const __m512 d = denom;
    const __m512 r = _mm512_rcp14_ps(d);
    const __m512 refined = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
    return g * Vec(refined);
#else
    return g / denom;
#endif
  }
}

// dst[0:2 * kLanes] = round(round(silu(gate)) * up) for two vectors of gates and of ups.
template <typename T>
inline void silu_times_up(Vec gate_low, Vec gate_high, const Vec& up_low, const Vec& up_high, T* dst) {
  gate_low = silu_vec<T>(gate_low);
  gate_high = silu_vec<T>(gate_high);
  round_pair<T>(gate_low, gate_high);
  store_pair(dst, gate_low * up_low, gate_high * up_high);
}

// out [N, I] = round(round(silu(gate)) * up) for x [N, 2I] = [gate | up], two vectors at a
// time in registers (a row's last, shorter stretch through zero-padded buffers).
template <typename T>
void silu_and_mul_kernel(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0);
  const int64_t size = out.size(1);
  const T* in = x.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate_row = in + r * 2 * size;
      const T* up_row = gate_row + size;
      T* out_row = dst + r * size;
      int64_t i = 0;
      for (; i + 2 * kLanes <= size; i += 2 * kLanes)
        silu_times_up(load_vec(gate_row + i), load_vec(gate_row + i + kLanes), load_vec(up_row + i),
                      load_vec(up_row + i + kLanes), out_row + i);
      if (i < size) {
        const int64_t n = size - i;
        float gate[2 * kLanes] = {}, up[2 * kLanes] = {};
        T result[2 * kLanes];
        load_row(gate_row + i, gate, n);
        load_row(up_row + i, up, n);
        silu_times_up(Vec::loadu(gate), Vec::loadu(gate + kLanes), Vec::loadu(up), Vec::loadu(up + kLanes), result);
        std::copy(result, result + n, out_row + i);
      }
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

// ---- fresh prefills ----

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
// On the tile unit (bfloat16, head_dim a multiple of 32), one work item is a request's
// query heads that share a KV head. Its keys are packed once into dimension pairs
// ([D/2][positions][2], the B operand of the scores) and its values into position pairs
// ([positions/2][D][2], the B operand of the output). Each block of 16 query rows then
// scores its causal prefix 16 x 16 at a time, takes a float32 softmax over whole rows,
// rounds the weights to bfloat16 (as torch's fused kernel does before its second matmul)
// and accumulates weights x values 32 positions x 16 dimensions per instruction.

// Every prefill tile is 16 rows of 64 bytes. Scores: tmm3 queries (A), tmm0-tmm2 keys (B),
// tmm4-tmm7 the scores of four 16-key blocks (C). Output: tmm3 weights (A), tmm0-tmm2
// values (B), tmm4-tmm7 four 16-dimension output columns (C). Four independent
// accumulators keep the tile unit busy while each one's previous product completes.
void configure_prefill_tiles() {
  static const struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  } config;
  _tile_loadconfig(&config);
}

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
// KV head `kv_head`, on tiles configured by configure_prefill_tiles.
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

// Work items (request, KV head), longest request first, taken by the threads in turn.
void causal_prefill_attention_amx(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  at::IntArrayRef starts, at::IntArrayRef lengths, float scale) {
  const int64_t num_kv_heads = k.size(1);
  std::vector<int64_t> order(starts.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  sort_longest_first(order, lengths);
  share_in_turn(static_cast<int64_t>(order.size()) * num_kv_heads, [&](const auto& take) {
    configure_prefill_tiles();
    PrefillScratch scratch;
    for (int64_t w = take(); w >= 0; w = take()) {
      const int64_t request = order[w / num_kv_heads];
      prefill_item_amx(out, q, k, v, starts[request], lengths[request], w % num_kv_heads, scale, scratch);
    }
    _tile_release();
  });
}
#endif

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

// ---- greedy token choice ----

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

bool supports_head_dim(int64_t head_dim) { return head_dim_supported(head_dim); }

bool bf16_key_pairs() { return kBf16KeyPairs; }

}  // namespace

TORCH_LIBRARY(servelab_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_table, Tensor query_start_loc, "
        "Tensor seq_lens, Tensor requests, float scale, int window) -> ()");
  m.def("supports_head_dim(int head_dim) -> bool");
  m.def("bf16_key_pairs() -> bool");
  m.def("write_kv_cache(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("argmax_rows(Tensor(a!) out, Tensor logits) -> ()");
  m.def("causal_prefill_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, int[] starts, int[] lengths, "
        "float scale) -> ()");
}

TORCH_LIBRARY_IMPL(servelab_cpu, CatchAll, m) {
  m.impl("supports_head_dim", &supports_head_dim);
  m.impl("bf16_key_pairs", &bf16_key_pairs);
}

TORCH_LIBRARY_IMPL(servelab_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv_cache", &write_kv_cache);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("causal_prefill_attention", &causal_prefill_attention);
}
