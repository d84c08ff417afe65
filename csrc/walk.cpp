// Walk: follow the target's tokens from the root down the draft tree and report the accepted path.
// Greedy follows the target's argmax; sampling draws the target's token at each visited node by the
// rule of reference.sample_token. The check_* functions are metadata-only and shared with the CUDA
// implementations; the CPU implementations add value checks (tree links, uniforms) before writing.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "checks.h"
#include "min_p.h"
#include "ops.h"

namespace ddtree {

void check_walk(const char* op, const at::Tensor& node_token, const at::Tensor& first_child,
                const at::Tensor& next_sibling, const at::Tensor& accepted, const at::Tensor& accept_len,
                const at::Tensor& next_token) {
  DDTREE_CHECK_DIM(op, node_token, 2);
  DDTREE_CHECK_DTYPE(op, node_token, at::kLong);
  const int64_t batch = node_token.size(0), num_nodes = node_token.size(1);
  DDTREE_CHECK(op, num_nodes >= 1, "node_token must hold at least the root, got shape ",
               shape_str(node_token.sizes()));
  DDTREE_CHECK_DTYPE(op, first_child, at::kInt);
  DDTREE_CHECK_SHAPE(op, first_child, {batch, num_nodes});
  DDTREE_CHECK_DTYPE(op, next_sibling, at::kInt);
  DDTREE_CHECK_SHAPE(op, next_sibling, {batch, num_nodes});
  DDTREE_CHECK_DTYPE(op, accepted, at::kInt);
  DDTREE_CHECK_DIM(op, accepted, 2);
  DDTREE_CHECK(op, accepted.size(0) == batch && accepted.size(1) >= 1, "accepted must have shape [", batch,
               ", D] with D >= 1, got ", shape_str(accepted.sizes()));
  DDTREE_CHECK_DTYPE(op, accept_len, at::kInt);
  DDTREE_CHECK_SHAPE(op, accept_len, {batch});
  DDTREE_CHECK_DTYPE(op, next_token, at::kLong);
  DDTREE_CHECK_SHAPE(op, next_token, {batch});
  DDTREE_CHECK_SAME_DEVICE(op, node_token, first_child);
  DDTREE_CHECK_SAME_DEVICE(op, node_token, next_sibling);
  DDTREE_CHECK_SAME_DEVICE(op, node_token, accepted);
  DDTREE_CHECK_SAME_DEVICE(op, node_token, accept_len);
  DDTREE_CHECK_SAME_DEVICE(op, node_token, next_token);
  DDTREE_CHECK_CONTIGUOUS(op, node_token);
  DDTREE_CHECK_CONTIGUOUS(op, first_child);
  DDTREE_CHECK_CONTIGUOUS(op, next_sibling);
  DDTREE_CHECK_CONTIGUOUS(op, accepted);
  DDTREE_CHECK_CONTIGUOUS(op, accept_len);
  DDTREE_CHECK_CONTIGUOUS(op, next_token);
  // The walk writes its outputs while it still reads the tree (on CUDA, other blocks' trees too).
  check_outputs_apart(op, {{"accepted", &accepted}, {"accept_len", &accept_len}, {"next_token", &next_token},
                           {"node_token", &node_token}, {"first_child", &first_child},
                           {"next_sibling", &next_sibling}},
                      3);
}

void check_row_argmax(const at::Tensor& x, const at::Tensor& out) {
  constexpr const char* op = "row_argmax";
  DDTREE_CHECK_DIM(op, x, 2);
  DDTREE_CHECK_FLOAT(op, x);
  DDTREE_CHECK(op, x.size(1) >= 1, "x must have at least one column, got shape ", shape_str(x.sizes()));
  DDTREE_CHECK(op, x.size(1) <= std::numeric_limits<int32_t>::max(), "x rows must be shorter than 2^31, got ",
               x.size(1));
  DDTREE_CHECK(op, x.size(0) <= std::numeric_limits<int32_t>::max(), "x must have fewer than 2^31 rows, got ",
               x.size(0));
  DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, x);
  DDTREE_CHECK_DTYPE(op, out, at::kLong);
  DDTREE_CHECK_SHAPE(op, out, {x.size(0)});
  DDTREE_CHECK_CONTIGUOUS(op, out);
  DDTREE_CHECK_SAME_DEVICE(op, x, out);
}

