// Declarations of every ddtree op: the device-agnostic argument checks and the per-device
// implementations. Schemas (and the meaning of each argument) live in python/torch_library.cpp;
// the readable specification of each op is ddtree_ext/reference.py.
//
// Conventions shared by all ops
//   B  batch rows, each with its own tree
//   N  tree nodes per row, padded: N = budget + 1, node 0 is the root (the last committed token)
//   L  draft depths (positions predicted by the draft), K candidates per depth
//   D  longest accepted path the caller makes room for (root included), usually L + 1
// Token ids, prefix lengths and positions are int64; node indices, depths and counts are int32.
// Every op writes into caller-provided buffers and returns nothing: no allocation, no host sync
// (on CUDA), safe under CUDA graphs and torch.compile. The two exceptions are host queries that launch nothing:
// linear_cublaslt_algorithms (a count) and linear_cublaslt_describe (a string).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <string>
#include <vector>

namespace ddtree {

// ---- build: per-depth top-K, tree, attention mask --------------------------------------------
void check_topk_logprobs(const at::Tensor& logits, const at::Tensor& logp, const at::Tensor& tokens);
void topk_logprobs_cpu(const at::Tensor& logits, at::Tensor& logp, at::Tensor& tokens);

void check_build_tree(const at::Tensor& logp, const at::Tensor& tokens, const at::Tensor& root_token,
                      const at::Tensor& prefix_len, int64_t budget, const at::Tensor& node_token,
                      const at::Tensor& parent, const at::Tensor& depth, const at::Tensor& num_nodes,
                      const at::Tensor& first_child, const at::Tensor& next_sibling,
                      const at::Tensor& ancestor_mask, const at::Tensor& position);
void build_tree_cpu(const at::Tensor& logp, const at::Tensor& tokens, const at::Tensor& root_token,
                    const at::Tensor& prefix_len, int64_t budget, bool spine, at::Tensor& node_token,
                    at::Tensor& parent, at::Tensor& depth, at::Tensor& num_nodes, at::Tensor& first_child,
                    at::Tensor& next_sibling, at::Tensor& ancestor_mask, at::Tensor& position);

void check_tree_attention_mask(const at::Tensor& ancestor_mask, const at::Tensor& prefix_len,
                               const at::Tensor& mask);
void tree_attention_mask_cpu(const at::Tensor& ancestor_mask, const at::Tensor& prefix_len, at::Tensor& mask);

// ---- verify: GDN layers on a tree ------------------------------------------------------------
// Values of parent [B, N] int32: every row a tree in topological order, -1 at the root (node 0) and
// 0 <= parent[i] < i elsewhere. Reads the data, so only the CPU implementations call it (the check_* functions are
// metadata-only).
void check_parent_values(const char* op, const at::Tensor& parent);

void check_tree_conv1d(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       const at::Tensor& conv_state, const at::Tensor& parent, const at::Tensor& out,
                       const char* op = "tree_conv1d");
void tree_conv1d_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                     const at::Tensor& conv_state, const at::Tensor& parent, bool silu, at::Tensor& out);

void check_tree_gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                                 const at::Tensor& parent, const at::Tensor& out, const at::Tensor& stash_u,
                                 const at::Tensor& stash_k, const at::Tensor& stash_cumg,
                                 const char* op = "tree_gated_delta_rule");
void tree_gated_delta_rule_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                               const at::Tensor& beta, const at::Tensor& state, const at::Tensor& parent,
                               double scale, bool use_qk_l2norm, at::Tensor& out, at::Tensor& stash_u,
                               at::Tensor& stash_k, at::Tensor& stash_cumg);

// gdn_conv_delta_rule: a GDN layer's causal conv (with SiLU) and its delta rule over the conv's q, k, v channels.
// The check returns a buffer for the conv's output ([B, N, C], x's dtype) and its q, k, v views ([B, N, H, K] twice,
// [B, N, HV, V]).
struct GdnConvBuffers {
  at::Tensor conv_out;
  std::array<at::Tensor, 3> qkv;
};
GdnConvBuffers check_gdn_conv_delta_rule(const at::Tensor& x, const at::Tensor& conv_weight,
                                     const c10::optional<at::Tensor>& conv_bias, const at::Tensor& conv_state,
                                     const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                                     const at::Tensor& parent, int64_t heads, int64_t kdim, const at::Tensor& out,
                                     const at::Tensor& stash_u, const at::Tensor& stash_k,
                                     const at::Tensor& stash_cumg);
