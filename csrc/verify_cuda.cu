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

// ==== tree_conv1d ==============================================================================
//
// One thread per (node, VEC channels). Node i's window is, oldest first, its W - 1 nearest
// ancestors then itself; window columns above the root come from the last columns of conv_state.

constexpr int kConvThreads = 128;

template <typename T, int VEC, int W>
__global__ void __launch_bounds__(kConvThreads) tree_conv1d_kernel(
    const T* __restrict__ x, int64_t x_sb, int64_t x_sn, const T* __restrict__ weight, int64_t w_sc, int64_t w_st,
    const T* __restrict__ bias, int64_t bias_s, const T* __restrict__ conv_state, int64_t cs_sb, int64_t cs_sc,
    int64_t cs_ss, int64_t state_len, const int32_t* __restrict__ parent, int64_t pa_sb, int64_t pa_sn, int num_nodes,
    int64_t channels, bool silu, T* __restrict__ out, int64_t o_sb, int64_t o_sn) {
  const int b = blockIdx.x / num_nodes, i = blockIdx.x % num_nodes;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.y) * kConvThreads + threadIdx.x) * VEC;
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
    for (int e = 0; e < VEC; ++e) acc[e] = fmaf(col[e], cuda::to_float(weight[(c0 + e) * w_sc + t * w_st]), acc[e]);
  }
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    float y = acc[e];
    if (bias != nullptr) y += cuda::to_float(bias[(c0 + e) * bias_s]);
    acc[e] = silu ? y / (1.f + expf(-y)) : y;
  }
  cuda::store_pack_float<T, VEC>(out + b * o_sb + i * o_sn + c0, acc);
}

