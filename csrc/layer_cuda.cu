// CUDA implementations of the layer-body ops (csrc/layer.cpp has the CPU twins and the rounding points).
//
// Each op is one launch where Hugging Face runs a chain of small kernels. They matter in a decode round
// replayed from a CUDA graph, where every small kernel still costs its GPU time: on the H200 a 27B-shaped
// RMSNorm took 16 us as HF's chain and 2.8 us as one launch (benchmarks/results/2026-11-29-h200-layer-ops.md).
//
// rms_norm gives each row a group of threads: half a warp or a warp when the row is short (GDN value heads: 128
// features, attention heads: 128-256), a 256-thread block when it is a hidden state (thousands). A thread keeps its
// chunks of the row in registers between the sum of squares and the output (kCachedChunks).
//
// Determinism: an op's bits never depend on the alignment of its inputs (a captured graph and an eager
// call may see the same data at different addresses): the reducing kernels assign elements to threads by
// 16-byte chunks and only the load instruction differs between aligned and unaligned inputs.
#include "activations.h"
#include "cuda_common.cuh"
#include "ops.h"

namespace ddtree {
namespace {

using cuda::from_float;
using cuda::to_float;

constexpr int kThreads = 256;
constexpr int kLongRowFeatures = 1024;  // rows longer than this get a whole block

// A chunk of N consecutive elements (16 bytes of T), as one aligned access (PACKED) or element by element
// (the first `valid`, zeros after). Kernels that reduce assign work to threads by chunks, whichever way
// they load them, so the sums run in the same order, and give the same bits, on aligned and unaligned
// inputs alike.
template <typename T, int N, bool PACKED>
__device__ __forceinline__ void load_chunk(const T* p, int valid, float (&out)[N]) {
  if constexpr (PACKED) {
    cuda::load_pack_float<T, N>(p, out);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = e < valid ? to_float(p[e]) : 0.f;
  }
}

template <typename T, int N, bool PACKED>
__device__ __forceinline__ void store_chunk(T* p, int valid, const float (&in)[N]) {
  if constexpr (PACKED) {
    cuda::store_pack_float<T, N>(p, in);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      if (e < valid) p[e] = from_float<T>(in[e]);
    }
  }
}

template <typename T>
struct RmsNormArgs {
  const T* x;
  const T* gate;  // nullptr: no gate
  const T* weight;
  T* out;
  RowLayout x_rows, gate_rows;  // x's and the gate's rows: [rows, D] or groups of rows [G, R, D]
  int64_t out_stride, rows;
  int dim;
  float eps, inv_dim;
  bool zero_centered;
  // add_rms_norm: the row normalised is round(x + residual), written to sum_out (nullptr: plain rms_norm).
  const T* residual;
  T* sum_out;
  int64_t residual_stride, sum_stride;
};

// A thread's first kCachedChunks chunks of its row (1 in a warp's row) stay in registers between the sum of squares
// and the output pass, with their weights and gate values, all loaded before the first use: a row costs one round
// trip to memory instead of two (at 1 row a 27B-shaped norm is latency bound, and the output pass waited for the
// weights, and in add_rms_norm for the sums it had just stored). Chunks past that (rows longer than kCachedChunks x
// GROUP chunks) are read again in the output pass. Either way the sums run over the chunks in the same order: the
// same bits.
constexpr int kCachedChunks = 4;

// v = the chunk of x at i, or round(x + residual) there when there is a residual (add_rms_norm).
template <typename T, int C, bool PACKED>
__device__ __forceinline__ void load_input_chunk(const T* x, const T* residual, int i, int dim, float (&v)[C]) {
  load_chunk<T, C, PACKED>(x + i, dim - i, v);
  if (residual != nullptr) {
    float r[C];
    load_chunk<T, C, PACKED>(residual + i, dim - i, r);
#pragma unroll
    for (int e = 0; e < C; ++e) v[e] = round_to<T>(v[e] + r[e]);
  }
}

// y = the output of one chunk from its (summed) input v, weight w and gate g.
template <typename T, int C>
__device__ __forceinline__ void rms_norm_chunk(const float (&v)[C], const float (&w)[C], const float (&g)[C],
                                               bool gated, bool zero_centered, float inv_rms, float (&y)[C]) {
  if (zero_centered) {
#pragma unroll
    for (int e = 0; e < C; ++e) y[e] = v[e] * inv_rms * (1.f + w[e]);
  } else {
#pragma unroll
    for (int e = 0; e < C; ++e) y[e] = w[e] * round_to<T>(v[e] * inv_rms);
    if (gated) {
#pragma unroll
      for (int e = 0; e < C; ++e) y[e] = round_to<T>(y[e]) * silu(g[e]);
    }
  }
}

// GROUP threads per row (half a warp, a warp or the whole block); thread t takes the row's chunks t, t + GROUP, ...
template <typename T, int GROUP, bool PACKED>
__global__ void __launch_bounds__(kThreads) rms_norm_kernel(const RmsNormArgs<T> p) {
  constexpr int kRowsPerBlock = kThreads / GROUP;
  constexpr int kWarpsPerGroup = GROUP >= cuda::kWarp ? GROUP / cuda::kWarp : 1;
  constexpr int C = 16 / sizeof(T);
  // A warp's rows are heads (128-256 features: one chunk per lane in 16-bit dtypes); more cached chunks there cost
  // registers, and at 65 rows x 48 heads the 390 blocks then took two waves (measured: 3.6 against 2.9 us a call).
  constexpr int K = GROUP <= cuda::kWarp ? 1 : kCachedChunks;
  __shared__ float partial[kRowsPerBlock][kWarpsPerGroup];
  const int slot = threadIdx.x / GROUP, t = threadIdx.x % GROUP;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + slot;
  const bool active = row < p.rows;  // inactive threads still take part in the block's barrier
  const T* x = p.x + (active ? row_offset(p.x_rows, row) : 0);
  const T* residual = p.residual != nullptr && active ? p.residual + row * p.residual_stride : nullptr;
  T* sum_out = p.sum_out != nullptr && active ? p.sum_out + row * p.sum_stride : nullptr;
  const T* gate = p.gate != nullptr && active ? p.gate + row_offset(p.gate_rows, row) : nullptr;

  // Launched as a programmatic dependent (launch_rms_norm): until the kernel ahead of it (which writes x) is done,
  // start moving this row's weights, residual and gate into L2. In a decoder layer the residual is a layer old, and
  // back in DRAM once the layer's weights have streamed through L2. A prefetch loads no register, so it is safe
  // even for data that kernel is still writing; every load and store comes after the wait.
  cuda::allow_dependent_launch();
  if (active) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = (t + k * GROUP) * C;
      if (i < p.dim) {
        cuda::prefetch_l2(p.weight + i);
        if (residual != nullptr) cuda::prefetch_l2(residual + i);
        if (gate != nullptr) cuda::prefetch_l2(gate + i);
      }
    }
  }
  cuda::wait_for_preceding_grid();

  float v[K][C], w[K][C], g[K][C];
  float sum = 0.f;
  if (active) {
    // Every load first (the sums' stores below could alias a later chunk's input, so they come after).
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = (t + k * GROUP) * C;
      if (i < p.dim) {
        load_input_chunk<T, C, PACKED>(x, residual, i, p.dim, v[k]);
        load_chunk<T, C, PACKED>(p.weight + i, p.dim - i, w[k]);
        if (gate != nullptr) load_chunk<T, C, PACKED>(gate + i, p.dim - i, g[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = (t + k * GROUP) * C;
      if (i < p.dim) {
        if (sum_out != nullptr) store_chunk<T, C, PACKED>(sum_out + i, p.dim - i, v[k]);
#pragma unroll
        for (int e = 0; e < C; ++e) sum = fmaf(v[k][e], v[k][e], sum);
      }
    }
    for (int i = (t + K * GROUP) * C; i < p.dim; i += GROUP * C) {
      float u[C];
      load_input_chunk<T, C, PACKED>(x, residual, i, p.dim, u);
      if (sum_out != nullptr) store_chunk<T, C, PACKED>(sum_out + i, p.dim - i, u);
#pragma unroll
      for (int e = 0; e < C; ++e) sum = fmaf(u[e], u[e], sum);
    }
    // The output pass reads uncached sums back: this thread wrote exactly the chunks it will read (same-thread
    // order makes them visible), and sum_out may be x or the residual itself.
    if (sum_out != nullptr) x = sum_out;
  }
  // Half a warp's rows sum over their 16 lanes: the bits a whole warp gave them, whose other lanes only added zeros.
  sum = cuda::warp_sum<(GROUP < cuda::kWarp ? GROUP : cuda::kWarp)>(sum);
  if (kWarpsPerGroup > 1) {
    if (t % cuda::kWarp == 0) partial[slot][t / cuda::kWarp] = sum;
    __syncthreads();
    sum = 0.f;
#pragma unroll
    for (int q = 0; q < kWarpsPerGroup; ++q) sum += partial[slot][q];  // same order in every thread
  }
  if (!active) return;
  // torch.rsqrt on CUDA is rsqrtf; the mean is the sum times 1/n as in torch's reduction, rounded before the
  // eps is added (no FMA contraction: torch runs the two as separate kernels).
  const float inv_rms = rsqrtf(__fadd_rn(__fmul_rn(sum, p.inv_dim), p.eps));
  T* out = p.out + row * p.out_stride;
  const bool gated = gate != nullptr;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int i = (t + k * GROUP) * C;
    if (i < p.dim) {
      float y[C];
      rms_norm_chunk<T, C>(v[k], w[k], g[k], gated, p.zero_centered, inv_rms, y);
      store_chunk<T, C, PACKED>(out + i, p.dim - i, y);
    }
  }
  for (int i = (t + K * GROUP) * C; i < p.dim; i += GROUP * C) {
    const int valid = p.dim - i;
    float u[C], wu[C], gu[C], y[C];
    load_chunk<T, C, PACKED>(x + i, valid, u);
    load_chunk<T, C, PACKED>(p.weight + i, valid, wu);
    if (gated) load_chunk<T, C, PACKED>(gate + i, valid, gu);
    rms_norm_chunk<T, C>(u, wu, gu, gated, p.zero_centered, inv_rms, y);
    store_chunk<T, C, PACKED>(out + i, valid, y);
  }
}

