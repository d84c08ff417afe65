// Layer-body ops on the CPU: the small pieces of a Qwen3 / Qwen3.5 decoder layer that Hugging Face runs as
// chains of elementwise and reduction kernels (an RMSNorm alone is about ten: casts, pow, mean, add, rsqrt,
// multiplies), each done here in one pass with the same rounding points as the HF module it replaces:
//
//   rms_norm     Qwen3RMSNorm (weight * round(x_hat)), Qwen3_5RMSNorm (round(x_hat * (1 + weight))) and
//                Qwen3_5RMSNormGated (round(round(weight * round(x_hat)) * silu(gate)))
//   silu_mul     the SwiGLU of Qwen3MLP / Qwen3_5MLP: round(round(silu(gate)) * up)
//   rope         rotate-half rotary embedding of q or k (apply_rotary_pos_emb, partial rotary included):
//                round(round(x * cos) + round(rotate_half(x) * sin)) on the first R features, the rest copied
//   qk_norm_rope an attention layer's q_norm and k_norm (per head) and the RoPE after them, in one pass
//   sigmoid_mul  Qwen3.5 attention's output gate: round(attn_output * round(sigmoid(gate)))
//   linear       a bias-free projection x W^T (at::mm here; on CUDA a weight-streaming kernel for a round's few rows)
//   gdn_gates    the Gated DeltaNet gates from the layer input: a = round(x W_a^T), b = round(x W_b^T),
//                g = -exp(A_log) * softplus(a + dt_bias), beta = round(sigmoid(b)) (two projections and
//                seven elementwise kernels in HF)
//
// round() is a rounding to the activation dtype; everything between rounding points is float32. The only
// differences from HF are the order of float32 sums (a norm's sum of squares, the gate projections' dot
// products), which move a value by an ulp of float32 before its rounding. Semantics in Python: ddtree_ext/reference.py; where each op is used:
// ddtree_ext/fused.py.
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "activations.h"
#include "checks.h"
#include "ops.h"

namespace ddtree {
namespace {

// A [rows, dim] activation: float dtype like ref, last dim contiguous, any row stride, on ref's device.
void check_rows(const char* op, const char* name, const at::Tensor& ref, const at::Tensor& t, int64_t rows,
                int64_t dim) {
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == rows && t.size(1) == dim, op, ": ", name, " must have shape [",
                    rows, ", ", dim, "], got ", shape_str(t.sizes()));
  TORCH_CHECK_VALUE(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have dtype ", ref.scalar_type(),
                    " like the input, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.stride(1) == 1 || dim == 1, op, ": ", name, " must be contiguous in its last dim, got strides ",
                    shape_str(t.strides()));
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": ", name, " must be on ", ref.device(), " like the input, got ",
                    t.device());
}

// rms_norm's x or gate: [rows, dim] or groups of rows [G, R, dim] with G * R = rows (RowLayout), last dim contiguous.
void check_row_groups(const char* op, const char* name, const at::Tensor& ref, const at::Tensor& t, int64_t rows,
                      int64_t dim) {
  const bool shaped = (t.dim() == 2 && t.size(0) == rows && t.size(1) == dim) ||
                      (t.dim() == 3 && t.size(0) * t.size(1) == rows && t.size(2) == dim);
  TORCH_CHECK_VALUE(shaped, op, ": ", name, " must have shape [", rows, ", ", dim, "] or [G, R, ", dim,
                    "] with G * R = ", rows, ", got ", shape_str(t.sizes()));
  TORCH_CHECK_VALUE(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have dtype ", ref.scalar_type(),
                    " like the input, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.stride(-1) == 1 || dim == 1, op, ": ", name, " must be contiguous in its last dim, got strides ",
                    shape_str(t.strides()));
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": ", name, " must be on ", ref.device(), " like the input, got ",
                    t.device());
}

// The op's first input x: [rows, features >= 1] in a float dtype, last dim contiguous.
void check_input_rows(const char* op, const at::Tensor& x) {
  DDTREE_CHECK_DIM(op, x, 2);
  DDTREE_CHECK_FLOAT(op, x);
  DDTREE_CHECK(op, x.size(1) >= 1, "x must have at least one feature, got shape ", shape_str(x.sizes()));
  check_rows(op, "x", x, x, x.size(0), x.size(1));
}

// t has ref's dtype and sits on ref's device (ref: the op's first input, named ref_name).
void check_like(const char* op, const char* name, const char* ref_name, const at::Tensor& ref, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have dtype ", ref.scalar_type(),
                    " like ", ref_name, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": ", name, " must be on ", ref.device(), " like ", ref_name,
                    ", got ", t.device());
}

void check_like_x(const char* op, const char* name, const at::Tensor& ref, const at::Tensor& t) {
  check_like(op, name, "x", ref, t);
}