// torch.argmax's own rule (the first maximum; a NaN above every number, the first NaN): the reference.
void row_argmax_cpu(const at::Tensor& x, at::Tensor& out) {
  check_row_argmax(x, out);
  out.copy_(x.argmax(-1));
}

void check_walk_greedy(const at::Tensor& node_token, const at::Tensor& target_token, const at::Tensor& accepted,
                       const at::Tensor& accept_len, const at::Tensor& next_token) {
  constexpr const char* op = "walk_greedy";
  DDTREE_CHECK_DTYPE(op, target_token, at::kLong);
  DDTREE_CHECK_SHAPE(op, target_token, {node_token.size(0), node_token.size(1)});
  DDTREE_CHECK_SAME_DEVICE(op, node_token, target_token);
  DDTREE_CHECK_CONTIGUOUS(op, target_token);
  check_outputs_apart(op, {{"accepted", &accepted}, {"accept_len", &accept_len}, {"next_token", &next_token},
                           {"target_token", &target_token}},
                      3);
}

void check_walk_sample(const at::Tensor& node_token, const at::Tensor& logits, const at::Tensor& uniform,
                       double temperature, int64_t top_k, double top_p, double min_p, const at::Tensor& accepted) {
  constexpr const char* op = "walk_sample";
  const int64_t batch = node_token.size(0), num_nodes = node_token.size(1);
  DDTREE_CHECK_FLOAT(op, logits);
  DDTREE_CHECK_DIM(op, logits, 3);
  DDTREE_CHECK(op, logits.size(0) == batch && logits.size(1) == num_nodes && logits.size(2) >= 1,
               "logits must have shape [", batch, ", ", num_nodes, ", V] with V >= 1, got ",
               shape_str(logits.sizes()));
  DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, logits);
  DDTREE_CHECK_SAME_DEVICE(op, node_token, logits);
  DDTREE_CHECK_DTYPE(op, uniform, at::kFloat);
  DDTREE_CHECK_SHAPE(op, uniform, {batch, accepted.size(1)});
  DDTREE_CHECK_SAME_DEVICE(op, node_token, uniform);
  DDTREE_CHECK_CONTIGUOUS(op, uniform);
  DDTREE_CHECK(op, std::isfinite(temperature) && temperature > 0, "temperature must be finite and > 0, got ",
               temperature);
  // The logits are divided by it in float32: a temperature that is zero or subnormal there is not one.
  DDTREE_CHECK(op, static_cast<float>(temperature) >= std::numeric_limits<float>::min(),
               "temperature must be at least float32's smallest normal number (", std::numeric_limits<float>::min(),
               "), got ", temperature);
  DDTREE_CHECK(op, top_k >= 0, "top_k must be >= 0 (0 = off), got ", top_k);
  DDTREE_CHECK(op, top_p > 0 && top_p <= 1, "top_p must be in (0, 1] (1 = off), got ", top_p);
  DDTREE_CHECK(op, min_p >= 0 && min_p <= 1, "min_p must be in [0, 1] (0 = off), got ", min_p);
}

float min_p_offset(double min_p) {
  return min_p > 0 ? static_cast<float>(std::log(min_p)) : -std::numeric_limits<float>::infinity();
}

