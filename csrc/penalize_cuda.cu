// CUDA implementation of penalize_logits. Semantics: ddtree_ext/reference.py (penalize_logits).
//
// Two kernels on the stream, each a programmatic dependent of the one before:
//   * every node's row gets the penalties of the tokens counted so far (`seen`, `counts`, one row per batch row,
//     read from L2 by every node): one streaming pass, the logits read once and the float32 result written once,
//     4 elements per thread where the rows allow 16-byte float32 stores;
//   * one warp per node redoes the few tokens on the node's own path below the root from the node's counts (present,
//     counted once more per occurrence on the path), reading the original logits again. A token that occurs
//     several times on a path is written once, by its nearest occurrence.
// The torch composition it replaced (masks over the tree's ancestor bits, a dozen full passes over [N, V] float32)
// was 12x slower: benchmarks/results/2026-12-06-h100-penalize-logits.md.

#include <algorithm>
#include <limits>

#include "cuda_common.cuh"
#include "ops.h"
#include "penalties.h"

namespace ddtree {
namespace {

using cuda::kMaxGridY;
using cuda::kWarp;

constexpr int kRowThreads = 256;

// out[b, i, v] = apply_penalties(logits[b, i, v], seen[b, v], counts[b, v]) for every node row (b, i), VEC
// consecutive elements per thread; VEC = 4 needs V, the row strides and every pointer 4-element aligned.
template <typename T, int VEC>
__global__ void __launch_bounds__(kRowThreads) penalize_rows_kernel(
    const T* __restrict__ logits, int64_t logit_batch_stride, int64_t logit_node_stride, int64_t num_nodes,
    int64_t rows, int64_t vocab, Penalties penalties, float* __restrict__ out) {
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();  // launched as a programmatic dependent: nothing read or written before
  const int64_t v0 = (static_cast<int64_t>(blockIdx.x) * kRowThreads + threadIdx.x) * VEC;
  if (v0 >= vocab) return;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t b = row / num_nodes, i = row % num_nodes;
    const T* x = logits + b * logit_batch_stride + i * logit_node_stride + v0;
    float value[VEC], count[VEC];
    bool present[VEC];
    if constexpr (VEC == 1) {
      value[0] = cuda::to_float(*x);
    } else {
      cuda::load_pack_float<T, VEC>(x, value);
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      present[e] = false;
      count[e] = 0.0f;
    }
    if (penalties.seen != nullptr) {
      const bool* s = penalties.seen + b * penalties.seen_stride + v0;
      if constexpr (VEC == 4) {
        const uchar4 pk = *reinterpret_cast<const uchar4*>(s);
        present[0] = pk.x, present[1] = pk.y, present[2] = pk.z, present[3] = pk.w;
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) present[e] = s[e];
      }
    }
    if (penalties.counts != nullptr) {
      const float* c = penalties.counts + b * penalties.count_stride + v0;
      if constexpr (VEC == 4) {
        const float4 pk = *reinterpret_cast<const float4*>(c);
        count[0] = pk.x, count[1] = pk.y, count[2] = pk.z, count[3] = pk.w;
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) count[e] = c[e];
      }
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) value[e] = apply_penalties(value[e], present[e], count[e], penalties);
    float* y = out + row * vocab + v0;
    if constexpr (VEC == 4) {
      *reinterpret_cast<float4*>(y) = make_float4(value[0], value[1], value[2], value[3]);
    } else {
      y[0] = value[0];
    }
  }
}

// One warp per node (b, i): lane 0 collects the tokens of the node's path below the root (nearest first, at most
// `limit` nodes) into shared memory, after their count; each lane then takes path entries and rewrites out[b, i, t]
// for the first occurrence of each token t. An invalid parent makes its node a root (cuda::checked_parent: its own
// token is not counted); tokens outside [0, V) are stored as -1 and skipped.
template <typename T>
__global__ void __launch_bounds__(kWarp) penalize_paths_kernel(
    const T* __restrict__ logits, int64_t logit_batch_stride, int64_t logit_node_stride,
    const int64_t* __restrict__ node_token, const int32_t* __restrict__ parent, int64_t num_nodes, int64_t vocab,
    int limit, Penalties penalties, float* __restrict__ out) {
  extern __shared__ int32_t path[];  // [0]: the path's length; [1 + k]: its k-th token
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();  // the rows kernel ahead has written every row
  const int64_t row = blockIdx.x, b = row / num_nodes, i = row % num_nodes;
  const int64_t* token = node_token + b * num_nodes;
  const int32_t* par = parent + b * num_nodes;
  if (threadIdx.x == 0) {
    int len = 0;
    for (int64_t node = i; len < limit;) {
      const int p = cuda::checked_parent(par[node], static_cast<int>(node));
      if (p < 0) break;  // node is the root: not on the path
      const int64_t t = token[node];
      path[1 + len++] = t >= 0 && t < vocab ? static_cast<int32_t>(t) : -1;
      node = p;
    }
    path[0] = len;
  }
  __syncthreads();
  const int len = path[0];
  const int32_t* tokens = path + 1;
  const T* x = logits + b * logit_batch_stride + i * logit_node_stride;
  for (int k = threadIdx.x; k < len; k += kWarp) {
    const int32_t t = tokens[k];
    if (t < 0) continue;
    bool first = true;
    for (int j = 0; j < k && first; ++j) first = tokens[j] != t;
    if (!first) continue;
    float occurrences = 0.0f;
    for (int j = k; j < len; ++j) occurrences += tokens[j] == t ? 1.0f : 0.0f;
    const float count = penalties.counts != nullptr ? penalties.counts[b * penalties.count_stride + t] : 0.0f;
    // float32 count + occurrences, as the torch composition adds them, before the penalties' arithmetic.
    out[row * vocab + t] = apply_penalties(cuda::to_float(x[t]), true, __fadd_rn(count, occurrences), penalties);
  }
}

