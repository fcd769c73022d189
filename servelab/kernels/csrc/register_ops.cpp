// Native CPU kernels for servelab: paged attention over the block table, fresh-prefill
// attention, the fused element-wise ops of a Llama layer (residual add + RMSNorm, rotary
// embedding, SiLU x up, greedy argmax), the quantized matmuls (weight-only int8 and int4,
// and int8 or int4 weights with int8 activations) and a decoder stack made of them for decode steps,
// registered as torch.ops.servelab_cpu.*.
//
// Built on first use by servelab/kernels/cpu_ops.py (torch.utils.cpp_extension, -O3 -march=native,
// CPU_CAPABILITY set to torch's so at::vec::Vectorized uses the widest SIMD of the host)
// from every source of this folder as one library; this file is its one registration.

#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(servelab_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_table, Tensor query_start_loc, "
        "Tensor seq_lens, Tensor requests, float scale, int window, Tensor? tree_mask=None, "
        "Tensor? tree_lens=None) -> ()");
  m.def("supports_head_dim(int head_dim) -> bool");
  m.def("bf16_key_pairs() -> bool");
  m.def("write_kv_cache(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("argmax_rows(Tensor(a!) out, Tensor logits) -> ()");
  m.def("sample_rows(Tensor(a!) out, Tensor logits, Tensor noise, float[] temperatures, int[] top_ks, float[] top_ps, "
        "float[] min_ps) -> ()");
  m.def("float_linear(Tensor(a!) out, Tensor x, Tensor packed) -> ()");
  m.def("bf16_linear(Tensor(a!) out, Tensor x, Tensor packed) -> ()");
  m.def("int8_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor scales) -> ()");
  m.def("int4_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor params) -> ()");
  m.def("w4a8_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor params) -> ()");
  m.def("supports_w8a8() -> bool");
  m.def("w8a8_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor offsets, Tensor scales) -> ()");
  m.def("int8_sliced_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor offsets, Tensor scales) -> ()");
  m.def("grouped_expert_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor scales, int[] experts, int[] starts, "
        "int[] counts) -> ()");
  m.def("grouped_w8a8_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor offsets, Tensor scales, int[] experts, "
        "int[] starts, int[] counts) -> ()");
  m.def("grouped_int8_sliced_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor offsets, Tensor scales, "
        "int[] experts, int[] starts, int[] counts) -> ()");
  m.def("int4_sliced_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor params) -> ()");
  m.def("softmax_topk(Tensor(a!) weights, Tensor(b!) experts, Tensor logits, int top_k, bool normalize) -> ()");
  m.def("causal_prefill_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, int[] starts, int[] lengths, "
        "float scale) -> ()");
  m.def("decode_layers(Tensor hidden, Tensor(a!) residual, bool has_residual, Tensor(c!) positions, "
        "Tensor[] kv_caches, Tensor(d!) slot_mapping, Tensor block_table, Tensor query_start_loc, "
        "Tensor(e!) seq_lens, Tensor requests, Tensor cos, Tensor sin, int rotary_dim, Tensor[] weights, int[] kinds, "
        "int[] out_features, int num_heads, int num_kv_heads, int head_dim, float scale, float eps, float qk_eps, "
        "int top_k, bool normalize, Tensor(f!) input_ids, Tensor embedding, Tensor final_norm, float final_eps, "
        "Tensor(b!) logits, Tensor[] head, int head_kind, Tensor(g!) step_tokens, int block_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(servelab_cpu, CatchAll, m) {
  m.impl("supports_head_dim", &servelab_cpu::supports_head_dim);
  m.impl("bf16_key_pairs", &servelab_cpu::bf16_key_pairs);
  m.impl("supports_w8a8", &servelab_cpu::supports_w8a8);
}

TORCH_LIBRARY_IMPL(servelab_cpu, CPU, m) {
  m.impl("paged_attention", &servelab_cpu::paged_attention);
  m.impl("write_kv_cache", &servelab_cpu::write_kv_cache);
  m.impl("rms_norm", &servelab_cpu::rms_norm);
  m.impl("add_rms_norm", &servelab_cpu::add_rms_norm);
  m.impl("rotary_embedding", &servelab_cpu::rotary_embedding);
  m.impl("silu_and_mul", &servelab_cpu::silu_and_mul);
  m.impl("argmax_rows", &servelab_cpu::argmax_rows);
  m.impl("sample_rows", &servelab_cpu::sample_rows);
  m.impl("float_linear", &servelab_cpu::float_linear);
  m.impl("bf16_linear", &servelab_cpu::bf16_linear);
  m.impl("int8_linear", &servelab_cpu::int8_linear);
  m.impl("w8a8_linear", &servelab_cpu::w8a8_linear);
  m.impl("int8_sliced_linear", &servelab_cpu::int8_sliced_linear);
  m.impl("grouped_expert_linear", &servelab_cpu::grouped_expert_linear);
  m.impl("grouped_w8a8_linear", &servelab_cpu::grouped_w8a8_linear);
  m.impl("grouped_int8_sliced_linear", &servelab_cpu::grouped_int8_sliced_linear);
  m.impl("int4_linear", &servelab_cpu::int4_linear);
  m.impl("w4a8_linear", &servelab_cpu::w4a8_linear);
  m.impl("int4_sliced_linear", &servelab_cpu::int4_sliced_linear);
  m.impl("softmax_topk", &servelab_cpu::softmax_topk);
  m.impl("causal_prefill_attention", &servelab_cpu::causal_prefill_attention);
  m.impl("decode_layers", &servelab_cpu::decode_layers);
}
