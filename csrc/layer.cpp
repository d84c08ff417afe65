// Layer-body ops on the CPU: the small pieces of a Qwen3 / Qwen3.5 decoder layer that Hugging Face runs as
// chains of elementwise and reduction kernels (an RMSNorm alone is about ten: casts, pow, mean, add, rsqrt,
// multiplies), each done here in one pass with the same rounding points as the HF module it replaces:
//
//   rms_norm     Qwen3RMSNorm (weight * round(x_hat)), Qwen3_5RMSNorm (round(x_hat * (1 + weight))) and
//                Qwen3_5RMSNormGated (round(round(weight * round(x_hat)) * silu(gate)))
//   silu_mul     the SwiGLU of Qwen3MLP / Qwen3_5MLP: round(round(silu(gate)) * up)
//   gdn_gating   the Gated DeltaNet gates: g = -exp(A_log) * softplus(a + dt_bias), beta = round(sigmoid(b))
//
// round() is a rounding to the activation dtype; everything between rounding points is float32. The only
// difference from HF is the order of the float32 sum of squares, which moves a normalised value by at most
// an ulp of float32. Semantics in Python: ddtree_ext/reference.py; where each op is used:
// ddtree_ext/fused.py.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

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

// A contiguous [dim] parameter on ref's device.
void check_vector(const char* op, const char* name, const at::Tensor& ref, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == dim, op, ": ", name, " must have shape [", dim, "], got ",
                    shape_str(t.sizes()));
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": ", name, " must be on ", ref.device(), " like the input, got ",
                    t.device());
}

template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

template <typename T>
void rms_norm_kernel(const at::Tensor& x, const at::Tensor& weight, const T* gate, int64_t gate_stride, float eps,
                     bool zero_centered, at::Tensor& out) {
  const int64_t rows = x.size(0), dim = x.size(1);
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  const T* x_ptr = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const float inv_dim = 1.f / static_cast<float>(dim);  // torch's mean multiplies by 1/n
  at::parallel_for(0, rows, std::max<int64_t>(1, at::internal::GRAIN_SIZE / dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x_ptr + r * x_stride;
      float sum = 0.f;
      for (int64_t i = 0; i < dim; ++i) {
        const float v = static_cast<float>(xr[i]);
        sum += v * v;
      }
      const float inv_rms = 1.f / std::sqrt(sum * inv_dim + eps);
      T* o = out_ptr + r * out_stride;
      const T* gr = gate != nullptr ? gate + r * gate_stride : nullptr;
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

template <typename T, typename A, typename D>
void gdn_gating_kernel(const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log, const at::Tensor& dt_bias,
                       at::Tensor& g, at::Tensor& beta) {
  const int64_t rows = a.size(0), heads = a.size(1);
  const T* a_ptr = a.data_ptr<T>();
  const T* b_ptr = b.data_ptr<T>();
  const A* alog = A_log.data_ptr<A>();
  const D* dt = dt_bias.data_ptr<D>();
  float* g_ptr = g.data_ptr<float>();
  float* beta_ptr = beta.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      const float x = static_cast<float>(a_ptr[r * a.stride(0) + h]) + static_cast<float>(dt[h]);
      const float softplus = x > 20.f ? x : std::log1p(std::exp(x));  // torch's threshold 20
      g_ptr[r * heads + h] = -std::exp(static_cast<float>(alog[h])) * softplus;
      const float bv = static_cast<float>(b_ptr[r * b.stride(0) + h]);
      beta_ptr[r * heads + h] = round_to<T>(1.f / (1.f + std::exp(-bv)));
    }
  }
}

}  // namespace

// ---- checks (metadata only: shared by the CPU and CUDA implementations) ----------------------------

