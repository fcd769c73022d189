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
// q[16 b + j][4 k4 + i]; channels padded to a multiple of 64 and K to a multiple of 64
// with zeros. One 64-byte load feeds one vpdpbusd for 16 channels, and 16 consecutive
// groups of a block are the B operand of one AMX tile product (16 rows of 64 bytes).
//
// Two paths, picked at run time: a few rows (decode) run on AVX512-VNNI, every weight
// vector multiplied into up to 6 rows; from kTileUnitRows rows on, CPUs with AMX (Intel
// Sapphire Rapids and later, where Linux grants the tile state) multiply 16 rows x 16
// channels x 64 inputs per tdpbusd, 4 channel blocks at a time. Both sum the same exact
// int32 products and share the epilogue, so their results are identical. Many rows
// (prefill) go in passes of as many as fit half the core's L2 (int8_rows.h rows_per_pass),
// each pass's tiles split over the threads.
//
// grouped_w8a8_linear multiplies several experts' rows, each by its own matrix of a stack
// ([E, N / 16, K' / 4, 64]), in one parallel region: the rows quantized once (a row's
// result never depends on the others), each expert's rows on the tile unit or VNNI as
// w8a8_linear would pick for them alone.

// int8_sliced_linear (and grouped_int8_sliced_linear) is weight-only int8 on the same
// packed weights and dot products: the float32 activations stay exact to about 6e-8 of a
// row's largest value by splitting each row into kSlices int8 rows (int8_rows.h
// slice_rows: the row quantized, then what it left out quantized on a 254x finer scale,
// twice), multiplied like w8a8's rows (one weight load feeds all three at batch 1, and
// from three rows on the tile unit takes them) and summed per row. Against widening each
// weight to float32 (int8_linear) it does a third of the instructions per weight byte.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "amx.h"
#include "int8_rows.h"
#include "ops.h"
#include "tile_stream.h"
#include "vec.h"

namespace servelab_cpu {

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VNNI__)
namespace {

constexpr int64_t kBlock = 16;         // output channels per packed block (one int32 vector)
constexpr int64_t kPackChannels = 64;  // the packed channel count is a multiple of this
constexpr int64_t kPackInputs = 64;    // the packed input count is a multiple of this
constexpr int kTileVecs = 4;           // blocks per tile: 64 channels
constexpr int kMaxRows = 6;            // 24 int32 accumulators of 32 registers
constexpr int64_t kTileUnitRows = 7;   // rows from which AMX multiplies, where it can
constexpr int64_t kTileRows = 16;      // rows of an AMX tile
// Each weight stream of a VNNI tile is prefetched this far ahead: without it, int8_sliced_linear
// at one row (three dot products per weight vector) streamed a 0.5B model's matrices from
// memory no faster than int8_linear on two threads of the development VM; with it 5-10%
// faster (w8a8_linear's one dot product per vector unchanged: at one row it prefetches nothing).
constexpr int64_t kPrefetchBytes = 1024;

// out[r, 0:channels] = (sums[r] - offsets) * x_scale[r] * w_scale for `rows` rows of a
// tile's exact int32 dot products (row stride lds).
void finish_rows(int64_t rows, const int32_t* sums, int64_t lds, const float* x_scale, const int32_t* offsets,
                 const float* w_scale, float* out, int64_t ldo, int64_t channels) {
  for (int64_t r = 0; r < rows; ++r) {
    float result[kTileVecs * kBlock];
    for (int v = 0; v < kTileVecs; ++v) {
      const __m512i exact = _mm512_sub_epi32(_mm512_loadu_si512(sums + r * lds + v * kBlock),
                                             _mm512_loadu_si512(offsets + v * kBlock));
      const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(x_scale[r]), _mm512_loadu_ps(w_scale + v * kBlock));
      _mm512_storeu_ps(result + v * kBlock, _mm512_mul_ps(_mm512_cvtepi32_ps(exact), scale));
    }
    std::copy(result, result + channels, out + r * ldo);
  }
}

// The next tile's offsets and scales (finish_rows' operands), on their way while this tile's
// weights stream: otherwise each tile's epilogue waits for them from memory.
inline void prefetch_next_epilogue(const int32_t* offsets, const float* w_scale) {
  for (int v = 0; v < kTileVecs; ++v) {
    _mm_prefetch(reinterpret_cast<const char*>(offsets + (kTileVecs + v) * kBlock), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w_scale + (kTileVecs + v) * kBlock), _MM_HINT_T0);
  }
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
  prefetch_next_epilogue(offsets, w_scale);
  const int64_t block_stride = padded_k * kBlock;
  for (int64_t k = 0; k < padded_k; k += 4) {
    __m512i xs[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xs[r] = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xu + r * padded_k + k));
    const int8_t* prefetched = stream_ahead(w, k * kBlock + kPrefetchBytes, block_stride, kTileVecs);
