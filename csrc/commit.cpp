// Commit: make the accepted path the committed state of every layer, in place, in one call for the
// whole model (each list holds one tensor per layer). Batch rows may accept paths of different
// lengths. The check_* functions are metadata-only and shared with the CUDA implementations; the CPU
// implementations add value checks of the path before writing anything.
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <c10/util/SmallVector.h>

#include "checks.h"
#include "ops.h"

namespace ddtree {
namespace {

// Metadata checks of one tensor of a per-layer list; messages name it "list[layer]".
struct LayerTensor {
  const char* op;
  std::string name;
  const at::Tensor& t;

  LayerTensor(const char* op, const char* list, size_t layer, const at::Tensor& t)
      : op(op), name(std::string(list) + "[" + std::to_string(layer) + "]"), t(t) {}

  void dims(int64_t n) const {
    DDTREE_CHECK(op, t.dim() == n, name, " must have ", n, " dims, got shape ", shape_str(t.sizes()));
  }
  void shape(const std::vector<int64_t>& expected) const {
    DDTREE_CHECK(op, t.sizes() == at::IntArrayRef(expected), name, " must have shape ", shape_str(expected),
                 ", got ", shape_str(t.sizes()));
  }
  void dtype(at::ScalarType expected) const {
    DDTREE_CHECK(op, t.scalar_type() == expected, name, " must have dtype ", expected, ", got ", t.scalar_type());
  }
  void floating() const {
    const auto s = t.scalar_type();
    DDTREE_CHECK(op, s == at::kFloat || s == at::kHalf || s == at::kBFloat16, name,
                 " must be float32, float16 or bfloat16, got ", s);
  }
  void device_of(const at::Tensor& ref, const char* ref_name) const {
    DDTREE_CHECK(op, t.device() == ref.device(), name, " must be on ", ref.device(), " like ", ref_name, ", got ",
                 t.device());
  }
  void contiguous() const {
    DDTREE_CHECK(op, t.is_contiguous(), name, " must be contiguous, got strides ", shape_str(t.strides()));
  }
  void last_dim_contiguous() const {
    DDTREE_CHECK(op, t.stride(-1) == 1 || t.size(-1) == 1, name, " must be contiguous in its last dim, got strides ",
                 shape_str(t.strides()));
  }
};

void check_layer_count(const char* op, const char* list, at::TensorList tensors, const char* ref_list,
                       size_t layers) {
  DDTREE_CHECK(op, tensors.size() == layers, list, " must hold one tensor per layer like ", ref_list, " (", layers,
               "), got ", tensors.size());
}

// Value checks of the accepted paths (CPU): 1 <= accept_len[b] <= D, path entries are node indices in
// [0, num_nodes) and strictly increasing (nodes are in topological order). Strictly increasing from
// >= 0 also gives accepted[b, d] >= d: a path node never moves to a slot after its own.
void check_path_values_cpu(const char* op, const at::Tensor& accepted, const at::Tensor& accept_len,
                           int64_t num_nodes) {
  const int64_t batch = accepted.size(0), max_accept = accepted.size(1);
  const int32_t* path = accepted.data_ptr<int32_t>();
  const int32_t* len = accept_len.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    DDTREE_CHECK(op, len[b] >= 1 && len[b] <= max_accept, "accept_len[", b, "] must be in [1, ", max_accept,
                 "], got ", len[b]);
    for (int64_t d = 0; d < len[b]; ++d) {
      const int64_t node = path[b * max_accept + d];
      DDTREE_CHECK(op, node >= 0 && node < num_nodes, "accepted[", b, ", ", d, "] must be a node index in [0, ",
                   num_nodes, "), got ", node);
      DDTREE_CHECK(op, d > 0 || node == 0, "accepted[", b, ", 0] must be the root, 0 (a path starts there), got ",
                   node);
      DDTREE_CHECK(op, d == 0 || node > path[b * max_accept + d - 1], "accepted[", b,
                   "] must be strictly increasing along the path (nodes are in topological order), got ",
                   path[b * max_accept + d - 1], " then ", node, " at d = ", d);
    }
  }
}

// Runs body(layer, b, i) for every i < inner[layer], over all layers and batch rows, in parallel.
template <typename Body>
void parallel_over_layers(const std::vector<int64_t>& inner, int64_t batch, int64_t grain, const Body& body) {
  std::vector<int64_t> start(inner.size() + 1, 0);  // first flat item of each layer
  for (size_t l = 0; l < inner.size(); ++l) start[l + 1] = start[l] + batch * inner[l];
  at::parallel_for(0, start.back(), grain, [&](int64_t begin, int64_t end) {
    size_t layer = std::upper_bound(start.begin(), start.end(), begin) - start.begin() - 1;
    for (int64_t item = begin; item < end; ++item) {
      while (item >= start[layer + 1]) ++layer;
      const int64_t local = item - start[layer];
      body(layer, local / inner[layer], local % inner[layer]);
    }
  });
}

}  // namespace

