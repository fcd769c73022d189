// write_kv_cache: stores each new token's keys and values at its slot of attention=cpu's
// cache (paged_cache.h; a negative slot skips the token), quantized when the cache is int8
// or float8_e4m3fn.

#include <ATen/Parallel.h>

#include <algorithm>

#include "ops.h"
#include "paged_cache.h"

namespace servelab_cpu {
namespace {

// Stores k, v [T, Hkv, D] at their slots (block * block_size + offset; negative: skipped)
// in the tiled layout of C: keys transposed per (block, head) (in pairs: key_offset), values
// row-major (none in a cache of keys alone); a quantized cache also gets each (slot,
// head)'s key and value scales.
template <typename T, typename C>
void write_kv_cache_kernel(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  const int64_t tokens = k.size(0);
  const int64_t num_kv_heads = k.size(1);
  const int64_t head_dim = k.size(2);
  const int64_t block_size = cache_block_size(kv_cache, head_dim);
  const int64_t part = part_elements<C>(block_size, head_dim);
  const int64_t parts = kv_cache.size(2);
  const int64_t block_stride = num_kv_heads * parts * part;
  const int64_t* slot_data = slots.data_ptr<int64_t>();
  const T* k_data = k.data_ptr<T>();
  const T* v_data = v.data_ptr<T>();
  C* cache = kv_cache.data_ptr<C>();
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slot_data[t];
      if (slot < 0) continue;
      const int64_t block = slot / block_size;
      const int64_t offset = slot % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const T* key = k_data + t * k.stride(0) + h * k.stride(1);
        const T* value = v_data + t * v.stride(0) + h * v.stride(1);
        C* key_tile = cache + block * block_stride + h * parts * part;
        C* value_tile = key_tile + part;
        if constexpr (kQuantized<C>) {
          tile_scales(key_tile, block_size, head_dim)[offset] = quantize_row(
              key, head_dim, key_tile, [&](int64_t d) { return key_offset<C>(d, offset, block_size); });
          if (parts == 2)
            tile_scales(value_tile, block_size, head_dim)[offset] =
                quantize_row(value, head_dim, value_tile + offset * head_dim, [](int64_t d) { return d; });
        } else {
          for (int64_t d = 0; d < head_dim; ++d) key_tile[key_offset<C>(d, offset, block_size)] = key[d];
          if (parts == 2) std::copy(value, value + head_dim, value_tile + offset * head_dim);
        }
      }
    }
  });
}

}  // namespace

void write_kv_cache(at::Tensor kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "write_kv_cache: k and v must be [T, Hkv, D] with unit last stride");
  check_cache(kv_cache, k.size(1), k.size(2), "write_kv_cache");
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), "write_kv_cache: k and v must share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == k.size(0),
              "write_kv_cache: slot_mapping must be contiguous int64 [T]");
  dispatch_dtype(k.scalar_type(), "write_kv_cache", [&](auto tag) {
    using scalar_t = decltype(tag);
    dispatch_cache_dtype<scalar_t>(kv_cache.scalar_type(), "write_kv_cache", [&](auto cache_tag) {
      write_kv_cache_kernel<scalar_t, decltype(cache_tag)>(kv_cache, k, v, slots);
    });
  });
}

}  // namespace servelab_cpu
