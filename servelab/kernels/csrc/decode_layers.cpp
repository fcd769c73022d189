// decode_layers: the decoder layers of a Llama-shaped model in one call, for a step whose
// every request reads its context from the paged cache (decode steps, chunks after the first).
//
// Each layer runs exactly the ops the Python layer calls, in its order: residual add +
// RMSNorm, the fused qkv projection (+ bias), per-head RMSNorm of q and k (Qwen3's q/k
// norms, as the Python layer computes them on a 3-D view), rotary embedding of q and k in place, the
// cache write, paged attention, the output projection, residual add + RMSNorm, the fused
// gate/up projection, SiLU x up and the down projection (or, in a sparse layer, the mixture of
// experts below). What it saves is the Python
// between them (module calls, views, allocations' wrappers): about ten microseconds an op,
// which at batch 1 on a small model is as long as the matmuls.
//
// A linear layer is four tensors of `weights` and one entry of `kinds`:
//   kind 0, float32:     packed (blocked_linear's layout), -, -            -> float_linear
//   kind 1, int8:        packed, scales, -                                 -> int8_linear
//   kind 2, w8a8:        packed, offsets, scales                           -> w8a8_linear
//   kind 3, int4:        packed, params, -                                 -> int4_linear
//   kind 4, bfloat16:    packed (blocked_linear's layout), -, -            -> bf16_linear
//   kind 5, w4a8:        packed, params, -                                 -> w4a8_linear
//   kind 6, int8 sliced: packed, offsets, scales (w8a8's layout)          -> int8_sliced_linear
//   kind 7, int4 sliced: packed, params, - (w4a8's layout)                 -> int4_sliced_linear
// then the bias (an empty tensor for none). A layer is the input norm's weight, the qkv,
// output, gate/up and down linears (4 tensors each), the post-attention norm's weight, the
// q and k norms' weights (empty tensors without q/k norms), the router's weight and the
// routed-pairs counter (empty tensors in a dense layer): 22 tensors, kinds 4 entries.
//
// A sparse layer (a router's weight present, in the blocked layout of its float_linear or
// bf16_linear) runs the MoE block as the Python one does (moe.py, routing.py): the router's
// logits, softmax_topk's top_k experts of each token and their weights (renormalised when
// `normalize`), the step's pairs per expert added to the counter; the (token, choice) pairs sorted by expert, each expert with pairs multiplies its
// rows at once (gate/up, SiLU x up, down), the outputs scaled by their weights and added onto
// their tokens with one index_add_. Its gate/up and down linears hold every expert stacked
// along a first dimension (expert e's tensors are their e-th entries; no bias).
//
// The first layer's input is `hidden`, or, where `embedding` is given (not empty), the rows of
// the embedding at `input_ids` (the whole model's step: then `residual` may be empty). With
// `final_norm` given, the model's final residual add + RMSNorm follows the last layer and the
// result is the LM head's input; with `head` given too (a linear's four tensors, kind
// `head_kind`), the LM head multiplies it into `logits` [T, vocab] (float32, its first vocab
// channels, converted from the rows' dtype as the Python head's `.float()` does).
//
// Given `step_tokens` [steps, T] (int64; empty: one step), the op runs `steps` greedy decode
// steps in a row (multi-step decoding): after each, row r's argmax (argmax_rows, as the
// greedy sampler takes it) goes to step_tokens[s, r] and becomes its next input id, one
// position on, its slot taken from its block table row (`block_size` tokens a block: the
// scheduler reserved them as lookahead), its sequence length one longer. input_ids,
// positions, slot_mapping and seq_lens are advanced in place; the last step's hidden states
// are returned.
//
// The hidden states are float32 (every linear kind), or bfloat16 with bfloat16 linears and
// experts (a bfloat16 model's decode steps of at most 16 rows, which its Python layers
// multiply with the same bf16_linear), each op rounding to bfloat16 where the Python one does.

#include <ATen/ATen.h>

#include <vector>

#include "ops.h"