// A contiguous [dim] parameter on ref's device.
void check_vector(const char* op, const char* name, const at::Tensor& ref, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == dim, op, ": ", name, " must have shape [", dim, "], got ",
                    shape_str(t.sizes()));
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": ", name, " must be on ", ref.device(), " like the input, got ",
                    t.device());
}

// cos, sin [B, N, R] like the input x named x_name (dtype, device), last dim contiguous, R even in [2, dim].
void check_rotary_tables(const char* op, const char* x_name, const at::Tensor& x, int64_t bsz, int64_t n, int64_t dim,
                         const at::Tensor& cos, const at::Tensor& sin) {
  for (const auto* t : {&cos, &sin}) {
    const char* name = t == &cos ? "cos" : "sin";
    TORCH_CHECK_VALUE(t->dim() == 3 && t->size(0) == bsz && t->size(1) == n, op, ": ", name,
                      " must have shape [B, N, R] = [", bsz, ", ", n, ", R], got ", shape_str(t->sizes()));
    check_like(op, name, x_name, x, *t);
    TORCH_CHECK_VALUE(t->stride(2) == 1 || t->size(2) == 1, op, ": ", name, " must be contiguous in its last dim");
  }
  const int64_t rot = cos.size(2);
  DDTREE_CHECK(op, sin.size(2) == rot, "sin must have shape ", shape_str(cos.sizes()), " like cos, got ",
               shape_str(sin.sizes()));
  DDTREE_CHECK(op, rot >= 2 && rot % 2 == 0 && rot <= dim, "the rotary width R (cos's last dim) must be even and in [2, ",
               dim, "] (the head dim), got ", rot);
}

// With a residual, the row normalised is s = round(x + residual) (HF's `residual + hidden_states`), written to
// sum_out first; the output pass reads it back from there, so sum_out may alias x or the residual.
template <typename T>
void rms_norm_kernel(const T* x_ptr, RowLayout x_rows, int64_t rows, int64_t dim, const at::Tensor& weight,
                     const T* gate, RowLayout gate_rows, const T* residual, int64_t residual_stride, T* sum_out,
                     int64_t sum_stride, float eps, bool zero_centered, at::Tensor& out) {
  const int64_t out_stride = out.stride(0);
  const T* w = weight.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const float inv_dim = 1.f / static_cast<float>(dim);  // torch's mean multiplies by 1/n
  at::parallel_for(0, rows, std::max<int64_t>(1, at::internal::GRAIN_SIZE / dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x_ptr + row_offset(x_rows, r);
      float sum = 0.f;
      if (residual != nullptr) {
        const T* rr = residual + r * residual_stride;
        T* sr = sum_out + r * sum_stride;
        for (int64_t i = 0; i < dim; ++i) {
          const T s = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
          sr[i] = s;
          const float v = static_cast<float>(s);
          sum += v * v;
        }
        xr = sr;
      } else {
        for (int64_t i = 0; i < dim; ++i) {
          const float v = static_cast<float>(xr[i]);
          sum += v * v;
        }
      }
      const float inv_rms = 1.f / std::sqrt(sum * inv_dim + eps);
      T* o = out_ptr + r * out_stride;
      const T* gr = gate != nullptr ? gate + row_offset(gate_rows, r) : nullptr;
      // Every value of the row is read by the sum above before the first write, so out may alias x.
      for (int64_t i = 0; i < dim; ++i) {
        const float normed = static_cast<float>(xr[i]) * inv_rms;
        float y;
        if (zero_centered) {
          y = normed * (1.f + static_cast<float>(w[i]));
        } else {
          y = static_cast<float>(w[i]) * round_to<T>(normed);
          if (gr != nullptr) y = round_to<T>(y) * silu(static_cast<float>(gr[i]));
        }
        o[i] = static_cast<T>(y);
      }
    }
  });
}

template <typename T>
void silu_mul_kernel(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  const int64_t rows = gate.size(0), dim = gate.size(1);
  const T* g = gate.data_ptr<T>();
  const T* u = up.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t gs = gate.stride(0), us = up.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, std::max<int64_t>(1, at::internal::GRAIN_SIZE / dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < dim; ++i) {
        o[r * os + i] = static_cast<T>(round_to<T>(silu(static_cast<float>(g[r * gs + i]))) *
                                       static_cast<float>(u[r * us + i]));
      }
    }
  });
}

