// CUDA implementations of moe_experts and moe_router. Semantics and rounding points: csrc/moe.cpp,
// ddtree_ext/reference.py.
//
// Hugging Face's grouped_mm experts forward is a dozen launches per layer (a sort, gathers, a histogram, a cumsum,
// two grouped GEMMs over every expert's offsets, the gate, a scatter back, a sum); a decode step or a verify block
// has few rows, so it is launch- and latency-bound. Here four launches, each a programmatic dependent of the one
// before (three for a decode step's 16-bit call, whose projection blocks rank its few ids themselves):
//   * route: one block lists the pairs (token, k) of each expert the rows reach, as slots (expert, first, count)
//     in the routing scratch;
//   * gate-up: writes round(round(silu(round(gate . x))) * round(up . x)) for every pair of a slot;
//   * down: round(round(down . that) * routing weight);
//   * combine: out[t] = round(sum over k of the pair outputs), k in order (plus the block's shared expert, where it
//     is folded in: csrc/moe.cpp).
// The projections come in two kinds, one per dtype, each with a sum order fixed by K alone, so that a row's bits do
// not depend on the batch (a verify block's rows give a decode step's bits):
//   * bfloat16 / float16, tensor cores (mma.sync, float32 sums): a block per (slot, 8 intermediate columns) or
//     (slot, 32 hidden features); its 8 warps split K and their sums are added in warp order; up to 32 of an
//     expert's pairs share each pass over its weights, so a crowded expert's weights are read once per 32 pairs;
//   * float32, fmaf (its sums as HF's float32 forwards round): a block per (slot, 8 columns) or (slot, 16 features),
//     the pairs staged in shared memory 8 at a time; lane-strided 16-byte chunks, explicit fmaf, a butterfly sum.
// Expert ids outside [0, E) reach no expert and add nothing (memcheck-clean; the CPU op raises).
// Timings against HF's grouped_mm forward and the weight-read floor: benchmarks/results/*moe-experts*.md.
#include <algorithm>
#include <limits>
#include <type_traits>

#include "activations.h"
#include "cuda_common.cuh"
#include "ops.h"