namespace servelab_cpu {
namespace {

constexpr int64_t kLayerTensors = 22;
constexpr int64_t kPostNorm = 17, kQNorm = 18, kKNorm = 19, kRouter = 20, kRouted = 21;
constexpr int64_t kLinearTensors = 4;
constexpr int64_t kLayerLinears = 4;

at::Tensor linear(const at::Tensor& x, at::TensorList w, int64_t kind, int64_t out_features) {
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  switch (kind) {
    case 0: float_linear(out, x, w[0]); break;
    case 1: int8_linear(out, x, w[0], w[1]); break;
    case 2: w8a8_linear(out, x, w[0], w[1], w[2]); break;
    case 3: int4_linear(out, x, w[0], w[1]); break;
    case 4: bf16_linear(out, x, w[0]); break;
    case 5: w4a8_linear(out, x, w[0], w[1]); break;
    case 6: int8_sliced_linear(out, x, w[0], w[1], w[2]); break;
    case 7: int4_sliced_linear(out, x, w[0], w[1]); break;
    default: TORCH_CHECK(false, "decode_layers: unknown linear kind ", kind);
  }
  if (w[3].numel()) {
    out.add_(w[3]);
  }
  return out;
}

// The four tensors of a layer's i-th linear (0 qkv, 1 output, 2 gate/up, 3 down).
at::TensorList linear_tensors(at::TensorList w, int64_t i) { return w.slice(1 + i * kLinearTensors, kLinearTensors); }

// Each expert's rows of `pairs` (grouped as `experts`, `starts`, `counts` say) times that
// expert's linear of stacked tensors `w` (float32, int8, w8a8 or bfloat16), in one grouped call.
at::Tensor experts_linear(const at::Tensor& pairs, at::TensorList w, int64_t kind, int64_t out_features,
                          const std::vector<int64_t>& experts, const std::vector<int64_t>& starts,
                          const std::vector<int64_t>& counts) {
  at::Tensor out = at::empty({pairs.size(0), out_features}, pairs.options());
  switch (kind) {
    case 0:
    case 4: grouped_expert_linear(out, pairs, w[0], at::Tensor(), experts, starts, counts); break;
    case 1: grouped_expert_linear(out, pairs, w[0], w[1], experts, starts, counts); break;
    case 2: grouped_w8a8_linear(out, pairs, w[0], w[1], w[2], experts, starts, counts); break;
    case 6: grouped_int8_sliced_linear(out, pairs, w[0], w[1], w[2], experts, starts, counts); break;
    default: TORCH_CHECK(false, "decode_layers: experts of linear kind ", kind, " are not served");
  }
  return out;
}

// The (token, choice) pairs' rows of x sorted by expert (`order`: pair indices, top_k per
// token), and their experts' outputs `result` scaled by the pairs' routing weights and
// added onto their tokens, as the Python layer's index_select, mul_ and index_add_ do in
// the rows' dtype T: every product rounded to T before any add, adds in pair order.
template <typename T>
at::Tensor gather_pairs(const at::Tensor& x, const std::vector<int64_t>& order, int64_t top_k) {
  const int64_t hidden = x.size(1);
  at::Tensor rows = at::empty({static_cast<int64_t>(order.size()), hidden}, x.options());
  const T* source = x.data_ptr<T>();
  T* row = rows.data_ptr<T>();
  for (size_t i = 0; i < order.size(); ++i) std::copy_n(source + order[i] / top_k * hidden, hidden, row + i * hidden);
  return rows;
}

template <typename T>
at::Tensor weighted_sum(const at::Tensor& x, at::Tensor& result, const float* weight, const std::vector<int64_t>& order,
                        int64_t top_k) {
  const int64_t hidden = x.size(1), pairs = static_cast<int64_t>(order.size());
  T* out = result.data_ptr<T>();
  for (int64_t i = 0; i < pairs; ++i) {
    for (int64_t h = 0; h < hidden; ++h) out[i * hidden + h] = static_cast<T>(static_cast<float>(out[i * hidden + h]) *
                                                                               weight[order[i]]);
  }
  at::Tensor mixed = at::zeros_like(x);
  T* dst = mixed.data_ptr<T>();
  for (int64_t i = 0; i < pairs; ++i) {
    T* token = dst + order[i] / top_k * hidden;
    for (int64_t h = 0; h < hidden; ++h) token[h] = static_cast<T>(static_cast<float>(token[h]) +
                                                                   static_cast<float>(out[i * hidden + h]));
  }
  return mixed;
}

// The mixture of experts of a sparse layer on its normed input `x` (see the header): the
// router's logits on its blocked weight and softmax_topk, as the Python router computes
// them; the bookkeeping after it (pairs per expert, the stable sort by expert, gathering
// rows, the weighted sum onto the tokens) is plain loops with the Python layer's results.
at::Tensor sparse_mlp(const at::Tensor& x, at::TensorList w, const int64_t* kind, const int64_t* width,
                      int64_t top_k, bool normalize) {
  const at::Tensor& router = w[kRouter];
  const int64_t experts = w[kRouted].size(0), tokens = x.size(0), pairs = tokens * top_k;
  at::Tensor logits = at::empty({tokens, experts}, x.options());
  if (router.scalar_type() == at::kBFloat16) {
    bf16_linear(logits, x, router);
  } else {
    float_linear(logits, x, router);
  }
  at::Tensor weights = at::empty({tokens, top_k}, x.options().dtype(at::kFloat));
  at::Tensor chosen = at::empty({tokens, top_k}, x.options().dtype(at::kLong));
  softmax_topk(weights, chosen, logits, top_k, normalize);
  const int64_t* choice = chosen.data_ptr<int64_t>();
  std::vector<int64_t> count(experts, 0), next(experts, 0), order(pairs);
  for (int64_t p = 0; p < pairs; ++p) ++count[choice[p]];
  int64_t* routed = w[kRouted].data_ptr<int64_t>();
  std::vector<int64_t> active, starts, counts;
  for (int64_t e = 0, start = 0; e < experts; start += count[e], ++e) {
    routed[e] += count[e];
    next[e] = start;
    if (count[e]) {
      active.push_back(e);
      starts.push_back(start);
      counts.push_back(count[e]);
    }
  }
  for (int64_t p = 0; p < pairs; ++p) order[next[choice[p]]++] = p;  // stable by expert
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor rows = bf16 ? gather_pairs<c10::BFloat16>(x, order, top_k) : gather_pairs<float>(x, order, top_k);
  at::Tensor gate_up = experts_linear(rows, linear_tensors(w, 2), kind[2], width[2], active, starts, counts);
  at::Tensor gated = at::empty({pairs, width[2] / 2}, x.options());
  silu_and_mul(gated, gate_up);
  at::Tensor out = experts_linear(gated, linear_tensors(w, 3), kind[3], width[3], active, starts, counts);
  const float* weight = weights.data_ptr<float>();
  return bf16 ? weighted_sum<c10::BFloat16>(x, out, weight, order, top_k) : weighted_sum<float>(x, out, weight, order, top_k);
}

// RMSNorm of each head of x [T, heads, head_dim] as the Python layer takes it: the native
// op on a contiguous copy of the rows.
at::Tensor head_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor rows = x.reshape({-1, x.size(-1)}).contiguous();
  at::Tensor out = at::empty_like(rows);
  rms_norm(out, rows, weight, eps);
  return out.view(x.sizes());
}

// The rows of `embedding` [vocab, hidden] at `input_ids` [T] (int64), as torch.embedding
// gives them.
at::Tensor embedded_rows(const at::Tensor& input_ids, const at::Tensor& embedding) {
  TORCH_CHECK(embedding.dim() == 2 && embedding.is_contiguous() &&
                  (embedding.scalar_type() == at::kFloat || embedding.scalar_type() == at::kBFloat16),
              "decode_layers: embedding must be a contiguous float32 or bfloat16 [vocab, hidden] tensor");
  TORCH_CHECK(input_ids.dim() == 1 && input_ids.is_contiguous() && input_ids.scalar_type() == at::kLong,
              "decode_layers: input_ids must be a contiguous int64 [T] tensor");
  const int64_t tokens = input_ids.size(0), vocab = embedding.size(0);
  const int64_t row_bytes = embedding.size(1) * static_cast<int64_t>(embedding.element_size());
  at::Tensor x = at::empty({tokens, embedding.size(1)}, embedding.options());
  const int64_t* ids = input_ids.data_ptr<int64_t>();
  const char* table = static_cast<const char*>(embedding.data_ptr());
  char* rows = static_cast<char*>(x.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(ids[t] >= 0 && ids[t] < vocab, "decode_layers: input_ids[", t, "] = ", ids[t],
                " is outside the embedding's ", vocab, " rows");
    std::copy_n(table + ids[t] * row_bytes, row_bytes, rows + t * row_bytes);
  }
  return x;
}

// One step of decode_layers (its arguments, less the steps').
at::Tensor decode_step(const at::Tensor& hidden, at::Tensor residual, bool has_residual, const at::Tensor& positions,
                       at::TensorList kv_caches, const at::Tensor& slot_mapping, const at::Tensor& block_table,
                       const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& requests,
                       const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim, at::TensorList weights,
                       at::IntArrayRef kinds, at::IntArrayRef out_features, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, double scale, double eps, double qk_eps,
                       int64_t top_k, bool normalize, const at::Tensor& input_ids, const at::Tensor& embedding,
                       const at::Tensor& final_norm, double final_eps, at::Tensor logits, at::TensorList head,
                       int64_t head_kind) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kLayerTensors &&
                  static_cast<int64_t>(kinds.size()) == layers * kLayerLinears &&
                  static_cast<int64_t>(out_features.size()) == layers * kLayerLinears,
              "decode_layers: ", layers, " layers need ", kLayerTensors, " weights and ", kLayerLinears,
              " linear kinds and widths each");
  const bool embeds = embedding.numel() > 0;
  TORCH_CHECK(embeds ? !has_residual
                     : hidden.dim() == 2 && hidden.is_contiguous() &&
                           (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16),
              "decode_layers: hidden must be a contiguous float32 or bfloat16 [T, hidden] (or input_ids with the "
              "embedding, and no residual)");
  at::Tensor x = embeds ? embedded_rows(input_ids, embedding) : hidden.clone();
  if (!residual.numel()) {  // none given (from the embedding): the layers' own
    residual = at::empty_like(x);
  }
  const int64_t tokens = x.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
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
    at::Tensor qkv = linear(x, linear_tensors(w, 0), kind[0], width[0]);
    const int64_t row = qkv.size(1), start = qkv.storage_offset();  // q, k, v: views of each row's heads
    at::Tensor q = qkv.as_strided({tokens, num_heads, head_dim}, {row, head_dim, 1}, start);
    at::Tensor k = qkv.as_strided({tokens, num_kv_heads, head_dim}, {row, head_dim, 1}, start + q_size);
    at::Tensor v = qkv.as_strided({tokens, num_kv_heads, head_dim}, {row, head_dim, 1}, start + q_size + kv_size);
    if (w[kQNorm].numel()) {
      q = head_rms_norm(q, w[kQNorm], qk_eps);
      k = head_rms_norm(k, w[kKNorm], qk_eps);
      rotary_embedding(q.narrow(2, 0, rotary_dim), k.narrow(2, 0, rotary_dim), positions, cos, sin);
    } else {
      rotary_embedding_rows(q.data_ptr(), num_heads, k.data_ptr(), num_kv_heads, qkv.scalar_type(), tokens, row,
                            head_dim, rotary_dim, positions, cos, sin);
    }
    write_kv_cache(kv_caches[l], k, v, slot_mapping);
    at::Tensor attended = at::empty({tokens, num_heads, head_dim}, x.options());
    paged_attention(attended, q, kv_caches[l], block_table, query_start_loc, seq_lens, requests, scale, 0,
                    c10::nullopt, c10::nullopt);
    at::Tensor o = linear(attended.view({tokens, q_size}), linear_tensors(w, 1), kind[1], width[1]);
    add_rms_norm(o, residual, w[kPostNorm], eps);
    if (w[kRouter].numel()) {
      x = sparse_mlp(o, w, kind, width, top_k, normalize);
      continue;
    }
    at::Tensor gate_up = linear(o, linear_tensors(w, 2), kind[2], width[2]);
    at::Tensor gated = at::empty({tokens, width[2] / 2}, x.options());
    silu_and_mul(gated, gate_up);
    x = linear(gated, linear_tensors(w, 3), kind[3], width[3]);
  }
  if (final_norm.numel()) {
    add_rms_norm(x, residual, final_norm, final_eps);
  }
  if (!head.empty()) {
    TORCH_CHECK(final_norm.numel() && static_cast<int64_t>(head.size()) == kLinearTensors && logits.dim() == 2 &&
                    logits.size(0) == tokens && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
                "decode_layers: the LM head needs the final norm, its ", kLinearTensors,
                " tensors and a contiguous float32 [T, vocab] logits tensor");
    logits.copy_(linear(x, head, head_kind, logits.size(1)));
  }
  return x;
}

}  // namespace