void check_commit_path(const char* op, const at::Tensor& accepted, const at::Tensor& accept_len) {
  DDTREE_CHECK_DTYPE(op, accepted, at::kInt);
  DDTREE_CHECK_DIM(op, accepted, 2);
  DDTREE_CHECK(op, accepted.size(1) >= 1, "accepted must have shape [B, D] with D >= 1, got ",
               shape_str(accepted.sizes()));
  DDTREE_CHECK_CONTIGUOUS(op, accepted);
  DDTREE_CHECK_DTYPE(op, accept_len, at::kInt);
  DDTREE_CHECK_SHAPE(op, accept_len, {accepted.size(0)});
  DDTREE_CHECK_CONTIGUOUS(op, accept_len);
  DDTREE_CHECK_SAME_DEVICE(op, accepted, accept_len);
}

// ---- commit_gdn_state ------------------------------------------------------------------------

void check_commit_gdn_state(at::TensorList state, at::TensorList stash_u, at::TensorList stash_k,
                            at::TensorList stash_cumg, const at::Tensor& accepted, const at::Tensor& accept_len) {
  constexpr const char* op = "commit_gdn_state";
  check_commit_path(op, accepted, accept_len);
  const size_t layers = state.size();
  check_layer_count(op, "stash_u", stash_u, "state", layers);
  check_layer_count(op, "stash_k", stash_k, "state", layers);
  check_layer_count(op, "stash_cumg", stash_cumg, "state", layers);
  const int64_t batch = accepted.size(0);
  int64_t num_nodes = 0;
  for (size_t l = 0; l < layers; ++l) {
    const LayerTensor s(op, "state", l, state[l]), u(op, "stash_u", l, stash_u[l]),
        k(op, "stash_k", l, stash_k[l]), g(op, "stash_cumg", l, stash_cumg[l]);
    s.dims(4);
    u.dims(4);
    k.dims(4);
    g.dims(3);
    if (l == 0) num_nodes = stash_u[0].size(1);
    const int64_t value_heads = state[l].size(1), key_dim = state[l].size(2), value_dim = state[l].size(3);
    const int64_t key_heads = stash_k[l].size(2);
    s.shape({batch, value_heads, key_dim, value_dim});
    u.shape({batch, num_nodes, value_heads, value_dim});
    k.shape({batch, num_nodes, key_heads, key_dim});
    g.shape({batch, num_nodes, value_heads});
    DDTREE_CHECK(op, key_heads >= 1 && value_heads % key_heads == 0, "stash_k[", l, "] has ", key_heads,
                 " key heads, which must divide the ", value_heads, " value heads of state[", l, "]");
    for (const LayerTensor* t : {&s, &u, &k, &g}) {
      t->dtype(at::kFloat);
      t->device_of(accepted, "accepted");
      t->contiguous();
    }
    for (const auto& [name, t] : {std::pair{"stash_u", &stash_u[l]}, {"stash_k", &stash_k[l]},
                                  {"stash_cumg", &stash_cumg[l]}}) {
      DDTREE_CHECK(op, !may_overlap(state[l], *t), "state[", l, "] must not overlap ", name, "[", l, "]");
    }
  }
  check_apart(op, "state", state);
}

