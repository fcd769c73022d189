// blocked_linear: y = x @ W.T for float32 rows x and a weight repacked once at load into
// blocks of 16 output channels stored k-major (servelab/kernels/blocked_linear.py builds it):
// packed[b][k][j] = W[16 b + j][k], the channels padded with zeros to a multiple of
// kPackChannels. Three weight types share the kernel:
//
//   float_linear  float32 weights (the default CPU matmul of float32 models)
//   bf16_linear   bfloat16 weights (a bfloat16 model's small matmuls), each vector widened to
//                 float32 in registers; bfloat16 rows are widened first and the float32 sums
//                 rounded once to bfloat16, as a bfloat16 matmul that accumulates in float32
//   int8_linear   int8 weights with one scale per output channel (weight-only int8), each
//                 int8 vector widened to float32 in registers, so the weight crosses memory
//                 as bytes, a quarter of float32's traffic; the scale multiplies the
//                 finished dot products.
//
// A tile of kTileVecs vectors of channels (64 on AVX-512, 32 on AVX2) reads one contiguous
// stream per block and multiplies every weight vector into up to kMaxRows rows of x at
// once, so at decode sizes one pass over the weight serves the whole batch and the matmul
// runs at memory speed. All rows of x pass over a tile while its weights sit in the core's
// L2 cache, so the weight crosses memory once whatever the row count; K is cut into slices
// that keep a tile's weights within half an L2 (partial sums of a slice go through `out`).
// Threads split the tiles, and the rows into groups only where there are too few tiles to
// keep every thread busy. grouped_expert_linear multiplies several experts' rows, each by
// its own matrix of a stack, in one parallel region.

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "blocked_tile.h"
#include "ops.h"

namespace servelab_cpu {
namespace {

// out[m0 : m0 + rows, n : n + kTileChannels] (times the channel scales where given) of
// x [M, K] and the packed W [N', K]: one tile of channels for a group of rows, every K slice.
template <typename W>
void tile_item(float* out, const float* x, int64_t K, const W* packed, const float* scales, int64_t N, int64_t n,
               int64_t m0, int64_t rows) {
  const int64_t slice = std::max<int64_t>(64, kSliceBytes / (kTileChannels * static_cast<int64_t>(sizeof(W))));
  for (int64_t k0 = 0; k0 < K; k0 += slice) {
    const Slice<W> s{packed + n * K, K, k0, std::min(K, k0 + slice), scales == nullptr ? nullptr : scales + n,
                     std::min(kTileChannels, N - n), k0 == 0, k0 + slice >= K};
    int64_t m = m0;
    for (; m + kMaxRows <= m0 + rows; m += kMaxRows) tile_rows<kMaxRows>(x + m * K, K, s, out + m * N + n, N);
    slice_remainder<kMaxRows - 1>(m0 + rows - m, x + m * K, K, s, out + m * N + n, N);
  }
}

// out = x @ W.T (times the channel scales where given) for x [M, K] and the packed W.
template <typename W>
void blocked_linear(float* out, const float* x, int64_t M, int64_t K, const W* packed, const float* scales,
                    int64_t N) {
  if (M == 0) return;  // no rows (a rank's empty share of a step's tokens)
  if (K == 0) return std::fill(out, out + M * N, 0.f);
  const int64_t tiles = (N + kTileChannels - 1) / kTileChannels;
  const int64_t row_blocks = (M + kMaxRows - 1) / kMaxRows;
  const int64_t wanted = (2 * at::get_num_threads() + tiles - 1) / tiles;  // two items per thread
  const int64_t groups = std::clamp<int64_t>(wanted, 1, row_blocks);
  const int64_t group_size = (row_blocks + groups - 1) / groups * kMaxRows;
  at::parallel_for(0, groups * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t m0 = (item / tiles) * group_size, n = (item % tiles) * kTileChannels;
      if (m0 < M) tile_item(out, x, K, packed, scales, N, n, m0, std::min(group_size, M - m0));
    }
  });
}

// For each group g, out[starts[g] : starts[g] + counts[g]] = the same rows of x times
// expert experts[g]'s packed W (stride expert_stride; its scales at scale_stride): every
// group's tiles in one parallel region (a mixture of experts' step at once). The rows'
// results are those of blocked_linear on each group alone, to the bit.
template <typename W>
void grouped_blocked_linear(float* out, const float* x, int64_t K, const W* packed, int64_t expert_stride,
                            const float* scales, int64_t scale_stride, int64_t N, at::IntArrayRef experts,
                            at::IntArrayRef starts, at::IntArrayRef counts) {
  if (K == 0) return std::fill(out, out + (starts.back() + counts.back()) * N, 0.f);
  const int64_t tiles = (N + kTileChannels - 1) / kTileChannels;
  at::parallel_for(0, static_cast<int64_t>(experts.size()) * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / tiles, expert = experts[g];
      tile_item(out + starts[g] * N, x + starts[g] * K, K, packed + expert * expert_stride,
                scales == nullptr ? nullptr : scales + expert * scale_stride, N, (item % tiles) * kTileChannels, 0,
                counts[g]);
    }
  });
}

