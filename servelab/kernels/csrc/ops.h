// The native CPU ops of servelab, as registered in torch.ops.servelab_cpu (register_ops.cpp;
// schemas and descriptions in docs/cpu_kernels.md). One source file per op or group:
//
//   paged_attention.cpp   paged_attention, supports_head_dim, bf16_key_pairs
//                         (+ paged_attention_scores.h, paged_attention_values.h)
//   write_kv_cache.cpp    write_kv_cache (the cache layout both share: paged_cache.h)
//   prefill_attention.cpp causal_prefill_attention (+ prefill_attention_amx.h)
//   rms_norm.cpp          rms_norm, add_rms_norm
//   rotary_embedding.cpp  rotary_embedding
//   silu_and_mul.cpp      silu_and_mul
//   argmax_rows.cpp       argmax_rows
//   sample_rows.cpp       sample_rows (the sampler's temperature, top-k/p, min-p and random race)
//   blocked_linear.cpp    float_linear, bf16_linear, int8_linear, grouped_expert_linear (float32,
//                         bfloat16 and weight-only int8 matmuls on a weight repacked into blocks
//                         of 16 channels)
//   w8a8_linear.cpp       w8a8_linear, grouped_w8a8_linear, supports_w8a8 (int8 weights and per-row int8
//                         activations), int8_sliced_linear, grouped_int8_sliced_linear (int8 weights,
//                         float32 activations split into int8 slices)
//   int4_linear.cpp       int4_linear (group-wise int4 weights, any number of rows)
//   w4a8_linear.cpp       w4a8_linear, int4_sliced_linear (group-wise int4 weights, per-row int8 or
//                         sliced float32 activations)
//   softmax_topk.cpp      softmax_topk (a mixture of experts' softmax top-k routing)
//   decode_layers.cpp     decode_layers (a Llama-shaped decoder stack in one call, from the ops above)
//
// Shared helpers: vec.h (SIMD, dtype conversions and dispatch), amx.h (the tile unit),
// blocked_tile.h (the register tile of the blocked matmuls).
// servelab/kernels/cpu_ops.py compiles all of them into one extension.
#pragma once

#include <ATen/core/Tensor.h>

namespace servelab_cpu {

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& requests,
                     double scale, int64_t window, const c10::optional<at::Tensor>& tree_mask,
                     const c10::optional<at::Tensor>& tree_lens);
bool supports_head_dim(int64_t head_dim);
bool bf16_key_pairs();
void write_kv_cache(at::Tensor kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots);
void causal_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              at::IntArrayRef starts, at::IntArrayRef lengths, double scale);
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
// rotary_embedding of the `tokens` rows of q (q_heads heads) and k (k_heads) of `dtype` at raw
// pointers, rows `row_stride` and heads `head_stride` elements apart, the first `dim` of each
// head rotated (decode_layers' q and k inside one qkv row, no views made).
void rotary_embedding_rows(void* q, int64_t q_heads, void* k, int64_t k_heads, at::ScalarType dtype, int64_t tokens,
                           int64_t row_stride, int64_t head_stride, int64_t dim, const at::Tensor& positions,
                           const at::Tensor& cos, const at::Tensor& sin);
void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin);
void silu_and_mul(at::Tensor out, const at::Tensor& x);
void argmax_rows(at::Tensor out, const at::Tensor& logits);
void sample_rows(at::Tensor out, const at::Tensor& logits, const at::Tensor& noise, at::ArrayRef<double> temperatures,
                 at::IntArrayRef top_ks, at::ArrayRef<double> top_ps, at::ArrayRef<double> min_ps);
void float_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed);
void int8_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales);
void bf16_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed);
// For each g: out[starts[g] : +counts[g]] = the same rows of x @ expert experts[g]'s matrix,
// from stacked packed weights [E, N / 16, K, 16]: float32, bfloat16, or int8 with scales
// [E, N']; x and out float32, or bfloat16 (the sums rounded once).
void grouped_expert_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           at::IntArrayRef experts, at::IntArrayRef starts, at::IntArrayRef counts);
bool supports_w8a8();
void w8a8_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets,
                 const at::Tensor& scales);
// w8a8_linear for each expert's rows of x, as grouped_expert_linear groups them; packed
// [E, N / 16, K' / 4, 64], offsets and scales [E, N'].
void grouped_w8a8_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets,
                         const at::Tensor& scales, at::IntArrayRef experts, at::IntArrayRef starts,
                         at::IntArrayRef counts);
// Weight-only int8 on w8a8_linear's packed weights: each float32 row of x split into int8
// slices, multiplied as w8a8_linear multiplies its rows, the slices' results summed.
void int8_sliced_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets,
                        const at::Tensor& scales);
void grouped_int8_sliced_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                                const at::Tensor& offsets, const at::Tensor& scales, at::IntArrayRef experts,
                                at::IntArrayRef starts, at::IntArrayRef counts);
void int4_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& params);
// int4 weights times activations quantized to int8 per row (AVX512-VNNI; supports_w8a8 says
// whether this build has it).
void w4a8_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& params);
// Weight-only int4 on w4a8_linear's packed weights: each float32 row of x split into int8
// slices, multiplied as w4a8_linear multiplies its rows, the slices' results summed.
void int4_sliced_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& params);
void softmax_topk(at::Tensor weights, at::Tensor experts, const at::Tensor& logits, int64_t top_k, bool normalize);
at::Tensor decode_layers(const at::Tensor& hidden, at::Tensor residual, bool has_residual, at::Tensor positions,
                         at::TensorList kv_caches, at::Tensor slot_mapping, const at::Tensor& block_table,
                         const at::Tensor& query_start_loc, at::Tensor seq_lens, const at::Tensor& requests,
                         const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim, at::TensorList weights,
                         at::IntArrayRef kinds, at::IntArrayRef out_features, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double scale, double eps, double qk_eps,
                         int64_t top_k, bool normalize, at::Tensor input_ids, const at::Tensor& embedding,
                         const at::Tensor& final_norm, double final_eps, at::Tensor logits, at::TensorList head,
                         int64_t head_kind, at::Tensor step_tokens, int64_t block_size);

}  // namespace servelab_cpu
