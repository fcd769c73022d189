// The register tile of servelab's blocked matmuls (blocked_linear.cpp: float32, bfloat16
// and int8 weights; int4_linear.cpp: int4 weights dequantized a K slice at a time): a weight
// repacked into blocks of 16 output channels stored k-major, packed[b][k][j] =
// W[16 b + j][k], and the micro-kernel that multiplies one tile of kTileVecs vectors of
// channels into up to kMaxRows rows of x over one K slice.
#pragma once

#include <algorithm>
#include <type_traits>

#include <c10/util/BFloat16.h>

#include "tile_stream.h"
#include "vec.h"

namespace servelab_cpu {
namespace {

constexpr int64_t kBlock = 16;          // output channels per packed block
constexpr int64_t kPackChannels = 64;   // the packed channel count is a multiple of this
constexpr int kTileVecs = 4;            // vectors of output channels per tile
constexpr int64_t kTileChannels = kTileVecs * kLanes;
static_assert(kBlock % kLanes == 0 && kPackChannels % kTileChannels == 0, "tile must split the packed blocks");
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kMaxRows = 6;  // 24 accumulators of 32 registers
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int kMaxRows = 3;  // 12 accumulators of 16 registers
#else
constexpr int kMaxRows = 2;
#endif
constexpr int64_t kSliceBytes = 512 * 1024;  // the weight bytes of one tile's K slice (half an L2)
// Each weight stream of a tile is prefetched this many bytes ahead, once per cache line: at
// decode sizes the streams of a small matrix end before the hardware prefetcher ramps up
// (a 0.5-1 MiB matrix on two threads of the development VM streamed at 21-22 GB/s in
// bfloat16 and 26-28 in float32 without it, 23-26 and 27-30 with it).
constexpr int64_t kPrefetchBytes = 4096;
template <typename W>
constexpr int64_t kStepsPerLine = std::max<int64_t>(1, 64 / static_cast<int64_t>(sizeof(W) * kBlock));

// The kLanes weights at p, as float32.
inline VecRegister load_weights(const float* p) { return Vec::loadu(p); }

inline VecRegister load_weights(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  float values[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) values[i] = p[i];
  return Vec::loadu(values);
#endif
}

inline VecRegister load_weights(const c10::BFloat16* p) {  // a bfloat16 is a float32's high half
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i halves = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(halves, 16));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(halves, 16));
#else
  float values[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) values[i] = static_cast<float>(p[i]);
  return Vec::loadu(values);
#endif
}

// Where one call of the kernel works: the packed weight of a tile, its K slice, and what
// the slice's epilogue does with the sums.
template <typename W>
struct Slice {
  const W* tile;          // the tile's first block (packed + first channel * K)
  int64_t K;              // the full input width (the stride between blocks is K * kBlock)
  int64_t k_begin, k_end;
  const float* scales;    // per-channel scales of the tile, applied by the last slice; null for none
  int64_t channels;       // real channels of the tile (<= kTileChannels)
  bool first, last;       // the first slice starts the sums, later ones add to `out`
};

// out[r, 0:channels] (+)= x[r] . W[c] over the slice, for R rows of x (row stride ldx) and
// out (row stride ldo).
template <int R, typename W>
void tile_rows(const float* x, int64_t ldx, const Slice<W>& s, float* out, int64_t ldo) {
  VecRegister acc[R][kTileVecs];
  for (int r = 0; r < R; ++r) {
    if (s.first) {
      for (int v = 0; v < kTileVecs; ++v) acc[r][v] = Vec(0.f);
    } else {
      float partial[kTileChannels] = {};
      std::copy(out + r * ldo, out + r * ldo + s.channels, partial);
      for (int v = 0; v < kTileVecs; ++v) acc[r][v] = Vec::loadu(partial + v * kLanes);
    }
  }
  const W* column[kTileVecs];
  for (int v = 0; v < kTileVecs; ++v)
    column[v] = s.tile + (v * kLanes / kBlock) * s.K * kBlock + (v * kLanes) % kBlock;
  const int64_t block_elements = s.K * kBlock;
  for (int64_t k = s.k_begin; k < s.k_end; ++k) {
    const int64_t ahead = k * kBlock + kPrefetchBytes / static_cast<int64_t>(sizeof(W));
    for (int v = 0; v < kTileVecs; ++v) {
      if (k % kStepsPerLine<W> == 0)
        __builtin_prefetch(stream_ahead(column[v], ahead, block_elements, kTileChannels / kBlock), 0, 3);
      const VecRegister weights = load_weights(column[v] + k * kBlock);
      for (int r = 0; r < R; ++r) acc[r][v] = fmadd_register(x[r * ldx + k], weights, acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float result[kTileChannels];
    for (int v = 0; v < kTileVecs; ++v) {
      Vec sums(acc[r][v]);
      if (s.last && s.scales != nullptr) sums = sums * Vec::loadu(s.scales + v * kLanes);
      sums.store(result + v * kLanes);
    }
    std::copy(result, result + s.channels, out + r * ldo);
  }
}

// The last `rows` (< kMaxRows) rows of a group against one slice.
template <int R, typename W>
void slice_remainder(int64_t rows, const float* x, int64_t ldx, const Slice<W>& s, float* out, int64_t ldo) {
  if constexpr (R > 0) {
    if (rows == R) return tile_rows<R>(x, ldx, s, out, ldo);
    slice_remainder<R - 1>(rows, x, ldx, s, out, ldo);
  }
}

}  // namespace
}  // namespace servelab_cpu
