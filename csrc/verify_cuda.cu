// CUDA implementations of the verify ops: GDN's short causal conv and the gated delta rule on a
// tree. Semantics: ddtree_ext/reference.py; the parallel form of the GDN recurrence: DESIGN.md §4.
#include <algorithm>
#include <type_traits>

#include "cuda_common.cuh"
#include "ops.h"

namespace ddtree {
namespace {

using cuda::kWarp;

constexpr float kL2NormEps = 1e-6f;  // reference.L2NORM_EPS

// The two 16-bit elements of a 32-bit word as floats (element 0 in the low half: little-endian).
template <typename T>
__device__ __forceinline__ float2 unpack_pair(uint32_t w) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    static_assert(std::is_same_v<T, at::Half>, "16-bit packs hold Half or BFloat16");
    return make_float2(__half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu))),
                       __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16))));
  }
}

// ==== tree_conv1d ==============================================================================
//
// One thread per (node, VEC channels). Node i's window is, oldest first, its W - 1 nearest
// ancestors then itself; window columns above the root come from the last columns of conv_state.

constexpr int kConvThreads = 128;

// A channel's conv output from its window sum, before the store rounds it to T: plus the bias, then (silu) rounded to
// T, as HF rounds the conv to the model dtype, and its SiLU. gdn_single_node_kernel's conv shares it.
template <typename T>
__device__ __forceinline__ float conv_output(float acc, const T* bias, int64_t bias_at, bool silu) {
  float y = acc;
  if (bias != nullptr) y += cuda::to_float(bias[bias_at]);
  if (silu) {
    y = cuda::to_float(cuda::from_float<T>(y));
    y = y / (1.f + expf(-y));
  }
  return y;
}

template <typename T, int VEC, int W>
__global__ void __launch_bounds__(kConvThreads) tree_conv1d_kernel(
    const T* __restrict__ x, int64_t x_sb, int64_t x_sn, const T* __restrict__ weight, int64_t w_sc, int64_t w_st,
    const T* __restrict__ bias, int64_t bias_s, const T* __restrict__ conv_state, int64_t cs_sb, int64_t cs_sc,
    int64_t cs_ss, int64_t state_len, const int32_t* __restrict__ parent, int64_t pa_sb, int64_t pa_sn, int num_nodes,
    int64_t channels, bool silu, bool weight_packed, T* __restrict__ out, int64_t o_sb, int64_t o_sn) {
  const int b = blockIdx.x / num_nodes, i = blockIdx.x % num_nodes;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.y) * kConvThreads + threadIdx.x) * VEC;
  cuda::allow_dependent_launch();
  // Launched as a programmatic dependent: the weights move into L2 while the kernel ahead (which writes x) ends; a
  // prefetch loads no register, and every load and store comes after the wait.
  if (c0 < channels) cuda::prefetch_l2(weight + c0 * w_sc);
  cuda::wait_for_preceding_grid();
  if (c0 >= channels) return;

  // chain[m] = the m-th ancestor of i (chain[0] = i), -1 above the root; path_len = nodes on the path.
  int chain[W];
  int path_len = W;
  chain[0] = i;
#pragma unroll
  for (int m = 1; m < W; ++m) {
    chain[m] = chain[m - 1] < 0 ? -1 : cuda::checked_parent(parent[b * pa_sb + chain[m - 1] * pa_sn], chain[m - 1]);
    if (chain[m] < 0 && path_len == W) path_len = m;
  }

  // The thread's VEC x W weights, as 16-byte loads when the weight rows are contiguous: a warp's rows then span
  // one contiguous range, where element by element each of the VEC x W loads touched a sector per lane.
  float wt[VEC][W];
  constexpr int kWeightBytes = VEC * W * static_cast<int>(sizeof(T));
  bool loaded = false;
  if constexpr (kWeightBytes % 16 == 0) {
    if (weight_packed) {
      constexpr int kWords = kWeightBytes / 4, kPerWord = 4 / static_cast<int>(sizeof(T));
      uint32_t words[kWords];
      const uint4* src = reinterpret_cast<const uint4*>(weight + c0 * w_sc);
#pragma unroll
      for (int l = 0; l < kWords / 4; ++l) {
        const uint4 v = src[l];
        words[4 * l] = v.x;
        words[4 * l + 1] = v.y;
        words[4 * l + 2] = v.z;
        words[4 * l + 3] = v.w;
      }
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
        float pair[2] = {0.f, 0.f};
        if constexpr (sizeof(T) == 4) {
          pair[0] = __uint_as_float(words[w]);
        } else {
          const float2 f = unpack_pair<T>(words[w]);
          pair[0] = f.x;
          pair[1] = f.y;
        }
#pragma unroll
        for (int h = 0; h < kPerWord; ++h) {
          const int idx = w * kPerWord + h;  // element e * W + t
          wt[idx / W][idx % W] = pair[h];
        }
      }
      loaded = true;
    }
  }
  if (!loaded) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
#pragma unroll
      for (int t = 0; t < W; ++t) wt[e][t] = cuda::to_float(weight[(c0 + e) * w_sc + t * w_st]);
    }
  }

  float acc[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
#pragma unroll
  for (int t = 0; t < W; ++t) {
    const int m = W - 1 - t;  // window column t holds the m-th ancestor
    float col[VEC];
    if (m < path_len) {
      cuda::load_pack_float<T, VEC>(x + b * x_sb + chain[m] * x_sn + c0, col);
    } else {
      const int64_t s = state_len - 1 - (m - path_len);  // the committed inputs, newest last
#pragma unroll
      for (int e = 0; e < VEC; ++e) col[e] = cuda::to_float(conv_state[b * cs_sb + (c0 + e) * cs_sc + s * cs_ss]);
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = fmaf(col[e], wt[e][t], acc[e]);
  }
#pragma unroll
  for (int e = 0; e < VEC; ++e) acc[e] = conv_output<T>(acc[e], bias, (c0 + e) * bias_s, silu);
  cuda::store_pack_float<T, VEC>(out + b * o_sb + i * o_sn + c0, acc);
}

template <typename T, int VEC>
void launch_tree_conv1d_vec(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                            const at::Tensor& conv_state, const at::Tensor& parent, bool silu, at::Tensor& out) {
  const int64_t bsz = x.size(0), n = x.size(1), channels = x.size(2), width = weight.size(1);
  const dim3 grid(static_cast<unsigned>(bsz * n), static_cast<unsigned>(cuda::ceil_div(channels, kConvThreads * VEC)));
  const T* bias_ptr = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  // Weight rows [C, W] contiguous and every thread's VEC rows 16-byte aligned (c0 is a multiple of VEC).
  const bool weight_packed = weight.stride(1) == 1 && weight.stride(0) == width &&
                             (VEC * width * static_cast<int64_t>(sizeof(T))) % 16 == 0 &&
                             cuda::is_aligned(weight.data_ptr(), 16);
  const int64_t bias_stride = bias.has_value() ? bias->stride(0) : 0;
  auto launch = [&](auto kernel) {
    cuda::launch_programmatic(
        kernel, grid, dim3(kConvThreads), 0, x.data_ptr<T>(), x.stride(0), x.stride(1), weight.data_ptr<T>(),
        weight.stride(0), weight.stride(1), bias_ptr,
        bias_stride, conv_state.data_ptr<T>(), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        conv_state.size(2), parent.data_ptr<int32_t>(), parent.stride(0), parent.stride(1), static_cast<int>(n),
        channels, silu, weight_packed, out.data_ptr<T>(), out.stride(0), out.stride(1));
      };
  switch (width) {
    case 1: launch(tree_conv1d_kernel<T, VEC, 1>); break;
    case 2: launch(tree_conv1d_kernel<T, VEC, 2>); break;
    case 3: launch(tree_conv1d_kernel<T, VEC, 3>); break;
    default: launch(tree_conv1d_kernel<T, VEC, 4>); break;
  }
}

template <typename T>
void launch_tree_conv1d(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        const at::Tensor& conv_state, const at::Tensor& parent, bool silu, at::Tensor& out) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t channels = x.size(2);
  // 16-byte packs along channels when every node row of x and out starts 16-byte aligned.
  const bool packed = channels % kVec == 0 && x.stride(0) % kVec == 0 && x.stride(1) % kVec == 0 &&
                      out.stride(0) % kVec == 0 && out.stride(1) % kVec == 0 && cuda::is_aligned(x.data_ptr(), 16) &&
                      cuda::is_aligned(out.data_ptr(), 16);
  if (packed) {
    launch_tree_conv1d_vec<T, kVec>(x, weight, bias, conv_state, parent, silu, out);
  } else {
    launch_tree_conv1d_vec<T, 1>(x, weight, bias, conv_state, parent, silu, out);
  }
}

// ==== tree_gated_delta_rule ====================================================================
//
// The parallel form (DESIGN.md §4). Per value head, with G_i the log decay summed along root..i and
// A_ij = beta_i e^{G_i - G_j} (k_i.k_j) for j a strict ancestor of i, the recurrence unrolls to
//   u = T r,  T = (I + A)^{-1},  r_i = beta_i (v_i - e^{G_i} H0^T k_i),
//   o_i = e^{G_i} H0^T q_i + sum_{a = 0..depth(i)} M_i[a] u_{a-th ancestor of i},  M_i[a] = e^{G_i - G_j} (q_i.k_j).
// Row i of T is nonzero on the path root..i only: T_i[a] by ancestor distance a, T_i[0] = 1, and
// T_i[b] = -sum_{a < b} T_i[a] A(P[a], P[b]) for the path P (P[0] = i): a forward substitution along one path,
// independent of every other node's. Two launches; H0 is read once (by the second), no per-node state is formed.
//  1. prep        per (b, key head, chunk of 8 nodes): the key products along the chunk's paths and the query
//                 products with them, G for the group's value heads (stash_cumg), the chunk's normalised keys
//                 (stash_k), and per chunk node (a warp) and value head the rows T_i and M_i into the workspaces
//                 `coef_near` (distances < kCachedDist, zero past the root) and `coef` (the deeper ones);
//                 1/||k_i|| and scale/||q_i|| into `norms`. Two versions: gdn_tree_prep_gram (16-bit inputs and
//                 N <= kGramMaxNodes: S = X X^T of the raw key and query rows on tensor cores, norms from its
//                 diagonal) and gdn_tree_prep (float32, or larger trees: normalised rows, products by FMA).
//  2. gdn_tree_main  per (b, value head, tile of 32 value columns): K H0 and Q H0 on the raw rows (the norms
//                 scale the sums afterwards; on tensor cores in TF32 with H0 split in two parts for 16-bit inputs)
//                 and e^G (the same sums as kernel 1's), then, once kernel 1 is complete, the T, M rows copied
//                 while r is formed from the norms, and u = T r and o: passes in which nodes are independent.
// gdn_tree_prep_gram and gdn_tree_main issue their prologue loads as asynchronous copies: one round trip each.
// Kernel 2 is launched as a programmatic dependent of kernel 1 (Hopper and newer): its loads and products, which
// need nothing kernel 1 writes, overlap kernel 1, and `griddepcontrol.wait` orders its reads of kernel 1's
// outputs after kernel 1's writes. Without that launch attribute the wait is a no-op.
// A tree of one node (autoregressive steps) takes gdn_single_node_kernel instead: one launch, no workspace.
// Exponents are only ever formed as G_i - G_j with j an ancestor of i (<= 0 for log decays <= 0).

