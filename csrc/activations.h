// The rounding points and activations the layer-body ops share between the CPU and the GPU: round_to<T> is a
// rounding to the activation dtype T (float math in between, as torch's ops run 16-bit math), and silu / sigmoid are
// torch's: float math with expf, no fast-math intrinsics (torch's CUDA kernels are built without them).
#pragma once

#include <cmath>

#include "host_device.h"

namespace ddtree {

template <typename T>
DDTREE_HOST_DEVICE inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

DDTREE_HOST_DEVICE inline float silu(float x) { return x / (1.f + expf(-x)); }

DDTREE_HOST_DEVICE inline float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

}  // namespace ddtree
