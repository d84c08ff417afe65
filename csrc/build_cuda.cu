// CUDA implementations of the build ops: per-depth top-K with log-softmax, the best-first tree, and
// the attention mask of the verify block. Semantics: ddtree_ext/reference.py; argument checks: the
// device-agnostic check_* functions shared with the CPU ops.
#include <limits>

#include "cuda_common.cuh"
#include "ops.h"
#include "row_topk.cuh"

namespace ddtree {
namespace {

using cuda::kFullMask;
using cuda::kWarp;

// ==== topk_logprobs ============================================================================
//
// A draft's 15 rows alone would occupy 15 multiprocessors, so each row is split into segments of whole
// chunks (kTopkChunk elements: 32 per thread, loaded at once in 16-byte packs, so one chunk is one
// round trip to memory): one block per (row, segment), then one warp per row merges the segments in
// a fixed order and writes the top k with their log-softmax values.
//
// Per chunk a block keeps its best K_CAP (value, id) pairs without a sorted insert per element: each
// warp takes the K_CAP-th largest of its lanes' maxima, a value at least K_CAP elements reach; the
// largest of these (and of the K_CAP-th pair kept from earlier chunks) is a threshold no element of
// the top K_CAP lies below. The few elements at or above it are gathered in shared memory and each
// finds its rank by counting the candidates ranked before it. Order: higher value first, then lower id
// (a total order, so the result does not depend on the order of the gathering). Chunks whose
// candidates do not fit (many equal values at the threshold) take per-thread sorted lists instead.
// NaN logits rank above every number (rank_key: the CPU op's torch.sort order, lower id first among NaNs),
// so the K ids are real ids of the row whatever it holds; a NaN makes the row's sum, and so every logp, NaN.
// The block's lists and candidates hold rank keys, so a comparison is one integer compare, and the threshold test
// is one float compare an element. 15 rows of 248320 at K = 8 on H100s (different machines): 16.6 us before NaN was
// ranked, 22.4 with rank keys of both sides of every comparison and of every element, 19.8 like this
// (benchmarks/results/2026-12-05-h100-walk-sample-histograms.md); in one call, 16.05 before and 19.79 like this, the
// per-element NaN test not the cause (benchmarks/results/2026-12-05-h100-draft-logits-topk-inf.md). Registers, most
// likely: see kTopkBlocksPerSM (18.24 -> 14.92 us in one call,
// benchmarks/results/2026-12-05-h100-pdl-build-walk-commit.md).

constexpr int kTopkThreads = 256;
constexpr int kTopkWarps = kTopkThreads / kWarp;
constexpr int kTopkPerThread = 32;
constexpr int64_t kTopkChunk = int64_t{kTopkThreads} * kTopkPerThread;
constexpr int kTopkCandidates = 512;  // gathered per chunk before the per-thread lists take over
constexpr int kTopkMaxFast = 32;      // larger k takes the sort-based path
// Blocks resident per SM for K_CAP <= 8 (a draft's k): at most 64 registers a thread. At the 80 that K_CAP 8 took with
// NaN ranked, three fit, and a draft's 15 rows x 31 one-chunk segments (27B vocabulary) needed two waves. Larger
// lists keep their registers (bounded at 64 they spill hundreds of bytes).
constexpr int kTopkBlocksPerSM = 4;

template <int K_CAP>
struct TopkSegmentSmem {
  // Values as rank keys (cuda::rank_key), which order NaN: one integer compare a comparison.
  unsigned list_key[2][K_CAP];  // the best pairs so far (double-buffered across chunks)
  int list_id[2][K_CAP];
  unsigned cand_key[kTopkCandidates];
  int cand_id[kTopkCandidates];
  int cand_count;
  unsigned warp_threshold[kTopkWarps];
  unsigned warp_key[kTopkWarps + 1][K_CAP];  // per-thread-list path: per-warp lists, then the kept list
  int warp_id[kTopkWarps + 1][K_CAP];
  float warp_m[kTopkWarps], warp_s[kTopkWarps];
};

template <typename T, int K_CAP>
__global__ void __launch_bounds__(kTopkThreads, K_CAP <= 8 ? kTopkBlocksPerSM : 1) topk_segment_kernel(
    const T* __restrict__ logits, int64_t lg_sb, int64_t lg_sl, int64_t vocab, int num_depths, int segments,
    int chunks_per_segment, float* __restrict__ part_val, int* __restrict__ part_id, float* __restrict__ part_stats) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kPacks = kTopkPerThread / kVec;
  static_assert(kPacks * kVec == kTopkPerThread, "whole packs per thread");
  __shared__ TopkSegmentSmem<K_CAP> sm;
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();  // launched as a programmatic dependent: nothing read or written before
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  const int row = blockIdx.x / segments, seg = blockIdx.x % segments;
  const int b = row / num_depths, l = row % num_depths;
  const T* row_ptr = logits + b * lg_sb + l * lg_sl;
  // Elements before the first 16-byte boundary (the head) go to segment 0's first chunk, one per thread.
  const int64_t head = cuda::elements_to_16b_boundary(row_ptr, vocab);
  const T* body = row_ptr + head;
  const int64_t body_len = vocab - head;
  const int64_t chunks = body_len > 0 ? (body_len + kTopkChunk - 1) / kTopkChunk : 1;
  const int64_t chunk_begin = static_cast<int64_t>(seg) * chunks_per_segment;
  const int64_t chunk_end = min(chunks, chunk_begin + chunks_per_segment);

