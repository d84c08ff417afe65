// The penalties' arithmetic on one logit, shared by the CPU op and the CUDA kernels (no Python, no ATen).
#pragma once

#include <cstdint>

#include "host_device.h"

namespace ddtree {

// One penalize_logits call: the tables (rows of [B, V], last dim contiguous) and the penalties as float32 (the dtype
// HF and vLLM apply them in). Made by make_penalties (ops.h).
struct Penalties {
  const bool* seen;     // the tokens in the sequence so far; null: no repetition penalty
  int64_t seen_stride;
  const float* counts;  // how often each token was generated so far; null: no presence or frequency penalty
  int64_t count_stride;
  float repetition;     // float32(r): negative logits are multiplied by it; on the CPU positive ones divided by it
  float reciprocal;     // float32(1 / r), the reciprocal taken in double: on CUDA positive logits are multiplied by it
  float presence;       // float32(presence_penalty)
  float frequency;      // float32(frequency_penalty)
};

// HF's repetition penalty (a token in the sequence: x * r where x < 0, x / r otherwise), then vLLM's frequency and
// presence penalties (x - f * count, then x - p where count > 0), one float32 operation at a time as the torch ops
// round them: no product and difference fused into one FMA, whose single rounding the torch ops don't have
// (__fmul_rn/__fsub_rn on the GPU; on the host the build passes -ffp-contract=off). x / r is what torch computes on
// the device: on the CPU a float32 division by float32(r); on CUDA (div_true_kernel_cuda with a Python number) a
// multiplication by float32(1 / r), which for r = 1.1 is not 1 / float32(r).
DDTREE_HOST_DEVICE inline float apply_penalties(float x, bool seen, float count, const Penalties& s) {
#if defined(__CUDA_ARCH__)
  if (s.seen != nullptr && seen) x = x < 0.0f ? __fmul_rn(x, s.repetition) : __fmul_rn(x, s.reciprocal);
  if (s.counts != nullptr) {
    x = __fsub_rn(x, __fmul_rn(s.frequency, count));
    x = __fsub_rn(x, __fmul_rn(s.presence, count > 0.0f ? 1.0f : 0.0f));
  }
#else
  if (s.seen != nullptr && seen) x = x < 0.0f ? x * s.repetition : x / s.repetition;
  if (s.counts != nullptr) {
    const float by_count = s.frequency * count;
    x = x - by_count;
    const float by_presence = s.presence * (count > 0.0f ? 1.0f : 0.0f);
    x = x - by_presence;
  }
#endif
  return x;
}

}  // namespace ddtree