constexpr int kPrepNodes = 8;                      // chunk nodes per prep block, a warp each
constexpr int kPrepThreads = kPrepNodes * kWarp;
constexpr int kMainThreads = 288;   // GEMM: 36 node rows x 8 column groups; passes: 9 warps
constexpr int kMainWarps = kMainThreads / kWarp;
constexpr int kTileV = 32;          // value columns per main block
constexpr int kH0Stride = kTileV + 8;  // floats per staged H0 row (see GdnMainLayout)
constexpr int kHalfChunk = 36;      // GEMM thread (rg, cg) owns the chunk's nodes rg and rg + 36
constexpr int kChunkNodes = 2 * kHalfChunk;
constexpr int kCachedDist = 17;     // ancestor distances 0..16 kept in shared memory; deeper ones are recomputed
constexpr int kKkRun = 2;           // key products per prep thread that share one read of the node's row
// Register budgets: two main blocks (2 x 288 x 80, capped) and one 16-bit prep block (gdn_tree_prep_gram, 256 x 64,
// what ptxas allots it: see the -Xptxas -v lines of a build) fit one multiprocessor's 64 K registers together (and, at 27B shapes and
// N <= 65, its shared memory), so every main block is resident from the start and runs its loads and K/Q x H0
// products beside the prep kernel instead of after it. A prep kernel that grows past 64 registers costs speed,
// not correctness.
constexpr int kMainMaxRegisters = 80;

using cuda::allow_dependent_launch;  // kernel 2 is a programmatic dependent of kernel 1
using cuda::wait_for_preceding_grid;

struct GdnShapes {
  int num_nodes, heads, value_heads, kdim, vdim;
  float scale;
  bool l2norm;
};

// Row length of a staged k/q row: >= K, a multiple of 4, (kpad / 4) odd, so float4 reads of rows 2 apart
// fall in distinct banks.
__host__ __device__ inline int staged_row_len(int kdim) {
  const int r = (kdim + 3) / 4 * 4;
  return r % 8 == 0 ? r + 4 : r;
}

// For e = threadIdx.x, + THREADS, ... < total: store(e, load(e)), BATCH loads at a time all issued before the
// first store, so that one round trip to memory serves BATCH elements (a loop that stores each element
// before loading the next waits a full round trip per element). Past the end, the loads repeat element
// total - 1 rather than branch, so the compiler keeps them together; `load` must not branch either.
template <int THREADS, int BATCH, typename Load, typename Store>
__device__ __forceinline__ void batched_copy(int total, Load load, Store store) {
  using Value = decltype(load(0));
  for (int base = threadIdx.x; base < total; base += BATCH * THREADS) {
    Value vals[BATCH];
#pragma unroll
    for (int u = 0; u < BATCH; ++u) vals[u] = load(min(base + u * THREADS, total - 1));
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {
      const int e = base + u * THREADS;
      if (e < total) store(e, vals[u]);
    }
  }
}

// Rows of q and k move as 16-byte packs when PACKED (every row starts 16-byte aligned and K is a multiple of
// the pack), else element by element. A pack travels as raw bits (uint4) and is converted when stored: the
// compiler kept a struct of eight 16-bit elements in local memory, one round trip per pack.
// kPack<T, PACKED>: elements per load.
template <typename T, bool PACKED>
constexpr int kPack = PACKED ? 16 / static_cast<int>(sizeof(T)) : 1;

template <typename T, bool PACKED>
using RowGroup = std::conditional_t<PACKED, uint4, T>;

template <typename T, bool PACKED>
__device__ __forceinline__ RowGroup<T, PACKED> load_group(const T* row, int p) {
  if constexpr (PACKED) {
    return *reinterpret_cast<const uint4*>(row + kPack<T, PACKED> * p);
  } else {
    return row[p];
  }
}

template <typename T, bool PACKED>
__device__ __forceinline__ void store_group(float* row, int p, const RowGroup<T, PACKED>& x) {
  if constexpr (PACKED && sizeof(T) == 4) {
    *reinterpret_cast<float4*>(row + 4 * p) =
        make_float4(__uint_as_float(x.x), __uint_as_float(x.y), __uint_as_float(x.z), __uint_as_float(x.w));
  } else if constexpr (PACKED) {
    const float2 a = unpack_pair<T>(x.x), b = unpack_pair<T>(x.y), c = unpack_pair<T>(x.z), d = unpack_pair<T>(x.w);
    *reinterpret_cast<float4*>(row + 8 * p) = make_float4(a.x, a.y, b.x, b.y);
    *reinterpret_cast<float4*>(row + 8 * p + 4) = make_float4(c.x, c.y, d.x, d.y);
  } else {
    row[p] = cuda::to_float(x);
  }
}

// e -> (e / groups, e % groups) for the copy loops without a division or a branch: e / groups =
// umulhi(e, mul) >> shift with mul = ceil(2^(31 + l) / groups), l = ceil(log2 groups), exact for e < 2^31.
struct RowSplit {
  int groups, shift;
  unsigned mul;
  __device__ explicit RowSplit(int g) : groups(g) {
    int l = 0;
    while ((1 << l) < g) ++l;
    shift = l > 0 ? l - 1 : 0;
    mul = g > 1 ? static_cast<unsigned>(((1ull << (31 + l)) + g - 1) / g) : 0u;
  }
  __device__ int row(int e) const {
    return groups > 1 ? static_cast<int>(__umulhi(static_cast<unsigned>(e), mul) >> shift) : e;
  }
  __device__ int col(int e) const { return e - row(e) * groups; }
};

// Normalises a staged row in place (x * inv, times `scale` for a query) and returns the factor that takes the
// raw row's products to the normalised row's: inv (keys) or inv * scale (queries), inv = 1 without l2norm.
__device__ __forceinline__ float normalise_staged_row(float* row, int kdim, int lane, bool l2norm, float scale) {
  const float inv = l2norm ? cuda::inv_l2_norm(cuda::warp_sum_squares(row, kdim, lane), kL2NormEps) : 1.f;
  for (int e = lane; e < kdim; e += kWarp) row[e] = (row[e] * inv) * scale;
  return inv * scale;
}

// x.y over staged rows, four partial sums for a short dependency chain.
template <bool PACKED>
__device__ __forceinline__ float dot_rows(const float* x, const float* y, int kdim) {
  if constexpr (PACKED) {  // K is a multiple of 4 and staged rows are 16-byte aligned
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int e = 0; e < kdim; e += 4) {
      const float4 a = *reinterpret_cast<const float4*>(x + e);
      const float4 c = *reinterpret_cast<const float4*>(y + e);
      acc.x = fmaf(a.x, c.x, acc.x);
      acc.y = fmaf(a.y, c.y, acc.y);
      acc.z = fmaf(a.z, c.z, acc.z);
      acc.w = fmaf(a.w, c.w, acc.w);
    }
    return (acc.x + acc.y) + (acc.z + acc.w);
  } else {
    float acc = 0.f;
#pragma unroll 8
    for (int e = 0; e < kdim; ++e) acc = fmaf(x[e], y[e], acc);
    return acc;
  }
}

// x.y_r for RUN rows y_r, each summed exactly as dot_rows sums it (the same bits), x read once for all of them.
template <bool PACKED, int RUN>
__device__ __forceinline__ void dot_rows_run(const float* x, const float* const (&ys)[RUN], int kdim,
                                             float (&out)[RUN]) {
  if constexpr (PACKED) {
    float4 acc[RUN];
#pragma unroll
    for (int r = 0; r < RUN; ++r) acc[r] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 2
    for (int e = 0; e < kdim; e += 4) {
      const float4 a = *reinterpret_cast<const float4*>(x + e);
#pragma unroll
      for (int r = 0; r < RUN; ++r) {
        const float4 c = *reinterpret_cast<const float4*>(ys[r] + e);
        acc[r].x = fmaf(a.x, c.x, acc[r].x);
        acc[r].y = fmaf(a.y, c.y, acc[r].y);
        acc[r].z = fmaf(a.z, c.z, acc[r].z);
        acc[r].w = fmaf(a.w, c.w, acc[r].w);
      }
    }
#pragma unroll
    for (int r = 0; r < RUN; ++r) out[r] = (acc[r].x + acc[r].y) + (acc[r].z + acc[r].w);
  } else {
    float acc[RUN] = {};
#pragma unroll 4
    for (int e = 0; e < kdim; ++e) {
      const float a = x[e];
#pragma unroll
      for (int r = 0; r < RUN; ++r) acc[r] = fmaf(a, ys[r][e], acc[r]);
    }
#pragma unroll
    for (int r = 0; r < RUN; ++r) out[r] = acc[r];
  }
}

// A node's first kCachedDist ancestors (anc[a]: the a-th; past the root the node itself) and its depth, from one
// walk up the parent table. root_first_sum adds a per-node value (the log decay) over root..i, root first, as the
// recurrence accumulates G: every GDN tree kernel sums G through it, so all get the same bits.
struct NodePath {
  int anc[kCachedDist];
  int depth;
  int first_deep;  // the kCachedDist-th ancestor, or -1

  __device__ __forceinline__ NodePath(int i, const int* par) {
    int j = i, d = 0;
#pragma unroll
    for (int a = 0; a < kCachedDist; ++a) {
      if (j >= 0) d = a;
      anc[a] = j >= 0 ? j : i;
      j = j >= 0 ? par[j] : -1;
    }
    first_deep = j;
    for (; j >= 0; j = par[j]) ++d;
    depth = d;
  }

  template <typename Value>
  __device__ __forceinline__ float root_first_sum(const int* par, Value value) const {
    float acc = 0.f;
    for (int a = depth; a >= kCachedDist; --a) {  // paths deeper than 16 only
      int j = first_deep;
      for (int s = kCachedDist; s < a; ++s) j = par[j];
      acc += value(j);
    }
#pragma unroll
    for (int a = kCachedDist - 1; a >= 0; --a) {
      if (a <= depth) acc += value(anc[a]);
    }
    return acc;
  }
};

// Byte offsets of consecutive shared-memory regions, each starting 16-byte aligned (the layouts below).
struct SmemPlan {
  size_t off = 0;
  size_t take(size_t bytes) {
    const size_t at = off;
    off += (bytes + 15) / 16 * 16;
    return at;
  }
};

// Shared-memory plan of gdn_tree_prep (byte offsets), sized from N, K and the value heads per key head.
struct GdnPrepLayout {
  int kpad;
  size_t krows, qrows, par, dep, on_path, anc, kk, graw, gcum, beta, qk, trow, path, total;

  GdnPrepLayout(int n, int kdim, int group) {
    kpad = staged_row_len(kdim);
    SmemPlan plan;
    krows = plan.take(sizeof(float) * n * kpad);            // keys of nodes 0..rows-1, normalised where on a path
    qrows = plan.take(sizeof(float) * kPrepNodes * kpad);   // the chunk's scaled, normalised queries
    par = plan.take(sizeof(int) * n);
    dep = plan.take(sizeof(int) * n);
    on_path = plan.take(sizeof(int) * n);                   // 1 when some chunk path holds the node
    anc = plan.take(sizeof(int) * n * kCachedDist);         // anc[m][a]: a-th ancestor of an on-path node m
    kk = plan.take(sizeof(float) * n * kCachedDist);        // kk[m][a] = k_m . k_{anc[m][a]}, a >= 1
    graw = plan.take(sizeof(float) * n * group);            // log decays of h's value heads
    gcum = plan.take(sizeof(float) * n * group);            // G of on-path nodes
    beta = plan.take(sizeof(float) * n * group);
    qk = plan.take(sizeof(float) * kPrepNodes * n);         // qk[t][a] = q_i . k_{a-th ancestor of i}, i = chunk node t
    trow = plan.take(sizeof(float) * kPrepNodes * n);       // a row of T being solved (paths longer than a warp)
    path = plan.take(sizeof(int) * kPrepNodes * n);         // path[t][a] = a-th ancestor of chunk node t
    total = plan.off;
  }
};

