// min_p's cut, shared by the CPU op and the CUDA kernels (no Python, no ATen).
#pragma once

#include <math.h>

#include "host_device.h"

namespace ddtree {

// min_p keeps a token when fl(x - m) >= offset, with x = logit / temperature, m the row's largest x and offset =
// min_p_offset(min_p) = float32(log(min_p)): HF's warper (probability at least min_p times the largest) compares
// exp(x - m) with min_p, and x - m is exact near the top, where m + offset is not (at a low temperature x is large
// and m + offset rounds by whole units). fl(x - m) grows with x, so the kept set is every x >= one cut: the smallest
// float c with fl(c - m) >= offset, a few steps from m + offset. A row whose m is not finite keeps m + offset.
DDTREE_HOST_DEVICE inline float min_p_cut(float m, float offset) {
  float c = m + offset;
  if (!(m - m == 0.0f)) return c;  // m is +-inf or NaN
  while (c - m < offset) c = nextafterf(c, INFINITY);
  for (float below = nextafterf(c, -INFINITY); below - m >= offset; below = nextafterf(c, -INFINITY)) c = below;
  return c;
}

// A node's cut after min_p (applied after top_k's and top_p's, as HF orders its warpers): the larger of `cut` and
// min_p_cut(m, offset), a NaN cut kept; `cut` as it is when min_p is off (offset -inf).
DDTREE_HOST_DEVICE inline float apply_min_p(float cut, float m, float offset) {
  if (offset == -INFINITY) return cut;
  const float floor = min_p_cut(m, offset);
  return floor > cut ? floor : cut;
}

}  // namespace ddtree