// RoPE's output at e from x[e], its rotate-half partner (negated in the first half of the rotary width), cos[e] and
// sin[e]. Explicit roundings: nvcc would otherwise contract the products and the sum into one FMA, which HF's separate
// multiply and add kernels do not do (visible in float32).
template <typename T>
__device__ __forceinline__ T rope_element(float x, float rotated, float c, float s) {
  return from_float<T>(__fadd_rn(round_to<T>(__fmul_rn(x, c)), round_to<T>(__fmul_rn(rotated, s))));
}

// One thread per output element; a row is one (batch, head, node). rotate_half(x)[e] is -x[e + R/2] in the
// first half of the rotary width and x[e - R/2] in the second.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(const T* x, const T* cos, const T* sin, T* out, int64_t xs0, int64_t xs1, int64_t xs2, int64_t cs0,
                int64_t cs1, int64_t ss0, int64_t ss1, int64_t os0, int64_t os1, int64_t os2, int64_t heads, int64_t n,
                int dim, int rot, int64_t total) {
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();  // launched as a programmatic dependent: nothing read or written before
  const int half = rot / 2;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int e = static_cast<int>(idx % dim);
    const int64_t row = idx / dim, i = row % n, h = (row / n) % heads, b = row / (n * heads);
    const T* xr = x + b * xs0 + h * xs1 + i * xs2;
    T* o = out + b * os0 + h * os1 + i * os2;
    if (e >= rot) {
      o[e] = xr[e];
      continue;
    }
    const float c = to_float(cos[b * cs0 + i * cs1 + e]), s = to_float(sin[b * ss0 + i * ss1 + e]);
    const float rotated = e < half ? -to_float(xr[e + half]) : to_float(xr[e - half]);
    o[e] = rope_element<T>(to_float(xr[e]), rotated, c, s);
  }
}

