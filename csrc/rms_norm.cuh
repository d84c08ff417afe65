// The arithmetic of the Qwen RMSNorms on the GPU, shared by ops.rms_norm / add_rms_norm (layer_cuda.cu) and the gated
// norm fused into the GDN delta rule (verify_cuda.cu), so that both give the bits of HF's torch code: float32 math,
// rounded to the model dtype T where HF rounds. Included by csrc/*_cuda.cu only.
#pragma once

#include "cuda_common.cuh"

namespace ddtree {
namespace cuda {

template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return to_float(from_float<T>(x));
}

// torch's CUDA silu and sigmoid: float math with expf (no fast-math intrinsics).
__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

// 1 / sqrt(mean + eps) from a row's sum of squares: torch.rsqrt on CUDA is rsqrtf, and the mean is the sum times 1/n
// as in torch's reduction, rounded before the eps is added (no FMA contraction: torch runs the two as separate kernels).
__device__ __forceinline__ float rms_inverse(float sum_of_squares, float inv_dim, float eps) {
  return rsqrtf(__fadd_rn(__fmul_rn(sum_of_squares, inv_dim), eps));
}

// One output element of a norm from its input v, weight w and gate g (gated only), with inv_rms = rms_inverse(...):
// Qwen3_5RMSNorm (zero_centered: x_hat (1 + w)), Qwen3RMSNorm (w * round(x_hat)), Qwen3_5RMSNormGated (that, rounded,
// times silu(g)). Returned in float32; the caller rounds it to T.
template <typename T>
__device__ __forceinline__ float rms_norm_element(float v, float w, float g, bool gated, bool zero_centered,
                                                  float inv_rms) {
  if (zero_centered) return v * inv_rms * (1.f + w);
  const float y = w * round_to<T>(v * inv_rms);
  return gated ? round_to<T>(y) * silu(g) : y;
}

}  // namespace cuda
}  // namespace ddtree
