// One pass over a row of logits by one thread block: softmax statistics (max, sum of exp) and the
// best K_CAP (value, id) pairs, ordered higher value first, then lower id (the ops' tie rule). Used by
// topk_logprobs (the draft's per-depth top-K) and walk_sample (the target's top-k).
//
// Every thread keeps an online (max, sum-exp) pair and a sorted register list; the lists are merged
// warp by warp, then across warps. (value, id) pairs are totally ordered, so the result does not
// depend on which thread saw which element; the softmax statistics are merged by fixed butterflies
// and a fixed warp order, so they are deterministic too.
#pragma once

#include <algorithm>
#include <type_traits>

#include "cuda_common.cuh"

namespace ddtree {
namespace cuda {

constexpr int kNoId = 0x7fffffff;

// A float's bits mapped to an unsigned key with the float order (-0 and +0 share one key; NaNs sort
// above +inf or below -inf by their sign bit: rank_key below orders them as the ops do).
__device__ __forceinline__ uint32_t ordered_bits(float f) {
  uint32_t u = __float_as_uint(f);
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The float whose ordered_bits are `o` (-0 comes back as +0).
__device__ __forceinline__ float from_ordered_bits(uint32_t o) {
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}

// Largest value over the warp, every lane gets it: one instruction on sm_80+.
__device__ __forceinline__ unsigned warp_max_u32(unsigned x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_max_sync(kFullMask, x);
#else
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) x = max(x, __shfl_xor_sync(kFullMask, x, off));
  return x;
#endif
}

// The K-th largest of the lanes' keys counted with multiplicity (0 = no value), or 0 when fewer than K
// lanes hold one. At most K rounds of a warp max.
template <int K>
__device__ __forceinline__ unsigned warp_kth_largest(unsigned key) {
  int count = 0;
  while (true) {
    const unsigned top = warp_max_u32(key);
    if (top == 0) return 0;
    count += __popc(__ballot_sync(kFullMask, key == top));
    if (count >= K) return top;
    if (key == top) key = 0;
  }
}

// The ops' rank order as a key: the float order with every NaN above +inf, as torch.sort and torch.topk (and
// so the CPU ops) rank NaN. Never 0 (the "no value" key above).
__device__ __forceinline__ uint32_t rank_key(float f) { return isnan(f) ? 0xffffffffu : ordered_bits(f); }

// ordered_bits(-inf): the key of the lists' padding (-inf, kNoId), as in the float lists.
constexpr uint32_t kNegInfKey = 0x007fffffu;

// The lists below hold floats (numbers only: walk_sample's, whose tests drop NaN) or rank keys (the top-K's,
// which keeps NaN). lowest_value<V>: the padding's value.
template <typename V>
__device__ __forceinline__ V lowest_value() {
  if constexpr (std::is_same_v<V, float>) {
    return -INFINITY;
  } else {
    return kNegInfKey;
  }
}

// Whether (a, ia) ranks before (b, ib): the higher value (number or rank key) first, then the lower id. A strict
// total order over pairs with distinct ids when no value is NaN. One compare of values: the sorted inserts run it
// twice a slot, and a NaN-aware float compare there (two rank keys a call, or float compares with NaN tests) made
// walk_sample's top-k lists 3-5 x slower (H100s: 128 -> 368 and 636 us for 65 rows at top_k 20,
// benchmarks/results/2026-12-05-h100-walk-sample-histograms.md); rank keys order NaN instead.
template <typename V>
__device__ __forceinline__ bool ranks_before(V a, int ia, V b, int ib) {
  return a > b || (a == b && ia < ib);
}

// (max, sum of exp(x - max)) of a running softmax; -inf elements contribute nothing. The hardware exp
// (__expf: a few ulps, about 2e-6 relative for arguments down to -30) keeps the per-element cost low;
// it moves log(sum) by ~1e-6, far inside the float32 tolerance of the log-probabilities.
struct MaxSum {
  float m = -INFINITY;
  float s = 0.f;

  __device__ __forceinline__ void add(float x) {
    if (x > m) {
      s = s * __expf(m - x) + 1.f;
      m = x;
    } else if (x != -INFINITY) {
      s += __expf(x - m);
    }
  }

