// CUDA implementations of the walk ops. Semantics: ddtree_ext/reference.py (_walk, sample_token).
//
// walk_greedy: one block per row stages the row's tree in shared memory and one thread follows it.
// walk_sample: the token the target draws at a node depends only on that node's logits and on
// uniform[b, depth], so every reachable node draws its token in parallel first (depths come from the
// child links); the walk itself is then the greedy walk over those tokens. Draws:
//   * top_k in [1, 64]: two passes over each node's row (a threshold, then the list), split into
//     segments over several blocks (row_topk.cuh), give the row's best 8/16/32/64 (the first at least
//     k + 4 long, else 64); one block per node merges the segments and finds top_k's and top_p's cut
//     values from them (a group tied with the k-th that runs past the list is counted over the row),
//     then draws from the list, or marks the node to draw over its row when the kept set runs past it;
//   * no top_k, no top_p: the rows' maxima by segments, then the draw over the row;
//   * top_p alone, or top_k > 64: the rows' maxima, the cut value by radix selects over the row (three
//     levels of histograms: counts for top_k's k-th value, fixed-point masses for top_p's cut), then the
//     draw over the row above the cut;
//   * the draw over a row: every chunk's total in parallel, then per node a scan over the totals and one
//     chunk rescanned;
//   * min_p (after top_k and top_p, as HF orders them) raises a node's cut by apply_min_p (min_p.h):
//     where the cut is found (the top-k merge, the last select), or by its own kernel when it is the only filter;
// Like the CPU op, weights are float32 exp(x - max x) and masses are summed in double, in a different
// order, so a draw can differ from the CPU op's only when uniform * total (or top_p * mass) lands
// within double rounding (or expf's last-bit differences) of a cumulative boundary; the radix selects
// sum top_p's masses in fixed point, a wider rounding (see there).

#include "cuda_common.cuh"
#include "min_p.h"
#include "ops.h"
#include "row_topk.cuh"

