// Moe: the routed experts of a sparse MoE block (Qwen3.5 / Qwen3.6 MoE), given the router's choice: token t goes
// through its K experts e = expert_ids[t, k], each a SwiGLU MLP, and their outputs are summed with the routing
// weights. With the rounding points of Hugging Face's default "grouped_mm" experts forward (T the activation dtype,
// round() a rounding to T, float32 between):
//
//   gate_up[p] = round(W_gu[e] x[t])                         [2I]   (p = t * K + k, the pair's index)
//   hidden[p]  = round(round(silu(gate_up[p][:I])) * gate_up[p][I:])  [I]
//   expert_out[p] = round(round(W_d[e] hidden[p]) * w[t, k])  [H]
//   out[t]     = round(sum over k, in order, of expert_out[t * K + k])   (float32 sum)
//
// With the block's shared expert folded in (its output s[t], and optionally its gate's logit g[t], as HF's
// Qwen3_5MoeSparseMoeBlock adds them): out[t] = round(round(sum) + round(round(sigmoid(g[t])) * s[t])), or
// round(round(sum) + s[t]) without a gate.
//
// Every pair's dot products run in a fixed order whatever the other rows are, so a token's output does not depend
// on the batch it came in: a verify block's rows get a decode step's bits. HF's grouped GEMMs sum in another order
// (float32 roundings apart). check_moe_experts is metadata-only and shared with the CUDA implementation; the CPU
// implementation also checks the expert ids before writing.
//
// The router before them (Hugging Face's Qwen3_5MoeTopKRouter after its projection), moe_router: per token,
// p = softmax(logits) in float32, its top-k experts (highest first, ties to the lower id), and their probabilities
// renormalised to sum to 1 (p_k / sum of the k picked, summed in pick order), rounded to the logits' dtype. The
// softmax sums in the order torch's warp softmax does (kRouterLanes lane sums, then a butterfly), so on CUDA the
// probabilities are torch's bits.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "activations.h"
#include "checks.h"
#include "ops.h"