// Checks the shapes shared by the ops and returns the padded channel count. x and out are
// float32, or both bfloat16 where `bf16_rows` allows it.
int64_t check_blocked(const char* op, const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                      at::ScalarType weight_type, const char* weight_name, bool bf16_rows = false) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || (bf16_rows && x.scalar_type() == at::kBFloat16)),
              op, ": x must be a contiguous float32", bf16_rows ? " or bfloat16" : "", " [M, K] tensor");
  const int64_t K = x.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == weight_type &&
                  packed.size(1) == K && packed.size(2) == kBlock && (packed.size(0) * kBlock) % kPackChannels == 0,
              op, ": packed must be a contiguous ", weight_name, " [N / ", kBlock, ", K, ", kBlock,
              "] tensor with N a multiple of ", kPackChannels);
  const int64_t padded = packed.size(0) * kBlock;
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == x.scalar_type() &&
                  out.size(0) == x.size(0) && out.size(1) <= padded && out.size(1) > padded - kPackChannels,
              op, ": out must be a contiguous [M, N] tensor of one dtype with x");
  return padded;
}

// Calls multiply(out32, x32) with float32 pointers of the (checked) rows x [M, K] and out
// [M, N]: their own data when float32; for bfloat16, thread-local float32 copies of x and a
// float32 result then rounded once into out (no tensors allocated at decode sizes).
template <typename Multiply>
void on_float_rows(at::Tensor& out, const at::Tensor& x, Multiply multiply) {
  if (x.scalar_type() == at::kFloat) return multiply(out.data_ptr<float>(), x.data_ptr<float>());
  thread_local std::vector<float> rows, result;
  rows.resize(x.numel());
  result.resize(out.numel());
  const c10::BFloat16* source = x.data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < x.numel(); ++i) rows[i] = static_cast<float>(source[i]);
  multiply(result.data(), rows.data());
  c10::BFloat16* target = out.data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < out.numel(); ++i) target[i] = static_cast<c10::BFloat16>(result[i]);
}

}  // namespace

void float_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed) {
  check_blocked("float_linear", out, x, packed, at::kFloat, "float32");
  blocked_linear(out.data_ptr<float>(), x.data_ptr<float>(), x.size(0), x.size(1), packed.data_ptr<float>(), nullptr,
                 out.size(1));
}

void int8_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  const int64_t padded = check_blocked("int8_linear", out, x, packed, at::kChar, "int8");
  TORCH_CHECK(scales.dim() == 1 && scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
                  scales.size(0) == padded,
              "int8_linear: scales must be a contiguous float32 [", padded, "] tensor");
  blocked_linear(out.data_ptr<float>(), x.data_ptr<float>(), x.size(0), x.size(1), packed.data_ptr<int8_t>(),
                 scales.data_ptr<float>(), out.size(1));
}

void bf16_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed) {
  check_blocked("bf16_linear", out, x, packed, at::kBFloat16, "bfloat16", true);
  on_float_rows(out, x, [&](float* y, const float* rows) {
    blocked_linear(y, rows, x.size(0), x.size(1), packed.data_ptr<c10::BFloat16>(), nullptr, out.size(1));
  });
}

void grouped_expert_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           at::IntArrayRef experts, at::IntArrayRef starts, at::IntArrayRef counts) {
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(3) == kBlock && !experts.empty() &&
                  experts.size() == starts.size() && experts.size() == counts.size(),
              "grouped_expert_linear: packed must be contiguous [E, N / 16, K, 16] with one start and count per "
              "expert");
  const at::Tensor first = packed.select(0, experts[0]);
  const int64_t K = x.size(1), N = out.size(1);
  if (scales.defined() && scales.numel()) {
    const int64_t padded = check_blocked("grouped_expert_linear", out, x, first, at::kChar, "int8", true);
    TORCH_CHECK(scales.dim() == 2 && scales.is_contiguous() && scales.size(1) == padded &&
                    scales.scalar_type() == at::kFloat,
                "grouped_expert_linear: scales must be a contiguous float32 [E, ", padded, "] tensor");
    on_float_rows(out, x, [&](float* y, const float* rows) {
      grouped_blocked_linear(y, rows, K, packed.data_ptr<int8_t>(), first.numel(), scales.data_ptr<float>(), padded,
                             N, experts, starts, counts);
    });
  } else if (packed.scalar_type() == at::kBFloat16) {
    check_blocked("grouped_expert_linear", out, x, first, at::kBFloat16, "bfloat16", true);
    on_float_rows(out, x, [&](float* y, const float* rows) {
      grouped_blocked_linear(y, rows, K, packed.data_ptr<c10::BFloat16>(), first.numel(), nullptr, 0, N, experts,
                             starts, counts);
    });
  } else {
    check_blocked("grouped_expert_linear", out, x, first, at::kFloat, "float32", true);
    on_float_rows(out, x, [&](float* y, const float* rows) {
      grouped_blocked_linear(y, rows, K, packed.data_ptr<float>(), first.numel(), nullptr, 0, N, experts, starts,
                             counts);
    });
  }
}

}  // namespace servelab_cpu