at::Tensor decode_layers(const at::Tensor& hidden, at::Tensor residual, bool has_residual, at::Tensor positions,
                         at::TensorList kv_caches, at::Tensor slot_mapping, const at::Tensor& block_table,
                         const at::Tensor& query_start_loc, at::Tensor seq_lens, const at::Tensor& requests,
                         const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim, at::TensorList weights,
                         at::IntArrayRef kinds, at::IntArrayRef out_features, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double scale, double eps, double qk_eps,
                         int64_t top_k, bool normalize, at::Tensor input_ids, const at::Tensor& embedding,
                         const at::Tensor& final_norm, double final_eps, at::Tensor logits, at::TensorList head,
                         int64_t head_kind, at::Tensor step_tokens, int64_t block_size) {
  auto step = [&]() {
    return decode_step(hidden, residual, has_residual, positions, kv_caches, slot_mapping, block_table,
                       query_start_loc, seq_lens, requests, cos, sin, rotary_dim, weights, kinds, out_features,
                       num_heads, num_kv_heads, head_dim, scale, eps, qk_eps, top_k, normalize, input_ids, embedding,
                       final_norm, final_eps, logits, head, head_kind);
  };
  if (!step_tokens.numel()) {
    return step();
  }
  const int64_t steps = step_tokens.size(0), rows = input_ids.numel();
  TORCH_CHECK(!head.empty() && embedding.numel() && step_tokens.dim() == 2 && step_tokens.size(1) == rows &&
                  step_tokens.is_contiguous() && step_tokens.scalar_type() == at::kLong &&
                  input_ids.is_contiguous() && input_ids.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.scalar_type() == at::kLong && seq_lens.is_contiguous() &&
                  seq_lens.scalar_type() == at::kInt && block_table.scalar_type() == at::kInt &&
                  block_table.dim() == 2 && block_table.is_contiguous() && block_table.size(0) == rows &&
                  block_size > 0,
              "decode_layers: greedy steps need the embedding, the LM head, int64 [steps, T] step_tokens, one "
              "int64 input id, position and slot and one int32 sequence length and block table row per request, "
              "and the block size");
  at::Tensor x;
  int64_t* ids = input_ids.data_ptr<int64_t>();
  int64_t* position = positions.data_ptr<int64_t>();
  int64_t* slot = slot_mapping.data_ptr<int64_t>();
  int32_t* length = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t width = block_table.size(1);
  for (int64_t s = 0; s < steps; ++s) {
    x = step();
    at::Tensor chosen = step_tokens[s];
    argmax_rows(chosen, logits);
    if (s + 1 == steps) {
      break;
    }
    const int64_t* next = chosen.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {  // the chosen token runs next, one position on, in its reserved slot
      const int64_t p = ++position[r];
      TORCH_CHECK(p / block_size < width, "decode_layers: step ", s + 1, " of request ", r, " at position ", p,
                  " lies past its block table");
      ids[r] = next[r];
      slot[r] = static_cast<int64_t>(table[r * width + p / block_size]) * block_size + p % block_size;
      ++length[r];
    }
  }
  return x;
}

}  // namespace servelab_cpu
