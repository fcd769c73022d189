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
#include <type_traits>

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
constexpr int64_t kSliceBytes = 512 * 1024;  // the weight bytes of one tile's K slice (half an L2)

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
  for (int64_t k = s.k_begin; k < s.k_end; ++k) {
    for (int v = 0; v < kTileVecs; ++v) {
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