namespace ddtree {

int64_t moe_routing_size(int64_t num_experts, int64_t num_pairs) {
  return 1 + 3 * std::min(num_experts, num_pairs) + num_pairs;
}

void check_moe_experts(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& expert_weights,
                       const at::Tensor& gate_up_proj, const at::Tensor& down_proj,
                       const c10::optional<at::Tensor>& maybe_shared,
                       const c10::optional<at::Tensor>& maybe_shared_gate,
                       const at::Tensor& routing, const at::Tensor& hidden, const at::Tensor& expert_out,
                       const at::Tensor& out) {
  constexpr const char* op = "moe_experts";
  DDTREE_CHECK_FLOAT(op, x);
  DDTREE_CHECK_DIM(op, x, 2);
  DDTREE_CHECK_CONTIGUOUS(op, x);
  const int64_t tokens = x.size(0), hidden_size = x.size(1);
  DDTREE_CHECK(op, hidden_size >= 1, "x must have shape [T, H] with H >= 1, got ", shape_str(x.sizes()));
  DDTREE_CHECK_DTYPE(op, expert_ids, at::kLong);
  DDTREE_CHECK_DIM(op, expert_ids, 2);
  DDTREE_CHECK(op, expert_ids.size(0) == tokens && expert_ids.size(1) >= 1,
               "expert_ids must have shape [T, K] = [", tokens, ", K] with K >= 1, got ",
               shape_str(expert_ids.sizes()));
  DDTREE_CHECK_CONTIGUOUS(op, expert_ids);
  DDTREE_CHECK_SAME_DEVICE(op, x, expert_ids);
  const int64_t top_k = expert_ids.size(1), pairs = tokens * top_k;
  DDTREE_CHECK(op, pairs <= std::numeric_limits<int32_t>::max(), "T * K must be below 2^31, got ", pairs);
  DDTREE_CHECK_DTYPE(op, expert_weights, x.scalar_type());
  DDTREE_CHECK_SHAPE(op, expert_weights, {tokens, top_k});
  DDTREE_CHECK_CONTIGUOUS(op, expert_weights);
  DDTREE_CHECK_SAME_DEVICE(op, x, expert_weights);
  DDTREE_CHECK_DTYPE(op, gate_up_proj, x.scalar_type());
  DDTREE_CHECK_DIM(op, gate_up_proj, 3);
  const int64_t experts = gate_up_proj.size(0), inter2 = gate_up_proj.size(1);
  DDTREE_CHECK(op, experts >= 1 && inter2 >= 2 && inter2 % 2 == 0 && gate_up_proj.size(2) == hidden_size,
               "gate_up_proj must have shape [E, 2 I, H] = [E, 2 I, ", hidden_size,
               "] with E >= 1, I >= 1 (gate rows, then up rows), got ", shape_str(gate_up_proj.sizes()));
  DDTREE_CHECK(op, experts <= std::numeric_limits<int32_t>::max(), "gate_up_proj must have fewer than 2^31 experts");
  DDTREE_CHECK_CONTIGUOUS(op, gate_up_proj);
  DDTREE_CHECK_SAME_DEVICE(op, x, gate_up_proj);
  const int64_t inter = inter2 / 2;
  DDTREE_CHECK_DTYPE(op, down_proj, x.scalar_type());
  DDTREE_CHECK_SHAPE(op, down_proj, {experts, hidden_size, inter});
  DDTREE_CHECK_CONTIGUOUS(op, down_proj);
  DDTREE_CHECK_SAME_DEVICE(op, x, down_proj);
  if (maybe_shared.has_value()) {
    const at::Tensor& shared = *maybe_shared;
    DDTREE_CHECK_DTYPE(op, shared, x.scalar_type());
    DDTREE_CHECK_SHAPE(op, shared, {tokens, hidden_size});
    DDTREE_CHECK_CONTIGUOUS(op, shared);
    DDTREE_CHECK_SAME_DEVICE(op, x, shared);
  }
  if (maybe_shared_gate.has_value()) {
    const at::Tensor& shared_gate = *maybe_shared_gate;
    DDTREE_CHECK(op, maybe_shared.has_value(), "shared_gate needs shared (the shared expert's output it gates)");
    DDTREE_CHECK_DTYPE(op, shared_gate, x.scalar_type());
    DDTREE_CHECK_SHAPE(op, shared_gate, {tokens, 1});
    DDTREE_CHECK_SAME_DEVICE(op, x, shared_gate);
  }
  DDTREE_CHECK_DTYPE(op, routing, at::kInt);
  DDTREE_CHECK_SHAPE(op, routing, {moe_routing_size(experts, pairs)});
  DDTREE_CHECK_CONTIGUOUS(op, routing);
  DDTREE_CHECK_SAME_DEVICE(op, x, routing);
  DDTREE_CHECK_DTYPE(op, hidden, x.scalar_type());
  DDTREE_CHECK_SHAPE(op, hidden, {pairs, inter});
  DDTREE_CHECK_CONTIGUOUS(op, hidden);
  DDTREE_CHECK_SAME_DEVICE(op, x, hidden);
  DDTREE_CHECK_DTYPE(op, expert_out, x.scalar_type());
  DDTREE_CHECK_SHAPE(op, expert_out, {pairs, hidden_size});
  DDTREE_CHECK_CONTIGUOUS(op, expert_out);
  DDTREE_CHECK_SAME_DEVICE(op, x, expert_out);
  DDTREE_CHECK_DTYPE(op, out, x.scalar_type());
  DDTREE_CHECK_SHAPE(op, out, {tokens, hidden_size});
  DDTREE_CHECK_CONTIGUOUS(op, out);
  DDTREE_CHECK_SAME_DEVICE(op, x, out);
  // The shared expert's rows are read last, by the combine: no output written before may overlap them.
  for (const auto& [name, input] : {std::pair<const char*, const c10::optional<at::Tensor>*>{"shared", &maybe_shared},
                                    {"shared_gate", &maybe_shared_gate}}) {
    if (!input->has_value()) continue;
    for (const auto& [written, t] : {std::pair<const char*, const at::Tensor*>{"routing", &routing},
                                     {"hidden", &hidden}, {"expert_out", &expert_out}, {"out", &out}}) {
      DDTREE_CHECK(op, !may_overlap(**input, *t), written, " must not share memory with ", name);
    }
  }
  check_outputs_apart(op,
                      {{"routing", &routing}, {"hidden", &hidden}, {"expert_out", &expert_out}, {"out", &out},
                       {"x", &x}, {"expert_ids", &expert_ids}, {"expert_weights", &expert_weights},
                       {"gate_up_proj", &gate_up_proj}, {"down_proj", &down_proj}},
                      4);
}

void check_moe_router(const at::Tensor& logits, int64_t top_k, const at::Tensor& weights, const at::Tensor& ids) {
  constexpr const char* op = "moe_router";
  DDTREE_CHECK_FLOAT(op, logits);
  DDTREE_CHECK_DIM(op, logits, 2);
  DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, logits);
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  DDTREE_CHECK(op, experts >= 1 && experts <= std::numeric_limits<int32_t>::max(),
               "logits must have shape [T, E] with 1 <= E < 2^31, got ", shape_str(logits.sizes()));
  DDTREE_CHECK(op, top_k >= 1 && top_k <= experts, "top_k must be in [1, E] = [1, ", experts, "], got ", top_k);
  DDTREE_CHECK_DTYPE(op, weights, logits.scalar_type());
  DDTREE_CHECK_SHAPE(op, weights, {tokens, top_k});
  DDTREE_CHECK_CONTIGUOUS(op, weights);
  DDTREE_CHECK_SAME_DEVICE(op, logits, weights);
  DDTREE_CHECK_DTYPE(op, ids, at::kLong);
  DDTREE_CHECK_SHAPE(op, ids, {tokens, top_k});
  DDTREE_CHECK_CONTIGUOUS(op, ids);
  DDTREE_CHECK_SAME_DEVICE(op, logits, ids);
  check_outputs_apart(op, {{"weights", &weights}, {"ids", &ids}, {"logits", &logits}}, 2);
}