  if (tid < K_CAP) {
    sm.list_key[0][tid] = cuda::kNegInfKey;
    sm.list_id[0][tid] = cuda::kNoId;
  }
  if (tid == 0) sm.cand_count = 0;
  int cur = 0;
  cuda::MaxSum ms;  // this thread's softmax statistics over all its chunks

  for (int64_t c = chunk_begin; c < chunk_end; ++c) {
    // Element (p, e) of this thread: body offset base + (p * threads + tid) * kVec + e.
    const int64_t base = c * kTopkChunk;
    auto load_chunk = [&](float (&v)[kPacks][kVec]) {
#pragma unroll
      for (int p = 0; p < kPacks; ++p) {
        const int64_t off = base + (static_cast<int64_t>(p) * kTopkThreads + tid) * kVec;
        if (off + kVec <= body_len) {
          cuda::load_pack_float<T, kVec>(body + off, v[p]);
        } else {
#pragma unroll
          for (int e = 0; e < kVec; ++e) v[p][e] = off + e < body_len ? cuda::to_float(body[off + e]) : -INFINITY;
        }
      }
    };
    float v[kPacks][kVec];
    load_chunk(v);
    const bool with_head = c == 0 && tid < head;
    const float head_value = with_head ? cuda::to_float(row_ptr[tid]) : -INFINITY;
    const bool full = base + kTopkChunk <= body_len;
    auto in_range = [&](int p, int e) {
      return full || base + (static_cast<int64_t>(p) * kTopkThreads + tid) * kVec + e < body_len;
    };
    auto id_of = [&](int p, int e) {
      return static_cast<int>(head + base + (static_cast<int64_t>(p) * kTopkThreads + tid) * kVec + e);
    };

    // Softmax statistics: one rescale per chunk, then a plain sum (padding is -inf and adds 0).
    float chunk_max = head_value;
    bool chunk_nan = isnan(head_value);  // fmaxf skips NaN; the threshold must not
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        chunk_max = fmaxf(chunk_max, v[p][e]);
        chunk_nan |= isnan(v[p][e]);
      }
    }
    if (chunk_max > ms.m) {
      ms.s = ms.m == -INFINITY ? 0.f : ms.s * __expf(ms.m - chunk_max);
      ms.m = chunk_max;
    }
    if (ms.m != -INFINITY) {
      float sum = with_head ? __expf(head_value - ms.m) : 0.f;
#pragma unroll
      for (int p = 0; p < kPacks; ++p) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) sum += __expf(v[p][e] - ms.m);
      }
      ms.s += sum;
    }

    // Threshold: the K_CAP-th largest lane maximum (by rank key) per warp (lanes holding an element of the row).
    const bool holds = with_head || in_range(0, 0);
    const unsigned warp_t = cuda::warp_kth_largest<K_CAP>(holds ? cuda::rank_key(chunk_nan ? NAN : chunk_max) : 0u);
    if (lane == 0) sm.warp_threshold[warp] = warp_t;
    __syncthreads();
    unsigned threshold = sm.list_id[cur][K_CAP - 1] != cuda::kNoId ? sm.list_key[cur][K_CAP - 1] : 0u;