void check_rms_norm(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& gate, double eps,
                    bool zero_centered, const at::Tensor& out) {
  constexpr const char* op = "rms_norm";
  DDTREE_CHECK_DIM(op, x, 2);
  DDTREE_CHECK_FLOAT(op, x);
  const int64_t rows = x.size(0), dim = x.size(1);
  DDTREE_CHECK(op, dim >= 1, "x must have at least one feature, got shape ", shape_str(x.sizes()));
  check_rows(op, "x", x, x, rows, dim);
  check_vector(op, "weight", x, weight, dim);
  DDTREE_CHECK_DTYPE(op, weight, x.scalar_type());
  if (gate.has_value()) {
    DDTREE_CHECK(op, !zero_centered, "gate is only supported with zero_centered=False (Qwen3_5RMSNormGated)");
    check_rows(op, "gate", x, *gate, rows, dim);
  }
  DDTREE_CHECK(op, std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  check_rows(op, "out", x, out, rows, dim);
}

void check_silu_mul(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& out) {
  constexpr const char* op = "silu_mul";
  DDTREE_CHECK_DIM(op, gate, 2);
  DDTREE_CHECK_FLOAT(op, gate);
  check_rows(op, "gate", gate, gate, gate.size(0), gate.size(1));
  check_rows(op, "up", gate, up, gate.size(0), gate.size(1));
  check_rows(op, "out", gate, out, gate.size(0), gate.size(1));
}

void check_gdn_gating(const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log, const at::Tensor& dt_bias,
                      const at::Tensor& g, const at::Tensor& beta) {
  constexpr const char* op = "gdn_gating";
  DDTREE_CHECK_DIM(op, a, 2);
  DDTREE_CHECK_FLOAT(op, a);
  const int64_t rows = a.size(0), heads = a.size(1);
  check_rows(op, "a", a, a, rows, heads);
  check_rows(op, "b", a, b, rows, heads);
  check_vector(op, "A_log", a, A_log, heads);
  DDTREE_CHECK_FLOAT(op, A_log);
  check_vector(op, "dt_bias", a, dt_bias, heads);
  DDTREE_CHECK_FLOAT(op, dt_bias);
  for (const auto* t : {&g, &beta}) {
    const char* name = t == &g ? "g" : "beta";
    TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == rows && t->size(1) == heads, op, ": ", name,
                      " must have shape [", rows, ", ", heads, "], got ", shape_str(t->sizes()));
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat, op, ": ", name, " must have dtype Float, got ",
                      t->scalar_type());
    TORCH_CHECK_VALUE(t->is_contiguous(), op, ": ", name, " must be contiguous");
    TORCH_CHECK_VALUE(t->device() == a.device(), op, ": ", name, " must be on ", a.device(), " like a, got ",
                      t->device());
  }
}

// ---- CPU implementations ---------------------------------------------------------------------------

void rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& gate, double eps,
                  bool zero_centered, at::Tensor& out) {
  check_rms_norm(x, weight, gate, eps, zero_centered, out);
  if (x.size(0) == 0) return;
  DDTREE_DISPATCH_FLOAT(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* gate_ptr = gate.has_value() ? gate->data_ptr<scalar_t>() : nullptr;
    const int64_t gate_stride = gate.has_value() ? gate->stride(0) : 0;
    rms_norm_kernel<scalar_t>(x, weight, gate_ptr, gate_stride, static_cast<float>(eps), zero_centered, out);
  });
}

void silu_mul_cpu(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  check_silu_mul(gate, up, out);
  if (gate.numel() == 0) return;
  DDTREE_DISPATCH_FLOAT(gate.scalar_type(), "silu_mul", [&] { silu_mul_kernel<scalar_t>(gate, up, out); });
}

void gdn_gating_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log, const at::Tensor& dt_bias,
                    at::Tensor& g, at::Tensor& beta) {
  check_gdn_gating(a, b, A_log, dt_bias, g, beta);
  if (a.numel() == 0) return;
  DDTREE_DISPATCH_FLOAT(a.scalar_type(), "gdn_gating", [&] {
    using T = scalar_t;
    DDTREE_DISPATCH_FLOAT(A_log.scalar_type(), "gdn_gating", [&] {
      using A = scalar_t;
      DDTREE_DISPATCH_FLOAT(dt_bias.scalar_type(), "gdn_gating",
                            [&] { gdn_gating_kernel<T, A, scalar_t>(a, b, A_log, dt_bias, g, beta); });
    });
  });
}

}  // namespace ddtree