namespace {

// Child links must point forward, to a larger index inside the row: the walk then visits strictly
// increasing node indices, so it stays in bounds and cannot loop.
void check_forward_links_cpu(const char* op, const char* name, const at::Tensor& link) {
  const int64_t batch = link.size(0), num_nodes = link.size(1);
  const int32_t* data = link.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < num_nodes; ++i) {
      const int64_t to = data[b * num_nodes + i];
      DDTREE_CHECK(op, to == -1 || (to > i && to < num_nodes), name, "[", b, ", ", i,
                   "] must be -1 or a node index in (", i, ", ", num_nodes, "), got ", to);
    }
  }
}

void check_uniform_values_cpu(const at::Tensor& uniform) {
  const float* data = uniform.data_ptr<float>();
  const int64_t depths = uniform.size(1);
  for (int64_t e = 0; e < uniform.numel(); ++e) {
    DDTREE_CHECK("walk_sample", data[e] >= 0.0f && data[e] < 1.0f, "uniform[", e / depths, ", ", e % depths,
                 "] must be in [0, 1), got ", data[e]);
  }
}

// Raw views of one batch of trees and of the walk's outputs.
struct TreeRows {
  const int64_t* token;
  const int32_t* first_child;
  const int32_t* next_sibling;
  int64_t num_nodes;
};

struct WalkRows {
  int32_t* accepted;
  int32_t* accept_len;
  int64_t* next_token;
  int64_t max_accept;
};

TreeRows tree_rows(const at::Tensor& node_token, const at::Tensor& first_child, const at::Tensor& next_sibling) {
  return {node_token.data_ptr<int64_t>(), first_child.data_ptr<int32_t>(), next_sibling.data_ptr<int32_t>(),
          node_token.size(1)};
}

WalkRows walk_rows(at::Tensor& accepted, at::Tensor& accept_len, at::Tensor& next_token) {
  return {accepted.data_ptr<int32_t>(), accept_len.data_ptr<int32_t>(), next_token.data_ptr<int64_t>(),
          accepted.size(1)};
}

// Walks row b from the root: record the node, take the target's token t there (token_at(node, d) for
// the d-th node of the path), move to the first child (by index) carrying t, stop when none does or
// the path holds max_accept nodes. t at the last node is the bonus token.
template <typename TokenAt>
void walk_row(const TreeRows& tree, int64_t b, TokenAt&& token_at, const WalkRows& out) {
  const int64_t row = b * tree.num_nodes;
  int32_t* accepted = out.accepted + b * out.max_accept;
  int64_t node = 0, len = 0, token = 0;
  for (;;) {
    accepted[len] = static_cast<int32_t>(node);
    token = token_at(node, len);
    ++len;
    if (len == out.max_accept) break;
    int64_t child = tree.first_child[row + node];
    while (child >= 0 && tree.token[row + child] != token) child = tree.next_sibling[row + child];
    if (child < 0) break;
    node = child;
  }
  std::fill(accepted + len, accepted + out.max_accept, -1);
  out.accept_len[b] = static_cast<int32_t>(len);
  out.next_token[b] = token;
}

// Draws one token per call from a row of logits by the rule of reference.sample_token:
// x = float32(logits) / temperature; top_k keeps every x at or above the k-th largest (all its ties, as
// HF's warper does); top_p ranks those by x descending and keeps a token when the mass ranked strictly
// above its value is below top_p of theirs (a tied group stays or goes whole); min_p then keeps x >= min_p_cut
// (HF's warper: probability at least min_p times the largest); draw by inverse CDF over
// the kept tokens in ascending id order. All three cuts are thresholds on x. Without filters that is a few
// streaming passes; the filters need only selections (nth_element, a mass-weighted quickselect), never a
// sort of the vocabulary. One sampler per thread: it owns the scratch rows.
template <typename scalar_t>
class TokenSampler {
 public:
  TokenSampler(int64_t vocab, double temperature, int64_t top_k, double top_p, double min_p)
      : vocab_(vocab),
        temperature_(static_cast<float>(temperature)),
        top_k_count_(top_k > 0 && top_k < vocab ? top_k : vocab),
        top_p_(top_p),
        min_p_offset_(min_p_offset(min_p)),
        scaled_(vocab),
        weight_(vocab) {}