// qk_norm_rope: an attention layer's q_norm and k_norm and the RoPE after them in one launch, where HF (and the
// separate ops) run four: rms_norm of q's heads, of k's, then rope of each. A row is one head of one node, of q
// (the first q_rows rows) or k (the next k_rows), in the output's (batch, head, node) order. STORE
// (qk_norm_rope_store_kv): k's output rows, and v's rows after them (copied as they are), go to cache slot
// slots[b, node] instead of node, as store_kv stores them: the K/V store is the same launch.
template <typename T>
struct QkNormRopeArgs {
  const T* x[3];  // q, k, v [B, N, H, D] (v: STORE only)
  const T* weight[3];   // q's, k's, k's again for v (its rows are not normed: their sums are computed and unused)
  T* out[3];            // q_out [B, Hq, N, D]; k_out [B, Hk, N, D], or with STORE the caches keys, values [B, Hk, S, D]
  int64_t x_stride[3][3];    // of b, n, h
  int64_t out_stride[3][3];  // of b, h, n (the cache's slot with STORE)
  const T* cos;
  const T* sin;
  int64_t cos_stride[2], sin_stride[2];  // of b, n
  const int64_t* slots;  // STORE: [B, N] (slots_sb = its row stride) or [N] (slots_sb = 0); a negative slot stores nothing
  int64_t slots_sb, cache_len;
  int n, heads_q, heads_k, q_rows, k_rows, rows;  // rows (q's, k's and v's) < 2^31: checked by the launcher
  int dim, rot;
  float eps, inv_dim;
  bool zero_centered;
  bool tables_packed;  // cos / sin rows as 16-byte packs (R a multiple of a pack, rows aligned)
};

// GROUP threads a row, each holding one chunk of it (rows of at most GROUP chunks): the group rms_norm gives a row of
// this length, with its sum of squares in the same order, so the normed values are rms_norm's bits. They go through
// shared memory, where each thread finds its chunk's rotate-half partners, and the output is rope's bits of them.
template <typename T, int GROUP, bool PACKED, bool STORE>
__global__ void __launch_bounds__(kThreads) qk_norm_rope_kernel(const QkNormRopeArgs<T> p) {
  constexpr int kRowsPerBlock = kThreads / GROUP;
  constexpr int C = 16 / sizeof(T);
  __shared__ float normed[kRowsPerBlock][GROUP * C];
  const int slot = threadIdx.x / GROUP, t = threadIdx.x % GROUP;
  const int row = blockIdx.x * kRowsPerBlock + slot;
  const int which = row < p.q_rows ? 0 : row < p.q_rows + p.k_rows ? 1 : 2;  // q, k or v (2: STORE only)
  const int r = row - (which == 0 ? 0 : which == 1 ? p.q_rows : p.q_rows + p.k_rows);
  const int heads = which == 0 ? p.heads_q : p.heads_k;
  const int i = r % p.n, h = (r / p.n) % heads, b = r / p.n / heads;
  const int e0 = t * C;
  const bool mine = row < p.rows && e0 < p.dim;  // this thread holds a chunk of a row
  const T* x = p.x[which] + b * p.x_stride[which][0] + i * p.x_stride[which][1] + h * p.x_stride[which][2];
  const T* weight = p.weight[which];
  const T* cos = p.cos + b * p.cos_stride[0] + i * p.cos_stride[1];
  const T* sin = p.sin + b * p.sin_stride[0] + i * p.sin_stride[1];

  // No register is loaded before the wait (q and k come from the projection ahead; nothing orders the tables' writes
  // before this kernel either), but the weight and table lines can move into L2.
  cuda::allow_dependent_launch();
  if (mine) {
    cuda::prefetch_l2(weight + e0);
    if (e0 < p.rot) {
      cuda::prefetch_l2(cos + e0);
      cuda::prefetch_l2(sin + e0);
    }
  }
  cuda::wait_for_preceding_grid();

  float v[C], w[C], y[C];
  float sum = 0.f;
  if (mine) {
    load_chunk<T, C, PACKED>(x + e0, p.dim - e0, v);
    load_chunk<T, C, PACKED>(weight + e0, p.dim - e0, w);
#pragma unroll
    for (int e = 0; e < C; ++e) sum = fmaf(v[e], v[e], sum);
  }
  sum = cuda::warp_sum<GROUP>(sum);  // every lane takes part, rows past the end adding zeros
  const float inv_rms = rsqrtf(__fadd_rn(__fmul_rn(sum, p.inv_dim), p.eps));
  if (mine) {
    rms_norm_chunk<T, C>(v, w, w, /*gated=*/false, p.zero_centered, inv_rms, y);
#pragma unroll
    for (int e = 0; e < C; ++e) {
      y[e] = round_to<T>(y[e]);  // rms_norm's output, rope's input
      normed[slot][e0 + e] = y[e];
    }
  }
  __syncwarp();  // a row's threads are one warp or half of one
  if (!mine) return;

  int64_t node = i;  // the output row's index along its node (or cache slot) dim
  if constexpr (STORE) {
    if (which > 0) {
      node = p.slots[b * p.slots_sb + i];
      if (node < 0 || node >= p.cache_len) return;  // a padding row (or past the caches, as store_kv): not stored
    }
    if (which == 2) {  // a value row: its bytes copied as they are, as store_kv copies them (NaN payloads too)
      T* dst = p.out[2] + b * p.out_stride[2][0] + h * p.out_stride[2][1] + node * p.out_stride[2][2] + e0;
      if constexpr (PACKED) {  // the head dim is a multiple of C: every chunk is whole
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(x + e0);
      } else {
        for (int e = 0; e < C && e0 + e < p.dim; ++e) dst[e] = x[e0 + e];
      }
      return;
    }
  }

  const int half = p.rot / 2;
  float c[C], sn[C];
  if (p.tables_packed && e0 < p.rot) {  // the chunk lies inside the rotary width
    cuda::load_pack_float<T, C>(cos + e0, c);
    cuda::load_pack_float<T, C>(sin + e0, sn);
  } else {
#pragma unroll
    for (int e = 0; e < C; ++e) {
      c[e] = e0 + e < p.rot ? to_float(cos[e0 + e]) : 0.f;
      sn[e] = e0 + e < p.rot ? to_float(sin[e0 + e]) : 0.f;
    }
  }
  float o[C];
#pragma unroll
  for (int e = 0; e < C; ++e) {
    const int f = e0 + e;
    if (f < p.rot) {
      const float rotated = f < half ? -normed[slot][f + half] : normed[slot][f - half];
      o[e] = to_float(rope_element<T>(y[e], rotated, c[e], sn[e]));
    } else {
      o[e] = y[e];
    }
  }
  T* out = p.out[which] + b * p.out_stride[which][0] + h * p.out_stride[which][1] + node * p.out_stride[which][2];
  store_chunk<T, C, PACKED>(out + e0, p.dim - e0, o);
}

