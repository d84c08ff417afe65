// Verify ops on the CPU: the two pieces of a Gated DeltaNet layer that must see the tree rather than a
// sequence, the short causal conv and the gated delta rule, each run along every root-to-node path.
//
// Both walk parent pointers instead of materialising ancestor sets: trees are topologically ordered
// (parent[i] < i), so processing nodes in index order finds every ancestor's result ready.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "checks.h"
#include "ops.h"

// A dense tensor of known shape and dtype on ref's device: the common case of the checks below. A macro, so the
// messages name the argument.
#define CHECK_DENSE(op, ref, t, dtype, ...)   \
  do {                                        \
    DDTREE_CHECK_SHAPE(op, t, __VA_ARGS__);   \
    DDTREE_CHECK_DTYPE(op, t, dtype);         \
    DDTREE_CHECK_CONTIGUOUS(op, t);           \
    DDTREE_CHECK_SAME_DEVICE(op, ref, t);     \
  } while (0)

namespace ddtree {

void check_parent_values(const char* op, const at::Tensor& parent) {
  const int64_t bsz = parent.size(0), n = parent.size(1);
  const int32_t* p = parent.data_ptr<int32_t>();
  for (int64_t b = 0; b < bsz; ++b) {
    if (n > 0) {
      DDTREE_CHECK(op, p[b * n] == -1, "parent[", b, ", 0] must be -1 (node 0 is the root), got ", p[b * n]);
    }
    for (int64_t i = 1; i < n; ++i) {
      const int32_t pi = p[b * n + i];
      DDTREE_CHECK(op, pi >= 0 && pi < i, "parent[", b, ", ", i, "] must be in [0, ", i,
                   ") (nodes in topological order), got ", pi);
    }
  }
}

namespace {

constexpr int64_t kMaxConvWidth = 4;
constexpr float kL2NormEps = 1e-6f;  // inside the sqrt, as in fla and Hugging Face

// Grain for at::parallel_for over tasks of about `work_per_task` multiply-adds each: tiny problems stay on the
// calling thread, where the fork would cost more than the work.
int64_t grain_for(int64_t work_per_task) {
  return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, work_per_task));
}

// Eight independent partial sums, which the compiler keeps in SIMD lanes (a single float accumulator cannot
// be reordered without fast-math).
inline float dot(const float* a, const float* b, int64_t len) {
  constexpr int64_t kLanes = 8;
  float lane[kLanes] = {};
  int64_t t = 0;
  for (; t + kLanes <= len; t += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lane[l] += a[t + l] * b[t + l];
  }
  float acc = 0.f;
  for (; t < len; ++t) acc += a[t] * b[t];
  for (int64_t l = 0; l < kLanes; ++l) acc += lane[l];
  return acc;
}

// acc[c] += w[c] * src[c] over contiguous channels.
template <typename src_t>
inline void add_weighted(float* acc, const float* w, const src_t* src, int64_t len) {
  for (int64_t c = 0; c < len; ++c) acc[c] += w[c] * static_cast<float>(src[c]);
}

