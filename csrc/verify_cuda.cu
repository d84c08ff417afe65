// CUDA implementations of the verify ops: GDN's short causal conv and the gated delta rule on a
// tree. Semantics: ddtree_ext/reference.py; the parallel form of the GDN recurrence: DESIGN.md §4.
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
// Three launches; the committed state H0 is read once (by the third) and no per-node state is formed.
// Queries are normalised where they are used (kernels 2 and 3) by the same arithmetic, bit for bit.
//  1. normalize_keys   stash_k = l2-normalised k (one warp per (b, node, key head)).
//  2. tree_gram        per (b, node i): G_i (cumulative log decay, root first, = stash_cumg) and, for
//                      each key head and each node j on the path root..i, k_i.k_j and (scale q_i).k_j
//                      into a workspace [B, H, N, N, 2] indexed by the distance a from i to j.
//  3. tree_gdn_main    per (b, value head, tile of 32 value columns):
//                        KH = K H0, QH = Q H0 for all nodes (fp32 FMA from shared memory);
//                        u_i = beta_i (v_i - e^{G_i} KH_i - sum_{j strict anc} e^{G_i-G_j} (k_i.k_j) u_j),
//                          level by level (a node depends on its ancestors only);
//                        o_i = e^{G_i} QH_i + sum_{j in root..i} e^{G_i-G_j} (q_i.k_j) u_j.
// Exponents are only ever formed as G_i - G_j with j an ancestor of i (<= 0 for log decays <= 0).

constexpr int kNormThreads = 256;
constexpr int kGramThreads = 128;
constexpr int kGdnThreads = 256;
constexpr int kGdnTileV = 32;        // value columns per block: one per lane
constexpr int kGdnChunk = 32;        // nodes per GEMM chunk (32 key rows + 32 query rows)
constexpr int kGdnCachedDist = 16;   // ancestor distances 0..16 cached in shared memory; deeper ones are read back

// 1 / ||row|| as every kernel here computes it (same lanes, same butterfly), or 1 without l2norm;
// a normalised query is ((x * inv) * scale), a normalised key x * inv.
template <typename T>
__device__ __forceinline__ float row_inv_norm(const T* row, int kdim, int lane, bool l2norm) {
  return l2norm ? cuda::inv_l2_norm(cuda::warp_sum_squares(row, kdim, lane), kL2NormEps) : 1.f;
}

// Copies rows of kdim elements into shared-memory rows of length ld (zero-padded; a null row is all
// zeros) as float, every thread of the block issuing independent loads so that many are in flight.
template <int THREADS, typename T, typename RowPtr>
__device__ __forceinline__ void stage_rows(float* dst, int ld, int rows, int kdim, RowPtr row_ptr) {
  const int total = rows * ld;
#pragma unroll 4
  for (int e = threadIdx.x; e < total; e += THREADS) {
    const int r = e / ld, c = e % ld;
    const T* src = row_ptr(r);
    dst[e] = src != nullptr && c < kdim ? cuda::to_float(src[c]) : 0.f;
  }
}

// Scales staged query rows [r0, r1) in place to ((x * inv) * scale), one warp per row; inv comes from
// row_inv_norm on the staged (exactly converted) values, so every kernel gets the same bits.
template <int THREADS>
__device__ __forceinline__ void normalise_staged_queries(float* rows, int ld, int r0, int r1, int kdim, bool l2norm,
                                                         float scale) {
  const int lane = threadIdx.x % kWarp;
  for (int r = r0 + static_cast<int>(threadIdx.x) / kWarp; r < r1; r += THREADS / kWarp) {
    float* row = rows + r * ld;
    const float inv = row_inv_norm(row, kdim, lane, l2norm);
    for (int e = lane; e < kdim; e += kWarp) row[e] = (row[e] * inv) * scale;
  }
}

template <typename T>
__global__ void __launch_bounds__(kNormThreads) gdn_normalize_keys_kernel(
    const T* __restrict__ k, int64_t k_sb, int64_t k_sn, int64_t k_sh, int num_nodes, int heads, int kdim, bool l2norm,
    int64_t rows, float* __restrict__ stash_k, int64_t sk_sb, int64_t sk_sn, int64_t sk_sh) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kNormThreads / kWarp) + threadIdx.x / kWarp;
  if (row >= rows) return;
  const int h = static_cast<int>(row % heads);
  const int i = static_cast<int>((row / heads) % num_nodes);
  const int64_t b = row / heads / num_nodes;
  const T* src = k + b * k_sb + i * k_sn + h * k_sh;
  float* dst = stash_k + b * sk_sb + i * sk_sn + h * sk_sh;
  const float inv = row_inv_norm(src, kdim, lane, l2norm);
  for (int e = lane; e < kdim; e += kWarp) dst[e] = cuda::to_float(src[e]) * inv;
}

