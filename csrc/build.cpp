// The build op group on the CPU: per-depth top-K of the draft logits, the best-first DDTree, and the
// verify block's attention mask. The specification of each op is in ddtree_ext/reference.py.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "checks.h"
#include "ops.h"

namespace ddtree {
namespace {

// Binary heap over a caller-owned vector, so a worker reuses one allocation across rows. top() is the
// element that `before` orders ahead of all others. Hand-written rather than std::push_heap because
// the tree build compares float scores, and a NaN score (from a NaN logit) would break the strict weak
// ordering the standard algorithms require; here it only makes the order unspecified.
template <typename T, typename Before>
class Heap {
 public:
  Heap(std::vector<T>& storage, Before before) : items_(storage), before_(before) { items_.clear(); }

  bool empty() const { return items_.empty(); }
  size_t size() const { return items_.size(); }
  const T& top() const { return items_.front(); }

  void push(const T& item) {
    items_.push_back(item);
    size_t i = items_.size() - 1;
    while (i > 0) {
      const size_t up = (i - 1) / 2;
      if (!before_(items_[i], items_[up])) break;
      std::swap(items_[i], items_[up]);
      i = up;
    }
  }

  T pop() {
    T first = items_.front();
    items_.front() = items_.back();
    items_.pop_back();
    sift_down();
    return first;
  }

  void replace_top(const T& item) {
    items_.front() = item;
    sift_down();
  }

 private:
  void sift_down() {
    const size_t n = items_.size();
    size_t i = 0;
    while (true) {
      size_t best = i;
      for (size_t c = 2 * i + 1; c <= 2 * i + 2 && c < n; ++c) {
        if (before_(items_[c], items_[best])) best = c;
      }
      if (best == i) return;
      std::swap(items_[i], items_[best]);
      i = best;
    }
  }

