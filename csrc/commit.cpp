// STUB: replaced by the implementation of this op group.
#include "checks.h"
#include "ops.h"

namespace ddtree {

void check_commit_path(const char* op, const at::Tensor& accepted, const at::Tensor& accept_len) {
  TORCH_CHECK(false, "check_commit_path: not implemented yet");
}

void check_commit_gdn_state(at::TensorList state, at::TensorList stash_u, at::TensorList stash_k,
                            at::TensorList stash_cumg, const at::Tensor& accepted, const at::Tensor& accept_len) {
  TORCH_CHECK(false, "check_commit_gdn_state: not implemented yet");
}

void commit_gdn_state_cpu(at::TensorList state, at::TensorList stash_u, at::TensorList stash_k,
                          at::TensorList stash_cumg, const at::Tensor& accepted, const at::Tensor& accept_len) {
  TORCH_CHECK(false, "commit_gdn_state_cpu: not implemented yet");
}

void check_commit_conv_state(at::TensorList conv_state, at::TensorList x, const at::Tensor& accepted,
                             const at::Tensor& accept_len) {
  TORCH_CHECK(false, "check_commit_conv_state: not implemented yet");
}

void commit_conv_state_cpu(at::TensorList conv_state, at::TensorList x, const at::Tensor& accepted,
                           const at::Tensor& accept_len) {
  TORCH_CHECK(false, "commit_conv_state_cpu: not implemented yet");
}

void check_commit_kv(at::TensorList cache, const at::Tensor& prefix_len, const at::Tensor& accepted,
                     const at::Tensor& accept_len) {
  TORCH_CHECK(false, "check_commit_kv: not implemented yet");
}

void commit_kv_cpu(at::TensorList cache, const at::Tensor& prefix_len, const at::Tensor& accepted,
                   const at::Tensor& accept_len) {
  TORCH_CHECK(false, "commit_kv_cpu: not implemented yet");
}

void check_gather_rows(const at::Tensor& src, const at::Tensor& accepted, const at::Tensor& accept_len,
                       const at::Tensor& out) {
  TORCH_CHECK(false, "check_gather_rows: not implemented yet");
}

void gather_rows_cpu(const at::Tensor& src, const at::Tensor& accepted, const at::Tensor& accept_len,
                     at::Tensor& out) {
  TORCH_CHECK(false, "gather_rows_cpu: not implemented yet");
}

}  // namespace ddtree