  int64_t operator()(const scalar_t* logits, float u) {
    float max_x = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < vocab_; ++i) {
      scaled_[i] = static_cast<float>(logits[i]) / temperature_;
      max_x = std::max(max_x, scaled_[i]);
    }
    for (int64_t i = 0; i < vocab_; ++i) weight_[i] = std::exp(scaled_[i] - max_x);
    const bool min_p_on = min_p_offset_ > -std::numeric_limits<float>::infinity();
    const bool filtered = top_k_count_ < vocab_ || top_p_ < 1.0 || min_p_on;
    const int64_t last_kept = filtered ? drop_filtered(max_x) : vocab_ - 1;
    // The total and the scan add the same terms in the same order, so for u < 1 the scan always hits.
    double total = 0;
    for (int64_t i = 0; i < vocab_; ++i) total += weight_[i];
    const double threshold = static_cast<double>(u) * total;
    double cum = 0;
    for (int64_t i = 0; i < vocab_; ++i) {
      cum += weight_[i];
      if (cum > threshold) return i;
    }
    return last_kept;  // only with non-finite logits
  }

 private:
  struct Ranked {
    float x;
    int32_t id;
  };

  // x descending, a NaN above every number (as torch.topk ranks it): with the id as the tie-break, a
  // strict total order even with NaNs, which the selections below need.
  static bool greater(float a, float b) { return std::isnan(a) ? !std::isnan(b) : a > b; }
  static bool ranks_above(const Ranked& a, const Ranked& b) {
    return greater(a.x, b.x) || (!greater(b.x, a.x) && a.id < b.id);
  }

  // Zeroes the weight of every token top_k, top_p or min_p drops; returns the largest kept id. The kept set is
  // every x not below a cut value, so selections find it.
  int64_t drop_filtered(float max_x) {
    float cut = -std::numeric_limits<float>::infinity();
    if (top_k_count_ < vocab_ || top_p_ < 1.0) {  // selections over the ranked row (min_p needs only max_x)
      ranked_.resize(vocab_);
      for (int64_t i = 0; i < vocab_; ++i) ranked_[i] = {scaled_[i], static_cast<int32_t>(i)};
      const auto first = ranked_.begin();
      auto last = ranked_.end();
      if (top_k_count_ < vocab_) {
        // The k-th largest x; the top_k set is every token not below it, its whole tie group included.
        std::nth_element(first, first + (top_k_count_ - 1), last, ranks_above);
        cut = first[top_k_count_ - 1].x;
        last = std::partition(first + top_k_count_, last, [cut](const Ranked& r) { return !greater(cut, r.x); });
      }
      // The last token top_p keeps in rank order; its value keeps its ties too.
      if (top_p_ < 1.0) cut = top_p_cut(first, last).x;
    }
    cut = apply_min_p(cut, max_x, min_p_offset_);  // the CUDA kernels' rule
    int64_t last_kept = -1;
    for (int64_t i = 0; i < vocab_; ++i) {
      if (greater(cut, scaled_[i])) {
        weight_[i] = 0.0f;
      } else {
        last_kept = i;
      }
    }
    return last_kept;
  }

  // The last token top_p keeps among [first, last) (the top_k set): the first, in rank order, whose mass
  // together with everything ranked above it reaches top_p of the set's mass. Its value does not depend
  // on how ties are ranked. A quickselect that descends by mass instead of by rank: expected linear time.
  Ranked top_p_cut(typename std::vector<Ranked>::iterator first, typename std::vector<Ranked>::iterator last) {
    double mass = 0;
    for (auto it = first; it != last; ++it) mass += weight_[it->id];
    const double target = top_p_ * mass;
    double above = 0;  // mass of the tokens ranked above [first, last)
    while (last - first > 1) {
      std::iter_swap(first + (last - first) / 2, last - 1);
      const Ranked pivot = last[-1];
      const auto mid = std::partition(first, last - 1, [&](const Ranked& r) { return ranks_above(r, pivot); });
      std::iter_swap(mid, last - 1);  // [first, mid) ranks above the pivot, now at mid; (mid, last) below
      double upper = 0;
      for (auto it = first; it != mid; ++it) upper += weight_[it->id];
      if (above + upper >= target) {
        last = mid;
        continue;
      }
      above += upper + weight_[pivot.id];
      if (above >= target) return pivot;
      first = mid + 1;
    }
    // One token left is the cut; none left means rounding kept the mass short of the target, and the
    // last pivot, the lowest-ranked token of the set, is the cut.
    return first < last ? *first : first[-1];
  }

  int64_t vocab_;
  float temperature_;
  int64_t top_k_count_;
  double top_p_;
  float min_p_offset_;  // -inf: min_p off
  std::vector<float> scaled_;  // x = logits / temperature
  std::vector<float> weight_;  // exp(x - max x), zero where dropped
  std::vector<Ranked> ranked_;
};

}  // namespace