// The two gated products: silu_mul (SwiGLU, round(round(silu(gate)) * up)) and sigmoid_mul (Qwen3.5 attention's
// output gate, round(round(sigmoid(gate)) * x)).
enum class GateActivation { kSilu, kSigmoid };

// VEC elements a thread; GROUPED: the gate's rows through their RowLayout (sigmoid_mul's gate is the gate half of a
// Qwen3.5 q projection's heads: rows that no single stride reaches), else one row stride (no division per pack).
template <typename T, int VEC, GateActivation ACT, bool GROUPED>
__global__ void __launch_bounds__(kThreads)
    gated_mul_kernel(const T* gate, RowLayout gate_rows, const T* x, T* out, int64_t x_stride, int64_t out_stride,
                     int64_t rows, int64_t packs_per_row) {
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();  // launched as a programmatic dependent: nothing read or written before
  const int64_t packs = rows * packs_per_row;
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < packs;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = p / packs_per_row, i = (p % packs_per_row) * VEC;
    float g[VEC], v[VEC], y[VEC];
    cuda::load_pack_float<T, VEC>(gate + (GROUPED ? row_offset(gate_rows, r) : r * gate_rows.inner_stride) + i, g);
    cuda::load_pack_float<T, VEC>(x + r * x_stride + i, v);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      y[e] = round_to<T>(ACT == GateActivation::kSilu ? silu(g[e]) : sigmoid(g[e])) * v[e];
    }
    cuda::store_pack_float<T, VEC>(out + r * out_stride + i, y);
  }
}

// g = -exp(A_log) softplus(a + dt_bias), beta = round(sigmoid(b)) from the rounded projections a and b.
template <typename T, typename A, typename D>
__device__ __forceinline__ void write_gates(float a, float b, A A_log, D dt_bias, float* g, float* beta) {
  const float xa = a + to_float(dt_bias);
  const float softplus = xa > 20.f ? xa : log1pf(expf(xa));  // torch's threshold 20
  *g = -expf(to_float(A_log)) * softplus;
  *beta = round_to<T>(1.f / (1.f + expf(-b)));
}

// Block: one value head; its 8 warps are (a, b) x 4 quarters of the features, against a chunk of kGateRows
// rows of x. A warp streams its quarter of a weight row once, with the chunk's rows of x beside it (independent
// sums in flight), and the quarters are added in a fixed order; then the block turns the rounded projections
// into the gates. Features are assigned by 16-byte chunks, so aligned and unaligned inputs give the same bits.
constexpr int kGateQuarters = kThreads / cuda::kWarp / 2;
constexpr int kGateRows = 8;

