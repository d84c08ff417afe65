// Penalize: the repetition, presence and frequency penalties at every node of a verified tree, applied to the
// target's logits before the walk reads them. A node's sequence is the tokens counted so far (the caller's tables)
// plus the tokens on the node's own path below the root, so every node gets the penalties of its own branch.
// check_penalize_logits is metadata-only and shared with the CUDA implementation; the CPU implementation adds value
// checks (tree links, path tokens) before writing.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "checks.h"
#include "ops.h"
#include "penalties.h"

namespace ddtree {

void check_penalize_logits(const at::Tensor& logits, const at::Tensor& node_token, const at::Tensor& parent,
                           const c10::optional<at::Tensor>& seen_table, const c10::optional<at::Tensor>& count_table,
                           double repetition_penalty, double presence_penalty, double frequency_penalty,
                           int64_t max_depth, const at::Tensor& out) {
  constexpr const char* op = "penalize_logits";
  DDTREE_CHECK_DIM(op, node_token, 2);
  DDTREE_CHECK_DTYPE(op, node_token, at::kLong);
  const int64_t batch = node_token.size(0), num_nodes = node_token.size(1);
  DDTREE_CHECK(op, num_nodes >= 1, "node_token must hold at least the root, got shape ",
               shape_str(node_token.sizes()));
  DDTREE_CHECK(op, num_nodes <= std::numeric_limits<int32_t>::max(), "trees must have fewer than 2^31 nodes, got ",
               num_nodes);
  DDTREE_CHECK_CONTIGUOUS(op, node_token);
  DDTREE_CHECK_DTYPE(op, parent, at::kInt);
  DDTREE_CHECK_SHAPE(op, parent, {batch, num_nodes});
  DDTREE_CHECK_CONTIGUOUS(op, parent);
  DDTREE_CHECK_SAME_DEVICE(op, node_token, parent);
  DDTREE_CHECK_FLOAT(op, logits);
  DDTREE_CHECK_DIM(op, logits, 3);
  DDTREE_CHECK(op, logits.size(0) == batch && logits.size(1) == num_nodes && logits.size(2) >= 1,
               "logits must have shape [", batch, ", ", num_nodes, ", V] with V >= 1, got ",
               shape_str(logits.sizes()));
  const int64_t vocab = logits.size(2);
  DDTREE_CHECK(op, vocab <= std::numeric_limits<int32_t>::max(), "logits rows must be shorter than 2^31, got ", vocab);
  DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, logits);
  DDTREE_CHECK_SAME_DEVICE(op, node_token, logits);
  if (seen_table.has_value()) {
    const at::Tensor& seen = *seen_table;
    DDTREE_CHECK_DTYPE(op, seen, at::kBool);
    DDTREE_CHECK_SHAPE(op, seen, {batch, vocab});
    DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, seen);
    DDTREE_CHECK_SAME_DEVICE(op, node_token, seen);
  }
  if (count_table.has_value()) {
    const at::Tensor& counts = *count_table;
    DDTREE_CHECK_DTYPE(op, counts, at::kFloat);
    DDTREE_CHECK_SHAPE(op, counts, {batch, vocab});
    DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, counts);
    DDTREE_CHECK_SAME_DEVICE(op, node_token, counts);
  }
  DDTREE_CHECK(op, std::isfinite(repetition_penalty) && repetition_penalty > 0,
               "repetition_penalty must be a finite number > 0 (1 = off), got ", repetition_penalty);
  // float32 is what the penalties are applied in: a factor that is zero, subnormal or infinite there is not one.
  DDTREE_CHECK(op, static_cast<float>(repetition_penalty) >= std::numeric_limits<float>::min() &&
                       std::isfinite(static_cast<float>(repetition_penalty)),
               "repetition_penalty must be a normal float32 number, got ", repetition_penalty);
  DDTREE_CHECK(op, std::isfinite(static_cast<float>(presence_penalty)),
               "presence_penalty must be finite in float32, got ", presence_penalty);
  DDTREE_CHECK(op, std::isfinite(static_cast<float>(frequency_penalty)),
               "frequency_penalty must be finite in float32, got ", frequency_penalty);
  // A penalty without the table it reads would be silently ignored.
  DDTREE_CHECK(op, seen_table.has_value() || repetition_penalty == 1.0,
               "repetition_penalty needs seen (the tokens in the sequence so far), got ", repetition_penalty,
               " without it");
  DDTREE_CHECK(op, count_table.has_value() || presence_penalty == 0.0,
               "presence_penalty needs counts (how often each token was generated), got ", presence_penalty,
               " without it");
  DDTREE_CHECK(op, count_table.has_value() || frequency_penalty == 0.0,
               "frequency_penalty needs counts (how often each token was generated), got ", frequency_penalty,
               " without it");
  DDTREE_CHECK(op, max_depth >= 1, "max_depth must be >= 1 (the longest path counted, root included), got ",
               max_depth);
  DDTREE_CHECK_DTYPE(op, out, at::kFloat);
  DDTREE_CHECK_SHAPE(op, out, {batch, num_nodes, vocab});
  DDTREE_CHECK_CONTIGUOUS(op, out);
  DDTREE_CHECK_SAME_DEVICE(op, node_token, out);
  // The path pass reads a node's original logits after the first pass has written the node's row.
  check_outputs_apart(op, {{"out", &out}, {"logits", &logits}, {"node_token", &node_token}, {"parent", &parent}}, 1);
  if (seen_table.has_value()) check_outputs_apart(op, {{"out", &out}, {"seen", &*seen_table}}, 1);
  if (count_table.has_value()) check_outputs_apart(op, {{"out", &out}, {"counts", &*count_table}}, 1);
}