#pragma unroll
    for (int w = 0; w < kTopkWarps; ++w) threshold = max(threshold, sm.warp_threshold[w]);
    // rank_key(x) >= threshold as one float compare an element: the threshold is 0 (none), a number's key or NaN's.
    const bool threshold_nan = threshold == cuda::rank_key(NAN);
    const float threshold_value = threshold == 0u ? -INFINITY : cuda::from_ordered_bits(threshold);
    auto passes = [&](float x) { return threshold_nan ? isnan(x) : !(x < threshold_value); };  // NaN x passes
    auto gather = [&](float x, int id) {
      if (passes(x)) {
        const int at = atomicAdd(&sm.cand_count, 1);
        if (at < kTopkCandidates) {
          sm.cand_key[at] = cuda::rank_key(x);
          sm.cand_id[at] = id;
        }
      }
    };
    if (with_head) gather(head_value, tid);
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        if (in_range(p, e)) gather(v[p][e], id_of(p, e));
      }
    }
    __syncthreads();
    const int gathered = sm.cand_count;
    const int next = cur ^ 1;
    if (gathered <= kTopkCandidates) {
      // Rank of each candidate (gathered ones, then the kept pairs) among all of them.
      const unsigned* kept_key = sm.list_key[cur];
      const int* kept_id = sm.list_id[cur];
      int kept = 0;
#pragma unroll
      for (int j = 0; j < K_CAP; ++j) kept += kept_id[j] != cuda::kNoId;
      const int total = gathered + kept;  // kept pairs are the first `kept` of their list
      for (int t = tid; t < total; t += kTopkThreads) {
        const unsigned x = t < gathered ? sm.cand_key[t] : kept_key[t - gathered];
        const int id = t < gathered ? sm.cand_id[t] : kept_id[t - gathered];
        int rank = 0;
        for (int j = 0; j < gathered; ++j) rank += cuda::ranks_before(sm.cand_key[j], sm.cand_id[j], x, id);
        for (int j = 0; j < kept; ++j) rank += cuda::ranks_before(kept_key[j], kept_id[j], x, id);
        if (rank < K_CAP) {
          sm.list_key[next][rank] = x;
          sm.list_id[next][rank] = id;
        }
      }
      if (tid >= total && tid < K_CAP) {
        sm.list_key[next][tid] = cuda::kNegInfKey;
        sm.list_id[next][tid] = cuda::kNoId;
      }
    } else {
      // Too many candidates: per-thread sorted lists of the elements at or above the threshold, merged
      // per warp, then the warps' lists and the kept list by warp 0.
      // (The chunk is read again, from L2: keeping it in registers past the gathering costs spills.)
      cuda::TopList<K_CAP, unsigned> top;
      top.clear();
      if (with_head && passes(head_value)) top.insert(cuda::rank_key(head_value), tid);
      float again[kPacks][kVec];
      load_chunk(again);
#pragma unroll
      for (int p = 0; p < kPacks; ++p) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          if (in_range(p, e) && passes(again[p][e])) top.insert(cuda::rank_key(again[p][e]), id_of(p, e));
        }
      }
      for (int r = 0; r < K_CAP; ++r) {
        unsigned bv = top.val[0];
        int bi = top.id[0];
        cuda::warp_best(bv, bi);
        if (top.id[0] == bi) top.pop_front();
        if (lane == 0) {
          sm.warp_key[warp][r] = bv;
          sm.warp_id[warp][r] = bi;
        }
      }
      if (tid < K_CAP) {
        sm.warp_key[kTopkWarps][tid] = sm.list_key[cur][tid];
        sm.warp_id[kTopkWarps][tid] = sm.list_id[cur][tid];
      }
      __syncthreads();
      if (warp == 0) {
        cuda::warp_merge_lists(&sm.warp_key[0][0], &sm.warp_id[0][0], K_CAP, kTopkWarps + 1, K_CAP, sm.list_key[next],
                               sm.list_id[next]);
      }
    }
    __syncthreads();
    if (tid == 0) sm.cand_count = 0;  // read by every thread before the barrier above
    cur = next;
  }

  // The block's softmax statistics: lanes by a fixed butterfly, then the warps in order.
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(kFullMask, ms.m, off);
    const float s2 = __shfl_xor_sync(kFullMask, ms.s, off);
    ms.merge(m2, s2);
  }
  if (lane == 0) {
    sm.warp_m[warp] = ms.m;
    sm.warp_s[warp] = ms.s;
  }
  __syncthreads();
  const int64_t part = static_cast<int64_t>(blockIdx.x);
  if (tid < K_CAP) {
    part_val[part * K_CAP + tid] = cuda::from_ordered_bits(sm.list_key[cur][tid]);  // NaN's key gives NaN
    part_id[part * K_CAP + tid] = sm.list_id[cur][tid];
  }
  if (tid == 0) {
    cuda::MaxSum total;
    for (int w = 0; w < kTopkWarps; ++w) total.merge(sm.warp_m[w], sm.warp_s[w]);
    part_stats[2 * part] = total.m;
    part_stats[2 * part + 1] = total.s;
  }
}