// 80-111 registers on sm_90a (float32 inputs and trees past kGramMaxNodes: outside the budget of kMainMaxRegisters)
template <typename T, bool PACKED>
__global__ void __launch_bounds__(kPrepThreads) gdn_tree_prep_kernel(
    GdnShapes sh, GdnPrepLayout lay, const T* __restrict__ q, int64_t q_sb, int64_t q_sn, int64_t q_sh,
    const T* __restrict__ k, int64_t k_sb, int64_t k_sn, int64_t k_sh, const float* __restrict__ g, int64_t g_sb,
    int64_t g_sn, int64_t g_sh, const float* __restrict__ beta, int64_t be_sb, int64_t be_sn, int64_t be_sh,
    const int32_t* __restrict__ parent, int64_t pa_sb, int64_t pa_sn, float* __restrict__ stash_k, int64_t sk_sb,
    int64_t sk_sn, int64_t sk_sh, float* __restrict__ stash_cumg, int64_t cg_sb, int64_t cg_sn, int64_t cg_sh,
    float2* __restrict__ coef_near, float2* __restrict__ coef, float2* __restrict__ norms) {
  allow_dependent_launch();  // kernel 2 reads nothing of ours before its wait
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int n = sh.num_nodes, kdim = sh.kdim, kpad = lay.kpad;
  const int group = sh.value_heads / sh.heads;
  const int c0 = blockIdx.x * kPrepNodes, h = blockIdx.y, b = blockIdx.z;
  const int count = min(kPrepNodes, n - c0);
  const int rows = c0 + count;  // nodes 0..rows-1 can lie on the chunk's paths
  float* krows = reinterpret_cast<float*>(smem_raw + lay.krows);
  float* qrows = reinterpret_cast<float*>(smem_raw + lay.qrows);
  int* par = reinterpret_cast<int*>(smem_raw + lay.par);
  int* dep = reinterpret_cast<int*>(smem_raw + lay.dep);
  int* on_path = reinterpret_cast<int*>(smem_raw + lay.on_path);
  int* anc = reinterpret_cast<int*>(smem_raw + lay.anc);
  float* kk = reinterpret_cast<float*>(smem_raw + lay.kk);
  float* graw = reinterpret_cast<float*>(smem_raw + lay.graw);
  float* gcum = reinterpret_cast<float*>(smem_raw + lay.gcum);
  float* beta_s = reinterpret_cast<float*>(smem_raw + lay.beta);
  float* qk = reinterpret_cast<float*>(smem_raw + lay.qk);
  float* trow = reinterpret_cast<float*>(smem_raw + lay.trow);
  int* path = reinterpret_cast<int*>(smem_raw + lay.path);
  __shared__ int path_len[kPrepNodes];
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;

  // ---- every load at once: the tree, the log decays and betas, the keys of all nodes up to the chunk's end
  // (those off the chunk's paths are not used, but loading them does not wait for the paths) ----
  for (int j = tid; j < rows; j += kPrepThreads) {
    par[j] = cuda::checked_parent(parent[b * pa_sb + j * pa_sn], j);
    on_path[j] = 0;
  }
  batched_copy<kPrepThreads, 4>(
      rows * group,
      [&](int e) {
        const int j = e / group, hv = h * group + e % group;
        return make_float2(g[b * g_sb + j * g_sn + hv * g_sh], beta[b * be_sb + j * be_sn + hv * be_sh]);
      },
      [&](int e, float2 x) {
        graw[e] = x.x;
        beta_s[e] = x.y;
      });
  // Rows 0..rows-1: keys of nodes 0..rows-1; rows rows..rows+count-1: the chunk's queries.
  const RowSplit split(kdim / kPack<T, PACKED>);
  const T* k_base = k + b * k_sb + h * k_sh;
  const T* q_base = q + b * q_sb + h * q_sh;
  batched_copy<kPrepThreads, 8>(
      (rows + count) * split.groups,
      [&](int e) {
        const int r = split.row(e);
        const T* row = r < rows ? k_base + r * k_sn : q_base + (c0 + r - rows) * q_sn;
        return load_group<T, PACKED>(row, split.col(e));
      },
      [&](int e, const RowGroup<T, PACKED>& x) {
        const int r = split.row(e);
        store_group<T, PACKED>(r < rows ? krows + r * kpad : qrows + (r - rows) * kpad, split.col(e), x);
      });
  __syncthreads();

  // ---- the chunk's paths ----
  if (tid < count) {
    int len = 0;
    for (int j = c0 + tid; j >= 0; j = par[j]) {
      path[tid * n + len++] = j;
      on_path[j] = 1;
    }
    path_len[tid] = len;
  }
  __syncthreads();

  // ---- normalised keys (a warp per on-path row); depth and the first ancestors of on-path nodes ----
  for (int m = warp; m < rows; m += kPrepNodes) {
    if (!on_path[m]) continue;
    float* row = krows + m * kpad;
    const float inv = normalise_staged_row(row, kdim, lane, sh.l2norm, 1.f);
    __syncwarp();
    if (m >= c0) {
      for (int e = lane; e < kdim; e += kWarp) stash_k[b * sk_sb + m * sk_sn + h * sk_sh + e] = row[e];
      if (lane == 0) norms[(static_cast<int64_t>(b) * sh.heads + h) * n + m].x = inv;
    }
  }
  for (int m = tid; m < rows; m += kPrepThreads) {
    if (!on_path[m]) continue;
    int j = m, d = 0;
    for (int a = 0; a < kCachedDist; ++a) {
      anc[m * kCachedDist + a] = j;
      if (j >= 0) j = par[j];
    }
    for (j = par[m]; j >= 0; j = par[j]) ++d;
    dep[m] = d;
  }
  __syncthreads();

  // ---- dot products: the chunk's queries with their paths (a warp per chunk node), the on-path keys with
  // their first ancestors (a thread per pair), and G (a thread per on-path node and value head) ----
  if (warp < count) {
    const int i = c0 + warp;
    float* qrow = qrows + warp * kpad;
    const float factor = normalise_staged_row(qrow, kdim, lane, sh.l2norm, sh.scale);
    __syncwarp();
    if (lane == 0) norms[(static_cast<int64_t>(b) * sh.heads + h) * n + i].y = factor;
    for (int a = lane; a < path_len[warp]; a += kWarp) {
      qk[warp * n + a] = dot_rows<PACKED>(qrow, krows + path[warp * n + a] * kpad, kdim);
    }
  }
  // kk: a thread per on-path node and run of kKkRun ancestor distances, so that each read of the node's row
  // serves kKkRun products (one product per thread read both rows for each: shared-memory bandwidth bound).
  constexpr int kKkRuns = (kCachedDist - 1) / kKkRun;
  for (int e = tid; e < rows * kKkRuns; e += kPrepThreads) {
    const int m = e / kKkRuns, a0 = 1 + kKkRun * (e % kKkRuns);
    if (!on_path[m] || a0 > dep[m]) continue;
    const float* ys[kKkRun];
#pragma unroll
    for (int r = 0; r < kKkRun; ++r) {
      const int a = a0 + r;
      ys[r] = krows + (a <= dep[m] ? anc[m * kCachedDist + a] : m) * kpad;  // past the root: a dummy row
    }
    float dots[kKkRun];
    dot_rows_run<PACKED, kKkRun>(krows + m * kpad, ys, kdim, dots);
#pragma unroll
    for (int r = 0; r < kKkRun; ++r) {
      if (a0 + r <= dep[m]) kk[m * kCachedDist + a0 + r] = dots[r];
    }
  }
  for (int e = tid; e < rows * group; e += kPrepThreads) {
    const int m = e / group, gi = e % group;
    if (on_path[m]) gcum[e] = NodePath(m, par).root_first_sum(par, [&](int j) { return graw[j * group + gi]; });
  }
  __syncthreads();

  // ---- rows of T and M, a warp per chunk node, value head by value head ----
  if (warp >= count) return;
  const int t = warp, i = c0 + t, len = path_len[t];
  const int* p = path + t * n;
  // kk of path nodes P[a] and P[b] (b > a): cached for distances < kCachedDist, else recomputed (deep paths).
  auto path_kk = [&](int pa, int pb, int dist) {
    return dist < kCachedDist ? kk[pa * kCachedDist + dist] : dot_rows<PACKED>(krows + pa * kpad, krows + pb * kpad, kdim);
  };
  for (int gi = 0; gi < group; ++gi) {
    const int hv = h * group + gi;
    const float gi_cum = gcum[i * group + gi];
    const int64_t row = (static_cast<int64_t>(b) * sh.value_heads + hv) * n + i;
    float2* near_row = coef_near + row * kCachedDist;  // distances < kCachedDist, zero past the root
    float2* coef_row = coef + row * n;                 // the deeper ones
    if (len <= kCachedDist) {
      // Lane b holds T_i[b]. The weights A(P[a], P[b]) do not depend on T: all 16 first, then the substitution
      // is a chain of shuffles and FMAs only. Lanes past the path (and a >= b) get weight 0.
      const int pb = p[lane < len ? lane : 0];
      const float gb = gcum[pb * group + gi];
      float w[kCachedDist - 1];
#pragma unroll
      for (int a = 0; a < kCachedDist - 1; ++a) {
        const int pa = __shfl_sync(cuda::kFullMask, pb, a);
        const float ga = __shfl_sync(cuda::kFullMask, gb, a);
        const bool live = lane > a && lane < len;
        const int dist = live ? lane - a : 1;
        const float wa = beta_s[pa * group + gi] * expf(ga - gb) * kk[pa * kCachedDist + dist];
        w[a] = live ? wa : 0.f;
      }
      float tb = lane == 0 ? 1.f : 0.f;
#pragma unroll
      for (int a = 0; a < kCachedDist - 1; ++a) tb = fmaf(-__shfl_sync(cuda::kFullMask, tb, a), w[a], tb);
      if (lane < kCachedDist) {
        near_row[lane] = lane < len ? make_float2(tb, expf(gi_cum - gb) * qk[t * n + lane]) : make_float2(0.f, 0.f);
      }
    } else {
      float* tr = trow + t * n;
      for (int c = lane; c < len; c += kWarp) tr[c] = c == 0 ? 1.f : 0.f;
      __syncwarp();
      for (int a = 0; a + 1 < len; ++a) {
        const float ta = tr[a];
        const int pa = p[a];
        const float ga = gcum[pa * group + gi], ba = beta_s[pa * group + gi];
        for (int c = a + 1 + lane; c < len; c += kWarp) {
          const int pc = p[c];
          const float w = ba * expf(ga - gcum[pc * group + gi]) * path_kk(pa, pc, c - a);
          tr[c] = fmaf(-ta, w, tr[c]);
        }
        __syncwarp();
      }
      for (int c = lane; c < len; c += kWarp) {  // len > kCachedDist: no zeros to write
        (c < kCachedDist ? near_row : coef_row)[c] =
            make_float2(tr[c], expf(gi_cum - gcum[p[c] * group + gi]) * qk[t * n + c]);
      }
      __syncwarp();  // tr is rewritten for the next value head
    }
    if (lane == 0) stash_cumg[b * cg_sb + i * cg_sn + hv * cg_sh] = gi_cum;
  }
}

// ---- the prep kernel for 16-bit inputs and N <= kGramMaxNodes: key products on tensor cores ----
// Same outputs and launch shape as gdn_tree_prep_kernel. The raw key rows 0..rows-1 and the chunk's raw query rows
// are staged as they are (X, 16-bit) and S = X X^T is formed on tensor cores (bf16/fp16 products are exact, their
// sums float32): S holds every key and query product and, on its diagonal, the squared norms. A
// normalised product is then a raw one times two inverse norms, so no row is normalised and no product recomputed
// for deep paths. The T-row solves step all value heads of a batch together, each weight formed where it is
// used: kGramSolveHeads independent shuffle-and-FMA chains per warp instead of one.

constexpr int kGramMaxNodes = 96;   // S takes 4 (N + 8)^2 bytes of shared memory
constexpr int kGramSolveHeads = 3;  // value heads a warp solves at once (Qwen3.5/3.6: 3 per key head)

struct GdnGramLayout {
  int kdepth;   // the MMA depth: K rounded up to 16 (staged columns K..kdepth are zero)
  int kstride;  // staged row length in elements: kdepth + 8
  int sstride;  // row length of S: N + kPrepNodes
  size_t x, s, kinv, par, graw, gcum, beta, path, trow, total;

