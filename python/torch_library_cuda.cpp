// CUDA implementations of the ddtree ops (schemas: python/torch_library.cpp). Compiled only in CUDA
// builds; every op launches on the current stream and never synchronises, so all are graph-safe.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY_IMPL(ddtree, CUDA, m) {
  m.impl("topk_logprobs", &ddtree::topk_logprobs_cuda);
  m.impl("build_tree", &ddtree::build_tree_cuda);
  m.impl("tree_attention_mask", &ddtree::tree_attention_mask_cuda);
  m.impl("tree_conv1d", &ddtree::tree_conv1d_cuda);
  m.impl("tree_gated_delta_rule", &ddtree::tree_gated_delta_rule_cuda);
  m.impl("gdn_conv_delta_rule", &ddtree::gdn_conv_delta_rule_cuda);
  m.impl("rms_norm", &ddtree::rms_norm_cuda);
  m.impl("add_rms_norm", &ddtree::add_rms_norm_cuda);
  m.impl("silu_mul", &ddtree::silu_mul_cuda);
  m.impl("rope", &ddtree::rope_cuda);
  m.impl("qk_norm_rope", &ddtree::qk_norm_rope_cuda);
  m.impl("qk_norm_rope_store_kv", &ddtree::qk_norm_rope_store_kv_cuda);
  m.impl("sigmoid_mul", &ddtree::sigmoid_mul_cuda);
  m.impl("linear", &ddtree::linear_cuda);
  m.impl("linear_cublaslt", &ddtree::linear_cublaslt_cuda);
  m.impl("linear_gemv", &ddtree::linear_gemv_cuda);
  m.impl("linear_cublaslt_algorithms", &ddtree::linear_cublaslt_algorithms_cuda);
  m.impl("linear_cublaslt_describe", &ddtree::linear_cublaslt_describe_cuda);
  m.impl("gqa_attention", &ddtree::gqa_attention_cuda);
  m.impl("gdn_gates", &ddtree::gdn_gates_cuda);
  m.impl("moe_experts", &ddtree::moe_experts_cuda);
  m.impl("moe_router", &ddtree::moe_router_cuda);
  m.impl("penalize_logits", &ddtree::penalize_logits_cuda);
  m.impl("row_argmax", &ddtree::row_argmax_cuda);
  m.impl("walk_greedy", &ddtree::walk_greedy_cuda);
  m.impl("walk_sample", &ddtree::walk_sample_cuda);
  m.impl("commit_gdn_state", &ddtree::commit_gdn_state_cuda);
  m.impl("commit_conv_state", &ddtree::commit_conv_state_cuda);
  m.impl("commit_kv", &ddtree::commit_kv_cuda);
  m.impl("store_kv", &ddtree::store_kv_cuda);
  m.impl("gather_rows", &ddtree::gather_rows_cuda);
}