namespace ddtree {
namespace {

using cuda::kFullMask;
using cuda::kWarp;

// ==== the walk ================================================================================

constexpr int kWalkThreads = 128;

struct TreeLinks {
  const int64_t* node_token;
  int64_t nt_sb, nt_sn;
  const int32_t* first_child;
  int64_t fc_sb, fc_sn;
  const int32_t* next_sibling;
  int64_t ns_sb, ns_sn;
  int num_nodes;
};

TreeLinks links_of(const at::Tensor& node_token, const at::Tensor& first_child, const at::Tensor& next_sibling) {
  return TreeLinks{node_token.data_ptr<int64_t>(),  node_token.stride(0),   node_token.stride(1),
                   first_child.data_ptr<int32_t>(), first_child.stride(0),  first_child.stride(1),
                   next_sibling.data_ptr<int32_t>(), next_sibling.stride(0), next_sibling.stride(1),
                   static_cast<int>(node_token.size(1))};
}

struct WalkOut {
  int32_t* accepted;
  int64_t acc_sb, acc_sd;
  int32_t* accept_len;
  int64_t al_s;
  int64_t* next_token;
  int64_t nx_s;
  int max_accept;
};

WalkOut walk_out_of(at::Tensor& accepted, at::Tensor& accept_len, at::Tensor& next_token) {
  return WalkOut{accepted.data_ptr<int32_t>(), accepted.stride(0), accepted.stride(1),
                 accept_len.data_ptr<int32_t>(), accept_len.stride(0), next_token.data_ptr<int64_t>(),
                 next_token.stride(0), static_cast<int>(accepted.size(1))};
}

// From the root, repeatedly take the target's token at the current node and move to the first child
// (in sibling-list order) carrying it; stop when none does or after max_accept nodes. Malformed links
// (an index outside the row, a sibling list longer than the row) end the walk instead of faulting.
__global__ void __launch_bounds__(kWalkThreads) walk_tree_kernel(TreeLinks tree, const int64_t* __restrict__ target,
                                                                 int64_t tg_sb, int64_t tg_sn, WalkOut out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();  // launched as a programmatic dependent: nothing read or written before
  const int n = tree.num_nodes;
  int64_t* token = reinterpret_cast<int64_t*>(smem_raw);  // [N]
  int64_t* want = token + n;                               // [N] the target's token at each node
  int* first_child = reinterpret_cast<int*>(want + n);    // [N]
  int* next_sibling = first_child + n;                     // [N]
  int* path = next_sibling + n;                            // [max_accept]
  __shared__ int path_len;
  __shared__ int64_t bonus;
  const int b = blockIdx.x;
  for (int i = threadIdx.x; i < n; i += kWalkThreads) {
    token[i] = tree.node_token[b * tree.nt_sb + i * tree.nt_sn];
    want[i] = target[b * tg_sb + i * tg_sn];
    first_child[i] = tree.first_child[b * tree.fc_sb + i * tree.fc_sn];
    next_sibling[i] = tree.next_sibling[b * tree.ns_sb + i * tree.ns_sn];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int node = 0, len = 0;
    int64_t t;
    while (true) {
      path[len++] = node;
      t = want[node];
      if (len == out.max_accept) break;
      int c = first_child[node], steps = 0;
      while (c >= 0 && c < n && steps < n && token[c] != t) {
        c = next_sibling[c];
        ++steps;
      }
      if (c < 0 || c >= n || steps >= n) break;
      node = c;
    }
    path_len = len;
    bonus = t;
  }
  __syncthreads();
  const int len = path_len;
  for (int d = threadIdx.x; d < out.max_accept; d += kWalkThreads) {
    out.accepted[b * out.acc_sb + d * out.acc_sd] = d < len ? path[d] : -1;
  }
  if (threadIdx.x == 0) {
    out.accept_len[b * out.al_s] = len;
    out.next_token[b * out.nx_s] = bonus;
  }
}

void launch_walk(const TreeLinks& tree, const at::Tensor& target, const WalkOut& out, int64_t bsz) {
  const int64_t n = tree.num_nodes;
  const size_t smem = (2 * sizeof(int64_t) + 2 * sizeof(int)) * n + sizeof(int) * out.max_accept;
  TORCH_CHECK_VALUE(smem <= cuda::max_dynamic_smem(), "walk: trees of ", n,
                    " nodes need more shared memory than this GPU offers");
  cuda::allow_dynamic_smem(walk_tree_kernel, smem);
  cuda::launch_programmatic(walk_tree_kernel, dim3(static_cast<unsigned>(bsz)), dim3(kWalkThreads), smem, tree,
                            target.data_ptr<int64_t>(), target.stride(0), target.stride(1), out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ==== row_argmax: the target's greedy tokens ====================================================
//
// torch.argmax over a verify's logits ([65, 248320] bf16 on the 27B shape) ran as one ATen reduction at about
// 0.6 TB/s (24.7 us for Qwen3-8B's [65, 151936] on the H200). Here a row is split into segments over enough blocks to
// fill the GPU twice (cuda::split_rows); a block streams its segment in 16-byte packs, four in flight per thread, and
// reduces it to one 64-bit key per segment; one warp per row takes the largest key. The key orders as torch.argmax does: the value's
// order-preserving bits above (every NaN above +inf), then the index reversed below, so the first maximum wins. Which
// thread saw which element does not matter: the result is a pure function of the row.

constexpr int kArgmaxThreads = 512;
constexpr int kArgmaxUnroll = 4;  // 16-byte packs in flight per thread

__device__ __forceinline__ uint64_t argmax_key(float v, int64_t i) {
  const uint32_t hi = cuda::rank_key(v);
  return (static_cast<uint64_t>(hi) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
}

__device__ __forceinline__ int64_t argmax_index(uint64_t key) {
  return static_cast<int64_t>(0xffffffffu - static_cast<uint32_t>(key));
}

// One block per (row, segment): the segment's key into part[block], or, with one segment a row, the index into out.
template <typename T>
__global__ void __launch_bounds__(kArgmaxThreads) row_argmax_segment_kernel(
    const T* __restrict__ x, int64_t row_stride, int64_t n, int segments, int64_t seg_len,
    uint64_t* __restrict__ part, int64_t* __restrict__ out) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  __shared__ uint64_t warp_key[kArgmaxThreads / kWarp];
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();  // launched as a programmatic dependent: nothing read or written before
  const int64_t row = blockIdx.x / segments;
  const int seg = blockIdx.x % segments;
  const int64_t start = seg * seg_len;
  const int64_t len = min(seg_len, n - start);
  const T* p = x + row * row_stride + start;
  // A thread visits its elements in increasing index order, so among equal values it keeps the first (strictly
  // greater replaces); a NaN replaces any number and no NaN; the first visit always takes.
  float best = -INFINITY;
  int64_t best_i = -1;
  auto visit = [&](float v, int64_t i) {
    const bool take = best_i < 0 || (isnan(v) ? !isnan(best) : v > best);
    best = take ? v : best;
    best_i = take ? i : best_i;
  };
  const int64_t head = cuda::elements_to_16b_boundary(p, len);
  for (int64_t i = threadIdx.x; i < head; i += kArgmaxThreads) visit(cuda::to_float(p[i]), start + i);
  const int64_t packs = (len - head) / kVec;
  for (int64_t q0 = threadIdx.x; q0 < packs; q0 += static_cast<int64_t>(kArgmaxThreads) * kArgmaxUnroll) {
    float v[kArgmaxUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kArgmaxUnroll; ++u) {
      const int64_t q = q0 + u * kArgmaxThreads;
      if (q < packs) cuda::load_pack_float<T, kVec>(p + head + q * kVec, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kArgmaxUnroll; ++u) {
      const int64_t q = q0 + u * kArgmaxThreads;
      if (q < packs) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) visit(v[u][e], start + head + q * kVec + e);
      }
    }
  }
  for (int64_t i = head + packs * kVec + threadIdx.x; i < len; i += kArgmaxThreads) {
    visit(cuda::to_float(p[i]), start + i);
  }
  uint64_t key = best_i < 0 ? 0 : argmax_key(best, best_i);  // 0: no element, below every key
  key = cuda::warp_max_u64(key);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) warp_key[warp] = key;
  __syncthreads();
  if (warp == 0) {
    key = lane < kArgmaxThreads / kWarp ? warp_key[lane] : 0;
    key = cuda::warp_max_u64(key);
    if (lane == 0) {
      if (segments == 1) {
        out[row] = argmax_index(key);
      } else {
        part[blockIdx.x] = key;
      }
    }
  }
}

// One warp per row over its segments' keys (at most 32).
__global__ void __launch_bounds__(kWarp * 8) row_argmax_merge_kernel(const uint64_t* __restrict__ part, int64_t rows,
                                                                    int segments, int64_t* __restrict__ out) {
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();  // launched as a programmatic dependent: nothing read or written before
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 8 + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= rows) return;
  const uint64_t key = cuda::warp_max_u64(lane < segments ? part[row * segments + lane] : 0);
  if (lane == 0) out[row] = argmax_index(key);
}

// ==== walk_sample: node depths ================================================================
//
// depth[b, i] = depth of node i reached through the child links from the root, or -1 when no walk can
// reach it (padding nodes, which no list links).

constexpr int kDepthThreads = 256;

__global__ void __launch_bounds__(kDepthThreads) tree_depth_kernel(TreeLinks tree, int32_t* __restrict__ depth) {
  extern __shared__ int parent_of[];  // [N]; -1 root, -2 unreached
  const int n = tree.num_nodes, b = blockIdx.x;
  for (int i = threadIdx.x; i < n; i += kDepthThreads) parent_of[i] = i == 0 ? -1 : -2;
  __syncthreads();
  for (int p = threadIdx.x; p < n; p += kDepthThreads) {
    int c = tree.first_child[b * tree.fc_sb + p * tree.fc_sn];
    for (int steps = 0; c > 0 && c < n && steps < n; ++steps) {
      parent_of[c] = p;
      c = tree.next_sibling[b * tree.ns_sb + c * tree.ns_sn];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += kDepthThreads) {
    int d = 0, j = i;
    while (j > 0 && d <= n) {
      j = parent_of[j];
      ++d;
    }
    depth[static_cast<int64_t>(b) * n + i] = j == 0 && d <= n ? d : -1;
  }
}

// ==== walk_sample: draws =======================================================================

constexpr int kSampleThreads = 256;
constexpr int kSampleMaxTopK = 64;

struct SampleArgs {
  const int32_t* depth;    // [B, N] contiguous workspace
  const float* uniform;    // [B, D]
  int64_t un_sb, un_sd;
  int num_nodes, max_accept;
  int64_t vocab;
  float temperature;
  double top_p;            // 1 = off
  int top_k;               // 0 = off
  float min_p_offset;      // min_p_offset(min_p): -inf = off
  int64_t* token;          // [B, N] contiguous workspace
};

// Node (b, i) of this block and its uniform; false (and token -1) when no walk reaches the node.
__device__ __forceinline__ bool sample_target(const SampleArgs& a, int b, int i, float& u) {
  const int64_t slot = static_cast<int64_t>(b) * a.num_nodes + i;
  const int d = a.depth[slot];
  if (d < 0 || d >= a.max_accept) {
    if (threadIdx.x == 0) a.token[slot] = -1;
    return false;
  }
  u = a.uniform[b * a.un_sb + d * a.un_sd];
  return true;
}

// top_k in [1, 64], step 1: one block per (node, vocabulary segment) of the reachable nodes, with its
// best K_CAP (x, id) pairs and its max x.
template <typename T, int K_CAP>
__global__ void __launch_bounds__(kSampleThreads) sample_top_k_segment_kernel(
    const T* __restrict__ logits, int64_t lg_sb, int64_t lg_sn, SampleArgs a, int segments, int64_t seg_len,
    float* __restrict__ part_val, int* __restrict__ part_id, float* __restrict__ part_max) {
  __shared__ cuda::RowTopKSmem<K_CAP, kSampleThreads> sm;
  const int i = blockIdx.x / segments, seg = blockIdx.x % segments, b = blockIdx.y;
  const int64_t slot = static_cast<int64_t>(b) * a.num_nodes + i;
  const int d = a.depth[slot];
  if (d < 0 || d >= a.max_accept) return;  // no walk reaches this node: nothing to draw
  const int64_t start = seg * seg_len;
  const int64_t len = start + seg_len < a.vocab ? seg_len : a.vocab - start;
  const float temperature = a.temperature;
  cuda::row_softmax_topk<T, K_CAP, kSampleThreads, /*WITH_SUM=*/false>(
      logits + b * lg_sb + i * lg_sn + start, len, static_cast<int>(start),
      [temperature](float x) { return x / temperature; }, sm);
  const int64_t part = slot * segments + seg;
  for (int r = threadIdx.x; r < K_CAP; r += kSampleThreads) {
    part_val[part * K_CAP + r] = sm.val[r];
    part_id[part * K_CAP + r] = sm.id[r];
  }
  if (threadIdx.x == 0) part_max[part] = sm.m;
}

// Inclusive prefix sum over the block in a fixed order (warp shuffles, then warp totals); also returns
// the exclusive prefix. Deterministic, so two scans of the same values agree bit for bit.
template <typename V>
__device__ __forceinline__ V block_scan(V x, V* warp_totals, V& exclusive) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  V incl = x;
#pragma unroll
  for (int off = 1; off < kWarp; off <<= 1) {
    const V y = __shfl_up_sync(kFullMask, incl, off);
    if (lane >= off) incl += y;
  }
  if (lane == kWarp - 1) warp_totals[warp] = incl;
  __syncthreads();
  V before = 0;
  for (int w = 0; w < warp; ++w) before += warp_totals[w];
  const V prev_in_warp = __shfl_up_sync(kFullMask, incl, 1);
  exclusive = before + (lane == 0 ? V{0} : prev_in_warp);
  incl = before + incl;
  __syncthreads();  // warp_totals is reused by the next scan
  return incl;
}

// ---- the draw over a whole row ----------------------------------------------------------------
// By inverse CDF in ascending id order over the kept tokens of a row (every token, or every x >= a cut
// value), x = logit / temperature, weights exp(x - m) (m the row's max x), sums in double. A row is cut
// into chunks of kDrawChunk ids, one warp's (8 consecutive ids a lane); three kernels:
//   1. the row's max x by segments (the top-k path has it from its lists already);
//   2. every chunk's total, a warp a chunk over all chunks of all drawing nodes at once;
//   3. per node, a block scan over the chunk totals finds the chunk holding uniform * total, and one warp
//      rescans that chunk with the same lane sums and warp scan as kernel 2 (the same bits).
// (One block per node walking its row chunk by chunk, a round trip and two barriers a chunk, took
// 592 us for 65 rows of 248320 on the H200; with these three kernels the whole walk_sample took 67 us.)
constexpr int kDrawPerLane = 8;
constexpr int kDrawChunk = kWarp * kDrawPerLane;
constexpr int kDrawBlocksPerSM = 8;  // resident blocks of kSampleThreads a multiprocessor takes, to hide latency

// Per node, what a draw over its row reads (the row's max x, the cut) and its workspaces.
struct DrawRowArgs {
  const float* part_max;   // [B, N, segments]: the segments' max x
  int segments;
  float* cut;              // [B, N] (FILTERED): the smallest kept x
  int8_t* over_row;        // [B, N] (FILTERED): 1 where the node draws over its row (the top-k or top-p path decides)
  double* chunk_total;     // [B, N, chunks]
  int* chunk_last;         // [B, N, chunks]: the chunk's largest kept id, -1 for none
  int64_t chunks;
};

// The row's max x: the largest of its segments' (exact in any order).
__device__ __forceinline__ float row_max_of_parts(const DrawRowArgs& d, int64_t slot) {
  float m = -INFINITY;
  for (int s = 0; s < d.segments; ++s) m = fmaxf(m, d.part_max[slot * d.segments + s]);
  return m;
}

// Lane l of a warp sums the kept weights of ids c0 + 8 l .. c0 + 8 l + 7 in ascending order (run[e]: its
// running sum through the e-th, bit e of `kept` set when the e-th is kept); returns the lane's inclusive
// prefix over the warp (lane 31's is the chunk's total) and its exclusive prefix in `excl`; `last` becomes the
// lane's largest kept id (unchanged if none).
template <typename T, typename Keep>
__device__ __forceinline__ double warp_chunk_scan(const T* __restrict__ row, int64_t c0, int64_t vocab, float m,
                                                  float temperature, Keep keep, double (&run)[kDrawPerLane],
                                                  unsigned& kept, int& last, double& excl) {
  const int lane = threadIdx.x % kWarp;
  double s = 0;
  kept = 0;
#pragma unroll
  for (int e = 0; e < kDrawPerLane; ++e) {
    const int64_t j = c0 + lane * kDrawPerLane + e;
    const float x = j < vocab ? cuda::to_float(row[j]) / temperature : 0.f;
    if (j < vocab && keep(x)) {
      s += expf(x - m);
      last = static_cast<int>(j);
      kept |= 1u << e;
    }
    run[e] = s;
  }
  double incl = s;
#pragma unroll
  for (int off = 1; off < kWarp; off <<= 1) {
    const double y = __shfl_up_sync(kFullMask, incl, off);
    if (lane >= off) incl += y;
  }
  const double prev = __shfl_up_sync(kFullMask, incl, 1);
  excl = lane == 0 ? 0.0 : prev;
  return incl;
}

// The draw's keep rule for a node (block- and warp-uniform).
template <bool FILTERED>
struct KeepRule {
  float cut;
  __device__ __forceinline__ bool operator()(float x) const { return !FILTERED || x >= cut; }
};

// Whether node `slot` draws over its row: FILTERED, where the top-k path said so; else every node a walk
// reaches (depth in [0, max_accept)).
template <bool FILTERED>
__device__ __forceinline__ bool draws_over_row(const SampleArgs& a, const DrawRowArgs& d, int64_t slot) {
  if constexpr (FILTERED) {
    return d.over_row[slot] != 0;
  } else {
    const int depth = a.depth[slot];
    return depth >= 0 && depth < a.max_accept;
  }
}

// No filter, kernel 1: one block per (node, segment) of the reachable nodes, the segment's max x.
template <typename T>
__global__ void __launch_bounds__(kSampleThreads) sample_row_max_kernel(const T* __restrict__ logits, int64_t lg_sb,
                                                                        int64_t lg_sn, SampleArgs a, int segments,
                                                                        int64_t seg_len, float* __restrict__ part_max) {
  __shared__ float warp_max[kSampleThreads / kWarp];
  const int i = blockIdx.x / segments, seg = blockIdx.x % segments, b = blockIdx.y;
  const int64_t slot = static_cast<int64_t>(b) * a.num_nodes + i;
  const int d = a.depth[slot];
  if (d < 0 || d >= a.max_accept) return;
  const int64_t start = seg * seg_len;
  const int64_t len = start + seg_len < a.vocab ? seg_len : a.vocab - start;
  const float temperature = a.temperature;
  float m = -INFINITY;
  cuda::for_each_in_row<T, kSampleThreads>(logits + b * lg_sb + i * lg_sn + start, len,
                                           [&](float x, int64_t) { m = fmaxf(m, x / temperature); });
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, off));
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 0; w < kSampleThreads / kWarp; ++w) m = fmaxf(m, warp_max[w]);
    part_max[slot * segments + seg] = m;
  }
}