namespace ddtree {
namespace {

using cuda::kFullMask;
using cuda::kMaxGridY;
using cuda::kWarp;
using cuda::Pack;
using cuda::to_float;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarp;
// The float32 (fmaf) kernels:
constexpr int kChunk = 8;             // pairs staged at once: an expert's weight tile is streamed once per chunk
constexpr int kDownRowsPerWarp = 2;   // hidden features per warp in the down projection
static_assert(kDownRowsPerWarp * kChunk <= kWarp, "one lane writes each of a warp's down results");
constexpr int kRouteThreads = 1024;
// Blocks resident per SM the float32 projections are built for (at most 85 registers a thread): a decode step has a
// few hundred blocks, each streaming weights, and latency is hidden by how many loads are in flight.
constexpr int kMinBlocks = 3;

// Dynamic shared memory: the route kernel's counts and cursors (two int32 per expert), and the float32 kernels' staged
// rows (kChunk rows of n elements). The launches and the checks before them both size by these.
inline size_t route_smem_bytes(int64_t experts) { return 2 * static_cast<size_t>(experts) * sizeof(int32_t); }
inline size_t staged_smem_bytes(int64_t n, int64_t element) { return kChunk * static_cast<size_t>(n * element); }

// The routing scratch: [0] the number of slots used; then slot_expert[S], slot_begin[S], slot_count[S] (S = min(E,
// P)), then the pair indices of every slot's expert, slot after slot (moe_routing_size). I: int32_t for the route
// kernel, which writes it, const int32_t for the kernels that read it.
template <typename I>
struct Routing {
  I* num_slots;
  I* slot_expert;
  I* slot_begin;
  I* slot_count;
  I* pairs;
};

template <typename I>
__device__ __forceinline__ Routing<I> routing_view(I* base, int slots) {
  return Routing<I>{base, base + 1, base + 1 + slots, base + 1 + 2 * slots, base + 1 + 3 * slots};
}

// Inclusive sums of a and b over the warp's lanes, in lane order.
__device__ __forceinline__ void warp_inclusive_sums(int& a, int& b, int lane) {
#pragma unroll
  for (int d = 1; d < kWarp; d <<= 1) {
    const int a_below = __shfl_up_sync(kFullMask, a, d), b_below = __shfl_up_sync(kFullMask, b, d);
    if (lane >= d) a += a_below, b += b_below;
  }
}

// One block: counts per expert (shared atomics), a block-wide exclusive scan of the counts and of the experts
// reached, then every valid pair placed in its expert's list. The order within a list is whatever the atomics give:
// each pair's result is computed on its own, so it does not change any bit.
__global__ void __launch_bounds__(kRouteThreads) moe_route_kernel(const int64_t* __restrict__ expert_ids, int pairs,
                                                                    int experts, int slots,
                                                                    int32_t* __restrict__ routing) {
  extern __shared__ int32_t counts[];  // [E] pairs per expert, then [E] each expert's next free place
  int32_t* cursor = counts + experts;
  __shared__ int32_t warp_offsets[2][kRouteThreads / kWarp];
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  for (int e = tid; e < experts; e += kRouteThreads) counts[e] = 0;
  __syncthreads();
  for (int p = tid; p < pairs; p += kRouteThreads) {
    const int64_t e = expert_ids[p];
    if (e >= 0 && e < experts) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  // Each thread takes a run of consecutive experts: its pairs and its experts reached, scanned over the block.
  const int per_thread = (experts + kRouteThreads - 1) / kRouteThreads;
  const int lo = min(tid * per_thread, experts), hi = min(lo + per_thread, experts);
  int own_pairs = 0, own_hits = 0;
  for (int e = lo; e < hi; ++e) {
    own_pairs += counts[e];
    own_hits += counts[e] > 0;
  }
  int inc_pairs = own_pairs, inc_hits = own_hits;
  warp_inclusive_sums(inc_pairs, inc_hits, lane);
  if (lane == kWarp - 1) warp_offsets[0][warp] = inc_pairs, warp_offsets[1][warp] = inc_hits;
  __syncthreads();
  if (warp == 0) {  // the warps' totals, one a lane (kRouteThreads / kWarp == kWarp), to exclusive offsets
    const int warp_pairs = warp_offsets[0][lane], warp_hits = warp_offsets[1][lane];
    int ip = warp_pairs, ih = warp_hits;
    warp_inclusive_sums(ip, ih, lane);
    warp_offsets[0][lane] = ip - warp_pairs, warp_offsets[1][lane] = ih - warp_hits;
  }
  __syncthreads();
  int begin = warp_offsets[0][warp] + inc_pairs - own_pairs, slot = warp_offsets[1][warp] + inc_hits - own_hits;
  const Routing<int32_t> routes = routing_view(routing, slots);
  for (int e = lo; e < hi; ++e) {
    const int c = counts[e];
    cursor[e] = begin;
    if (c > 0) {
      routes.slot_expert[slot] = e, routes.slot_begin[slot] = begin, routes.slot_count[slot] = c;
      ++slot;
    }
    begin += c;
  }
  if (tid == kRouteThreads - 1) *routes.num_slots = slot;  // the last run ends at the total
  __syncthreads();
  for (int p = tid; p < pairs; p += kRouteThreads) {
    const int64_t e = expert_ids[p];
    if (e >= 0 && e < experts) routes.pairs[atomicAdd(&cursor[e], 1)] = p;
  }
}

// Stages `rows` activation rows of length n (row r: src + row_of(r) * n) into shared memory, zero rows up to
// `staged`; 16-byte copies where src is aligned (n is a multiple of the chunk: checked on the host).
template <typename T, typename RowOf>
__device__ __forceinline__ void stage_rows(T* dst, const T* src, int64_t n, int rows, int staged, bool aligned,
                                           RowOf row_of) {
  constexpr int V = 16 / sizeof(T);
  const int64_t chunks = n / V;
  for (int64_t i = threadIdx.x; i < staged * chunks; i += kThreads) {
    const int r = static_cast<int>(i / chunks);
    const int64_t j = (i % chunks) * V;
    Pack<T, V> pk;
    if (r >= rows) {
#pragma unroll
      for (int e = 0; e < V; ++e) pk.v[e] = T(0.f);
    } else {
      const T* s = src + row_of(r) * n + j;
      if (aligned) {
        pk = *reinterpret_cast<const Pack<T, V>*>(s);
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) pk.v[e] = s[e];
      }
    }
    *reinterpret_cast<Pack<T, V>*>(dst + r * n + j) = pk;
  }
}

// acc[q][r] = dot(weight row q, staged row r) for Q weight rows `row_stride` apart and R staged rows of length n:
// lane-strided 16-byte chunks, fmaf in element order, then a butterfly sum (every lane gets the totals).
template <typename T, int Q, int R>
__device__ __forceinline__ void warp_dots(const T* __restrict__ weight, int64_t row_stride, const T* staged, int64_t n,
                                          int lane, float (&acc)[Q][R]) {
  constexpr int V = 16 / sizeof(T);
#pragma unroll
  for (int q = 0; q < Q; ++q) {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[q][r] = 0.f;
  }
#pragma unroll 2
  for (int64_t j = static_cast<int64_t>(lane) * V; j < n; j += kWarp * V) {
    Pack<T, V> w[Q];  // kept in T: registers for the accumulators
#pragma unroll
    for (int q = 0; q < Q; ++q) w[q] = *reinterpret_cast<const Pack<T, V>*>(weight + q * row_stride + j);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float a[V];
      cuda::load_pack_float<T, V>(staged + r * n + j, a);
#pragma unroll
      for (int q = 0; q < Q; ++q) {
#pragma unroll
        for (int e = 0; e < V; ++e) acc[q][r] = __fmaf_rn(to_float(w[q].v[e]), a[e], acc[q][r]);
      }
    }
  }
#pragma unroll
  for (int q = 0; q < Q; ++q) {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[q][r] = cuda::warp_sum(acc[q][r]);
  }
}

// Where a projection block finds its expert slot (blockIdx.y): the route kernel's table, or, for 16-bit calls of at
// most kWarp pairs and 8 rows (a decode step's 8 pairs), the expert ids themselves, ranked by one warp of the block,
// and the route kernel is not launched: one dependent launch less where the op is shortest. Either way slot s is the
// s-th expert reached in id order, so both give the same blocks the same work.
struct SlotSource {
  const int32_t* routing;  // the route kernel's table; null: rank expert_ids in each block
  const int64_t* expert_ids;
  int pairs, experts, slots;
};

// One warp, lane l taking pair l's expert id (pairs <= kWarp): out[0 .. count) = the pairs of the s-th expert reached,
// in order, out[kWarp] = count (0: fewer experts reached), out[kWarp + 1] = the expert. Out-of-range ids reach none.
__device__ __forceinline__ void rank_slot(const SlotSource& src, int s, int lane, int32_t* out) {
  const int64_t id = lane < src.pairs ? src.expert_ids[lane] : -1;
  const bool valid = id >= 0 && id < src.experts;
  const int key = valid ? static_cast<int>(id) : -1 - lane;  // lanes without an expert: keys of their own
  const unsigned same = __match_any_sync(kFullMask, key);
  const bool first = valid && __ffs(same) - 1 == lane;  // the expert's first pair
  int rank = 0;  // experts reached with smaller ids
  for (int j = 0; j < kWarp; ++j) {
    const int other = __shfl_sync(kFullMask, key, j);
    rank += __shfl_sync(kFullMask, static_cast<int>(first), j) && other < key;
  }
  const unsigned at_s = __ballot_sync(kFullMask, first && rank == s);
  if (at_s == 0) {
    if (lane == 0) out[kWarp] = 0;
    return;
  }
  const int leader = __ffs(at_s) - 1;
  const unsigned members = __shfl_sync(kFullMask, same, leader);
  const int expert = __shfl_sync(kFullMask, key, leader);
  if ((members >> lane) & 1u) out[__popc(members & ((1u << lane) - 1u))] = lane;
  if (lane == 0) out[kWarp] = __popc(members), out[kWarp + 1] = expert;
}

// visit(rows, pairs, expert) for the block's expert slot in groups of at most G of its pairs (pairs: the group's pair
// indices, rows of them). Nothing for a block past the slots reached.
// RankInBlock: the ids ranked in the block (src.routing is null), else the route kernel's table.
template <int G, bool RankInBlock = false, typename Visit>
__device__ __forceinline__ void for_each_group(const SlotSource& src, Visit visit) {
  const int s = blockIdx.y;
  if constexpr (RankInBlock) {
    __shared__ int32_t ranked[kWarp + 2];
    if (threadIdx.x < kWarp) rank_slot(src, s, threadIdx.x, ranked);
    __syncthreads();
    const int count = ranked[kWarp];
    if (count == 0) return;
    const int64_t expert = ranked[kWarp + 1];
    for (int c0 = 0; c0 < count; c0 += G) visit(min(G, count - c0), static_cast<const int32_t*>(ranked) + c0, expert);
  } else {
    const Routing<const int32_t> routes = routing_view(src.routing, src.slots);
    if (s >= *routes.num_slots) return;
    const int64_t expert = routes.slot_expert[s];
    const int begin = routes.slot_begin[s], count = routes.slot_count[s];
    for (int c0 = 0; c0 < count; c0 += G) visit(min(G, count - c0), routes.pairs + begin + c0, expert);
  }
}

// The smallest of 1, 2, 4, kChunk rows that holds `rows`: the staged rows a warp computes.
__device__ __forceinline__ int bucket(int rows) { return rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : kChunk; }

template <int R>
using Rows = std::integral_constant<int, R>;

// The block's expert slot in chunks of at most kChunk pairs: each chunk's input rows (row_of(pair) of src, rows of
// length n) are staged in shared memory, then, for warps with work (`active`), compute(Rows<R>{}, staged, rows, pairs,
// expert) runs with R = bucket(rows).
template <typename T, typename RowOf, typename Compute>
__device__ __forceinline__ void for_each_chunk(const SlotSource& slots, const T* src, int64_t n, bool aligned,
                                               RowOf row_of, bool active, Compute compute) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* staged = reinterpret_cast<T*>(smem_raw);  // [kChunk][n]
  bool first = true;
  for_each_group<kChunk>(slots, [&](int rows, const int32_t* pairs, int64_t expert) {
    if (!first) __syncthreads();  // the warps are done with the chunk before
    first = false;
    stage_rows(staged, src, n, rows, bucket(rows), aligned, [&](int r) { return row_of(pairs[r]); });
    __syncthreads();
    if (!active) return;
    switch (bucket(rows)) {
      case 1: compute(Rows<1>{}, staged, rows, pairs, expert); break;
      case 2: compute(Rows<2>{}, staged, rows, pairs, expert); break;
      case 4: compute(Rows<4>{}, staged, rows, pairs, expert); break;
      default: compute(Rows<kChunk>{}, staged, rows, pairs, expert);
    }
  });
}