template <typename T, typename A, typename D, bool PACKED>
__global__ void __launch_bounds__(kThreads)
    gdn_gates_kernel(const T* x, int64_t x_stride, const T* weight_a, const T* weight_b, const A* A_log,
                     const D* dt_bias, float* g, float* beta, int64_t rows, int features, int heads) {
  constexpr int C = 16 / sizeof(T);
  __shared__ float partial[kGateRows][2][kGateQuarters];
  __shared__ float proj[kGateRows][2];
  const int warp = threadIdx.x / cuda::kWarp, lane = threadIdx.x % cuda::kWarp;
  const int head = blockIdx.x, which = warp / kGateQuarters, quarter = warp % kGateQuarters;  // which: 0 = a, 1 = b
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kGateRows;
  const int chunk = static_cast<int>(rows - row0 < kGateRows ? rows - row0 : kGateRows);
  const int chunks = (features + C - 1) / C;
  const int first = quarter * chunks / kGateQuarters, last = (quarter + 1) * chunks / kGateQuarters;
  const T* w = (which == 0 ? weight_a : weight_b) + static_cast<int64_t>(head) * features;
  const T* x0 = x + row0 * x_stride;
  float acc[kGateRows] = {};
#pragma unroll 2
  for (int c = first + lane; c < last; c += cuda::kWarp) {
    const int f = c * C, valid = features - f;
    float wv[C];
    load_chunk<T, C, PACKED>(w + f, valid, wv);
#pragma unroll
    for (int r = 0; r < kGateRows; ++r) {
      if (r < chunk) {
        float xv[C];
        load_chunk<T, C, PACKED>(x0 + r * x_stride + f, valid, xv);
#pragma unroll
        for (int e = 0; e < C; ++e) acc[r] = fmaf(xv[e], wv[e], acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kGateRows; ++r) {
    const float sum = cuda::warp_sum(acc[r]);
    if (lane == 0) partial[r][which][quarter] = sum;
  }
  __syncthreads();
  if (threadIdx.x < 2 * chunk) {
    const int r = threadIdx.x / 2, k = threadIdx.x % 2;
    float sum = 0.f;
#pragma unroll
    for (int q = 0; q < kGateQuarters; ++q) sum += partial[r][k][q];
    proj[r][k] = round_to<T>(sum);  // the projection's output dtype
  }
  __syncthreads();
  if (threadIdx.x < chunk) {
    const int r = threadIdx.x;
    const int64_t o = (row0 + r) * heads + head;
    write_gates<T>(proj[r][0], proj[r][1], A_log[head], dt_bias[head], g + o, beta + o);
  }
}

// Rows of x past kGateRows on 16-bit inputs: the product [rows, F] x [F, 2 H] on tensor cores, split over the
// features (kGateSplit per block; partial sums to a float32 workspace), then one thread per (row, head) adds the
// splits in order and writes the gates. x is read once, not once per head. Staging is element by element where
// a row is not 16-byte aligned, so the bits do not depend on alignment.
constexpr int kGateSplit = 128;                 // features per block
constexpr int kGateStride = kGateSplit + 8;     // staged row stride (elements): conflict-free fragments

inline int64_t round_up(int64_t a, int64_t b) { return cuda::ceil_div(a, b) * b; }

inline size_t gates_partial_smem(int64_t rows, int64_t heads) {
  return sizeof(uint16_t) * kGateStride * (round_up(2 * heads, 16) + round_up(rows, 8));
}

template <typename T, bool PACKED>
__global__ void __launch_bounds__(kThreads) gdn_gates_partial_kernel(const T* x, int64_t x_stride, const T* weight_a,
                                                                     const T* weight_b, float* part, int rows,
                                                                     int features, int heads) {
  constexpr int C = 8, kPacks = kGateSplit / C;  // 16-byte packs per staged row
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int outs = 2 * heads, out_pad = (outs + 15) / 16 * 16, row_pad = (rows + 7) / 8 * 8;
  T* ws = reinterpret_cast<T*>(smem_raw);  // [out_pad][kGateStride]: the a rows, then the b rows
  T* xs = ws + out_pad * kGateStride;      // [row_pad][kGateStride]
  const int f0 = blockIdx.x * kGateSplit, valid = min(kGateSplit, features - f0);
  for (int e = threadIdx.x; e < (out_pad + row_pad) * kPacks; e += kThreads) {
    const int r = e / kPacks, c = C * (e % kPacks);
    const bool weight_row = r < out_pad;
    const int rr = weight_row ? r : r - out_pad;
    const bool real = weight_row ? rr < outs : rr < rows;
    T* dst = (weight_row ? ws : xs) + rr * kGateStride + c;
    const T* src = weight_row ? (rr < heads ? weight_a + static_cast<int64_t>(rr) * features
                                            : weight_b + static_cast<int64_t>(rr - heads) * features)
                              : x + rr * x_stride;
    if (PACKED && real && c + C <= valid) {
      cuda::copy_async<16>(dst, src + f0 + c);
    } else {
#pragma unroll
      for (int t = 0; t < C; ++t) dst[t] = real && c + t < valid ? src[f0 + c + t] : from_float<T>(0.f);
    }
  }
  cuda::wait_async_copies();
  __syncthreads();
  const int warp = threadIdx.x / cuda::kWarp, lane = threadIdx.x % cuda::kWarp, gid = lane / 4, tig = lane % 4;
  const int n_tiles = row_pad / 8;
  const uint32_t* ww = reinterpret_cast<const uint32_t*>(ws);
  const uint32_t* xw = reinterpret_cast<const uint32_t*>(xs);
  constexpr int kWs = kGateStride / 2;  // words per staged row
  for (int t = warp; t < out_pad / 16 * n_tiles; t += kThreads / cuda::kWarp) {
    const int mt = t / n_tiles, nt = t % n_tiles;
    float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < kGateSplit / 16; ++kk) {
      const uint32_t* a = ww + (16 * mt + gid) * kWs + 8 * kk + tig;
      const uint32_t* b = xw + (8 * nt + gid) * kWs + 8 * kk + tig;
      const uint32_t af[4] = {a[0], a[8 * kWs], a[4], a[8 * kWs + 4]};
      const uint32_t bf[2] = {b[0], b[4]};
      cuda::mma_16x8x16<T>(d, af, bf);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // d[e]: output 16 mt + gid + 8 (e / 2), x row 8 nt + 2 tig + e % 2
      const int o = 16 * mt + gid + 8 * (e / 2), r = 8 * nt + 2 * tig + e % 2;
      if (o < outs && r < rows) part[(static_cast<int64_t>(blockIdx.x) * rows + r) * outs + o] = d[e];
    }
  }
}

template <typename T, typename A, typename D>
__global__ void __launch_bounds__(kThreads) gdn_gates_finish_kernel(const float* part, const A* A_log,
                                                                    const D* dt_bias, float* g, float* beta,
                                                                    int rows, int heads, int splits) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= static_cast<int64_t>(rows) * heads) return;
  const int r = static_cast<int>(i / heads), head = static_cast<int>(i % heads), outs = 2 * heads;
  float sum_a = 0.f, sum_b = 0.f;
#pragma unroll 8
  for (int s = 0; s < splits; ++s) {  // in split order; unrolled so that several splits' loads are in flight
    const float* p = part + (static_cast<int64_t>(s) * rows + r) * outs;
    sum_a += p[head];
    sum_b += p[heads + head];
  }
  write_gates<T>(round_to<T>(sum_a), round_to<T>(sum_b), A_log[head], dt_bias[head], g + i, beta + i);
}

// 16-byte packs of T when every pointer and row stride allows them, else single elements. The stride of a dimension of
// size 1 is never stepped (a single row of a wider stacked projection's output, say), so it does not count.
template <typename T>
bool can_pack(std::initializer_list<const at::Tensor*> tensors, int64_t dim) {
  constexpr int64_t vec = 16 / sizeof(T);
  if (dim % vec != 0) return false;
  for (const at::Tensor* t : tensors) {
    if (!cuda::is_aligned(t->data_ptr(), 16)) return false;
    for (int64_t d = 0; d + 1 < t->dim(); ++d) {
      if (t->size(d) > 1 && t->stride(d) % vec != 0) return false;
    }
  }
  return true;
}

unsigned grid_for(int64_t work, int threads) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(cuda::ceil_div(work, threads), sms * 8)));
}

template <typename T, int GROUP, bool PACKED>
void launch_rms_norm(const RmsNormArgs<T>& args) {
  constexpr int kRowsPerBlock = kThreads / GROUP;
  const unsigned blocks = static_cast<unsigned>(cuda::ceil_div(args.rows, kRowsPerBlock));
  cuda::launch_programmatic(rms_norm_kernel<T, GROUP, PACKED>, dim3(blocks), dim3(kThreads), 0, args);
}