// One warp per row: the segments' statistics by a fixed butterfly; the best k pairs by k rounds of a
// warp max over the segments' list heads, keyed [rank key | ~id] (higher value, NaN highest, then lower
// id; a list's padding (-inf, kNoId) ranks below every real pair and an exhausted list below that).
template <int K_CAP>
__global__ void __launch_bounds__(kWarp) topk_merge_kernel(
    const float* __restrict__ part_val, const int* __restrict__ part_id, const float* __restrict__ part_stats,
    int num_depths, int segments, int k, float* __restrict__ logp, int64_t lp_sb, int64_t lp_sl, int64_t lp_sk,
    int64_t* __restrict__ tokens, int64_t tk_sb, int64_t tk_sl, int64_t tk_sk) {
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();  // launched as a programmatic dependent: nothing read or written before
  const int lane = threadIdx.x;
  const int row = blockIdx.x, b = row / num_depths, l = row % num_depths;
  const bool live = lane < segments;
  const int64_t list = static_cast<int64_t>(row) * segments + lane;
  cuda::MaxSum total;
  if (live) {
    total.m = part_stats[2 * list];
    total.s = part_stats[2 * list + 1];
  }
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(kFullMask, total.m, off);
    const float s2 = __shfl_xor_sync(kFullMask, total.s, off);
    total.merge(m2, s2);
  }
  const float* vals = part_val + list * K_CAP;
  const int* ids = part_id + list * K_CAP;
  int pos = 0;
  auto key_hi = [&](int at) { return live && at < K_CAP ? cuda::rank_key(vals[at]) : 0u; };
  auto key_lo = [&](int at) { return live && at < K_CAP ? ~static_cast<unsigned>(ids[at]) : 0u; };
  unsigned hi = key_hi(0), lo = key_lo(0);
  unsigned next_hi = key_hi(1), next_lo = key_lo(1);
  // A NaN anywhere in the row heads its segment's list. The segments' sums may have skipped it (a segment
  // of NaN and -inf alone adds nothing), so it makes every logp NaN here, as the CPU op's sum does.
  const float log_norm = cuda::warp_max_u32(hi) == cuda::rank_key(NAN) ? NAN : logf(total.s);
  for (int r = 0; r < k; ++r) {
    const unsigned max_hi = cuda::warp_max_u32(hi);
    const unsigned max_lo = cuda::warp_max_u32(hi == max_hi ? lo : 0u);
    if (hi == max_hi && lo == max_lo) {  // one lane: (value, id) pairs are unique within a row
      logp[b * lp_sb + l * lp_sl + r * lp_sk] = (cuda::from_ordered_bits(max_hi) - total.m) - log_norm;
      tokens[b * tk_sb + l * tk_sl + r * tk_sk] = static_cast<int>(~max_lo);
      ++pos;
      hi = next_hi;
      lo = next_lo;
      next_hi = key_hi(pos + 1);
      next_lo = key_lo(pos + 1);
    }
  }
}

