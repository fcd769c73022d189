// w4a8_linear: y = x @ W.T with servelab's group-wise int4 weights (w[n, k] = q[n, k] *
// s[n, g] + m[n, g], q in 0..15, g = k / group, m = zero - 8 * scale; int4_linear.cpp) and
// the activations quantized to int8 per row at each call (int8_rows.h, as w8a8_linear), the
// nibbles multiplied with int8 dot products (AVX512-VNNI vpdpbusd, 64 multiply-adds per
// instruction). The weight crosses memory as half a byte per value and no weight is ever
// widened to float32: the 4-bit decode of llama.cpp's Q4_0 x Q8_0 kind.
//
// Per row m (scale a = max |x[m]| / 127, int8 values xq) and group g:
//   sum_k x_k w_k ~ a * (s * sum_k xq_k q_k + m * sum_k xq_k)
// where sum_k xq_k q_k is the exact int32 dot product of the nibbles (unsigned bytes, the
// first operand of vpdpbusd) with the activations (signed bytes, broadcast from memory as
// its second), and sum_k xq_k the group's activation sum, computed once per row and group.
// So the result is the dot product of the quantized row with the dequantized weight, up to
// float32 rounding; a row's result never depends on the other rows of the batch.
//
// Packed layout (servelab/kernels/w4a8_cpu.py builds it): blocks of 16 output channels, each
// a run of K / 8 steps of 64 bytes, packed[b][t][4 j + i] = q[16 b + j][8 t + i] |
// q[16 b + j][8 t + 4 + i] << 4, so one 64-byte load gives, masked, the operands of two
// vpdpbusd (inputs 8 t..8 t + 3 and 8 t + 4..8 t + 7 of 16 channels), and a tile of 4
// blocks reads 4 streams at once (a standalone loop of the batch-1 steps streamed 8-12%
// faster from memory so than with a tile's steps interleaved into one stream);
// params[b][g][0][j] = s[16 b + j, g], params[b][g][1][j] = m[16 b + j, g] (int4_linear's);
// channels padded to a multiple of 64 with zeros. Groups are multiples of 8 inputs.
//
// int4_sliced_linear is weight-only int4 on the same packed weight and dot products: each
// float32 row split into kInt4Slices int8 slices (int8_rows.h slice_rows, as
// int8_sliced_linear's three), multiplied as rows of their own and summed per row.
//
// Two paths, picked at run time. VNNI: a tile of 64 channels multiplies up to kMaxRows rows
// at once (12 int32 group sums and 12 float32 accumulators of 32 registers), more rows pass
// over it again while its weights sit in the core's cache. From kTileUnitRows rows, on CPUs
// with AMX and groups of multiples of 64 (up to 512): each thread unpacks its tile's nibbles
// a group at a time into bytes in its L1 (the B operand of the tile product: 16 rows of 4
// inputs x 16 channels; q, 0..15, is a signed byte too) and multiplies every 16 rows x 64
// channels x 64 inputs with them per pass of the tile unit (tdpbssd: signed rows, signed
// weights): the same exact int32 group sums as VNNI, so both paths give the same results.
// Threads split the tiles; many rows go in passes of as many as fit half the core's L2, as
// w8a8_linear's.

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "amx.h"
#include "int8_rows.h"
#include "ops.h"
#include "tile_stream.h"