  std::vector<T>& items_;
  Before before_;
};

// ---- topk_logprobs ---------------------------------------------------------------------------

struct Logit {
  float value;
  int64_t token;
};

// The order of torch.sort(descending=True, stable=True): larger logit first, NaN above everything,
// ties by the lower token id. A total order, so the top-K is well defined for any input.
inline bool logit_before(const Logit& a, const Logit& b) {
  const bool a_nan = std::isnan(a.value), b_nan = std::isnan(b.value);
  if (a_nan || b_nan) return a_nan && (!b_nan || a.token < b.token);
  return a.value > b.value || (a.value == b.value && a.token < b.token);
}

inline bool logit_after(const Logit& a, const Logit& b) { return logit_before(b, a); }

// One row: a single pass keeps a running max and the float sum of exp(x - max), rescaled when the
// max grows, next to a heap of the K best logits with the worst on top. The sum is accumulated in
// double so that a 250k-entry vocabulary loses no precision to the order of the additions.
template <typename scalar_t>
void topk_logprobs_row(const scalar_t* logits, int64_t vocab, int64_t k, std::vector<Logit>& storage,
                       float* logp, int64_t logp_stride, int64_t* tokens, int64_t tokens_stride) {
  Heap<Logit, decltype(&logit_after)> worst_first(storage, &logit_after);
  // Starting the max at the lowest finite value (with an empty sum) keeps -inf logits from
  // producing exp(-inf - -inf) = NaN.
  float max = std::numeric_limits<float>::lowest();
  double sum = 0.0;
  for (int64_t v = 0; v < vocab; ++v) {
    const float x = static_cast<float>(logits[v]);
    if (x > max) {
      sum = sum * std::exp(max - x) + 1.0;
      max = x;
    } else {
      sum += std::exp(x - max);
    }
    const Logit candidate{x, v};
    if (static_cast<int64_t>(worst_first.size()) < k) {
      worst_first.push(candidate);
    } else if (logit_before(candidate, worst_first.top())) {
      worst_first.replace_top(candidate);
    }
  }
  // A +inf logit makes log_softmax's sum inf - inf: NaN at every entry. The running sum above only sees that from a
  // second +inf on (the first one restarts it at 1), so it is stated here.
  const float log_sum = max == std::numeric_limits<float>::infinity() ? std::numeric_limits<float>::quiet_NaN()
                                                                      : static_cast<float>(std::log(sum));
  for (int64_t slot = k - 1; slot >= 0; --slot) {
    const Logit best = worst_first.pop();
    logp[slot * logp_stride] = (best.value - max) - log_sum;
    tokens[slot * tokens_stride] = best.token;
  }
}

// ---- build_tree ------------------------------------------------------------------------------

// A child not yet in the tree: the node at `depth` under `parent` choosing the draft's `rank`-th token.
struct Candidate {
  float score;
  int32_t parent;
  int32_t rank;
  int32_t depth;
};

// Best-first order of reference.build_tree: higher score, then lower parent index, then lower rank.
inline bool candidate_before(const Candidate& a, const Candidate& b) {
  if (a.score != b.score) return a.score > b.score;
  if (a.parent != b.parent) return a.parent < b.parent;
  return a.rank < b.rank;
}

// Per-worker scratch reused across rows.
struct TreeScratch {
  std::vector<Candidate> heap;
  std::vector<float> score;
  std::vector<int32_t> last_child;
};

struct TreeOutputs {
  int64_t* token;
  int32_t* parent;
  int32_t* depth;
  int32_t* num_nodes;
  int32_t* first_child;
  int32_t* next_sibling;
  int64_t* ancestor_mask;
  int64_t* position;
};

// Builds row b's tree into the (contiguous) outputs.
void build_tree_row(const at::TensorAccessor<float, 2>& logp, const at::TensorAccessor<int64_t, 2>& tokens,
                    int64_t root_token, int64_t prefix, int64_t budget, bool spine, int64_t b,
                    const TreeOutputs& out, TreeScratch& scratch) {
  const int32_t depths = static_cast<int32_t>(logp.size(0));
  const int32_t k = static_cast<int32_t>(logp.size(1));
  const int64_t n = budget + 1;
  const int64_t words = (n + 63) / 64;
  int64_t* token = out.token + b * n;
  int32_t* parent = out.parent + b * n;
  int32_t* depth = out.depth + b * n;
  int32_t* first_child = out.first_child + b * n;
  int32_t* next_sibling = out.next_sibling + b * n;
  int64_t* ancestors = out.ancestor_mask + b * n * words;
  int64_t* position = out.position + b * n;

  std::vector<float>& score = scratch.score;
  std::vector<int32_t>& last_child = scratch.last_child;
  score.assign(n, 0.0f);
  last_child.assign(n, -1);
  Heap<Candidate, decltype(&candidate_before)> frontier(scratch.heap, &candidate_before);

  auto set_ancestor_bit = [&](int64_t node, int64_t bit) {
    ancestors[node * words + bit / 64] |= static_cast<int64_t>(uint64_t{1} << (bit % 64));
  };
  std::fill(ancestors, ancestors + n * words, int64_t{0});
  token[0] = root_token;
  parent[0] = -1;
  depth[0] = 0;
  first_child[0] = -1;
  next_sibling[0] = -1;
  set_ancestor_bit(0, 0);
  position[0] = prefix;

  int32_t taken = 0;  // real nodes besides the root
  auto take = [&](int32_t p, int32_t d, int32_t r, float s) {
    const int32_t i = ++taken;
    token[i] = tokens[d - 1][r];
    parent[i] = p;
    depth[i] = d;
    first_child[i] = -1;
    next_sibling[i] = -1;
    if (last_child[p] >= 0) {
      next_sibling[last_child[p]] = i;
    } else {
      first_child[p] = i;
    }
    last_child[p] = i;
    std::copy(ancestors + p * words, ancestors + (p + 1) * words, ancestors + i * words);
    set_ancestor_bit(i, i);
    position[i] = prefix + d;
    score[i] = s;
    return i;
  };
  auto push = [&](int32_t p, int32_t d, int32_t r) {
    if (d <= depths && r < k) frontier.push(Candidate{score[p] + logp[d - 1][r], p, r, d});
  };

  if (spine) {
    // The top-1 chain first; each spine node's next sibling seeds the best-first search (the
    // children of spine nodes are the next spine node, already taken).
    int32_t prev = 0;
    const int32_t spine_len = static_cast<int32_t>(std::min<int64_t>(depths, budget));
    for (int32_t d = 1; d <= spine_len; ++d) {
      push(prev, d, 1);
      prev = take(prev, d, 0, score[prev] + logp[d - 1][0]);
    }
  } else {
    push(0, 1, 0);
  }
  while (taken < budget && !frontier.empty()) {
    const Candidate c = frontier.pop();
    const int32_t i = take(c.parent, c.depth, c.rank, c.score);
    push(i, c.depth + 1, 0);              // first child
    push(c.parent, c.depth, c.rank + 1);  // next sibling
  }
  out.num_nodes[b] = taken + 1;

  // Padding: children of the root repeating its token, linked nowhere, so no walk reaches them.
  for (int64_t i = taken + 1; i < n; ++i) {
    token[i] = root_token;
    parent[i] = 0;
    depth[i] = 1;
    first_child[i] = -1;
    next_sibling[i] = -1;
    set_ancestor_bit(i, 0);
    set_ancestor_bit(i, i);
    position[i] = prefix + 1;
  }
}

// ---- tree_attention_mask ---------------------------------------------------------------------

template <typename scalar_t>
void tree_attention_mask_impl(const at::Tensor& ancestor_mask, const at::Tensor& prefix_len, at::Tensor& mask,
                              scalar_t attend, scalar_t blocked) {
  const int64_t batch = mask.size(0), n = mask.size(2), kv_len = mask.size(3);
  const int64_t stride_b = mask.stride(0), stride_i = mask.stride(2), stride_c = mask.stride(3);
  const auto bits = ancestor_mask.accessor<int64_t, 3>();
  const auto prefix = prefix_len.accessor<int64_t, 1>();
  scalar_t* base = mask.data_ptr<scalar_t>();
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(kv_len, 1));
  // Columns [from, to) of one mask row; the contiguous case as a plain fill, which vectorises.
  auto fill = [stride_c](scalar_t* out, int64_t from, int64_t to, scalar_t value) {
    if (stride_c == 1) {
      std::fill(out + from, out + to, value);
    } else {
      for (int64_t c = from; c < to; ++c) out[c * stride_c] = value;
    }
  };
  at::parallel_for(0, batch * n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / n, i = row % n;
      const int64_t p = prefix[b];
      scalar_t* out = base + b * stride_b + i * stride_i;
      fill(out, 0, p, attend);
      for (int64_t j = 0; j < n; ++j) {
        const bool ancestor = (static_cast<uint64_t>(bits[b][i][j / 64]) >> (j % 64)) & 1;
        out[(p + j) * stride_c] = ancestor ? attend : blocked;
      }
      fill(out, p + n, kv_len, blocked);
    }
  });
}

}  // namespace