template <typename T, int K_CAP>
void launch_topk(const at::Tensor& logits, at::Tensor& logp, at::Tensor& tokens) {
  const int64_t bsz = logits.size(0), depths = logits.size(1), vocab = logits.size(2), rows = bsz * depths;
  // Segments of whole chunks: enough (row, segment) blocks to fill the GPU about four times, at most
  // one per lane of the merging warp.
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t chunks = std::max<int64_t>(1, cuda::ceil_div(vocab, kTopkChunk));
  const int64_t wanted = std::min<int64_t>(std::max<int64_t>(1, cuda::ceil_div(4 * sms, rows)), kWarp);
  const int64_t chunks_per_segment = cuda::ceil_div(chunks, std::min(wanted, chunks));
  const int64_t segments = cuda::ceil_div(chunks, chunks_per_segment);
  // Shape-dependent workspaces (never data-dependent): fine under CUDA graph capture.
  const auto f32 = logits.options().dtype(at::kFloat);
  const at::Tensor part_val = at::empty({rows, segments, K_CAP}, f32);
  const at::Tensor part_id = at::empty({rows, segments, K_CAP}, logits.options().dtype(at::kInt));
  const at::Tensor part_stats = at::empty({rows, segments, 2}, f32);
  cuda::launch_programmatic(
      topk_segment_kernel<T, K_CAP>, dim3(static_cast<unsigned>(rows * segments)), dim3(kTopkThreads), 0,
      logits.data_ptr<T>(), logits.stride(0), logits.stride(1), vocab, static_cast<int>(depths),
      static_cast<int>(segments), static_cast<int>(chunks_per_segment), part_val.data_ptr<float>(),
      part_id.data_ptr<int>(), part_stats.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  cuda::launch_programmatic(topk_merge_kernel<K_CAP>, dim3(static_cast<unsigned>(rows)), dim3(kWarp), 0,
      part_val.data_ptr<float>(), part_id.data_ptr<int>(), part_stats.data_ptr<float>(), static_cast<int>(depths),
      static_cast<int>(segments), static_cast<int>(logp.size(2)), logp.data_ptr<float>(), logp.stride(0),
      logp.stride(1), logp.stride(2), tokens.data_ptr<int64_t>(), tokens.stride(0), tokens.stride(1),
      tokens.stride(2));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// k above the register lists' reach: a stable descending sort (lower id first among equal logits)
// and a log-sum-exp, through ATen. Allocates only shape-dependent temporaries, never syncs.
// CUDA's sort ranks by bits on its radix path: a NaN with its sign bit set (what CPU torch's vectorised
// float -> bfloat16 conversion makes of every NaN) below -inf, and -0 below +0, where the CPU op and torch.sort
// on the CPU rank every NaN first and tie the zeros. So every NaN becomes +NaN and -0 becomes +0 first.
void topk_by_sort(const at::Tensor& logits, at::Tensor& logp, at::Tensor& tokens) {
  const auto raw = logits.to(at::kFloat);
  const auto x = raw.masked_fill(raw.isnan(), std::numeric_limits<float>::quiet_NaN()).masked_fill(raw == 0, 0.0);
  const auto order = std::get<1>(at::sort(x, /*stable=*/true, /*dim=*/-1, /*descending=*/true)).narrow(-1, 0, logp.size(2));
  tokens.copy_(order);
  // A row holding +inf: log_softmax (the semantics; the CPU op and the segment kernels agree) makes every logp NaN
  // (inf - inf in its sum), logsumexp only the infinities' (its +inf takes the numbers to -inf).
  const auto lse = at::logsumexp(x, -1, /*keepdim=*/true);
  logp.copy_(at::gather(x, -1, order) - lse.masked_fill(lse == std::numeric_limits<float>::infinity(),
                                                          std::numeric_limits<float>::quiet_NaN()));
}

// ==== build_tree ===============================================================================
//
// One block per batch row. Warp 0 runs the best-first selection exactly as the reference does (same
// pops in the same order, ties included): a candidate is a child of a taken node not yet taken, keyed
// by 64 bits [score as ordered bits | parent | rank (| depth)] so that "largest key" is "highest
// float32 score, then lower parent index, then lower rank" (the reference's heap order; a candidate's
// (parent, rank) is unique, so the key is too). All threads then write the padded tree.
//
// Two ways to keep the candidates, both popping the largest key:
// - register lists (budget <= kListMaxBudget, the draft's case): every lane keeps a short sorted list
//   of candidates in registers. A pop is two warp-wide max reductions over the list heads, which give
//   every lane the popped key; every lane derives the node and its (at most two) new candidates from
//   it, the winner takes the first in place of the popped one and the second is dealt round-robin. A
//   lane's list only grows by dealt candidates, and at most `budget` are dealt before the last pop, so
//   ceil(budget / 32) entries per lane never overflow. Three reads per pop after the reductions (two
//   logp values and the parent's score), issued together; all from shared memory where logp is staged.
// - shared-memory slots (larger budgets): candidates live in slots, each lane tracks the best of its
//   slots and rescans them when its best is taken.

constexpr int kBuildThreads = 256;
constexpr int kMaxKeyField = 0xffff;          // slots: parent index and rank are packed in 16 bits each
constexpr int64_t kStagedLogpMax = 8192;     // logp rows up to this many floats are staged in shared memory

// Register lists: lo word = [1023 - parent (10 bits) | 8191 - rank (13 bits) | depth (9 bits)]. The
// depth rides along (it never decides an order) so a pop needs no lookup of the parent's depth.
constexpr int kListRankBits = 13, kListDepthBits = 9;
constexpr int kListMaxParent = (1 << 10) - 1;
constexpr int kListMaxRank = (1 << kListRankBits) - 1;
constexpr int kListMaxDepth = (1 << kListDepthBits) - 1;
constexpr int kListMaxPerLane = 16;
constexpr int kListMaxBudget = kListMaxPerLane * kWarp;  // 512 < kListMaxParent, so a real lo word is never 0

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
  return (static_cast<uint64_t>(cuda::ordered_bits(score)) << 32) |
         (static_cast<uint64_t>(kMaxKeyField - parent) << 16) | static_cast<uint64_t>(kMaxKeyField - rank);
}

__device__ __forceinline__ uint64_t list_key(float score, int parent, int rank, int depth) {
  const uint32_t lo = (static_cast<uint32_t>(kListMaxParent - parent) << (kListRankBits + kListDepthBits)) |
                      (static_cast<uint32_t>(kListMaxRank - rank) << kListDepthBits) | static_cast<uint32_t>(depth);
  return (static_cast<uint64_t>(cuda::ordered_bits(score)) << 32) | lo;
}

// One lane's candidates, largest key first, in registers (every index is a compile-time constant). A key holds all
// a pop needs (score, parent, rank, depth); the parent's score and previous child are in shared memory.
template <int CAP>
struct CandidateList {
  uint64_t key[CAP];  // 0 = empty

  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int j = 0; j < CAP; ++j) key[j] = 0;
  }

  // Keys are unique, so strict comparisons; inserting key 0 changes nothing (the predicated inserts rely on it).
  __device__ __forceinline__ void insert(uint64_t k) {
#pragma unroll
    for (int j = CAP - 1; j > 0; --j) key[j] = k > key[j - 1] ? key[j - 1] : (k > key[j] ? k : key[j]);
    key[0] = k > key[0] ? k : key[0];
  }

  __device__ __forceinline__ void pop_front_if(bool pop) {
#pragma unroll
    for (int j = 0; j < CAP - 1; ++j) key[j] = pop ? key[j + 1] : key[j];
    key[CAP - 1] = pop ? 0 : key[CAP - 1];
  }
};