template <typename T>
void rope_kernel(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t bsz = x.size(0), heads = x.size(1), n = x.size(2), dim = x.size(3), rot = cos.size(2), half = rot / 2;
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, bsz * heads * n, std::max<int64_t>(1, at::internal::GRAIN_SIZE / dim), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (heads * n), h = (row / n) % heads, i = row % n;
      const T* xr = xp + b * x.stride(0) + h * x.stride(1) + i * x.stride(2);
      const T* c = cp + b * cos.stride(0) + i * cos.stride(1);
      const T* s = sp + b * sin.stride(0) + i * sin.stride(1);
      T* o = op + b * out.stride(0) + h * out.stride(1) + i * out.stride(2);
      for (int64_t e = 0; e < dim; ++e) {
        if (e >= rot) {
          o[e] = xr[e];
          continue;
        }
        const float rotated = e < half ? -static_cast<float>(xr[e + half]) : static_cast<float>(xr[e - half]);
        o[e] = static_cast<T>(round_to<T>(static_cast<float>(xr[e]) * static_cast<float>(c[e])) +
                              round_to<T>(rotated * static_cast<float>(s[e])));
      }
    }
  });
}

// The gates of one (row, head) from its two projections, each already rounded to the activation dtype.
template <typename T>
inline void gdn_gate_values(float a, float b, float A_log, float dt_bias, float* g, float* beta) {
  const float x = a + dt_bias;
  const float softplus = x > 20.f ? x : std::log1p(std::exp(x));  // torch's threshold 20
  *g = -std::exp(A_log) * softplus;
  *beta = round_to<T>(1.f / (1.f + std::exp(-b)));
}

template <typename T, typename A, typename D>
void gdn_gates_kernel(const at::Tensor& x, const at::Tensor& weight_a, const at::Tensor& weight_b,
                      const at::Tensor& A_log, const at::Tensor& dt_bias, at::Tensor& g, at::Tensor& beta) {
  const int64_t rows = x.size(0), features = x.size(1), heads = weight_a.size(0);
  const T* xp = x.data_ptr<T>();
  const T* wa = weight_a.data_ptr<T>();
  const T* wb = weight_b.data_ptr<T>();
  const A* alog = A_log.data_ptr<A>();
  const D* dt = dt_bias.data_ptr<D>();
  float* g_ptr = g.data_ptr<float>();
  float* beta_ptr = beta.data_ptr<float>();
  at::parallel_for(0, rows * heads, std::max<int64_t>(1, at::internal::GRAIN_SIZE / features), [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t r = idx / heads, h = idx % heads;
      const T* xr = xp + r * x.stride(0);
      float a = 0.f, b = 0.f;
      for (int64_t f = 0; f < features; ++f) {
        const float v = static_cast<float>(xr[f]);
        a += v * static_cast<float>(wa[h * features + f]);
        b += v * static_cast<float>(wb[h * features + f]);
      }
      gdn_gate_values<T>(round_to<T>(a), round_to<T>(b), static_cast<float>(alog[h]), static_cast<float>(dt[h]),
                         g_ptr + idx, beta_ptr + idx);
    }
  });
}

// The norm into a [B, N, H, D] buffer, then RoPE out of it: the composition of rms_norm and rope, bit for bit.
template <typename T>
void norm_rope_heads(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos, const at::Tensor& sin,
                     float eps, bool zero_centered, at::Tensor& out) {
  const at::Tensor rows = x.contiguous().view({-1, x.size(3)});
  at::Tensor normed = at::empty_like(rows);
  rms_norm_kernel<T>(rows.data_ptr<T>(), row_layout(rows), rows.size(0), rows.size(1), weight, nullptr,
                     RowLayout{1, 0, 0}, nullptr, 0, nullptr, 0, eps, zero_centered, normed);
  rope_kernel<T>(normed.view(x.sizes()).transpose(1, 2), cos, sin, out);
}

}  // namespace

// ---- checks (metadata only: shared by the CPU and CUDA implementations) ----------------------------