void commit_gdn_state_cpu(at::TensorList state, at::TensorList stash_u, at::TensorList stash_k,
                          at::TensorList stash_cumg, const at::Tensor& accepted, const at::Tensor& accept_len) {
  check_commit_gdn_state(state, stash_u, stash_k, stash_cumg, accepted, accept_len);
  if (state.empty()) return;
  const int64_t num_nodes = stash_u[0].size(1);
  check_path_values_cpu("commit_gdn_state", accepted, accept_len, num_nodes);

  const int64_t max_accept = accepted.size(1);
  const int32_t* path_all = accepted.data_ptr<int32_t>();
  const int32_t* len_all = accept_len.data_ptr<int32_t>();
  std::vector<int64_t> value_heads(state.size());
  for (size_t l = 0; l < state.size(); ++l) value_heads[l] = state[l].size(1);

  // One item = one K x V state: S <- e^{G_last} S + sum_d (e^{G_last - G_d} k_d) u_d^T, row by row
  // so each state row is read and written once.
  parallel_over_layers(value_heads, accepted.size(0), 1, [&](size_t l, int64_t b, int64_t hv) {
    const int64_t heads = value_heads[l], key_heads = stash_k[l].size(2);
    const int64_t key_dim = state[l].size(2), value_dim = state[l].size(3);
    const int64_t hk = hv / (heads / key_heads);
    const int32_t* path = path_all + b * max_accept;
    const int64_t len = len_all[b];
    const float* cumg = stash_cumg[l].const_data_ptr<float>() + b * num_nodes * heads + hv;  // [node * heads]
    const float g_last = cumg[path[len - 1] * heads];

    c10::SmallVector<float, 32> weight(len);
    c10::SmallVector<const float*, 32> u(len), k(len);
    for (int64_t d = 0; d < len; ++d) {
      const int64_t node = b * num_nodes + path[d];
      weight[d] = std::exp(g_last - cumg[path[d] * heads]);
      u[d] = stash_u[l].const_data_ptr<float>() + (node * heads + hv) * value_dim;
      k[d] = stash_k[l].const_data_ptr<float>() + (node * key_heads + hk) * key_dim;
    }
    const float decay = std::exp(g_last);
    float* s = state[l].data_ptr<float>() + (b * heads + hv) * key_dim * value_dim;
    for (int64_t i = 0; i < key_dim; ++i) {
      float* __restrict__ row = s + i * value_dim;
      for (int64_t v = 0; v < value_dim; ++v) row[v] *= decay;
      for (int64_t d = 0; d < len; ++d) {
        const float coef = weight[d] * k[d][i];
        const float* __restrict__ ud = u[d];
        for (int64_t v = 0; v < value_dim; ++v) row[v] += coef * ud[v];
      }
    }
  });
}

// ---- commit_conv_state -----------------------------------------------------------------------

void check_commit_conv_state(at::TensorList conv_state, at::TensorList x, const at::Tensor& accepted,
                             const at::Tensor& accept_len) {
  constexpr const char* op = "commit_conv_state";
  check_commit_path(op, accepted, accept_len);
  const size_t layers = conv_state.size();
  check_layer_count(op, "x", x, "conv_state", layers);
  const int64_t batch = accepted.size(0);
  int64_t num_nodes = 0;
  for (size_t l = 0; l < layers; ++l) {
    const LayerTensor cs(op, "conv_state", l, conv_state[l]), xl(op, "x", l, x[l]);
    cs.dims(3);
    xl.dims(3);
    if (l == 0) num_nodes = x[0].size(1);
    const int64_t channels = conv_state[l].size(1), width = conv_state[l].size(2);
    cs.shape({batch, channels, width});
    xl.shape({batch, num_nodes, channels});
    cs.floating();
    xl.dtype(conv_state[l].scalar_type());
    cs.device_of(accepted, "accepted");
    xl.device_of(accepted, "accepted");
    xl.last_dim_contiguous();
    check_no_self_overlap(op, "conv_state[" + std::to_string(l) + "]", conv_state[l]);
    DDTREE_CHECK(op, !may_overlap(conv_state[l], x[l]), "conv_state[", l, "] must not overlap x[", l, "]");
  }
  check_apart(op, "conv_state", conv_state);
}

