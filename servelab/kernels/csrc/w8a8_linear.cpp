// w8a8_linear: y = x @ (q * scale).T with int8 weights (one scale per output channel) and
// the activations quantized to int8 per row at each call, multiplied with int8 dot
// products (AVX512-VNNI vpdpbusd: 64 multiply-adds per instruction, four times float32's).
//
// Each row of x gets its own scale, max |x[m]| / 127, so a row's result never depends on
// the other rows of the batch. vpdpbusd multiplies unsigned by signed bytes: the row is
// stored as xq + 128 (0..254) and 128 * sum_k q[n, k] (precomputed per channel) is
// subtracted from the int32 dot product, which is exact.
//
// Packed layout (servelab/kernels/w8a8_cpu.py builds it): blocks of 16 output channels, each a
// run of K / 4 groups of [16 channels][4 consecutive k], packed[b][k4][j][i] =
// q[16 b + j][4 k4 + i]; channels padded to a multiple of 64 and K to a multiple of 4
// with zeros. One 64-byte load feeds one vpdpbusd for 16 channels.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace servelab_cpu {

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VNNI__)
namespace {

constexpr int64_t kBlock = 16;         // output channels per packed block (one int32 vector)
constexpr int64_t kPackChannels = 64;  // the packed channel count is a multiple of this
constexpr int kTileVecs = 4;           // blocks per tile: 64 channels
constexpr int kMaxRows = 6;            // 24 int32 accumulators of 32 registers

// xu[m, 0:K4 * 4] = round(x[m] / scale[m]) + 128 (128 past K), scale[m] = max |x[m]| / 127.
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t padded_k, uint8_t* xu, float* scale) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * K;
      __m512 largest = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) largest = _mm512_max_ps(largest, _mm512_abs_ps(_mm512_loadu_ps(row + k)));
      float max_abs = _mm512_reduce_max_ps(largest);
      for (; k < K; ++k) max_abs = std::max(max_abs, std::fabs(row[k]));
      const float step = max_abs > 0.f ? max_abs / 127.f : 1.f;
      scale[m] = step;
      const __m512 inverse = _mm512_set1_ps(1.f / step);
      uint8_t* out = xu + m * padded_k;
      for (k = 0; k + 16 <= K; k += 16) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(row + k), inverse),
                                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k),
                         _mm512_cvtepi32_epi8(_mm512_add_epi32(q, _mm512_set1_epi32(128))));
      }
      for (; k < K; ++k) out[k] = static_cast<uint8_t>(std::nearbyint(row[k] * (1.f / step)) + 128.f);
      for (; k < padded_k; ++k) out[k] = 128;
    }
  });
}

// out[r, 0:channels] for R rows of xu against the tile whose first block starts at w.
template <int R>
void tile_rows(const uint8_t* xu, int64_t padded_k, const float* x_scale, const int8_t* w, const int32_t* offsets,
               const float* w_scale, float* out, int64_t ldo, int64_t channels) {
  // Fully unrolled, inputs broadcast first, then one weight vector at a time: 24
  // accumulators, 6 broadcasts and the weight fit the 32 registers. (Left to itself GCC
  // keeps the accumulator array on the stack, or hoists the epilogue's loads into the loop's
  // registers, and loads and stores accumulators around every vpdpbusd.)
  __m512i acc[R][kTileVecs];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < kTileVecs; ++v) acc[r][v] = _mm512_setzero_si512();
  const int64_t block_stride = padded_k * kBlock;
  for (int64_t k = 0; k < padded_k; k += 4) {
    __m512i xs[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xs[r] = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xu + r * padded_k + k));