// rms_norm's and add_rms_norm's launch: a block per row for hidden states, a warp per row for heads, half a warp for
// heads of at most 16 chunks (128 features in 16-bit dtypes: a GDN value head). A warp there left half its lanes
// idle, and the 27B GDN layers' gated norm at 65 rows (3120 heads) was bound by its warps' instruction issue (Nsight
// Compute in a replayed round: 8.3 us, 22 of 32 lanes active on average). The sums run in the order a warp ran them
// (its lanes past the row's chunks only added zeros).
template <typename T>
void launch_rms_norm_rows(const RmsNormArgs<T>& args, bool packed) {
  constexpr int kHalfWarp = cuda::kWarp / 2;
  if (args.dim > kLongRowFeatures) {
    packed ? launch_rms_norm<T, kThreads, true>(args) : launch_rms_norm<T, kThreads, false>(args);
  } else if (args.dim <= kHalfWarp * static_cast<int>(16 / sizeof(T))) {
    packed ? launch_rms_norm<T, kHalfWarp, true>(args) : launch_rms_norm<T, kHalfWarp, false>(args);
  } else {
    packed ? launch_rms_norm<T, cuda::kWarp, true>(args) : launch_rms_norm<T, cuda::kWarp, false>(args);
  }
}

// The arguments of a plain norm of x's rows into out (no gate, no residual).
template <typename T>
RmsNormArgs<T> rms_norm_args(const char* op, const at::Tensor& x, const at::Tensor& weight, double eps,
                             bool zero_centered, at::Tensor& out) {
  TORCH_CHECK_VALUE(x.size(-1) <= INT32_MAX, op, ": x has too many features (", x.size(-1), ")");
  RmsNormArgs<T> args{};
  args.x = x.data_ptr<T>();
  args.weight = weight.data_ptr<T>();
  args.out = out.data_ptr<T>();
  args.x_rows = row_layout(x);
  args.gate_rows = RowLayout{1, 0, 0};
  args.out_stride = out.stride(0);
  args.rows = out.size(0);
  args.dim = static_cast<int>(x.size(-1));
  args.eps = static_cast<float>(eps);
  args.inv_dim = 1.f / static_cast<float>(x.size(-1));
  args.zero_centered = zero_centered;
  return args;
}

}  // namespace

bool programmatic_launches(int64_t device_index) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  // One kernel answers for all: a build compiles every kernel for the same architectures, so the code the GPU runs
  // has the same PTX version in each.
  return cuda::programmatic_launch_supported() &&
         cuda::has_grid_dependency_control(
             reinterpret_cast<const void*>(&gated_mul_kernel<float, 1, GateActivation::kSilu, false>));
}

void rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& gate, double eps,
                   bool zero_centered, at::Tensor& out) {
  check_rms_norm(x, weight, gate, eps, zero_centered, out);
  const c10::cuda::CUDAGuard guard(x.device());
  if (out.size(0) == 0) return;
  DDTREE_CUDA_DISPATCH_FLOAT(x.scalar_type(), "rms_norm", [&] {
    using T = scalar_t;
    RmsNormArgs<T> args = rms_norm_args<T>("rms_norm", x, weight, eps, zero_centered, out);
    if (gate.has_value()) {
      args.gate = gate->data_ptr<T>();
      args.gate_rows = row_layout(*gate);
    }
    const bool packed = gate.has_value() ? can_pack<T>({&x, &weight, &*gate, &out}, x.size(-1))
                                         : can_pack<T>({&x, &weight, &out}, x.size(-1));
    launch_rms_norm_rows(args, packed);
  });
}

void add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                       bool zero_centered, at::Tensor& out, at::Tensor& residual_out) {
  check_add_rms_norm(x, residual, weight, eps, zero_centered, out, residual_out);
  const c10::cuda::CUDAGuard guard(x.device());
  if (x.size(0) == 0) return;
  DDTREE_CUDA_DISPATCH_FLOAT(x.scalar_type(), "add_rms_norm", [&] {
    using T = scalar_t;
    RmsNormArgs<T> args = rms_norm_args<T>("add_rms_norm", x, weight, eps, zero_centered, out);
    args.residual = residual.data_ptr<T>();
    args.residual_stride = residual.stride(0);
    args.sum_out = residual_out.data_ptr<T>();
    args.sum_stride = residual_out.stride(0);
    launch_rms_norm_rows(args, can_pack<T>({&x, &residual, &weight, &out, &residual_out}, x.size(1)));
  });
}

namespace {

// gated_mul_kernel over x's rows [rows, D] (gate [rows, D] or groups of rows [G, R, D]), 16-byte packs where every
// pointer and row stride allows them.
template <GateActivation ACT>
void launch_gated_mul(const at::Tensor& gate, const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), dim = x.size(1);
  if (rows == 0 || dim == 0) return;
  DDTREE_CUDA_DISPATCH_FLOAT(x.scalar_type(), "gated_mul", [&] {  // dtype checked by the op
    using T = scalar_t;
    constexpr int kVec = 16 / sizeof(T);
    const RowLayout gate_rows = row_layout(gate);
    auto launch = [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const int64_t packs_per_row = dim / VEC;
      auto kernel = gate.dim() == 3 ? gated_mul_kernel<T, VEC, ACT, true> : gated_mul_kernel<T, VEC, ACT, false>;
      cuda::launch_programmatic(kernel, dim3(grid_for(rows * packs_per_row, kThreads)), dim3(kThreads), 0,
                                gate.data_ptr<T>(), gate_rows, x.data_ptr<T>(), out.data_ptr<T>(), x.stride(0),
                                out.stride(0), rows, packs_per_row);
    };
    if (can_pack<T>({&gate, &x, &out}, dim)) {
      launch(std::integral_constant<int, kVec>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
  });
}

}  // namespace

void silu_mul_cuda(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  check_silu_mul(gate, up, out);
  const c10::cuda::CUDAGuard guard(gate.device());
  launch_gated_mul<GateActivation::kSilu>(gate, up, out);
}

void sigmoid_mul_cuda(const at::Tensor& gate, const at::Tensor& x, at::Tensor& out) {
  check_sigmoid_mul(gate, x, out);
  const c10::cuda::CUDAGuard guard(x.device());
  launch_gated_mul<GateActivation::kSigmoid>(gate, x, out);
}

void rope_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  check_rope(x, cos, sin, out);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t total = x.numel();
  if (total == 0) return;
  DDTREE_CUDA_DISPATCH_FLOAT(x.scalar_type(), "rope", [&] {
    using T = scalar_t;
    cuda::launch_programmatic(
        rope_kernel<T>, dim3(grid_for(total, kThreads)), dim3(kThreads), 0, x.data_ptr<T>(), cos.data_ptr<T>(),
        sin.data_ptr<T>(), out.data_ptr<T>(), x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(1),
        sin.stride(0), sin.stride(1), out.stride(0), out.stride(1), out.stride(2), x.size(1), x.size(2),
        static_cast<int>(x.size(3)), static_cast<int>(cos.size(2)), total);
  });
}