namespace servelab_cpu {

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VNNI__)
namespace {

constexpr int64_t kBlock = 16;         // output channels per packed block (one int32 vector)
constexpr int64_t kPackChannels = 64;  // the packed channel count is a multiple of this
constexpr int64_t kStepInputs = 8;     // inputs per 64-byte step of a block
constexpr int kTileVecs = 4;           // blocks per tile: 64 channels
constexpr int kMaxRows = 3;
constexpr int64_t kTileUnitRows = 8;  // rows from which AMX multiplies, where it can (below, VNNI is faster)
constexpr int64_t kTileRows = 16;      // rows of an AMX tile
constexpr int64_t kTileUnitInputs = 64;  // inputs per tile product (a group is a multiple of this)
constexpr int64_t kMaxTileUnitGroup = 512;  // the largest group the tile unit multiplies (unpacked: 32 KB)
// Slices of a row for weight-only int4: two keep it to max |x| / 64516 (int8_rows.h), far
// below what rounding weights to 4 bits changes (the tiny model's perplexity with int4
// weights: the same to four digits with two slices as with three), and make one row's
// three dot products per 64 weight bytes two (0.5B layers: 1.2-1.7x faster at 16-256 rows,
// 5-9% shorter batch-1 decode steps).
constexpr int kInt4Slices = 2;
// Each weight stream of a VNNI tile is prefetched this far ahead (a block of the 0.5B
// shape's attention and MLP up layers is only 7 KB: the hardware prefetcher would start
// over at every one).
constexpr int64_t kPrefetchBytes = 1024;

struct W4A8Weight {
  const uint8_t* packed;
  const float* params;
  int64_t K, group, groups;
  int64_t block_bytes() const { return K / kStepInputs * 64; }
  int64_t block_params() const { return groups * 2 * kBlock; }
};

// out[r, 0:channels] for R quantized rows (xq, row stride K; scales a; group sums xsum, row
// stride groups) against tile `tile` (channels 64 tile..).
template <int R>
void tile_rows(const int8_t* xq, const float* a, const int32_t* xsum, const W4A8Weight& w, int64_t tile, float* out,
               int64_t ldo, int64_t channels) {
  const uint8_t* packed = w.packed + tile * kTileVecs * w.block_bytes();
  const float* params = w.params + tile * kTileVecs * w.block_params();
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F), high_nibbles = _mm512_set1_epi8(static_cast<char>(0xF0));
  // One row has the registers to sum the high nibbles apart, as 16 q (masked, not shifted:
  // one instruction fewer per 64 bytes), shifted back once per group, which is exact.
  constexpr bool kHighApart = R == 1;
  __m512 acc[R][kTileVecs];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < kTileVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t steps = w.group / kStepInputs;
  for (int64_t g = 0; g < w.groups; ++g) {
    {  // the group parameters two groups on (past a block's end: the next tile's), as the packed streams are
      const float* next = stream_ahead(params, (g + 2) * 2 * kBlock, w.block_params(), kTileVecs);
#pragma GCC unroll 8
      for (int v = 0; v < kTileVecs; ++v) {
        _mm_prefetch(reinterpret_cast<const char*>(next + v * w.block_params()), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(next + v * w.block_params() + kBlock), _MM_HINT_T0);
      }
    }
    __m512i sums[R][kTileVecs], high_sums[R][kTileVecs];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < kTileVecs; ++v) sums[r][v] = high_sums[r][v] = _mm512_setzero_si512();
    for (int64_t t = g * steps; t < (g + 1) * steps; ++t) {
      const uint8_t* prefetched = stream_ahead(packed, t * 64 + kPrefetchBytes, w.block_bytes(), kTileVecs);
#pragma GCC unroll 8
      for (int v = 0; v < kTileVecs; ++v) {
        _mm_prefetch(reinterpret_cast<const char*>(prefetched + v * w.block_bytes()), _MM_HINT_T0);
        const __m512i raw = _mm512_loadu_si512(packed + v * w.block_bytes() + t * 64);
        const __m512i low = _mm512_and_si512(raw, low_nibbles);
        const __m512i high = kHighApart ? _mm512_and_si512(raw, high_nibbles)
                                        : _mm512_and_si512(_mm512_srli_epi16(raw, 4), low_nibbles);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* inputs = xq + r * w.K + t * kStepInputs;
          const __m512i first = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(inputs));
          const __m512i second = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(inputs + 4));
          sums[r][v] = _mm512_dpbusd_epi32(sums[r][v], low, first);
          if constexpr (kHighApart)
            high_sums[r][v] = _mm512_dpbusd_epi32(high_sums[r][v], high, second);
          else
            sums[r][v] = _mm512_dpbusd_epi32(sums[r][v], high, second);
        }
      }
    }
