// CUDA implementations of the walk ops. Semantics: ddtree_ext/reference.py (_walk, sample_token).
//
// walk_greedy: one block per row stages the row's tree in shared memory and one thread follows it.
// walk_sample: the token the target draws at a node depends only on that node's logits and on
// uniform[b, depth], so every reachable node draws its token in parallel first (depths come from the
// child links); the walk itself is then the greedy walk over those tokens. Draws:
//   * top_k in [1, 64]: one pass over each node's row, split into segments over several blocks
//     (row_topk.cuh), gives the row's best 8/16/32/64 (the first at least k + 4 long, else 64); one
//     block per node merges the segments and finds top_k's and top_p's cut values from them (a group
//     tied with the k-th that runs past the list is counted over the row), then draws from the list,
//     or over the row when the kept set runs past the list;
//   * no top_k, no top_p: a max pass, then chunked prefix sums in ascending id order;
//   * anything else (top_p over the whole vocabulary, top_k > 64): the same rule through a sort of
//     every node's row in ATen on the device (exact, heavier).
// Like the CPU op, weights are float32 exp(x - max x) and masses are summed in double, in a different
// order, so a draw can differ from the CPU op's only when uniform * total (or top_p * mass) lands
// within double rounding (or expf's last-bit differences) of a cumulative boundary.
#include "cuda_common.cuh"
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
  walk_tree_kernel<<<static_cast<unsigned>(bsz), kWalkThreads, smem, cuda::current_stream()>>>(
      tree, target.data_ptr<int64_t>(), target.stride(0), target.stride(1), out);
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
  const uint32_t hi = isnan(v) ? 0xffffffffu : cuda::ordered_bits(v);
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
constexpr int kSampleChunkPerThread = 8;
constexpr int kSampleChunk = kSampleThreads * kSampleChunkPerThread;

struct SampleArgs {
  const int32_t* depth;    // [B, N] contiguous workspace
  const float* uniform;    // [B, D]
  int64_t un_sb, un_sd;
  int num_nodes, max_accept;
  int64_t vocab;
  float temperature;
  double top_p;            // 1 = off
  int top_k;               // 0 = off
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
__device__ __forceinline__ double block_scan(double x, double* warp_totals, double& exclusive) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  double incl = x;
#pragma unroll
  for (int off = 1; off < kWarp; off <<= 1) {
    const double y = __shfl_up_sync(kFullMask, incl, off);
    if (lane >= off) incl += y;
  }
  if (lane == kWarp - 1) warp_totals[warp] = incl;
  __syncthreads();
  double before = 0;
  for (int w = 0; w < warp; ++w) before += warp_totals[w];
  const double prev_in_warp = __shfl_up_sync(kFullMask, incl, 1);
  exclusive = before + (lane == 0 ? 0.0 : prev_in_warp);
  incl = before + incl;
  __syncthreads();  // warp_totals is reused by the next scan
  return incl;
}

// Draws by inverse CDF in ascending id order over the tokens of a row that keep(x) keeps, x = logit /
// temperature, weights exp(x - m), sums in double: per-chunk totals, the chunk holding uniform * total,
// that chunk rescanned. Every thread of the block calls it; the result is valid in thread 0. With no
// crossing (non-finite logits) it is the largest kept id (the last id if none is kept); with a crossing
// the chunk total saw but no element did (a rounding gap between the two sums), the chunk's largest kept
// id. Once per block: its shared scalars are set up without a barrier before them.
template <typename T, typename Keep>
__device__ int64_t draw_over_row(const T* __restrict__ row, const SampleArgs& a, float m, float u, Keep keep,
                                 double* chunk_total, double* warp_totals) {
  __shared__ int chosen_chunk, chosen_id, last_kept, last_in_chunk;
  __shared__ double chosen_before, threshold_shared;
  const float temperature = a.temperature;
  if (threadIdx.x == 0) {
    last_kept = -1;
    last_in_chunk = -1;
    chosen_id = cuda::kNoId;
  }
  // Thread t of a chunk owns ids [c0 + 8 t, c0 + 8 t + 8): its running sums, then the block scan.
  auto thread_sum = [&](int64_t c0, double (&run)[kSampleChunkPerThread], int& last) {
    double s = 0;
#pragma unroll
    for (int e = 0; e < kSampleChunkPerThread; ++e) {
      const int64_t j = c0 + threadIdx.x * kSampleChunkPerThread + e;
      const float x = j < a.vocab ? cuda::to_float(row[j]) / temperature : 0.f;
      if (j < a.vocab && keep(x)) {
        s += expf(x - m);
        last = static_cast<int>(j);
      }
      run[e] = s;
    }
    return s;
  };
  const int chunks = static_cast<int>((a.vocab + kSampleChunk - 1) / kSampleChunk);
  int my_last = -1;
  for (int c = 0; c < chunks; ++c) {
    double run[kSampleChunkPerThread], excl;
    const double incl = block_scan(thread_sum(static_cast<int64_t>(c) * kSampleChunk, run, my_last), warp_totals, excl);
    if (threadIdx.x == kSampleThreads - 1) chunk_total[c] = incl;
  }
  if (my_last >= 0) atomicMax(&last_kept, my_last);
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    for (int c = 0; c < chunks; ++c) total += chunk_total[c];
    const double threshold = static_cast<double>(u) * total;
    double before = 0;
    int chosen = -1;
    for (int c = 0; c < chunks && chosen < 0; ++c) {
      if (before + chunk_total[c] > threshold) {
        chosen = c;
      } else {
        before += chunk_total[c];
      }
    }
    chosen_chunk = chosen;
    chosen_before = before;
    threshold_shared = threshold;
  }
  __syncthreads();
  const int chosen = chosen_chunk;
  if (chosen < 0) return last_kept >= 0 ? last_kept : a.vocab - 1;
  const int64_t c0 = static_cast<int64_t>(chosen) * kSampleChunk;
  double run[kSampleChunkPerThread], excl;
  int my_last_in_chunk = -1;
  block_scan(thread_sum(c0, run, my_last_in_chunk), warp_totals, excl);
  const double before = chosen_before + excl, threshold = threshold_shared;