void check_rms_norm(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& gate, double eps,
                    bool zero_centered, const at::Tensor& out) {
  constexpr const char* op = "rms_norm";
  DDTREE_CHECK(op, x.dim() == 2 || x.dim() == 3, "x must have shape [rows, D] or [G, R, D], got shape ",
               shape_str(x.sizes()));
  DDTREE_CHECK_FLOAT(op, x);
  const int64_t dim = x.size(-1), rows = x.dim() == 2 ? x.size(0) : x.size(0) * x.size(1);
  DDTREE_CHECK(op, dim >= 1, "x must have at least one feature, got shape ", shape_str(x.sizes()));
  check_row_groups(op, "x", x, x, rows, dim);
  check_vector(op, "weight", x, weight, dim);
  DDTREE_CHECK_DTYPE(op, weight, x.scalar_type());
  if (gate.has_value()) {
    DDTREE_CHECK(op, !zero_centered, "gate is only supported with zero_centered=False (Qwen3_5RMSNormGated)");
    check_row_groups(op, "gate", x, *gate, rows, dim);
  }
  DDTREE_CHECK(op, std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  check_rows(op, "out", x, out, rows, dim);
  // A row's output pass reads the row again (and the weight, the gate) after others' rows may have been written.
  DDTREE_CHECK(op, !may_overlap(x, out), "out must not overlap x");
  DDTREE_CHECK(op, !may_overlap(weight, out), "out must not overlap weight");
  if (gate.has_value()) DDTREE_CHECK(op, !may_overlap(*gate, out), "out must not overlap gate");
  check_no_self_overlap(op, "out", out);
}

void check_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                        bool zero_centered, const at::Tensor& out, const at::Tensor& residual_out) {
  constexpr const char* op = "add_rms_norm";
  check_input_rows(op, x);
  const int64_t rows = x.size(0), dim = x.size(1);
  check_rows(op, "residual", x, residual, rows, dim);
  check_vector(op, "weight", x, weight, dim);
  DDTREE_CHECK_DTYPE(op, weight, x.scalar_type());
  DDTREE_CHECK(op, std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  check_rows(op, "out", x, out, rows, dim);
  check_rows(op, "residual_out", x, residual_out, rows, dim);
  check_no_self_overlap(op, "out", out);
  check_no_self_overlap(op, "residual_out", residual_out);
  // residual_out is written before the output pass reads it back: it may be x or the residual itself, but out
  // (written last, from residual_out) must be apart from it and from the inputs it may not replace.
  for (const auto* t : {&x, &residual, &residual_out}) {
    DDTREE_CHECK(op, !may_overlap(*t, out), "out must not overlap ",
                 t == &x ? "x" : t == &residual ? "residual" : "residual_out");
  }
  for (const auto* t : {&x, &residual}) {
    DDTREE_CHECK(op, same_elements(*t, residual_out) || !may_overlap(*t, residual_out), "residual_out must be ",
                 t == &x ? "x" : "residual", " itself or apart from it");
  }
  DDTREE_CHECK(op, !may_overlap(weight, residual_out), "residual_out must not overlap weight");
}

void check_silu_mul(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& out) {
  constexpr const char* op = "silu_mul";
  DDTREE_CHECK_DIM(op, gate, 2);
  DDTREE_CHECK_FLOAT(op, gate);
  check_rows(op, "gate", gate, gate, gate.size(0), gate.size(1));
  check_rows(op, "up", gate, up, gate.size(0), gate.size(1));
  check_rows(op, "out", gate, out, gate.size(0), gate.size(1));
  // Elementwise: out may be gate or up itself (in place); any other overlap would read values already written.
  for (const auto* t : {&gate, &up}) {
    DDTREE_CHECK(op, same_elements(*t, out) || !may_overlap(*t, out), "out must not overlap ",
                 t == &gate ? "gate" : "up", " unless it is ", t == &gate ? "gate" : "up", " itself");
  }
  check_no_self_overlap(op, "out", out);
}

void check_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& out) {
  constexpr const char* op = "rope";
  DDTREE_CHECK_DIM(op, x, 4);
  DDTREE_CHECK_FLOAT(op, x);
  DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, x);
  const int64_t bsz = x.size(0), n = x.size(2), dim = x.size(3);
  check_rotary_tables(op, "x", x, bsz, n, dim, cos, sin);
  DDTREE_CHECK_SHAPE(op, out, {x.size(0), x.size(1), n, dim});
  DDTREE_CHECK_DTYPE(op, out, x.scalar_type());
  DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, out);
  DDTREE_CHECK_SAME_DEVICE(op, x, out);
  // Each output element reads two inputs of its row (itself and its rotate-half partner): in place would race.
  DDTREE_CHECK(op, !may_overlap(x, out), "out must not overlap x");
  DDTREE_CHECK(op, !may_overlap(cos, out) && !may_overlap(sin, out), "out must not overlap cos or sin");
  check_no_self_overlap(op, "out", out);
}

namespace {

// The inputs of qk_norm_rope and qk_norm_rope_store_kv: q [B, N, Hq, D], k [B, N, Hk, D], their norms' weights [D],
// the rotary tables [B, N, R] and eps.
void check_qk_norm_rope_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight,
                               const at::Tensor& k_weight, const at::Tensor& cos, const at::Tensor& sin, double eps) {
  DDTREE_CHECK_DIM(op, q, 4);
  DDTREE_CHECK_FLOAT(op, q);
  DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, q);
  const int64_t bsz = q.size(0), n = q.size(1), dim = q.size(3);
  DDTREE_CHECK(op, dim >= 2, "q must have a head dim of at least 2, got shape ", shape_str(q.sizes()));
  TORCH_CHECK_VALUE(k.dim() == 4 && k.size(0) == bsz && k.size(1) == n && k.size(3) == dim, op,
                    ": k must have shape [B, N, Hk, D] = [", bsz, ", ", n, ", Hk, ", dim, "], got ",
                    shape_str(k.sizes()));
  check_like(op, "k", "q", q, k);
  DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, k);
  for (const auto* w : {&q_weight, &k_weight}) {
    const char* name = w == &q_weight ? "q_weight" : "k_weight";
    check_vector(op, name, q, *w, dim);
    check_like(op, name, "q", q, *w);
  }
  check_rotary_tables(op, "q", q, bsz, n, dim, cos, sin);
  DDTREE_CHECK(op, std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
}