#pragma GCC unroll 8
    for (int v = 0; v < kTileVecs; ++v) {
      const float* param = params + v * w.block_params() + g * 2 * kBlock;
      const __m512 scale = _mm512_loadu_ps(param), offset = _mm512_loadu_ps(param + kBlock);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        if constexpr (kHighApart) sums[r][v] = _mm512_add_epi32(sums[r][v], _mm512_srai_epi32(high_sums[r][v], 4));
        acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][v]), scale, acc[r][v]);
        acc[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(static_cast<float>(xsum[r * w.groups + g])), offset, acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float result[kTileVecs * kBlock];
    const __m512 row_scale = _mm512_set1_ps(a[r]);
    for (int v = 0; v < kTileVecs; ++v) _mm512_storeu_ps(result + v * kBlock, _mm512_mul_ps(acc[r][v], row_scale));
    std::copy(result, result + channels, out + r * ldo);
  }
}

template <int R>
void tile_remainder(int64_t rows, const int8_t* xq, const float* a, const int32_t* xsum, const W4A8Weight& w,
                    int64_t tile, float* out, int64_t ldo, int64_t channels) {
  if constexpr (R > 0) {
    if (rows == R) return tile_rows<R>(xq, a, xsum, w, tile, out, ldo, channels);
    tile_remainder<R - 1>(rows, xq, a, xsum, w, tile, out, ldo, channels);
  }
}


#ifdef SERVELAB_AMX_INT8
// Group g of one tile unpacked as the tile unit's B operand: unpacked[v][k / 4][j][i] =
// q[64 tile + 16 v + j][g * group + k + i] (group / 4 rows of 64 bytes per block).
void unpack_group(const W4A8Weight& w, int64_t tile, int64_t g, uint8_t* unpacked) {
  const uint8_t* packed = w.packed + tile * kTileVecs * w.block_bytes();
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const int64_t steps = w.group / kStepInputs;
  // Group g + 2's weights and parameters (past a block's end: the next tile's first groups),
  // on their way while this group is multiplied.
  const uint8_t* next = stream_ahead(packed, (g + 2) * steps * 64, w.block_bytes(), kTileVecs);
  const float* next_params = stream_ahead(w.params + tile * kTileVecs * w.block_params(), (g + 2) * 2 * kBlock,
                                          w.block_params(), kTileVecs);
  for (int v = 0; v < kTileVecs; ++v) {
    for (int64_t line = 0; line < steps * 64; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next + v * w.block_bytes() + line), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(next_params + v * w.block_params()), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(next_params + v * w.block_params() + kBlock), _MM_HINT_T0);
  }
  for (int v = 0; v < kTileVecs; ++v) {
    for (int64_t t = 0; t < steps; ++t) {
      const __m512i raw = _mm512_loadu_si512(packed + v * w.block_bytes() + (g * steps + t) * 64);
      uint8_t* rows = unpacked + (v * steps + t) * 2 * 64;
      _mm512_store_si512(rows, _mm512_and_si512(raw, low_nibbles));
      _mm512_store_si512(rows + 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low_nibbles));
    }
  }
}

// acc[r, 0:64] += group g's part of rows m0 + r (16 signed rows of xq from m0; rows past M
// are padding) against the group unpacked by unpack_group, on the tile unit (tile_unit_sums:
// the nibbles, 0..15, are signed bytes too).
void tile_unit_group(const int8_t* xq, const int32_t* xsum, const W4A8Weight& w, int64_t tile, int64_t g,
                     const uint8_t* unpacked, int64_t m0, int64_t rows, float* acc) {
  alignas(64) int32_t sums[kTileRows][kTileVecs * kBlock];
  tile_unit_sums<true>(reinterpret_cast<const uint8_t*>(xq) + m0 * w.K + g * w.group, w.K, unpacked,
                       w.group * kBlock, w.group, sums);
  const float* params = w.params + tile * kTileVecs * w.block_params() + g * 2 * kBlock;
  for (int v = 0; v < kTileVecs; ++v) {
    const float* param = params + v * w.block_params();
    const __m512 scale = _mm512_loadu_ps(param), offset = _mm512_loadu_ps(param + kBlock);
    for (int64_t r = 0; r < rows; ++r) {
      float* sum = acc + (m0 + r) * kTileVecs * kBlock + v * kBlock;
      const __m512i exact = _mm512_load_si512(sums[r] + v * kBlock);
      const __m512 scaled = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, _mm512_load_ps(sum));
      _mm512_store_ps(sum, _mm512_fmadd_ps(_mm512_set1_ps(static_cast<float>(xsum[(m0 + r) * w.groups + g])),
                                           offset, scaled));
    }
  }
}