struct BuildSmem {
  uint64_t* slot_key;  // [slot capacity] (slots only); 0 = empty (no real score maps to 0)
  float* score;        // [N]
  int* last_child;     // [N]
  int* parent;         // [N]
  int* depth;          // [N]
  int* rank;           // [N]
  int* first_child;    // [N]
  int* next_sibling;   // [N]
  uint64_t* mask;      // [N * W]
  float* logp;         // [L * K] when staged
};

// Shared memory of one block; the slot selection also needs the slots.
__host__ __device__ inline size_t build_smem_bytes(int64_t n, int64_t words, int64_t slots, int64_t staged_logp) {
  return sizeof(uint64_t) * (n * words + slots) + sizeof(float) * (staged_logp + n) + sizeof(int) * 6 * n;
}

// Best-first selection with shared-memory slots (any budget the key fields hold). Run by warp 0;
// returns the number of nodes taken besides the root.
template <typename Lp>
__device__ int select_with_slots(BuildSmem& sm, Lp lp, int num_depths, int k, int budget, bool spine) {
  const int lane = threadIdx.x % kWarp;
  if (lane == 0) sm.score[0] = 0.f;
  __syncwarp();
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
    const int spine_len = min(num_depths, budget);
    for (int d = 1; d <= spine_len; ++d) {
      const float sp = sm.score[prev];
      if (k > 1) put(slots++, candidate_key(sp + lp(d - 1, 1), prev, 1));  // the spine node's next sibling
      prev = take_node(prev, d, 0, sp + lp(d - 1, 0));
    }
  } else {
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
  return taken;
}

// Best-first selection with per-lane register lists of CAP >= ceil(budget / 32) candidates (see the
// section comment). Run by warp 0; returns the number of nodes taken besides the root.
//
// A pop is two warp reductions: the highest score over the list heads, then the highest low word among the heads
// holding it. The (score, low word) pair is unique, so every lane then knows the popped key and whether it held it,
// with no ballot or shuffle; the rest is straight-line code with predicated inserts. That chain is the kernel's
// critical path, run once per node.
template <int CAP, typename Lp>
__device__ int select_with_lists(BuildSmem& sm, Lp lp, int num_depths, int k, int budget, bool spine) {
  const int lane = threadIdx.x % kWarp;
  CandidateList<CAP> list;
  list.clear();
  int taken = 0;  // nodes taken besides the root
  int dealt = 0;  // candidates dealt round-robin so far: the next one goes to lane dealt % 32
  if (lane == 0) sm.score[0] = 0.f;
  // Node i's tables (lane 0). Children are taken in rank order: a rank r + 1 sibling becomes a candidate when rank r
  // is taken, so the previous child is the last one taken.
  auto record = [&](int i, int p, int d, int r, float s) {
    sm.score[i] = s;
    sm.parent[i] = p;
    sm.depth[i] = d;
    sm.rank[i] = r;
    if (r == 0) {
      sm.first_child[p] = i;
    } else {
      sm.next_sibling[sm.last_child[p]] = i;
    }
    sm.last_child[p] = i;
  };

  if (spine) {
    // The top-1 chain is nodes 1..spine_len; each spine node's next sibling is a candidate.
    const int spine_len = min(num_depths, budget);
    float s = 0.f;  // score of node d - 1
    for (int d = 1; d <= spine_len; ++d) {
      if (k > 1) {
        if (lane == dealt % kWarp) list.insert(list_key(s + lp(d - 1, 1), d - 1, 1, d));
        ++dealt;
      }
      s = s + lp(d - 1, 0);
      if (lane == 0) record(d, d - 1, d, 0, s);
    }
    taken = spine_len;
  } else {
    if (lane == 0) list.insert(list_key(0.f + lp(0, 0), 0, 0, 1));
    dealt = 1;
  }
  __syncwarp();

  while (taken < budget) {
    const uint32_t hi = static_cast<uint32_t>(list.key[0] >> 32);
    const uint32_t lo = static_cast<uint32_t>(list.key[0]);
    const uint32_t max_hi = cuda::warp_max_u32(hi);
    const uint32_t max_lo = cuda::warp_max_u32(hi == max_hi ? lo : 0u);
    if (max_hi == 0 && max_lo == 0) break;  // every list empty: K ** depth ran out, the rest is padding
    const bool is_winner = hi == max_hi && lo == max_lo;
    const float s = cuda::from_ordered_bits(max_hi);
    const int p = kListMaxParent - static_cast<int>(max_lo >> (kListRankBits + kListDepthBits));
    const int r = kListMaxRank - static_cast<int>((max_lo >> kListDepthBits) & kListMaxRank);
    const int d = static_cast<int>(max_lo & kListMaxDepth);
    const int i = ++taken;
    // The new candidates, the same float32 sums the reference pushes (reads clamped in range, keys dropped after).
    const float parent_score = sm.score[p];
    const float child_lp = lp(min(d, num_depths - 1), 0);
    const float sibling_lp = lp(d - 1, min(r + 1, k - 1));
    if (lane == 0) record(i, p, d, r, s);
    const uint64_t child = d < num_depths ? list_key(s + child_lp, i, 0, d + 1) : 0;
    const uint64_t sibling = r + 1 < k ? list_key(parent_score + sibling_lp, p, r + 1, d) : 0;
    // The winner replaces its head by the first new candidate; with two, the sibling is dealt round-robin (to the
    // winner too, which then inserts both).
    const bool deal = child != 0 && sibling != 0;
    const int dealt_to = dealt % kWarp;
    list.pop_front_if(is_winner);
    list.insert(is_winner ? (child ? child : sibling) : 0);
    list.insert(deal && lane == dealt_to ? sibling : 0);
    dealt += deal ? 1 : 0;
    __syncwarp();  // lane 0's score[i] is read by the pops after this one
  }
  return taken;
}