// Whether rows starting at p, `stride` elements apart (`rows` of them), all start on a `vec`-element boundary.
bool aligned_rows(const void* p, int64_t rows, int64_t stride, int64_t element_bytes, int64_t vec) {
  return cuda::is_aligned(p, static_cast<size_t>(element_bytes * vec)) && (rows <= 1 || stride % vec == 0);
}

}  // namespace

void penalize_logits_cuda(const at::Tensor& logits, const at::Tensor& node_token, const at::Tensor& parent,
                          const c10::optional<at::Tensor>& seen, const c10::optional<at::Tensor>& counts,
                          double repetition_penalty, double presence_penalty, double frequency_penalty,
                          int64_t max_depth, at::Tensor& out) {
  constexpr const char* op = "penalize_logits";
  check_penalize_logits(logits, node_token, parent, seen, counts, repetition_penalty, presence_penalty,
                        frequency_penalty, max_depth, out);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t batch = node_token.size(0), num_nodes = node_token.size(1), vocab = logits.size(2);
  const int64_t rows = batch * num_nodes;
  if (rows == 0) return;
  DDTREE_CHECK(op, rows <= std::numeric_limits<int32_t>::max(), "logits must have fewer than 2^31 node rows, got ",
               rows);
  const int64_t limit = std::min(max_depth - 1, num_nodes - 1);
  // The paths kernel's only shared memory: the path's length and tokens, int32 (checked before any launch).
  const size_t smem = static_cast<size_t>(limit + 1) * sizeof(int32_t);
  DDTREE_CHECK(op, smem <= cuda::max_dynamic_smem(), "max_depth must keep paths within this GPU's shared memory (",
               cuda::max_dynamic_smem() / sizeof(int32_t) - 1, " nodes), got paths of up to ", limit,
               " nodes (max_depth ", max_depth, ", ", num_nodes, " nodes a tree)");
  const Penalties penalties = make_penalties(seen, counts, repetition_penalty, presence_penalty, frequency_penalty);
  DDTREE_CUDA_DISPATCH_FLOAT(logits.scalar_type(), op, [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    float* y = out.data_ptr<float>();
    // generate's tables are [1, V + 1] (a sink column): one row, whatever its stride.
    const bool vec4 = vocab % 4 == 0 && aligned_rows(x, batch, logits.stride(0), sizeof(scalar_t), 4) &&
                      (num_nodes <= 1 || logits.stride(1) % 4 == 0) && cuda::is_aligned(y, 16) &&
                      (penalties.seen == nullptr || aligned_rows(penalties.seen, batch, penalties.seen_stride, 1, 4)) &&
                      (penalties.counts == nullptr ||
                       aligned_rows(penalties.counts, batch, penalties.count_stride, 4, 4));
    const int vec = vec4 ? 4 : 1;
    const dim3 grid(static_cast<unsigned>(cuda::ceil_div(cuda::ceil_div(vocab, vec), kRowThreads)),
                    static_cast<unsigned>(std::min<int64_t>(rows, kMaxGridY)));
    auto rows_kernel = vec4 ? penalize_rows_kernel<scalar_t, 4> : penalize_rows_kernel<scalar_t, 1>;
    cuda::launch_programmatic(rows_kernel, grid, dim3(kRowThreads), 0, x, logits.stride(0), logits.stride(1),
                              num_nodes, rows, vocab, penalties, y);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (limit > 0 && (penalties.seen != nullptr || penalties.counts != nullptr)) {  // else nothing to redo
      cuda::allow_dynamic_smem(penalize_paths_kernel<scalar_t>, smem);
      cuda::launch_programmatic(penalize_paths_kernel<scalar_t>, dim3(static_cast<unsigned>(rows)), dim3(kWarp), smem,
                                x, logits.stride(0), logits.stride(1), node_token.data_ptr<int64_t>(),
                                parent.data_ptr<int32_t>(), num_nodes, vocab, static_cast<int>(limit), penalties, y);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

}  // namespace ddtree
