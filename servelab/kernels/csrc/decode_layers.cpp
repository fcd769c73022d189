// decode_layers: the decoder layers of a Llama-shaped model in one call, for a step whose
// every request reads its context from the paged cache (decode steps, chunks after the first).
//
// Each layer runs exactly the ops the Python layer calls, in its order: residual add +
// RMSNorm, the fused qkv projection (+ bias), per-head RMSNorm of q and k (Qwen3's q/k
// norms, as the Python layer computes them on a 3-D view), rotary embedding of q and k in place, the
// cache write, paged attention, the output projection, residual add + RMSNorm, the fused
// gate/up projection, SiLU x up and the down projection. What it saves is the Python
// between them (module calls, views, allocations' wrappers): about ten microseconds an op,
// which at batch 1 on a small model is as long as the matmuls.
//
// A linear layer is four tensors of `weights` and one entry of `kinds`:
//   kind 0, float32:     packed (blocked_linear's layout), -, -            -> float_linear
//   kind 1, int8:        packed, scales, -                                 -> int8_linear
//   kind 2, w8a8:        packed, offsets, scales                           -> w8a8_linear
//   kind 3, int4:        packed, params, -                                 -> int4_linear
// then the bias (an empty tensor for none). A layer is the input norm's weight, the qkv,
// output, gate/up and down linears (4 tensors each), the post-attention norm's weight and
// the q and k norms' weights (empty tensors without q/k norms): 20 tensors, kinds 4 entries.

#include <ATen/ATen.h>

#include "ops.h"

namespace servelab_cpu {
namespace {

constexpr int64_t kLayerTensors = 20;
constexpr int64_t kPostNorm = 17, kQNorm = 18, kKNorm = 19;
constexpr int64_t kLinearTensors = 4;
constexpr int64_t kLayerLinears = 4;

at::Tensor linear(const at::Tensor& x, at::TensorList w, int64_t kind, int64_t out_features) {
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  switch (kind) {
    case 0: float_linear(out, x, w[0]); break;
    case 1: int8_linear(out, x, w[0], w[1]); break;
    case 2: w8a8_linear(out, x, w[0], w[1], w[2]); break;
    case 3: int4_linear(out, x, w[0], w[1]); break;
    default: TORCH_CHECK(false, "decode_layers: unknown linear kind ", kind);
  }
  if (w[3].numel()) {
    out.add_(w[3]);
  }
  return out;
}

// RMSNorm of float32 rows over the last dimension with the torch formula the Python layer
// uses for a 3-D input: weight * (x * rsqrt(mean(x^2) + eps)).
at::Tensor head_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return weight * (x * at::rsqrt(x.pow(2).mean(-1, true) + eps));
}

}  // namespace

at::Tensor decode_layers(const at::Tensor& hidden, at::Tensor residual, bool has_residual, const at::Tensor& positions,
                         at::TensorList kv_caches, const at::Tensor& slot_mapping, const at::Tensor& block_table,
                         const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& requests,
                         const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim, at::TensorList weights,
                         at::IntArrayRef kinds, at::IntArrayRef out_features, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double scale, double eps, double qk_eps) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kLayerTensors &&
                  static_cast<int64_t>(kinds.size()) == layers * kLayerLinears &&
                  static_cast<int64_t>(out_features.size()) == layers * kLayerLinears,
              "decode_layers: ", layers, " layers need ", kLayerTensors, " weights and ", kLayerLinears,
              " linear kinds and widths each");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.scalar_type() == at::kFloat,
              "decode_layers: hidden must be a contiguous float32 [T, hidden]");
  const int64_t tokens = hidden.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor x = hidden.clone();
  for (int64_t l = 0; l < layers; ++l) {
    at::TensorList w = weights.slice(l * kLayerTensors, kLayerTensors);
    const int64_t* kind = kinds.data() + l * kLayerLinears;
    const int64_t* width = out_features.data() + l * kLayerLinears;
    if (l > 0 || has_residual) {
      add_rms_norm(x, residual, w[0], eps);
    } else {
      residual.copy_(x);
      rms_norm(x, residual, w[0], eps);
    }
    at::Tensor qkv = linear(x, w.slice(1, kLinearTensors), kind[0], width[0]);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    if (w[kQNorm].numel()) {
      q = head_rms_norm(q, w[kQNorm], qk_eps);
      k = head_rms_norm(k, w[kKNorm], qk_eps);
    }
    rotary_embedding(q.narrow(2, 0, rotary_dim), k.narrow(2, 0, rotary_dim), positions, cos, sin);
    write_kv_cache(kv_caches[l], k, v, slot_mapping);
    at::Tensor attended = at::empty({tokens, num_heads, head_dim}, x.options());
    paged_attention(attended, q, kv_caches[l], block_table, query_start_loc, seq_lens, requests, scale, 0,
                    c10::nullopt, c10::nullopt);
    at::Tensor o = linear(attended.view({tokens, q_size}), w.slice(1 + kLinearTensors, kLinearTensors), kind[1],
                          width[1]);
    add_rms_norm(o, residual, w[kPostNorm], eps);
    at::Tensor gate_up = linear(o, w.slice(1 + 2 * kLinearTensors, kLinearTensors), kind[2], width[2]);
    at::Tensor gated = at::empty({tokens, width[2] / 2}, x.options());
    silu_and_mul(gated, gate_up);
    x = linear(gated, w.slice(1 + 3 * kLinearTensors, kLinearTensors), kind[3], width[3]);
  }
  return x;
}

}  // namespace servelab_cpu