// ---- topk_logprobs ---------------------------------------------------------------------------

void check_topk_logprobs(const at::Tensor& logits, const at::Tensor& logp, const at::Tensor& tokens) {
  constexpr const char* op = "topk_logprobs";
  DDTREE_CHECK_DIM(op, logits, 3);
  DDTREE_CHECK_FLOAT(op, logits);
  DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, logits);
  DDTREE_CHECK_DIM(op, logp, 3);
  DDTREE_CHECK_DTYPE(op, logp, at::kFloat);
  DDTREE_CHECK_DTYPE(op, tokens, at::kLong);
  DDTREE_CHECK_SAME_DEVICE(op, logits, logp);
  DDTREE_CHECK_SAME_DEVICE(op, logits, tokens);
  const int64_t batch = logits.size(0), depths = logits.size(1), vocab = logits.size(2), k = logp.size(2);
  DDTREE_CHECK_SHAPE(op, logp, {batch, depths, k});
  DDTREE_CHECK_SHAPE(op, tokens, {batch, depths, k});
  DDTREE_CHECK(op, k >= 1 && k <= vocab, "K (last dim of logp and tokens) must be in [1, V = ", vocab,
               "] (V = last dim of logits), got K = ", k);
  check_no_self_overlap(op, "logp", logp);
  check_no_self_overlap(op, "tokens", tokens);
  DDTREE_CHECK(op, !may_overlap(logits, logp) && !may_overlap(logits, tokens) && !may_overlap(logp, tokens),
               "logp, tokens and logits must not share memory");
}