// hidden[p, c] = round(round(silu(round(gate_c . x[t]))) * round(up_c . x[t])) for the block's expert, the warp's
// column c and every pair p = (t, k) of the expert.
template <typename T>
__global__ void __launch_bounds__(kThreads, kMinBlocks) moe_gate_up_kernel(
    const T* __restrict__ x, bool x_aligned, int top_k, SlotSource slots,
    const T* __restrict__ gate_up_proj, int64_t inter, int64_t hidden_size, T* __restrict__ hidden) {
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t column = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  auto token_of = [&](int32_t pair) { return static_cast<int64_t>(pair / top_k); };
  for_each_chunk(slots, x, hidden_size, x_aligned, token_of, column < inter,
                 [&](auto rows_tag, const T* staged, int rows, const int32_t* pairs, int64_t expert) {
    constexpr int R = decltype(rows_tag)::value;
    const T* gate = gate_up_proj + (expert * 2 * inter + column) * hidden_size;
    float acc[2][R];
    warp_dots<T, 2, R>(gate, inter * hidden_size, staged, hidden_size, lane, acc);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r < rows && lane == r) {
        const float g = round_to<T>(acc[0][r]), u = round_to<T>(acc[1][r]);
        hidden[static_cast<int64_t>(pairs[r]) * inter + column] = static_cast<T>(__fmul_rn(round_to<T>(silu(g)), u));
      }
    }
  });
}

// expert_out[p, j] = round(round(down_j . hidden[p]) * w[p]) for the block's expert, the warp's kDownRowsPerWarp
// features j and every pair p of the expert.
template <typename T>
__global__ void __launch_bounds__(kThreads, kMinBlocks) moe_down_kernel(
    const T* __restrict__ hidden, const T* __restrict__ expert_weights, SlotSource slots,
    const T* __restrict__ down_proj, int64_t inter, int64_t hidden_size, T* __restrict__ expert_out) {
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  // H is a multiple of 4 (16 bytes of float32 at least): a warp's rows are all inside H or all past it.
  const int64_t feature = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * kDownRowsPerWarp;
  auto pair_row = [](int32_t pair) { return static_cast<int64_t>(pair); };
  for_each_chunk(slots, hidden, inter, true, pair_row, feature < hidden_size,
                 [&](auto rows_tag, const T* staged, int rows, const int32_t* pairs, int64_t expert) {
    constexpr int R = decltype(rows_tag)::value;
    const T* down = down_proj + (expert * hidden_size + feature) * inter;
    float acc[kDownRowsPerWarp][R];
    warp_dots<T, kDownRowsPerWarp, R>(down, inter, staged, inter, lane, acc);
#pragma unroll
    for (int q = 0; q < kDownRowsPerWarp; ++q) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r < rows && lane == q * R + r) {  // kDownRowsPerWarp * kChunk <= 32: one lane per result
          const int64_t p = pairs[r];
          expert_out[p * hidden_size + feature + q] =
              static_cast<T>(__fmul_rn(round_to<T>(acc[q][r]), to_float(expert_weights[p])));
        }
      }
    }
  });
}

