// int4_linear: y = x @ W.T for float32 rows x and group-wise int4 weights (servelab's format,
// servelab/kernels/quantized_weights.py: w[n, k] = q[n, k] * s[n, g] + m[n, g] with q in 0..15,
// g = k / group and m = zero - 8 * scale), the weight-only int4 matmul of any number of rows.
//
// Packed layout (servelab/kernels/int4_cpu.py builds it): blocks of 16 output channels, each a
// run of K / 2 bytes per channel stored k-major, packed[b][p][j] = the byte of channel
// 16 b + j holding inputs 2 p (low nibble) and 2 p + 1 (high nibble); params[b][g][0][j] =
// s[16 b + j, g] and params[b][g][1][j] = m[16 b + j, g]; channels padded to a multiple of
// 64 with zeros. The weight crosses memory as half a byte per value, an eighth of float32.
//
// Two paths, picked by the number of rows:
//
//   few rows (decode): the nibbles of a tile of channels are widened to float32 in
//     registers and multiplied into up to kDirectRows rows with float32 FMAs; the sums of a
//     group are scaled once at the group's end, sum_k x_k w_k = s * sum_k x_k q_k +
//     m * sum_k x_k, with sum_k x_k computed once per row and group. One pass over the
//     packed weight; on one core the widening (about seven vector instructions per 32
//     weights), not memory, bounds it, near the read bandwidth.
//   more rows (prefill, large batches): each tile's K slice (whole groups) is dequantized
//     once into a float32 buffer in the core's cache, and the float32 register tile of
//     blocked_tile.h multiplies every row with it, so dequantizing costs once per weight,
//     not once per row.
//
// Threads split the tiles (and, on the second path, the rows into groups where there are
// too few tiles). Everything is written against torch's at::vec for the build's
// CPU_CAPABILITY (AVX-512, AVX2, or plain C++), so the same source runs on every x86 CPU.

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "blocked_tile.h"
#include "ops.h"

namespace servelab_cpu {
namespace {

#if defined(CPU_CAPABILITY_AVX512)
constexpr int kDirectVecs = 4;  // 64 channels
constexpr int kDirectRows = 3;  // 12 accumulators and 12 group sums of 32 registers
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int kDirectVecs = 2;  // 16 channels
constexpr int kDirectRows = 2;  // 4 accumulators and 4 group sums of 16 registers
#else
constexpr int kDirectVecs = 2;
constexpr int kDirectRows = 1;
#endif
constexpr int64_t kDirectChannels = kDirectVecs * kLanes;
static_assert(kPackChannels % kDirectChannels == 0 && kPackChannels % kTileChannels == 0, "tiles must split blocks");
constexpr int64_t kDirectMaxRows = 2 * kDirectRows;  // more rows take the dequantizing path
constexpr int64_t kParams = 2 * kBlock;              // floats per (block, group): 16 scales, 16 offsets
constexpr int64_t kDequantizedFloats = 8192;         // a dequantized K slice of a tile: 32 KB, within an L1

inline VecRegister fmadd_vectors(VecRegister a, VecRegister b, VecRegister c) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_fmadd_ps(a, b, c);
#else
  return at::vec::fmadd(a, b, c);
#endif
}

// The kLanes bytes at p as float32 vectors of their low and high nibbles.
inline void load_nibbles(const uint8_t* p, VecRegister& low, VecRegister& high) {
#if defined(CPU_CAPABILITY_AVX512)
  // vpermps picks table[i & 15] per lane: the nibble's float32 value in one shuffle, no mask.
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  low = _mm512_permutexvar_ps(bytes, table);
  high = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  low = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
  high = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
#else
  float lows[kLanes], highs[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) lows[i] = p[i] & 15, highs[i] = p[i] >> 4;
  low = Vec::loadu(lows);
  high = Vec::loadu(highs);
#endif
}

// Where the int4 weight is: packed and params as laid out above, K inputs in `groups`
// groups of `group`.
struct Int4Weight {
  const uint8_t* packed;
  const float* params;
  int64_t K, group, groups;