namespace {

template <typename T, bool STORE>
void launch_qk_norm_rope_kernel(const QkNormRopeArgs<T>& args, bool packed, int64_t dim) {
  auto launch = [&](auto kernel, int group) {
    const unsigned blocks = static_cast<unsigned>(cuda::ceil_div(args.rows, kThreads / group));
    cuda::launch_programmatic(kernel, dim3(blocks), dim3(kThreads), 0, args);
  };
  // The group rms_norm gives a row of this length (launch_rms_norm_rows): its sums, its bits.
  constexpr int C = 16 / sizeof(T), kHalfWarp = cuda::kWarp / 2;
  if (dim <= kHalfWarp * C) {
    packed ? launch(qk_norm_rope_kernel<T, kHalfWarp, true, STORE>, kHalfWarp)
           : launch(qk_norm_rope_kernel<T, kHalfWarp, false, STORE>, kHalfWarp);
  } else {
    packed ? launch(qk_norm_rope_kernel<T, cuda::kWarp, true, STORE>, cuda::kWarp)
           : launch(qk_norm_rope_kernel<T, cuda::kWarp, false, STORE>, cuda::kWarp);
  }
}

// One qk_norm_rope_kernel launch for heads of up to 32 16-byte chunks. k_out is k's output [B, Hk, N, D], or with a
// value tensor the keys cache [B, Hk, S, D] (STORE: v's rows into values, both at slots).
template <typename T>
void launch_qk_norm_rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight,
                         const at::Tensor& k_weight, const at::Tensor& cos, const at::Tensor& sin, double eps,
                         bool zero_centered, at::Tensor& q_out, at::Tensor& k_out, const at::Tensor* v = nullptr,
                         at::Tensor* values = nullptr, const at::Tensor* slots = nullptr) {
  const bool store = v != nullptr;
  QkNormRopeArgs<T> args{};
  const at::Tensor* xs[3] = {&q, &k, store ? v : &k};
  const at::Tensor* ws[3] = {&q_weight, &k_weight, &k_weight};
  at::Tensor* outs[3] = {&q_out, &k_out, store ? values : &k_out};
  for (int which = 0; which < 3; ++which) {
    args.x[which] = xs[which]->data_ptr<T>();
    args.weight[which] = ws[which]->data_ptr<T>();
    args.out[which] = outs[which]->data_ptr<T>();
    for (int d = 0; d < 3; ++d) {
      args.x_stride[which][d] = xs[which]->stride(d);
      args.out_stride[which][d] = outs[which]->stride(d);
    }
  }
  args.cos = cos.data_ptr<T>();
  args.sin = sin.data_ptr<T>();
  args.cos_stride[0] = cos.stride(0);
  args.cos_stride[1] = cos.stride(1);
  args.sin_stride[0] = sin.stride(0);
  args.sin_stride[1] = sin.stride(1);
  if (store) {
    args.slots = slots->data_ptr<int64_t>();
    args.slots_sb = slots->dim() == 2 ? slots->stride(0) : 0;
    args.cache_len = k_out.size(2);
  }
  const int64_t q_rows = q.size(0) * q.size(2) * q.size(1), k_rows = k.size(0) * k.size(2) * k.size(1);
  const int64_t rows = q_rows + (store ? 2 : 1) * k_rows;
  TORCH_CHECK_VALUE(rows <= INT32_MAX - kThreads, store ? "qk_norm_rope_store_kv" : "qk_norm_rope",
                    ": q, k (and v) have too many heads (", rows, " rows)");
  const int64_t dim = q.size(3);
  args.n = static_cast<int>(q.size(1));
  args.heads_q = static_cast<int>(std::max<int64_t>(q.size(2), 1));
  args.heads_k = static_cast<int>(std::max<int64_t>(k.size(2), 1));
  args.q_rows = static_cast<int>(q_rows);
  args.k_rows = static_cast<int>(k_rows);
  args.rows = static_cast<int>(rows);
  args.dim = static_cast<int>(dim);
  args.rot = static_cast<int>(cos.size(2));
  args.eps = static_cast<float>(eps);
  args.inv_dim = 1.f / static_cast<float>(dim);
  args.zero_centered = zero_centered;
  const bool packed = store ? can_pack<T>({&q, &k, v, &q_weight, &k_weight, &q_out, &k_out, values}, dim)
                            : can_pack<T>({&q, &k, &q_weight, &k_weight, &q_out, &k_out}, dim);
  args.tables_packed = packed && can_pack<T>({&cos, &sin}, cos.size(2));
  store ? launch_qk_norm_rope_kernel<T, true>(args, packed, dim) : launch_qk_norm_rope_kernel<T, false>(args, packed, dim);
}

// Whether a head is longer than a warp's chunks (the kernel's limit): then the ops run apart, through buffers.
bool long_heads(const at::Tensor& q) { return q.size(3) > cuda::kWarp * (16 / static_cast<int64_t>(q.element_size())); }

}  // namespace