#pragma unroll
  for (int e = 0; e < kSampleChunkPerThread; ++e) {
    const int64_t j = c0 + threadIdx.x * kSampleChunkPerThread + e;
    if (j < a.vocab && before + run[e] > threshold) {
      atomicMin(&chosen_id, static_cast<int>(j));
      break;
    }
  }
  if (my_last_in_chunk >= 0) atomicMax(&last_in_chunk, my_last_in_chunk);
  __syncthreads();
  return chosen_id != cuda::kNoId ? chosen_id : last_in_chunk;
}

// top_k in [1, 64], step 2: one block per node. Warp 0 merges the segments' lists into the row's best
// K_CAP (x, id) pairs. The top_k set is every x >= the k-th largest, kth. top_p then keeps the groups
// of equal x, in descending order, whose mass above is below top_p of the set's (when the list ends
// inside kth's group, the group may run past it and is counted over the row): the kept set is every
// x >= a cut value. When all of it is in the list, warp 0 draws from the list; else (kth's group is
// kept and runs past the list) the block draws over the row.
template <typename T, int K_CAP>
__global__ void __launch_bounds__(kSampleThreads) sample_top_k_draw_kernel(const T* __restrict__ logits, int64_t lg_sb,
                                                                           int64_t lg_sn, SampleArgs a, int segments,
                                                                           const float* __restrict__ part_val,
                                                                           const int* __restrict__ part_id,
                                                                           const float* __restrict__ part_max) {
  extern __shared__ double chunk_total[];  // [ceil(V / kSampleChunk)], for a draw over the row
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
  float u;
  if (!sample_target(a, b, i, u)) return;
  const int64_t first = (static_cast<int64_t>(b) * a.num_nodes + i) * segments;
  if (warp == 0) {
    cuda::warp_merge_lists(part_val + first * K_CAP, part_id + first * K_CAP, K_CAP, segments, K_CAP, val, id);
  }
  float m = -INFINITY;  // the row's max x, the reference point of every weight (as on the CPU)
  for (int s = 0; s < segments; ++s) m = fmaxf(m, part_max[first + s]);
  __syncthreads();
  const T* row = logits + b * lg_sb + i * lg_sn;
  const float temperature = a.temperature;
  const int k = a.top_k;
  const float kth = val[k - 1];
  // The list ends inside kth's tie group, which may run past it: count the group over the row (a
  // block-uniform branch). top_p needs the count for the set's mass; the draw, to know whether the kept set
  // fits the list (one pass over the row, where a draw over it makes two with a block scan per chunk).
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
    cut_shared = cut;
    over_row_shared = cut == kth && tied > tied_in_list;  // kth's group is kept and runs past the list
  }
  __syncthreads();
  const float cut = cut_shared;
  if (over_row_shared) {
    const int64_t token =
        draw_over_row(row, a, m, u, [cut](float x) { return x >= cut; }, chunk_total, warp_totals);
    if (threadIdx.x == 0) a.token[static_cast<int64_t>(b) * a.num_nodes + i] = token;
    return;
  }
  if (warp != 0) return;
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
  // uniform * total, else the largest kept id (the list's first entry is always kept).
  int count = 0;
  for (int r = 0; r < K_CAP; ++r) count += keep[r];
  double total = 0;
  for (int r = 0; r < count; ++r) total += weight_by_id[r];
  const double threshold = static_cast<double>(u) * total;
  int64_t token = id_by_id[count - 1];
  double cum = 0;
  for (int r = 0; r < count; ++r) {
    cum += weight_by_id[r];
    if (cum > threshold) {
      token = id_by_id[r];
      break;
    }
  }
  a.token[static_cast<int64_t>(b) * a.num_nodes + i] = token;
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
  sample_top_k_segment_kernel<T, K_CAP>
      <<<dim3(static_cast<unsigned>(n * segments), static_cast<unsigned>(bsz)), kSampleThreads, 0, stream>>>(
          logits.data_ptr<T>(), logits.stride(0), logits.stride(1), args, static_cast<int>(segments), seg_len,
          part_val.data_ptr<float>(), part_id.data_ptr<int>(), part_max.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  sample_top_k_draw_kernel<T, K_CAP>
      <<<dim3(static_cast<unsigned>(n), static_cast<unsigned>(bsz)), kSampleThreads,
         sizeof(double) * cuda::ceil_div(args.vocab, kSampleChunk), stream>>>(
          logits.data_ptr<T>(), logits.stride(0), logits.stride(1), args, static_cast<int>(segments),
          part_val.data_ptr<float>(), part_id.data_ptr<int>(), part_max.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// No top_k, no top_p: a max pass, then the draw over the row.
template <typename T>
__global__ void __launch_bounds__(kSampleThreads) sample_full_kernel(const T* __restrict__ logits, int64_t lg_sb,
                                                                     int64_t lg_sn, SampleArgs a) {
  extern __shared__ double chunk_total[];  // [ceil(V / kSampleChunk)]
  __shared__ double warp_totals[kSampleThreads / kWarp];
  __shared__ float warp_max[kSampleThreads / kWarp];
  const int i = blockIdx.x, b = blockIdx.y;
  float u;
  if (!sample_target(a, b, i, u)) return;
  const T* row = logits + b * lg_sb + i * lg_sn;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const float temperature = a.temperature;

  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < a.vocab; j += kSampleThreads) m = fmaxf(m, cuda::to_float(row[j]) / temperature);
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, off));
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  m = warp_max[0];
  for (int w = 1; w < kSampleThreads / kWarp; ++w) m = fmaxf(m, warp_max[w]);
  const int64_t token = draw_over_row(row, a, m, u, [](float) { return true; }, chunk_total, warp_totals);
  if (threadIdx.x == 0) a.token[static_cast<int64_t>(b) * a.num_nodes + i] = token;
}