  // A staged row takes kdepth + 8 elements, kstride / 2 = 4 (mod 8) words: the 8 rows x 4 consecutive words of
  // an MMA fragment fall in 32 distinct banks.
  GdnGramLayout(int n, int kdim, int group) {
    kdepth = (kdim + 15) / 16 * 16;
    kstride = kdepth + 8;
    sstride = n + kPrepNodes;
    const int xrows = (n + kPrepNodes + 15) / 16 * 16;  // whole MMA row tiles
    SmemPlan plan;
    x = plan.take(sizeof(uint16_t) * xrows * kstride);
    s = plan.take(sizeof(float) * sstride * sstride);
    kinv = plan.take(sizeof(float) * sstride);            // 1/||k|| of key rows, scale/||q|| of query rows
    par = plan.take(sizeof(int) * n);
    graw = plan.take(sizeof(float) * n * group);
    gcum = plan.take(sizeof(float) * n * group);
    beta = plan.take(sizeof(float) * n * group);
    path = plan.take(sizeof(int) * kPrepNodes * n);
    trow = plan.take(sizeof(float) * kPrepNodes * kGramSolveHeads * n);  // finished T entries, paths longer than a warp
    total = plan.off;
  }
};

template <typename T, bool PACKED>
__global__ void __launch_bounds__(kPrepThreads) gdn_tree_prep_gram_kernel(
    GdnShapes sh, GdnGramLayout lay, const T* __restrict__ q, int64_t q_sb, int64_t q_sn, int64_t q_sh,
    const T* __restrict__ k, int64_t k_sb, int64_t k_sn, int64_t k_sh, const float* __restrict__ g, int64_t g_sb,
    int64_t g_sn, int64_t g_sh, const float* __restrict__ beta, int64_t be_sb, int64_t be_sn, int64_t be_sh,
    const int32_t* __restrict__ parent, int64_t pa_sb, int64_t pa_sn, float* __restrict__ stash_k, int64_t sk_sb,
    int64_t sk_sn, int64_t sk_sh, float* __restrict__ stash_cumg, int64_t cg_sb, int64_t cg_sn, int64_t cg_sh,
    float2* __restrict__ coef_near, float2* __restrict__ coef, float2* __restrict__ norms) {
  static_assert(sizeof(T) == 2, "the tensor-core prep kernel takes 16-bit inputs");
  allow_dependent_launch();  // kernel 2 reads nothing of ours before its wait
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int n = sh.num_nodes, kdim = sh.kdim, ks = lay.kstride, ss = lay.sstride;
  const int group = sh.value_heads / sh.heads;
  const int c0 = blockIdx.x * kPrepNodes, h = blockIdx.y, b = blockIdx.z;
  const int count = min(kPrepNodes, n - c0);
  const int rows = c0 + count;       // key rows 0..rows-1 can lie on the chunk's paths
  const int xrows = rows + count;    // then the chunk's queries
  const int xtiles = (xrows + 15) / 16;
  T* x = reinterpret_cast<T*>(smem_raw + lay.x);
  float* s = reinterpret_cast<float*>(smem_raw + lay.s);
  float* kinv = reinterpret_cast<float*>(smem_raw + lay.kinv);
  int* par = reinterpret_cast<int*>(smem_raw + lay.par);
  float* graw = reinterpret_cast<float*>(smem_raw + lay.graw);
  float* gcum = reinterpret_cast<float*>(smem_raw + lay.gcum);
  float* beta_s = reinterpret_cast<float*>(smem_raw + lay.beta);
  int* path = reinterpret_cast<int*>(smem_raw + lay.path);
  float* trow = reinterpret_cast<float*>(smem_raw + lay.trow);
  __shared__ int path_len[kPrepNodes];
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;

  // ---- every load at once, as asynchronous copies (one round trip to memory): the tree, the log decays and
  // betas, the raw key and query rows; zero padding ----
  for (int j = tid; j < rows; j += kPrepThreads) cuda::copy_async<4>(par + j, parent + b * pa_sb + j * pa_sn);
  const RowSplit by_head(group);
  for (int e = tid; e < rows * group; e += kPrepThreads) {
    const int j = by_head.row(e), hv = h * group + by_head.col(e);
    cuda::copy_async<4>(graw + e, g + b * g_sb + j * g_sn + hv * g_sh);
    cuda::copy_async<4>(beta_s + e, beta + b * be_sb + j * be_sn + hv * be_sh);
  }
  const RowSplit split(kdim / kPack<T, PACKED>);
  const T* k_base = k + b * k_sb + h * k_sh;
  const T* q_base = q + b * q_sb + h * q_sh;
  auto x_source = [&](int r) { return r < rows ? k_base + r * k_sn : q_base + (c0 + r - rows) * q_sn; };
  if constexpr (PACKED) {
    for (int e = tid; e < xrows * split.groups; e += kPrepThreads) {
      const int r = split.row(e), c = kPack<T, PACKED> * split.col(e);
      cuda::copy_async<16>(x + r * ks + c, x_source(r) + c);
    }
  } else {  // element by element (2 bytes: too small for an asynchronous copy)
    batched_copy<kPrepThreads, 8>(
        xrows * split.groups, [&](int e) { return load_group<T, PACKED>(x_source(split.row(e)), split.col(e)); },
        [&](int e, const RowGroup<T, PACKED>& v) { x[split.row(e) * ks + split.col(e)] = v; });
  }
  // Columns K..kdepth of the staged rows and the rows past them up to a whole tile take part in the products:
  // zero (the padding rows' products are never read, but are kept finite).
  const int pad_cols = lay.kdepth - kdim;
  for (int e = tid; e < xrows * pad_cols; e += kPrepThreads) {
    x[(e / pad_cols) * ks + kdim + e % pad_cols] = cuda::from_float<T>(0.f);
  }
  {  // the padding rows are contiguous, and a staged row is a whole number of 16-byte words
    uint4* pad_rows = reinterpret_cast<uint4*>(x + xrows * ks);
    const int words = (16 * xtiles - xrows) * ks * static_cast<int>(sizeof(T)) / 16;
    for (int e = tid; e < words; e += kPrepThreads) pad_rows[e] = make_uint4(0u, 0u, 0u, 0u);
  }
  cuda::wait_async_copies();
  for (int j = tid; j < rows; j += kPrepThreads) par[j] = cuda::checked_parent(par[j], j);  // this thread's copies
  __syncthreads();

  // ---- three independent jobs: the chunk's paths (a thread per chunk node), G of every row for each value
  // head (a thread per row), S = X X^T on and below the diagonal (a warp per 16x8 tile) ----
  // Balance: G takes the first threads, the paths warp 3's, and the tiles go to warps 7, 6, ... first.
  constexpr int kPathWarp = 3;
  if (warp == kPathWarp && lane < count) {
    int len = 0;
    for (int j = c0 + lane; j >= 0; j = par[j]) path[lane * n + len++] = j;
    path_len[lane] = len;
  }
  for (int m = tid; m < rows; m += kPrepThreads) {
    const NodePath np(m, par);
    for (int gi = 0; gi < group; ++gi) {
      gcum[m * group + gi] = np.root_first_sum(par, [&](int j) { return graw[j * group + gi]; });
    }
  }
  {
    // Fragments as in the PTX ISA's m16n8k16 layout: lane (gid, tig) holds rows gid and gid + 8 of the 16x16 tile
    // (columns 2 tig, 2 tig + 1 and those + 8) and row gid of the 8 columns' tile (the same columns).
    const int gid = lane / 4, tig = lane % 4;
    const uint32_t* xw = reinterpret_cast<const uint32_t*>(x);
    const int ws = ks / 2;  // words per staged row
    const int col_tiles = (xrows + 7) / 8;
    int task = 0;
    for (int rt = 0; rt < xtiles; ++rt) {
      const int last = min(col_tiles, 2 * rt + 2);  // tiles reaching the diagonal
      for (int ct = 0; ct < last; ++ct, ++task) {
        if (task % kPrepNodes != kPrepNodes - 1 - warp) continue;
        const uint32_t* arow0 = xw + (16 * rt + gid) * ws + tig;
        const uint32_t* arow1 = arow0 + 8 * ws;
        const uint32_t* brow = xw + (8 * ct + gid) * ws + tig;
        float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
        for (int kw = 0; kw < lay.kdepth / 2; kw += 8) {
          const uint32_t a[4] = {arow0[kw], arow1[kw], arow0[kw + 4], arow1[kw + 4]};
          const uint32_t bb[2] = {brow[kw], brow[kw + 4]};
          cuda::mma_16x8x16<T>(d, a, bb);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 16 * rt + gid + 8 * (e / 2), c = 8 * ct + 2 * tig + e % 2;
          if (r >= xrows || c > r) continue;
          s[r * ss + c] = d[e];
          if (c == r) {  // the squared norm: 1/||k|| of a key row, scale/||q|| of a query row
            const float inv = sh.l2norm ? cuda::inv_l2_norm(d[e], kL2NormEps) : 1.f;
            kinv[r] = r < rows ? inv : inv * sh.scale;
          }
        }
      }
    }
  }
  __syncthreads();

  // ---- per chunk node (a warp): its norms and normalised key, then the rows T_i and M_i of each value head ----
  if (warp >= count) return;
  const int t = warp, i = c0 + t, len = path_len[t];
  const int* p = path + t * n;
  const float ki = kinv[i], qf = kinv[rows + t];
  if (lane == 0) norms[(static_cast<int64_t>(b) * sh.heads + h) * n + i] = make_float2(ki, qf);
  for (int e = lane; e < kdim; e += kWarp) {
    stash_k[b * sk_sb + i * sk_sn + h * sk_sh + e] = cuda::to_float(x[i * ks + e]) * ki;
  }
  const float* s_query = s + (rows + t) * ss;
  float* tr = trow + t * kGramSolveHeads * n;
  for (int g0 = 0; g0 < group; g0 += kGramSolveHeads) {
    // Heads past the group repeat the last one and store nothing.
    int hs[kGramSolveHeads];
#pragma unroll
    for (int u = 0; u < kGramSolveHeads; ++u) hs[u] = min(g0 + u, group - 1);
    float gi_cum[kGramSolveHeads];
#pragma unroll
    for (int u = 0; u < kGramSolveHeads; ++u) gi_cum[u] = gcum[i * group + hs[u]];
    // Lane l holds T_i[cb + l]: T_i[b] = -sum_{a < b} T_i[a] A(P[a], P[b]), A(P[a], P[b]) = beta_{P[a]}
    // e^{G_{P[a]} - G_{P[b]}} k_{P[a]}.k_{P[b]}. Step a adds term a to every lane; lane a - cb is then complete
    // and passes T_i[a] on by a shuffle (entries of earlier blocks of 32 come from tr).
    for (int cb = 0; cb < len; cb += kWarp) {
      const int bi = cb + lane;
      const bool live = bi < len;
      const int pb = p[live ? bi : 0];
      const float kb = kinv[pb];
      float gb[kGramSolveHeads], tb[kGramSolveHeads];
#pragma unroll
      for (int u = 0; u < kGramSolveHeads; ++u) {
        gb[u] = gcum[pb * group + hs[u]];
        tb[u] = bi == 0 ? 1.f : 0.f;
      }
      // Term a: T_i[a] (t_a(u) for the batch's head u) times the weight A(P[a], P[b]). Lanes without the term
      // (a >= b, or past the path) get weight 0 by arithmetic, not a branch (the compiler turned a select into
      // one, which made every weight wait for the previous one): a mask of 0 zeroes their product, read from S
      // at a written entry, and their exponent, so everything stays finite.
      auto add_term = [&](int a, auto t_a) {
        const int pa = p[a];
        const float mask = live && a < bi ? 1.f : 0.f;
        const float kk = ((s[max(pa, pb) * ss + min(pa, pb)] * kinv[pa]) * kb) * mask;  // pa > pb for a term
#pragma unroll
        for (int u = 0; u < kGramSolveHeads; ++u) {
          const float w = beta_s[pa * group + hs[u]] * expf((gcum[pa * group + hs[u]] - gb[u]) * mask) * kk;
          tb[u] = fmaf(-t_a(u), w, tb[u]);
        }
      };
      for (int a = 0; a < cb; ++a) add_term(a, [&](int u) { return tr[u * n + a]; });  // earlier blocks of 32
      const int a_end = min(cb + kWarp, len) - 1;
#pragma unroll 4
      for (int a = cb; a < a_end; ++a) add_term(a, [&](int u) { return __shfl_sync(cuda::kFullMask, tb[u], a - cb); });
      // Distances < kCachedDist go to the compact rows (zero past the root), the deeper ones to the full rows.
      const float qk = (s_query[pb] * qf) * kb;
#pragma unroll
      for (int u = 0; u < kGramSolveHeads; ++u) {
        if (g0 + u >= group) continue;
        const int64_t row = (static_cast<int64_t>(b) * sh.value_heads + h * group + g0 + u) * n + i;
        const float2 c = live ? make_float2(tb[u], expf(gi_cum[u] - gb[u]) * qk) : make_float2(0.f, 0.f);
        if (bi < kCachedDist) {
          coef_near[row * kCachedDist + bi] = c;
        } else if (live) {
          coef[row * n + bi] = c;
        }
        if (live && len > kWarp) tr[u * n + bi] = tb[u];
      }
      __syncwarp();
    }
    if (lane < kGramSolveHeads && g0 + lane < group) {
      stash_cumg[b * cg_sb + i * cg_sn + (h * group + g0 + lane) * cg_sh] = gcum[i * group + g0 + lane];
    }
    __syncwarp();  // tr is rewritten for the next batch of heads
  }
}