// ---- 16-bit inputs: tensor cores ------------------------------------------------------------------------------
// The fmaf kernels above do R x the multiply-adds for R staged pairs; when many rows reach one expert (verify rows
// share their context and crowd a few experts) that, not the weights, is the bound. For bfloat16 and float16 the
// products run on tensor cores instead (mma.sync m16n8k16, float32 sums), the weights as the 16-row side and the
// expert's pairs as the 8-column side, up to 32 pairs per pass, so a crowded expert's weights are read once per 32.
// Each of a block's warps takes every kWarps-th block of kKBlock elements of K (split-K) for the same output rows; the
// warps' partial sums are then added in warp order. A product's sum order is thus fixed by K alone: a pair's bits do
// not depend on the other pairs, on how many share its pass, or on its place in a tile.
// A lane loads 16 consecutive elements of each of its rows per K block (two 16-byte loads) and feeds them to the
// block's 4 mma k-steps: k-step s takes elements 4 s .. 4 s + 3 of the lane's 16 as the fragment's columns 2 tig,
// 2 tig + 1, 2 tig + 8, 2 tig + 9. The weights and the pair rows are permuted alike, so the sums are the dot products.
constexpr int kKBlock = 64;      // elements of K per warp step: 4 lanes (tig) x 16
constexpr int kMaxTiles = 4;     // mma column tiles of 8 pairs a pass takes at most: 32 pairs
// The kernels come in three widths, the most column tiles a pass takes (1, 2 or kMaxTiles): a call with T rows serves
// at most T pairs an expert (a token's experts are distinct), so a decode step runs the narrowest, whose
// registers let 4 blocks share an SM (one wave for its 512 blocks on an H100) where the wider ones fit 2 (at 3 the
// two-tile gate-up spilled 100 bytes).
template <int MaxTiles>
constexpr int kMmaMinBlocks = MaxTiles == 1 ? 4 : 2;

template <int N>
using Tiles = std::integral_constant<int, N>;

// 16 bytes of row + k, or zeros where row is null or k is past the row's end (K is a multiple of 8 elements).
template <typename T>
__device__ __forceinline__ uint4 load_granule(const T* row, int64_t k, int64_t k_len, bool aligned) {
  uint4 v = make_uint4(0, 0, 0, 0);
  if (row != nullptr && k < k_len) {
    if (aligned) {
      v = *reinterpret_cast<const uint4*>(row + k);
    } else {
      Pack<T, 8> pk;
#pragma unroll
      for (int e = 0; e < 8; ++e) pk.v[e] = row[k + e];
      v = *reinterpret_cast<const uint4*>(&pk);
    }
  }
  return v;
}

__device__ __forceinline__ uint32_t word(const uint4 (&g)[2], int i) {
  const uint4& q = g[i / 4];
  const int j = i % 4;
  return j == 0 ? q.x : j == 1 ? q.y : j == 2 ? q.z : q.w;
}

// acc[m][n] += (rows of m-tile m) . (pair rows of column tile n) over this warp's K blocks (warp, warp + kWarps, ...).
// This lane's operands: rows a[m][0] (row gid of the tile) and a[m][1] (row gid + 8), pair row b[n] (column gid);
// null pointers read as zeros. Weights are always 16-byte aligned; the pair rows are where b_aligned says.
// K blocks are unrolled by two for one tile of rows (gate-up: several blocks a warp); two tiles hold enough loads.
template <typename T, int MT, int NT>
__device__ __forceinline__ void warp_mma_k_blocks(const T* const (&a)[MT][2], const T* const (&b)[NT], bool b_aligned,
                                                  int64_t k_len, int warp, int tig, float (&acc)[MT][NT][4]) {
  constexpr int kUnroll = MT == 1 ? 2 : 1;
#pragma unroll kUnroll
  for (int64_t k0 = static_cast<int64_t>(warp) * kKBlock; k0 < k_len; k0 += kWarps * kKBlock) {
    const int64_t k = k0 + 16 * tig;
    uint4 wa[MT][2][2], xb[NT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        wa[m][h][0] = load_granule(a[m][h], k, k_len, true);
        wa[m][h][1] = load_granule(a[m][h], k + 8, k_len, true);
      }
    }
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      xb[n][0] = load_granule(b[n], k, k_len, b_aligned);
      xb[n][1] = load_granule(b[n], k + 8, k_len, b_aligned);
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) {
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        const uint32_t frag_a[4] = {word(wa[m][0], 2 * s), word(wa[m][1], 2 * s), word(wa[m][0], 2 * s + 1),
                                    word(wa[m][1], 2 * s + 1)};
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const uint32_t frag_b[2] = {word(xb[n], 2 * s), word(xb[n], 2 * s + 1)};
          cuda::mma_16x8x16<T>(acc[m][n], frag_a, frag_b);
        }
      }
    }
  }
}