// The CPU op's rule, batched over every node through ATen on the device: weights exp(x - max x); the top_k
// set (every x at or above the k-th largest); top_p's cut value from a descending sort and double masses;
// the inverse CDF by a double cumulative sum and a search.
void sample_by_sort(const at::Tensor& logits, const at::Tensor& uniform, const at::Tensor& depth, double temperature,
                    int64_t top_k, double top_p, at::Tensor& token) {
  const int64_t vocab = logits.size(2);
  // Divided by a device tensor: ATen divides by a host scalar as a multiply by its reciprocal, a bit off
  // x / temperature (which the other paths compute), and a bit can make or break a tie the cuts keep whole.
  const at::Tensor x = logits.to(at::kFloat).div(at::full({}, static_cast<float>(temperature), logits.options().dtype(at::kFloat)));
  const at::Tensor weight = (x - std::get<0>(x.max(-1, /*keepdim=*/true))).exp();
  const at::Tensor u = uniform.gather(1, depth.clamp(0, uniform.size(1) - 1).to(at::kLong));  // [B, N]
  const at::Tensor rank = at::arange(vocab, x.options().dtype(at::kLong));
  at::Tensor keep = at::ones_like(x, x.options().dtype(at::kBool));
  if (top_k > 0 && top_k < vocab) keep = x.ge(std::get<0>(x.topk(top_k, -1)).narrow(-1, top_k - 1, 1));
  if (top_p < 1.0) {
    const auto [sorted_x, order] = at::sort(x, /*stable=*/false, /*dim=*/-1, /*descending=*/true);
    const at::Tensor keep_sorted = keep.gather(-1, order);
    const at::Tensor mass = weight.gather(-1, order).to(at::kDouble).mul(keep_sorted);
    const at::Tensor above = mass.cumsum(-1).sub(mass);
    const at::Tensor in_prefix = keep_sorted.logical_and(above.lt(mass.sum(-1, /*keepdim=*/true).mul(top_p)));
    // The last token kept in rank order; its value keeps its ties too.
    keep = keep.logical_and(x.ge(sorted_x.masked_fill(in_prefix.logical_not(), INFINITY).amin(-1, true)));
  }
  const at::Tensor cum = weight.to(at::kDouble).mul(keep).cumsum(-1);
  const at::Tensor threshold = u.to(at::kDouble).unsqueeze(-1).mul(cum.narrow(-1, vocab - 1, 1));
  const at::Tensor hit = at::searchsorted(cum, threshold, /*out_int32=*/false, /*right=*/true).squeeze(-1);
  const at::Tensor kept_max = keep.mul(rank).amax(-1);
  token.copy_(at::where(hit.lt(vocab), hit, kept_max));
}

}  // namespace