// One term of a node's path sums in gdn_tree_main, read with one 16-byte load: T_i[a], M_i[a] (first: the prep
// kernel's compact rows land there by 8-byte asynchronous copies) and the row (times kTileV) of its a-th ancestor.
// Distances past the root point at the node's own row with zero coefficients.
struct alignas(16) PathTerm {
  float t, m;
  int row;
  int unused;
};

// Shared-memory plan of gdn_tree_main (byte offsets), sized from N and K at launch.
struct GdnMainLayout {
  int kpad;   // staged row length in elements of the input type: see the constructor
  int krows;  // the GEMM's depth: K rounded up to 8 (rows of the H0 tile; staged rows are zero beyond K)
  int chunk;  // nodes per GEMM chunk: min(N, 72)
  size_t h0, stage, kh, qh, vt, graw, decay, beta, parent, depth, total;

  // Staged k/q rows keep the input's type (16-bit inputs: half the shared memory, so that two main blocks fit
  // on a multiprocessor beside a prep block). A row takes K rounded up to 8 elements, then to 16 bytes, plus 16
  // bytes when that is a multiple of 32: rows two apart then start 32 or 96 bytes apart modulo 128 (the float
  // GEMM's four row groups read distinct banks), and the tensor-core fragments' 8 rows x 4 elements as well.
  // H0 rows are kH0Stride floats apart: a fragment's 4 rows x 8 columns fall in 32 distinct banks.
  GdnMainLayout(int n, int kdim, int elem_bytes) {
    krows = (kdim + 7) / 8 * 8;
    int row_bytes = (krows * elem_bytes + 15) / 16 * 16;
    if (row_bytes % 32 == 0) row_bytes += 16;
    kpad = row_bytes / elem_bytes;
    chunk = n < kChunkNodes ? n : kChunkNodes;
    SmemPlan plan;
    h0 = plan.take(sizeof(float) * krows * kH0Stride);
    // The staged k/q rows of a chunk and, after the GEMM, the table of ancestors and coefficients share one region.
    const size_t staging = static_cast<size_t>(elem_bytes) * 2 * chunk * kpad;
    const size_t coeffs = sizeof(PathTerm) * static_cast<size_t>(n) * kCachedDist;
    stage = plan.take(staging > coeffs ? staging : coeffs);
    kh = plan.take(sizeof(float) * n * kTileV);
    qh = plan.take(sizeof(float) * n * kTileV);
    vt = plan.take(sizeof(float) * n * kTileV);
    graw = plan.take(sizeof(float) * n);
    decay = plan.take(sizeof(float) * n);
    beta = plan.take(sizeof(float) * n);
    parent = plan.take(sizeof(int) * n);
    depth = plan.take(sizeof(int) * n);
    total = plan.off;
  }
};

// KH and QH of one chunk for float32 inputs: thread (rg, cg) accumulates staged rows 2 rg, 2 rg + 1 (key and query of
// chunk node rg) and 2 rg + 72, 2 rg + 73 (node rg + 36) against H0 columns 4 cg .. 4 cg + 3. The 4 row groups of
// a warp read rows 2 apart (distinct banks, see GdnMainLayout); its 8 column groups read one 128-byte H0 row.
// HALF skips node rg + 36 (chunks of <= 36 nodes); a missing node's rows are read from row 0 and its sums dropped.
template <bool HALF>
__device__ __forceinline__ void node_pair_gemm(const float* stage, int kpad, int nodes, const float* h0, int krows,
                                               int rg, int cg, float (&acc)[4][4]) {
  const float* row[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int node = rg + kHalfChunk * (m / 2);
    row[m] = node < nodes ? stage + (2 * node + m % 2) * kpad : stage;
  }
#pragma unroll 2
  for (int k0 = 0; k0 < krows; k0 += 4) {
    float4 a[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      if (HALF && m >= 2) continue;
      a[m] = *reinterpret_cast<const float4*>(row[m] + k0);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float4 hb = *reinterpret_cast<const float4*>(h0 + (k0 + e) * kH0Stride + 4 * cg);
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        if (HALF && m >= 2) continue;
        const float ae = e == 0 ? a[m].x : e == 1 ? a[m].y : e == 2 ? a[m].z : a[m].w;
        acc[m][0] = fmaf(ae, hb.x, acc[m][0]);
        acc[m][1] = fmaf(ae, hb.y, acc[m][1]);
        acc[m][2] = fmaf(ae, hb.z, acc[m][2]);
        acc[m][3] = fmaf(ae, hb.w, acc[m][3]);
      }
    }
  }
}

// The TF32 bits of a 16-bit element (exact: bf16 and fp16 mantissas fit TF32's 10 bits).
template <typename T>
__device__ __forceinline__ uint32_t tf32_of_16bit(uint16_t raw) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    return static_cast<uint32_t>(raw) << 16;
  } else {
    return __float_as_uint(__half2float(__ushort_as_half(raw)));
  }
}

// x with its mantissa cut to TF32's 10 bits (toward zero): one instruction, where the rounding cvt.rna.tf32.f32 is
// emulated in several on sm_90.
__device__ __forceinline__ uint32_t truncate_to_tf32(float x) { return __float_as_uint(x) & 0xffffe000u; }

// d += a b for a 16x8 tile a (row-major) and an 8x8 tile b (column-major) of TF32 values, float32 sums.
__device__ __forceinline__ void mma_16x8x8_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();  // launch_tree_gdn refuses 16-bit inputs on builds for older architectures
#endif
}

// KH and QH of one chunk for 16-bit inputs, on tensor cores (m16n8k8 TF32). Staged key and query elements are exact
// in TF32; each H0 element is split into two parts, hi = its TF32 truncation and lo = the exact remainder (below 2^-10
// of the element), which the tensor cores truncate to TF32 in turn: what is lost is below 2^-20 of the element (eight
// float32 ulps), so two products per tile keep about float32 accuracy (the error-corrected TF32 split of Ootomo and
// Yokota, 2022, its high part truncated rather than rounded: fewer instructions). Warp w takes the 16-row tiles w,
// w + 9, ... of the chunk's `rows` staged rows (key and query of node 0, then of node 1, ...) against all 32 columns;
// rows past the end are read from row 0 and their sums dropped. Fragments as in the PTX ISA's m16n8k8 layout: lane
// (gid, tig) holds rows gid and gid + 8 of a tile at depths tig and tig + 4, and column gid of each 8-column tile.
template <typename T>
__device__ __forceinline__ void stage_gemm_tensor_cores(const T* stage, int kpad, int rows, const float* h0, int krows,
                                                        int warp, int lane, int c0, float* kh, float* qh) {
  const int gid = lane / 4, tig = lane % 4;
  const uint16_t* st = reinterpret_cast<const uint16_t*>(stage);
  for (int rt = warp; 16 * rt < rows; rt += kMainWarps) {
    const int r_lo = 16 * rt + gid, r_hi = r_lo + 8;
    const uint16_t* a_lo = st + (r_lo < rows ? r_lo : 0) * kpad + tig;
    const uint16_t* a_hi = st + (r_hi < rows ? r_hi : 0) * kpad + tig;
    const float* b_col = h0 + tig * kH0Stride + gid;
    float acc[4][4] = {};
#pragma unroll 2
    for (int k0 = 0; k0 < krows; k0 += 8) {
      const uint32_t a[4] = {tf32_of_16bit<T>(a_lo[k0]), tf32_of_16bit<T>(a_hi[k0]), tf32_of_16bit<T>(a_lo[k0 + 4]),
                             tf32_of_16bit<T>(a_hi[k0 + 4])};
#pragma unroll
      for (int nt = 0; nt < kTileV / 8; ++nt) {
        const float x0 = b_col[k0 * kH0Stride + 8 * nt], x1 = b_col[(k0 + 4) * kH0Stride + 8 * nt];
        const uint32_t hi0 = truncate_to_tf32(x0), hi1 = truncate_to_tf32(x1);
        // The residual goes in as float32 bits: the tensor cores read its top 19.
        const uint32_t lo0 = __float_as_uint(x0 - __uint_as_float(hi0));
        const uint32_t lo1 = __float_as_uint(x1 - __uint_as_float(hi1));
        mma_16x8x8_tf32(acc[nt], a, lo0, lo1);
        mma_16x8x8_tf32(acc[nt], a, hi0, hi1);
      }
    }
#pragma unroll
    for (int nt = 0; nt < kTileV / 8; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = half == 0 ? r_lo : r_hi;
        if (r >= rows) continue;
        float* dst = (r % 2 == 0 ? kh : qh) + (c0 + r / 2) * kTileV + 8 * nt + 2 * tig;
        *reinterpret_cast<float2*>(dst) = make_float2(acc[nt][2 * half], acc[nt][2 * half + 1]);
      }
    }
  }
}