// An output (q_out, k_out, or the caches of qk_norm_rope_store_kv) of the given shape, like q, contiguous in its last
// dim, overlapping neither itself nor any input: a row's outputs are written while other rows' inputs (rotate-half
// partners, the norm's sums) may still be read.
void check_qk_norm_rope_output(const char* op, const char* name, const at::Tensor& q, const at::Tensor& out,
                               const std::vector<int64_t>& shape, std::initializer_list<const at::Tensor*> inputs) {
  TORCH_CHECK_VALUE(out.sizes() == at::IntArrayRef(shape), op, ": ", name, " must have shape ", shape_str(shape),
                    ", got ", shape_str(out.sizes()));
  check_like(op, name, "q", q, out);
  TORCH_CHECK_VALUE(out.stride(3) == 1, op, ": ", name, " must be contiguous in its last dim, got strides ",
                    shape_str(out.strides()));
  check_no_self_overlap(op, name, out);
  for (const auto* in : inputs) DDTREE_CHECK(op, !may_overlap(*in, out), name, " must not overlap the inputs");
}

}  // namespace

void check_qk_norm_rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight,
                        const at::Tensor& k_weight, const at::Tensor& cos, const at::Tensor& sin, double eps,
                        const at::Tensor& q_out, const at::Tensor& k_out) {
  constexpr const char* op = "qk_norm_rope";
  check_qk_norm_rope_inputs(op, q, k, q_weight, k_weight, cos, sin, eps);
  const int64_t bsz = q.size(0), n = q.size(1), dim = q.size(3);
  for (const auto* t : {&q_out, &k_out}) {
    check_qk_norm_rope_output(op, t == &q_out ? "q_out" : "k_out", q, *t,
                              {bsz, (t == &q_out ? q : k).size(2), n, dim}, {&q, &k, &q_weight, &k_weight, &cos, &sin});
  }
  DDTREE_CHECK(op, !may_overlap(q_out, k_out), "q_out and k_out must not overlap");
}

void check_qk_norm_rope_store_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& q_weight, const at::Tensor& k_weight, const at::Tensor& cos,
                                 const at::Tensor& sin, double eps, const at::Tensor& slots, const at::Tensor& q_out,
                                 const at::Tensor& keys, const at::Tensor& values) {
  constexpr const char* op = "qk_norm_rope_store_kv";
  check_qk_norm_rope_inputs(op, q, k, q_weight, k_weight, cos, sin, eps);
  const int64_t bsz = q.size(0), n = q.size(1), dim = q.size(3), kv_heads = k.size(2);
  DDTREE_CHECK(op, v.sizes() == k.sizes(), "v must have k's shape ", shape_str(k.sizes()), ", got ",
               shape_str(v.sizes()));
  check_like(op, "v", "q", q, v);
  DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, v);
  TORCH_CHECK_VALUE(slots.dim() == 1 || (slots.dim() == 2 && slots.size(0) == bsz), op,
                    ": slots must have shape [N] (one slot table for every batch row) or [B, N] = [", bsz,
                    ", N], got ", shape_str(slots.sizes()));
  TORCH_CHECK_VALUE(slots.size(-1) == n, op, ": slots must have one slot for each of q's ", n, " nodes, got shape ",
                    shape_str(slots.sizes()));
  DDTREE_CHECK_DTYPE(op, slots, at::kLong);
  DDTREE_CHECK_CONTIGUOUS(op, slots);
  DDTREE_CHECK_SAME_DEVICE(op, q, slots);
  DDTREE_CHECK_DIM(op, keys, 4);
  const std::vector<int64_t> cache_shape = {bsz, kv_heads, keys.size(2), dim};
  const std::initializer_list<const at::Tensor*> inputs = {&q, &k, &v, &q_weight, &k_weight, &cos, &sin, &slots};
  check_qk_norm_rope_output(op, "q_out", q, q_out, {bsz, q.size(2), n, dim}, inputs);
  check_qk_norm_rope_output(op, "keys", q, keys, cache_shape, inputs);
  check_qk_norm_rope_output(op, "values", q, values, cache_shape, inputs);
  DDTREE_CHECK(op, !may_overlap(q_out, keys) && !may_overlap(q_out, values) && !may_overlap(keys, values),
               "q_out, keys and values must not overlap each other");
}