// Kernel 2: blockIdx.y is the node, its warps take the chunks blockIdx.x, + gridDim.x, ... (one per warp a
// step); nodes that do not draw over their rows leave at once.
template <typename T, bool FILTERED>
__global__ void __launch_bounds__(kSampleThreads) sample_chunk_totals_kernel(const T* __restrict__ logits,
                                                                             int64_t lg_sb, int64_t lg_sn,
                                                                             SampleArgs a, DrawRowArgs d) {
  const int64_t slot = blockIdx.y;
  if (!draws_over_row<FILTERED>(a, d, slot)) return;
  const int b = static_cast<int>(slot / a.num_nodes), i = static_cast<int>(slot % a.num_nodes);
  const T* row = logits + b * lg_sb + i * lg_sn;
  const float m = row_max_of_parts(d, slot);
  const KeepRule<FILTERED> keep{FILTERED ? d.cut[slot] : 0.f};
  constexpr int kWarps = kSampleThreads / kWarp;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * kWarps + warp; c < d.chunks;
       c += static_cast<int64_t>(gridDim.x) * kWarps) {
    double run[kDrawPerLane], excl;
    unsigned kept;
    int last = -1;
    const double incl =
        warp_chunk_scan(row, c * kDrawChunk, a.vocab, m, a.temperature, keep, run, kept, last, excl);
#pragma unroll
    for (int off = kWarp / 2; off > 0; off >>= 1) last = max(last, __shfl_xor_sync(kFullMask, last, off));
    if (lane == kWarp - 1) {
      d.chunk_total[slot * d.chunks + c] = incl;
      d.chunk_last[slot * d.chunks + c] = last;
    }
  }
}