  // Vector v of the tile starting at channel n: its bytes (at input pair 0) and its params (group 0).
  const uint8_t* column(int64_t n, int64_t v) const {
    const int64_t c = n + v * kLanes;
    return packed + (c / kBlock) * (K / 2) * kBlock + c % kBlock;
  }
  const float* param(int64_t n, int64_t v) const {
    const int64_t c = n + v * kLanes;
    return params + (c / kBlock) * groups * kParams + c % kBlock;
  }
};

// out[r, 0:channels] = x[r] . W[n + c] for R rows of x (row stride ldx) and out (ldo);
// xsum[r * groups + g] = the sum of x[r] over group g.
template <int R>
void direct_rows(const float* x, int64_t ldx, const float* xsum, const Int4Weight& w, int64_t n, float* out,
                 int64_t ldo, int64_t channels) {
  const uint8_t* column[kDirectVecs];
  const float* param[kDirectVecs];
  for (int v = 0; v < kDirectVecs; ++v) column[v] = w.column(n, v), param[v] = w.param(n, v);
  // With few rows the low and high nibbles sum apart: two chains of dependent FMAs per
  // accumulator instead of one keep the FMA units busy (their latency, not their count,
  // would set the pace); with more rows the registers are needed for the rows.
  constexpr int kChains = R <= 2 ? 2 : 1;
  VecRegister acc[R][kDirectVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kDirectVecs; ++v) acc[r][v] = Vec(0.f);
  for (int64_t g = 0; g < w.groups; ++g) {
    VecRegister part[kChains][R][kDirectVecs];
    for (int c = 0; c < kChains; ++c)
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < kDirectVecs; ++v) part[c][r][v] = Vec(0.f);
    for (int64_t p = g * w.group / 2, end = (g + 1) * w.group / 2; p < end; ++p) {
      for (int v = 0; v < kDirectVecs; ++v) {
        VecRegister low, high;
        load_nibbles(column[v] + p * kBlock, low, high);
        for (int r = 0; r < R; ++r) {
          part[0][r][v] = fmadd_register(x[r * ldx + 2 * p], low, part[0][r][v]);
          part[kChains - 1][r][v] = fmadd_register(x[r * ldx + 2 * p + 1], high, part[kChains - 1][r][v]);
        }
      }
    }
    for (int v = 0; v < kDirectVecs; ++v) {
      const VecRegister scale = Vec::loadu(param[v] + g * kParams), offset = Vec::loadu(param[v] + g * kParams + kBlock);
      for (int r = 0; r < R; ++r) {
        VecRegister sum = part[0][r][v];
        if constexpr (kChains == 2) sum = Vec(sum) + Vec(part[1][r][v]);
        acc[r][v] = fmadd_register(xsum[r * w.groups + g], offset, fmadd_vectors(sum, scale, acc[r][v]));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float result[kDirectChannels];
    for (int v = 0; v < kDirectVecs; ++v) Vec(acc[r][v]).store(result + v * kLanes);
    std::copy(result, result + channels, out + r * ldo);
  }
}

template <int R>
void direct_remainder(int64_t rows, const float* x, int64_t ldx, const float* xsum, const Int4Weight& w, int64_t n,
                      float* out, int64_t ldo, int64_t channels) {
  if constexpr (R > 0) {
    if (rows == R) return direct_rows<R>(x, ldx, xsum, w, n, out, ldo, channels);
    direct_remainder<R - 1>(rows, x, ldx, xsum, w, n, out, ldo, channels);
  }
}

// The first path: M <= kDirectMaxRows rows, threads split the tiles.
void direct_linear(float* out, const float* x, int64_t M, const Int4Weight& w, int64_t N) {
  thread_local std::vector<float> sums;
  sums.resize(M * w.groups);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < w.groups; ++g) {
      const float* group = x + m * w.K + g * w.group;
      Vec acc(0.f);
      int64_t k = 0;
      for (; k + kLanes <= w.group; k += kLanes) acc = acc + Vec::loadu(group + k);
      float total = sum_lanes(acc);
      for (; k < w.group; ++k) total += group[k];
      sums[m * w.groups + g] = total;
    }
  const float* xsum = sums.data();
  const int64_t tiles = (N + kDirectChannels - 1) / kDirectChannels;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * kDirectChannels, channels = std::min(kDirectChannels, N - n);
      int64_t m = 0;
      for (; m + kDirectRows <= M; m += kDirectRows)
        direct_rows<kDirectRows>(x + m * w.K, w.K, xsum + m * w.groups, w, n, out + m * N + n, N, channels);
      direct_remainder<kDirectRows - 1>(M - m, x + m * w.K, w.K, xsum + m * w.groups, w, n, out + m * N + n, N,
                                        channels);
    }
  });
}