#pragma GCC unroll 8
    for (int v = 0; v < kTileVecs; ++v) {
      if constexpr (R > 1) _mm_prefetch(reinterpret_cast<const char*>(prefetched + v * block_stride), _MM_HINT_T0);
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
  finish_rows(R, sums[0], kTileVecs * kBlock, x_scale, offsets, w_scale, out, ldo, channels);
}

template <int R>
void tile_remainder(int64_t rows, const uint8_t* xu, int64_t padded_k, const float* x_scale, const int8_t* w,
                    const int32_t* offsets, const float* w_scale, float* out, int64_t ldo, int64_t channels) {
  if constexpr (R > 0) {
    if (rows == R) return tile_rows<R>(xu, padded_k, x_scale, w, offsets, w_scale, out, ldo, channels);
    tile_remainder<R - 1>(rows, xu, padded_k, x_scale, w, offsets, w_scale, out, ldo, channels);
  }
}

#ifdef SERVELAB_AMX_INT8
// out[m0 + r, n:n + channels] for the 16 rows of xu from m0 (rows past M are padding) and the
// tile of 64 channels at n, on the tile unit (tile_unit_sums).
void tile_unit_rows(const uint8_t* xu, int64_t padded_k, int64_t m0, int64_t M, const float* x_scale,
                    const int8_t* w, const int32_t* offsets, const float* w_scale, float* out, int64_t ldo,
                    int64_t channels) {
  alignas(64) int32_t sums[kTileRows][kTileVecs * kBlock];
  tile_unit_sums(xu + m0 * padded_k, padded_k, w, padded_k * kBlock, padded_k, sums);
  finish_rows(std::min(kTileRows, M - m0), sums[0], kTileVecs * kBlock, x_scale + m0, offsets, w_scale,
              out + m0 * ldo, ldo, channels);
}
#endif

}  // namespace

bool supports_w8a8() { return true; }

namespace {

// Checks a packed weight [N / 16, K' / 4, 64] with its offsets and scales for x [M, K] and
// out [M, N]; returns K'.
int64_t check_w8a8(const char* op, const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                   const at::Tensor& offsets, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, op,
              ": x must be a contiguous float32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), padded_k = (K + kPackInputs - 1) / kPackInputs * kPackInputs;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kChar &&
                  packed.size(1) == padded_k / 4 && packed.size(2) == 4 * kBlock &&
                  (packed.size(0) * kBlock) % kPackChannels == 0,
              op, ": packed must be a contiguous int8 [N / 16, K' / 4, 64] tensor, N and K' multiples of ",
              kPackChannels);
  const int64_t padded_n = packed.size(0) * kBlock;
  TORCH_CHECK(offsets.dim() == 1 && offsets.is_contiguous() && offsets.scalar_type() == at::kInt &&
                  offsets.size(0) == padded_n && scales.dim() == 1 && scales.is_contiguous() &&
                  scales.scalar_type() == at::kFloat && scales.size(0) == padded_n,
              op, ": offsets (int32) and scales (float32) must be contiguous [", padded_n, "] tensors");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == M &&
                  out.size(1) <= padded_n && out.size(1) > padded_n - kPackChannels,
              op, ": out must be a contiguous float32 [M, N] tensor");
  return padded_k;
}

// The int8 operand of x [M, K]: `per_row` rows for each row of x (1: the row quantized,
// w8a8; kSlices: its slices, weight-only int8), built once per call into per-thread
// buffers that outlive it, followed where the tile unit multiplies them by one tile of
// padding rows (zero activations: 128).
struct Operand {
  const uint8_t* rows;
  const float* scales;
  int64_t per_row;
};

Operand operand_rows(const at::Tensor& x, int64_t padded_k, int64_t per_row, bool tile_unit) {
  const int64_t M = x.size(0), rows = M * per_row;
  thread_local std::vector<uint8_t> xu;
  thread_local std::vector<float> x_scale;
  xu.resize((rows + (tile_unit ? kTileRows : 0)) * padded_k);
  x_scale.resize(rows);
  std::fill(xu.begin() + rows * padded_k, xu.end(), uint8_t{128});
  if (per_row == 1)
    quantize_rows(x.data_ptr<float>(), M, x.size(1), padded_k, 128, xu.data(), x_scale.data());
  else
    slice_rows(x.data_ptr<float>(), M, x.size(1), padded_k, 128, xu.data(), x_scale.data());
  return {xu.data(), x_scale.data(), per_row};  // this thread's buffers, read by every thread of the call
}

