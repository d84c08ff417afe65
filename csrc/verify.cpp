// STUB: replaced by the implementation of this op group.
#include "checks.h"
#include "ops.h"

namespace ddtree {

void check_tree_conv1d(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       const at::Tensor& conv_state, const at::Tensor& parent, const at::Tensor& out) {
  TORCH_CHECK(false, "check_tree_conv1d: not implemented yet");
}

void tree_conv1d_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                     const at::Tensor& conv_state, const at::Tensor& parent, bool silu, at::Tensor& out) {
  TORCH_CHECK(false, "tree_conv1d_cpu: not implemented yet");
}

void check_tree_gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                                 const at::Tensor& parent, const at::Tensor& out, const at::Tensor& stash_u,
                                 const at::Tensor& stash_k, const at::Tensor& stash_cumg) {
  TORCH_CHECK(false, "check_tree_gated_delta_rule: not implemented yet");
}

void tree_gated_delta_rule_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                               const at::Tensor& beta, const at::Tensor& state, const at::Tensor& parent,
                               double scale, bool use_qk_l2norm, at::Tensor& out, at::Tensor& stash_u,
                               at::Tensor& stash_k, at::Tensor& stash_cumg) {
  TORCH_CHECK(false, "tree_gated_delta_rule_cpu: not implemented yet");
}

}  // namespace ddtree