// Kernel 3: one block per node. Thread t sums the totals of its run of consecutive chunks, a block scan
// places the runs; the first chunk whose cumulative total passes uniform * total is rescanned by warp 0.
// With no crossing (non-finite logits) the token is the row's largest kept id (the last id if none is
// kept); with a crossing the chunk total saw but no element did (a rounding gap between the two sums),
// the chunk's largest kept id.
template <typename T, bool FILTERED>
__global__ void __launch_bounds__(kSampleThreads) sample_row_select_kernel(const T* __restrict__ logits,
                                                                           int64_t lg_sb, int64_t lg_sn,
                                                                           SampleArgs a, DrawRowArgs d) {
  __shared__ double warp_totals[kSampleThreads / kWarp];
  __shared__ double total_shared, before_shared;
  __shared__ int chosen_chunk, last_kept;
  const int i = blockIdx.x, b = blockIdx.y;
  const int64_t slot = static_cast<int64_t>(b) * a.num_nodes + i;
  if (!draws_over_row<FILTERED>(a, d, slot)) {
    if (!FILTERED && threadIdx.x == 0) a.token[slot] = -1;  // unreached (the top-k path wrote its own tokens)
    return;
  }
  const float u = a.uniform[b * a.un_sb + a.depth[slot] * a.un_sd];
  if (threadIdx.x == 0) {
    chosen_chunk = INT_MAX;
    last_kept = -1;
  }
  const double* total_of = d.chunk_total + slot * d.chunks;
  const int* last_of = d.chunk_last + slot * d.chunks;
  const int64_t per_thread = (d.chunks + kSampleThreads - 1) / kSampleThreads;
  const int64_t begin = min(d.chunks, threadIdx.x * per_thread), end = min(d.chunks, begin + per_thread);
  double mine = 0;
  int my_last = -1;
  for (int64_t c = begin; c < end; ++c) {
    mine += total_of[c];
    my_last = max(my_last, last_of[c]);
  }
  double excl;
  const double incl = block_scan(mine, warp_totals, excl);  // its barriers also order the stores above
  if (threadIdx.x == kSampleThreads - 1) total_shared = incl;
  if (my_last >= 0) atomicMax(&last_kept, my_last);
  __syncthreads();
  const double threshold = static_cast<double>(u) * total_shared;
  double before = excl;
  int64_t crossing = -1;
  for (int64_t c = begin; c < end; ++c) {
    if (total_of[c] > 0 && before + total_of[c] > threshold) {  // never a chunk with nothing to draw
      crossing = c;
      break;
    }
    before += total_of[c];
  }
  if (crossing >= 0) atomicMin(&chosen_chunk, static_cast<int>(crossing));
  __syncthreads();
  if (crossing >= 0 && crossing == chosen_chunk) before_shared = before;  // the chunk's owner
  __syncthreads();
  if (threadIdx.x >= kWarp) return;
  int64_t token;
  if (chosen_chunk == INT_MAX) {
    token = last_kept >= 0 ? last_kept : a.vocab - 1;
  } else {
    const T* row = logits + b * lg_sb + i * lg_sn;
    const KeepRule<FILTERED> keep{FILTERED ? d.cut[slot] : 0.f};
    double run[kDrawPerLane], lane_excl;
    unsigned kept;
    int last = -1;
    warp_chunk_scan(row, static_cast<int64_t>(chosen_chunk) * kDrawChunk, a.vocab, row_max_of_parts(d, slot),
                    a.temperature, keep, run, kept, last, lane_excl);
    const double lane_before = before_shared + lane_excl;
    // The first kept token whose cumulative weight passes the threshold (a differently associated sum may
    // pass it at an unkept one: never drawn).
    int hit = kDrawPerLane;
#pragma unroll
    for (int e = kDrawPerLane - 1; e >= 0; --e) hit = (kept >> e & 1u) && lane_before + run[e] > threshold ? e : hit;
    const unsigned lanes_hit = __ballot_sync(kFullMask, hit < kDrawPerLane);
#pragma unroll
    for (int off = kWarp / 2; off > 0; off >>= 1) last = max(last, __shfl_xor_sync(kFullMask, last, off));
    const int first_lane = __ffs(lanes_hit) - 1;
    const int first_hit = __shfl_sync(kFullMask, hit, first_lane < 0 ? 0 : first_lane);
    token = lanes_hit != 0 ? static_cast<int64_t>(chosen_chunk) * kDrawChunk + first_lane * kDrawPerLane + first_hit
                           : last;
  }
  if (threadIdx.x == 0) a.token[slot] = token;
}