// The block's expert slot in passes of at most 8 MaxTiles pairs: compute(Tiles<NT>{}, rows, pairs, expert) with the
// fewest column tiles of 8 that hold the pass's rows.
template <int MaxTiles, bool RankInBlock, typename Compute>
__device__ __forceinline__ void for_each_pass(const SlotSource& slots, Compute compute) {
  for_each_group<8 * MaxTiles, RankInBlock>(slots, [&](int rows, const int32_t* pairs, int64_t expert) {
    if (rows <= 8) {
      compute(Tiles<1>{}, rows, pairs, expert);
    } else if constexpr (MaxTiles > 1) {
      if (MaxTiles == 2 || rows <= 16) {
        compute(Tiles<2>{}, rows, pairs, expert);
      } else {
        compute(Tiles<MaxTiles>{}, rows, pairs, expert);
      }
    }
  });
}

// The block's sum over warps of value v of lane's partial sums, warp 0 first.
template <int V>
__device__ __forceinline__ float sum_over_warps(const float (&partial)[kWarps][V][kWarp], int v, int lane) {
  float sum = partial[0][v][lane];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) sum = __fadd_rn(sum, partial[w][v][lane]);
  return sum;
}

// gate-up on tensor cores: a block per (slot, 8 intermediate columns c0 .. c0 + 7): the 16 weight rows are those
// columns' gate rows, then their up rows, so a lane's accumulators hold gate and up of one column for two pairs.
template <typename T, int MaxTiles, bool RankInBlock>
__global__ void __launch_bounds__(kThreads, kMmaMinBlocks<MaxTiles>) moe_gate_up_mma_kernel(
    const T* __restrict__ x, bool x_aligned, int top_k, SlotSource slots,
    const T* __restrict__ gate_up_proj, int64_t inter, int64_t hidden_size, T* __restrict__ hidden) {
  constexpr int kValues = 4 * MaxTiles;
  __shared__ float partial[kWarps][kValues][kWarp];
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, gid = lane / 4, tig = lane % 4;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * 8;  // I is a multiple of 8: every column exists
  for_each_pass<MaxTiles, RankInBlock>(slots, [&](auto tiles, int rows, const int32_t* pairs, int64_t expert) {
    constexpr int NT = decltype(tiles)::value;
    const T* gate = gate_up_proj + (expert * 2 * inter + c0 + gid) * hidden_size;
    const T* const a[1][2] = {{gate, gate + inter * hidden_size}};
    const T* b[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const int r = 8 * n + gid;
      b[n] = r < rows ? x + static_cast<int64_t>(pairs[r] / top_k) * hidden_size : nullptr;
    }
    float acc[1][NT][4] = {};
    warp_mma_k_blocks<T, 1, NT>(a, b, x_aligned, hidden_size, warp, tig, acc);
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int q = 0; q < 4; ++q) partial[warp][4 * n + q][lane] = acc[0][n][q];
    }
    __syncthreads();
    // Value n * 4 + h: gate (column gid) for pair 8 n + 2 tig + h; n * 4 + 2 + h: up of the same.
    for (int i = threadIdx.x; i < 2 * NT * kWarp; i += kThreads) {
      const int l = i % kWarp, h = (i / kWarp) % 2, n = i / (2 * kWarp);
      const int r = 8 * n + 2 * (l % 4) + h;
      if (r >= rows) continue;
      const float g = round_to<T>(sum_over_warps(partial, 4 * n + h, l));
      const float u = round_to<T>(sum_over_warps(partial, 4 * n + 2 + h, l));
      hidden[static_cast<int64_t>(pairs[r]) * inter + c0 + l / 4] = static_cast<T>(__fmul_rn(round_to<T>(silu(g)), u));
    }
    __syncthreads();  // partial is read before the next pass writes it
  });
}

// down on tensor cores: a block per (slot, kDownMmaTiles * 16 hidden features), times the routing weight.
constexpr int kDownMmaTiles = 2;

template <typename T, int MaxTiles, bool RankInBlock>
__global__ void __launch_bounds__(kThreads, kMmaMinBlocks<MaxTiles>) moe_down_mma_kernel(
    const T* __restrict__ hidden, const T* __restrict__ expert_weights, SlotSource slots,
    const T* __restrict__ down_proj, int64_t inter, int64_t hidden_size, T* __restrict__ expert_out) {
  constexpr int MT = kDownMmaTiles, kValues = MT * 4 * MaxTiles;
  __shared__ float partial[kWarps][kValues][kWarp];
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, gid = lane / 4, tig = lane % 4;
  const int64_t f0 = static_cast<int64_t>(blockIdx.x) * MT * 16;
  for_each_pass<MaxTiles, RankInBlock>(slots, [&](auto tiles, int rows, const int32_t* pairs, int64_t expert) {
    constexpr int NT = decltype(tiles)::value;
    const T* a[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t feature = f0 + 16 * m + 8 * h + gid;
        a[m][h] = feature < hidden_size ? down_proj + (expert * hidden_size + feature) * inter : nullptr;
      }
    }
    const T* b[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const int r = 8 * n + gid;
      b[n] = r < rows ? hidden + static_cast<int64_t>(pairs[r]) * inter : nullptr;
    }
    float acc[MT][NT][4] = {};
    warp_mma_k_blocks<T, MT, NT>(a, b, true, inter, warp, tig, acc);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int q = 0; q < 4; ++q) partial[warp][4 * (m * NT + n) + q][lane] = acc[m][n][q];
      }
    }
    __syncthreads();
    // Value (m NT + n) * 4 + q: feature 16 m + gid + 8 (q / 2), pair 8 n + 2 tig + q % 2.
    for (int i = threadIdx.x; i < MT * NT * 4 * kWarp; i += kThreads) {
      const int l = i % kWarp, v = i / kWarp, q = v % 4, n = (v / 4) % NT, m = v / (4 * NT);
      const int r = 8 * n + 2 * (l % 4) + q % 2;
      const int64_t feature = f0 + 16 * m + 8 * (q / 2) + l / 4;
      if (r >= rows || feature >= hidden_size) continue;
      const int64_t p = pairs[r];
      expert_out[p * hidden_size + feature] =
          static_cast<T>(__fmul_rn(round_to<T>(sum_over_warps(partial, v, l)), to_float(expert_weights[p])));
    }
    __syncthreads();
  });
}

