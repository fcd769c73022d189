// blocked_linear: y = x @ W.T for float32 rows x and a weight repacked once at load into
// blocks of 16 output channels stored k-major (servelab/kernels/blocked_linear.py builds it):
// packed[b][k][j] = W[16 b + j][k], the channels padded with zeros to a multiple of
// kPackChannels. Two weight types share the kernel:
//
//   float_linear  float32 weights (the default CPU matmul of float32 models)
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
// keep every thread busy.

#include <ATen/Parallel.h>

#include <algorithm>

#include "blocked_tile.h"
#include "ops.h"

namespace servelab_cpu {
namespace {

// out = x @ W.T (times the channel scales where given) for x [M, K] and the packed W.
template <typename W>
void blocked_linear(float* out, const float* x, int64_t M, int64_t K, const W* packed, const float* scales,
                    int64_t N) {
  if (K == 0) return std::fill(out, out + M * N, 0.f);
  const int64_t tiles = (N + kTileChannels - 1) / kTileChannels;
  const int64_t row_blocks = (M + kMaxRows - 1) / kMaxRows;
  const int64_t wanted = (2 * at::get_num_threads() + tiles - 1) / tiles;  // two items per thread
  const int64_t groups = std::clamp<int64_t>(wanted, 1, row_blocks);
  const int64_t group_size = (row_blocks + groups - 1) / groups * kMaxRows;
  const int64_t slice = std::max<int64_t>(64, kSliceBytes / (kTileChannels * static_cast<int64_t>(sizeof(W))));
  at::parallel_for(0, groups * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t m0 = (item / tiles) * group_size, n = (item % tiles) * kTileChannels;
      if (m0 >= M) continue;
      const int64_t group_rows = std::min(group_size, M - m0);
      for (int64_t k0 = 0; k0 < K; k0 += slice) {
        const Slice<W> s{packed + n * K, K, k0, std::min(K, k0 + slice), scales == nullptr ? nullptr : scales + n,
                         std::min(kTileChannels, N - n), k0 == 0, k0 + slice >= K};
        int64_t m = m0;
        for (; m + kMaxRows <= m0 + group_rows; m += kMaxRows) tile_rows<kMaxRows>(x + m * K, K, s, out + m * N + n, N);
        slice_remainder<kMaxRows - 1>(m0 + group_rows - m, x + m * K, K, s, out + m * N + n, N);
      }
    }
  });
}

// Checks the shapes shared by both ops and returns the padded channel count.
int64_t check_blocked(const char* op, const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                      at::ScalarType weight_type, const char* weight_name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, op,
              ": x must be a contiguous float32 [M, K] tensor");
  const int64_t K = x.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == weight_type &&
                  packed.size(1) == K && packed.size(2) == kBlock && (packed.size(0) * kBlock) % kPackChannels == 0,
              op, ": packed must be a contiguous ", weight_name, " [N / ", kBlock, ", K, ", kBlock,
              "] tensor with N a multiple of ", kPackChannels);
  const int64_t padded = packed.size(0) * kBlock;
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == x.size(0) &&
                  out.size(1) <= padded && out.size(1) > padded - kPackChannels,
              op, ": out must be a contiguous float32 [M, N] tensor");
  return padded;
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

}  // namespace servelab_cpu