  __device__ __forceinline__ void merge(float m2, float s2) {
    const float mm = fmaxf(m, m2);
    if (mm == -INFINITY) return;
    s = (m == -INFINITY ? 0.f : s * __expf(m - mm)) + (m2 == -INFINITY ? 0.f : s2 * __expf(m2 - mm));
    m = mm;
  }
};

// Descending list of the best K (value, id) pairs seen by one thread, in registers (every index is a
// compile-time constant, so nothing goes to local memory). V: float (numbers only) or rank keys.
template <int K, typename V = float>
struct TopList {
  V val[K];
  int id[K];

  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int j = 0; j < K; ++j) {
      val[j] = lowest_value<V>();
      id[j] = kNoId;
    }
  }

  __device__ __forceinline__ void insert(V x, int ix) {
    if (!ranks_before(x, ix, val[K - 1], id[K - 1])) return;
    // From the tail: slot j takes slot j - 1's entry while x ranks before that, else x itself.
#pragma unroll
    for (int j = K - 1; j > 0; --j) {
      if (ranks_before(x, ix, val[j - 1], id[j - 1])) {
        val[j] = val[j - 1];
        id[j] = id[j - 1];
      } else if (ranks_before(x, ix, val[j], id[j])) {
        val[j] = x;
        id[j] = ix;
      }
    }
    if (ranks_before(x, ix, val[0], id[0])) {
      val[0] = x;
      id[0] = ix;
    }
  }

  __device__ __forceinline__ void pop_front() {
#pragma unroll
    for (int j = 0; j < K - 1; ++j) {
      val[j] = val[j + 1];
      id[j] = id[j + 1];
    }
    val[K - 1] = lowest_value<V>();
    id[K - 1] = kNoId;
  }
};

// Best (value, id) pair over the warp; every lane gets it.
template <typename V>
__device__ __forceinline__ void warp_best(V& v, int& id) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    const V v2 = __shfl_xor_sync(kFullMask, v, off);
    const int id2 = __shfl_xor_sync(kFullMask, id, off);
    if (ranks_before(v2, id2, v, id)) {
      v = v2;
      id = id2;
    }
  }
}

// Calls f(value, id) for every element of row[0, n) (as float), in 16-byte packs where aligned.
template <typename T, int THREADS, typename F>
__device__ __forceinline__ void for_each_in_row(const T* row, int64_t n, F&& f) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t head = elements_to_16b_boundary(row, n);
  const int64_t packs = (n - head) / kVec;
  for (int64_t i = threadIdx.x; i < head; i += THREADS) f(to_float(row[i]), i);
  for (int64_t p = threadIdx.x; p < packs; p += THREADS) {
    float v[kVec];
    load_pack_float<T, kVec>(row + head + p * kVec, v);
#pragma unroll
    for (int e = 0; e < kVec; ++e) f(v[e], head + p * kVec + e);
  }
  for (int64_t i = head + packs * kVec + threadIdx.x; i < n; i += THREADS) f(to_float(row[i]), i);
}

// Merges `lists` (<= 32) descending lists of K_CAP (value, id) pairs, list l at vals[l * stride] /
// ids[l * stride], into the best K_CAP, written to out_val / out_id. Called by one whole warp.
template <typename V>
__device__ __forceinline__ void warp_merge_lists(const V* vals, const int* ids, int stride, int lists, int k_cap,
                                                 V* out_val, int* out_id) {
  const int lane = threadIdx.x % kWarp;
  int pos = 0;  // lane l walks list l
  for (int r = 0; r < k_cap; ++r) {
    const bool live = lane < lists && pos < k_cap;
    V v = live ? vals[lane * stride + pos] : lowest_value<V>();
    int id = live ? ids[lane * stride + pos] : kNoId;
    const int mine = id;
    warp_best(v, id);
    if (live && mine == id) ++pos;
    if (lane == 0) {
      out_val[r] = v;
      out_id[r] = id;
    }
  }
}

template <int K_CAP, int THREADS>
struct RowTopKSmem {
  static constexpr int kWarps = THREADS / kWarp;
  static_assert(kWarps <= kWarp, "one warp merges the per-warp lists");
  float warp_val[kWarps][K_CAP];
  int warp_id[kWarps][K_CAP];
  float warp_m[kWarps], warp_s[kWarps];
  unsigned warp_threshold[kWarps];
  float val[K_CAP];  // the result, best first
  int id[K_CAP];
  float m, s;        // softmax max and sum of exp(x - m) over the row
};