// out[0:M, n:n + channels] for M quantized rows (xs, x_scales) against the tile of 64
// channels whose first block starts at w: the tile unit from kTileUnitRows rows where
// `tile_unit` (the thread's tiles configured), else VNNI. The tile unit reads whole tiles
// of 16 rows; rows past M are discarded.
void tile_item(bool tile_unit, const uint8_t* xs, int64_t padded_k, const float* x_scales, int64_t M,
               const int8_t* w, const int32_t* os, const float* ss, float* ys, int64_t N, int64_t channels) {
#ifdef SERVELAB_AMX_INT8
  if (tile_unit && M >= kTileUnitRows) {
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) tile_unit_rows(xs, padded_k, m0, M, x_scales, w, os, ss, ys, N, channels);
    return;
  }
#endif
  int64_t m = 0;
  for (; m + kMaxRows <= M; m += kMaxRows)
    tile_rows<kMaxRows>(xs + m * padded_k, padded_k, x_scales + m, w, os, ss, ys + m * N, N, channels);
  tile_remainder<kMaxRows - 1>(M - m, xs + m * padded_k, padded_k, x_scales + m, w, os, ss, ys + m * N, N, channels);
}

// out[0:M, 0:channels] (row stride N) for the M rows of x from row m of the operand against
// the tile at w: the quantized rows' results directly, or the slices' results (in a
// per-thread buffer of the tile's width) summed into each row.
void operand_item(bool tile_unit, const Operand& a, int64_t m, int64_t padded_k, int64_t M, const int8_t* w,
                  const int32_t* os, const float* ss, float* out, int64_t N, int64_t channels) {
  constexpr int64_t width = kTileVecs * kBlock;
  const int64_t first = m * a.per_row;
  if (a.per_row == 1)
    return tile_item(tile_unit, a.rows + first * padded_k, padded_k, a.scales + first, M, w, os, ss, out, N, channels);
  thread_local std::vector<float> partial;
  partial.resize(M * a.per_row * width);
  tile_item(tile_unit, a.rows + first * padded_k, padded_k, a.scales + first, M * a.per_row, w, os, ss,
            partial.data(), width, channels);
  sum_slices(partial.data(), width, M, out, N, channels);
}

// Runs body(item) for items [0, items) over the threads, each thread's tiles configured
// for the tile unit around its share where `tile_unit`.
template <typename F>
void parallel_items(int64_t items, bool tile_unit, F&& body) {
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
#ifdef SERVELAB_AMX_INT8
    if (tile_unit) configure_full_tiles();
#endif
    for (int64_t item = begin; item < end; ++item) body(item);
#ifdef SERVELAB_AMX_INT8
    if (tile_unit) _tile_release();
#endif
  });
}

// out = x @ W.T for the packed weight W through `per_row` operand rows per row of x.
void operand_linear(const char* op, int64_t per_row, at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                    const at::Tensor& offsets, const at::Tensor& scales) {
  const int64_t padded_k = check_w8a8(op, out, x, packed, offsets, scales);
  const int64_t M = x.size(0), N = out.size(1);
  constexpr int64_t tile_channels = kTileVecs * kBlock;
  const bool tile_unit = M * per_row >= kTileUnitRows && int8_tile_unit_available();
  const Operand a = operand_rows(x, padded_k, per_row, tile_unit);
  const int8_t* ws = packed.data_ptr<int8_t>();
  const int32_t* os = offsets.data_ptr<int32_t>();
  const float* ss = scales.data_ptr<float>();
  float* ys = out.data_ptr<float>();
  // Passes of `pass` rows, each split over the threads by tiles.
  const int64_t pass = rows_per_pass(padded_k, per_row);
  for (int64_t m = 0; m < M; m += pass) {
    const int64_t rows = std::min(pass, M - m);
    parallel_items((N + tile_channels - 1) / tile_channels, tile_unit, [&](int64_t t) {
      const int64_t n = t * tile_channels;
      operand_item(tile_unit, a, m, padded_k, rows, ws + n * padded_k, os + n, ss + n, ys + m * N + n, N,
                   std::min(tile_channels, N - n));
    });
  }
}