template <typename scalar_t>
void tree_conv1d_kernel(const at::Tensor& x, const at::Tensor& weight, const scalar_t* bias,
                        const at::Tensor& conv_state, const at::Tensor& parent, at::Tensor& out) {
  const int64_t bsz = x.size(0), n = x.size(1), channels = x.size(2), width = weight.size(1);
  const int64_t reach = width - 1;  // columns of the committed state a window can reach
  const int64_t first_col = conv_state.size(2) - reach;
  const int64_t x_sb = x.stride(0), x_sn = x.stride(1);
  const scalar_t* x_ptr = x.data_ptr<scalar_t>();
  const int32_t* par = parent.data_ptr<int32_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();

  // The weights and the reachable state columns as float32 rows [tap][channel], so that every loop over
  // channels below is contiguous.
  std::vector<float> weight_rows(width * channels);
  const scalar_t* w_ptr = weight.data_ptr<scalar_t>();
  for (int64_t c = 0; c < channels; ++c) {
    for (int64_t s = 0; s < width; ++s) weight_rows[s * channels + c] = static_cast<float>(w_ptr[c * width + s]);
  }
  std::vector<float> state_rows(bsz * reach * channels);
  const auto cs = conv_state.accessor<scalar_t, 3>();
  for (int64_t b = 0; b < bsz; ++b) {
    for (int64_t s = 0; s < reach; ++s) {
      float* dst = state_rows.data() + (b * reach + s) * channels;
      for (int64_t c = 0; c < channels; ++c) dst[c] = static_cast<float>(cs[b][c][first_col + s]);
    }
  }

  at::parallel_for(0, bsz * n, grain_for(channels * width), [&](int64_t begin, int64_t end) {
    std::vector<float> acc(channels);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / n, i = row % n;
      // Taps oldest first: the last is the node itself, the one before its parent, and so on. Taps above the
      // root (the oldest `from_state` of them) are the last columns of the committed state.
      const scalar_t* node_tap[kMaxConvWidth];
      int64_t from_state = width;
      for (int64_t node = i; from_state > 0 && node >= 0; node = par[b * n + node]) {
        node_tap[--from_state] = x_ptr + b * x_sb + node * x_sn;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = 0; s < width; ++s) {
        const float* w = weight_rows.data() + s * channels;
        if (s < from_state) {
          add_weighted(acc.data(), w, state_rows.data() + (b * reach + reach - from_state + s) * channels, channels);
        } else {
          add_weighted(acc.data(), w, node_tap[s], channels);
        }
      }
      scalar_t* o = out_ptr + row * channels;
      for (int64_t c = 0; c < channels; ++c) {
        float y = acc[c];
        if (bias != nullptr) y += static_cast<float>(bias[c]);
        o[c] = static_cast<scalar_t>(y);
      }
    }
  });
}

// dst [B, N, heads, dim] float32 <- src * scale, l2-normalised first when asked (q and k of the delta rule).
template <typename scalar_t>
void normalise_rows(const at::Tensor& src, bool use_l2norm, float scale, float* dst) {
  const int64_t n = src.size(1), heads = src.size(2), dim = src.size(3);
  const int64_t sb = src.stride(0), sn = src.stride(1), sh = src.stride(2);
  const scalar_t* src_ptr = src.data_ptr<scalar_t>();
  at::parallel_for(0, src.size(0) * n * heads, grain_for(dim), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (n * heads), i = (row / heads) % n, h = row % heads;
      const scalar_t* from = src_ptr + b * sb + i * sn + h * sh;
      float* to = dst + row * dim;
      for (int64_t t = 0; t < dim; ++t) to[t] = static_cast<float>(from[t]);
      const float factor = use_l2norm ? scale / std::sqrt(dot(to, to, dim) + kL2NormEps) : scale;
      if (factor != 1.f) {
        for (int64_t t = 0; t < dim; ++t) to[t] *= factor;
      }
    }
  });
}

// h0k = H0^T k and h0q = H0^T q for H0 [kdim, vdim], in one sweep over the rows of H0. Streaming whole rows
// keeps the inner loop contiguous and vectorisable; register-blocked variants measured slower.
inline void read_state(const float* h0, int64_t kdim, int64_t vdim, const float* k, const float* q,
                       float* __restrict h0k, float* __restrict h0q) {
  std::fill(h0k, h0k + vdim, 0.f);
  std::fill(h0q, h0q + vdim, 0.f);
  for (int64_t r = 0; r < kdim; ++r) {
    const float* row = h0 + r * vdim;
    const float kr = k[r], qr = q[r];
    for (int64_t c = 0; c < vdim; ++c) {
      h0k[c] += kr * row[c];
      h0q[c] += qr * row[c];
    }
  }
}