void check_sigmoid_mul(const at::Tensor& gate, const at::Tensor& x, const at::Tensor& out) {
  constexpr const char* op = "sigmoid_mul";
  check_input_rows(op, x);
  const int64_t rows = x.size(0), dim = x.size(1);
  check_row_groups(op, "gate", x, gate, rows, dim);
  check_rows(op, "out", x, out, rows, dim);
  check_no_self_overlap(op, "out", out);
  // Elementwise: out may be x itself (in place); any other overlap would read values already written.
  DDTREE_CHECK(op, !may_overlap(gate, out), "out must not overlap gate");
  DDTREE_CHECK(op, same_elements(x, out) || !may_overlap(x, out), "out must not overlap x unless it is x itself");
}

void check_gdn_gates(const at::Tensor& x, const at::Tensor& weight_a, const at::Tensor& weight_b,
                     const at::Tensor& A_log, const at::Tensor& dt_bias, const at::Tensor& g, const at::Tensor& beta) {
  constexpr const char* op = "gdn_gates";
  check_input_rows(op, x);
  const int64_t rows = x.size(0), features = x.size(1);
  DDTREE_CHECK_DIM(op, weight_a, 2);
  const int64_t heads = weight_a.size(0);
  for (const auto* t : {&weight_a, &weight_b}) {
    const char* name = t == &weight_a ? "weight_a" : "weight_b";
    TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == heads && t->size(1) == features, op, ": ", name,
                      " must have shape [HV, F] = [", heads, ", ", features, "], got ", shape_str(t->sizes()));
    check_like_x(op, name, x, *t);
    TORCH_CHECK_VALUE(t->is_contiguous(), op, ": ", name, " must be contiguous");
  }
  check_vector(op, "A_log", x, A_log, heads);
  DDTREE_CHECK_FLOAT(op, A_log);
  check_vector(op, "dt_bias", x, dt_bias, heads);
  DDTREE_CHECK_FLOAT(op, dt_bias);
  for (const auto* t : {&g, &beta}) {
    const char* name = t == &g ? "g" : "beta";
    TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == rows && t->size(1) == heads, op, ": ", name,
                      " must have shape [", rows, ", ", heads, "], got ", shape_str(t->sizes()));
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat, op, ": ", name, " must have dtype Float, got ",
                      t->scalar_type());
    TORCH_CHECK_VALUE(t->is_contiguous(), op, ": ", name, " must be contiguous");
    TORCH_CHECK_VALUE(t->device() == x.device(), op, ": ", name, " must be on ", x.device(), " like x, got ",
                      t->device());
  }
}

void check_linear(const char* op, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  check_input_rows(op, x);
  const int64_t rows = x.size(0), features = x.size(1);
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == features, op, ": weight must have shape [N, ", features,
                    "] (K = x's features), got ", shape_str(weight.sizes()));
  check_like_x(op, "weight", x, weight);
  TORCH_CHECK_VALUE(weight.stride(1) == 1 || features == 1, op,
                    ": weight must be contiguous in its last dim, got strides ", shape_str(weight.strides()));
  check_rows(op, "out", x, out, rows, weight.size(0));
  for (const auto* t : {&x, &weight}) {
    DDTREE_CHECK(op, !may_overlap(*t, out), "out must not overlap ", t == &x ? "x" : "weight");
  }
}

void check_linear_cublaslt(const char* op, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  check_linear(op, x, weight, out);
  // cuBLASLt reads each operand as a matrix whose leading dimension spans a row: rows may lie further apart than
  // their length (a row block of a stacked weight, a slice of wider rows), never closer.
  const int64_t rows = x.size(0), n = weight.size(0), k = x.size(1);
  DDTREE_CHECK(op, rows == 1 || x.stride(0) >= k, "x's rows must lie at least K = ", k,
               " elements apart, got strides ", shape_str(x.strides()));
  DDTREE_CHECK(op, n == 1 || weight.stride(0) >= k, "weight's rows must lie at least K = ", k,
               " elements apart, got strides ", shape_str(weight.strides()));
  DDTREE_CHECK(op, rows == 1 || out.stride(0) >= n, "out's rows must lie at least N = ", n,
               " elements apart, got strides ", shape_str(out.strides()));
}

// ---- CPU implementations ---------------------------------------------------------------------------

void rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& gate, double eps,
                  bool zero_centered, at::Tensor& out) {
  check_rms_norm(x, weight, gate, eps, zero_centered, out);
  if (out.size(0) == 0) return;
  DDTREE_DISPATCH_FLOAT(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* gate_ptr = gate.has_value() ? gate->data_ptr<scalar_t>() : nullptr;
    const RowLayout gate_rows = gate.has_value() ? row_layout(*gate) : RowLayout{1, 0, 0};
    rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), row_layout(x), out.size(0), x.size(-1), weight, gate_ptr,
                              gate_rows, nullptr, 0, nullptr, 0, static_cast<float>(eps), zero_centered, out);
  });
}

