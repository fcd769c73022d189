// The KV cache layout of attention=cpu, shared by write_kv_cache and paged_attention.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "vec.h"

namespace servelab_cpu {
namespace {

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

// A cache whose values are its keys (latent attention: AttentionSpec.values_are_keys) is
// kv_cache[num_blocks, Hkv, 1, block_size * D]: each (block, KV head) holds its key tile
// alone, and paged_attention reads the values out of it.

// A quantized cache (cache.kv_dtype int8 or fp8_e4m3) holds one-byte values, and each tile
// is followed by its block_size float32 scales, one per slot: a (block, KV head) is [key
// tile][key scales][value tile][value scales], value = stored value * its slot's scale.
// Block copies (copy-on-write, swapping) and prefix caching carry the scales with the block.
template <typename C>
constexpr bool kQuantized = std::is_same_v<C, int8_t> || std::is_same_v<C, c10::Float8_e4m3fn>;
constexpr int64_t kScaleBytes = 4;

inline bool quantized_cache(const at::Tensor& kv_cache) {
  return kv_cache.scalar_type() == at::kChar || kv_cache.scalar_type() == at::kFloat8_e4m3fn;
}

// Elements of one (block, KV head)'s key or value part: its tile and, quantized, the scales.
template <typename C>
inline int64_t part_elements(int64_t block_size, int64_t head_dim) {
  return block_size * head_dim + (kQuantized<C> ? block_size * kScaleBytes : 0);
}

// The per-slot scales that follow the key or value tile at `tile` (quantized caches).
template <typename C>
inline float* tile_scales(C* tile, int64_t block_size, int64_t head_dim) {
  return reinterpret_cast<float*>(tile + block_size * head_dim);
}
template <typename C>
inline const float* tile_scales(const C* tile, int64_t block_size, int64_t head_dim) {
  return reinterpret_cast<const float*>(tile + block_size * head_dim);
}

// Slots per block of a cache of head_dim values per row.
inline int64_t cache_block_size(const at::Tensor& kv_cache, int64_t head_dim) {
  return kv_cache.size(3) / (head_dim + (quantized_cache(kv_cache) ? kScaleBytes : 0));
}

// The largest stored magnitude: a row's absolute maximum maps to it.
template <typename C>
constexpr float kQuantMax = std::is_same_v<C, int8_t> ? 127.f : 448.f;

// Quantizes n values of x into dst[offset(d)] (int8: round half to even; float8: the
// cast's rounding) and returns their scale, amax / kQuantMax; as servelab/kernels/kv_quantization.py.
template <typename C, typename T, typename Offset>
inline float quantize_row(const T* x, int64_t n, C* dst, Offset&& offset) {
  float amax = 0.f;
  for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::abs(to_float(x[d])));
  const float scale = amax / kQuantMax<C>;
  const float divisor = std::max(scale, std::numeric_limits<float>::min());
  for (int64_t d = 0; d < n; ++d) {
    const float v = std::clamp(to_float(x[d]) / divisor, -kQuantMax<C>, kQuantMax<C>);
    if constexpr (std::is_same_v<C, int8_t>) {
      dst[offset(d)] = static_cast<int8_t>(std::nearbyint(v));
    } else {
      dst[offset(d)] = C(v);
    }
  }
  return scale;
}

// Calls f(C{}) with C the element type of a cache for T values: T itself, int8_t or
// c10::Float8_e4m3fn (quantized).
template <typename T, typename F>
void dispatch_cache_dtype(at::ScalarType type, const char* op, F&& f) {
  if (type == c10::CppTypeToScalarType<T>::value) {
    f(T{});
  } else if (type == at::kChar) {
    f(int8_t{});
  } else if (type == at::kFloat8_e4m3fn) {
    f(c10::Float8_e4m3fn{});
  } else {
    TORCH_CHECK(false, op, ": kv_cache dtype must be the query's, int8 or float8_e4m3fn, got ", type);
  }
}

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

// Fails naming `op` unless kv_cache has this layout for num_kv_heads heads of head_dim.
void check_cache(const at::Tensor& kv_cache, int64_t num_kv_heads, int64_t head_dim, const char* op) {
  const int64_t row = head_dim + (quantized_cache(kv_cache) ? kScaleBytes : 0);
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(1) == num_kv_heads &&
                  (kv_cache.size(2) == 2 || kv_cache.size(2) == 1) && kv_cache.is_contiguous() &&
                  kv_cache.size(3) % row == 0,
              op, ": kv_cache must be a contiguous [blocks, Hkv, 2, block_size * D] tensor "
              "([blocks, Hkv, 1, ...] when values are keys; block_size * (D + 4) when int8 or float8_e4m3fn)");
}

}  // namespace
}  // namespace servelab_cpu