void gdn_conv_delta_rule_cpu(const at::Tensor& x, const at::Tensor& conv_weight,
                             const c10::optional<at::Tensor>& conv_bias, const at::Tensor& conv_state,
                             const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                             const at::Tensor& parent, int64_t heads, int64_t kdim, double scale, bool use_qk_l2norm,
                             at::Tensor& out, at::Tensor& stash_u, at::Tensor& stash_k, at::Tensor& stash_cumg);

// ---- layer bodies: fused norms, SwiGLU, RoPE, projections, GDN gates, GQA attention (csrc/layer.cpp) ----------
void check_rms_norm(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& gate, double eps,
                    bool zero_centered, const at::Tensor& out);
void rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& gate, double eps,
                  bool zero_centered, at::Tensor& out);
void check_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                        bool zero_centered, const at::Tensor& out, const at::Tensor& residual_out);
void add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                      bool zero_centered, at::Tensor& out, at::Tensor& residual_out);
void check_silu_mul(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& out);
void silu_mul_cpu(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out);
void check_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& out);
void rope_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out);
void check_qk_norm_rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight,
                        const at::Tensor& k_weight, const at::Tensor& cos, const at::Tensor& sin, double eps,
                        const at::Tensor& q_out, const at::Tensor& k_out);
void qk_norm_rope_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight, const at::Tensor& k_weight,
                      const at::Tensor& cos, const at::Tensor& sin, double eps, bool zero_centered, at::Tensor& q_out,
                      at::Tensor& k_out);
void check_qk_norm_rope_store_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& q_weight, const at::Tensor& k_weight, const at::Tensor& cos,
                                 const at::Tensor& sin, double eps, const at::Tensor& slots, const at::Tensor& q_out,
                                 const at::Tensor& keys, const at::Tensor& values);
void qk_norm_rope_store_kv_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& q_weight, const at::Tensor& k_weight, const at::Tensor& cos,
                               const at::Tensor& sin, double eps, bool zero_centered, const at::Tensor& slots,
                               at::Tensor& q_out, at::Tensor& keys, at::Tensor& values);
void check_sigmoid_mul(const at::Tensor& gate, const at::Tensor& x, const at::Tensor& out);
void sigmoid_mul_cpu(const at::Tensor& gate, const at::Tensor& x, at::Tensor& out);
void check_gdn_gates(const at::Tensor& x, const at::Tensor& weight_a, const at::Tensor& weight_b,
                     const at::Tensor& A_log, const at::Tensor& dt_bias, const at::Tensor& g, const at::Tensor& beta);
void gdn_gates_cpu(const at::Tensor& x, const at::Tensor& weight_a, const at::Tensor& weight_b, const at::Tensor& A_log,
                   const at::Tensor& dt_bias, at::Tensor& g, at::Tensor& beta);
void check_linear(const char* op, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out);
// check_linear, and row strides a matrix's leading dimension can express (rows never closer than their length).
void check_linear_cublaslt(const char* op, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out);
int64_t linear_cublaslt_algorithms_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out);
std::string linear_cublaslt_describe_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out,
                                         int64_t algorithm);
void linear_cublaslt_cpu(const at::Tensor& x, const at::Tensor& weight, int64_t algorithm, at::Tensor& out);
// out = x weight^T through at::mm: the CPU op, and the CUDA op's path for what its kernel does not take.
void linear_mm(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out);
void linear_cpu(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, bool prefetch_weight);
// check_linear for a single row of x.
void check_linear_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out);
void linear_gemv_cpu(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, bool prefetch_weight);
void check_gqa_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                         const at::Tensor& out, int64_t num_splits);
// The same attention through ATen's SDPA over K/V repeated per query head: the CPU op, and the CUDA op's path for
// what its kernel does not take (float32, other head dims, unaligned rows).
void gqa_attention_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                        double scale, at::Tensor& out);
void gqa_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                       double scale, at::Tensor& out, int64_t num_splits);

