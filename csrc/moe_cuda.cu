// CUDA implementation of moe_experts. Semantics and rounding points: csrc/moe.cpp, ddtree_ext/reference.py.
//
// Hugging Face's grouped_mm experts forward is a dozen launches per layer (a sort, gathers, a histogram, a cumsum,
// two grouped GEMMs over every expert's offsets, the gate, a scatter back, a sum); a decode step or a verify block
// has few rows, so it is launch- and latency-bound. Here four launches, each a programmatic dependent of the one
// before:
//   * route: one block lists the pairs (token, k) of each expert the rows reach, as slots (expert, first, count)
//     in the routing scratch;
//   * gate_up: a block per (slot, 8 intermediate columns): each warp streams its column's gate and up weight rows
//     once per 8 of the slot's pairs (staged in shared memory) and writes round(round(silu(g)) * u);
//   * down: a block per (slot, 16 hidden features), the same way over the down projection, times the routing weight;
//   * combine: out[t] = round(sum over k of the pair outputs), k in order.
// The weights an expert's pairs need are read from memory once (an expert reached by more than 8 pairs streams its
// tile again for each 8 more, mostly from L2). A pair's dot products run in the same order whatever the other pairs are (lane-strided 16-byte chunks,
// explicit fmaf, then a butterfly sum), so a row's bits do not depend on the batch: a verify block's rows give a
// decode step's bits. Expert ids outside [0, E) reach no expert and add nothing (memcheck-clean; the CPU op raises).
// On an H100 at Qwen3.6-35B-A3B's sizes: 33 us for one row (HF's grouped_mm forward: 94), 1.2x the weight-read floor
// for 17 and 65 rows (benchmarks/results/2026-12-06-h100-moe-experts.md).
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
constexpr int kChunk = 8;             // pairs staged at once: an expert's weight tile is streamed once per chunk
constexpr int kDownRowsPerWarp = 2;   // hidden features per warp in the down projection
static_assert(kDownRowsPerWarp * kChunk <= kWarp, "one lane writes each of a warp's down results");
constexpr int kRouteThreads = 1024;
// Blocks resident per SM the projections are built for (at most 85 registers a thread): a decode step has a few
// hundred blocks, each streaming weights, and latency is hidden by how many loads are in flight.
constexpr int kMinBlocks = 3;

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

// The smallest of 1, 2, 4, kChunk rows that holds `rows`: the staged rows a warp computes.
__device__ __forceinline__ int bucket(int rows) { return rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : kChunk; }

template <int R>
using Rows = std::integral_constant<int, R>;

// The block's expert slot (blockIdx.y) in chunks of at most kChunk pairs: each chunk's input rows (row_of(pair) of
// src, rows of length n) are staged in shared memory, then, for warps with work (`active`), compute(Rows<R>{}, staged,
// rows, pairs, expert) runs with R = bucket(rows). Nothing for a block past the slots the route kernel filled.
template <typename T, typename RowOf, typename Compute>
__device__ __forceinline__ void for_each_chunk(const int32_t* routing, int slots, const T* src, int64_t n,
                                               bool aligned, RowOf row_of, bool active, Compute compute) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* staged = reinterpret_cast<T*>(smem_raw);  // [kChunk][n]
  const Routing<const int32_t> routes = routing_view(routing, slots);
  const int s = blockIdx.y;
  if (s >= *routes.num_slots) return;
  const int64_t expert = routes.slot_expert[s];
  const int begin = routes.slot_begin[s], count = routes.slot_count[s];
  for (int c0 = 0; c0 < count; c0 += kChunk) {
    const int rows = min(kChunk, count - c0);
    const int32_t* pairs = routes.pairs + begin + c0;
    if (c0 > 0) __syncthreads();  // the warps are done with the chunk before
    stage_rows(staged, src, n, rows, bucket(rows), aligned, [&](int r) { return row_of(pairs[r]); });
    __syncthreads();
    if (!active) continue;
    switch (bucket(rows)) {
      case 1: compute(Rows<1>{}, staged, rows, pairs, expert); break;
      case 2: compute(Rows<2>{}, staged, rows, pairs, expert); break;
      case 4: compute(Rows<4>{}, staged, rows, pairs, expert); break;
      default: compute(Rows<kChunk>{}, staged, rows, pairs, expert);
    }
  }
}

