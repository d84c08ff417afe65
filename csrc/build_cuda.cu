// CUDA implementations of the build ops: per-depth top-K with log-softmax, the best-first tree, and
// the attention mask of the verify block. Semantics: ddtree_ext/reference.py; argument checks: the
// device-agnostic check_* functions shared with the CPU ops.
#include "cuda_common.cuh"
#include "ops.h"
#include "row_topk.cuh"

namespace ddtree {
namespace {

using cuda::kFullMask;
using cuda::kWarp;

// ==== topk_logprobs ============================================================================
//
// A draft's 15 rows alone would occupy 15 multiprocessors, so each row is split into segments: one
// block per (row, segment) makes one pass over its segment (row_topk.cuh) and writes its softmax
// statistics and best K_CAP pairs; then one warp per row merges the segments in a fixed order and
// writes the top k with their log-softmax values.

constexpr int kTopkThreads = 256;
constexpr int kTopkMaxFast = 32;  // larger k takes the sort-based path

template <typename T, int K_CAP>
__global__ void __launch_bounds__(kTopkThreads) topk_segment_kernel(
    const T* __restrict__ logits, int64_t lg_sb, int64_t lg_sl, int64_t vocab, int num_depths, int segments,
    int64_t seg_len, float* __restrict__ part_val, int* __restrict__ part_id, float* __restrict__ part_stats) {
  __shared__ cuda::RowTopKSmem<K_CAP, kTopkThreads> sm;
  const int row = blockIdx.x / segments, seg = blockIdx.x % segments;
  const int b = row / num_depths, l = row % num_depths;
  const int64_t start = seg * seg_len;
  const int64_t len = start + seg_len < vocab ? seg_len : vocab - start;
  cuda::row_softmax_topk<T, K_CAP, kTopkThreads>(logits + b * lg_sb + l * lg_sl + start, len,
                                                 static_cast<int>(start), [](float x) { return x; }, sm);
  const int64_t part = static_cast<int64_t>(blockIdx.x);
  for (int r = threadIdx.x; r < K_CAP; r += kTopkThreads) {
    part_val[part * K_CAP + r] = sm.val[r];
    part_id[part * K_CAP + r] = sm.id[r];
  }
  if (threadIdx.x == 0) {
    part_stats[2 * part] = sm.m;
    part_stats[2 * part + 1] = sm.s;
  }
}

template <int K_CAP>
__global__ void __launch_bounds__(cuda::kWarp) topk_merge_kernel(
    const float* __restrict__ part_val, const int* __restrict__ part_id, const float* __restrict__ part_stats,
    int num_depths, int segments, int k, float* __restrict__ logp, int64_t lp_sb, int64_t lp_sl, int64_t lp_sk,
    int64_t* __restrict__ tokens, int64_t tk_sb, int64_t tk_sl, int64_t tk_sk) {
  __shared__ float val[K_CAP];
  __shared__ int id[K_CAP];
  __shared__ float log_norm, max_logit;
  const int row = blockIdx.x, b = row / num_depths, l = row % num_depths;
  const int64_t first = static_cast<int64_t>(row) * segments;
  cuda::warp_merge_lists(part_val + first * K_CAP, part_id + first * K_CAP, K_CAP, segments, K_CAP, val, id);
  if (threadIdx.x == 0) {
    cuda::MaxSum total;
    for (int s = 0; s < segments; ++s) total.merge(part_stats[2 * (first + s)], part_stats[2 * (first + s) + 1]);
    log_norm = logf(total.s);
    max_logit = total.m;
  }
  __syncwarp();
  for (int r = threadIdx.x; r < k; r += cuda::kWarp) {
    logp[b * lp_sb + l * lp_sl + r * lp_sk] = (val[r] - max_logit) - log_norm;
    tokens[b * tk_sb + l * tk_sl + r * tk_sk] = id[r];
  }
}

template <typename T, int K_CAP>
void launch_topk(const at::Tensor& logits, at::Tensor& logp, at::Tensor& tokens) {
  const int64_t bsz = logits.size(0), depths = logits.size(1), vocab = logits.size(2), rows = bsz * depths;
  const auto [segments, seg_len] = cuda::split_rows(rows, vocab);
  // Shape-dependent workspaces (never data-dependent): fine under CUDA graph capture.
  const auto f32 = logits.options().dtype(at::kFloat);
  const at::Tensor part_val = at::empty({rows, segments, K_CAP}, f32);
  const at::Tensor part_id = at::empty({rows, segments, K_CAP}, logits.options().dtype(at::kInt));
  const at::Tensor part_stats = at::empty({rows, segments, 2}, f32);
  const cudaStream_t stream = cuda::current_stream();
  topk_segment_kernel<T, K_CAP><<<static_cast<unsigned>(rows * segments), kTopkThreads, 0, stream>>>(
      logits.data_ptr<T>(), logits.stride(0), logits.stride(1), vocab, static_cast<int>(depths),
      static_cast<int>(segments), seg_len, part_val.data_ptr<float>(), part_id.data_ptr<int>(),
      part_stats.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  topk_merge_kernel<K_CAP><<<static_cast<unsigned>(rows), cuda::kWarp, 0, stream>>>(
      part_val.data_ptr<float>(), part_id.data_ptr<int>(), part_stats.data_ptr<float>(), static_cast<int>(depths),
      static_cast<int>(segments), static_cast<int>(logp.size(2)), logp.data_ptr<float>(), logp.stride(0),
      logp.stride(1), logp.stride(2), tokens.data_ptr<int64_t>(), tokens.stride(0), tokens.stride(1),
      tokens.stride(2));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// k above the register lists' reach: a stable descending sort (lower id first among equal logits)
// and a log-sum-exp, through ATen. Allocates only shape-dependent temporaries, never syncs.
void topk_by_sort(const at::Tensor& logits, at::Tensor& logp, at::Tensor& tokens) {
  const auto x = logits.to(at::kFloat);
  const auto order = std::get<1>(at::sort(x, /*stable=*/true, /*dim=*/-1, /*descending=*/true)).narrow(-1, 0, logp.size(2));
  tokens.copy_(order);
  logp.copy_(at::gather(x, -1, order) - at::logsumexp(x, -1, /*keepdim=*/true));
}

// ==== build_tree ===============================================================================
//
// One block per batch row. Warp 0 runs the best-first selection exactly as the reference does: the
// candidates (children of taken nodes not yet taken) live in shared-memory slots as 64-bit keys
// [score as ordered bits | 0xffff - parent | 0xffff - rank], so "largest key" is "highest float32
// score, then lower parent index, then lower rank"; each lane tracks the best key of its slots and a
// warp max picks the next node. All threads then write the padded tree.

constexpr int kBuildThreads = 256;
constexpr int kMaxKeyField = 0xffff;          // parent index and rank are packed in 16 bits each
constexpr int64_t kStagedLogpMax = 8192;     // logp rows up to this many floats are staged in shared memory

__device__ __forceinline__ uint32_t ordered_bits(float f) {
  uint32_t u = __float_as_uint(f);
  if (u == 0x80000000u) u = 0;  // -0 and +0 compare equal as floats, so they get one key
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Largest key over the warp. On sm_80+ two single-instruction reductions (the high words, then the low
// words of the lanes holding the highest high word); a low word is never 0 for a real key (parent and
// rank are < 0xffff), and an empty lane (key 0) never holds the highest high word unless all are empty.
__device__ __forceinline__ uint64_t warp_max_key(uint64_t key) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned hi = static_cast<unsigned>(key >> 32);
  const unsigned max_hi = __reduce_max_sync(kFullMask, hi);
  const unsigned max_lo = __reduce_max_sync(kFullMask, hi == max_hi ? static_cast<unsigned>(key) : 0u);
  return (static_cast<uint64_t>(max_hi) << 32) | max_lo;
#else
  return cuda::warp_max_u64(key);
#endif
}

__device__ __forceinline__ uint64_t candidate_key(float score, int parent, int rank) {
  return (static_cast<uint64_t>(ordered_bits(score)) << 32) |
         (static_cast<uint64_t>(kMaxKeyField - parent) << 16) | static_cast<uint64_t>(kMaxKeyField - rank);
}

struct BuildSmem {
  uint64_t* slot_key;  // [slot capacity]; 0 = empty (no real score maps to 0)
  float* score;        // [N]
  int* parent;         // [N]
  int* depth;          // [N]
  int* rank;           // [N]
  int* first_child;    // [N]
  int* next_sibling;   // [N]
  int* last_child;     // [N]
  uint64_t* mask;      // [N * W]
  float* logp;         // [L * K] when staged
};

__host__ __device__ inline size_t build_smem_bytes(int64_t n, int64_t words, int64_t slots, int64_t staged_logp) {
  return sizeof(uint64_t) * (slots + n * words) + sizeof(float) * (n + staged_logp) + sizeof(int) * 6 * n;
}

__global__ void __launch_bounds__(kBuildThreads) build_tree_kernel(
    const float* __restrict__ logp, int64_t lp_sb, int64_t lp_sl, int64_t lp_sk, const int64_t* __restrict__ tokens,
    int64_t tk_sb, int64_t tk_sl, int64_t tk_sk, const int64_t* __restrict__ root_token, int64_t rt_s,
    const int64_t* __restrict__ prefix_len, int64_t pl_s, int num_depths, int k, int budget, bool spine, bool stage_logp,
    int slot_capacity, int64_t* __restrict__ node_token, int64_t nt_sb, int64_t nt_sn, int32_t* __restrict__ parent_out,
    int64_t pa_sb, int64_t pa_sn, int32_t* __restrict__ depth_out, int64_t de_sb, int64_t de_sn,
    int32_t* __restrict__ num_nodes, int64_t nn_s, int32_t* __restrict__ first_child_out, int64_t fc_sb, int64_t fc_sn,
    int32_t* __restrict__ next_sibling_out, int64_t ns_sb, int64_t ns_sn, int64_t* __restrict__ ancestor_mask,
    int64_t am_sb, int64_t am_sn, int64_t am_sw, int64_t* __restrict__ position, int64_t po_sb, int64_t po_sn) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int n = budget + 1;
  const int words = (n + 63) / 64;
  BuildSmem sm;
  {
    unsigned char* p = smem_raw;
    auto take = [&](size_t bytes) {
      unsigned char* q = p;
      p += bytes;
      return q;
    };
    sm.slot_key = reinterpret_cast<uint64_t*>(take(sizeof(uint64_t) * slot_capacity));
    sm.mask = reinterpret_cast<uint64_t*>(take(sizeof(uint64_t) * n * words));
    sm.score = reinterpret_cast<float*>(take(sizeof(float) * n));
    sm.logp = reinterpret_cast<float*>(take(sizeof(float) * (stage_logp ? num_depths * k : 0)));
    sm.parent = reinterpret_cast<int*>(take(sizeof(int) * n));
    sm.depth = reinterpret_cast<int*>(take(sizeof(int) * n));
    sm.rank = reinterpret_cast<int*>(take(sizeof(int) * n));
    sm.first_child = reinterpret_cast<int*>(take(sizeof(int) * n));
    sm.next_sibling = reinterpret_cast<int*>(take(sizeof(int) * n));
    sm.last_child = reinterpret_cast<int*>(take(sizeof(int) * n));
  }
  const int b = blockIdx.x;
  const int tid = threadIdx.x;
  const float* lp_row = logp + b * lp_sb;

  for (int i = tid; i < n; i += kBuildThreads) {
    sm.first_child[i] = -1;
    sm.next_sibling[i] = -1;
    sm.parent[i] = i == 0 ? -1 : 0;  // padding nodes hang under the root
    sm.depth[i] = i == 0 ? 0 : 1;
  }
  for (int i = tid; i < slot_capacity; i += kBuildThreads) sm.slot_key[i] = 0;
  if (stage_logp) {
    for (int i = tid; i < num_depths * k; i += kBuildThreads) sm.logp[i] = lp_row[(i / k) * lp_sl + (i % k) * lp_sk];
  }
  if (tid == 0) sm.score[0] = 0.f;
  __syncthreads();

  __shared__ int taken_shared;
  if (tid < kWarp) {
    const int lane = tid;
    auto lp = [&](int d0, int r) { return stage_logp ? sm.logp[d0 * k + r] : lp_row[d0 * lp_sl + r * lp_sk]; };
    int taken = 0;    // nodes taken besides the root
    int slots = 0;    // slots in use (a popped slot is reused by the next candidate)
    uint64_t my_best = 0;
    int my_best_slot = -1;
    auto rescan = [&]() {
      my_best = 0;
      my_best_slot = -1;
      for (int s = lane; s < slots; s += kWarp) {
        const uint64_t key = sm.slot_key[s];
        if (key > my_best) {
          my_best = key;
          my_best_slot = s;
        }
      }
    };
    // Every lane runs the same control flow on the same values; the owner lane of a slot writes it.
    auto put = [&](int slot, uint64_t key) {
      if (lane == slot % kWarp) sm.slot_key[slot] = key;
    };
    auto take_node = [&](int p, int d, int r, float s) {
      const int i = ++taken;
      if (lane == 0) {
        sm.score[i] = s;
        sm.parent[i] = p;
        sm.depth[i] = d;
        sm.rank[i] = r;
        if (sm.first_child[p] < 0) {
          sm.first_child[p] = i;
        } else {
          sm.next_sibling[sm.last_child[p]] = i;
        }
        sm.last_child[p] = i;
      }
      __syncwarp();
      return i;
    };

    if (spine) {
      int prev = 0;
      const int spine_len = k > 0 ? min(num_depths, budget) : 0;
      for (int d = 1; d <= spine_len; ++d) {
        const float sp = sm.score[prev];
        if (k > 1) put(slots++, candidate_key(sp + lp(d - 1, 1), prev, 1));  // the spine node's next sibling
        prev = take_node(prev, d, 0, sp + lp(d - 1, 0));
      }
    } else if (num_depths > 0 && k > 0) {
      put(slots++, candidate_key(0.f + lp(0, 0), 0, 0));
    }
    __syncwarp();
    rescan();

    while (taken < budget) {
      const uint64_t best = warp_max_key(my_best);
      if (best == 0) break;  // K ** depth ran out: the rest is padding
      const int owner = __ffs(__ballot_sync(kFullMask, my_best == best)) - 1;
      const int slot = __shfl_sync(kFullMask, my_best_slot, owner);
      const int p = kMaxKeyField - static_cast<int>((best >> 16) & 0xffff);
      const int r = kMaxKeyField - static_cast<int>(best & 0xffff);
      const int d = sm.depth[p] + 1;
      const float sp = sm.score[p];
      const float s = sp + lp(d - 1, r);  // the same float32 sum that was pushed
      const int i = take_node(p, d, r, s);
      const uint64_t child = d < num_depths ? candidate_key(s + lp(d, 0), i, 0) : 0;         // first child
      const uint64_t sibling = r + 1 < k ? candidate_key(sp + lp(d - 1, r + 1), p, r + 1) : 0;  // next sibling
      const uint64_t first = child ? child : sibling;
      const uint64_t second = child ? sibling : 0;
      put(slot, first);
      int extra = -1;
      if (second) {
        extra = slots++;
        put(extra, second);
      }
      __syncwarp();
      if (lane == slot % kWarp || (extra >= 0 && lane == extra % kWarp)) rescan();
    }
    if (lane == 0) taken_shared = taken;
  }
  __syncthreads();
  const int taken = taken_shared;

  // Ancestor bitmask of every node (padding nodes included: parent 0, so {0, i}).
  for (int i = tid; i < n; i += kBuildThreads) {
    uint64_t* row = sm.mask + static_cast<int64_t>(i) * words;
    for (int w = 0; w < words; ++w) row[w] = 0;
    for (int j = i; j >= 0; j = sm.parent[j]) row[j >> 6] |= uint64_t{1} << (j & 63);
  }
  __syncthreads();

  const int64_t root = root_token[b * rt_s];
  const int64_t prefix = prefix_len[b * pl_s];
  for (int i = tid; i < n; i += kBuildThreads) {
    const bool real = i >= 1 && i <= taken;
    const int d = sm.depth[i];
    node_token[b * nt_sb + i * nt_sn] = real ? tokens[b * tk_sb + (d - 1) * tk_sl + sm.rank[i] * tk_sk] : root;
    parent_out[b * pa_sb + i * pa_sn] = sm.parent[i];
    depth_out[b * de_sb + i * de_sn] = d;
    first_child_out[b * fc_sb + i * fc_sn] = sm.first_child[i];
    next_sibling_out[b * ns_sb + i * ns_sn] = sm.next_sibling[i];
    position[b * po_sb + i * po_sn] = prefix + d;
  }
  for (int e = tid; e < n * words; e += kBuildThreads) {
    const int i = e / words, w = e % words;
    ancestor_mask[b * am_sb + i * am_sn + w * am_sw] = static_cast<int64_t>(sm.mask[e]);
  }
  if (tid == 0) num_nodes[b * nn_s] = taken + 1;
}

// ==== tree_attention_mask ======================================================================
//
// One block per (b, node) row of the mask; columns in 16-byte packs where the row allows it.

constexpr int kMaskThreads = 256;

template <typename T>
__device__ __forceinline__ T mask_value(bool allow) {
  if constexpr (std::is_same_v<T, bool>) {
    return allow;
  } else {
    return allow ? T(0.f) : cuda::lowest<T>();
  }
}

template <typename T>
__global__ void __launch_bounds__(kMaskThreads) tree_attention_mask_kernel(
    const int64_t* __restrict__ ancestor_mask, int64_t am_sb, int64_t am_sn, int64_t am_sw, int words,
    const int64_t* __restrict__ prefix_len, int64_t pl_s, int num_nodes, T* __restrict__ mask, int64_t m_sb,
    int64_t m_sn, int64_t m_ss, int64_t kv_len) {
  extern __shared__ uint64_t anc_words[];
  const int b = blockIdx.x / num_nodes, i = blockIdx.x % num_nodes;
  for (int w = threadIdx.x; w < words; w += blockDim.x) {
    anc_words[w] = static_cast<uint64_t>(ancestor_mask[b * am_sb + i * am_sn + w * am_sw]);
  }
  __syncthreads();
  const int64_t prefix = prefix_len[b * pl_s];
  auto allow = [&](int64_t c) {
    if (c < prefix) return true;
    const int64_t j = c - prefix;
    return j < num_nodes && ((anc_words[j >> 6] >> (j & 63)) & 1);
  };
  T* row = mask + b * m_sb + i * m_sn;
  constexpr int kVec = 16 / sizeof(T);
  if (m_ss == 1) {
    const int64_t head = cuda::elements_to_16b_boundary(row, kv_len);
    const int64_t packs = (kv_len - head) / kVec;
    for (int64_t c = threadIdx.x; c < head; c += blockDim.x) row[c] = mask_value<T>(allow(c));
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      cuda::Pack<T, kVec> pk;
      const int64_t c0 = head + p * kVec;
#pragma unroll
      for (int e = 0; e < kVec; ++e) pk.v[e] = mask_value<T>(allow(c0 + e));
      *reinterpret_cast<cuda::Pack<T, kVec>*>(row + c0) = pk;
    }
    for (int64_t c = head + packs * kVec + threadIdx.x; c < kv_len; c += blockDim.x) row[c] = mask_value<T>(allow(c));
  } else {
    for (int64_t c = threadIdx.x; c < kv_len; c += blockDim.x) row[c * m_ss] = mask_value<T>(allow(c));
  }
}

template <typename T>
void launch_tree_attention_mask(const at::Tensor& ancestor_mask, const at::Tensor& prefix_len, at::Tensor& mask) {
  const int64_t bsz = ancestor_mask.size(0), n = ancestor_mask.size(1), words = ancestor_mask.size(2);
  const unsigned blocks = static_cast<unsigned>(bsz * n);
  if (blocks == 0 || mask.size(3) == 0) return;
  tree_attention_mask_kernel<T><<<blocks, kMaskThreads, sizeof(uint64_t) * words, cuda::current_stream()>>>(
      ancestor_mask.data_ptr<int64_t>(), ancestor_mask.stride(0), ancestor_mask.stride(1), ancestor_mask.stride(2),
      static_cast<int>(words), prefix_len.data_ptr<int64_t>(), prefix_len.stride(0), static_cast<int>(n),
      reinterpret_cast<T*>(mask.data_ptr()), mask.stride(0), mask.stride(2), mask.stride(3), mask.size(3));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// ---- entry points ------------------------------------------------------------------------------

void topk_logprobs_cuda(const at::Tensor& logits, at::Tensor& logp, at::Tensor& tokens) {
  check_topk_logprobs(logits, logp, tokens);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t k = logp.size(2);
  if (logits.size(0) * logits.size(1) == 0 || k == 0) return;
  if (k > kTopkMaxFast) {
    topk_by_sort(logits, logp, tokens);
    return;
  }
  DDTREE_CUDA_DISPATCH_FLOAT(logits.scalar_type(), "topk_logprobs", [&] {
    if (k <= 1) {
      launch_topk<scalar_t, 1>(logits, logp, tokens);
    } else if (k <= 2) {
      launch_topk<scalar_t, 2>(logits, logp, tokens);
    } else if (k <= 4) {
      launch_topk<scalar_t, 4>(logits, logp, tokens);
    } else if (k <= 8) {
      launch_topk<scalar_t, 8>(logits, logp, tokens);
    } else if (k <= 16) {
      launch_topk<scalar_t, 16>(logits, logp, tokens);
    } else {
      launch_topk<scalar_t, 32>(logits, logp, tokens);
    }
  });
}

void build_tree_cuda(const at::Tensor& logp, const at::Tensor& tokens, const at::Tensor& root_token,
                     const at::Tensor& prefix_len, int64_t budget, bool spine, at::Tensor& node_token,
                     at::Tensor& parent, at::Tensor& depth, at::Tensor& num_nodes, at::Tensor& first_child,
                     at::Tensor& next_sibling, at::Tensor& ancestor_mask, at::Tensor& position) {
  constexpr const char* op = "build_tree";
  check_build_tree(logp, tokens, root_token, prefix_len, budget, node_token, parent, depth, num_nodes, first_child,
                   next_sibling, ancestor_mask, position);
  const c10::cuda::CUDAGuard guard(logp.device());
  const int64_t bsz = logp.size(0), depths = logp.size(1), k = logp.size(2);
  const int64_t n = budget + 1, words = (n + 63) / 64;
  TORCH_CHECK_VALUE(n - 1 <= kMaxKeyField && k <= kMaxKeyField, op, ": the CUDA op supports budget and K up to ",
                    kMaxKeyField, ", got budget ", budget, " and K ", k);
  // Candidates: the initial ones (spine siblings or the first root child), then at most one more per pop.
  const int64_t slots = depths + budget + 1;
  const bool stage = depths * k <= kStagedLogpMax;
  const size_t smem = build_smem_bytes(n, words, slots, stage ? depths * k : 0);
  TORCH_CHECK_VALUE(smem <= cuda::max_dynamic_smem(), op, ": budget ", budget,
                    " needs more shared memory than this GPU offers (", smem, " bytes)");
  if (bsz == 0) return;
  cuda::allow_dynamic_smem(build_tree_kernel, smem);
  build_tree_kernel<<<static_cast<unsigned>(bsz), kBuildThreads, smem, cuda::current_stream()>>>(
      logp.data_ptr<float>(), logp.stride(0), logp.stride(1), logp.stride(2), tokens.data_ptr<int64_t>(),
      tokens.stride(0), tokens.stride(1), tokens.stride(2), root_token.data_ptr<int64_t>(), root_token.stride(0),
      prefix_len.data_ptr<int64_t>(), prefix_len.stride(0), static_cast<int>(depths), static_cast<int>(k),
      static_cast<int>(budget), spine, stage, static_cast<int>(slots), node_token.data_ptr<int64_t>(),
      node_token.stride(0), node_token.stride(1), parent.data_ptr<int32_t>(), parent.stride(0), parent.stride(1),
      depth.data_ptr<int32_t>(), depth.stride(0), depth.stride(1), num_nodes.data_ptr<int32_t>(), num_nodes.stride(0),
      first_child.data_ptr<int32_t>(), first_child.stride(0), first_child.stride(1), next_sibling.data_ptr<int32_t>(),
      next_sibling.stride(0), next_sibling.stride(1), ancestor_mask.data_ptr<int64_t>(), ancestor_mask.stride(0),
      ancestor_mask.stride(1), ancestor_mask.stride(2), position.data_ptr<int64_t>(), position.stride(0),
      position.stride(1));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void tree_attention_mask_cuda(const at::Tensor& ancestor_mask, const at::Tensor& prefix_len, at::Tensor& mask) {
  check_tree_attention_mask(ancestor_mask, prefix_len, mask);
  const c10::cuda::CUDAGuard guard(ancestor_mask.device());
  switch (mask.scalar_type()) {
    case at::kBool:
      launch_tree_attention_mask<bool>(ancestor_mask, prefix_len, mask);
      break;
    case at::kFloat:
      launch_tree_attention_mask<float>(ancestor_mask, prefix_len, mask);
      break;
    case at::kHalf:
      launch_tree_attention_mask<at::Half>(ancestor_mask, prefix_len, mask);
      break;
    case at::kBFloat16:
      launch_tree_attention_mask<at::BFloat16>(ancestor_mask, prefix_len, mask);
      break;
    default:
      TORCH_CHECK_VALUE(false, "tree_attention_mask: mask must be bool, float32, float16 or bfloat16, got ",
                        mask.scalar_type());
  }
}

}  // namespace ddtree