// ---- entry points ------------------------------------------------------------------------------

void row_argmax_cuda(const at::Tensor& x, at::Tensor& out) {
  check_row_argmax(x, out);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), n = x.size(1);
  if (rows == 0) return;
  const auto [segments, seg_len] = cuda::split_rows(rows, n);
  const cudaStream_t stream = cuda::current_stream();
  // A shape-dependent workspace (never data-dependent): fine under CUDA graph capture.
  const at::Tensor part = at::empty({segments > 1 ? rows * segments : 0}, x.options().dtype(at::kLong));
  DDTREE_CUDA_DISPATCH_FLOAT(x.scalar_type(), "row_argmax", [&] {
    row_argmax_segment_kernel<scalar_t><<<static_cast<unsigned>(rows * segments), kArgmaxThreads, 0, stream>>>(
        x.data_ptr<scalar_t>(), x.stride(0), n, static_cast<int>(segments), seg_len,
        reinterpret_cast<uint64_t*>(part.data_ptr<int64_t>()), out.data_ptr<int64_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (segments > 1) {
    row_argmax_merge_kernel<<<static_cast<unsigned>(cuda::ceil_div(rows, int64_t{8})), kWarp * 8, 0, stream>>>(
        reinterpret_cast<const uint64_t*>(part.data_ptr<int64_t>()), rows, static_cast<int>(segments),
        out.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void walk_greedy_cuda(const at::Tensor& node_token, const at::Tensor& first_child, const at::Tensor& next_sibling,
                      const at::Tensor& target_token, at::Tensor& accepted, at::Tensor& accept_len,
                      at::Tensor& next_token) {
  constexpr const char* op = "walk_greedy";
  check_walk(op, node_token, first_child, next_sibling, accepted, accept_len, next_token);
  check_walk_greedy(node_token, target_token);
  const c10::cuda::CUDAGuard guard(node_token.device());
  if (node_token.size(0) == 0 || accepted.size(1) == 0) return;
  launch_walk(links_of(node_token, first_child, next_sibling), target_token,
              walk_out_of(accepted, accept_len, next_token), node_token.size(0));
}

void walk_sample_cuda(const at::Tensor& node_token, const at::Tensor& first_child, const at::Tensor& next_sibling,
                      const at::Tensor& logits, const at::Tensor& uniform, double temperature, int64_t top_k,
                      double top_p, at::Tensor& accepted, at::Tensor& accept_len, at::Tensor& next_token) {
  constexpr const char* op = "walk_sample";
  check_walk(op, node_token, first_child, next_sibling, accepted, accept_len, next_token);
  check_walk_sample(node_token, logits, uniform, temperature, top_k, top_p, accepted);
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
                        static_cast<float>(temperature), top_p, static_cast<int>(k_on),
                        token.data_ptr<int64_t>()};
  if (k_on > kSampleMaxTopK || (k_on == 0 && p_on)) {
    sample_by_sort(logits, uniform, depth, temperature, top_k, top_p, token);
  } else {
    DDTREE_CUDA_DISPATCH_FLOAT(logits.scalar_type(), op, [&] {
      if (k_on == 0) {
        sample_full_kernel<scalar_t><<<dim3(static_cast<unsigned>(n), static_cast<unsigned>(bsz)), kSampleThreads,
                                       sizeof(double) * cuda::ceil_div(vocab, kSampleChunk), stream>>>(
            logits.data_ptr<scalar_t>(), logits.stride(0), logits.stride(1), args);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  }
  launch_walk(tree, token, walk_out_of(accepted, accept_len, next_token), bsz);
}

}  // namespace ddtree