void walk_greedy_cpu(const at::Tensor& node_token, const at::Tensor& first_child, const at::Tensor& next_sibling,
                     const at::Tensor& target_token, at::Tensor& accepted, at::Tensor& accept_len,
                     at::Tensor& next_token) {
  check_walk("walk_greedy", node_token, first_child, next_sibling, accepted, accept_len, next_token);
  check_walk_greedy(node_token, target_token, accepted, accept_len, next_token);
  check_forward_links_cpu("walk_greedy", "first_child", first_child);
  check_forward_links_cpu("walk_greedy", "next_sibling", next_sibling);

  const TreeRows tree = tree_rows(node_token, first_child, next_sibling);
  const WalkRows out = walk_rows(accepted, accept_len, next_token);
  const int64_t* target = target_token.data_ptr<int64_t>();
  for (int64_t b = 0; b < node_token.size(0); ++b) {
    const int64_t* row_target = target + b * tree.num_nodes;
    walk_row(tree, b, [row_target](int64_t node, int64_t) { return row_target[node]; }, out);
  }
}

void walk_sample_cpu(const at::Tensor& node_token, const at::Tensor& first_child, const at::Tensor& next_sibling,
                     const at::Tensor& logits, const at::Tensor& uniform, double temperature, int64_t top_k,
                     double top_p, double min_p, at::Tensor& accepted, at::Tensor& accept_len,
                     at::Tensor& next_token) {
  check_walk("walk_sample", node_token, first_child, next_sibling, accepted, accept_len, next_token);
  check_walk_sample(node_token, logits, uniform, temperature, top_k, top_p, min_p, accepted);
  check_forward_links_cpu("walk_sample", "first_child", first_child);
  check_forward_links_cpu("walk_sample", "next_sibling", next_sibling);
  check_uniform_values_cpu(uniform);

  const TreeRows tree = tree_rows(node_token, first_child, next_sibling);
  const WalkRows out = walk_rows(accepted, accept_len, next_token);
  const float* uniform_data = uniform.data_ptr<float>();
  const int64_t vocab = logits.size(2), stride_b = logits.stride(0), stride_n = logits.stride(1);
  DDTREE_DISPATCH_FLOAT(logits.scalar_type(), "walk_sample", [&] {
    const scalar_t* logits_data = logits.const_data_ptr<scalar_t>();
    at::parallel_for(0, node_token.size(0), 1, [&](int64_t begin, int64_t end) {
      TokenSampler<scalar_t> sample(vocab, temperature, top_k, top_p, min_p);
      for (int64_t b = begin; b < end; ++b) {
        const float* row_uniform = uniform_data + b * out.max_accept;
        const scalar_t* row_logits = logits_data + b * stride_b;
        walk_row(
            tree, b,
            [&](int64_t node, int64_t d) { return sample(row_logits + node * stride_n, row_uniform[d]); }, out);
      }
    });
  });
}

}  // namespace ddtree