// ---- penalize: the repetition, presence and frequency penalties at every tree node -------------
struct Penalties;
void check_penalize_logits(const at::Tensor& logits, const at::Tensor& node_token, const at::Tensor& parent,
                           const c10::optional<at::Tensor>& seen, const c10::optional<at::Tensor>& counts,
                           double repetition_penalty, double presence_penalty, double frequency_penalty,
                           int64_t max_depth, const at::Tensor& out);
// The tables' rows and the float32 penalties of a checked call (penalties.h).
Penalties make_penalties(const c10::optional<at::Tensor>& seen, const c10::optional<at::Tensor>& counts,
                         double repetition_penalty, double presence_penalty, double frequency_penalty);
void penalize_logits_cpu(const at::Tensor& logits, const at::Tensor& node_token, const at::Tensor& parent,
                         const c10::optional<at::Tensor>& seen, const c10::optional<at::Tensor>& counts,
                         double repetition_penalty, double presence_penalty, double frequency_penalty,
                         int64_t max_depth, at::Tensor& out);

// ---- moe: a sparse MoE block's routed experts and router (csrc/moe.cpp) --------------------------
// P = T * K (token, expert) pairs; S = min(E, P) slots, one per expert the pairs reach. routing is int32 scratch of
// moe_routing_size(E, P) elements: the CUDA route kernel's per-expert lists (left untouched by the CPU op and by 16-bit
// CUDA calls of at most 32 pairs and 8 rows, whose projection blocks rank the ids themselves).
int64_t moe_routing_size(int64_t num_experts, int64_t num_pairs);
void check_moe_experts(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& expert_weights,
                       const at::Tensor& gate_up_proj, const at::Tensor& down_proj,
                       const c10::optional<at::Tensor>& shared, const c10::optional<at::Tensor>& shared_gate,
                       const at::Tensor& routing, const at::Tensor& hidden, const at::Tensor& expert_out,
                       const at::Tensor& out);
void moe_experts_cpu(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& expert_weights,
                     const at::Tensor& gate_up_proj, const at::Tensor& down_proj,
                     const c10::optional<at::Tensor>& shared, const c10::optional<at::Tensor>& shared_gate,
                     at::Tensor& routing, at::Tensor& hidden, at::Tensor& expert_out, at::Tensor& out);
// The router: softmax over E, top-k, renormalised (csrc/moe.cpp). The softmax's sum runs over kRouterLanes lane sums.
constexpr int kRouterLanes = 32;
void check_moe_router(const at::Tensor& logits, int64_t top_k, const at::Tensor& weights, const at::Tensor& ids);
void moe_router_cpu(const at::Tensor& logits, int64_t top_k, bool renormalize, at::Tensor& weights, at::Tensor& ids);

// ---- walk: follow the target's tokens down the tree ------------------------------------------
void check_walk(const char* op, const at::Tensor& node_token, const at::Tensor& first_child,
                const at::Tensor& next_sibling, const at::Tensor& accepted, const at::Tensor& accept_len,
                const at::Tensor& next_token);
void check_walk_greedy(const at::Tensor& node_token, const at::Tensor& target_token, const at::Tensor& accepted,
                       const at::Tensor& accept_len, const at::Tensor& next_token);
void check_row_argmax(const at::Tensor& x, const at::Tensor& out);
void row_argmax_cpu(const at::Tensor& x, at::Tensor& out);
void walk_greedy_cpu(const at::Tensor& node_token, const at::Tensor& first_child, const at::Tensor& next_sibling,
                     const at::Tensor& target_token, at::Tensor& accepted, at::Tensor& accept_len,
                     at::Tensor& next_token);
void check_walk_sample(const at::Tensor& node_token, const at::Tensor& logits, const at::Tensor& uniform,
                       double temperature, int64_t top_k, double top_p, double min_p, const at::Tensor& accepted);
