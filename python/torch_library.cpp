// The ddtree op library: one schema per op, registered once, and the per-device implementations.
//
// Every op but two host queries (linear_cublaslt_algorithms, linear_cublaslt_describe) writes into
// caller-provided buffers, marked mutable in the schema (Tensor(a!)), and returns nothing, so the ops need
// no allocation, are safe under CUDA graphs, and torch.compile handles them through auto-functionalization. Argument meanings are documented in ddtree_ext/ops.py; the readable
// specification is ddtree_ext/reference.py.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(ddtree, m) {
  // build
  m.def("topk_logprobs(Tensor logits, Tensor(a!) logp, Tensor(b!) tokens) -> ()");
  m.def(
      "build_tree(Tensor logp, Tensor tokens, Tensor root_token, Tensor prefix_len, int budget, bool spine, "
      "Tensor(a!) node_token, Tensor(b!) parent, Tensor(c!) depth, Tensor(d!) num_nodes, "
      "Tensor(e!) first_child, Tensor(f!) next_sibling, Tensor(g!) ancestor_mask, Tensor(h!) position) -> ()");
  m.def("tree_attention_mask(Tensor ancestor_mask, Tensor prefix_len, Tensor(a!) mask) -> ()");
  // verify
  m.def(
      "tree_conv1d(Tensor x, Tensor weight, Tensor? bias, Tensor conv_state, Tensor parent, bool silu, "
      "Tensor(a!) out) -> ()");
  m.def(
      "tree_gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor state, Tensor parent, "
      "float scale, bool use_qk_l2norm, Tensor(a!) out, Tensor(b!) stash_u, Tensor(c!) stash_k, "
      "Tensor(d!) stash_cumg) -> ()");
  m.def(
      "gdn_conv_delta_rule(Tensor x, Tensor conv_weight, Tensor? conv_bias, Tensor conv_state, Tensor g, "
      "Tensor beta, Tensor state, Tensor parent, int num_heads, int head_k_dim, float scale, bool use_qk_l2norm, "
      "Tensor(a!) out, Tensor(b!) stash_u, Tensor(c!) stash_k, Tensor(d!) stash_cumg) -> ()");
  // layer bodies
  m.def("rms_norm(Tensor x, Tensor weight, Tensor? gate, float eps, bool zero_centered, Tensor(a!) out) -> ()");
  m.def(
      "add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, bool zero_centered, Tensor(a!) out, "
      "Tensor(b!) residual_out) -> ()");
  m.def("silu_mul(Tensor gate, Tensor up, Tensor(a!) out) -> ()");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, Tensor(a!) out) -> ()");
  m.def(
      "qk_norm_rope(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor cos, Tensor sin, float eps, "
      "bool zero_centered, Tensor(a!) q_out, Tensor(b!) k_out) -> ()");
  m.def(
      "qk_norm_rope_store_kv(Tensor q, Tensor k, Tensor v, Tensor q_weight, Tensor k_weight, Tensor cos, Tensor sin, "
      "float eps, bool zero_centered, Tensor slots, Tensor(a!) q_out, Tensor(b!) keys, Tensor(c!) values) -> ()");
  m.def("sigmoid_mul(Tensor gate, Tensor x, Tensor(a!) out) -> ()");
  m.def("linear(Tensor x, Tensor weight, Tensor(a!) out, bool prefetch_weight=False) -> ()");
  m.def("linear_cublaslt(Tensor x, Tensor weight, int algorithm, Tensor(a!) out) -> ()");
  m.def("linear_gemv(Tensor x, Tensor weight, Tensor(a!) out, bool prefetch_weight=False) -> ()");
  // host queries: how many cuBLASLt candidates a problem has, and what one of them is
  m.def("linear_cublaslt_algorithms(Tensor x, Tensor weight, Tensor out) -> int");
  m.def("linear_cublaslt_describe(Tensor x, Tensor weight, Tensor out, int algorithm) -> str");
  m.def(
      "gqa_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, Tensor(a!) out, int num_splits=0) -> ()");
  m.def(
      "gdn_gates(Tensor x, Tensor weight_a, Tensor weight_b, Tensor A_log, Tensor dt_bias, Tensor(a!) g, "
      "Tensor(b!) beta) -> ()");
  m.def(
      "moe_experts(Tensor x, Tensor expert_ids, Tensor expert_weights, Tensor gate_up_proj, Tensor down_proj, "
      "Tensor? shared, Tensor? shared_gate, Tensor(a!) routing, Tensor(b!) hidden, Tensor(c!) expert_out, "
      "Tensor(d!) out) -> ()");
  m.def("moe_router(Tensor logits, int top_k, bool renormalize, Tensor(a!) weights, Tensor(b!) ids) -> ()");
  // penalize
  m.def(
      "penalize_logits(Tensor logits, Tensor node_token, Tensor parent, Tensor? seen, Tensor? counts, "
      "float repetition_penalty, float presence_penalty, float frequency_penalty, int max_depth, Tensor(a!) out) -> ()");
  // walk
  m.def("row_argmax(Tensor x, Tensor(a!) out) -> ()");
  m.def(
      "walk_greedy(Tensor node_token, Tensor first_child, Tensor next_sibling, Tensor target_token, "
      "Tensor(a!) accepted, Tensor(b!) accept_len, Tensor(c!) next_token) -> ()");
  m.def(
      "walk_sample(Tensor node_token, Tensor first_child, Tensor next_sibling, Tensor logits, Tensor uniform, "
      "float temperature, int top_k, float top_p, float min_p, Tensor(a!) accepted, Tensor(b!) accept_len, "
      "Tensor(c!) next_token) -> ()");
  // commit
  m.def(
      "commit_gdn_state(Tensor(a!)[] state, Tensor[] stash_u, Tensor[] stash_k, Tensor[] stash_cumg, "
      "Tensor accepted, Tensor accept_len) -> ()");
  m.def("commit_conv_state(Tensor(a!)[] conv_state, Tensor[] x, Tensor accepted, Tensor accept_len) -> ()");
  m.def("commit_kv(Tensor(a!)[] cache, Tensor prefix_len, Tensor accepted, Tensor accept_len) -> ()");
  m.def("store_kv(Tensor(a!) keys, Tensor(b!) values, Tensor slots, Tensor key_states, Tensor value_states) -> ()");
  m.def("gather_rows(Tensor src, Tensor accepted, Tensor accept_len, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(ddtree, CPU, m) {
  m.impl("topk_logprobs", &ddtree::topk_logprobs_cpu);
  m.impl("build_tree", &ddtree::build_tree_cpu);
  m.impl("tree_attention_mask", &ddtree::tree_attention_mask_cpu);
  m.impl("tree_conv1d", &ddtree::tree_conv1d_cpu);
  m.impl("tree_gated_delta_rule", &ddtree::tree_gated_delta_rule_cpu);
  m.impl("gdn_conv_delta_rule", &ddtree::gdn_conv_delta_rule_cpu);
  m.impl("rms_norm", &ddtree::rms_norm_cpu);
  m.impl("add_rms_norm", &ddtree::add_rms_norm_cpu);
  m.impl("silu_mul", &ddtree::silu_mul_cpu);
  m.impl("rope", &ddtree::rope_cpu);
  m.impl("qk_norm_rope", &ddtree::qk_norm_rope_cpu);
  m.impl("qk_norm_rope_store_kv", &ddtree::qk_norm_rope_store_kv_cpu);
  m.impl("sigmoid_mul", &ddtree::sigmoid_mul_cpu);
  m.impl("linear", &ddtree::linear_cpu);
  m.impl("linear_cublaslt", &ddtree::linear_cublaslt_cpu);
  m.impl("linear_gemv", &ddtree::linear_gemv_cpu);
  m.impl("linear_cublaslt_algorithms", &ddtree::linear_cublaslt_algorithms_cpu);
  m.impl("linear_cublaslt_describe", &ddtree::linear_cublaslt_describe_cpu);
  m.impl("gqa_attention", &ddtree::gqa_attention_cpu);
  m.impl("gdn_gates", &ddtree::gdn_gates_cpu);
  m.impl("moe_experts", &ddtree::moe_experts_cpu);
  m.impl("moe_router", &ddtree::moe_router_cpu);
  m.impl("penalize_logits", &ddtree::penalize_logits_cpu);
  m.impl("row_argmax", &ddtree::row_argmax_cpu);
  m.impl("walk_greedy", &ddtree::walk_greedy_cpu);
  m.impl("walk_sample", &ddtree::walk_sample_cpu);
  m.impl("commit_gdn_state", &ddtree::commit_gdn_state_cpu);
  m.impl("commit_conv_state", &ddtree::commit_conv_state_cpu);
  m.impl("commit_kv", &ddtree::commit_kv_cpu);
  m.impl("store_kv", &ddtree::store_kv_cpu);
  m.impl("gather_rows", &ddtree::gather_rows_cpu);
}
