// The KV cache layout of attention=cpu, shared by write_kv_cache and paged_attention.
#pragma once

#include <ATen/core/Tensor.h>

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
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(1) == num_kv_heads && kv_cache.size(2) == 2 &&
                  kv_cache.is_contiguous() && kv_cache.size(3) % head_dim == 0,
              op, ": kv_cache must be a contiguous [blocks, Hkv, 2, block_size * D] tensor");
}

}  // namespace
}  // namespace servelab_cpu