// float32(log(min_p)), the log taken in double on the host; -inf for min_p = 0 (off). See min_p_cut (min_p.h).
float min_p_offset(double min_p);
void walk_sample_cpu(const at::Tensor& node_token, const at::Tensor& first_child, const at::Tensor& next_sibling,
                     const at::Tensor& logits, const at::Tensor& uniform, double temperature, int64_t top_k,
                     double top_p, double min_p, at::Tensor& accepted, at::Tensor& accept_len,
                     at::Tensor& next_token);

// ---- commit: make the accepted path the new committed state, in place ------------------------
void check_commit_path(const char* op, const at::Tensor& accepted, const at::Tensor& accept_len);
void check_commit_gdn_state(at::TensorList state, at::TensorList stash_u, at::TensorList stash_k,
                            at::TensorList stash_cumg, const at::Tensor& accepted, const at::Tensor& accept_len);
void commit_gdn_state_cpu(at::TensorList state, at::TensorList stash_u, at::TensorList stash_k,
                          at::TensorList stash_cumg, const at::Tensor& accepted, const at::Tensor& accept_len);
void check_commit_conv_state(at::TensorList conv_state, at::TensorList x, const at::Tensor& accepted,
                             const at::Tensor& accept_len);
void commit_conv_state_cpu(at::TensorList conv_state, at::TensorList x, const at::Tensor& accepted,
                           const at::Tensor& accept_len);
void check_commit_kv(at::TensorList cache, const at::Tensor& prefix_len, const at::Tensor& accepted,
                     const at::Tensor& accept_len);
void commit_kv_cpu(at::TensorList cache, const at::Tensor& prefix_len, const at::Tensor& accepted,
                   const at::Tensor& accept_len);
void check_store_kv(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& slots,
                    const at::Tensor& key_states, const at::Tensor& value_states);
void check_slots_below(const char* op, const at::Tensor& slots, int64_t num_slots);
void store_kv_cpu(at::Tensor& keys, at::Tensor& values, const at::Tensor& slots, const at::Tensor& key_states,
                  const at::Tensor& value_states);
void check_gather_rows(const at::Tensor& src, const at::Tensor& accepted, const at::Tensor& accept_len,
                       const at::Tensor& out);
void gather_rows_cpu(const at::Tensor& src, const at::Tensor& accepted, const at::Tensor& accept_len,
                     at::Tensor& out);

// ---- CUDA implementations (CUDA builds only; csrc/*_cuda.cu). Same signatures and semantics as the
// CPU ops; each calls the check_* function above, then checks that every tensor is on one CUDA device.
void topk_logprobs_cuda(const at::Tensor& logits, at::Tensor& logp, at::Tensor& tokens);
void build_tree_cuda(const at::Tensor& logp, const at::Tensor& tokens, const at::Tensor& root_token,
                     const at::Tensor& prefix_len, int64_t budget, bool spine, at::Tensor& node_token,
                     at::Tensor& parent, at::Tensor& depth, at::Tensor& num_nodes, at::Tensor& first_child,
                     at::Tensor& next_sibling, at::Tensor& ancestor_mask, at::Tensor& position);
void tree_attention_mask_cuda(const at::Tensor& ancestor_mask, const at::Tensor& prefix_len, at::Tensor& mask);
void tree_conv1d_cuda(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                      const at::Tensor& conv_state, const at::Tensor& parent, bool silu, at::Tensor& out);
void gdn_conv_delta_rule_cuda(const at::Tensor& x, const at::Tensor& conv_weight,
                              const c10::optional<at::Tensor>& conv_bias, const at::Tensor& conv_state,
                              const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                              const at::Tensor& parent, int64_t heads, int64_t kdim, double scale, bool use_qk_l2norm,
                              at::Tensor& out, at::Tensor& stash_u, at::Tensor& stash_k, at::Tensor& stash_cumg);
void tree_gated_delta_rule_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                const at::Tensor& beta, const at::Tensor& state, const at::Tensor& parent,
                                double scale, bool use_qk_l2norm, at::Tensor& out, at::Tensor& stash_u,
                                at::Tensor& stash_k, at::Tensor& stash_cumg);
void rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& gate, double eps,
                   bool zero_centered, at::Tensor& out);
void add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                       bool zero_centered, at::Tensor& out, at::Tensor& residual_out);
void silu_mul_cuda(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out);
void rope_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out);
void qk_norm_rope_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight, const at::Tensor& k_weight,
                       const at::Tensor& cos, const at::Tensor& sin, double eps, bool zero_centered, at::Tensor& q_out,
                       at::Tensor& k_out);
void qk_norm_rope_store_kv_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& q_weight, const at::Tensor& k_weight, const at::Tensor& cos,
                                const at::Tensor& sin, double eps, bool zero_centered, const at::Tensor& slots,
                                at::Tensor& q_out, at::Tensor& keys, at::Tensor& values);
void sigmoid_mul_cuda(const at::Tensor& gate, const at::Tensor& x, at::Tensor& out);
void linear_cuda(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, bool prefetch_weight);
void linear_gemv_cuda(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, bool prefetch_weight);
int64_t linear_cublaslt_algorithms_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out);
std::string linear_cublaslt_describe_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out,
                                          int64_t algorithm);
void linear_cublaslt_cuda(const at::Tensor& x, const at::Tensor& weight, int64_t algorithm, at::Tensor& out);
void gqa_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                        double scale, at::Tensor& out, int64_t num_splits);
void gdn_gates_cuda(const at::Tensor& x, const at::Tensor& weight_a, const at::Tensor& weight_b, const at::Tensor& A_log,
                    const at::Tensor& dt_bias, at::Tensor& g, at::Tensor& beta);
void moe_experts_cuda(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& expert_weights,
                      const at::Tensor& gate_up_proj, const at::Tensor& down_proj,
                      const c10::optional<at::Tensor>& shared, const c10::optional<at::Tensor>& shared_gate,
                      at::Tensor& routing, at::Tensor& hidden, at::Tensor& expert_out, at::Tensor& out);
void moe_router_cuda(const at::Tensor& logits, int64_t top_k, bool renormalize, at::Tensor& weights, at::Tensor& ids);
void penalize_logits_cuda(const at::Tensor& logits, const at::Tensor& node_token, const at::Tensor& parent,
                          const c10::optional<at::Tensor>& seen, const c10::optional<at::Tensor>& counts,
                          double repetition_penalty, double presence_penalty, double frequency_penalty,
                          int64_t max_depth, at::Tensor& out);
void row_argmax_cuda(const at::Tensor& x, at::Tensor& out);
void walk_greedy_cuda(const at::Tensor& node_token, const at::Tensor& first_child, const at::Tensor& next_sibling,
                      const at::Tensor& target_token, at::Tensor& accepted, at::Tensor& accept_len,
                      at::Tensor& next_token);
void walk_sample_cuda(const at::Tensor& node_token, const at::Tensor& first_child, const at::Tensor& next_sibling,
                      const at::Tensor& logits, const at::Tensor& uniform, double temperature, int64_t top_k,
                      double top_p, double min_p, at::Tensor& accepted, at::Tensor& accept_len,
                      at::Tensor& next_token);
void commit_gdn_state_cuda(at::TensorList state, at::TensorList stash_u, at::TensorList stash_k,
                           at::TensorList stash_cumg, const at::Tensor& accepted, const at::Tensor& accept_len);
void commit_conv_state_cuda(at::TensorList conv_state, at::TensorList x, const at::Tensor& accepted,
                            const at::Tensor& accept_len);
void commit_kv_cuda(at::TensorList cache, const at::Tensor& prefix_len, const at::Tensor& accepted,
                    const at::Tensor& accept_len);
void store_kv_cuda(at::Tensor& keys, at::Tensor& values, const at::Tensor& slots, const at::Tensor& key_states,
                   const at::Tensor& value_states);
void gather_rows_cuda(const at::Tensor& src, const at::Tensor& accepted, const at::Tensor& accept_len,
                      at::Tensor& out);

}  // namespace ddtree