void topk_logprobs_cpu(const at::Tensor& logits, at::Tensor& logp, at::Tensor& tokens) {
  check_topk_logprobs(logits, logp, tokens);
  const int64_t depths = logits.size(1), vocab = logits.size(2), k = logp.size(2);
  const int64_t rows = logits.size(0) * depths;
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / vocab);
  DDTREE_DISPATCH_FLOAT(logits.scalar_type(), "topk_logprobs_cpu", [&] {
    const scalar_t* logits_base = logits.data_ptr<scalar_t>();
    float* logp_base = logp.data_ptr<float>();
    int64_t* tokens_base = tokens.data_ptr<int64_t>();
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      std::vector<Logit> storage;
      storage.reserve(k);
      for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / depths, d = row % depths;
        topk_logprobs_row(logits_base + b * logits.stride(0) + d * logits.stride(1), vocab, k, storage,
                          logp_base + b * logp.stride(0) + d * logp.stride(1), logp.stride(2),
                          tokens_base + b * tokens.stride(0) + d * tokens.stride(1), tokens.stride(2));
      }
    });
  });
}

// ---- build_tree ------------------------------------------------------------------------------

void check_build_tree(const at::Tensor& logp, const at::Tensor& tokens, const at::Tensor& root_token,
                      const at::Tensor& prefix_len, int64_t budget, const at::Tensor& node_token,
                      const at::Tensor& parent, const at::Tensor& depth, const at::Tensor& num_nodes,
                      const at::Tensor& first_child, const at::Tensor& next_sibling,
                      const at::Tensor& ancestor_mask, const at::Tensor& position) {
  constexpr const char* op = "build_tree";
  DDTREE_CHECK(op, budget >= 1 && budget < std::numeric_limits<int32_t>::max(),
               "budget must be in [1, 2^31 - 1), got ", budget);
  DDTREE_CHECK_DIM(op, logp, 3);
  DDTREE_CHECK_DTYPE(op, logp, at::kFloat);
  DDTREE_CHECK_DTYPE(op, tokens, at::kLong);
  DDTREE_CHECK_DTYPE(op, root_token, at::kLong);
  DDTREE_CHECK_DTYPE(op, prefix_len, at::kLong);
  const int64_t batch = logp.size(0), depths = logp.size(1), k = logp.size(2);
  const int64_t n = budget + 1, words = (n + 63) / 64;
  DDTREE_CHECK(op, depths >= 1, "logp must have L >= 1 depths, got shape ", shape_str(logp.sizes()));
  DDTREE_CHECK(op, k >= 1, "logp must have K >= 1 candidates per depth, got shape ", shape_str(logp.sizes()));
  DDTREE_CHECK_SHAPE(op, tokens, {batch, depths, k});
  DDTREE_CHECK_SHAPE(op, root_token, {batch});
  DDTREE_CHECK_SHAPE(op, prefix_len, {batch});

  // Outputs: N = budget + 1 nodes per row, contiguous (the compiled ops index them flat).
  DDTREE_CHECK(op, node_token.dim() == 2 && node_token.size(1) == n,
               "node_token must have shape [B, N] with N = budget + 1 = ", n, ", got shape ",
               shape_str(node_token.sizes()));
  DDTREE_CHECK_DTYPE(op, node_token, at::kLong);
  DDTREE_CHECK_DTYPE(op, parent, at::kInt);
  DDTREE_CHECK_DTYPE(op, depth, at::kInt);
  DDTREE_CHECK_DTYPE(op, num_nodes, at::kInt);
  DDTREE_CHECK_DTYPE(op, first_child, at::kInt);
  DDTREE_CHECK_DTYPE(op, next_sibling, at::kInt);
  DDTREE_CHECK_DTYPE(op, ancestor_mask, at::kLong);
  DDTREE_CHECK_DTYPE(op, position, at::kLong);
  DDTREE_CHECK_SHAPE(op, node_token, {batch, n});
  DDTREE_CHECK_SHAPE(op, parent, {batch, n});
  DDTREE_CHECK_SHAPE(op, depth, {batch, n});
  DDTREE_CHECK_SHAPE(op, num_nodes, {batch});
  DDTREE_CHECK_SHAPE(op, first_child, {batch, n});
  DDTREE_CHECK_SHAPE(op, next_sibling, {batch, n});
  DDTREE_CHECK_SHAPE(op, ancestor_mask, {batch, n, words});
  DDTREE_CHECK_SHAPE(op, position, {batch, n});
  DDTREE_CHECK_CONTIGUOUS(op, node_token);
  DDTREE_CHECK_CONTIGUOUS(op, parent);
  DDTREE_CHECK_CONTIGUOUS(op, depth);
  DDTREE_CHECK_CONTIGUOUS(op, num_nodes);
  DDTREE_CHECK_CONTIGUOUS(op, first_child);
  DDTREE_CHECK_CONTIGUOUS(op, next_sibling);
  DDTREE_CHECK_CONTIGUOUS(op, ancestor_mask);
  DDTREE_CHECK_CONTIGUOUS(op, position);

  DDTREE_CHECK_SAME_DEVICE(op, logp, tokens);
  DDTREE_CHECK_SAME_DEVICE(op, logp, root_token);
  DDTREE_CHECK_SAME_DEVICE(op, logp, prefix_len);
  DDTREE_CHECK_SAME_DEVICE(op, logp, node_token);
  DDTREE_CHECK_SAME_DEVICE(op, logp, parent);
  DDTREE_CHECK_SAME_DEVICE(op, logp, depth);
  DDTREE_CHECK_SAME_DEVICE(op, logp, num_nodes);
  DDTREE_CHECK_SAME_DEVICE(op, logp, first_child);
  DDTREE_CHECK_SAME_DEVICE(op, logp, next_sibling);
  DDTREE_CHECK_SAME_DEVICE(op, logp, ancestor_mask);
  DDTREE_CHECK_SAME_DEVICE(op, logp, position);
  // The outputs are written in several passes that read each other: no output may alias another or an input.
  check_outputs_apart(op,
                      {{"node_token", &node_token}, {"parent", &parent}, {"depth", &depth}, {"num_nodes", &num_nodes},
                       {"first_child", &first_child}, {"next_sibling", &next_sibling},
                       {"ancestor_mask", &ancestor_mask}, {"position", &position}, {"logp", &logp},
                       {"tokens", &tokens}, {"root_token", &root_token}, {"prefix_len", &prefix_len}},
                      8);
}