void qk_norm_rope_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight, const at::Tensor& k_weight,
                       const at::Tensor& cos, const at::Tensor& sin, double eps, bool zero_centered, at::Tensor& q_out,
                       at::Tensor& k_out) {
  check_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, q_out, k_out);
  const c10::cuda::CUDAGuard guard(q.device());
  if (q.numel() == 0 && k.numel() == 0) return;
  TORCH_CHECK_VALUE(q.size(3) <= INT32_MAX, "qk_norm_rope: q has too large a head dim (", q.size(3), ")");
  if (long_heads(q)) {  // the two ops, through a buffer
    const int64_t dim = q.size(3);
    for (int which = 0; which < 2; ++which) {
      const at::Tensor& x = which == 0 ? q : k;
      if (x.numel() == 0) continue;
      const at::Tensor rows = x.contiguous().view({-1, dim});
      at::Tensor normed = at::empty_like(rows);
      rms_norm_cuda(rows, which == 0 ? q_weight : k_weight, c10::nullopt, eps, zero_centered, normed);
      rope_cuda(normed.view(x.sizes()).transpose(1, 2), cos, sin, which == 0 ? q_out : k_out);
    }
    return;
  }
  DDTREE_CUDA_DISPATCH_FLOAT(q.scalar_type(), "qk_norm_rope", [&] {
    launch_qk_norm_rope<scalar_t>(q, k, q_weight, k_weight, cos, sin, eps, zero_centered, q_out, k_out);
  });
}

void qk_norm_rope_store_kv_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& q_weight, const at::Tensor& k_weight, const at::Tensor& cos,
                                const at::Tensor& sin, double eps, bool zero_centered, const at::Tensor& slots,
                                at::Tensor& q_out, at::Tensor& keys, at::Tensor& values) {
  check_qk_norm_rope_store_kv(q, k, v, q_weight, k_weight, cos, sin, eps, slots, q_out, keys, values);
  const c10::cuda::CUDAGuard guard(q.device());
  if (q.numel() == 0 && k.numel() == 0) return;
  TORCH_CHECK_VALUE(q.size(3) <= INT32_MAX, "qk_norm_rope_store_kv: q has too large a head dim (", q.size(3), ")");
  if (long_heads(q)) {  // the two ops, through a buffer for k's output
    at::Tensor k_out = at::empty({k.size(0), k.size(2), k.size(1), k.size(3)}, k.options());
    qk_norm_rope_cuda(q, k, q_weight, k_weight, cos, sin, eps, zero_centered, q_out, k_out);
    store_kv_cuda(keys, values, slots, k_out, v.transpose(1, 2));
    return;
  }
  DDTREE_CUDA_DISPATCH_FLOAT(q.scalar_type(), "qk_norm_rope_store_kv", [&] {
    launch_qk_norm_rope<scalar_t>(q, k, q_weight, k_weight, cos, sin, eps, zero_centered, q_out, keys, &v, &values,
                                  &slots);
  });
}

void gdn_gates_cuda(const at::Tensor& x, const at::Tensor& weight_a, const at::Tensor& weight_b, const at::Tensor& A_log,
                    const at::Tensor& dt_bias, at::Tensor& g, at::Tensor& beta) {
  check_gdn_gates(x, weight_a, weight_b, A_log, dt_bias, g, beta);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), features = x.size(1), heads = weight_a.size(0);
  if (rows == 0 || heads == 0) return;
  TORCH_CHECK_VALUE(features <= INT32_MAX && heads <= INT32_MAX, "gdn_gates: x or the weights are too large");
  const dim3 grid(static_cast<unsigned>(heads), static_cast<unsigned>(cuda::ceil_div(rows, kGateRows)));
  TORCH_CHECK_VALUE(grid.y <= cuda::kMaxGridY, "gdn_gates: x has too many rows (", rows, ")");
  DDTREE_CUDA_DISPATCH_FLOAT(x.scalar_type(), "gdn_gates", [&] {
    using T = scalar_t;
    const bool packed = can_pack<T>({&x, &weight_a, &weight_b}, features);
    DDTREE_CUDA_DISPATCH_FLOAT(A_log.scalar_type(), "gdn_gates", [&] {
      using A = scalar_t;
      DDTREE_CUDA_DISPATCH_FLOAT(dt_bias.scalar_type(), "gdn_gates", [&] {
        using D = scalar_t;
        auto launch = [&](auto kernel) {
          kernel<<<grid, kThreads, 0, cuda::current_stream()>>>(
              x.data_ptr<T>(), x.stride(0), weight_a.data_ptr<T>(), weight_b.data_ptr<T>(), A_log.data_ptr<A>(),
              dt_bias.data_ptr<D>(), g.data_ptr<float>(), beta.data_ptr<float>(), rows, static_cast<int>(features),
              static_cast<int>(heads));
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        };
        if constexpr (sizeof(T) == 2) {
          const size_t smem = gates_partial_smem(rows, heads);
          static const bool tensor_cores = cuda::ptx_version(gdn_gates_partial_kernel<T, true>) >= 80;
          if (rows > kGateRows && tensor_cores && smem <= cuda::max_dynamic_smem() && rows <= INT32_MAX) {
            const int splits = static_cast<int>(cuda::ceil_div(features, kGateSplit));
            at::Tensor part = at::empty({splits, rows, 2 * heads}, x.options().dtype(at::kFloat));
            auto partial = packed ? gdn_gates_partial_kernel<T, true> : gdn_gates_partial_kernel<T, false>;
            cuda::allow_dynamic_smem(partial, smem);
            partial<<<splits, kThreads, smem, cuda::current_stream()>>>(
                x.data_ptr<T>(), x.stride(0), weight_a.data_ptr<T>(), weight_b.data_ptr<T>(), part.data_ptr<float>(),
                static_cast<int>(rows), static_cast<int>(features), static_cast<int>(heads));
            C10_CUDA_KERNEL_LAUNCH_CHECK();
            gdn_gates_finish_kernel<T, A, D>
                <<<static_cast<unsigned>(cuda::ceil_div(rows * heads, kThreads)), kThreads, 0, cuda::current_stream()>>>(
                    part.data_ptr<float>(), A_log.data_ptr<A>(), dt_bias.data_ptr<D>(), g.data_ptr<float>(),
                    beta.data_ptr<float>(), static_cast<int>(rows), static_cast<int>(heads), splits);
            C10_CUDA_KERNEL_LAUNCH_CHECK();
            return;
          }
        }
        if (packed) {
          launch(gdn_gates_kernel<T, A, D, true>);
        } else {
          launch(gdn_gates_kernel<T, A, D, false>);
        }
      });
    });
  });
}

}  // namespace ddtree