void add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                      bool zero_centered, at::Tensor& out, at::Tensor& residual_out) {
  check_add_rms_norm(x, residual, weight, eps, zero_centered, out, residual_out);
  if (x.size(0) == 0) return;
  DDTREE_DISPATCH_FLOAT(x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), row_layout(x), x.size(0), x.size(1), weight, nullptr,
                              RowLayout{1, 0, 0}, residual.data_ptr<scalar_t>(), residual.stride(0),
                              residual_out.data_ptr<scalar_t>(), residual_out.stride(0), static_cast<float>(eps),
                              zero_centered, out);
  });
}

void silu_mul_cpu(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  check_silu_mul(gate, up, out);
  if (gate.numel() == 0) return;
  DDTREE_DISPATCH_FLOAT(gate.scalar_type(), "silu_mul", [&] { silu_mul_kernel<scalar_t>(gate, up, out); });
}

void linear_mm(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out) { at::mm_out(out, x, weight.t()); }

void linear_cpu(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, bool /*prefetch_weight*/) {
  check_linear("linear", x, weight, out);
  if (out.numel() == 0) return;
  linear_mm(x, weight, out);
}

void check_linear_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  check_linear("linear_gemv", x, weight, out);
  DDTREE_CHECK("linear_gemv", x.size(0) == 1, "x must have one row (a decode step's), got shape ",
               shape_str(x.sizes()));
}

void linear_gemv_cpu(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, bool /*prefetch_weight*/) {
  check_linear_gemv(x, weight, out);
  if (out.numel() == 0) return;
  linear_mm(x, weight, out);
}

// The CPU op has one algorithm, at::mm (the CUDA op's are cuBLASLt's candidates: csrc/linear_cublaslt_cuda.cpp).
int64_t linear_cublaslt_algorithms_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  check_linear_cublaslt("linear_cublaslt_algorithms", x, weight, out);
  return 1;
}

std::string linear_cublaslt_describe_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out,
                                         int64_t algorithm) {
  check_linear_cublaslt("linear_cublaslt_describe", x, weight, out);
  TORCH_CHECK_VALUE(algorithm == 0, "linear_cublaslt_describe: algorithm must be 0 on the CPU (at::mm), got ",
                    algorithm);
  return "at::mm";
}

void linear_cublaslt_cpu(const at::Tensor& x, const at::Tensor& weight, int64_t algorithm, at::Tensor& out) {
  check_linear_cublaslt("linear_cublaslt", x, weight, out);
  TORCH_CHECK_VALUE(algorithm == 0, "linear_cublaslt: algorithm must be 0 on the CPU (at::mm), got ", algorithm);
  if (out.numel() == 0) return;
  linear_mm(x, weight, out);
}

void check_gqa_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                         const at::Tensor& out, int64_t num_splits) {
  constexpr const char* op = "gqa_attention";
  DDTREE_CHECK(op, num_splits >= 0, "num_splits must be >= 0 (0: the op's own choice), got ", num_splits);
  DDTREE_CHECK_DIM(op, q, 4);
  DDTREE_CHECK_FLOAT(op, q);
  DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, q);
  const int64_t bsz = q.size(0), heads = q.size(1), n = q.size(2), dim = q.size(3);
  DDTREE_CHECK_DIM(op, k, 4);
  DDTREE_CHECK(op, k.size(0) == bsz && k.size(3) == dim && k.size(1) >= 1 && heads % k.size(1) == 0,
               "k must have shape [B, Hkv, S, D] = [", bsz, ", Hkv, S, ", dim, "] with Hkv dividing H = ", heads,
               ", got ", shape_str(k.sizes()));
  const int64_t slots = k.size(2);
  DDTREE_CHECK_SHAPE(op, v, {bsz, k.size(1), slots, dim});
  for (const auto* t : {&k, &v, &out}) {
    const char* name = t == &k ? "k" : t == &v ? "v" : "out";
    DDTREE_CHECK(op, t->scalar_type() == q.scalar_type(), name, " must have dtype ", q.scalar_type(), " like q, got ",
                 t->scalar_type());
    DDTREE_CHECK(op, t->device() == q.device(), name, " must be on ", q.device(), " like q, got ", t->device());
    DDTREE_CHECK(op, t->dim() == 0 || t->stride(-1) == 1 || t->size(-1) == 1, name,
                 " must be contiguous in its last dim, got strides ", shape_str(t->strides()));
  }
  DDTREE_CHECK_SHAPE(op, out, {bsz, heads, n, dim});
  DDTREE_CHECK_DTYPE(op, mask, at::kBool);
  DDTREE_CHECK_SAME_DEVICE(op, q, mask);
  DDTREE_CHECK(op, mask.dim() == 4 && (mask.size(0) == bsz || mask.size(0) == 1) && mask.size(1) == 1 &&
                       (mask.size(2) == n || mask.size(2) == 1) && mask.size(3) == slots,
               "mask must have shape [B or 1, 1, N or 1, S] = [", bsz, ", 1, ", n, ", ", slots, "], got ",
               shape_str(mask.sizes()));
  DDTREE_CHECK(op, !may_overlap(q, out), "out must not overlap q");
  DDTREE_CHECK(op, !may_overlap(k, out), "out must not overlap k");
  DDTREE_CHECK(op, !may_overlap(v, out), "out must not overlap v");
  check_no_self_overlap(op, "out", out);
}