// The block's shared expert, folded into the combine: its output rows, and its gate's logit per row (null: no gate).
template <typename T>
struct SharedExpert {
  const T* rows;  // [T, H] contiguous, or null: no shared expert
  const T* gate;  // [T, 1] at gate_stride, or null
  int64_t gate_stride;
};

// out[t, j .. j + V) = round(sum over k of expert_out[t * K + k, j ..]), k in order, skipping pairs whose expert id
// is out of range (they reached no expert); plus the shared expert's gated rows, as HF's block adds them.
template <typename T>
__global__ void __launch_bounds__(kThreads) moe_combine_kernel(const T* __restrict__ expert_out,
                                                                 const int64_t* __restrict__ expert_ids, int top_k,
                                                                 int64_t experts, int64_t tokens, int64_t hidden_size,
                                                                 SharedExpert<T> shared, T* __restrict__ out) {
  constexpr int V = 16 / sizeof(T);
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();
  const int64_t chunks = hidden_size / V;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= tokens * chunks) return;
  const int64_t t = i / chunks, j = (i % chunks) * V;
  float sum[V];
#pragma unroll
  for (int e = 0; e < V; ++e) sum[e] = 0.f;
  for (int k = 0; k < top_k; ++k) {
    const int64_t p = t * top_k + k, id = expert_ids[p];
    if (id < 0 || id >= experts) continue;
    float y[V];
    cuda::load_pack_float<T, V>(expert_out + p * hidden_size + j, y);
#pragma unroll
    for (int e = 0; e < V; ++e) sum[e] = __fadd_rn(sum[e], y[e]);
  }
  if (shared.rows != nullptr) {
    const float scale = shared.gate != nullptr ? round_to<T>(sigmoid(to_float(shared.gate[t * shared.gate_stride])))
                                               : 1.f;
    float s[V];
    cuda::load_pack_float<T, V>(shared.rows + t * hidden_size + j, s);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      sum[e] = __fadd_rn(round_to<T>(sum[e]), shared.gate != nullptr ? round_to<T>(__fmul_rn(scale, s[e])) : s[e]);
    }
  }
  cuda::store_pack_float<T, V>(out + t * hidden_size + j, sum);
}

// 16-bit inputs run tensor-core code (mma.sync: compute capability >= 8.0); a build whose code for this GPU targets
// an older architecture has traps in its place: refuse before launching anything.
template <typename T>
void check_tensor_cores() {
  static const int ptx_version = cuda::ptx_version(moe_gate_up_mma_kernel<T, 1, false>);
  DDTREE_CHECK("moe_experts", ptx_version >= 80, "bfloat16/float16 inputs need this extension built for compute ",
               "capability 8.0 or newer (its code for this GPU targets ", ptx_version / 10, ".", ptx_version % 10,
               "); rebuild with TORCH_CUDA_ARCH_LIST naming 8.0 or newer, or pass float32");
}