// One task per (row b, value head hv), nodes in index order. With H0 = state[b, hv] and G the log decay
// summed along the path (DESIGN.md section 4):
//   u_i = beta_i (v_i - e^{G_i} H0^T k_i - sum_{j in anc(i), j != i} e^{G_i - G_j} (k_i . k_j) u_j)
//   o_i = e^{G_i} H0^T q_i + sum_{j in path(i)} e^{G_i - G_j} (q_i . k_j) u_j      (q scaled)
// H0 stays in cache across the task's nodes and no per-node K x V state is formed. Decays between two nodes
// are the exp of the difference of their G, never a ratio of two exps (which underflows to 0/0 on deep paths).
template <typename scalar_t>
void tree_gated_delta_rule_kernel(const float* qs, const float* kn, int64_t heads, const at::Tensor& v,
                                  const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                                  const at::Tensor& parent, at::Tensor& out, at::Tensor& stash_u,
                                  at::Tensor& stash_cumg) {
  const int64_t n = v.size(1), vheads = v.size(2), vdim = v.size(3), kdim = state.size(2);
  const int64_t group = vheads / heads;
  const int64_t v_sb = v.stride(0), v_sn = v.stride(1), v_sh = v.stride(2);
  const scalar_t* v_ptr = v.data_ptr<scalar_t>();
  const float* g_ptr = g.data_ptr<float>();
  const float* beta_ptr = beta.data_ptr<float>();
  const float* state_ptr = state.data_ptr<float>();
  const int32_t* par = parent.data_ptr<int32_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  float* u_ptr = stash_u.data_ptr<float>();
  float* cumg_ptr = stash_cumg.data_ptr<float>();

  at::parallel_for(0, v.size(0) * vheads, grain_for(n * kdim * vdim), [&](int64_t begin, int64_t end) {
    std::vector<float> h0k(vdim), h0q(vdim);  // H0^T k_i, H0^T q_i
    std::vector<float> cumg(n);
    std::vector<float> u_acc(vdim), o_acc(vdim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / vheads, hv = task % vheads, h = hv / group;
      const float* h0 = state_ptr + task * kdim * vdim;
      // Node i's rows of this (b, hv) in the [B, N, heads, dim] buffers.
      auto key_of = [&](int64_t i) { return kn + ((b * n + i) * heads + h) * kdim; };
      auto query_of = [&](int64_t i) { return qs + ((b * n + i) * heads + h) * kdim; };
      auto u_of = [&](int64_t i) { return u_ptr + ((b * n + i) * vheads + hv) * vdim; };
      auto per_head = [&](int64_t i) { return (b * n + i) * vheads + hv; };

      for (int64_t i = 0; i < n; ++i) {
        const float* ki = key_of(i);
        const float* qi = query_of(i);
        const int32_t p = par[b * n + i];
        cumg[i] = (p >= 0 ? cumg[p] : 0.f) + g_ptr[per_head(i)];
        cumg_ptr[per_head(i)] = cumg[i];
        const float decay_from_h0 = std::exp(cumg[i]);
        read_state(h0, kdim, vdim, ki, qi, h0k.data(), h0q.data());
        const scalar_t* vi = v_ptr + b * v_sb + i * v_sn + hv * v_sh;
        for (int64_t c = 0; c < vdim; ++c) {
          u_acc[c] = static_cast<float>(vi[c]) - decay_from_h0 * h0k[c];
          o_acc[c] = decay_from_h0 * h0q[c];
        }
        for (int64_t j = par[b * n + i]; j >= 0; j = par[b * n + j]) {
          const float decay = std::exp(cumg[i] - cumg[j]);
          const float* kj = key_of(j);
          const float ck = decay * dot(ki, kj, kdim);
          const float cq = decay * dot(qi, kj, kdim);
          const float* uj = u_of(j);
          for (int64_t c = 0; c < vdim; ++c) {
            u_acc[c] -= ck * uj[c];
            o_acc[c] += cq * uj[c];
          }
        }
        const float bi = beta_ptr[per_head(i)];
        const float cq_self = dot(qi, ki, kdim);
        float* ui = u_of(i);
        scalar_t* oi = out_ptr + per_head(i) * vdim;
        for (int64_t c = 0; c < vdim; ++c) {
          ui[c] = bi * u_acc[c];
          oi[c] = static_cast<scalar_t>(o_acc[c] + cq_self * ui[c]);
        }
      }
    }
  });
}

}  // namespace