struct GdnShapes {
  int num_nodes, heads, value_heads, kdim, vdim;
  float scale;
  bool l2norm;
};

// Row length of a [H][K] block of k_i / q_i in the gram kernel's shared memory: 16-byte rows.
__host__ __device__ inline int gram_row(int kdim) { return (kdim + 3) / 4 * 4 + 4; }

__host__ __device__ inline size_t gram_smem_bytes(int n, int heads, int kdim) {
  return sizeof(int) * 2 * n + sizeof(float) * 2 * heads * gram_row(kdim);
}

template <typename T, bool VEC4>
__global__ void __launch_bounds__(kGramThreads) gdn_tree_gram_kernel(
    GdnShapes sh, const T* __restrict__ q, int64_t q_sb, int64_t q_sn, int64_t q_sh, const float* __restrict__ g,
    int64_t g_sb, int64_t g_sn, int64_t g_sh, const int32_t* __restrict__ parent, int64_t pa_sb, int64_t pa_sn,
    const float* __restrict__ stash_k, int64_t sk_sb, int64_t sk_sn, int64_t sk_sh, float* __restrict__ stash_cumg,
    int64_t cg_sb, int64_t cg_sn, int64_t cg_sh, float* __restrict__ gram) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int n = sh.num_nodes, kdim = sh.kdim, krow = gram_row(kdim);
  const int i = blockIdx.x, b = blockIdx.y;
  float* qn = reinterpret_cast<float*>(smem_raw);                  // [H][krow] scale * normalised q_i
  float* kn = qn + sh.heads * krow;                                 // [H][krow] normalised k_i
  int* par = reinterpret_cast<int*>(kn + sh.heads * krow);         // [N]
  int* path = par + n;                                              // path[a] = a-th ancestor of i
  __shared__ int path_len;
  const int tid = threadIdx.x;

  for (int j = tid; j <= i; j += kGramThreads) par[j] = cuda::checked_parent(parent[b * pa_sb + j * pa_sn], j);
  stage_rows<kGramThreads, T>(qn, krow, sh.heads, kdim, [&](int h) { return q + b * q_sb + i * q_sn + h * q_sh; });
  stage_rows<kGramThreads, float>(kn, krow, sh.heads, kdim,
                                  [&](int h) { return stash_k + b * sk_sb + i * sk_sn + h * sk_sh; });
  __syncthreads();
  normalise_staged_queries<kGramThreads>(qn, krow, 0, sh.heads, kdim, sh.l2norm, sh.scale);
  __syncthreads();
  if (tid == 0) {
    int len = 0;
    for (int j = i; j >= 0; j = par[j]) path[len++] = j;
    path_len = len;
  }
  __syncthreads();
  const int len = path_len;

  // Cumulative log decay summed root first, as the recurrence accumulates it.
  for (int hv = tid; hv < sh.value_heads; hv += kGramThreads) {
    float acc = 0.f;
    for (int a = len - 1; a >= 0; --a) acc += g[b * g_sb + path[a] * g_sn + hv * g_sh];
    stash_cumg[b * cg_sb + i * cg_sn + hv * cg_sh] = acc;
  }
  const int pairs = sh.heads * len;
  for (int p = tid; p < pairs; p += kGramThreads) {
    const int h = p / len, a = p % len;
    const float* kj = stash_k + b * sk_sb + path[a] * sk_sn + h * sk_sh;
    const float* ki = kn + h * krow;
    const float* qi = qn + h * krow;
    float kk = 0.f, qk = 0.f;
    if constexpr (VEC4) {
#pragma unroll 8
      for (int e = 0; e < kdim; e += 4) {
        const float4 x = *reinterpret_cast<const float4*>(kj + e);
        const float4 ka = *reinterpret_cast<const float4*>(ki + e);
        const float4 qa = *reinterpret_cast<const float4*>(qi + e);
        kk = fmaf(ka.x, x.x, kk);
        kk = fmaf(ka.y, x.y, kk);
        kk = fmaf(ka.z, x.z, kk);
        kk = fmaf(ka.w, x.w, kk);
        qk = fmaf(qa.x, x.x, qk);
        qk = fmaf(qa.y, x.y, qk);
        qk = fmaf(qa.z, x.z, qk);
        qk = fmaf(qa.w, x.w, qk);
      }
    } else {
#pragma unroll 8
      for (int e = 0; e < kdim; ++e) {
        const float x = kj[e];
        kk = fmaf(ki[e], x, kk);
        qk = fmaf(qi[e], x, qk);
      }
    }
    float* dst = gram + ((((static_cast<int64_t>(b) * sh.heads + h) * n + i) * n + a) * 2);
    dst[0] = kk;
    dst[1] = qk;
  }
}