void commit_conv_state_cpu(at::TensorList conv_state, at::TensorList x, const at::Tensor& accepted,
                           const at::Tensor& accept_len) {
  check_commit_conv_state(conv_state, x, accepted, accept_len);
  if (conv_state.empty()) return;
  check_path_values_cpu("commit_conv_state", accepted, accept_len, x[0].size(1));

  const int64_t max_accept = accepted.size(1);
  const int32_t* path_all = accepted.data_ptr<int32_t>();
  const int32_t* len_all = accept_len.data_ptr<int32_t>();
  const std::vector<int64_t> one_item_per_row(conv_state.size(), 1);
  parallel_over_layers(one_item_per_row, accepted.size(0), 1, [&](size_t l, int64_t b, int64_t) {
    const at::Tensor& cs = conv_state[l];
    const at::Tensor& xl = x[l];
    const int64_t channels = cs.size(1), width = cs.size(2);
    const int64_t cs_c = cs.stride(1), cs_s = cs.stride(2), x_n = xl.stride(1);
    const int32_t* path = path_all + b * max_accept;
    const int64_t len = len_all[b];
    const int64_t taken = std::min(len, width);  // new columns entering the window, from the path's end
    const int64_t kept = width - taken;          // old columns that stay, shifted left by `taken`
    DDTREE_DISPATCH_FLOAT(cs.scalar_type(), "commit_conv_state", [&] {
      scalar_t* state = cs.data_ptr<scalar_t>() + b * cs.stride(0);
      const scalar_t* inputs = xl.const_data_ptr<scalar_t>() + b * xl.stride(0);
      // Ascending columns: column s reads column s + taken, which is written later.
      for (int64_t s = 0; s < kept; ++s) {
        for (int64_t c = 0; c < channels; ++c) state[c * cs_c + s * cs_s] = state[c * cs_c + (s + taken) * cs_s];
      }
      for (int64_t s = kept; s < width; ++s) {
        const scalar_t* column = inputs + path[len - width + s] * x_n;
        for (int64_t c = 0; c < channels; ++c) state[c * cs_c + s * cs_s] = column[c];
      }
    });
  });
}

// ---- commit_kv -------------------------------------------------------------------------------

void check_commit_kv(at::TensorList cache, const at::Tensor& prefix_len, const at::Tensor& accepted,
                     const at::Tensor& accept_len) {
  constexpr const char* op = "commit_kv";
  check_commit_path(op, accepted, accept_len);
  const int64_t batch = accepted.size(0);
  DDTREE_CHECK_DTYPE(op, prefix_len, at::kLong);
  DDTREE_CHECK_SHAPE(op, prefix_len, {batch});
  DDTREE_CHECK_CONTIGUOUS(op, prefix_len);
  DDTREE_CHECK_SAME_DEVICE(op, accepted, prefix_len);
  for (size_t l = 0; l < cache.size(); ++l) {
    const LayerTensor c(op, "cache", l, cache[l]);
    c.dims(4);
    c.shape({batch, cache[l].size(1), cache[l].size(2), cache[l].size(3)});
    c.device_of(accepted, "accepted");
    c.last_dim_contiguous();
    check_no_self_overlap(op, "cache[" + std::to_string(l) + "]", cache[l]);
  }
  check_apart(op, "cache", cache);
}

void commit_kv_cpu(at::TensorList cache, const at::Tensor& prefix_len, const at::Tensor& accepted,
                   const at::Tensor& accept_len) {
  constexpr const char* op = "commit_kv";
  check_commit_kv(cache, prefix_len, accepted, accept_len);
  if (cache.empty()) return;
  size_t shortest = 0;  // the cache with the fewest slots bounds every destination and source
  for (size_t l = 1; l < cache.size(); ++l) {
    if (cache[l].size(2) < cache[shortest].size(2)) shortest = l;
  }
  const int64_t slots = cache[shortest].size(2);
  const int64_t* prefix = prefix_len.data_ptr<int64_t>();
  for (int64_t b = 0; b < accepted.size(0); ++b) {
    DDTREE_CHECK(op, prefix[b] >= 0, "prefix_len[", b, "] must be >= 0, got ", prefix[b]);
  }
  check_path_values_cpu(op, accepted, accept_len, slots);
  const int64_t max_accept = accepted.size(1);
  const int32_t* path_all = accepted.data_ptr<int32_t>();
  const int32_t* len_all = accept_len.data_ptr<int32_t>();
  for (int64_t b = 0; b < accepted.size(0); ++b) {
    const int64_t last = path_all[b * max_accept + len_all[b] - 1];
    // prefix[b] >= 0 and last >= 0 are checked; comparing with slots - last keeps a huge prefix from wrapping.
    DDTREE_CHECK(op, prefix[b] < slots - last, "prefix_len[", b, "] + accepted[", b, ", ", len_all[b] - 1,
                 "] = ", prefix[b], " + ", last, " must be < ", slots, " (the slots of cache[", shortest, "])");
  }

  std::vector<int64_t> heads(cache.size());
  for (size_t l = 0; l < cache.size(); ++l) heads[l] = cache[l].size(1);
  parallel_over_layers(heads, accepted.size(0), 1, [&](size_t l, int64_t b, int64_t h) {
    const at::Tensor& c = cache[l];
    const int64_t item_size = c.element_size();
    const int64_t row_bytes = c.size(3) * item_size, slot_stride = c.stride(2) * item_size;
    char* base = static_cast<char*>(c.data_ptr()) + (b * c.stride(0) + h * c.stride(1)) * item_size +
                 prefix[b] * slot_stride;
    const int32_t* path = path_all + b * max_accept;
    // In path order this is overlap-safe without a temporary: node path[d] >= d moves to slot d, which
    // is no later path node's source (those are > path[d] >= d), and every slot written so far is < d.
    for (int64_t d = 0; d < len_all[b]; ++d) {
      if (path[d] != d) std::memcpy(base + d * slot_stride, base + path[d] * slot_stride, row_bytes);
    }
  });
}