void check_tree_conv1d(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& maybe_bias,
                       const at::Tensor& conv_state, const at::Tensor& parent, const at::Tensor& out, const char* op) {
  DDTREE_CHECK_DIM(op, x, 3);
  DDTREE_CHECK_FLOAT(op, x);
  DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, x);
  const int64_t bsz = x.size(0), n = x.size(1), channels = x.size(2);

  DDTREE_CHECK_DIM(op, weight, 2);
  DDTREE_CHECK(op, weight.size(0) == channels, "weight must have shape [C, W] with C = ", channels,
               " (x's channels), got ", shape_str(weight.sizes()));
  const int64_t width = weight.size(1);
  DDTREE_CHECK(op, width >= 1 && width <= kMaxConvWidth, "weight's width W must be in [1, ", kMaxConvWidth,
               "], got shape ", shape_str(weight.sizes()));
  DDTREE_CHECK_DTYPE(op, weight, x.scalar_type());
  DDTREE_CHECK_CONTIGUOUS(op, weight);
  DDTREE_CHECK_SAME_DEVICE(op, x, weight);

  if (maybe_bias.has_value()) {
    const at::Tensor& bias = *maybe_bias;
    CHECK_DENSE(op, x, bias, x.scalar_type(), {channels});
  }

  DDTREE_CHECK_DIM(op, conv_state, 3);
  DDTREE_CHECK(op, conv_state.size(0) == bsz && conv_state.size(1) == channels, "conv_state must have shape [B, C, S] = [",
               bsz, ", ", channels, ", S], got ", shape_str(conv_state.sizes()));
  DDTREE_CHECK(op, conv_state.size(2) >= width - 1, "conv_state must hold at least W - 1 = ", width - 1,
               " columns for weight's width W = ", width, ", got shape ", shape_str(conv_state.sizes()));
  DDTREE_CHECK_DTYPE(op, conv_state, x.scalar_type());
  DDTREE_CHECK_SAME_DEVICE(op, x, conv_state);

  CHECK_DENSE(op, x, parent, at::kInt, {bsz, n});

  CHECK_DENSE(op, x, out, x.scalar_type(), {bsz, n, channels});
  // A node's window reads its ancestors' x rows, which other nodes' outputs would overwrite.
  for (const at::Tensor* t : {&x, &weight, &conv_state}) {
    DDTREE_CHECK(op, !may_overlap(*t, out), "out must not overlap ",
                 t == &x ? "x" : t == &weight ? "weight" : "conv_state");
  }
  if (maybe_bias.has_value()) DDTREE_CHECK(op, !may_overlap(*maybe_bias, out), "out must not overlap bias");
}

void tree_conv1d_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                     const at::Tensor& conv_state, const at::Tensor& parent, bool silu, at::Tensor& out) {
  check_tree_conv1d(x, weight, bias, conv_state, parent, out);
  check_parent_values("tree_conv1d", parent);
  DDTREE_DISPATCH_FLOAT(x.scalar_type(), "tree_conv1d", [&] {
    const scalar_t* bias_ptr = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    tree_conv1d_kernel<scalar_t>(x, weight, bias_ptr, conv_state, parent, out);
  });
  // The activation of the rounded conv is torch's own SiLU, as in HF's torch path: on the CPU its vectorised exp
  // differs from std::exp by an ulp at times, and a bf16 tree would then leave the chain's logits.
  if (silu) at::silu_(out);
}