// Shared-memory plan of tree_gdn_main (floats unless noted), sized from N and K at launch.
struct GdnMainLayout {
  int kpad;        // row length of the staged k/q rows: >= K, a multiple of 4, (kpad / 4) odd (no bank conflicts)
  int krows;       // rows of the H0 tile: K rounded up to 4
  size_t h0, u, qh, decay, beta, parent, depth, order, level_start, scratch, total;  // byte offsets

  GdnMainLayout(int n, int kdim) {
    krows = (kdim + 3) / 4 * 4;
    kpad = krows % 8 == 0 ? krows + 4 : krows;
    const int dist = kGdnCachedDist + 1;
    size_t off = 0;
    auto take = [&](size_t bytes) {
      const size_t at = off;
      off += (bytes + 15) / 16 * 16;
      return at;
    };
    h0 = take(sizeof(float) * krows * kGdnTileV);
    u = take(sizeof(float) * n * kGdnTileV);
    qh = take(sizeof(float) * n * kGdnTileV);
    decay = take(sizeof(float) * n);
    beta = take(sizeof(float) * n);
    parent = take(sizeof(int) * n);
    depth = take(sizeof(int) * n);
    order = take(sizeof(int) * n);
    level_start = take(sizeof(int) * (n + 2));
    // The GEMM staging rows and, after the GEMM, the cached ancestor coefficients share one region.
    const size_t staging = sizeof(float) * 2 * kGdnChunk * kpad;
    const size_t coeffs = (2 * sizeof(float) + sizeof(int)) * static_cast<size_t>(n) * dist;
    scratch = take(staging > coeffs ? staging : coeffs);
    total = off;
  }
};