// hidden[p, c] = round(round(silu(round(gate_c . x[t]))) * round(up_c . x[t])) for the block's expert, the warp's
// column c and every pair p = (t, k) of the expert.
template <typename T>
__global__ void __launch_bounds__(kThreads, kMinBlocks) moe_gate_up_kernel(
    const T* __restrict__ x, bool x_aligned, int top_k, const int32_t* __restrict__ routing, int slots,
    const T* __restrict__ gate_up_proj, int64_t inter, int64_t hidden_size, T* __restrict__ hidden) {
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t column = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  auto token_of = [&](int32_t pair) { return static_cast<int64_t>(pair / top_k); };
  for_each_chunk(routing, slots, x, hidden_size, x_aligned, token_of, column < inter,
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
    const T* __restrict__ hidden, const T* __restrict__ expert_weights, const int32_t* __restrict__ routing, int slots,
    const T* __restrict__ down_proj, int64_t inter, int64_t hidden_size, T* __restrict__ expert_out) {
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  // H is a multiple of 4 (16 bytes of float32 at least): a warp's rows are all inside H or all past it.
  const int64_t feature = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * kDownRowsPerWarp;
  auto pair_row = [](int32_t pair) { return static_cast<int64_t>(pair); };
  for_each_chunk(routing, slots, hidden, inter, true, pair_row, feature < hidden_size,
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

// out[t, j .. j + V) = round(sum over k of expert_out[t * K + k, j ..]), k in order, skipping pairs whose expert id
// is out of range (they reached no expert).
template <typename T>
__global__ void __launch_bounds__(kThreads) moe_combine_kernel(const T* __restrict__ expert_out,
                                                                 const int64_t* __restrict__ expert_ids, int top_k,
                                                                 int64_t experts, int64_t tokens, int64_t hidden_size,
                                                                 T* __restrict__ out) {
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
  cuda::store_pack_float<T, V>(out + t * hidden_size + j, sum);
}

}  // namespace

void moe_experts_cuda(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& expert_weights,
                      const at::Tensor& gate_up_proj, const at::Tensor& down_proj, at::Tensor& routing,
                      at::Tensor& hidden, at::Tensor& expert_out, at::Tensor& out) {
  constexpr const char* op = "moe_experts";
  check_moe_experts(x, expert_ids, expert_weights, gate_up_proj, down_proj, routing, hidden, expert_out, out);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t tokens = x.size(0), hidden_size = x.size(1), top_k = expert_ids.size(1);
  const int64_t experts = gate_up_proj.size(0), inter = down_proj.size(2), pairs = tokens * top_k;
  if (tokens == 0) return;
  const int64_t element = x.element_size(), vec = 16 / element;
  DDTREE_CHECK(op, hidden_size % vec == 0 && inter % vec == 0, "on CUDA the hidden size H (", hidden_size,
               ") and the intermediate size I (", inter, ") must be multiples of ", vec, " (16 bytes of ",
               x.scalar_type(), ")");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"gate_up_proj", &gate_up_proj},
                                {"down_proj", &down_proj}, {"hidden", &hidden}, {"expert_out", &expert_out},
                                {"out", &out}}) {
    DDTREE_CHECK(op, cuda::is_aligned(t->data_ptr(), 16), name, " must start on a 16-byte boundary on CUDA");
  }
  const int64_t slots = std::min(experts, pairs);
  DDTREE_CHECK(op, slots <= kMaxGridY, "on CUDA min(E, T * K) must be at most ", kMaxGridY, ", got ", slots);
  const size_t route_smem = 2 * static_cast<size_t>(experts) * sizeof(int32_t);
  const size_t gate_up_smem = kChunk * static_cast<size_t>(hidden_size) * element;
  const size_t down_smem = kChunk * static_cast<size_t>(inter) * element;
  const size_t smem_limit = cuda::max_dynamic_smem();
  DDTREE_CHECK(op, route_smem <= smem_limit, "on this GPU the number of experts E must be at most ",
               smem_limit / (2 * sizeof(int32_t)), ", got ", experts);
  DDTREE_CHECK(op, gate_up_smem <= smem_limit && down_smem <= smem_limit, "on this GPU H and I must be at most ",
               smem_limit / (kChunk * element), " for ", x.scalar_type(), ", got H = ", hidden_size, ", I = ", inter);
  int32_t* route = routing.data_ptr<int32_t>();
  cuda::allow_dynamic_smem(moe_route_kernel, route_smem);
  cuda::launch_programmatic(moe_route_kernel, dim3(1), dim3(kRouteThreads), route_smem, expert_ids.data_ptr<int64_t>(),
                            static_cast<int>(pairs), static_cast<int>(experts), static_cast<int>(slots), route);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  DDTREE_CUDA_DISPATCH_FLOAT(x.scalar_type(), op, [&] {
    const scalar_t* xs = x.data_ptr<scalar_t>();
    scalar_t* mid = hidden.data_ptr<scalar_t>();
    scalar_t* per_pair = expert_out.data_ptr<scalar_t>();
    cuda::allow_dynamic_smem(moe_gate_up_kernel<scalar_t>, gate_up_smem);
    cuda::launch_programmatic(moe_gate_up_kernel<scalar_t>,
                              dim3(static_cast<unsigned>(cuda::ceil_div(inter, kWarps)), static_cast<unsigned>(slots)),
                              dim3(kThreads), gate_up_smem, xs, cuda::is_aligned(xs, 16), static_cast<int>(top_k),
                              static_cast<const int32_t*>(route), static_cast<int>(slots),
                              gate_up_proj.data_ptr<scalar_t>(), inter, hidden_size, mid);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    cuda::allow_dynamic_smem(moe_down_kernel<scalar_t>, down_smem);
    cuda::launch_programmatic(
        moe_down_kernel<scalar_t>,
        dim3(static_cast<unsigned>(cuda::ceil_div(hidden_size, kWarps * kDownRowsPerWarp)), static_cast<unsigned>(slots)),
        dim3(kThreads), down_smem, static_cast<const scalar_t*>(mid), expert_weights.data_ptr<scalar_t>(),
        static_cast<const int32_t*>(route), static_cast<int>(slots), down_proj.data_ptr<scalar_t>(), inter,
        hidden_size, per_pair);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    cuda::launch_programmatic(moe_combine_kernel<scalar_t>,
                              dim3(static_cast<unsigned>(cuda::ceil_div(tokens * (hidden_size / vec), kThreads))),
                              dim3(kThreads), 0, static_cast<const scalar_t*>(per_pair), expert_ids.data_ptr<int64_t>(),
                              static_cast<int>(top_k), experts, tokens, hidden_size, out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace ddtree