// Scans row[0, n) with every thread of the block, taking transform(x) as the value of element x and
// id_offset + i as the id of element i. Afterwards (following a barrier) sm.val / sm.id hold the best
// min(K_CAP, n) pairs (padded with (-inf, kNoId)) and sm.m / sm.s the softmax statistics (sm.s stays 0
// without WITH_SUM, which saves an exp per element). Must be called by all THREADS threads.
//
// Two passes over the row (the second mostly from L2). A sorted insert per element made the list
// compute-bound: a warp takes the insert's K_CAP steps whenever one lane's element beats its list's
// tail, which early in a row is nearly always (walk_sample's top-20 over 65 rows of 248320 took 325 us
// on the H200, 42 x the time to read them). So pass 1 takes each thread's max (one element of the
// row); each warp's (K_CAP / warps)-th largest lane max is reached by that many of its elements, so the
// least of these over the warps is reached by K_CAP elements and no element below it is in the top
// K_CAP. Pass 2 inserts only the elements at or above it: the same pairs, a handful of inserts (the whole
// walk_sample then took 127 us for those rows, 2026-12-05).
template <typename T, int K_CAP, int THREADS, bool WITH_SUM = true, typename Transform>
__device__ void row_softmax_topk(const T* row, int64_t n, int id_offset, Transform transform,
                                 RowTopKSmem<K_CAP, THREADS>& sm) {
  constexpr int kWarps = THREADS / kWarp;
  static_assert(K_CAP % kWarps == 0, "every warp contributes K_CAP / kWarps elements to the threshold");
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  MaxSum ms;
  for_each_in_row<T, THREADS>(row, n, [&](float x, int64_t) {
    const float v = transform(x);
    if constexpr (WITH_SUM) {
      ms.add(v);
    } else {
      ms.m = fmaxf(ms.m, v);
    }
  });
  // A lane that saw no element (or only -inf) keys -inf: at worst the threshold is -inf and pass 2 keeps
  // everything, as one pass did. 0 (fewer than K_CAP / kWarps keys in a warp) means no threshold.
  const unsigned warp_t = warp_kth_largest<K_CAP / kWarps>(ordered_bits(ms.m));
  if (lane == 0) sm.warp_threshold[warp] = warp_t;
  __syncthreads();
  unsigned least = sm.warp_threshold[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) least = min(least, sm.warp_threshold[w]);
  const float threshold = least == 0 ? -INFINITY : from_ordered_bits(least);
  TopList<K_CAP> top;
  top.clear();
  for_each_in_row<T, THREADS>(row, n, [&](float x, int64_t i) {
    const float v = transform(x);
    // NaN fails the test: walk_sample's lists keep numbers only (its draws handle NaN rows apart).
    if (v >= threshold) top.insert(v, id_offset + static_cast<int>(i));
  });
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(kFullMask, ms.m, off);
    const float s2 = __shfl_xor_sync(kFullMask, ms.s, off);
    ms.merge(m2, s2);
  }
  // K_CAP rounds of "the best head in the warp wins and is popped".
  for (int r = 0; r < K_CAP; ++r) {
    float v = top.val[0];
    int id = top.id[0];
    warp_best(v, id);
    if (top.id[0] == id) top.pop_front();
    if (lane == 0) {
      sm.warp_val[warp][r] = v;
      sm.warp_id[warp][r] = id;
    }
  }
  if (lane == 0) {
    sm.warp_m[warp] = ms.m;
    sm.warp_s[warp] = ms.s;
  }
  __syncthreads();
  if (warp == 0) {
    warp_merge_lists(&sm.warp_val[0][0], &sm.warp_id[0][0], K_CAP, kWarps, K_CAP, sm.val, sm.id);
    if (lane == 0) {
      MaxSum total;
      for (int w = 0; w < kWarps; ++w) total.merge(sm.warp_m[w], sm.warp_s[w]);
      sm.m = total.m;
      sm.s = total.s;
    }
  }
  __syncthreads();
}

// How a one-pass scan splits rows of n elements over blocks: enough (row, segment) blocks to fill the
// GPU about twice, segments of at least kMinRowSegment elements starting on 8-element (16-byte for
// 16-bit types) boundaries, at most kWarp segments per row (one warp merges them).
constexpr int64_t kMinRowSegment = 4096;

struct RowSplit {
  int64_t segments, length;
};

inline RowSplit split_rows(int64_t rows, int64_t n) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t segments = std::min<int64_t>(std::max<int64_t>(1, ceil_div(2 * sms, std::max<int64_t>(rows, 1))), kWarp);
  segments = std::min(segments, std::max<int64_t>(1, n / kMinRowSegment));
  const int64_t length = ceil_div(ceil_div(n, segments), 8) * 8;
  return {ceil_div(n, length), length};
}

}  // namespace cuda
}  // namespace ddtree