// The kernel's arguments (pointers and strides of every input and output).
struct BuildArgs {
  const float* logp;
  int64_t lp_sb, lp_sl, lp_sk;
  const int64_t* tokens;
  int64_t tk_sb, tk_sl, tk_sk;
  const int64_t* root_token;
  int64_t rt_s;
  const int64_t* prefix_len;
  int64_t pl_s;
  int num_depths, k, budget, slot_capacity;
  bool spine, stage_logp;
  int64_t* node_token;
  int64_t nt_sb, nt_sn;
  int32_t* parent;
  int64_t pa_sb, pa_sn;
  int32_t* depth;
  int64_t de_sb, de_sn;
  int32_t* num_nodes;
  int64_t nn_s;
  int32_t* first_child;
  int64_t fc_sb, fc_sn;
  int32_t* next_sibling;
  int64_t ns_sb, ns_sn;
  int64_t* ancestor_mask;
  int64_t am_sb, am_sn, am_sw;
  int64_t* position;
  int64_t po_sb, po_sn;
};

// LIST_CAP > 0: register lists of that many candidates per lane; 0: shared-memory slots.
template <int LIST_CAP>
__global__ void __launch_bounds__(kBuildThreads) build_tree_kernel(const BuildArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();  // launched as a programmatic dependent: nothing read or written before
  constexpr bool kSlots = LIST_CAP == 0;
  const int n = a.budget + 1;
  const int words = (n + 63) / 64;
  const int num_depths = a.num_depths, k = a.k;
  BuildSmem sm;
  {
    unsigned char* p = smem_raw;
    auto take = [&](size_t bytes) {
      unsigned char* q = p;
      p += bytes;
      return q;
    };
    sm.mask = reinterpret_cast<uint64_t*>(take(sizeof(uint64_t) * n * words));
    sm.slot_key = reinterpret_cast<uint64_t*>(take(kSlots ? sizeof(uint64_t) * a.slot_capacity : 0));
    sm.logp = reinterpret_cast<float*>(take(sizeof(float) * (a.stage_logp ? num_depths * k : 0)));
    sm.score = reinterpret_cast<float*>(take(sizeof(float) * n));
    sm.last_child = reinterpret_cast<int*>(take(sizeof(int) * n));
    sm.parent = reinterpret_cast<int*>(take(sizeof(int) * n));
    sm.depth = reinterpret_cast<int*>(take(sizeof(int) * n));
    sm.rank = reinterpret_cast<int*>(take(sizeof(int) * n));
    sm.first_child = reinterpret_cast<int*>(take(sizeof(int) * n));
    sm.next_sibling = reinterpret_cast<int*>(take(sizeof(int) * n));
  }
  const int b = blockIdx.x;
  const int tid = threadIdx.x;
  const float* lp_row = a.logp + b * a.lp_sb;

  for (int i = tid; i < n; i += kBuildThreads) {
    sm.first_child[i] = -1;
    sm.next_sibling[i] = -1;
    sm.parent[i] = i == 0 ? -1 : 0;  // padding nodes hang under the root
    sm.depth[i] = i == 0 ? 0 : 1;
  }
  if constexpr (kSlots) {
    for (int i = tid; i < a.slot_capacity; i += kBuildThreads) sm.slot_key[i] = 0;
  }
  if (a.stage_logp) {
    for (int i = tid; i < num_depths * k; i += kBuildThreads) sm.logp[i] = lp_row[(i / k) * a.lp_sl + (i % k) * a.lp_sk];
  }
  __syncthreads();

  __shared__ int taken_shared;
  if (tid < kWarp) {
    const bool staged = a.stage_logp;
    const int64_t lp_sl = a.lp_sl, lp_sk = a.lp_sk;
    const float* staged_lp = sm.logp;
    auto lp = [=](int d0, int r) { return staged ? staged_lp[d0 * k + r] : lp_row[d0 * lp_sl + r * lp_sk]; };
    int taken;
    if constexpr (kSlots) {
      taken = select_with_slots(sm, lp, num_depths, k, a.budget, a.spine);
    } else {
      taken = select_with_lists<LIST_CAP>(sm, lp, num_depths, k, a.budget, a.spine);
    }
    if (tid == 0) taken_shared = taken;
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

  const int64_t root = a.root_token[b * a.rt_s];
  const int64_t prefix = a.prefix_len[b * a.pl_s];
  for (int i = tid; i < n; i += kBuildThreads) {
    const bool real = i >= 1 && i <= taken;
    const int d = sm.depth[i];
    a.node_token[b * a.nt_sb + i * a.nt_sn] = real ? a.tokens[b * a.tk_sb + (d - 1) * a.tk_sl + sm.rank[i] * a.tk_sk] : root;
    a.parent[b * a.pa_sb + i * a.pa_sn] = sm.parent[i];
    a.depth[b * a.de_sb + i * a.de_sn] = d;
    a.first_child[b * a.fc_sb + i * a.fc_sn] = sm.first_child[i];
    a.next_sibling[b * a.ns_sb + i * a.ns_sn] = sm.next_sibling[i];
    a.position[b * a.po_sb + i * a.po_sn] = prefix + d;
  }
  for (int e = tid; e < n * words; e += kBuildThreads) {
    const int i = e / words, w = e % words;
    a.ancestor_mask[b * a.am_sb + i * a.am_sn + w * a.am_sw] = static_cast<int64_t>(sm.mask[e]);
  }
  if (tid == 0) a.num_nodes[b * a.nn_s] = taken + 1;
}

template <int LIST_CAP>
void launch_build_tree(const BuildArgs& args, int64_t bsz, size_t smem) {
  cuda::allow_dynamic_smem(build_tree_kernel<LIST_CAP>, smem);
  cuda::launch_programmatic(build_tree_kernel<LIST_CAP>, dim3(static_cast<unsigned>(bsz)), dim3(kBuildThreads), smem,
                            args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();  // launched as a programmatic dependent: nothing read or written before
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
  cuda::launch_programmatic(tree_attention_mask_kernel<T>, dim3(blocks), dim3(kMaskThreads), sizeof(uint64_t) * words,
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
  const bool lists = budget <= kListMaxBudget && k <= kListMaxRank && depths <= kListMaxDepth;
  TORCH_CHECK_VALUE(lists || (n - 1 <= kMaxKeyField && k <= kMaxKeyField), op,
                    ": the CUDA op supports budget and K up to ", kMaxKeyField, ", got budget ", budget, " and K ", k);
  // Slots: the initial candidates (spine siblings or the first root child), then at most one more per pop.
  const int64_t slots = lists ? 0 : depths + budget + 1;
  const bool stage = depths * k <= kStagedLogpMax;
  const size_t smem = build_smem_bytes(n, words, slots, stage ? depths * k : 0);
  TORCH_CHECK_VALUE(smem <= cuda::max_dynamic_smem(), op, ": budget ", budget,
                    " needs more shared memory than this GPU offers (", smem, " bytes)");
  if (bsz == 0) return;
  const BuildArgs args{logp.data_ptr<float>(), logp.stride(0), logp.stride(1), logp.stride(2),
                       tokens.data_ptr<int64_t>(), tokens.stride(0), tokens.stride(1), tokens.stride(2),
                       root_token.data_ptr<int64_t>(), root_token.stride(0), prefix_len.data_ptr<int64_t>(),
                       prefix_len.stride(0), static_cast<int>(depths), static_cast<int>(k), static_cast<int>(budget),
                       static_cast<int>(slots), spine, stage, node_token.data_ptr<int64_t>(), node_token.stride(0),
                       node_token.stride(1), parent.data_ptr<int32_t>(), parent.stride(0), parent.stride(1),
                       depth.data_ptr<int32_t>(), depth.stride(0), depth.stride(1), num_nodes.data_ptr<int32_t>(),
                       num_nodes.stride(0), first_child.data_ptr<int32_t>(), first_child.stride(0),
                       first_child.stride(1), next_sibling.data_ptr<int32_t>(), next_sibling.stride(0),
                       next_sibling.stride(1), ancestor_mask.data_ptr<int64_t>(), ancestor_mask.stride(0),
                       ancestor_mask.stride(1), ancestor_mask.stride(2), position.data_ptr<int64_t>(),
                       position.stride(0), position.stride(1)};
  // Entries per lane: at most ceil(budget / 32) candidates are dealt to one lane (section comment).
  const int64_t per_lane = cuda::ceil_div(budget, kWarp);
  if (!lists) {
    launch_build_tree<0>(args, bsz, smem);
  } else if (per_lane <= 2) {
    launch_build_tree<2>(args, bsz, smem);
  } else if (per_lane <= 4) {
    launch_build_tree<4>(args, bsz, smem);
  } else if (per_lane <= 8) {
    launch_build_tree<8>(args, bsz, smem);
  } else {
    static_assert(kListMaxPerLane == 16, "16 entries per lane cover every list budget");
    launch_build_tree<16>(args, bsz, smem);
  }
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