// out[0:M, 0:channels] of one tile on the tile unit: each group unpacked once into the core's
// L1, then every 16 rows multiplied with it, the float32 sums of all rows in `acc` [M, 64].
void tile_unit_rows(const int8_t* xq, const float* a, const int32_t* xsum, const W4A8Weight& w, int64_t tile,
                    int64_t M, float* acc, float* out, int64_t ldo, int64_t channels) {
  alignas(64) uint8_t unpacked[kTileVecs * kMaxTileUnitGroup * kBlock];
  std::fill(acc, acc + M * kTileVecs * kBlock, 0.f);
  for (int64_t g = 0; g < w.groups; ++g) {
    unpack_group(w, tile, g, unpacked);
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows)
      tile_unit_group(xq, xsum, w, tile, g, unpacked, m0, std::min(kTileRows, M - m0), acc);
  }
  for (int64_t m = 0; m < M; ++m) {
    float result[kTileVecs * kBlock];
    const __m512 row_scale = _mm512_set1_ps(a[m]);
    for (int v = 0; v < kTileVecs; ++v) {
      const __m512 sum = _mm512_load_ps(acc + (m * kTileVecs + v) * kBlock);
      _mm512_storeu_ps(result + v * kBlock, _mm512_mul_ps(sum, row_scale));
    }
    std::copy(result, result + channels, out + m * ldo);
  }
}
#endif

}  // namespace