// KH and QH for one chunk: thread (rg, cg) accumulates staged rows rg + 16 m (m = 0, 1: keys of nodes
// c0 + rg, c0 + rg + 16; m = 2, 3: their queries) against H0 columns 2 cg, 2 cg + 1. Rows are float4
// loads with (kpad / 4) odd, so the 8 rows a quarter-warp reads fall in distinct banks. HALF skips
// m = 1, 3 (nodes c0 + 16.. of a tail chunk that has none).
template <bool HALF>
__device__ __forceinline__ void chunk_gemm(const float* stage, int kpad, const float* h0, int krows, int rg, int cg,
                                           float (&acc)[4][2]) {
  for (int k0 = 0; k0 < krows; k0 += 4) {
    float4 a[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      if (HALF && (m & 1)) continue;
      a[m] = *reinterpret_cast<const float4*>(stage + (rg + 16 * m) * kpad + k0);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 hb = *reinterpret_cast<const float2*>(h0 + (k0 + e) * kGdnTileV + 2 * cg);
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        if (HALF && (m & 1)) continue;
        const float ae = e == 0 ? a[m].x : e == 1 ? a[m].y : e == 2 ? a[m].z : a[m].w;
        acc[m][0] = fmaf(ae, hb.x, acc[m][0]);
        acc[m][1] = fmaf(ae, hb.y, acc[m][1]);
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kGdnThreads) gdn_tree_main_kernel(
    GdnShapes sh, GdnMainLayout lay, const T* __restrict__ q, int64_t q_sb, int64_t q_sn, int64_t q_sh,
    const T* __restrict__ v, int64_t v_sb, int64_t v_sn, int64_t v_sh, const float* __restrict__ beta,
    int64_t be_sb, int64_t be_sn, int64_t be_sh, const float* __restrict__ state, int64_t st_sb, int64_t st_sh,
    int64_t st_sk, int64_t st_sv, const int32_t* __restrict__ parent, int64_t pa_sb, int64_t pa_sn,
    const float* __restrict__ stash_k, int64_t sk_sb, int64_t sk_sn, int64_t sk_sh,
    const float* __restrict__ stash_cumg, int64_t cg_sb, int64_t cg_sn, int64_t cg_sh,
    const float* __restrict__ gram, T* __restrict__ out, int64_t o_sb, int64_t o_sn, int64_t o_sh,
    float* __restrict__ stash_u, int64_t su_sb, int64_t su_sn, int64_t su_sh) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* h0 = reinterpret_cast<float*>(smem_raw + lay.h0);       // [krows][32]
  float* u = reinterpret_cast<float*>(smem_raw + lay.u);         // [N][32]: v - e^G KH, then u
  float* qh = reinterpret_cast<float*>(smem_raw + lay.qh);       // [N][32]: e^G QH
  float* cumg = reinterpret_cast<float*>(smem_raw + lay.decay);  // [N]
  float* beta_s = reinterpret_cast<float*>(smem_raw + lay.beta); // [N]
  int* par = reinterpret_cast<int*>(smem_raw + lay.parent);      // [N]
  int* dep = reinterpret_cast<int*>(smem_raw + lay.depth);       // [N]
  int* order = reinterpret_cast<int*>(smem_raw + lay.order);     // [N] nodes sorted by depth
  int* level_start = reinterpret_cast<int*>(smem_raw + lay.level_start);  // [N + 2]
  float* stage = reinterpret_cast<float*>(smem_raw + lay.scratch);        // [64][kpad] during the GEMM
  constexpr int kDist = kGdnCachedDist + 1;
  float* coef_u = stage;                                                  // [N][kDist] after the GEMM
  float* coef_o = coef_u + sh.num_nodes * kDist;                          // [N][kDist]
  int* anc = reinterpret_cast<int*>(coef_o + sh.num_nodes * kDist);      // [N][kDist]
  __shared__ int max_depth;

  const int n = sh.num_nodes, kdim = sh.kdim, kpad = lay.kpad;
  const int v0 = blockIdx.x * kGdnTileV, hv = blockIdx.y, b = blockIdx.z;
  const int h = hv / (sh.value_heads / sh.heads);
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  constexpr int kWarps = kGdnThreads / kWarp;
  const int col = v0 + lane;
  const bool col_ok = col < sh.vdim;

  // ---- tree structure, decays, H0 tile ----
  if (tid == 0) max_depth = 0;
  for (int i = tid; i < n + 2; i += kGdnThreads) level_start[i] = 0;
  for (int i = tid; i < n; i += kGdnThreads) {
    par[i] = cuda::checked_parent(parent[b * pa_sb + i * pa_sn], i);
    cumg[i] = stash_cumg[b * cg_sb + i * cg_sn + hv * cg_sh];
    beta_s[i] = beta[b * be_sb + i * be_sn + hv * be_sh];
  }
  const float* h0_src = state + b * st_sb + hv * st_sh;
#pragma unroll 4
  for (int e = tid; e < lay.krows * kGdnTileV; e += kGdnThreads) {
    const int r = e / kGdnTileV, c = v0 + e % kGdnTileV;
    h0[e] = r < kdim && c < sh.vdim ? h0_src[r * st_sk + c * st_sv] : 0.f;
  }
  __syncthreads();
  for (int i = tid; i < n; i += kGdnThreads) {
    int d = 0;
    for (int j = par[i]; j >= 0; j = par[j]) ++d;
    dep[i] = d;
    atomicMax(&max_depth, d);
    atomicAdd(&level_start[d + 1], 1);
  }
  __syncthreads();
  if (tid == 0) {
    for (int d = 1; d <= max_depth + 1; ++d) level_start[d] += level_start[d - 1];
  }
  __syncthreads();
  // Within a level nodes are independent, so the order atomics hand out there changes no value.
  for (int i = tid; i < n; i += kGdnThreads) order[atomicAdd(&level_start[dep[i]], 1)] = i;
  __syncthreads();
  // The scatter advanced each level_start[d] to the start of level d + 1; shift back.
  if (tid == 0) {
    for (int d = max_depth + 1; d > 0; --d) level_start[d] = level_start[d - 1];
    level_start[0] = 0;
  }

  // ---- KH and QH by chunks of 32 nodes ----
  const int rg = tid % 16, cg = tid / 16;  // rows rg + 16 m (m = 0..3), columns 2 cg, 2 cg + 1
  for (int c0 = 0; c0 < n; c0 += kGdnChunk) {
    __syncthreads();  // previous chunk's reads of the staging rows are done
    stage_rows<kGdnThreads, float>(stage, kpad, kGdnChunk, kdim, [&](int r) {
      return c0 + r < n ? stash_k + b * sk_sb + (c0 + r) * sk_sn + h * sk_sh : nullptr;
    });
    stage_rows<kGdnThreads, T>(stage + kGdnChunk * kpad, kpad, kGdnChunk, kdim, [&](int r) {
      return c0 + r < n ? q + b * q_sb + (c0 + r) * q_sn + h * q_sh : nullptr;
    });
    __syncthreads();
    normalise_staged_queries<kGdnThreads>(stage, kpad, kGdnChunk, 2 * kGdnChunk, kdim, sh.l2norm, sh.scale);
    __syncthreads();
    float acc[4][2] = {};
    if (n - c0 > kGdnChunk / 2) {
      chunk_gemm<false>(stage, kpad, h0, lay.krows, rg, cg, acc);
    } else {
      chunk_gemm<true>(stage, kpad, h0, lay.krows, rg, cg, acc);  // tail of <= 16 nodes: half the rows
    }
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int i = c0 + rg + 16 * (m % 2);
      if (i >= n) continue;  // also skips the rows a half chunk left out
      const float decay = expf(cumg[i]);
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int lc = 2 * cg + c;
        if (m < 2) {
          const float vi = v0 + lc < sh.vdim ? cuda::to_float(v[b * v_sb + i * v_sn + hv * v_sh + v0 + lc]) : 0.f;
          u[i * kGdnTileV + lc] = vi - decay * acc[m][c];
        } else {
          qh[i * kGdnTileV + lc] = decay * acc[m][c];
        }
      }
    }
  }
  __syncthreads();  // staging rows are dead from here on: the region now holds the coefficients

  // ---- ancestor coefficients e^{G_i - G_j} (k_i.k_j) and e^{G_i - G_j} (q_i.k_j), distance a <= 16 ----
  const float* gram_h = gram + (static_cast<int64_t>(b) * sh.heads + h) * n * n * 2;
  for (int i = tid; i < n; i += kGdnThreads) {
    const float gi = cumg[i];
    int j = i;
    for (int a = 0; a < kDist && j >= 0; ++a, j = par[j]) {
      const float w = expf(gi - cumg[j]);
      const float* gr = gram_h + (static_cast<int64_t>(i) * n + a) * 2;
      anc[i * kDist + a] = j;
      coef_u[i * kDist + a] = w * gr[0];
      coef_o[i * kDist + a] = w * gr[1];
    }
  }
  __syncthreads();

  // The node at distance a from i and its coefficient (u: e^{G_i - G_j} k_i.k_j, else e^{G_i - G_j} q_i.k_j),
  // from the cache, or for a > 16 from the node at distance a - 1 (`prev`) and the workspace.
  struct Term {
    float coef;
    int node;
  };
  auto ancestor_term = [&](int i, int a, int prev, bool for_u) -> Term {
    if (a < kDist) return {for_u ? coef_u[i * kDist + a] : coef_o[i * kDist + a], anc[i * kDist + a]};
    const int j = par[prev];
    const float w = expf(cumg[i] - cumg[j]);
    return {w * gram_h[(static_cast<int64_t>(i) * n + a) * 2 + (for_u ? 0 : 1)], j};
  };

  // ---- u, level by level ----
  for (int d = 0; d <= max_depth; ++d) {
    const int start = level_start[d], count = level_start[d + 1] - start;
    for (int s = warp; s < count; s += kWarps) {
      const int i = order[start + s];
      float acc = 0.f;
      int j = i;
      for (int a = 1; a <= d; ++a) {
        const Term t = ancestor_term(i, a, j, true);
        j = t.node;
        acc = fmaf(t.coef, u[j * kGdnTileV + lane], acc);
      }
      u[i * kGdnTileV + lane] = beta_s[i] * (u[i * kGdnTileV + lane] - acc);
    }
    __syncthreads();
  }

  // ---- outputs ----
  for (int i = warp; i < n; i += kWarps) {
    float o = qh[i * kGdnTileV + lane];
    int j = i;
    for (int a = 0; a <= dep[i]; ++a) {
      const Term t = ancestor_term(i, a, j, false);
      j = t.node;
      o = fmaf(t.coef, u[j * kGdnTileV + lane], o);
    }
    if (col_ok) {
      out[b * o_sb + i * o_sn + hv * o_sh + col] = cuda::from_float<T>(o);
      stash_u[b * su_sb + i * su_sn + hv * su_sh + col] = u[i * kGdnTileV + lane];
    }
  }
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
  const size_t gram_smem = gram_smem_bytes(static_cast<int>(n), static_cast<int>(heads), static_cast<int>(kdim));
  TORCH_CHECK_VALUE(lay.total <= cuda::max_dynamic_smem() && gram_smem <= cuda::max_dynamic_smem(),
                    "tree_gated_delta_rule: N = ", n, " and K = ", kdim,
                    " need more shared memory than this GPU offers (", lay.total, " bytes)");
  const cudaStream_t stream = cuda::current_stream();

  const int64_t key_rows = bsz * n * heads;
  constexpr int64_t kRowsPerBlock = kNormThreads / kWarp;
  gdn_normalize_keys_kernel<T><<<static_cast<unsigned>(cuda::ceil_div(key_rows, kRowsPerBlock)), kNormThreads, 0,
                                 stream>>>(k.data_ptr<T>(), k.stride(0), k.stride(1), k.stride(2), static_cast<int>(n),
                                           static_cast<int>(heads), static_cast<int>(kdim), use_qk_l2norm, key_rows,
                                           stash_k.data_ptr<float>(), stash_k.stride(0), stash_k.stride(1),
                                           stash_k.stride(2));
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  // Shape-dependent workspace (never data-dependent): fine under CUDA graph capture.
  const at::Tensor gram = at::empty({bsz, heads, n, n, 2}, k.options().dtype(at::kFloat));
  // Ancestor key rows as float4 when every row of stash_k starts 16-byte aligned.
  const bool vec4 = kdim % 4 == 0 && stash_k.stride(0) % 4 == 0 && stash_k.stride(1) % 4 == 0 &&
                    stash_k.stride(2) % 4 == 0 && cuda::is_aligned(stash_k.data_ptr(), 16);
  auto launch_gram = [&](auto kernel) {
    cuda::allow_dynamic_smem(kernel, gram_smem);
    kernel<<<dim3(static_cast<unsigned>(n), static_cast<unsigned>(bsz)), kGramThreads, gram_smem, stream>>>(
        sh, q.data_ptr<T>(), q.stride(0), q.stride(1), q.stride(2), g.data_ptr<float>(), g.stride(0), g.stride(1),
        g.stride(2), parent.data_ptr<int32_t>(), parent.stride(0), parent.stride(1), stash_k.data_ptr<float>(),
        stash_k.stride(0), stash_k.stride(1), stash_k.stride(2), stash_cumg.data_ptr<float>(), stash_cumg.stride(0),
        stash_cumg.stride(1), stash_cumg.stride(2), gram.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (vec4) {
    launch_gram(gdn_tree_gram_kernel<T, true>);
  } else {
    launch_gram(gdn_tree_gram_kernel<T, false>);
  }

  cuda::allow_dynamic_smem(gdn_tree_main_kernel<T>, lay.total);
  const dim3 grid(static_cast<unsigned>(cuda::ceil_div(vdim, kGdnTileV)), static_cast<unsigned>(value_heads),
                  static_cast<unsigned>(bsz));
  gdn_tree_main_kernel<T><<<grid, kGdnThreads, lay.total, stream>>>(
      sh, lay, q.data_ptr<T>(), q.stride(0), q.stride(1), q.stride(2), v.data_ptr<T>(), v.stride(0), v.stride(1),
      v.stride(2), beta.data_ptr<float>(), beta.stride(0), beta.stride(1), beta.stride(2), state.data_ptr<float>(),
      state.stride(0), state.stride(1), state.stride(2), state.stride(3), parent.data_ptr<int32_t>(),
      parent.stride(0), parent.stride(1), stash_k.data_ptr<float>(), stash_k.stride(0), stash_k.stride(1),
      stash_k.stride(2), stash_cumg.data_ptr<float>(), stash_cumg.stride(0), stash_cumg.stride(1),
      stash_cumg.stride(2), gram.data_ptr<float>(), out.data_ptr<T>(), out.stride(0), out.stride(1), out.stride(2),
      stash_u.data_ptr<float>(), stash_u.stride(0), stash_u.stride(1), stash_u.stride(2));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
