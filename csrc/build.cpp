// STUB: replaced by the implementation of this op group.
#include "checks.h"
#include "ops.h"

namespace ddtree {

void check_topk_logprobs(const at::Tensor& logits, const at::Tensor& logp, const at::Tensor& tokens) {
  TORCH_CHECK(false, "check_topk_logprobs: not implemented yet");
}

void topk_logprobs_cpu(const at::Tensor& logits, at::Tensor& logp, at::Tensor& tokens) {
  TORCH_CHECK(false, "topk_logprobs_cpu: not implemented yet");
}

void check_build_tree(const at::Tensor& logp, const at::Tensor& tokens, const at::Tensor& root_token,
                      const at::Tensor& prefix_len, int64_t budget, const at::Tensor& node_token,
                      const at::Tensor& parent, const at::Tensor& depth, const at::Tensor& num_nodes,
                      const at::Tensor& first_child, const at::Tensor& next_sibling,
                      const at::Tensor& ancestor_mask, const at::Tensor& position) {
  TORCH_CHECK(false, "check_build_tree: not implemented yet");
}

void build_tree_cpu(const at::Tensor& logp, const at::Tensor& tokens, const at::Tensor& root_token,
                    const at::Tensor& prefix_len, int64_t budget, bool spine, at::Tensor& node_token,
                    at::Tensor& parent, at::Tensor& depth, at::Tensor& num_nodes, at::Tensor& first_child,
                    at::Tensor& next_sibling, at::Tensor& ancestor_mask, at::Tensor& position) {
  TORCH_CHECK(false, "build_tree_cpu: not implemented yet");
}

void check_tree_attention_mask(const at::Tensor& ancestor_mask, const at::Tensor& prefix_len,
                               const at::Tensor& mask) {
  TORCH_CHECK(false, "check_tree_attention_mask: not implemented yet");
}

void tree_attention_mask_cpu(const at::Tensor& ancestor_mask, const at::Tensor& prefix_len, at::Tensor& mask) {
  TORCH_CHECK(false, "tree_attention_mask_cpu: not implemented yet");
}

}  // namespace ddtree