void moe_router_cpu(const at::Tensor& logits, int64_t top_k, bool renormalize, at::Tensor& weights, at::Tensor& ids) {
  constexpr const char* op = "moe_router";
  check_moe_router(logits, top_k, weights, ids);
  const int64_t tokens = logits.size(0), experts = logits.size(1), row_stride = logits.stride(0);
  DDTREE_DISPATCH_FLOAT(logits.scalar_type(), op, [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    scalar_t* w = weights.data_ptr<scalar_t>();
    int64_t* picked = ids.data_ptr<int64_t>();
    at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> p(experts);
      std::vector<char> taken(experts);
      std::vector<float> top(top_k);
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* row = x + t * row_stride;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t e = 0; e < experts; ++e) m = std::max(m, static_cast<float>(row[e]));
        // The CUDA kernel's sum order: lane l of a warp adds elements l, l + 32, ... in turn, then the lanes'
        // sums meet in a butterfly (xor 16, 8, 4, 2, 1), as torch's warp softmax sums.
        float lane_sum[kRouterLanes] = {};
        for (int64_t e = 0; e < experts; ++e) {
          p[e] = std::exp(static_cast<float>(row[e]) - m);
          lane_sum[e % kRouterLanes] += p[e];
        }
        for (int off = kRouterLanes / 2; off > 0; off /= 2) {
          float next[kRouterLanes];
          for (int l = 0; l < kRouterLanes; ++l) next[l] = lane_sum[l] + lane_sum[l ^ off];
          std::copy(next, next + kRouterLanes, lane_sum);
        }
        for (int64_t e = 0; e < experts; ++e) p[e] /= lane_sum[0];
        // Top-k by probability, ties to the lower expert id, highest first.
        std::fill(taken.begin(), taken.end(), 0);
        float total = 0.f;
        for (int64_t k = 0; k < top_k; ++k) {
          int64_t best = -1;
          for (int64_t e = 0; e < experts; ++e) {
            // NaN above every number, as torch.topk and the CUDA kernel's keys order it.
            if (!taken[e] && (best < 0 || (std::isnan(p[e]) && !std::isnan(p[best])) || p[e] > p[best])) best = e;
          }
          taken[best] = 1;
          top[k] = p[best];
          total += p[best];
          picked[t * top_k + k] = best;
        }
        for (int64_t k = 0; k < top_k; ++k) {
          w[t * top_k + k] = static_cast<scalar_t>(renormalize ? top[k] / total : top[k]);
        }
      }
    });
  });
}