void build_tree_cpu(const at::Tensor& logp, const at::Tensor& tokens, const at::Tensor& root_token,
                    const at::Tensor& prefix_len, int64_t budget, bool spine, at::Tensor& node_token,
                    at::Tensor& parent, at::Tensor& depth, at::Tensor& num_nodes, at::Tensor& first_child,
                    at::Tensor& next_sibling, at::Tensor& ancestor_mask, at::Tensor& position) {
  check_build_tree(logp, tokens, root_token, prefix_len, budget, node_token, parent, depth, num_nodes,
                   first_child, next_sibling, ancestor_mask, position);
  const auto logp_rows = logp.accessor<float, 3>();
  const auto token_rows = tokens.accessor<int64_t, 3>();
  const auto roots = root_token.accessor<int64_t, 1>();
  const auto prefixes = prefix_len.accessor<int64_t, 1>();
  for (int64_t b = 0; b < logp.size(0); ++b) {  // positions prefix + depth, depth <= L, must fit int64
    DDTREE_CHECK("build_tree", prefixes[b] >= 0 && prefixes[b] <= std::numeric_limits<int64_t>::max() - logp.size(1),
                 "prefix_len[", b, "] must be >= 0 and leave room for the tree's ", logp.size(1), " depths, got ",
                 prefixes[b]);
  }
  const TreeOutputs out{node_token.data_ptr<int64_t>(),    parent.data_ptr<int32_t>(),
                        depth.data_ptr<int32_t>(),         num_nodes.data_ptr<int32_t>(),
                        first_child.data_ptr<int32_t>(),   next_sibling.data_ptr<int32_t>(),
                        ancestor_mask.data_ptr<int64_t>(), position.data_ptr<int64_t>()};
  // A row costs about N log N heap steps plus N * words mask writes; batch small trees per task.
  const int64_t grain = std::max<int64_t>(1, 4096 / (budget + 1));
  at::parallel_for(0, logp.size(0), grain, [&](int64_t begin, int64_t end) {
    TreeScratch scratch;
    for (int64_t b = begin; b < end; ++b) {
      build_tree_row(logp_rows[b], token_rows[b], roots[b], prefixes[b], budget, spine, b, out, scratch);
    }
  });
}