void gqa_attention_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                        double scale, at::Tensor& out) {
  const int64_t group = q.size(1) / k.size(1);
  const at::Tensor kr = group == 1 ? k : k.repeat_interleave(group, 1);
  const at::Tensor vr = group == 1 ? v : v.repeat_interleave(group, 1);
  out.copy_(at::scaled_dot_product_attention(q, kr, vr, mask, 0.0, false, scale));
  // A row with no key to attend: zeros (what SDPA's math path gives since torch 2.5, whatever this torch does).
  out.masked_fill_(mask.logical_not().all(-1, /*keepdim=*/true), 0);
}

// num_splits only steers the CUDA kernel's split of the keys; the CPU op checks it and runs SDPA unsplit.
void gqa_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                       double scale, at::Tensor& out, int64_t num_splits) {
  check_gqa_attention(q, k, v, mask, out, num_splits);
  if (k.size(2) == 0) {  // no keys: every row attends to nothing
    out.zero_();
    return;
  }
  if (out.numel() == 0) return;
  gqa_attention_sdpa(q, k, v, mask, scale, out);
}

void rope_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  check_rope(x, cos, sin, out);
  if (x.numel() == 0) return;
  DDTREE_DISPATCH_FLOAT(x.scalar_type(), "rope", [&] { rope_kernel<scalar_t>(x, cos, sin, out); });
}

void qk_norm_rope_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight, const at::Tensor& k_weight,
                      const at::Tensor& cos, const at::Tensor& sin, double eps, bool zero_centered, at::Tensor& q_out,
                      at::Tensor& k_out) {
  check_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, q_out, k_out);
  DDTREE_DISPATCH_FLOAT(q.scalar_type(), "qk_norm_rope", [&] {
    if (q.numel() != 0) norm_rope_heads<scalar_t>(q, q_weight, cos, sin, static_cast<float>(eps), zero_centered, q_out);
    if (k.numel() != 0) norm_rope_heads<scalar_t>(k, k_weight, cos, sin, static_cast<float>(eps), zero_centered, k_out);
  });
}

void qk_norm_rope_store_kv_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& q_weight, const at::Tensor& k_weight, const at::Tensor& cos,
                               const at::Tensor& sin, double eps, bool zero_centered, const at::Tensor& slots,
                               at::Tensor& q_out, at::Tensor& keys, at::Tensor& values) {
  constexpr const char* op = "qk_norm_rope_store_kv";
  check_qk_norm_rope_store_kv(q, k, v, q_weight, k_weight, cos, sin, eps, slots, q_out, keys, values);
  check_slots_below(op, slots, keys.size(2));  // before anything is written
  at::Tensor k_out = at::empty({k.size(0), k.size(2), k.size(1), k.size(3)}, k.options());
  qk_norm_rope_cpu(q, k, q_weight, k_weight, cos, sin, eps, zero_centered, q_out, k_out);
  store_kv_cpu(keys, values, slots, k_out, v.transpose(1, 2));
}

// torch's own sigmoid and multiply, for HF's bits: on the CPU torch's float32 sigmoid gives other bits in its
// vectorised loop than in its scalar one (an exp of its own against std::exp), and which one an element takes depends
// on the layout; HF runs it over the gate copied contiguous (gate.reshape), and so does this.
void sigmoid_mul_cpu(const at::Tensor& gate, const at::Tensor& x, at::Tensor& out) {
  check_sigmoid_mul(gate, x, out);
  if (x.numel() == 0) return;
  at::mul_out(out, x, at::sigmoid(gate.reshape({x.size(0), x.size(1)}).contiguous()));
}

void gdn_gates_cpu(const at::Tensor& x, const at::Tensor& weight_a, const at::Tensor& weight_b, const at::Tensor& A_log,
                   const at::Tensor& dt_bias, at::Tensor& g, at::Tensor& beta) {
  check_gdn_gates(x, weight_a, weight_b, A_log, dt_bias, g, beta);
  if (g.numel() == 0) return;
  DDTREE_DISPATCH_FLOAT(x.scalar_type(), "gdn_gates", [&] {
    using T = scalar_t;
    DDTREE_DISPATCH_FLOAT(A_log.scalar_type(), "gdn_gates", [&] {
      using A = scalar_t;
      DDTREE_DISPATCH_FLOAT(dt_bias.scalar_type(), "gdn_gates",
                            [&] { gdn_gates_kernel<T, A, scalar_t>(x, weight_a, weight_b, A_log, dt_bias, g, beta); });
    });
  });
}

}  // namespace ddtree