// Launches kernels 2 and 3 (kernel 1's maxima are in d.part_max).
template <typename T, bool FILTERED>
void launch_draw_over_row(const at::Tensor& logits, const SampleArgs& a, DrawRowArgs d, int64_t bsz,
                          cudaStream_t stream) {
  const int64_t nodes = bsz * a.num_nodes;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // Enough blocks over the nodes to fill the GPU kDrawBlocksPerSM deep, at most one chunk a warp.
  const int64_t per_node = std::max<int64_t>(
      1, std::min(cuda::ceil_div(kDrawBlocksPerSM * sms, nodes), cuda::ceil_div(d.chunks, kSampleThreads / kWarp)));
  sample_chunk_totals_kernel<T, FILTERED>
      <<<dim3(static_cast<unsigned>(per_node), static_cast<unsigned>(nodes)), kSampleThreads, 0, stream>>>(
          logits.data_ptr<T>(), logits.stride(0), logits.stride(1), a, d);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  sample_row_select_kernel<T, FILTERED>
      <<<dim3(static_cast<unsigned>(a.num_nodes), static_cast<unsigned>(bsz)), kSampleThreads, 0, stream>>>(
          logits.data_ptr<T>(), logits.stride(0), logits.stride(1), a, d);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Workspaces of a draw over the row for B x N nodes (shape-dependent, never data-dependent: fine under
// CUDA graph capture).
struct DrawRowWorkspace {
  at::Tensor chunk_total, chunk_last, cut, over_row;

  DrawRowWorkspace(const at::Tensor& logits, int64_t bsz, int64_t n) {
    const int64_t chunks = cuda::ceil_div(logits.size(2), int64_t{kDrawChunk});
    chunk_total = at::empty({bsz, n, chunks}, logits.options().dtype(at::kDouble));
    chunk_last = at::empty({bsz, n, chunks}, logits.options().dtype(at::kInt));
    cut = at::empty({bsz, n}, logits.options().dtype(at::kFloat));
    over_row = at::empty({bsz, n}, logits.options().dtype(at::kChar));
  }

  DrawRowArgs args(const at::Tensor& part_max) {
    return DrawRowArgs{part_max.data_ptr<float>(), static_cast<int>(part_max.size(2)), cut.data_ptr<float>(),
                       over_row.data_ptr<int8_t>(),  chunk_total.data_ptr<double>(),    chunk_last.data_ptr<int>(),
                       chunk_total.size(2)};
  }
};

// ---- the cut by radix selects over the row: top_p alone, top_k above the lists ---------------------
// The kept set is every x >= a cut, found by one or two selects over the row's values, digit by digit of their
// order-preserving 32-bit keys (ordered_bits), 11, 11 and 10 bits at a time:
//   * top_k > 64: a count select finds kth, the k-th largest x: count(x > kth) < k <= count(x >= kth);
//   * top_p: a mass select finds c, where the mass summed from the top first reaches top_p of the set's (the
//     row, or every x >= kth after a top_k): mass(x > c) < top_p * mass(set) <= mass(x >= c), the CPU op's rule.
// Each level of a select: a histogram by digit over the keys that match the digits found so far (one block per
// row segment, merged by global atomics), then per node a descending scan over the digits finds where the count
// or mass crosses its target. Then the draw over the row keeps x >= the cut.
// Masses are fixed-point integers, weights exp(x - max x) rounded to multiples of 2^-scale_bits: integer sums do
// not depend on their order, so the cut is the same on every run, and no row can overflow them (scale_bits
// leaves the vocabulary's size of headroom in 63 bits). At Qwen's vocabularies a unit is 2^-45 of the max
// weight, so the roundings, and the weights below half a unit (x more than 31.9 below the max) that count as
// zero, move the masses by at most V 2^-46 of the max weight (3.5e-9 at V = 248320): a cut can differ from the
// CPU op's (double sums) only when top_p * mass lands that close to a boundary between two values.
// (A sort of every row, which this replaced, took 3.3 ms for 65 rows of 248320 on the H200.)
constexpr int kRadixLevels = 3;
constexpr int kRadixBuckets = 2048;  // digits of 11 bits (the last level's 10 use half)
__host__ __device__ constexpr int radix_shift(int level) { return level == 0 ? 21 : level == 1 ? 10 : 0; }
__host__ __device__ constexpr int radix_buckets(int level) { return level == 2 ? 1024 : kRadixBuckets; }
static_assert(radix_shift(0) + 11 == 32 && radix_shift(1) + 11 == radix_shift(0) && radix_buckets(2) == 1 << radix_shift(1),
              "the levels' digits tile the 32-bit key");

// Per node, a select's progress: the key's digits found so far (levels before this one), the count or mass of
// every key above the digits' range, and the count or mass asked for.
struct RadixCut {
  uint32_t prefix;
  int failed;  // nothing to select (a mass select over a set with no finite weight): keep the whole set
  unsigned long long above;
  unsigned long long target;
};

// One select over every node's row.
struct RadixSelectArgs {
  RadixCut* state;             // [B, N]: this select's
  const RadixCut* floor;       // [B, N]: a mass select after a count select: only keys >= its kth count; or null
  unsigned long long* hist;    // [B, N, kRadixBuckets], zero before each level (each select zeroes what it read)
  float unit;                  // 2^scale_bits: a weight in fixed point is weight * unit, rounded
  long long count_target;      // a count select's k
  bool last;                   // its cut is the kept set's: the last level writes d.cut and d.over_row
};

// Whether key `key` lies in the range the digits found before `level` leave (and above the floor, if any).
template <int LEVEL>
__device__ __forceinline__ bool in_radix_range(uint32_t key, uint32_t prefix, uint32_t floor_key) {
  if (key < floor_key) return false;
  if constexpr (LEVEL == 0) {
    return true;
  } else {
    return (key >> radix_shift(LEVEL - 1)) == (prefix >> radix_shift(LEVEL - 1));
  }
}

// A block's histogram keeps a bucket's sum as three 32-bit words of kPartBits-bit parts of the amounts: 32-bit
// shared atomics are native, where a 64-bit add compiles to a compare-and-swap loop on sm_90 (which the lanes of a
// warp adding to one bucket, and the block's warps, spin on). Each lane adds its own amount, without warp
// aggregation: at level 0, where every key is in range, a warp's keys spread over many buckets, and aggregating
// by bucket cost more than the atomics it saved (65 rows of 248320, level-0 masses under Nsight Compute on two H100s:
// 980 us with a match and hardware reductions per group of lanes, 57.5 us like this; against the cooperative-groups
// partition and 64-bit atomic before, in one call, the whole top_p select took 177 us instead of 442:
// benchmarks/results/2026-12-05-h100-walk-sample-histograms.md). The parts' sums are exact whatever the order (no
// word overflows, see kMaxHistSegment), so the cut is the same on every run.
constexpr int kPartBits = 17;
// Elements a block may add: a low or middle word then sums less than 2^32. The top word takes amount >> 34 <=
// 2^(29 - vocab_bits) (the mass select's unit leaves the vocabulary's size of headroom), at most 2^29 over the row.
constexpr int64_t kMaxHistSegment = int64_t{1} << (32 - kPartBits);

template <bool COUNT>
__device__ __forceinline__ void add_to_bucket(unsigned* part0, unsigned* part1, unsigned* part2, unsigned digit,
                                              unsigned long long amount) {
  if constexpr (COUNT) {
    atomicAdd(part0 + digit, 1u);  // every amount is 1
  } else {
    constexpr unsigned long long kMask = (1ull << kPartBits) - 1;
    atomicAdd(part0 + digit, static_cast<unsigned>(amount & kMask));
    const unsigned middle = static_cast<unsigned>(amount >> kPartBits & kMask);
    const unsigned top = static_cast<unsigned>(amount >> (2 * kPartBits));
    if (middle != 0) atomicAdd(part1 + digit, middle);
    if (top != 0) atomicAdd(part2 + digit, top);
  }
}

// Level LEVEL's histogram: one block per (node, row segment) of the reachable nodes, its segment's counts or
// masses by digit in shared memory (add_to_bucket), then added into the node's global histogram (nonzero
// buckets only).
template <typename T, int LEVEL, bool COUNT>
__global__ void __launch_bounds__(kSampleThreads) radix_histogram_kernel(const T* __restrict__ logits, int64_t lg_sb,
                                                                         int64_t lg_sn, SampleArgs a, DrawRowArgs d,
                                                                         RadixSelectArgs s, int64_t seg_len) {
  constexpr int kBuckets = radix_buckets(LEVEL);
  __shared__ unsigned part0[kBuckets], part1[kBuckets], part2[kBuckets];
  const int seg = blockIdx.x;
  const int64_t slot = blockIdx.y;
  const int depth = a.depth[slot];
  if (depth < 0 || depth >= a.max_accept) return;  // no walk reaches this node: nothing to draw
  if (LEVEL > 0 && s.state[slot].failed) return;
  const uint32_t prefix = LEVEL > 0 ? s.state[slot].prefix : 0u;
  const uint32_t floor_key = s.floor != nullptr ? s.floor[slot].prefix : 0u;  // a count select never fails
  const int b = static_cast<int>(slot / a.num_nodes), i = static_cast<int>(slot % a.num_nodes);
  const int64_t start = seg * seg_len;  // < vocab: the launch makes ceil(vocab / seg_len) segments
  const int64_t len = start + seg_len < a.vocab ? seg_len : a.vocab - start;
  for (int e = threadIdx.x; e < kBuckets; e += kSampleThreads) part0[e] = part1[e] = part2[e] = 0;
  __syncthreads();
  const float m = COUNT ? 0.f : row_max_of_parts(d, slot), temperature = a.temperature, unit = s.unit;
  cuda::for_each_in_row<T, kSampleThreads>(logits + b * lg_sb + i * lg_sn + start, len, [&](float v, int64_t) {
    const float x = v / temperature;
    const uint32_t key = cuda::ordered_bits(x);
    if (!in_radix_range<LEVEL>(key, prefix, floor_key)) return;  // first: past level 0, most keys are out
    unsigned long long amount = 1;  // a count select counts every element, NaN and -inf included
    if constexpr (!COUNT) {
      const float scaled = expf(x - m) * unit;  // <= 2^scale_bits (exact: unit is a power of 2); NaN for NaN x
      if (!(scaled >= 0.5f)) return;            // rounds to zero mass, or NaN: adds nothing
      amount = __float2ull_rn(scaled);
    }
    add_to_bucket<COUNT>(part0, part1, part2, (key >> radix_shift(LEVEL)) & (kBuckets - 1), amount);
  });
  __syncthreads();
  unsigned long long* out = s.hist + slot * kRadixBuckets;
  for (int e = threadIdx.x; e < kBuckets; e += kSampleThreads) {
    const unsigned long long sum = part0[e] + (static_cast<unsigned long long>(part1[e]) << kPartBits) +
                                   (static_cast<unsigned long long>(part2[e]) << (2 * kPartBits));
    if (sum != 0) atomicAdd(out + e, sum);
  }
}

// Level LEVEL's select: one block per node. Thread t owns digits kBuckets - 1 - kPer t down to
// kBuckets - kPer (t + 1) (descending); a block scan of their sums places them, and the one bucket where
// the count or mass from the top crosses the target gives the digit. At the last level of the last select the
// cut goes to d.cut and every reachable node is marked to draw over its row.
template <int LEVEL, bool COUNT>
__global__ void __launch_bounds__(kSampleThreads) radix_select_kernel(SampleArgs a, DrawRowArgs d, RadixSelectArgs s) {
  constexpr int kBuckets = radix_buckets(LEVEL), kPer = kBuckets / kSampleThreads;
  static_assert(kBuckets % kSampleThreads == 0, "whole buckets a thread");
  __shared__ unsigned long long warp_totals[kSampleThreads / kWarp];
  __shared__ unsigned long long total;
  __shared__ int found;
  const int64_t slot = static_cast<int64_t>(blockIdx.y) * a.num_nodes + blockIdx.x;
  const int depth = a.depth[slot];
  const bool writes_cut = LEVEL == kRadixLevels - 1 && s.last;
  if (depth < 0 || depth >= a.max_accept) {
    if (writes_cut && threadIdx.x == 0) {
      d.over_row[slot] = 0;
      a.token[slot] = -1;
    }
    return;
  }
  RadixCut& st = s.state[slot];
  // Every thread reads the levels before's progress here, before the scan's barriers: the thread that finds the
  // digit overwrites it below, and a thread still to read it then would start from the new values.
  const bool failed_before = LEVEL > 0 && st.failed;
  const RadixCut before_level = LEVEL > 0 && !failed_before ? st : RadixCut{0u, 0, 0ull, 0ull};
  if (!failed_before) {
    unsigned long long* h = s.hist + slot * kRadixBuckets;
    unsigned long long mine[kPer], sum = 0;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      mine[e] = h[kBuckets - 1 - (kPer * threadIdx.x + e)];
      h[kBuckets - 1 - (kPer * threadIdx.x + e)] = 0;  // the next level's histogram starts from zero
      sum += mine[e];
    }
    if (threadIdx.x == 0) found = 0;
    unsigned long long before;
    const unsigned long long incl = block_scan(sum, warp_totals, before);  // its barriers publish `found`
    if (threadIdx.x == kSampleThreads - 1) total = incl;
    __syncthreads();
    unsigned long long above, target;
    if constexpr (LEVEL == 0) {
      above = 0;
      if constexpr (COUNT) {
        target = static_cast<unsigned long long>(s.count_target);
      } else {
        // top_p of the set's mass, rounded up: an integer mass reaches top_p * total iff it reaches this. (The
        // double product can round past the total only for a top_p within 2^-53 of 1: then all is kept.)
        target = static_cast<unsigned long long>(ceil(a.top_p * static_cast<double>(total)));
      }
      target = max(1ull, min(target, static_cast<unsigned long long>(total)));
    } else {
      above = before_level.above;
      target = before_level.target;
    }
    unsigned long long cum = above + before;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      if (mine[e] != 0 && cum < target && cum + mine[e] >= target) {  // exactly one bucket: cum is monotone
        const uint32_t digit = kBuckets - 1 - (kPer * threadIdx.x + e);
        st.prefix = before_level.prefix | digit << radix_shift(LEVEL);
        st.above = cum;
        st.target = target;
        found = 1;
      }
      cum += mine[e];
    }
    __syncthreads();
    if (threadIdx.x == 0 && !found) st.failed = 1;  // nothing to select (total 0)
    if (threadIdx.x == 0 && found && LEVEL == 0) st.failed = 0;
    __syncthreads();
  }
  if (writes_cut && threadIdx.x == 0) {
    // A failed mass select (no finite weight in the set: a +inf in the row) keeps the whole set: the row, or
    // top_k's (as the CPU op does; the draw then takes the set's largest id).
    const float keep_all = s.floor != nullptr ? cuda::from_ordered_bits(s.floor[slot].prefix) : -INFINITY;
    d.cut[slot] = apply_min_p(st.failed ? keep_all : cuda::from_ordered_bits(st.prefix), row_max_of_parts(d, slot),
                              a.min_p_offset);
    d.over_row[slot] = 1;
  }
}