// ---- tree_attention_mask ---------------------------------------------------------------------

void check_tree_attention_mask(const at::Tensor& ancestor_mask, const at::Tensor& prefix_len,
                               const at::Tensor& mask) {
  constexpr const char* op = "tree_attention_mask";
  DDTREE_CHECK_DIM(op, ancestor_mask, 3);
  DDTREE_CHECK_DTYPE(op, ancestor_mask, at::kLong);
  DDTREE_CHECK_DTYPE(op, prefix_len, at::kLong);
  DDTREE_CHECK_DIM(op, mask, 4);
  DDTREE_CHECK(op,
               mask.scalar_type() == at::kBool || mask.scalar_type() == at::kFloat ||
                   mask.scalar_type() == at::kHalf || mask.scalar_type() == at::kBFloat16,
               "mask must be bool, float32, float16 or bfloat16, got ", mask.scalar_type());
  DDTREE_CHECK_SAME_DEVICE(op, ancestor_mask, prefix_len);
  DDTREE_CHECK_SAME_DEVICE(op, ancestor_mask, mask);
  const int64_t batch = ancestor_mask.size(0), n = ancestor_mask.size(1), kv_len = mask.size(3);
  DDTREE_CHECK(op, ancestor_mask.size(2) == (n + 63) / 64, "ancestor_mask must have ceil(N / 64) = ",
               (n + 63) / 64, " words per node for N = ", n, " nodes, got shape ",
               shape_str(ancestor_mask.sizes()));
  DDTREE_CHECK_SHAPE(op, prefix_len, {batch});
  DDTREE_CHECK_SHAPE(op, mask, {batch, 1, n, kv_len});
  DDTREE_CHECK(op, kv_len >= n, "mask's last dim S must be >= N = ", n, ", got shape ", shape_str(mask.sizes()));
  check_no_self_overlap(op, "mask", mask);
  DDTREE_CHECK(op, !may_overlap(mask, ancestor_mask) && !may_overlap(mask, prefix_len),
               "mask must not overlap ancestor_mask or prefix_len");
}

void tree_attention_mask_cpu(const at::Tensor& ancestor_mask, const at::Tensor& prefix_len, at::Tensor& mask) {
  check_tree_attention_mask(ancestor_mask, prefix_len, mask);
  const int64_t n = mask.size(2), kv_len = mask.size(3);
  const auto prefix = prefix_len.accessor<int64_t, 1>();
  for (int64_t b = 0; b < prefix_len.size(0); ++b) {
    // prefix + n <= S, as prefix <= S - n (S >= N is checked): a huge prefix_len cannot wrap around.
    DDTREE_CHECK("tree_attention_mask", prefix[b] >= 0 && prefix[b] <= kv_len - n,
                 "prefix_len must satisfy 0 <= prefix_len[b] and prefix_len[b] + N <= S (N = ", n,
                 " nodes, S = ", kv_len, " mask columns), got prefix_len[", b, "] = ", prefix[b]);
  }
  if (mask.scalar_type() == at::kBool) {
    tree_attention_mask_impl<bool>(ancestor_mask, prefix_len, mask, true, false);
    return;
  }
  DDTREE_DISPATCH_FLOAT(mask.scalar_type(), "tree_attention_mask_cpu", [&] {
    tree_attention_mask_impl<scalar_t>(ancestor_mask, prefix_len, mask, scalar_t(0),
                                       std::numeric_limits<scalar_t>::lowest());
  });
}

}  // namespace ddtree