namespace {

// out = x @ W.T for the packed int4 weight W through `per_row` int8 rows per row of x (1:
// the row quantized, w4a8; kInt4Slices: its slices, weight-only int4).
void int4_rows_linear(const char* op, int64_t per_row, at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                      const at::Tensor& params) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              op, ": x must be a contiguous float32 [M, K] tensor");
  const int64_t K = x.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  K % kStepInputs == 0 && packed.size(1) == K / kStepInputs && packed.size(2) == 64 &&
                  (packed.size(0) * kBlock) % kPackChannels == 0,
              op, ": packed must be a contiguous uint8 [N / 16, K / 8, 64] tensor with N a multiple of ",
              kPackChannels);
  const int64_t blocks = packed.size(0), groups = params.dim() == 4 ? params.size(1) : 0;
  TORCH_CHECK(params.dim() == 4 && params.is_contiguous() && params.scalar_type() == at::kFloat &&
                  params.size(0) == blocks && groups > 0 && K % groups == 0 && (K / groups) % kStepInputs == 0 &&
                  params.size(2) == 2 && params.size(3) == kBlock,
              op, ": params must be a contiguous float32 [", blocks, ", K / group, 2, ", kBlock,
              "] tensor with a group that is a multiple of ", kStepInputs);
  const int64_t N = out.size(1);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == x.size(0) &&
                  N <= blocks * kBlock && N > blocks * kBlock - kPackChannels,
              op, ": out must be a contiguous float32 [M, N] tensor");
  const int64_t M = x.size(0) * per_row;  // the int8 rows multiplied
  if (M == 0) return;
  const W4A8Weight w{packed.data_ptr<uint8_t>(), params.data_ptr<float>(), K, K / groups, groups};
  const bool tile_unit = M >= kTileUnitRows && w.group % kTileUnitInputs == 0 && w.group <= kMaxTileUnitGroup &&
                         int8_tile_unit_available();
  // The rows quantized (or sliced) once per call into this thread's buffers, read by every thread:
  // signed, for the tile unit one tile of padding rows (zero) after them.
  thread_local std::vector<uint8_t> rows;
  thread_local std::vector<float> row_scales;
  thread_local std::vector<int32_t> group_sums;
  rows.resize((M + (tile_unit ? kTileRows : 0)) * K);
  row_scales.resize(M);
  group_sums.resize(M * groups);
  std::fill(rows.begin() + M * K, rows.end(), uint8_t{0});
  if (per_row == 1)
    quantize_rows(x.data_ptr<float>(), M, K, K, 0, rows.data(), row_scales.data());
  else
    slice_rows(x.data_ptr<float>(), x.size(0), K, K, 0, rows.data(), row_scales.data(), per_row);
  const int8_t* xq = reinterpret_cast<const int8_t*>(rows.data());
  int32_t* sums = group_sums.data();
  // Each row's sum of xq per group (rows are K = groups * group long: item i is row i / groups,
  // group i % groups).
  at::parallel_for(0, M * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int32_t total = 0;
      for (int64_t k = 0; k < w.group; ++k) total += xq[i * w.group + k];
      sums[i] = total;
    }
  });
  float* ys = out.data_ptr<float>();
  constexpr int64_t tile_channels = kTileVecs * kBlock;
  const int64_t tiles = (N + tile_channels - 1) / tile_channels, pass = rows_per_pass(K + tile_channels * sizeof(float), per_row);
  // Passes of `pass` rows of x: each pass's operand rows (K bytes each) and the tile unit's float32 sums of them
  // (64 per row) stay in the core's L2 while every tile passes them.
  for (int64_t first = 0; first < x.size(0); first += pass) {
    const int64_t rows = std::min(pass, x.size(0) - first), R = rows * per_row, r0 = first * per_row;
    const float* a = row_scales.data() + r0;
    const int32_t* xsum = sums + r0 * groups;
    const int8_t* pq = xq + r0 * K;
    float* y0 = ys + first * N;
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      // Slices' results go to this thread's buffer of one tile's width, then are summed per row.
      thread_local std::vector<float> partial;
      partial.resize(per_row > 1 ? R * tile_channels : 0);
      const int64_t ldo = per_row > 1 ? tile_channels : N;
      const auto finish = [&](int64_t n, int64_t channels) {
        if (per_row > 1) sum_slices(partial.data(), tile_channels, rows, y0 + n, N, channels, per_row);
      };
#ifdef SERVELAB_AMX_INT8
      if (tile_unit) {
        thread_local std::vector<float> acc;
        acc.resize(R * tile_channels + 16);
        float* accs = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(acc.data()) + 63) & ~uintptr_t{63});
        configure_full_tiles();
        for (int64_t t = begin; t < end; ++t) {
          const int64_t n = t * tile_channels, channels = std::min(tile_channels, N - n);
          tile_unit_rows(pq, a, xsum, w, t, R, accs, per_row > 1 ? partial.data() : y0 + n, ldo, channels);
          finish(n, channels);
        }
        _tile_release();
        return;
      }
#endif
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n = t * tile_channels, channels = std::min(tile_channels, N - n);
        float* y = per_row > 1 ? partial.data() : y0 + n;
        int64_t m = 0;
        for (; m + kMaxRows <= R; m += kMaxRows)
          tile_rows<kMaxRows>(pq + m * K, a + m, xsum + m * groups, w, t, y + m * ldo, ldo, channels);
        tile_remainder<kMaxRows - 1>(R - m, pq + m * K, a + m, xsum + m * groups, w, t, y + m * ldo, ldo, channels);
        finish(n, channels);
      }
    });
  }
}

}  // namespace

void w4a8_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& params) {
  int4_rows_linear("w4a8_linear", 1, out, x, packed, params);
}

void int4_sliced_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& params) {
  int4_rows_linear("int4_sliced_linear", kInt4Slices, out, x, packed, params);
}

#else

void w4a8_linear(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "w4a8_linear needs a CPU with AVX512-VNNI (int8 dot products), which this build does not target");
}

void int4_sliced_linear(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "int4_sliced_linear needs a CPU with AVX512-VNNI (int8 dot products), which this build does not "
              "target");
}

#endif

}  // namespace servelab_cpu