// top_p alone, or top_k > 64 (with or without top_p): the rows' maxima, the selects' levels (a count select
// for top_k, then a mass select for top_p), then the draw over every reachable node's row above its cut.
template <typename T>
void launch_sample_radix(const at::Tensor& logits, const SampleArgs& args, int64_t bsz, cudaStream_t stream) {
  const int64_t n = args.num_nodes, vocab = args.vocab, rows = bsz * n;
  // Segments enough to keep kDrawBlocksPerSM blocks on every multiprocessor (the histogram's atomics and
  // loads want latency hidden), at least cuda::kMinRowSegment elements each.
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t segments = std::max<int64_t>(1, cuda::ceil_div(kDrawBlocksPerSM * sms, std::max<int64_t>(rows, 1)));
  segments = std::min(segments, std::max<int64_t>(1, vocab / cuda::kMinRowSegment));
  segments = std::max(segments, cuda::ceil_div(vocab, kMaxHistSegment));  // no block histogram's word overflows
  const int64_t seg_len = cuda::ceil_div(cuda::ceil_div(vocab, segments), 8) * 8;  // 16-byte aligned starts
  segments = cuda::ceil_div(vocab, seg_len);
  // Shape-dependent workspaces (never data-dependent): fine under CUDA graph capture (the zeroing is a
  // memset node).
  const at::Tensor part_max = at::empty({bsz, n, segments}, logits.options().dtype(at::kFloat));
  DrawRowWorkspace draw(logits, bsz, n);
  const DrawRowArgs d = draw.args(part_max);
  const bool by_count = args.top_k > 0, by_mass = args.top_p < 1.0;
  const at::Tensor states = at::empty({2 * rows * static_cast<int64_t>(sizeof(RadixCut))}, logits.options().dtype(at::kByte));
  RadixCut* count_state = reinterpret_cast<RadixCut*>(states.data_ptr());
  const at::Tensor hist = at::zeros({bsz, n, kRadixBuckets}, logits.options().dtype(at::kLong));
  int vocab_bits = 0;  // ceil(log2 vocab): the headroom the row's sum needs
  while ((int64_t{1} << vocab_bits) < vocab) ++vocab_bits;
  const RadixSelectArgs count_select{count_state, nullptr, reinterpret_cast<unsigned long long*>(hist.data_ptr<int64_t>()),
                                     1.f, args.top_k, /*last=*/!by_mass};
  const RadixSelectArgs mass_select{count_state + rows, by_count ? count_state : nullptr, count_select.hist,
                                    std::ldexp(1.0f, std::min(62, 63 - vocab_bits)), 0, /*last=*/true};
  const T* lg = logits.data_ptr<T>();
  const int64_t lg_sb = logits.stride(0), lg_sn = logits.stride(1);
  sample_row_max_kernel<T><<<dim3(static_cast<unsigned>(n * segments), static_cast<unsigned>(bsz)), kSampleThreads, 0,
                             stream>>>(lg, lg_sb, lg_sn, args, static_cast<int>(segments), seg_len,
                                       part_max.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const dim3 hist_grid(static_cast<unsigned>(segments), static_cast<unsigned>(rows));
  const dim3 node_grid(static_cast<unsigned>(n), static_cast<unsigned>(bsz));
  auto select = [&](auto count_constant, const RadixSelectArgs& s) {
    constexpr bool kCount = decltype(count_constant)::value;
    auto level = [&](auto level_constant) {
      constexpr int kLevel = decltype(level_constant)::value;
      radix_histogram_kernel<T, kLevel, kCount>
          <<<hist_grid, kSampleThreads, 0, stream>>>(lg, lg_sb, lg_sn, args, d, s, seg_len);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      radix_select_kernel<kLevel, kCount><<<node_grid, kSampleThreads, 0, stream>>>(args, d, s);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    level(std::integral_constant<int, 0>{});
    level(std::integral_constant<int, 1>{});
    level(std::integral_constant<int, 2>{});
    static_assert(kRadixLevels == 3, "one launch pair a level");
  };
  if (by_count) select(std::true_type{}, count_select);
  if (by_mass) select(std::false_type{}, mass_select);
  launch_draw_over_row<T, /*FILTERED=*/true>(logits, args, d, bsz, stream);
}

// top_k in [1, 64], step 2: one block per node. Warp 0 merges the segments' lists into the row's best
// K_CAP (x, id) pairs. The top_k set is every x >= the k-th largest, kth. top_p then keeps the groups
// of equal x, in descending order, whose mass above is below top_p of the set's (when the list ends
// inside kth's group, the group may run past it and is counted over the row): the kept set is every
// x >= a cut value. When all of it is in the list, warp 0 draws from the list; else (kth's group is
// kept and runs past the list) the node is marked to draw over its row (d.over_row, d.cut), which the
// kernels after this one do.
template <typename T, int K_CAP>
__global__ void __launch_bounds__(kSampleThreads) sample_top_k_draw_kernel(const T* __restrict__ logits, int64_t lg_sb,
                                                                           int64_t lg_sn, SampleArgs a, DrawRowArgs d,
                                                                           const float* __restrict__ part_val,
                                                                           const int* __restrict__ part_id) {
  __shared__ double warp_totals[kSampleThreads / kWarp];
  __shared__ float val[K_CAP];
  __shared__ int id[K_CAP];
  __shared__ bool keep[K_CAP];
  __shared__ float weight_by_id[K_CAP];  // exp(x - max x) of the kept tokens, ascending id
  __shared__ int id_by_id[K_CAP];
  __shared__ double tied_in_row;
  __shared__ float cut_shared;
  __shared__ bool over_row_shared;
  const int i = blockIdx.x, b = blockIdx.y, lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t slot = static_cast<int64_t>(b) * a.num_nodes + i;
  float u;
  if (!sample_target(a, b, i, u)) {
    if (threadIdx.x == 0) d.over_row[slot] = 0;
    return;
  }
  const int64_t first = slot * d.segments;
  if (warp == 0) {
    cuda::warp_merge_lists(part_val + first * K_CAP, part_id + first * K_CAP, K_CAP, d.segments, K_CAP, val, id);
  }
  const float m = row_max_of_parts(d, slot);  // the reference point of every weight (as on the CPU)
  __syncthreads();
  const T* row = logits + b * lg_sb + i * lg_sn;
  const float temperature = a.temperature;
  const int k = a.top_k;
  const float kth = val[k - 1];
  // The list ends inside kth's tie group, which may run past it: count the group over the row (a
  // block-uniform branch). top_p needs the count for the set's mass; the draw, to know whether the kept set
  // fits the list, else the node draws over its row.
  const bool group_past_list = val[K_CAP - 1] == kth;
  if (group_past_list) {
    int count = 0;
    cuda::for_each_in_row<T, kSampleThreads>(row, a.vocab, [&](float x, int64_t) { count += x / temperature == kth; });
    double excl;
    const double incl = block_scan(static_cast<double>(count), warp_totals, excl);
    if (threadIdx.x == kSampleThreads - 1) tied_in_row = incl;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    int above_kth = k - 1;  // the list's entries [0, above_kth) are every x > kth
    while (above_kth > 0 && val[above_kth - 1] == kth) --above_kth;
    int tied_in_list = 0;
    for (int r = above_kth; r < K_CAP && val[r] == kth; ++r) tied_in_list += id[r] != cuda::kNoId;
    const double tied = group_past_list ? tied_in_row : tied_in_list;
    float cut = kth;
    if (a.top_p < 1.0) {
      // The top_k set's mass: its tokens above kth, then kth's group.
      double mass = tied * static_cast<double>(expf(kth - m));
      for (int r = 0; r < above_kth; ++r) mass += expf(val[r] - m);
      // Groups of equal x in descending order (masses in double, like the CPU op): a group stays while the
      // mass above it is below top_p of the set's mass; the first always does.
      const double target = a.top_p * mass;
      double above = 0;
      int r = 0;
      while (r < above_kth && above < target) {
        cut = val[r];
        for (const float group = val[r]; r < above_kth && val[r] == group; ++r) above += expf(val[r] - m);
      }
      if (r == above_kth && above < target) cut = kth;
    }
    cut = apply_min_p(cut, m, a.min_p_offset);
    cut_shared = cut;
    const bool over_row = cut == kth && tied > tied_in_list;  // kth's group is kept and runs past the list
    over_row_shared = over_row;
    d.over_row[slot] = over_row;
    d.cut[slot] = cut;
  }
  __syncthreads();
  const float cut = cut_shared;
  if (over_row_shared || warp != 0) return;
  // Every kept token is in the list: warp 0 ranks them by id (each lane its entries) and lane 0 draws.
  for (int r = lane; r < K_CAP; r += kWarp) keep[r] = val[r] >= cut && id[r] != cuda::kNoId;  // not padding
  __syncwarp();
  for (int r = lane; r < K_CAP; r += kWarp) {
    if (!keep[r]) continue;
    int pos = 0;
    for (int s = 0; s < K_CAP; ++s) pos += keep[s] && id[s] < id[r];
    id_by_id[pos] = id[r];
    weight_by_id[pos] = expf(val[r] - m);
  }
  __syncwarp();
  if (lane != 0) return;
  // Inverse CDF in ascending id order: the first kept token whose cumulative weight exceeds
  // uniform * total, else the largest kept id. The list's first entry is kept unless the list holds no token
  // at all (a row of NaNs, which no list takes): then the row's last id, as the CPU op draws there.
  int count = 0;
  for (int r = 0; r < K_CAP; ++r) count += keep[r];
  double total = 0;
  for (int r = 0; r < count; ++r) total += weight_by_id[r];
  const double threshold = static_cast<double>(u) * total;
  int64_t token = count > 0 ? id_by_id[count - 1] : a.vocab - 1;
  double cum = 0;
  for (int r = 0; r < count; ++r) {
    cum += weight_by_id[r];
    if (cum > threshold) {
      token = id_by_id[r];
      break;
    }
  }
  a.token[slot] = token;
}

template <typename T, int K_CAP>
void launch_sample_top_k(const at::Tensor& logits, const SampleArgs& args, int64_t bsz, cudaStream_t stream) {
  const int64_t n = args.num_nodes;
  const auto [segments, seg_len] = cuda::split_rows(bsz * n, args.vocab);
  // Shape-dependent workspaces (never data-dependent): fine under CUDA graph capture.
  const auto f32 = logits.options().dtype(at::kFloat);
  const at::Tensor part_val = at::empty({bsz, n, segments, K_CAP}, f32);
  const at::Tensor part_id = at::empty({bsz, n, segments, K_CAP}, logits.options().dtype(at::kInt));
  const at::Tensor part_max = at::empty({bsz, n, segments}, f32);
  DrawRowWorkspace over_row(logits, bsz, n);
  const DrawRowArgs d = over_row.args(part_max);
  sample_top_k_segment_kernel<T, K_CAP>
      <<<dim3(static_cast<unsigned>(n * segments), static_cast<unsigned>(bsz)), kSampleThreads, 0, stream>>>(
          logits.data_ptr<T>(), logits.stride(0), logits.stride(1), args, static_cast<int>(segments), seg_len,
          part_val.data_ptr<float>(), part_id.data_ptr<int>(), part_max.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  sample_top_k_draw_kernel<T, K_CAP>
      <<<dim3(static_cast<unsigned>(n), static_cast<unsigned>(bsz)), kSampleThreads, 0, stream>>>(
          logits.data_ptr<T>(), logits.stride(0), logits.stride(1), args, d, part_val.data_ptr<float>(),
          part_id.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch_draw_over_row<T, /*FILTERED=*/true>(logits, args, d, bsz, stream);
}

// min_p alone: every reachable node draws over its row, keeping x >= min_p_cut (min_p.h). One thread a node.
__global__ void __launch_bounds__(kSampleThreads) min_p_cut_kernel(SampleArgs a, DrawRowArgs d, int64_t rows) {
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * kSampleThreads + threadIdx.x;
  if (slot >= rows) return;
  const int depth = a.depth[slot];
  const bool reached = depth >= 0 && depth < a.max_accept;
  d.over_row[slot] = reached;
  if (!reached) {
    a.token[slot] = -1;
    return;
  }
  d.cut[slot] = apply_min_p(-INFINITY, row_max_of_parts(d, slot), a.min_p_offset);
}

// No top_k, no top_p: the rows' maxima by segments, then the draw over every reachable node's row (above min_p's cut
// where it is on).
template <typename T>
void launch_sample_full(const at::Tensor& logits, const SampleArgs& args, int64_t bsz, cudaStream_t stream) {
  const int64_t n = args.num_nodes;
  const auto [segments, seg_len] = cuda::split_rows(bsz * n, args.vocab);
  const at::Tensor part_max = at::empty({bsz, n, segments}, logits.options().dtype(at::kFloat));
  DrawRowWorkspace over_row(logits, bsz, n);
  sample_row_max_kernel<T>
      <<<dim3(static_cast<unsigned>(n * segments), static_cast<unsigned>(bsz)), kSampleThreads, 0, stream>>>(
          logits.data_ptr<T>(), logits.stride(0), logits.stride(1), args, static_cast<int>(segments), seg_len,
          part_max.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const DrawRowArgs d = over_row.args(part_max);
  if (args.min_p_offset == -INFINITY) {
    launch_draw_over_row<T, /*FILTERED=*/false>(logits, args, d, bsz, stream);
    return;
  }
  min_p_cut_kernel<<<static_cast<unsigned>(cuda::ceil_div(bsz * n, int64_t{kSampleThreads})), kSampleThreads, 0,
                     stream>>>(args, d, bsz * n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch_draw_over_row<T, /*FILTERED=*/true>(logits, args, d, bsz, stream);
}

}  // namespace

// ---- entry points ------------------------------------------------------------------------------

void row_argmax_cuda(const at::Tensor& x, at::Tensor& out) {
  check_row_argmax(x, out);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), n = x.size(1);
  if (rows == 0) return;
  const auto [segments, seg_len] = cuda::split_rows(rows, n);
  // A shape-dependent workspace (never data-dependent): fine under CUDA graph capture.
  const at::Tensor part = at::empty({segments > 1 ? rows * segments : 0}, x.options().dtype(at::kLong));
  DDTREE_CUDA_DISPATCH_FLOAT(x.scalar_type(), "row_argmax", [&] {
    cuda::launch_programmatic(row_argmax_segment_kernel<scalar_t>, dim3(static_cast<unsigned>(rows * segments)),
        dim3(kArgmaxThreads), 0, x.data_ptr<scalar_t>(), x.stride(0), n, static_cast<int>(segments), seg_len,
        reinterpret_cast<uint64_t*>(part.data_ptr<int64_t>()), out.data_ptr<int64_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (segments > 1) {
    cuda::launch_programmatic(row_argmax_merge_kernel, dim3(static_cast<unsigned>(cuda::ceil_div(rows, int64_t{8}))),
                              dim3(kWarp * 8), 0, reinterpret_cast<const uint64_t*>(part.data_ptr<int64_t>()), rows,
                              static_cast<int>(segments), out.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void walk_greedy_cuda(const at::Tensor& node_token, const at::Tensor& first_child, const at::Tensor& next_sibling,
                      const at::Tensor& target_token, at::Tensor& accepted, at::Tensor& accept_len,
                      at::Tensor& next_token) {
  constexpr const char* op = "walk_greedy";
  check_walk(op, node_token, first_child, next_sibling, accepted, accept_len, next_token);
  check_walk_greedy(node_token, target_token, accepted, accept_len, next_token);
  const c10::cuda::CUDAGuard guard(node_token.device());
  if (node_token.size(0) == 0 || accepted.size(1) == 0) return;
  launch_walk(links_of(node_token, first_child, next_sibling), target_token,
              walk_out_of(accepted, accept_len, next_token), node_token.size(0));
}

void walk_sample_cuda(const at::Tensor& node_token, const at::Tensor& first_child, const at::Tensor& next_sibling,
                      const at::Tensor& logits, const at::Tensor& uniform, double temperature, int64_t top_k,
                      double top_p, double min_p, at::Tensor& accepted, at::Tensor& accept_len,
                      at::Tensor& next_token) {
  constexpr const char* op = "walk_sample";
  check_walk(op, node_token, first_child, next_sibling, accepted, accept_len, next_token);
  check_walk_sample(node_token, logits, uniform, temperature, top_k, top_p, min_p, accepted);
  const c10::cuda::CUDAGuard guard(node_token.device());
  const int64_t bsz = node_token.size(0), n = node_token.size(1), vocab = logits.size(2);
  if (bsz == 0 || accepted.size(1) == 0) return;
  const TreeLinks tree = links_of(node_token, first_child, next_sibling);
  const cudaStream_t stream = cuda::current_stream();

  // Shape-dependent workspaces (never data-dependent): fine under CUDA graph capture.
  const at::Tensor depth = at::empty({bsz, n}, node_token.options().dtype(at::kInt));
  at::Tensor token = at::empty({bsz, n}, node_token.options().dtype(at::kLong));
  tree_depth_kernel<<<static_cast<unsigned>(bsz), kDepthThreads, sizeof(int) * n, stream>>>(
      tree, depth.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const int64_t k_on = top_k > 0 && top_k < vocab ? top_k : 0;
  const bool p_on = top_p < 1.0;
  const SampleArgs args{depth.data_ptr<int32_t>(), uniform.data_ptr<float>(), uniform.stride(0), uniform.stride(1),
                        static_cast<int>(n), static_cast<int>(uniform.size(1)), vocab,
                        static_cast<float>(temperature), top_p, static_cast<int>(k_on), min_p_offset(min_p),
                        token.data_ptr<int64_t>()};
  const bool beyond_lists = k_on > kSampleMaxTopK || (k_on == 0 && p_on);
  DDTREE_CUDA_DISPATCH_FLOAT(logits.scalar_type(), op, [&] {
    if (beyond_lists) {
      launch_sample_radix<scalar_t>(logits, args, bsz, stream);
    } else if (k_on == 0) {
      launch_sample_full<scalar_t>(logits, args, bsz, stream);
    } else if (k_on <= 8 - 4) {  // a list 4 longer than k: kth's tie group seldom runs past it
      launch_sample_top_k<scalar_t, 8>(logits, args, bsz, stream);
    } else if (k_on <= 16 - 4) {
      launch_sample_top_k<scalar_t, 16>(logits, args, bsz, stream);
    } else if (k_on <= 32 - 4) {
      launch_sample_top_k<scalar_t, 32>(logits, args, bsz, stream);
    } else {
      launch_sample_top_k<scalar_t, 64>(logits, args, bsz, stream);
    }
  });
  launch_walk(tree, token, walk_out_of(accepted, accept_len, next_token), bsz);
}

}  // namespace ddtree