Penalties make_penalties(const c10::optional<at::Tensor>& seen, const c10::optional<at::Tensor>& counts,
                         double repetition_penalty, double presence_penalty, double frequency_penalty) {
  Penalties p;
  p.seen = seen.has_value() ? seen->data_ptr<bool>() : nullptr;
  p.seen_stride = seen.has_value() ? seen->stride(0) : 0;
  p.counts = counts.has_value() ? counts->data_ptr<float>() : nullptr;
  p.count_stride = counts.has_value() ? counts->stride(0) : 0;
  p.repetition = static_cast<float>(repetition_penalty);
  p.reciprocal = static_cast<float>(1.0 / repetition_penalty);
  p.presence = static_cast<float>(presence_penalty);
  p.frequency = static_cast<float>(frequency_penalty);
  return p;
}

namespace {

// The nodes of node i's path below the root, nearest first, at most `limit` of them.
void path_nodes(const int32_t* parent, int64_t i, int64_t limit, std::vector<int64_t>& path) {
  path.clear();
  for (int64_t node = i; static_cast<int64_t>(path.size()) < limit && parent[node] >= 0; node = parent[node]) {
    path.push_back(node);
  }
}

}  // namespace

void penalize_logits_cpu(const at::Tensor& logits, const at::Tensor& node_token, const at::Tensor& parent,
                         const c10::optional<at::Tensor>& seen, const c10::optional<at::Tensor>& counts,
                         double repetition_penalty, double presence_penalty, double frequency_penalty,
                         int64_t max_depth, at::Tensor& out) {
  check_penalize_logits(logits, node_token, parent, seen, counts, repetition_penalty, presence_penalty,
                        frequency_penalty, max_depth, out);
  check_parent_values("penalize_logits", parent);
  const int64_t batch = node_token.size(0), num_nodes = node_token.size(1), vocab = logits.size(2);
  const int64_t limit = std::min(max_depth - 1, num_nodes - 1);
  const int64_t* token = node_token.data_ptr<int64_t>();
  const int32_t* parents = parent.data_ptr<int32_t>();
  std::vector<int64_t> path;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < num_nodes; ++i) {
      path_nodes(parents + b * num_nodes, i, limit, path);
      for (const int64_t node : path) {
        const int64_t t = token[b * num_nodes + node];
        DDTREE_CHECK("penalize_logits", t >= 0 && t < vocab, "node_token[", b, ", ", node, "] (on node ", i,
                     "'s path) must be a token in [0, ", vocab, "), got ", t);
      }
    }
  }
  const Penalties penalties = make_penalties(seen, counts, repetition_penalty, presence_penalty, frequency_penalty);
  DDTREE_DISPATCH_FLOAT(logits.scalar_type(), "penalize_logits", [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    float* y = out.data_ptr<float>();
    at::parallel_for(0, batch * num_nodes, 1, [&](int64_t begin, int64_t end) {
      std::vector<int64_t> node_path;
      for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / num_nodes, i = row % num_nodes;
        const scalar_t* xr = x + b * logits.stride(0) + i * logits.stride(1);
        const bool* sr = penalties.seen ? penalties.seen + b * penalties.seen_stride : nullptr;
        const float* cr = penalties.counts ? penalties.counts + b * penalties.count_stride : nullptr;
        float* yr = y + row * vocab;
        for (int64_t v = 0; v < vocab; ++v) {
          yr[v] = apply_penalties(static_cast<float>(xr[v]), sr && sr[v], cr ? cr[v] : 0.0f, penalties);
        }
        if (penalties.seen == nullptr && penalties.counts == nullptr) continue;  // nothing to redo
        // The path's tokens again, from the node's own counts: present, and counted once more per occurrence.
        path_nodes(parents + b * num_nodes, i, limit, node_path);
        const int64_t* tr = token + b * num_nodes;
        for (const int64_t node : node_path) {
          const int64_t t = tr[node];
          float occurrences = 0;
          for (const int64_t other : node_path) occurrences += tr[other] == t ? 1.0f : 0.0f;
          yr[t] = apply_penalties(static_cast<float>(xr[t]), true, (cr ? cr[t] : 0.0f) + occurrences, penalties);
        }
      }
    });
  });
}

}  // namespace ddtree