namespace {

// sum_i a[i] * b[i] in float32 in a fixed order, whatever the other rows: eight partial sums over i mod 8 (which the
// compiler can keep in one vector register), added pairwise at the end.
template <typename T>
float dot(const T* a, const T* b, int64_t n) {
  constexpr int kLanes = 8;
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) part[l] += static_cast<float>(a[i + l]) * static_cast<float>(b[i + l]);
  }
  for (int l = 0; i < n; ++i, ++l) part[l] += static_cast<float>(a[i]) * static_cast<float>(b[i]);
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) part[l] += part[l + width];
  }
  return part[0];
}

}  // namespace

void moe_experts_cpu(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& expert_weights,
                     const at::Tensor& gate_up_proj, const at::Tensor& down_proj,
                     const c10::optional<at::Tensor>& shared, const c10::optional<at::Tensor>& shared_gate,
                     at::Tensor& routing, at::Tensor& hidden, at::Tensor& expert_out, at::Tensor& out) {
  constexpr const char* op = "moe_experts";
  check_moe_experts(x, expert_ids, expert_weights, gate_up_proj, down_proj, shared, shared_gate, routing, hidden,
                    expert_out, out);
  const int64_t tokens = x.size(0), hidden_size = x.size(1), top_k = expert_ids.size(1);
  const int64_t experts = gate_up_proj.size(0), inter = down_proj.size(2), pairs = tokens * top_k;
  const int64_t* ids = expert_ids.data_ptr<int64_t>();
  for (int64_t p = 0; p < pairs; ++p) {
    DDTREE_CHECK(op, ids[p] >= 0 && ids[p] < experts, "expert_ids[", p / top_k, ", ", p % top_k,
                 "] must be an expert in [0, ", experts, "), got ", ids[p]);
  }
  DDTREE_DISPATCH_FLOAT(x.scalar_type(), op, [&] {
    const scalar_t* xs = x.data_ptr<scalar_t>();
    const scalar_t* weights = expert_weights.data_ptr<scalar_t>();
    const scalar_t* w_gate_up = gate_up_proj.data_ptr<scalar_t>();
    const scalar_t* w_down = down_proj.data_ptr<scalar_t>();
    scalar_t* mid = hidden.data_ptr<scalar_t>();
    scalar_t* per_pair = expert_out.data_ptr<scalar_t>();
    at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const scalar_t* xr = xs + (p / top_k) * hidden_size;
        const scalar_t* gate = w_gate_up + ids[p] * 2 * inter * hidden_size;
        const scalar_t* up = gate + inter * hidden_size;
        scalar_t* h = mid + p * inter;
        for (int64_t c = 0; c < inter; ++c) {
          const float g = round_to<scalar_t>(dot(gate + c * hidden_size, xr, hidden_size));
          const float u = round_to<scalar_t>(dot(up + c * hidden_size, xr, hidden_size));
          h[c] = static_cast<scalar_t>(round_to<scalar_t>(silu(g)) * u);
        }
        const scalar_t* down = w_down + ids[p] * hidden_size * inter;
        const float w = static_cast<float>(weights[p]);
        for (int64_t j = 0; j < hidden_size; ++j) {
          per_pair[p * hidden_size + j] = static_cast<scalar_t>(round_to<scalar_t>(dot(down + j * inter, h, inter)) * w);
        }
      }
    });
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* shared_rows = shared.has_value() ? shared->data_ptr<scalar_t>() : nullptr;
    const scalar_t* gate = shared_gate.has_value() ? shared_gate->data_ptr<scalar_t>() : nullptr;
    const int64_t gate_stride = shared_gate.has_value() ? shared_gate->stride(0) : 0;
    at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float scale =
            gate != nullptr ? round_to<scalar_t>(sigmoid(static_cast<float>(gate[t * gate_stride]))) : 1.f;
        for (int64_t j = 0; j < hidden_size; ++j) {
          float sum = 0.f;
          for (int64_t k = 0; k < top_k; ++k) sum += static_cast<float>(per_pair[(t * top_k + k) * hidden_size + j]);
          if (shared_rows != nullptr) {
            const float s = static_cast<float>(shared_rows[t * hidden_size + j]);
            sum = round_to<scalar_t>(sum) + (gate != nullptr ? round_to<scalar_t>(scale * s) : s);
          }
          o[t * hidden_size + j] = static_cast<scalar_t>(sum);
        }
      }
    });
  });
}

}  // namespace ddtree