// buffer[b][k - k0][j] = W[n + 16 b + j][k] for the blocks of the tile at channel n and the
// inputs of groups [g0, g1): the layout of pack_blocks' float32 weight, K = (g1 - g0) * group.
void dequantize_slice(const Int4Weight& w, int64_t n, int64_t g0, int64_t g1, float* buffer) {
  const int64_t length = (g1 - g0) * w.group;
  for (int64_t b = 0; b < kTileChannels / kBlock; ++b)
    for (int64_t lane = 0; lane < kBlock; lane += kLanes) {
      const uint8_t* column = w.column(n + b * kBlock + lane, 0);
      const float* param = w.param(n + b * kBlock + lane, 0);
      float* dst = buffer + b * length * kBlock + lane;
      for (int64_t g = g0; g < g1; ++g) {
        const VecRegister scale = Vec::loadu(param + g * kParams), offset = Vec::loadu(param + g * kParams + kBlock);
        for (int64_t p = g * w.group / 2, end = (g + 1) * w.group / 2; p < end; ++p) {
          VecRegister low, high;
          load_nibbles(column + p * kBlock, low, high);
          float* row = dst + (2 * p - g0 * w.group) * kBlock;
          Vec(fmadd_vectors(low, scale, offset)).store(row);
          Vec(fmadd_vectors(high, scale, offset)).store(row + kBlock);
        }
      }
    }
}

// The second path: threads split (row group, tile) items; each dequantizes its tile a K
// slice of whole groups at a time and runs every row of its group over the slice.
void dequantizing_linear(float* out, const float* x, int64_t M, const Int4Weight& w, int64_t N) {
  const int64_t tiles = (N + kTileChannels - 1) / kTileChannels;
  const int64_t row_blocks = (M + kMaxRows - 1) / kMaxRows;
  const int64_t wanted = (2 * at::get_num_threads() + tiles - 1) / tiles;  // two items per thread
  const int64_t row_groups = std::clamp<int64_t>(wanted, 1, row_blocks);
  const int64_t group_rows = (row_blocks + row_groups - 1) / row_groups * kMaxRows;
  const int64_t slice_groups = std::max<int64_t>(1, kDequantizedFloats / kTileChannels / w.group);
  at::parallel_for(0, row_groups * tiles, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buffer;
    buffer.resize(kTileChannels * slice_groups * w.group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t m0 = (item / tiles) * group_rows, n = (item % tiles) * kTileChannels;
      if (m0 >= M) continue;
      const int64_t rows = std::min(group_rows, M - m0), channels = std::min(kTileChannels, N - n);
      for (int64_t g0 = 0; g0 < w.groups; g0 += slice_groups) {
        const int64_t g1 = std::min(w.groups, g0 + slice_groups), length = (g1 - g0) * w.group;
        dequantize_slice(w, n, g0, g1, buffer.data());
        const Slice<float> s{buffer.data(), length, 0, length, nullptr, channels, g0 == 0, g1 == w.groups};
        const float* xs = x + g0 * w.group;
        int64_t m = m0;
        for (; m + kMaxRows <= m0 + rows; m += kMaxRows) tile_rows<kMaxRows>(xs + m * w.K, w.K, s, out + m * N + n, N);
        slice_remainder<kMaxRows - 1>(m0 + rows - m, xs + m * w.K, w.K, s, out + m * N + n, N);
      }
    }
  });
}

}  // namespace

void int4_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& params) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "int4_linear: x must be a contiguous float32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kByte && K % 2 == 0 &&
                  packed.size(1) == K / 2 && packed.size(2) == kBlock && (packed.size(0) * kBlock) % kPackChannels == 0,
              "int4_linear: packed must be a contiguous uint8 [N / ", kBlock, ", K / 2, ", kBlock,
              "] tensor with K even and N a multiple of ", kPackChannels);
  const int64_t blocks = packed.size(0), groups = params.dim() == 4 ? params.size(1) : 0;
  TORCH_CHECK(params.dim() == 4 && params.is_contiguous() && params.scalar_type() == at::kFloat &&
                  params.size(0) == blocks && groups > 0 && K % groups == 0 && K / groups >= 2 && (K / groups) % 2 == 0 &&
                  params.size(2) == 2 && params.size(3) == kBlock,
              "int4_linear: params must be a contiguous float32 [", blocks, ", K / group, 2, ", kBlock,
              "] tensor with an even group");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == M &&
                  out.size(1) <= blocks * kBlock && out.size(1) > blocks * kBlock - kPackChannels,
              "int4_linear: out must be a contiguous float32 [M, N] tensor");
  const Int4Weight w{packed.data_ptr<uint8_t>(), params.data_ptr<float>(), K, K / groups, groups};
  if (M <= kDirectMaxRows)
    direct_linear(out.data_ptr<float>(), x.data_ptr<float>(), M, w, out.size(1));
  else
    dequantizing_linear(out.data_ptr<float>(), x.data_ptr<float>(), M, w, out.size(1));
}

}  // namespace servelab_cpu