template <typename T, int VEC>
void launch_tree_conv1d_vec(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                            const at::Tensor& conv_state, const at::Tensor& parent, bool silu, at::Tensor& out) {
  const int64_t bsz = x.size(0), n = x.size(1), channels = x.size(2), width = weight.size(1);
  const dim3 grid(static_cast<unsigned>(bsz * n), static_cast<unsigned>(cuda::ceil_div(channels, kConvThreads * VEC)));
  const T* bias_ptr = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  const int64_t bias_stride = bias.has_value() ? bias->stride(0) : 0;
  auto launch = [&](auto kernel) {
    kernel<<<grid, kConvThreads, 0, cuda::current_stream()>>>(
        x.data_ptr<T>(), x.stride(0), x.stride(1), weight.data_ptr<T>(), weight.stride(0), weight.stride(1), bias_ptr,
        bias_stride, conv_state.data_ptr<T>(), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        conv_state.size(2), parent.data_ptr<int32_t>(), parent.stride(0), parent.stride(1), static_cast<int>(n),
        channels, silu, out.data_ptr<T>(), out.stride(0), out.stride(1));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
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
// Two launches; the committed state H0 is read once (by the second) and no per-node state is formed.
//  1. gdn_tree_prep   per (b, key head, chunk of 16 nodes): l2-normalised keys (= stash_k); for every node i
//                     of the chunk and every node j on its path root..i at distance a, k_i.k_j and
//                     (scale q_i).k_j into a workspace gram[b, h, i, a, 0..1]; G_i (cumulative log decay,
//                     summed root first, = stash_cumg) for the value heads of that key head.
//  2. gdn_tree_main   per (b, value head, tile of 32 value columns):
//                       KH = K H0 and QH = Q H0 for all nodes (fp32 FMA from shared memory, on its own
//                         normalised copies of k and q, the same bits as kernel 1's);
//                       then, once kernel 1 is complete, level by level (a node depends on its ancestors only)
//                         u_i = beta_i (v_i - e^{G_i} KH_i - sum_{j strict anc} e^{G_i-G_j} (k_i.k_j) u_j),
//                         o_i = e^{G_i} QH_i + sum_{j in root..i} e^{G_i-G_j} (q_i.k_j) u_j,
//                       writing node i's output and stash_u as soon as its u is known.
// Kernel 2 is launched as a programmatic dependent of kernel 1 (Hopper and newer): its loads and products, which
// need nothing kernel 1 writes, overlap kernel 1, and `griddepcontrol.wait` orders its reads of the workspace
// and stash_cumg after kernel 1's writes. Without that launch attribute the wait is a no-op.
// Exponents are only ever formed as G_i - G_j with j an ancestor of i (<= 0 for log decays <= 0).

constexpr int kPrepThreads = 256;
constexpr int kPrepNodes = 16;      // chunk nodes per prep block
constexpr int kMainThreads = 288;   // GEMM: 36 node rows x 8 column groups; solve: 9 warps
constexpr int kMainWarps = kMainThreads / kWarp;
constexpr int kTileV = 32;          // value columns per main block: one per lane in the solve
constexpr int kHalfChunk = 36;      // GEMM thread (rg, cg) owns the chunk's nodes rg and rg + 36
constexpr int kChunkNodes = 2 * kHalfChunk;
constexpr int kCachedDist = 17;     // ancestor distances 0..16 cached in shared memory; deeper ones are read back

// Lets the dependent launch (kernel 2) start / waits until the grid this one depends on is complete and its
// writes are visible. Both are no-ops without a programmatic dependent launch.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

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
// before loading the next waits a full round trip per element). `load` must not branch.
template <int THREADS, int BATCH, typename Load, typename Store>
__device__ __forceinline__ void batched_copy(int total, Load load, Store store) {
  using Value = decltype(load(0));
  for (int base = threadIdx.x; base < total; base += BATCH * THREADS) {
    Value vals[BATCH];
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {
      const int e = base + u * THREADS;
      if (e < total) vals[u] = load(e);
    }
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {
      const int e = base + u * THREADS;
      if (e < total) store(e, vals[u]);
    }
  }
}

// Element group p of a row of T (4 elements when VEC4, else 1), raw, and its store into a float row.
template <typename T, bool VEC4>
using RowGroup = std::conditional_t<VEC4, cuda::Pack<T, 4>, T>;

template <typename T, bool VEC4>
__device__ __forceinline__ RowGroup<T, VEC4> load_group(const T* row, int p) {
  if constexpr (VEC4) {
    return *reinterpret_cast<const cuda::Pack<T, 4>*>(row + 4 * p);
  } else {
    return row[p];
  }
}

template <typename T, bool VEC4>
__device__ __forceinline__ void store_group(float* row, int p, const RowGroup<T, VEC4>& x) {
  if constexpr (VEC4) {
    *reinterpret_cast<float4*>(row + 4 * p) =
        make_float4(cuda::to_float(x.v[0]), cuda::to_float(x.v[1]), cuda::to_float(x.v[2]), cuda::to_float(x.v[3]));
  } else {
    row[p] = cuda::to_float(x);
  }
}

// 1 / ||row|| as every kernel here computes it (same lanes, same butterfly), or 1 without l2norm;
// a normalised query is ((x * inv) * scale), a normalised key x * inv.
__device__ __forceinline__ void normalise_staged_row(float* row, int kdim, int lane, bool l2norm, bool query,
                                                     float scale) {
  const float inv = l2norm ? cuda::inv_l2_norm(cuda::warp_sum_squares(row, kdim, lane), kL2NormEps) : 1.f;
  if (query) {
    for (int e = lane; e < kdim; e += kWarp) row[e] = (row[e] * inv) * scale;
  } else {
    for (int e = lane; e < kdim; e += kWarp) row[e] = row[e] * inv;
  }
}

template <bool VEC4>
__device__ __forceinline__ float dot_rows(const float* x, const float* y, int kdim) {
  float acc = 0.f;
  if constexpr (VEC4) {
#pragma unroll 8
    for (int e = 0; e < kdim; e += 4) {
      const float4 a = *reinterpret_cast<const float4*>(x + e);
      const float4 c = *reinterpret_cast<const float4*>(y + e);
      acc = fmaf(a.x, c.x, acc);
      acc = fmaf(a.y, c.y, acc);
      acc = fmaf(a.z, c.z, acc);
      acc = fmaf(a.w, c.w, acc);
    }
  } else {
#pragma unroll 8
    for (int e = 0; e < kdim; ++e) acc = fmaf(x[e], y[e], acc);
  }
  return acc;
}

__host__ __device__ inline size_t prep_smem_bytes(int n, int kdim, int group) {
  const int kpad = staged_row_len(kdim);
  return sizeof(float) * (static_cast<size_t>(n + kPrepNodes) * kpad + static_cast<size_t>(n) * group) +
         sizeof(int) * static_cast<size_t>(2 + kPrepNodes) * n;
}

template <typename T, bool VEC4>
__global__ void __launch_bounds__(kPrepThreads) gdn_tree_prep_kernel(
    GdnShapes sh, const T* __restrict__ q, int64_t q_sb, int64_t q_sn, int64_t q_sh, const T* __restrict__ k,
    int64_t k_sb, int64_t k_sn, int64_t k_sh, const float* __restrict__ g, int64_t g_sb, int64_t g_sn, int64_t g_sh,
    const int32_t* __restrict__ parent, int64_t pa_sb, int64_t pa_sn, float* __restrict__ stash_k, int64_t sk_sb,
    int64_t sk_sn, int64_t sk_sh, float* __restrict__ stash_cumg, int64_t cg_sb, int64_t cg_sn, int64_t cg_sh,
    float* __restrict__ gram) {
  allow_dependent_launch();  // kernel 2 reads nothing of ours before its wait
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int n = sh.num_nodes, kdim = sh.kdim, kpad = staged_row_len(kdim);
  const int group = sh.value_heads / sh.heads;
  const int c0 = blockIdx.x * kPrepNodes, h = blockIdx.y, b = blockIdx.z;
  const int count = min(kPrepNodes, n - c0);
  const int rows = c0 + count;  // nodes 0..rows-1 can lie on the chunk's paths
  float* krows = reinterpret_cast<float*>(smem_raw);     // [n][kpad] keys, normalised where on a chunk path
  float* qrows = krows + static_cast<size_t>(n) * kpad;  // [kPrepNodes][kpad] scale * normalised queries
  float* gs = qrows + kPrepNodes * kpad;                  // [n][group] log decays of h's value heads
  int* par = reinterpret_cast<int*>(gs + n * group);      // [n]
  int* on_path = par + n;                                 // [n] 1 when some chunk path holds the node
  int* path = on_path + n;                                // [kPrepNodes][n]: path[t][a] = a-th ancestor
  __shared__ int path_len[kPrepNodes];
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  constexpr int kWarps = kPrepThreads / kWarp;

  // Every load at once: the tree, the keys of all nodes up to the chunk (those off the chunk's paths are
  // not used, but loading them does not wait for the paths), the chunk's queries, the log decays.
  for (int j = tid; j < rows; j += kPrepThreads) {
    par[j] = cuda::checked_parent(parent[b * pa_sb + j * pa_sn], j);
    on_path[j] = 0;
  }
  batched_copy<kPrepThreads, 4>(
      rows * group, [&](int e) { return g[b * g_sb + (e / group) * g_sn + (h * group + e % group) * g_sh]; },
      [&](int e, float x) { gs[e] = x; });
  // Rows 0..rows-1: keys of nodes 0..rows-1; rows rows..rows+count-1: the chunk's queries.
  const int groups = VEC4 ? kdim / 4 : kdim;
  const T* k_base = k + b * k_sb + h * k_sh;
  const T* q_base = q + b * q_sb + h * q_sh;
  batched_copy<kPrepThreads, 8>(
      (rows + count) * groups,
      [&](int e) {
        const int r = e / groups;
        const T* row = r < rows ? k_base + r * k_sn : q_base + (c0 + r - rows) * q_sn;
        return load_group<T, VEC4>(row, e % groups);
      },
      [&](int e, const RowGroup<T, VEC4>& x) {
        const int r = e / groups;
        store_group<T, VEC4>(r < rows ? krows + r * kpad : qrows + (r - rows) * kpad, e % groups, x);
      });
  __syncthreads();
  if (tid < count) {
    int len = 0;
    for (int j = c0 + tid; j >= 0; j = par[j]) {
      path[tid * n + len++] = j;
      on_path[j] = 1;
    }
    path_len[tid] = len;
  }
  __syncthreads();
  for (int r = warp; r < rows + count; r += kWarps) {
    if (r < rows) {
      if (on_path[r]) normalise_staged_row(krows + r * kpad, kdim, lane, sh.l2norm, false, 1.f);
    } else {
      normalise_staged_row(qrows + (r - rows) * kpad, kdim, lane, sh.l2norm, true, sh.scale);
    }
  }
  __syncthreads();

  for (int e = tid; e < count * kdim; e += kPrepThreads) {
    const int t = e / kdim, c = e % kdim;
    stash_k[b * sk_sb + (c0 + t) * sk_sn + h * sk_sh + c] = krows[(c0 + t) * kpad + c];
  }
  // One thread per (chunk node t, distance a): k_i.k_j and q_i.k_j.
  int pairs = 0;
  for (int t = 0; t < count; ++t) pairs += path_len[t];
  for (int p = tid; p < pairs; p += kPrepThreads) {
    int t = 0, a = p;
    while (a >= path_len[t]) a -= path_len[t++];
    const int i = c0 + t;
    const float* kj = krows + path[t * n + a] * kpad;
    const float kk = dot_rows<VEC4>(krows + i * kpad, kj, kdim);
    const float qk = dot_rows<VEC4>(qrows + t * kpad, kj, kdim);
    *reinterpret_cast<float2*>(gram + ((((static_cast<int64_t>(b) * sh.heads + h) * n + i) * n + a) * 2)) =
        make_float2(kk, qk);
  }
  // Cumulative log decay summed root first, as the recurrence accumulates it.
  for (int p = tid; p < count * group; p += kPrepThreads) {
    const int t = p / group, gi = p % group;
    float acc = 0.f;
    for (int a = path_len[t] - 1; a >= 0; --a) acc += gs[path[t * n + a] * group + gi];
    stash_cumg[b * cg_sb + (c0 + t) * cg_sn + (h * group + gi) * cg_sh] = acc;
  }
}

// Shared-memory plan of gdn_tree_main (byte offsets), sized from N and K at launch.
struct GdnMainLayout {
  int kpad;   // staged row length (staged_row_len)
  int krows;  // the GEMM's depth: K rounded up to 4 (rows of the H0 tile; staged rows are zero beyond K)
  int chunk;  // nodes per GEMM chunk: min(N, 72)
  size_t h0, stage, kh, qh, vt, cumg, beta, parent, depth, order, level_start, level_fill, total;

  GdnMainLayout(int n, int kdim) {
    kpad = staged_row_len(kdim);
    krows = (kdim + 3) / 4 * 4;
    chunk = n < kChunkNodes ? n : kChunkNodes;
    size_t off = 0;
    auto take = [&](size_t bytes) {
      const size_t at = off;
      off += (bytes + 15) / 16 * 16;
      return at;
    };
    h0 = take(sizeof(float) * krows * kTileV);
    // The staged k/q rows of a chunk and, after the GEMM, the cached ancestor coefficients share one region.
    const size_t staging = sizeof(float) * 2 * chunk * kpad;
    const size_t coeffs = (2 * sizeof(float) + sizeof(int)) * static_cast<size_t>(n) * kCachedDist;
    stage = take(staging > coeffs ? staging : coeffs);
    kh = take(sizeof(float) * n * kTileV);
    qh = take(sizeof(float) * n * kTileV);
    vt = take(sizeof(float) * n * kTileV);
    cumg = take(sizeof(float) * n);
    beta = take(sizeof(float) * n);
    parent = take(sizeof(int) * n);
    depth = take(sizeof(int) * n);
    order = take(sizeof(int) * n);
    level_start = take(sizeof(int) * (n + 2));
    level_fill = take(sizeof(int) * (n + 1));
    total = off;
  }
};

// KH and QH of one chunk: thread (rg, cg) accumulates staged rows 2 rg, 2 rg + 1 (key and query of chunk node rg)
// and 2 rg + 72, 2 rg + 73 (node rg + 36) against H0 columns 4 cg .. 4 cg + 3. The 4 row groups of a warp read
// rows 2 apart, (kpad / 4) odd: distinct banks; its 8 column groups read one 128-byte H0 row. HALF skips node
// rg + 36 (chunks of <= 36 nodes); a missing node's rows are read from row 0 and its sums dropped.
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
      const float4 hb = *reinterpret_cast<const float4*>(h0 + (k0 + e) * kTileV + 4 * cg);
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

template <typename T, bool VEC4>
__global__ void __launch_bounds__(kMainThreads, 2) gdn_tree_main_kernel(
    GdnShapes sh, GdnMainLayout lay, const T* __restrict__ q, int64_t q_sb, int64_t q_sn, int64_t q_sh,
    const T* __restrict__ k, int64_t k_sb, int64_t k_sn, int64_t k_sh, const T* __restrict__ v, int64_t v_sb,
    int64_t v_sn, int64_t v_sh, const float* __restrict__ beta, int64_t be_sb, int64_t be_sn, int64_t be_sh,
    const float* __restrict__ state, int64_t st_sb, int64_t st_sh, int64_t st_sk, int64_t st_sv, bool state_vec4,
    const int32_t* __restrict__ parent, int64_t pa_sb, int64_t pa_sn, const float* __restrict__ stash_cumg,
    int64_t cg_sb, int64_t cg_sn, int64_t cg_sh, const float* __restrict__ gram, T* __restrict__ out, int64_t o_sb,
    int64_t o_sn, int64_t o_sh, float* __restrict__ stash_u, int64_t su_sb, int64_t su_sn, int64_t su_sh) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* h0 = reinterpret_cast<float*>(smem_raw + lay.h0);        // [krows][32]
  float* stage = reinterpret_cast<float*>(smem_raw + lay.stage);  // [2 chunk][kpad] during the GEMM
  float* kh = reinterpret_cast<float*>(smem_raw + lay.kh);        // [N][32]: K H0, then u
  float* qh = reinterpret_cast<float*>(smem_raw + lay.qh);        // [N][32]: Q H0
  float* vt = reinterpret_cast<float*>(smem_raw + lay.vt);        // [N][32]: v
  float* cumg = reinterpret_cast<float*>(smem_raw + lay.cumg);    // [N]
  float* beta_s = reinterpret_cast<float*>(smem_raw + lay.beta);  // [N]
  int* par = reinterpret_cast<int*>(smem_raw + lay.parent);       // [N]
  int* dep = reinterpret_cast<int*>(smem_raw + lay.depth);        // [N]
  int* order = reinterpret_cast<int*>(smem_raw + lay.order);      // [N] nodes by depth
  int* level_start = reinterpret_cast<int*>(smem_raw + lay.level_start);  // [N + 2] level d: order[start d ..]
  int* level_fill = reinterpret_cast<int*>(smem_raw + lay.level_fill);    // [N + 1] scatter cursors
  const int n = sh.num_nodes, kdim = sh.kdim, kpad = lay.kpad;
  float* coef_u = stage;                                   // [N][kCachedDist] after the GEMM
  float* coef_o = coef_u + n * kCachedDist;                // [N][kCachedDist]
  int* anc = reinterpret_cast<int*>(coef_o + n * kCachedDist);  // [N][kCachedDist]
  __shared__ int max_depth;

  const int v0 = blockIdx.x * kTileV, hv = blockIdx.y, b = blockIdx.z;
  const int h = hv / (sh.value_heads / sh.heads);
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  const int col = v0 + lane;
  const bool col_ok = col < sh.vdim;

  // Stages the key and query rows of chunk nodes c0 .. c0 + nodes - 1 as float (rows 2 l and 2 l + 1).
  const int groups = VEC4 ? kdim / 4 : kdim;
  const T* k_base = k + b * k_sb + h * k_sh;
  const T* q_base = q + b * q_sb + h * q_sh;
  auto stage_chunk = [&](int c0, int nodes) {
    batched_copy<kMainThreads, 8>(
        2 * nodes * groups,
        [&](int e) {
          const int r = e / groups, i = c0 + r / 2;
          const T* row = r % 2 == 0 ? k_base + i * k_sn : q_base + i * q_sn;
          return load_group<T, VEC4>(row, e % groups);
        },
        [&](int e, const RowGroup<T, VEC4>& x) { store_group<T, VEC4>(stage + (e / groups) * kpad, e % groups, x); });
    if (lay.krows > kdim) {  // zero the columns K..krows the GEMM reads
      const int w = lay.krows - kdim;
      for (int e = tid; e < 2 * nodes * w; e += kMainThreads) stage[(e / w) * kpad + kdim + e % w] = 0.f;
    }
  };
  auto normalise_chunk = [&](int nodes) {
    for (int r = warp; r < 2 * nodes; r += kMainWarps) {
      normalise_staged_row(stage + r * kpad, kdim, lane, sh.l2norm, r % 2 == 1, sh.scale);
    }
  };

  // ---- tree, beta, H0 tile, v tile and the first chunk's k and q: independent loads, issued together ----
  if (tid == 0) max_depth = 0;
  for (int i = tid; i < n + 2; i += kMainThreads) level_start[i] = 0;
  for (int i = tid; i < n; i += kMainThreads) {
    par[i] = cuda::checked_parent(parent[b * pa_sb + i * pa_sn], i);
    beta_s[i] = beta[b * be_sb + i * be_sn + hv * be_sh];
  }
  const float* h0_src = state + b * st_sb + hv * st_sh;
  // Rows K..krows of the tile are zero; so are columns past V (their sums are never stored). Clamped
  // addresses keep every load in bounds without a branch.
  if (state_vec4 && v0 + kTileV <= sh.vdim) {
    batched_copy<kMainThreads, 4>(
        lay.krows * (kTileV / 4),
        [&](int e) {
          const int r = e / (kTileV / 4), c = 4 * (e % (kTileV / 4));
          return *reinterpret_cast<const float4*>(h0_src + min(r, kdim - 1) * st_sk + v0 + c);
        },
        [&](int e, float4 x) {
          reinterpret_cast<float4*>(h0)[e] = e / (kTileV / 4) < kdim ? x : make_float4(0.f, 0.f, 0.f, 0.f);
        });
  } else {
    batched_copy<kMainThreads, 8>(
        lay.krows * kTileV,
        [&](int e) {
          const int r = min(e / kTileV, kdim - 1), c = min(v0 + e % kTileV, sh.vdim - 1);
          return h0_src[r * st_sk + c * st_sv];
        },
        [&](int e, float x) { h0[e] = e / kTileV < kdim && v0 + e % kTileV < sh.vdim ? x : 0.f; });
  }
  batched_copy<kMainThreads, 8>(
      n * kTileV,
      [&](int e) { return v[b * v_sb + (e / kTileV) * v_sn + hv * v_sh + min(v0 + e % kTileV, sh.vdim - 1)]; },
      [&](int e, T x) { vt[e] = v0 + e % kTileV < sh.vdim ? cuda::to_float(x) : 0.f; });
  stage_chunk(0, lay.chunk);
  __syncthreads();
  for (int i = tid; i < n; i += kMainThreads) {
    int d = 0;
    for (int j = par[i]; j >= 0; j = par[j]) ++d;
    dep[i] = d;
    atomicMax(&max_depth, d);
    atomicAdd(&level_start[d + 1], 1);
  }
  normalise_chunk(lay.chunk);
  __syncthreads();

  // ---- KH and QH by chunks of up to 72 nodes ----
  const int rg = tid / 8, cg = tid % 8;
  for (int c0 = 0;;) {
    const int nodes = min(lay.chunk, n - c0);
    if (rg < nodes) {
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
    const int next = min(lay.chunk, n - c0);
    stage_chunk(c0, next);
    __syncthreads();
    normalise_chunk(next);
    __syncthreads();
  }
  // The staged rows are dead from here on: the region now holds the coefficients.

  // ---- kernel 1's results: G, and the coefficients of ancestor distances a <= 16 ----
  wait_for_prerequisite_grid();
  const float* gram_h = gram + (static_cast<int64_t>(b) * sh.heads + h) * n * n * 2;
  auto load_dots = [&](int i, float2(&dots)[kCachedDist]) {
    const int d = dep[i];
    const float2* gr = reinterpret_cast<const float2*>(gram_h + static_cast<int64_t>(i) * n * 2);
#pragma unroll
    for (int a = 0; a < kCachedDist; ++a) dots[a] = a <= d ? gr[a] : make_float2(0.f, 0.f);
  };
  auto store_coefs = [&](int i, const float2(&dots)[kCachedDist]) {
    const int d = dep[i];
    const float gi = cumg[i];
    int j = i;
#pragma unroll
    for (int a = 0; a < kCachedDist; ++a) {
      if (a > d) break;
      const float w = expf(gi - cumg[j]);
      anc[i * kCachedDist + a] = j;
      coef_u[i * kCachedDist + a] = w * dots[a].x;
      coef_o[i * kCachedDist + a] = w * dots[a].y;
      j = par[j];
    }
  };
  // A thread's own node (tid < n: every node for N <= 288) has its dots loaded with G, before the barrier.
  float2 own_dots[kCachedDist];
  if (tid < n) load_dots(tid, own_dots);
  for (int i = tid; i < n; i += kMainThreads) cumg[i] = stash_cumg[b * cg_sb + i * cg_sn + hv * cg_sh];
  if (tid == 0) {  // level sizes to level starts (the counts were added long before, behind several barriers)
    for (int d = 1; d <= max_depth + 1; ++d) level_start[d] += level_start[d - 1];
    for (int d = 0; d <= max_depth; ++d) level_fill[d] = level_start[d];
  }
  __syncthreads();
  if (tid < n) store_coefs(tid, own_dots);
  for (int i = tid + kMainThreads; i < n; i += kMainThreads) {
    float2 dots[kCachedDist];
    load_dots(i, dots);
    store_coefs(i, dots);
  }
  // Within a level nodes are independent, so the order atomics hand out there changes no value.
  for (int i = tid; i < n; i += kMainThreads) order[atomicAdd(&level_fill[dep[i]], 1)] = i;
  __syncthreads();

  // ---- u and o, level by level, a warp per node ----
  const int levels = max_depth + 1;
  for (int d = 0; d < levels; ++d) {
    for (int s = level_start[d] + warp; s < level_start[d + 1]; s += kMainWarps) {
      const int i = order[s];
      const int* anc_i = anc + i * kCachedDist;
      const float* cu_i = coef_u + i * kCachedDist;
      const float* co_i = coef_o + i * kCachedDist;
      float acc_u = 0.f, acc_o = 0.f;
      const int cached = min(d, kCachedDist - 1);
#pragma unroll 4
      for (int a = 1; a <= cached; ++a) {
        const float uj = kh[anc_i[a] * kTileV + lane];
        acc_u = fmaf(cu_i[a], uj, acc_u);
        acc_o = fmaf(co_i[a], uj, acc_o);
      }
      // Deeper than the cache: each node from the one at distance a - 1, the dots from the workspace.
      const float gi = cumg[i];
      if (d >= kCachedDist) {
        int j = anc_i[kCachedDist - 1];
        for (int a = kCachedDist; a <= d; ++a) {
          j = par[j];
          const float w = expf(gi - cumg[j]);
          const float2 x = *reinterpret_cast<const float2*>(gram_h + (static_cast<int64_t>(i) * n + a) * 2);
          const float uj = kh[j * kTileV + lane];
          acc_u = fmaf(w * x.x, uj, acc_u);
          acc_o = fmaf(w * x.y, uj, acc_o);
        }
      }
      const float decay = expf(gi);
      const float u = beta_s[i] * ((vt[i * kTileV + lane] - decay * kh[i * kTileV + lane]) - acc_u);
      const float o = decay * qh[i * kTileV + lane] + (co_i[0] * u + acc_o);
      kh[i * kTileV + lane] = u;
      if (col_ok) {
        out[b * o_sb + i * o_sn + hv * o_sh + col] = cuda::from_float<T>(o);
        stash_u[b * su_sb + i * su_sn + hv * su_sh + col] = u;
      }
    }
    __syncthreads();
  }
}

// Rows of q and k move as 4-element packs when every row starts aligned to one.
template <typename T>
bool rows_in_packs_of_4(const at::Tensor& x) {
  return x.size(3) % 4 == 0 && x.stride(0) % 4 == 0 && x.stride(1) % 4 == 0 && x.stride(2) % 4 == 0 &&
         cuda::is_aligned(x.data_ptr(), 4 * sizeof(T));
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
  const GdnMainLayout lay(static_cast<int>(n), static_cast<int>(kdim));
  const size_t prep_smem =
      prep_smem_bytes(static_cast<int>(n), static_cast<int>(kdim), static_cast<int>(value_heads / heads));
  TORCH_CHECK_VALUE(lay.total <= cuda::max_dynamic_smem() && prep_smem <= cuda::max_dynamic_smem(),
                    "tree_gated_delta_rule: N = ", n, " and K = ", kdim,
                    " need more shared memory than this GPU offers (", std::max(lay.total, prep_smem), " bytes)");
  const cudaStream_t stream = cuda::current_stream();
  // Shape-dependent workspace (never data-dependent): fine under CUDA graph capture.
  const at::Tensor gram = at::empty({bsz, heads, n, n, 2}, k.options().dtype(at::kFloat));
  const bool vec4 = rows_in_packs_of_4<T>(q) && rows_in_packs_of_4<T>(k);

  auto launch_prep = [&](auto kernel) {
    cuda::allow_dynamic_smem(kernel, prep_smem);
    const dim3 grid(static_cast<unsigned>(cuda::ceil_div(n, kPrepNodes)), static_cast<unsigned>(heads),
                    static_cast<unsigned>(bsz));
    kernel<<<grid, kPrepThreads, prep_smem, stream>>>(
        sh, q.data_ptr<T>(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr<T>(), k.stride(0), k.stride(1),
        k.stride(2), g.data_ptr<float>(), g.stride(0), g.stride(1), g.stride(2), parent.data_ptr<int32_t>(),
        parent.stride(0), parent.stride(1), stash_k.data_ptr<float>(), stash_k.stride(0), stash_k.stride(1),
        stash_k.stride(2), stash_cumg.data_ptr<float>(), stash_cumg.stride(0), stash_cumg.stride(1),
        stash_cumg.stride(2), gram.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };

  // The main kernel starts while the prep kernel runs where the GPU supports it (compute capability >= 9).
  const bool dependent_launch = at::cuda::getCurrentDeviceProperties()->major >= 9;
  const bool state_vec4 = vdim % 4 == 0 && state.stride(3) == 1 && state.stride(2) % 4 == 0 &&
                          state.stride(1) % 4 == 0 && state.stride(0) % 4 == 0 && cuda::is_aligned(state.data_ptr(), 16);
  auto launch_main = [&](auto kernel) {
    cuda::allow_dynamic_smem(kernel, lay.total);
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(static_cast<unsigned>(cuda::ceil_div(vdim, kTileV)), static_cast<unsigned>(value_heads),
                          static_cast<unsigned>(bsz));
    config.blockDim = dim3(kMainThreads);
    config.dynamicSmemBytes = lay.total;
    config.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attr;
    config.numAttrs = dependent_launch ? 1 : 0;
    C10_CUDA_CHECK(cudaLaunchKernelEx(
        &config, kernel, sh, lay, static_cast<const T*>(q.data_ptr<T>()), q.stride(0), q.stride(1), q.stride(2),
        static_cast<const T*>(k.data_ptr<T>()), k.stride(0), k.stride(1), k.stride(2),
        static_cast<const T*>(v.data_ptr<T>()), v.stride(0), v.stride(1), v.stride(2),
        static_cast<const float*>(beta.data_ptr<float>()), beta.stride(0), beta.stride(1), beta.stride(2),
        static_cast<const float*>(state.data_ptr<float>()), state.stride(0), state.stride(1), state.stride(2),
        state.stride(3), state_vec4, static_cast<const int32_t*>(parent.data_ptr<int32_t>()), parent.stride(0),
        parent.stride(1), static_cast<const float*>(stash_cumg.data_ptr<float>()), stash_cumg.stride(0),
        stash_cumg.stride(1), stash_cumg.stride(2), static_cast<const float*>(gram.data_ptr<float>()),
        out.data_ptr<T>(), out.stride(0), out.stride(1), out.stride(2), stash_u.data_ptr<float>(), stash_u.stride(0),
        stash_u.stride(1), stash_u.stride(2)));
  };

  if (vec4) {
    launch_prep(gdn_tree_prep_kernel<T, true>);
    launch_main(gdn_tree_main_kernel<T, true>);
  } else {
    launch_prep(gdn_tree_prep_kernel<T, false>);
    launch_main(gdn_tree_main_kernel<T, false>);
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