template <typename T, bool PACKED>
__global__ void __maxnreg__(kMainMaxRegisters) gdn_tree_main_kernel(
    GdnShapes sh, GdnMainLayout lay, const T* __restrict__ q, int64_t q_sb, int64_t q_sn, int64_t q_sh,
    const T* __restrict__ k, int64_t k_sb, int64_t k_sn, int64_t k_sh, const T* __restrict__ v, int64_t v_sb,
    int64_t v_sn, int64_t v_sh, bool v_packed, const float* __restrict__ beta, int64_t be_sb, int64_t be_sn,
    int64_t be_sh, const float* __restrict__ state, int64_t st_sb, int64_t st_sh, int64_t st_sk, int64_t st_sv,
    bool state_vec4, const int32_t* __restrict__ parent, int64_t pa_sb, int64_t pa_sn, const float* __restrict__ g, int64_t g_sb,
    int64_t g_sn, int64_t g_sh, const float2* __restrict__ coef_near, const float2* __restrict__ coef,
    const float2* __restrict__ norms, T* __restrict__ out, int64_t o_sb, int64_t o_sn, int64_t o_sh,
    float* __restrict__ stash_u, int64_t su_sb, int64_t su_sn, int64_t su_sh) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* h0 = reinterpret_cast<float*>(smem_raw + lay.h0);        // [krows][32]
  T* stage = reinterpret_cast<T*>(smem_raw + lay.stage);          // [2 chunk][kpad] during the GEMM
  float* kh = reinterpret_cast<float*>(smem_raw + lay.kh);        // [N][32]: K H0, then r
  float* qh = reinterpret_cast<float*>(smem_raw + lay.qh);        // [N][32]: Q H0, then e^G H0^T q
  float* vt = reinterpret_cast<float*>(smem_raw + lay.vt);        // [N][32]: v, then u
  float* graw = reinterpret_cast<float*>(smem_raw + lay.graw);    // [N] log decays
  float* decay_s = reinterpret_cast<float*>(smem_raw + lay.decay);  // [N] e^G
  float* beta_s = reinterpret_cast<float*>(smem_raw + lay.beta);  // [N]
  int* par = reinterpret_cast<int*>(smem_raw + lay.parent);       // [N]
  int* dep = reinterpret_cast<int*>(smem_raw + lay.depth);        // [N]
  const int n = sh.num_nodes, kdim = sh.kdim, kpad = lay.kpad;
  PathTerm* terms = reinterpret_cast<PathTerm*>(stage);  // [N][kCachedDist], after the GEMM

  const int v0 = blockIdx.x * kTileV, hv = blockIdx.y, b = blockIdx.z;
  const int h = hv / (sh.value_heads / sh.heads);
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;

  // Stages the raw key and query rows of chunk nodes c0 .. c0 + nodes - 1 as they are (rows 2 l and 2 l + 1).
  const RowSplit split(kdim / kPack<T, PACKED>);
  const T* k_base = k + b * k_sb + h * k_sh;
  const T* q_base = q + b * q_sb + h * q_sh;
  // Packed rows travel as asynchronous copies: wait_async_copies() before the barrier that publishes them.
  auto stage_chunk = [&](int c0, int nodes) {
    auto source = [&](int r) { return r % 2 == 0 ? k_base + (c0 + r / 2) * k_sn : q_base + (c0 + r / 2) * q_sn; };
    if constexpr (PACKED) {
      for (int e = tid; e < 2 * nodes * split.groups; e += kMainThreads) {
        const int r = split.row(e), c = kPack<T, PACKED> * split.col(e);
        cuda::copy_async<16>(stage + r * kpad + c, source(r) + c);
      }
    } else {
      batched_copy<kMainThreads, 8>(
          2 * nodes * split.groups, [&](int e) { return load_group<T, PACKED>(source(split.row(e)), split.col(e)); },
          [&](int e, const RowGroup<T, PACKED>& x) { stage[split.row(e) * kpad + split.col(e)] = x; });
    }
    if (lay.krows > kdim) {  // zero the columns K..krows the GEMM reads
      const int w = lay.krows - kdim;
      for (int e = tid; e < 2 * nodes * w; e += kMainThreads) stage[(e / w) * kpad + kdim + e % w] = cuda::from_float<T>(0.f);
    }
  };

  // ---- tree, beta, H0 tile, v tile and the first chunk's k and q: independent loads, in one round trip (the
  // asynchronous copies are all issued first, then the v tile is loaded and converted while they fly) ----
  for (int i = tid; i < n; i += kMainThreads) {
    cuda::copy_async<4>(par + i, parent + b * pa_sb + i * pa_sn);
    cuda::copy_async<4>(beta_s + i, beta + b * be_sb + i * be_sn + hv * be_sh);
    cuda::copy_async<4>(graw + i, g + b * g_sb + i * g_sn + hv * g_sh);
  }
  const float* h0_src = state + b * st_sb + hv * st_sh;
  // Rows K..krows of the tile are zero; so are columns past V (their sums are never stored). Clamped
  // addresses keep every load in bounds without a branch.
  if (state_vec4 && v0 + kTileV <= sh.vdim) {
    for (int e = tid; e < lay.krows * (kTileV / 4); e += kMainThreads) {
      const int r = e / (kTileV / 4), c = 4 * (e % (kTileV / 4));
      if (r < kdim) {
        cuda::copy_async<16>(h0 + r * kH0Stride + c, h0_src + r * st_sk + v0 + c);
      } else {
        *reinterpret_cast<float4*>(h0 + r * kH0Stride + c) = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  } else {
    batched_copy<kMainThreads, 8>(
        lay.krows * kTileV,
        [&](int e) {
          const int r = min(e / kTileV, kdim - 1), c = min(v0 + e % kTileV, sh.vdim - 1);
          return h0_src[r * st_sk + c * st_sv];
        },
        [&](int e, float x) {
          h0[(e / kTileV) * kH0Stride + e % kTileV] = e / kTileV < kdim && v0 + e % kTileV < sh.vdim ? x : 0.f;
        });
  }
  stage_chunk(0, lay.chunk);
  const T* v_base = v + b * v_sb + hv * v_sh + v0;
  if (v_packed && v0 + kTileV <= sh.vdim) {  // 16-byte packs: one load a thread for N <= 72 (16-bit inputs)
    constexpr int kVPacks = kTileV / kPack<T, true>;
    batched_copy<kMainThreads, 4>(
        n * kVPacks, [&](int e) { return load_group<T, true>(v_base + (e / kVPacks) * v_sn, e % kVPacks); },
        [&](int e, const uint4& x) { store_group<T, true>(vt + (e / kVPacks) * kTileV, e % kVPacks, x); });
  } else {  // element by element; columns past V are zero
    batched_copy<kMainThreads, 8>(
        n * kTileV, [&](int e) { return v_base[(e / kTileV) * v_sn + min(e % kTileV, sh.vdim - 1 - v0)]; },
        [&](int e, T x) { vt[e] = v0 + e % kTileV < sh.vdim ? cuda::to_float(x) : 0.f; });
  }
  cuda::wait_async_copies();
  for (int i = tid; i < n; i += kMainThreads) par[i] = cuda::checked_parent(par[i], i);  // this thread's copies
  __syncthreads();

  // ---- K H0 and Q H0 of the raw rows, by chunks of up to 72 nodes ----
  const int rg = tid / 8, cg = tid % 8;
  for (int c0 = 0;;) {
    const int nodes = min(lay.chunk, n - c0);
    if constexpr (sizeof(T) == 2) {
      stage_gemm_tensor_cores<T>(stage, kpad, 2 * nodes, h0, lay.krows, warp, lane, c0, kh, qh);
    } else if (rg < nodes) {
      float acc[4][4] = {};
      if (nodes > kHalfChunk) {
        node_pair_gemm<false>(stage, kpad, nodes, h0, lay.krows, rg, cg, acc);
      } else {
        node_pair_gemm<true>(stage, kpad, nodes, h0, lay.krows, rg, cg, acc);
      }
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int node = rg + kHalfChunk * (m / 2);
        if (node >= nodes) continue;
        float* dst = (m % 2 == 0 ? kh : qh) + (c0 + node) * kTileV + 4 * cg;
        *reinterpret_cast<float4*>(dst) = make_float4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
      }
    }
    c0 += lay.chunk;
    __syncthreads();  // this chunk's reads of the staged rows are done
    if (c0 >= n) break;
    stage_chunk(c0, min(lay.chunk, n - c0));
    cuda::wait_async_copies();
    __syncthreads();
  }
  // The staged rows are dead from here on: the region now holds the path terms (rows now, coefficients later).
  // One walk up the tree per node gives its first kCachedDist ancestors (in registers: unrolled) and its depth.
  // G_i is summed root first, as gdn_tree_prep sums it (the same additions in the same order: the same bits).
  for (int i = tid; i < n; i += kMainThreads) {
    const NodePath path(i, par);  // past the root: the node's own row, with zero coefficients from kernel 1
    dep[i] = path.depth;
#pragma unroll
    for (int a = 0; a < kCachedDist; ++a) terms[i * kCachedDist + a].row = path.anc[a] * kTileV;
    decay_s[i] = expf(path.root_first_sum(par, [&](int j) { return graw[j]; }));
  }
  __syncthreads();  // dep and decay_s

  // ---- kernel 1's results. Its compact rows (T_i[a], M_i[a]) for a < kCachedDist, zero past the root, land in
  // the path terms by asynchronous copies while the warps form r and e^G H0^T q, which need only the norms ----
  wait_for_preceding_grid();
  const int64_t head_rows = (static_cast<int64_t>(b) * sh.value_heads + hv) * n;
  const float2* near_h = coef_near + head_rows * kCachedDist;
  const float2* coef_h = coef + head_rows * n;  // distances >= kCachedDist (paths deeper than 16 only)
  const float2* norms_h = norms + (static_cast<int64_t>(b) * sh.heads + h) * n;
  for (int e = tid; e < n * kCachedDist; e += kMainThreads) cuda::copy_async<8>(&terms[e].t, near_h + e);
  // r_i = beta_i (v_i - e^{G_i} H0^T k_i) over kh, e^{G_i} H0^T q_i over qh: warp w takes nodes w, w + 9, ...; its
  // lane l loads the norms of its l-th node of each batch of 32, in one round trip.
  for (int first = warp; first < n; first += kWarp * kMainWarps) {
    const int mine = first + lane * kMainWarps;
    const float2 nm_lane = mine < n ? norms_h[mine] : make_float2(0.f, 0.f);
    for (int it = 0, i = first; it < kWarp && i < n; ++it, i += kMainWarps) {
      const float nk = __shfl_sync(cuda::kFullMask, nm_lane.x, it), nq = __shfl_sync(cuda::kFullMask, nm_lane.y, it);
      const float decay = decay_s[i];
      kh[i * kTileV + lane] = beta_s[i] * (vt[i * kTileV + lane] - decay * (nk * kh[i * kTileV + lane]));
      qh[i * kTileV + lane] = decay * (nq * qh[i * kTileV + lane]);
    }
  }
  cuda::wait_async_copies();
  __syncthreads();

  // The u and o passes: a warp takes kPassNodes nodes at once, kTileV / 4 lanes each, and a lane owns 4
  // consecutive columns of its node. Per path term a warp then reads kPassNodes 16-byte terms (one wavefront) and
  // kPassNodes rows of the tile (128 bytes each), against one term and one row per node with a lane per column:
  // the passes are bound by shared-memory wavefronts. Each column still sums its terms in the same order.
  constexpr int kLanesPerNode = kTileV / 4;
  constexpr int kPassNodes = kWarp / kLanesPerNode;
  const int slot = lane / kLanesPerNode, c4 = 4 * (lane % kLanesPerNode);
  // sum_{a = 0..depth(i)} c_i[a] x_{a-th ancestor}[c4 .. c4 + 3]: the first kCachedDist terms from the table, up to
  // the deepest of the warp's nodes (a shallower node's further terms have zero coefficients: they add nothing), then
  // the deeper ones walked (paths deeper than 16 only).
  auto path_sum4 = [&](int i, const float* x, bool m_pass) {
    const PathTerm* term = terms + i * kCachedDist;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    auto add = [&](float c, const float* row) {
      const float4 xv = *reinterpret_cast<const float4*>(row + c4);
      acc.x = fmaf(c, xv.x, acc.x);
      acc.y = fmaf(c, xv.y, acc.y);
      acc.z = fmaf(c, xv.z, acc.z);
      acc.w = fmaf(c, xv.w, acc.w);
    };
    const int d = dep[i];
    int last = d;  // the warp's deepest node, at most kCachedDist - 1
#pragma unroll
    for (int off = kWarp / 2; off > 0; off /= 2) last = max(last, __shfl_xor_sync(cuda::kFullMask, last, off));
    last = min(last, kCachedDist - 1);
#pragma unroll 4
    for (int a = 0; a <= last; ++a) {
      const PathTerm pt = term[a];
      add(m_pass ? pt.m : pt.t, x + pt.row);
    }
    if (d >= kCachedDist) {
      int j = term[kCachedDist - 1].row / kTileV;
      for (int a = kCachedDist; a <= d; ++a) {
        j = par[j];
        const float2 c = coef_h[static_cast<int64_t>(i) * n + a];
        add(m_pass ? c.y : c.x, x + j * kTileV);
      }
    }
    return acc;
  };
  // Past the end a slot recomputes node N - 1 and stores nothing.
  // u = T r, into vt (v is dead).
  for (int base = warp * kPassNodes; base < n; base += kMainWarps * kPassNodes) {
    const int i = min(base + slot, n - 1);
    const float4 u = path_sum4(i, kh, false);
    if (base + slot < n) {
      *reinterpret_cast<float4*>(vt + i * kTileV + c4) = u;
      const float uv[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (v0 + c4 + e < sh.vdim) stash_u[b * su_sb + i * su_sn + hv * su_sh + v0 + c4 + e] = uv[e];
      }
    }
  }
  __syncthreads();
  for (int base = warp * kPassNodes; base < n; base += kMainWarps * kPassNodes) {
    const int i = min(base + slot, n - 1);
    const float4 m = path_sum4(i, vt, true);
    if (base + slot < n) {
      const float4 e0 = *reinterpret_cast<const float4*>(qh + i * kTileV + c4);
      const float ov[4] = {e0.x + m.x, e0.y + m.y, e0.z + m.z, e0.w + m.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (v0 + c4 + e < sh.vdim) out[b * o_sb + i * o_sn + hv * o_sh + v0 + c4 + e] = cuda::from_float<T>(ov[e]);
      }
    }
  }
}

