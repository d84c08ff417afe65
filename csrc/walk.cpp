// STUB: replaced by the implementation of this op group.
#include "checks.h"
#include "ops.h"

namespace ddtree {

void check_walk(const char* op, const at::Tensor& node_token, const at::Tensor& first_child,
                const at::Tensor& next_sibling, const at::Tensor& accepted, const at::Tensor& accept_len,
                const at::Tensor& next_token) {
  TORCH_CHECK(false, "check_walk: not implemented yet");
}

void walk_greedy_cpu(const at::Tensor& node_token, const at::Tensor& first_child, const at::Tensor& next_sibling,
                     const at::Tensor& target_token, at::Tensor& accepted, at::Tensor& accept_len,
                     at::Tensor& next_token) {
  TORCH_CHECK(false, "walk_greedy_cpu: not implemented yet");
}

void check_walk_sample(const at::Tensor& node_token, const at::Tensor& logits, const at::Tensor& uniform,
                       double temperature, int64_t top_k, double top_p, const at::Tensor& accepted) {
  TORCH_CHECK(false, "check_walk_sample: not implemented yet");
}

void walk_sample_cpu(const at::Tensor& node_token, const at::Tensor& first_child, const at::Tensor& next_sibling,
                     const at::Tensor& logits, const at::Tensor& uniform, double temperature, int64_t top_k,
                     double top_p, at::Tensor& accepted, at::Tensor& accept_len, at::Tensor& next_token) {
  TORCH_CHECK(false, "walk_sample_cpu: not implemented yet");
}

}  // namespace ddtree