// gate-up, then down times the routing weight, on tensor cores, passes of at most 8 MaxTiles pairs; RankInBlock: the
// blocks rank the expert ids themselves (slots.routing is null).
template <typename T, int MaxTiles, bool RankInBlock = false>
void launch_mma_projections(const T* x, bool x_aligned, int top_k, const at::Tensor& expert_weights,
                            const at::Tensor& gate_up_proj, const at::Tensor& down_proj, const SlotSource& slots,
                            at::Tensor& hidden, at::Tensor& expert_out) {
  const int64_t hidden_size = gate_up_proj.size(2), inter = down_proj.size(2);
  cuda::launch_programmatic(moe_gate_up_mma_kernel<T, MaxTiles, RankInBlock>,
                            dim3(static_cast<unsigned>(inter / 8), slots.slots), dim3(kThreads), 0, x, x_aligned, top_k,
                            slots, gate_up_proj.data_ptr<T>(), inter, hidden_size, hidden.data_ptr<T>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  cuda::launch_programmatic(
      moe_down_mma_kernel<T, MaxTiles, RankInBlock>,
      dim3(static_cast<unsigned>(cuda::ceil_div(hidden_size, kDownMmaTiles * 16)), slots.slots), dim3(kThreads), 0,
      static_cast<const T*>(hidden.data_ptr<T>()), expert_weights.data_ptr<T>(), slots, down_proj.data_ptr<T>(), inter,
      hidden_size, expert_out.data_ptr<T>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The launches: route (skipped for 16-bit calls of at most kWarp pairs and 8 rows); gate-up, then down times the
// routing weight (on tensor cores for 16-bit T; for float32, the fmaf kernels, which stage x's and the SwiGLU
// output's rows in shared memory); combine. Arguments checked.
template <typename T>
void launch_experts(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& expert_weights,
                    const at::Tensor& gate_up_proj, const at::Tensor& down_proj, const SharedExpert<T>& shared,
                    at::Tensor& routing, at::Tensor& hidden, at::Tensor& expert_out, at::Tensor& out) {
  if constexpr (sizeof(T) == 2) check_tensor_cores<T>();
  const int64_t tokens = x.size(0), hidden_size = x.size(1), inter = down_proj.size(2);
  const int64_t experts = gate_up_proj.size(0), pairs = expert_ids.numel();
  const int top_k = static_cast<int>(expert_ids.size(1)), slots = static_cast<int>(std::min(experts, pairs));
  const int64_t* ids = expert_ids.data_ptr<int64_t>();
  SlotSource source{nullptr, ids, static_cast<int>(pairs), static_cast<int>(experts), slots};
  // 16-bit calls of at most kWarp pairs and 8 rows (a decode step's) rank the ids in each projection block instead.
  const bool rank_in_block = sizeof(T) == 2 && pairs <= kWarp && tokens <= 8;
  if (!rank_in_block) {
    int32_t* route = routing.data_ptr<int32_t>();
    const size_t route_smem = route_smem_bytes(experts);
    cuda::allow_dynamic_smem(moe_route_kernel, route_smem);
    cuda::launch_programmatic(moe_route_kernel, dim3(1), dim3(kRouteThreads), route_smem, ids, source.pairs,
                              source.experts, slots, route);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    source.routing = route;
  }
  const T* xs = x.data_ptr<T>();
  const bool x_aligned = cuda::is_aligned(xs, 16);
  const dim3 threads(kThreads);
  if constexpr (sizeof(T) == 2) {
    // A call of T rows serves at most T pairs an expert (its ids distinct per row, as a router's top-k are; repeats
    // only add passes): the narrowest kernels that take that many in one pass.
    const int64_t most_pairs_an_expert = std::min<int64_t>(tokens, 8 * kMaxTiles);
    if (rank_in_block) {
      launch_mma_projections<T, 1, true>(xs, x_aligned, top_k, expert_weights, gate_up_proj, down_proj, source, hidden,
                                         expert_out);
    } else if (most_pairs_an_expert <= 8) {
      launch_mma_projections<T, 1>(xs, x_aligned, top_k, expert_weights, gate_up_proj, down_proj, source, hidden,
                                   expert_out);
    } else if (most_pairs_an_expert <= 16) {
      launch_mma_projections<T, 2>(xs, x_aligned, top_k, expert_weights, gate_up_proj, down_proj, source, hidden,
                                   expert_out);
    } else {
      launch_mma_projections<T, kMaxTiles>(xs, x_aligned, top_k, expert_weights, gate_up_proj, down_proj, source,
                                           hidden, expert_out);
    }
  } else {
    const size_t gate_up_smem = staged_smem_bytes(hidden_size, sizeof(T));
    const size_t down_smem = staged_smem_bytes(inter, sizeof(T));
    cuda::allow_dynamic_smem(moe_gate_up_kernel<T>, gate_up_smem);
    cuda::launch_programmatic(moe_gate_up_kernel<T>, dim3(static_cast<unsigned>(cuda::ceil_div(inter, kWarps)), slots),
                              threads, gate_up_smem, xs, x_aligned, top_k, source, gate_up_proj.data_ptr<T>(), inter,
                              hidden_size, hidden.data_ptr<T>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    cuda::allow_dynamic_smem(moe_down_kernel<T>, down_smem);
    cuda::launch_programmatic(
        moe_down_kernel<T>,
        dim3(static_cast<unsigned>(cuda::ceil_div(hidden_size, kWarps * kDownRowsPerWarp)), slots), threads,
        down_smem, static_cast<const T*>(hidden.data_ptr<T>()), expert_weights.data_ptr<T>(), source,
        down_proj.data_ptr<T>(), inter, hidden_size, expert_out.data_ptr<T>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  constexpr int V = 16 / sizeof(T);
  const unsigned combine_blocks = static_cast<unsigned>(cuda::ceil_div(tokens * (hidden_size / V), kThreads));
  cuda::launch_programmatic(moe_combine_kernel<T>, dim3(combine_blocks), threads, 0,
                            static_cast<const T*>(expert_out.data_ptr<T>()), ids, top_k, experts, tokens, hidden_size,
                            shared, out.data_ptr<T>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---- moe_router: softmax over E, top-k, renormalised; one warp per token ----

constexpr int kRouterWarps = 4;  // tokens per block
constexpr int kRouterMaxTopK = kWarp;  // lane k keeps the k-th pick's probability

// The sort key of an expert's probability: its float bits above (non-negative floats and NaN order as unsigned
// integers, NaN above every number, as torch.topk puts it), the complement of its id below (ties to the lower id).
__device__ __forceinline__ uint64_t router_key(float p, int e) {
  return (static_cast<uint64_t>(__float_as_uint(p)) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(e));
}

// PER_LANE: the probabilities each lane holds (experts e = lane + kRouterLanes * i), E <= kRouterLanes * PER_LANE.
template <typename T, int PER_LANE>
__global__ void __launch_bounds__(kRouterWarps * kWarp) moe_router_kernel(const T* __restrict__ logits,
                                                                          int64_t row_stride, int64_t tokens,
                                                                          int experts, int top_k, bool renormalize,
                                                                          T* __restrict__ weights,
                                                                          int64_t* __restrict__ ids) {
  static_assert(kRouterLanes == kWarp, "the softmax's lane sums are a warp's lanes");
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();
  const int lane = threadIdx.x % kWarp;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouterWarps + threadIdx.x / kWarp;
  if (t >= tokens) return;  // a whole warp: the shuffles below see all 32 lanes
  const T* row = logits + t * row_stride;
  float p[PER_LANE];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int e = lane + kWarp * i;
    p[i] = e < experts ? to_float(row[e]) : -INFINITY;
    m = fmaxf(m, p[i]);
  }
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, off));
  // torch's warp softmax: each lane sums its exponentials in turn (padding adds exp(-inf) = 0), then a butterfly.
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    p[i] = expf(p[i] - m);
    sum += p[i];
  }
  sum = cuda::warp_sum(sum);
  uint64_t key[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int e = lane + kWarp * i;
    key[i] = e < experts ? router_key(p[i] / sum, e) : 0;  // key 0: below every expert's (padding, or picked)
  }
  float mine = 0.f, total = 0.f;
  int64_t my_id = 0;
  for (int k = 0; k < top_k; ++k) {
    uint64_t best = 0;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) best = key[i] > best ? key[i] : best;
    best = cuda::warp_max_u64(best);
    const int e = static_cast<int>(0xFFFFFFFFu - static_cast<uint32_t>(best));
    const float pk = __uint_as_float(static_cast<uint32_t>(best >> 32));
    total += pk;  // in pick order, as the CPU op sums
    if (lane == k) mine = pk, my_id = e;
    if (e % kWarp == lane) {
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) {
        if (lane + kWarp * i == e) key[i] = 0;
      }
    }
  }
  if (lane < top_k) {
    weights[t * top_k + lane] = cuda::from_float<T>(renormalize ? mine / total : mine);
    ids[t * top_k + lane] = my_id;
  }
}

template <typename T, int PER_LANE>
void launch_router(const at::Tensor& logits, int top_k, bool renormalize, at::Tensor& weights, at::Tensor& ids) {
  const int64_t tokens = logits.size(0);
  cuda::launch_programmatic(moe_router_kernel<T, PER_LANE>,
                            dim3(static_cast<unsigned>(cuda::ceil_div(tokens, kRouterWarps))),
                            dim3(kRouterWarps * kWarp), 0, logits.data_ptr<T>(), logits.stride(0), tokens,
                            static_cast<int>(logits.size(1)), top_k, renormalize, weights.data_ptr<T>(),
                            ids.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void moe_experts_cuda(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& expert_weights,
                      const at::Tensor& gate_up_proj, const at::Tensor& down_proj,
                      const c10::optional<at::Tensor>& shared, const c10::optional<at::Tensor>& shared_gate,
                      at::Tensor& routing, at::Tensor& hidden, at::Tensor& expert_out, at::Tensor& out) {
  constexpr const char* op = "moe_experts";
  check_moe_experts(x, expert_ids, expert_weights, gate_up_proj, down_proj, shared, shared_gate, routing, hidden,
                    expert_out, out);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t tokens = x.size(0), hidden_size = x.size(1);
  const int64_t experts = gate_up_proj.size(0), inter = down_proj.size(2), pairs = expert_ids.numel();
  if (tokens == 0) return;
  const int64_t element = x.element_size(), vec = 16 / element;
  DDTREE_CHECK(op, hidden_size % vec == 0 && inter % vec == 0, "on CUDA the hidden size H (", hidden_size,
               ") and the intermediate size I (", inter, ") must be multiples of ", vec, " (16 bytes of ",
               x.scalar_type(), ")");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"gate_up_proj", &gate_up_proj},
                                {"down_proj", &down_proj}, {"hidden", &hidden}, {"expert_out", &expert_out},
                                {"out", &out}, {"shared", shared.has_value() ? &*shared : nullptr}}) {
    if (t != nullptr) {
      DDTREE_CHECK(op, cuda::is_aligned(t->data_ptr(), 16), name, " must start on a 16-byte boundary on CUDA");
    }
  }
  const int64_t slots = std::min(experts, pairs);
  DDTREE_CHECK(op, slots <= kMaxGridY, "on CUDA min(E, T * K) must be at most ", kMaxGridY, ", got ", slots);
  const size_t smem_limit = cuda::max_dynamic_smem();
  DDTREE_CHECK(op, route_smem_bytes(experts) <= smem_limit, "on this GPU the number of experts E must be at most ",
               smem_limit / (2 * sizeof(int32_t)), ", got ", experts);
  // float32 stages kChunk rows of x (H) and of the SwiGLU output (I) in shared memory; 16-bit inputs stage nothing.
  if (element == 4) {
    DDTREE_CHECK(op, staged_smem_bytes(std::max(hidden_size, inter), element) <= smem_limit,
                 "on this GPU H and I must be at most ", smem_limit / (kChunk * element), " for ", x.scalar_type(),
                 ", got H = ", hidden_size, ", I = ", inter);
  }
  DDTREE_CUDA_DISPATCH_FLOAT(x.scalar_type(), op, [&] {
    const SharedExpert<scalar_t> folded{shared.has_value() ? shared->data_ptr<scalar_t>() : nullptr,
                                        shared_gate.has_value() ? shared_gate->data_ptr<scalar_t>() : nullptr,
                                        shared_gate.has_value() ? shared_gate->stride(0) : 0};
    launch_experts<scalar_t>(x, expert_ids, expert_weights, gate_up_proj, down_proj, folded, routing, hidden,
                             expert_out, out);
  });
}


void moe_router_cuda(const at::Tensor& logits, int64_t top_k, bool renormalize, at::Tensor& weights, at::Tensor& ids) {
  constexpr const char* op = "moe_router";
  check_moe_router(logits, top_k, weights, ids);
  const int64_t experts = logits.size(1);
  DDTREE_CHECK(op, experts <= 32 * kRouterLanes, "on CUDA the number of experts E must be at most ", 32 * kRouterLanes,
               ", got ", experts);
  DDTREE_CHECK(op, top_k <= kRouterMaxTopK, "on CUDA top_k must be at most ", kRouterMaxTopK, ", got ", top_k);
  const c10::cuda::CUDAGuard guard(logits.device());
  if (logits.size(0) == 0) return;
  const int k = static_cast<int>(top_k);
  DDTREE_CUDA_DISPATCH_FLOAT(logits.scalar_type(), op, [&] {
    if (experts <= kRouterLanes) {
      launch_router<scalar_t, 1>(logits, k, renormalize, weights, ids);
    } else if (experts <= 2 * kRouterLanes) {
      launch_router<scalar_t, 2>(logits, k, renormalize, weights, ids);
    } else if (experts <= 4 * kRouterLanes) {
      launch_router<scalar_t, 4>(logits, k, renormalize, weights, ids);
    } else if (experts <= 8 * kRouterLanes) {
      launch_router<scalar_t, 8>(logits, k, renormalize, weights, ids);
    } else if (experts <= 16 * kRouterLanes) {
      launch_router<scalar_t, 16>(logits, k, renormalize, weights, ids);
    } else {
      launch_router<scalar_t, 32>(logits, k, renormalize, weights, ids);
    }
  });
}

}  // namespace ddtree