// ---- gather_rows -----------------------------------------------------------------------------

void check_gather_rows(const at::Tensor& src, const at::Tensor& accepted, const at::Tensor& accept_len,
                       const at::Tensor& out) {
  constexpr const char* op = "gather_rows";
  check_commit_path(op, accepted, accept_len);
  DDTREE_CHECK_DIM(op, src, 3);
  DDTREE_CHECK(op, src.size(0) == accepted.size(0), "src must have shape [", accepted.size(0),
               ", N, F] like accepted, got ", shape_str(src.sizes()));
  DDTREE_CHECK_SHAPE(op, out, {accepted.size(0), accepted.size(1), src.size(2)});
  DDTREE_CHECK_DTYPE(op, out, src.scalar_type());
  DDTREE_CHECK_SAME_DEVICE(op, accepted, src);
  DDTREE_CHECK_SAME_DEVICE(op, accepted, out);
  DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, src);
  DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, out);
  // In place, the CUDA kernel's blocks would read rows that others overwrite (no order between them).
  DDTREE_CHECK(op, !may_overlap(src, out), "out must not overlap src");
  check_no_self_overlap(op, "out", out);
}

void gather_rows_cpu(const at::Tensor& src, const at::Tensor& accepted, const at::Tensor& accept_len,
                     at::Tensor& out) {
  check_gather_rows(src, accepted, accept_len, out);
  check_path_values_cpu("gather_rows", accepted, accept_len, src.size(1));

  const int64_t max_accept = accepted.size(1), item_size = src.element_size();
  const int64_t row_bytes = src.size(2) * item_size;
  const int32_t* path = accepted.data_ptr<int32_t>();
  const int32_t* len = accept_len.data_ptr<int32_t>();
  const char* src_data = static_cast<const char*>(src.const_data_ptr());
  char* out_data = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, accepted.size(0) * max_accept, 64, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / max_accept, d = item % max_accept;
      char* dst = out_data + (b * out.stride(0) + d * out.stride(1)) * item_size;
      if (d < len[b]) {
        std::memcpy(dst, src_data + (b * src.stride(0) + path[item] * src.stride(1)) * item_size, row_bytes);
      } else {
        std::memset(dst, 0, row_bytes);  // all-zero bytes are zero in every dtype
      }
    }
  });
}

// ---- store_kv (a verify's new K/V rows into the static caches) -------------------------------------