// operand_linear for each expert's rows of x (grouped_w8a8_linear's arguments).
void grouped_operand_linear(const char* op, int64_t per_row, at::Tensor& out, const at::Tensor& x,
                            const at::Tensor& packed, const at::Tensor& offsets, const at::Tensor& scales,
                            at::IntArrayRef experts, at::IntArrayRef starts, at::IntArrayRef counts) {
  TORCH_CHECK(packed.dim() == 4 && offsets.dim() == 2 && scales.dim() == 2 && !experts.empty() &&
                  experts.size() == starts.size() && experts.size() == counts.size(),
              op, ": packed [E, N / 16, K' / 4, 64], offsets and scales [E, N'] with one start and count per expert");
  const int64_t padded_k = check_w8a8(op, out, x, packed.select(0, experts[0]), offsets.select(0, experts[0]),
                                      scales.select(0, experts[0]));
  const int64_t N = out.size(1), padded_n = offsets.size(1), expert_stride = packed.stride(0);
  constexpr int64_t tile_channels = kTileVecs * kBlock;
  const int64_t tiles = (N + tile_channels - 1) / tile_channels;
  const bool tile_unit =
      int8_tile_unit_available() && *std::max_element(counts.begin(), counts.end()) * per_row >= kTileUnitRows;
  const Operand a = operand_rows(x, padded_k, per_row, tile_unit);
  const int8_t* ws = packed.data_ptr<int8_t>();
  const int32_t* os = offsets.data_ptr<int32_t>();
  const float* ss = scales.data_ptr<float>();
  float* ys = out.data_ptr<float>();
  // Each expert's rows in passes (rows_per_pass), one item per pass and tile, a pass's tiles in a row.
  struct Pass {
    int64_t expert, first, rows;
  };
  std::vector<Pass> passes;
  const int64_t pass = rows_per_pass(padded_k, per_row);
  for (size_t g = 0; g < experts.size(); ++g)
    for (int64_t m = 0; m < counts[g]; m += pass)
      passes.push_back({experts[g], starts[g] + m, std::min(pass, counts[g] - m)});
  parallel_items(static_cast<int64_t>(passes.size()) * tiles, tile_unit, [&](int64_t item) {
    const Pass& p = passes[item / tiles];
    const int64_t n = (item % tiles) * tile_channels, e = p.expert, m = p.first;
    operand_item(tile_unit, a, m, padded_k, p.rows, ws + e * expert_stride + n * padded_k, os + e * padded_n + n,
                 ss + e * padded_n + n, ys + m * N + n, N, std::min(tile_channels, N - n));
  });
}

}  // namespace

void w8a8_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets,
                 const at::Tensor& scales) {
  operand_linear("w8a8_linear", 1, out, x, packed, offsets, scales);
}

void int8_sliced_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets,
                        const at::Tensor& scales) {
  operand_linear("int8_sliced_linear", kSlices, out, x, packed, offsets, scales);
}

void grouped_w8a8_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets,
                         const at::Tensor& scales, at::IntArrayRef experts, at::IntArrayRef starts,
                         at::IntArrayRef counts) {
  grouped_operand_linear("grouped_w8a8_linear", 1, out, x, packed, offsets, scales, experts, starts, counts);
}

void grouped_int8_sliced_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                                const at::Tensor& offsets, const at::Tensor& scales, at::IntArrayRef experts,
                                at::IntArrayRef starts, at::IntArrayRef counts) {
  grouped_operand_linear("grouped_int8_sliced_linear", kSlices, out, x, packed, offsets, scales, experts, starts,
                         counts);
}

#else

bool supports_w8a8() { return false; }

void w8a8_linear(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "w8a8_linear needs a CPU with AVX512-VNNI (int8 dot products), which this build does not target");
}

void int8_sliced_linear(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "int8_sliced_linear needs a CPU with AVX512-VNNI (int8 dot products), which this build does "
              "not target");
}

void grouped_int8_sliced_linear(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef) {
  TORCH_CHECK(false, "grouped_int8_sliced_linear needs a CPU with AVX512-VNNI (int8 dot products), which this build "
              "does not target");
}

void grouped_w8a8_linear(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         at::IntArrayRef, at::IntArrayRef, at::IntArrayRef) {
  TORCH_CHECK(false, "grouped_w8a8_linear needs a CPU with AVX512-VNNI (int8 dot products), which this build does "
              "not target");
}

#endif

}  // namespace servelab_cpu