void check_tree_gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                                 const at::Tensor& parent, const at::Tensor& out, const at::Tensor& stash_u,
                                 const at::Tensor& stash_k, const at::Tensor& stash_cumg, const char* op) {
  DDTREE_CHECK_DIM(op, q, 4);
  DDTREE_CHECK_FLOAT(op, q);
  DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, q);
  const int64_t bsz = q.size(0), n = q.size(1), heads = q.size(2), kdim = q.size(3);
  DDTREE_CHECK(op, heads >= 1, "q must have at least one head, got shape ", shape_str(q.sizes()));

  DDTREE_CHECK_SHAPE(op, k, {bsz, n, heads, kdim});
  DDTREE_CHECK_DTYPE(op, k, q.scalar_type());
  DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, k);
  DDTREE_CHECK_SAME_DEVICE(op, q, k);

  DDTREE_CHECK_DIM(op, v, 4);
  DDTREE_CHECK(op, v.size(0) == bsz && v.size(1) == n, "v must have shape [B, N, HV, V] with [B, N] = [", bsz, ", ",
               n, "] (q's), got ", shape_str(v.sizes()));
  const int64_t vheads = v.size(2), vdim = v.size(3);
  DDTREE_CHECK(op, vheads % heads == 0, "v's value heads HV = ", vheads, " must be a multiple of q's key heads H = ",
               heads);
  DDTREE_CHECK_DTYPE(op, v, q.scalar_type());
  DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, v);
  DDTREE_CHECK_SAME_DEVICE(op, q, v);

  CHECK_DENSE(op, q, g, at::kFloat, {bsz, n, vheads});
  CHECK_DENSE(op, q, beta, at::kFloat, {bsz, n, vheads});
  CHECK_DENSE(op, q, state, at::kFloat, {bsz, vheads, kdim, vdim});

  CHECK_DENSE(op, q, parent, at::kInt, {bsz, n});

  CHECK_DENSE(op, q, out, v.scalar_type(), {bsz, n, vheads, vdim});
  CHECK_DENSE(op, q, stash_u, at::kFloat, {bsz, n, vheads, vdim});
  CHECK_DENSE(op, q, stash_k, at::kFloat, {bsz, n, heads, kdim});
  CHECK_DENSE(op, q, stash_cumg, at::kFloat, {bsz, n, vheads});
  // Inputs are read after outputs are written (the stashes before the products), and the state is read only.
  check_outputs_apart(op,
                      {{"out", &out}, {"stash_u", &stash_u}, {"stash_k", &stash_k}, {"stash_cumg", &stash_cumg},
                       {"q", &q}, {"k", &k}, {"v", &v}, {"g", &g}, {"beta", &beta}, {"state", &state},
                       {"parent", &parent}},
                      4);
}

void tree_gated_delta_rule_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                               const at::Tensor& beta, const at::Tensor& state, const at::Tensor& parent,
                               double scale, bool use_qk_l2norm, at::Tensor& out, at::Tensor& stash_u,
                               at::Tensor& stash_k, at::Tensor& stash_cumg) {
  check_tree_gated_delta_rule(q, k, v, g, beta, state, parent, out, stash_u, stash_k, stash_cumg);
  check_parent_values("tree_gated_delta_rule", parent);
  // Keys go straight to their stash; queries, normalised and scaled, to a scratch buffer.
  std::vector<float> queries(q.numel());
  DDTREE_DISPATCH_FLOAT(q.scalar_type(), "tree_gated_delta_rule", [&] {
    normalise_rows<scalar_t>(k, use_qk_l2norm, 1.f, stash_k.data_ptr<float>());
    normalise_rows<scalar_t>(q, use_qk_l2norm, static_cast<float>(scale), queries.data());
    tree_gated_delta_rule_kernel<scalar_t>(queries.data(), stash_k.data_ptr<float>(), q.size(2), v, g, beta, state,
                                           parent, out, stash_u, stash_cumg);
  });
}