void check_store_kv(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& slots,
                    const at::Tensor& key_states, const at::Tensor& value_states) {
  constexpr const char* op = "store_kv";
  DDTREE_CHECK_DIM(op, keys, 4);
  DDTREE_CHECK_FLOAT(op, keys);
  DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, keys);
  const int64_t bsz = keys.size(0), heads = keys.size(1), dim = keys.size(3);
  DDTREE_CHECK_SHAPE(op, values, {bsz, heads, keys.size(2), dim});
  DDTREE_CHECK_DTYPE(op, values, keys.scalar_type());
  DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, values);
  DDTREE_CHECK_SAME_DEVICE(op, keys, values);
  TORCH_CHECK_VALUE(slots.dim() == 1 || (slots.dim() == 2 && slots.size(0) == bsz), op,
                    ": slots must have shape [N] (one slot table for every batch row) or [B, N] = [", bsz,
                    ", N], got ", shape_str(slots.sizes()));
  DDTREE_CHECK_DTYPE(op, slots, at::kLong);
  DDTREE_CHECK_CONTIGUOUS(op, slots);
  DDTREE_CHECK_SAME_DEVICE(op, keys, slots);
  const int64_t n = slots.size(-1);
  for (const auto* t : {&key_states, &value_states}) {
    const char* name = t == &key_states ? "key_states" : "value_states";
    TORCH_CHECK_VALUE(t->dim() == 4 && t->size(0) == bsz && t->size(1) == heads && t->size(2) == n &&
                          t->size(3) == dim,
                      op, ": ", name, " must have shape [B, H, N, D] = [", bsz, ", ", heads, ", ", n, ", ", dim,
                      "] (the caches' B, H, D and N = slots), got ", shape_str(t->sizes()));
    TORCH_CHECK_VALUE(t->scalar_type() == keys.scalar_type(), op, ": ", name, " must have dtype ",
                      keys.scalar_type(), " like the caches, got ", t->scalar_type());
    TORCH_CHECK_VALUE(t->stride(3) == 1 || dim == 1, op, ": ", name, " must be contiguous in its last dim");
    TORCH_CHECK_VALUE(t->device() == keys.device(), op, ": ", name, " must be on ", keys.device(),
                      " like the caches, got ", t->device());
  }
  check_no_self_overlap(op, "keys", keys);
  check_no_self_overlap(op, "values", values);
  DDTREE_CHECK(op, !may_overlap(keys, values), "keys must not overlap values");
  for (const auto* c : {&keys, &values}) {
    for (const auto* t : {&key_states, &value_states}) {
      DDTREE_CHECK(op, !may_overlap(*c, *t), c == &keys ? "keys" : "values", " must not overlap ",
                   t == &key_states ? "key_states" : "value_states");
    }
  }
}

// A host-side table: every slot below num_slots (a negative one stores nothing), and the slots a batch row stores
// all different (two rows into one slot: the last write would win on the CPU, a race on CUDA), so that a bad table
// leaves the caches as they were.
void check_slots_below(const char* op, const at::Tensor& slots, int64_t num_slots) {
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t n = slots.size(-1);
  for (int64_t i = 0; i < slots.numel(); ++i) {
    DDTREE_CHECK(op, s[i] < num_slots, "slots[",
                 slots.dim() == 2 ? std::to_string(i / n) + ", " + std::to_string(i % n) : std::to_string(i), "] = ",
                 s[i], " must be below ", num_slots, " (the caches' slots; a negative slot stores nothing)");
  }
  std::vector<int64_t> stored;
  for (int64_t row = 0; row < slots.numel() / std::max<int64_t>(n, 1); ++row) {
    stored.clear();
    for (int64_t i = 0; i < n; ++i) {
      if (s[row * n + i] >= 0) stored.push_back(s[row * n + i]);
    }
    std::sort(stored.begin(), stored.end());
    const auto twice = std::adjacent_find(stored.begin(), stored.end());
    DDTREE_CHECK(op, twice == stored.end(), "slots", slots.dim() == 2 ? "[" + std::to_string(row) + "]" : "",
                 " stores slot ", twice == stored.end() ? 0 : *twice, " twice (each row needs its own slot)");
  }
}

void store_kv_cpu(at::Tensor& keys, at::Tensor& values, const at::Tensor& slots, const at::Tensor& key_states,
                  const at::Tensor& value_states) {
  check_store_kv(keys, values, slots, key_states, value_states);
  check_slots_below("store_kv", slots, keys.size(2));  // before anything is written
  const int64_t n = slots.size(-1);
  for (int64_t b = 0; b < keys.size(0); ++b) {
    const at::Tensor row = slots.dim() == 2 ? slots[b] : slots;
    const at::Tensor keep = (row >= 0).nonzero().view(-1);  // the rows stored, in order
    const bool all = keep.numel() == n;
    const at::Tensor to = all ? row : row.index_select(0, keep);
    keys[b].index_copy_(1, to, all ? key_states[b] : key_states[b].index_select(1, keep));
    values[b].index_copy_(1, to, all ? value_states[b] : value_states[b].index_select(1, keep));
  }
}

}  // namespace ddtree