// ---- one node: the plain recurrence step ----
// A tree of one node (autoregressive steps) has T = [1] and M = [q.k]: no prep kernel, no workspace, one launch per
// (b, value head, 32 value columns). The block's warps split the rows of the H0 tile and reduce through shared
// memory; the norms scale the sums of the raw rows, as in the tree kernels.

constexpr int kNodeThreads = 256;
constexpr int kNodeWarps = kNodeThreads / kWarp;
constexpr int kNodeBatch = 16;  // H0 rows a thread loads before its first product

// gdn_conv_delta_rule's input for one node: the GDN layer's pre-conv channels x [B, 1, C] (q's, then k's, then v's)
// and what the node's causal window needs besides (its weights, bias and the committed conv state).
template <typename T>
struct NodeConvInput {
  const T* x;
  int64_t x_sb;
  const T* weight;  // [C, W]
  int64_t w_sc, w_st;
  const T* bias;  // nullptr: none
  int64_t bias_s;
  const T* conv_state;  // [B, C, S], the newest input last
  int64_t cs_sb, cs_sc, cs_ss;
  int state_len, width;
  int64_t k_offset, v_offset;  // the first key and value channels: H K and 2 H K
};

// tree_conv1d's output at channel c of a one-node tree (its window: the last W - 1 committed inputs, then x): the
// same sums in the same order, rounded as it rounds them (to T before the SiLU, and after it).
template <typename T>
__device__ __forceinline__ float node_conv_silu(const NodeConvInput<T>& in, int b, int64_t c) {
  float acc = 0.f;
  for (int t = 0; t < in.width; ++t) {
    const int m = in.width - 1 - t;  // window column t holds the input m steps back
    const float col = m == 0 ? cuda::to_float(in.x[b * in.x_sb + c])
                             : cuda::to_float(in.conv_state[b * in.cs_sb + c * in.cs_sc + (in.state_len - m) * in.cs_ss]);
    acc = fmaf(col, cuda::to_float(in.weight[c * in.w_sc + t * in.w_st]), acc);
  }
  const float y = conv_output<T>(acc, in.bias, c * in.bias_s, /*silu=*/true);
  return cuda::to_float(cuda::from_float<T>(y));  // what tree_conv1d stores
}

// CONV: q, k and v are the SiLU of the causal conv of conv.x (gdn_conv_delta_rule), computed here, not read: one
// launch where an autoregressive step ran tree_conv1d and this kernel one after the other.
template <typename T, bool CONV>
__global__ void __launch_bounds__(kNodeThreads) gdn_single_node_kernel(
    GdnShapes sh, NodeConvInput<T> conv, const T* __restrict__ q, int64_t q_sb, int64_t q_sh, const T* __restrict__ k,
    int64_t k_sb, int64_t k_sh, const T* __restrict__ v, int64_t v_sb, int64_t v_sh, const float* __restrict__ g,
    int64_t g_sb, int64_t g_sh, const float* __restrict__ beta, int64_t be_sb, int64_t be_sh,
    const float* __restrict__ state, int64_t st_sb, int64_t st_sh, int64_t st_sk, int64_t st_sv, T* __restrict__ out,
    int64_t o_sb, int64_t o_sh, float* __restrict__ stash_u, int64_t su_sb, int64_t su_sh,
    float* __restrict__ stash_k, int64_t sk_sb, int64_t sk_sh, float* __restrict__ stash_cumg, int64_t cg_sb,
    int64_t cg_sh) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int kdim = sh.kdim;
  float* krow = reinterpret_cast<float*>(smem_raw);  // [K] raw key
  float* qrow = krow + kdim;                         // [K] raw query
  float* part = qrow + kdim;                         // [2][kNodeWarps][32] partial sums of k.H0, q.H0
  __shared__ float inv_k, factor_q, qk;
  const int v0 = blockIdx.x * kTileV, hv = blockIdx.y, b = blockIdx.z;
  const int group = sh.value_heads / sh.heads, h = hv / group;
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  const int col = min(v0 + lane, sh.vdim - 1);
  const bool col_ok = v0 + lane < sh.vdim;

  // Launched as a programmatic dependent: the block's H0 tile (committed rounds ago) moves into L2 while the kernel
  // ahead (the conv, which writes q, k and v; with CONV the qkv projection, which writes x) ends, and with CONV so do
  // the conv's weights and committed inputs of the block's channels; a prefetch loads no register, and every load
  // comes after the wait.
  cuda::allow_dependent_launch();
  for (int e = tid; e < kdim; e += kNodeThreads) cuda::prefetch_l2(state + b * st_sb + hv * st_sh + e * st_sk + v0 * st_sv);
  if constexpr (CONV) {
    for (int e = tid; e < 2 * kdim + kTileV; e += kNodeThreads) {
      const int64_t c = e < kdim ? h * kdim + e
                        : e < 2 * kdim ? conv.k_offset + h * kdim + (e - kdim)
                                       : conv.v_offset + hv * sh.vdim + min(v0 + e - 2 * kdim, sh.vdim - 1);
      cuda::prefetch_l2(conv.weight + c * conv.w_sc);
      if (conv.width > 1) {  // the newest committed input the window reads
        cuda::prefetch_l2(conv.conv_state + b * conv.cs_sb + c * conv.cs_sc + (conv.state_len - 1) * conv.cs_ss);
      }
    }
  }
  cuda::wait_for_preceding_grid();

  // The rows, and this lane's v, g and beta (warp 0); the H0 column entries follow.
  float vv = 0.f, gg = 0.f, bt = 0.f;
  if constexpr (CONV) {
    for (int e = tid; e < 2 * kdim; e += kNodeThreads) {
      if (e < kdim) {
        qrow[e] = node_conv_silu(conv, b, h * kdim + e);
      } else {
        krow[e - kdim] = node_conv_silu(conv, b, conv.k_offset + h * kdim + (e - kdim));
      }
    }
    if (warp == 0) vv = node_conv_silu(conv, b, conv.v_offset + hv * sh.vdim + col);
  } else {
    for (int e = tid; e < kdim; e += kNodeThreads) {
      krow[e] = cuda::to_float(k[b * k_sb + h * k_sh + e]);
      qrow[e] = cuda::to_float(q[b * q_sb + h * q_sh + e]);
    }
    if (warp == 0) vv = cuda::to_float(v[b * v_sb + hv * v_sh + col]);
  }
  if (warp == 0) {
    gg = g[b * g_sb + hv * g_sh];
    bt = beta[b * be_sb + hv * be_sh];
  }
  __syncthreads();
  if (warp == 0) {
    const float inv = sh.l2norm ? cuda::inv_l2_norm(cuda::warp_sum_squares(krow, kdim, lane), kL2NormEps) : 1.f;
    if (lane == 0) inv_k = inv;
    if (blockIdx.x == 0 && hv % group == 0) {  // one writer per key head
      for (int e = lane; e < kdim; e += kWarp) stash_k[b * sk_sb + h * sk_sh + e] = krow[e] * inv;
    }
  } else if (warp == 1) {
    const float inv = sh.l2norm ? cuda::inv_l2_norm(cuda::warp_sum_squares(qrow, kdim, lane), kL2NormEps) : 1.f;
    if (lane == 0) factor_q = inv * sh.scale;
  } else if (warp == 2) {
    float acc = 0.f;
    for (int e = lane; e < kdim; e += kWarp) acc = fmaf(qrow[e], krow[e], acc);
    acc = cuda::warp_sum(acc);
    if (lane == 0) qk = acc;
  }
  const float* h0 = state + b * st_sb + hv * st_sh + col * st_sv;
  float pk = 0.f, pq = 0.f;
  for (int r0 = warp; r0 < kdim; r0 += kNodeBatch * kNodeWarps) {
    float hx[kNodeBatch];
#pragma unroll
    for (int u = 0; u < kNodeBatch; ++u) hx[u] = h0[min(r0 + u * kNodeWarps, kdim - 1) * st_sk];
#pragma unroll
    for (int u = 0; u < kNodeBatch; ++u) {
      const int r = r0 + u * kNodeWarps;
      if (r < kdim) {
        pk = fmaf(krow[r], hx[u], pk);
        pq = fmaf(qrow[r], hx[u], pq);
      }
    }
  }
  part[warp * kWarp + lane] = pk;
  part[(kNodeWarps + warp) * kWarp + lane] = pq;
  __syncthreads();
  if (warp != 0) return;
  float kh = 0.f, qh = 0.f;
#pragma unroll
  for (int w = 0; w < kNodeWarps; ++w) {
    kh += part[w * kWarp + lane];
    qh += part[(kNodeWarps + w) * kWarp + lane];
  }
  // u = beta (v - e^g H0^T k), o = e^g H0^T q + (q.k) u, with q and k normalised (and q scaled).
  const float decay = expf(gg);
  const float u = bt * (vv - decay * (inv_k * kh));
  const float o = decay * (factor_q * qh) + ((qk * inv_k) * factor_q) * u;
  if (col_ok) {
    out[b * o_sb + hv * o_sh + v0 + lane] = cuda::from_float<T>(o);
    stash_u[b * su_sb + hv * su_sh + v0 + lane] = u;
  }
  if (blockIdx.x == 0 && lane == 0) stash_cumg[b * cg_sb + hv * cg_sh] = 0.f + gg;  // G of the root, as summed
}

// Rows of q and k move as 16-byte packs when every row starts aligned to one.
template <typename T>
bool rows_in_packs(const at::Tensor& x) {
  constexpr int64_t kP = kPack<T, true>;
  return x.size(3) % kP == 0 && x.stride(0) % kP == 0 && x.stride(1) % kP == 0 && x.stride(2) % kP == 0 &&
         cuda::is_aligned(x.data_ptr(), 16);
}

// Dynamic shared memory of gdn_single_node_kernel: the raw key and query rows, the warps' partial sums.
inline size_t single_node_smem(int64_t kdim) { return sizeof(float) * (2 * kdim + 2 * kNodeWarps * kWarp); }

// q, k, v: the delta rule's inputs (views of x's layout with CONV, where the kernel reads conv.x instead: their
// shapes and strides still give the kernel its shapes).
template <typename T, bool CONV>
void launch_single_node(const GdnShapes& sh, const NodeConvInput<T>& conv, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                        at::Tensor& out, at::Tensor& stash_u, at::Tensor& stash_k, at::Tensor& stash_cumg) {
  const int64_t kdim = k.size(3), vdim = v.size(3);
  const size_t smem = single_node_smem(kdim);
  cuda::allow_dynamic_smem(gdn_single_node_kernel<T, CONV>, smem);
  const dim3 grid(static_cast<unsigned>(cuda::ceil_div(vdim, kTileV)), static_cast<unsigned>(v.size(2)),
                  static_cast<unsigned>(k.size(0)));
  cuda::launch_programmatic(
      gdn_single_node_kernel<T, CONV>, grid, dim3(kNodeThreads), smem, sh, conv, q.data_ptr<T>(), q.stride(0),
      q.stride(2), k.data_ptr<T>(), k.stride(0), k.stride(2), v.data_ptr<T>(), v.stride(0), v.stride(2),
      g.data_ptr<float>(), g.stride(0), g.stride(2), beta.data_ptr<float>(), beta.stride(0), beta.stride(2),
      state.data_ptr<float>(), state.stride(0), state.stride(1), state.stride(2), state.stride(3), out.data_ptr<T>(),
      out.stride(0), out.stride(2), stash_u.data_ptr<float>(), stash_u.stride(0), stash_u.stride(2),
      stash_k.data_ptr<float>(), stash_k.stride(0), stash_k.stride(2), stash_cumg.data_ptr<float>(),
      stash_cumg.stride(0), stash_cumg.stride(2));
}