GdnConvBuffers check_gdn_conv_delta_rule(const at::Tensor& x, const at::Tensor& conv_weight,
                                     const c10::optional<at::Tensor>& conv_bias, const at::Tensor& conv_state,
                                     const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                                     const at::Tensor& parent, int64_t heads, int64_t kdim, const at::Tensor& out,
                                     const at::Tensor& stash_u, const at::Tensor& stash_k,
                                     const at::Tensor& stash_cumg) {
  constexpr const char* op = "gdn_conv_delta_rule";
  DDTREE_CHECK_DIM(op, x, 3);
  DDTREE_CHECK_FLOAT(op, x);
  DDTREE_CHECK(op, heads >= 1, "num_heads must be >= 1, got ", heads);
  DDTREE_CHECK(op, kdim >= 1, "head_k_dim must be >= 1, got ", kdim);
  DDTREE_CHECK_DIM(op, out, 4);
  const int64_t channels = x.size(2), value_heads = out.size(2), vdim = out.size(3);
  DDTREE_CHECK(op, value_heads >= 1 && vdim >= 1 && channels == 2 * heads * kdim + value_heads * vdim,
               "x's channels C = ", channels, " must be 2 * num_heads * head_k_dim + HV * V = 2 * ", heads, " * ", kdim,
               " + ", value_heads, " * ", vdim, " (HV, V from out's shape ", shape_str(out.sizes()), ")");
  DDTREE_CHECK(op, value_heads % heads == 0, "out's value heads HV = ", value_heads,
               " must be a multiple of num_heads = ", heads);
  // The conv's output, in x's layout: checked as the conv's out, then split as the delta rule's q, k and v.
  const int64_t bsz = x.size(0), n = x.size(1), key_dim = heads * kdim;
  at::Tensor conv_out = at::empty({bsz, n, channels}, x.options());
  check_tree_conv1d(x, conv_weight, conv_bias, conv_state, parent, conv_out, op);
  GdnConvBuffers buffers{conv_out,
                         {conv_out.narrow(2, 0, key_dim).view({bsz, n, heads, kdim}),
                          conv_out.narrow(2, key_dim, key_dim).view({bsz, n, heads, kdim}),
                          conv_out.narrow(2, 2 * key_dim, value_heads * vdim).view({bsz, n, value_heads, vdim})}};
  const auto& qkv = buffers.qkv;
  check_tree_gated_delta_rule(qkv[0], qkv[1], qkv[2], g, beta, state, parent, out, stash_u, stash_k, stash_cumg, op);
  // The outputs against the conv's inputs (the delta rule's own check saw only the conv's output, which stands in
  // for q, k and v here).
  check_outputs_apart(op,
                      {{"out", &out}, {"stash_u", &stash_u}, {"stash_k", &stash_k}, {"stash_cumg", &stash_cumg},
                       {"x", &x}, {"conv_state", &conv_state}},
                      4);
  return buffers;
}

void gdn_conv_delta_rule_cpu(const at::Tensor& x, const at::Tensor& conv_weight,
                             const c10::optional<at::Tensor>& conv_bias, const at::Tensor& conv_state,
                             const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                             const at::Tensor& parent, int64_t heads, int64_t kdim, double scale, bool use_qk_l2norm,
                             at::Tensor& out, at::Tensor& stash_u, at::Tensor& stash_k, at::Tensor& stash_cumg) {
  auto buffers = check_gdn_conv_delta_rule(x, conv_weight, conv_bias, conv_state, g, beta, state, parent, heads, kdim,
                                           out, stash_u, stash_k, stash_cumg);
  check_parent_values("gdn_conv_delta_rule", parent);
  tree_conv1d_cpu(x, conv_weight, conv_bias, conv_state, parent, /*silu=*/true, buffers.conv_out);
  const auto& qkv = buffers.qkv;
  tree_gated_delta_rule_cpu(qkv[0], qkv[1], qkv[2], g, beta, state, parent, scale, use_qk_l2norm, out, stash_u,
                            stash_k, stash_cumg);
}

}  // namespace ddtree