#pragma GCC unroll 8
    for (int v = 0; v < kTileVecs; ++v) {
      const __m512i weights = _mm512_loadu_si512(w + v * block_stride + k * kBlock);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], xs[r], weights);
    }
  }
  alignas(64) int32_t sums[R][kTileVecs * kBlock];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < kTileVecs; ++v) _mm512_store_si512(sums[r] + v * kBlock, acc[r][v]);
  for (int r = 0; r < R; ++r) {
    float result[kTileVecs * kBlock];
    for (int v = 0; v < kTileVecs; ++v) {
      const __m512i exact = _mm512_sub_epi32(_mm512_load_si512(sums[r] + v * kBlock),
                                             _mm512_loadu_si512(offsets + v * kBlock));
      const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(x_scale[r]), _mm512_loadu_ps(w_scale + v * kBlock));
      _mm512_storeu_ps(result + v * kBlock, _mm512_mul_ps(_mm512_cvtepi32_ps(exact), scale));
    }
    std::copy(result, result + channels, out + r * ldo);
  }
}

template <int R>
void tile_remainder(int64_t rows, const uint8_t* xu, int64_t padded_k, const float* x_scale, const int8_t* w,
                    const int32_t* offsets, const float* w_scale, float* out, int64_t ldo, int64_t channels) {
  if constexpr (R > 0) {
    if (rows == R) return tile_rows<R>(xu, padded_k, x_scale, w, offsets, w_scale, out, ldo, channels);
    tile_remainder<R - 1>(rows, xu, padded_k, x_scale, w, offsets, w_scale, out, ldo, channels);
  }
}

}  // namespace

bool supports_w8a8() { return true; }

void w8a8_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets,
                 const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "w8a8_linear: x must be a contiguous float32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), padded_k = (K + 3) / 4 * 4;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kChar &&
                  packed.size(1) == padded_k / 4 && packed.size(2) == 4 * kBlock &&
                  (packed.size(0) * kBlock) % kPackChannels == 0,
              "w8a8_linear: packed must be a contiguous int8 [N / 16, ceil(K / 4), 64] tensor with N a multiple of ",
              kPackChannels);
  const int64_t padded_n = packed.size(0) * kBlock;
  TORCH_CHECK(offsets.dim() == 1 && offsets.is_contiguous() && offsets.scalar_type() == at::kInt &&
                  offsets.size(0) == padded_n && scales.dim() == 1 && scales.is_contiguous() &&
                  scales.scalar_type() == at::kFloat && scales.size(0) == padded_n,
              "w8a8_linear: offsets (int32) and scales (float32) must be contiguous [", padded_n, "] tensors");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == M &&
                  out.size(1) <= padded_n && out.size(1) > padded_n - kPackChannels,
              "w8a8_linear: out must be a contiguous float32 [M, N] tensor");
  const int64_t N = out.size(1);
  std::vector<uint8_t> xu(M * padded_k);
  std::vector<float> x_scale(M);
  quantize_rows(x.data_ptr<float>(), M, K, padded_k, xu.data(), x_scale.data());
  const int8_t* ws = packed.data_ptr<int8_t>();
  const int32_t* os = offsets.data_ptr<int32_t>();
  const float* ss = scales.data_ptr<float>();
  float* ys = out.data_ptr<float>();
  constexpr int64_t tile_channels = kTileVecs * kBlock;
  const int64_t tiles = (N + tile_channels - 1) / tile_channels;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * tile_channels, channels = std::min(tile_channels, N - n);
      const int8_t* w = ws + n * padded_k;
      int64_t m = 0;
      for (; m + kMaxRows <= M; m += kMaxRows)
        tile_rows<kMaxRows>(xu.data() + m * padded_k, padded_k, x_scale.data() + m, w, os + n, ss + n, ys + m * N + n,
                            N, channels);
      tile_remainder<kMaxRows - 1>(M - m, xu.data() + m * padded_k, padded_k, x_scale.data() + m, w, os + n, ss + n,
                                   ys + m * N + n, N, channels);
    }
  });
}

#else

bool supports_w8a8() { return false; }

void w8a8_linear(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "w8a8_linear needs a CPU with AVX512-VNNI (int8 dot products), which this build does not target");
}

#endif

}  // namespace servelab_cpu