template <typename T>
void launch_tree_gdn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                     const at::Tensor& beta, const at::Tensor& state, const at::Tensor& parent, double scale,
                     bool use_qk_l2norm, at::Tensor& out, at::Tensor& stash_u, at::Tensor& stash_k,
                     at::Tensor& stash_cumg) {
  const int64_t bsz = k.size(0), n = k.size(1), heads = k.size(2), kdim = k.size(3);
  const int64_t value_heads = v.size(2), vdim = v.size(3);
  const GdnShapes sh{static_cast<int>(n), static_cast<int>(heads), static_cast<int>(value_heads),
                     static_cast<int>(kdim), static_cast<int>(vdim), static_cast<float>(scale), use_qk_l2norm};
  const GdnMainLayout lay(static_cast<int>(n), static_cast<int>(kdim), static_cast<int>(sizeof(T)));
  const GdnPrepLayout prep_lay(static_cast<int>(n), static_cast<int>(kdim), static_cast<int>(value_heads / heads));
  const GdnGramLayout gram_lay(static_cast<int>(n), static_cast<int>(kdim), static_cast<int>(value_heads / heads));
  // 16-bit inputs take tensor-core code (mma.sync, cp.async: compute capability >= 8.0) in both tree kernels. A build
  // whose code for this GPU targets an older architecture (TORCH_CUDA_ARCH_LIST with 7.x only, or 7.x PTX compiled
  // for a newer GPU) has traps in its place: refuse before launching.
  if constexpr (sizeof(T) == 2) {
    static const int ptx_version = cuda::ptx_version(gdn_tree_main_kernel<T, true>);
    TORCH_CHECK(ptx_version >= 80, "tree_gated_delta_rule: bfloat16/float16 inputs need this extension built for ",
                "compute capability 8.0 or newer (its code for this GPU targets ", ptx_version / 10, ".",
                ptx_version % 10, "); rebuild with TORCH_CUDA_ARCH_LIST naming 8.0 or newer, or pass float32");
  }
  // The tensor-core prep kernel where it applies: 16-bit inputs and N <= kGramMaxNodes.
  const bool gram = sizeof(T) == 2 && n <= kGramMaxNodes && gram_lay.total <= cuda::max_dynamic_smem();
  const size_t prep_smem = gram ? gram_lay.total : prep_lay.total;
  TORCH_CHECK_VALUE(lay.total <= cuda::max_dynamic_smem() && prep_smem <= cuda::max_dynamic_smem(),
                    "tree_gated_delta_rule: N = ", n, " and K = ", kdim,
                    " need more shared memory than this GPU offers (", std::max(lay.total, prep_smem), " bytes)");
  const cudaStream_t stream = cuda::current_stream();
  if (n == 1) {
    launch_single_node<T, false>(sh, NodeConvInput<T>{}, q, k, v, g, beta, state, out, stash_u, stash_k, stash_cumg);
    return;
  }
  // Shape-dependent workspaces (never data-dependent): fine under CUDA graph capture. coef_near holds T_i[a] and
  // M_i[a] by ancestor distance a < kCachedDist (zero for a > depth(i)), coef those of kCachedDist <= a <= depth(i);
  // norms 1/||k_i|| and scale/||q_i||.
  const auto f32 = k.options().dtype(at::kFloat);
  const at::Tensor coef_near = at::empty({bsz, value_heads, n, kCachedDist, 2}, f32);
  const at::Tensor coef = at::empty({bsz, value_heads, n, n, 2}, f32);
  const at::Tensor norms = at::empty({bsz, heads, n, 2}, f32);
  auto* coef_near_ptr = reinterpret_cast<float2*>(coef_near.data_ptr<float>());
  auto* coef_ptr = reinterpret_cast<float2*>(coef.data_ptr<float>());
  auto* norms_ptr = reinterpret_cast<float2*>(norms.data_ptr<float>());
  const bool packed = rows_in_packs<T>(q) && rows_in_packs<T>(k);
  const bool v_packed = rows_in_packs<T>(v);

  auto launch_prep = [&](auto kernel, const auto& layout) {
    cuda::allow_dynamic_smem(kernel, layout.total);
    const dim3 grid(static_cast<unsigned>(cuda::ceil_div(n, kPrepNodes)), static_cast<unsigned>(heads),
                    static_cast<unsigned>(bsz));
    kernel<<<grid, kPrepThreads, layout.total, stream>>>(
        sh, layout, q.data_ptr<T>(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr<T>(), k.stride(0),
        k.stride(1), k.stride(2), g.data_ptr<float>(), g.stride(0), g.stride(1), g.stride(2), beta.data_ptr<float>(),
        beta.stride(0), beta.stride(1), beta.stride(2), parent.data_ptr<int32_t>(), parent.stride(0),
        parent.stride(1), stash_k.data_ptr<float>(), stash_k.stride(0), stash_k.stride(1), stash_k.stride(2),
        stash_cumg.data_ptr<float>(), stash_cumg.stride(0), stash_cumg.stride(1), stash_cumg.stride(2), coef_near_ptr,
        coef_ptr, norms_ptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };

  // The main kernel starts while the prep kernel runs where the GPU supports it (cuda::launch_programmatic).
  const bool state_vec4 = vdim % 4 == 0 && state.stride(3) == 1 && state.stride(2) % 4 == 0 &&
                          state.stride(1) % 4 == 0 && state.stride(0) % 4 == 0 && cuda::is_aligned(state.data_ptr(), 16);
  auto launch_main = [&](auto kernel) {
    cuda::allow_dynamic_smem(kernel, lay.total);
    cuda::launch_programmatic(
        kernel,
        dim3(static_cast<unsigned>(cuda::ceil_div(vdim, kTileV)), static_cast<unsigned>(value_heads),
             static_cast<unsigned>(bsz)),
        dim3(kMainThreads), lay.total, sh, lay, static_cast<const T*>(q.data_ptr<T>()), q.stride(0), q.stride(1),
        q.stride(2), static_cast<const T*>(k.data_ptr<T>()), k.stride(0), k.stride(1), k.stride(2),
        static_cast<const T*>(v.data_ptr<T>()), v.stride(0), v.stride(1), v.stride(2), v_packed,
        static_cast<const float*>(beta.data_ptr<float>()), beta.stride(0), beta.stride(1), beta.stride(2),
        static_cast<const float*>(state.data_ptr<float>()), state.stride(0), state.stride(1), state.stride(2),
        state.stride(3), state_vec4, static_cast<const int32_t*>(parent.data_ptr<int32_t>()), parent.stride(0),
        parent.stride(1), static_cast<const float*>(g.data_ptr<float>()), g.stride(0), g.stride(1), g.stride(2),
        static_cast<const float2*>(coef_near_ptr), static_cast<const float2*>(coef_ptr),
        static_cast<const float2*>(norms_ptr), out.data_ptr<T>(), out.stride(0), out.stride(1), out.stride(2),
        stash_u.data_ptr<float>(), stash_u.stride(0), stash_u.stride(1), stash_u.stride(2));
  };

  auto launch_pair = [&](auto packed_rows) {
    constexpr bool kPacked = decltype(packed_rows)::value;
    if constexpr (sizeof(T) == 2) {
      if (gram) {
        launch_prep(gdn_tree_prep_gram_kernel<T, kPacked>, gram_lay);
      } else {
        launch_prep(gdn_tree_prep_kernel<T, kPacked>, prep_lay);
      }
    } else {
      launch_prep(gdn_tree_prep_kernel<T, kPacked>, prep_lay);
    }
    launch_main(gdn_tree_main_kernel<T, kPacked>);
  };
  if (packed) {
    launch_pair(std::true_type{});
  } else {
    launch_pair(std::false_type{});
  }
}

}  // namespace

// ---- entry points ------------------------------------------------------------------------------

void tree_conv1d_cuda(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                      const at::Tensor& conv_state, const at::Tensor& parent, bool silu, at::Tensor& out) {
  check_tree_conv1d(x, weight, bias, conv_state, parent, out);
  const c10::cuda::CUDAGuard guard(x.device());
  if (x.numel() == 0) return;
  DDTREE_CUDA_DISPATCH_FLOAT(x.scalar_type(), "tree_conv1d",
                        [&] { launch_tree_conv1d<scalar_t>(x, weight, bias, conv_state, parent, silu, out); });
}

void gdn_conv_delta_rule_cuda(const at::Tensor& x, const at::Tensor& conv_weight,
                              const c10::optional<at::Tensor>& conv_bias, const at::Tensor& conv_state,
                              const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                              const at::Tensor& parent, int64_t heads, int64_t kdim, double scale, bool use_qk_l2norm,
                              at::Tensor& out, at::Tensor& stash_u, at::Tensor& stash_k, at::Tensor& stash_cumg) {
  auto buffers = check_gdn_conv_delta_rule(x, conv_weight, conv_bias, conv_state, g, beta, state, parent, heads, kdim,
                                           out, stash_u, stash_k, stash_cumg);
  const c10::cuda::CUDAGuard guard(x.device());
  if (x.size(0) == 0 || x.size(1) == 0) return;
  const auto& qkv = buffers.qkv;
  if (x.size(1) > 1) {  // a tree: the conv, then the tree kernels (which read each node's q, k, v many times)
    tree_conv1d_cuda(x, conv_weight, conv_bias, conv_state, parent, /*silu=*/true, buffers.conv_out);
    tree_gated_delta_rule_cuda(qkv[0], qkv[1], qkv[2], g, beta, state, parent, scale, use_qk_l2norm, out, stash_u,
                               stash_k, stash_cumg);
    return;
  }
  const size_t smem = single_node_smem(kdim);
  TORCH_CHECK_VALUE(smem <= cuda::max_dynamic_smem(), "gdn_conv_delta_rule: head_k_dim = ", kdim,
                    " needs more shared memory than this GPU offers (", smem, " bytes)");
  DDTREE_CUDA_DISPATCH_FLOAT(x.scalar_type(), "gdn_conv_delta_rule", [&] {
    const int64_t key_dim = heads * kdim;
    const NodeConvInput<scalar_t> conv{
        x.data_ptr<scalar_t>(), x.stride(0), conv_weight.data_ptr<scalar_t>(), conv_weight.stride(0),
        conv_weight.stride(1), conv_bias.has_value() ? conv_bias->data_ptr<scalar_t>() : nullptr,
        conv_bias.has_value() ? conv_bias->stride(0) : 0, conv_state.data_ptr<scalar_t>(), conv_state.stride(0),
        conv_state.stride(1), conv_state.stride(2), static_cast<int>(conv_state.size(2)),
        static_cast<int>(conv_weight.size(1)), key_dim, 2 * key_dim};
    const GdnShapes sh{1, static_cast<int>(heads), static_cast<int>(out.size(2)), static_cast<int>(kdim),
                       static_cast<int>(out.size(3)), static_cast<float>(scale), use_qk_l2norm};
    launch_single_node<scalar_t, true>(sh, conv, qkv[0], qkv[1], qkv[2], g, beta, state, out, stash_u, stash_k,
                                       stash_cumg);
  });
}

void tree_gated_delta_rule_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                const at::Tensor& beta, const at::Tensor& state, const at::Tensor& parent,
                                double scale, bool use_qk_l2norm, at::Tensor& out, at::Tensor& stash_u,
                                at::Tensor& stash_k, at::Tensor& stash_cumg) {
  check_tree_gated_delta_rule(q, k, v, g, beta, state, parent, out, stash_u, stash_k, stash_cumg);
  const c10::cuda::CUDAGuard guard(q.device());
  if (k.size(0) == 0 || k.size(1) == 0) return;
  DDTREE_CUDA_DISPATCH_FLOAT(v.scalar_type(), "tree_gated_delta_rule", [&] {
    launch_tree_gdn<scalar_t>(q, k, v, g, beta, state, parent, scale, use_qk_l2norm, out, stash_u, stash_k,
                              stash_cumg);
  });
}

}  // namespace ddtree
