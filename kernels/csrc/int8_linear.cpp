// int8_linear: y = x @ (q * scale).T for int8 weights with one scale per output channel
// (weight-only: x and y float32), on a weight repacked once at load.
//
// Packed layout (kernels/quantized_cpu.py builds it): blocks of 16 output channels,
// each stored k-major, packed[b][k][j] = q[16 b + j][k], the channels padded with zeros to
// a multiple of kPackChannels. A tile of kTileVecs vectors of channels (64 on AVX-512,
// 32 on AVX2) reads one contiguous stream per block; every int8 vector is widened to
// float32 in registers and multiplied into up to kMaxRows rows of x at once, so one pass
// over the weight serves that many rows and the weight crosses memory as bytes, a quarter
// of float32's traffic. The channel scale multiplies the finished dot products. Threads
// split the tiles of output channels.

#include <ATen/Parallel.h>

#include <algorithm>

#include "ops.h"
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

// The kLanes int8 values at p, as float32.
inline VecRegister load_int8(const int8_t* p) {
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

// out[r, 0:channels] = scales * (x[r] . q[c]) for R rows of x (row stride ldx) and the
// tile of channels whose first block starts at w (`channels` <= kTileChannels are kept).
template <int R>
void tile_rows(const float* x, int64_t ldx, const int8_t* w, int64_t K, const float* scales, float* out,
               int64_t ldo, int64_t channels) {
  VecRegister acc[R][kTileVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kTileVecs; ++v) acc[r][v] = Vec(0.f);
  const int8_t* column[kTileVecs];
  for (int v = 0; v < kTileVecs; ++v) column[v] = w + (v * kLanes / kBlock) * K * kBlock + (v * kLanes) % kBlock;
  for (int64_t k = 0; k < K; ++k) {
    for (int v = 0; v < kTileVecs; ++v) {
      const VecRegister weights = load_int8(column[v] + k * kBlock);
      for (int r = 0; r < R; ++r) acc[r][v] = fmadd_register(x[r * ldx + k], weights, acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* row = out + r * ldo;
    if (channels == kTileChannels) {
      for (int v = 0; v < kTileVecs; ++v) (Vec(acc[r][v]) * Vec::loadu(scales + v * kLanes)).store(row + v * kLanes);
    } else {
      float result[kTileChannels];
      for (int v = 0; v < kTileVecs; ++v) (Vec(acc[r][v]) * Vec::loadu(scales + v * kLanes)).store(result + v * kLanes);
      std::copy(result, result + channels, row);
    }
  }
}

// The last `rows` (< kMaxRows) rows of x against one tile.
template <int R>
void tile_remainder(int64_t rows, const float* x, int64_t K, const int8_t* w, const float* scales, float* out,
                    int64_t N, int64_t channels) {
  if constexpr (R > 0) {
    if (rows == R) return tile_rows<R>(x, K, w, K, scales, out, N, channels);
    tile_remainder<R - 1>(rows, x, K, w, scales, out, N, channels);
  }
}

// All M rows of x against one tile, kMaxRows rows at a time.
void tile(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scales, float* out, int64_t N,
          int64_t channels) {
  int64_t m = 0;
  for (; m + kMaxRows <= M; m += kMaxRows) tile_rows<kMaxRows>(x + m * K, K, w, K, scales, out + m * N, N, channels);
  tile_remainder<kMaxRows - 1>(M - m, x + m * K, K, w, scales, out + m * N, N, channels);
}

}  // namespace

void int8_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "int8_linear: x must be a contiguous float32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kChar &&
                  packed.size(1) == K && packed.size(2) == kBlock && (packed.size(0) * kBlock) % kPackChannels == 0,
              "int8_linear: packed must be a contiguous int8 [N / ", kBlock, ", K, ", kBlock,
              "] tensor with N a multiple of ", kPackChannels);
  const int64_t padded = packed.size(0) * kBlock;
  TORCH_CHECK(scales.dim() == 1 && scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
                  scales.size(0) == padded,
              "int8_linear: scales must be a contiguous float32 [", padded, "] tensor");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == M &&
                  out.size(1) <= padded && out.size(1) > padded - kPackChannels,
              "int8_linear: out must be a contiguous float32 [M, N] tensor");
  const int64_t N = out.size(1);
  const float* xs = x.data_ptr<float>();
  const int8_t* ws = packed.data_ptr<int8_t>();
  const float* ss = scales.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const int64_t tiles = (N + kTileChannels - 1) / kTileChannels;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * kTileChannels;
      tile(xs, M, K, ws + n * K, ss + n, os + n, N, std::min(kTileChannels, N - n));
    }
  });
}

}  // namespace servelab_cpu
