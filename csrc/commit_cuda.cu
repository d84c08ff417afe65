// CUDA implementations of the commit ops: the accepted path becomes the committed state, in place,
// for every layer of a list in as few launches as possible. Semantics: ddtree_ext/reference.py.
//
// Layers are launched in runs: consecutive layers whose tensors share sizes and strides (the usual
// case: every layer's cache has one shape) go into one launch, their data pointers passed by value in
// a kernel-parameter table. Parameters are captured with a CUDA graph, so replays stay valid with no
// host memory behind them.
//
// Paths come from the device (accepted, accept_len) and are never read back. A path the kernels
// cannot apply safely (length outside [1, D], a node outside [0, N), a slot outside the cache) leaves
// that row's state untouched instead of touching memory out of bounds.
#include <functional>
#include <type_traits>

#include "cuda_common.cuh"
#include "ops.h"

namespace ddtree {
namespace {

// 64 layers per launch (a 48-layer model's GDN states in one): four tables of 64 pointers still fit the 4 KB of
// kernel parameters.
constexpr int kMaxLayersPerLaunch = 64;

template <typename T>
struct LayerTable {
  T* ptr[kMaxLayersPerLaunch];
};

bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.strides() == b.strides() && a.scalar_type() == b.scalar_type();
}

// Calls launch(first, count) for runs of at most kMaxLayersPerLaunch consecutive layers for which
// compatible(first, l) holds.
void for_each_layer_run(int64_t layers, const std::function<bool(int64_t, int64_t)>& compatible,
                        const std::function<void(int64_t, int64_t)>& launch) {
  int64_t first = 0;
  while (first < layers) {
    int64_t end = first + 1;
    while (end < layers && end - first < kMaxLayersPerLaunch && compatible(first, end)) ++end;
    launch(first, end - first);
    first = end;
  }
}

template <typename T>
LayerTable<T> table_of(at::TensorList list, int64_t first, int64_t count) {
  LayerTable<T> t{};
  for (int64_t l = 0; l < count; ++l) t.ptr[l] = reinterpret_cast<T*>(list[first + l].data_ptr());
  return t;
}

// The accepted path of row b: its length (0 when unusable) and node d, read by every thread. A path is usable
// when 1 <= accept_len <= D and every node lies in [0, num_nodes).
struct Path {
  const int32_t* accepted;
  int64_t acc_sb, acc_sd;
  const int32_t* accept_len;
  int64_t len_s;
  int max_len;

  __device__ __forceinline__ int raw_length(int b) const { return accept_len[b * len_s]; }
  __device__ __forceinline__ bool length_ok(int len) const { return len >= 1 && len <= max_len; }
  __device__ __forceinline__ static bool node_ok(int node, int num_nodes) { return node >= 0 && node < num_nodes; }
  __device__ __forceinline__ int length(int b, int num_nodes) const {
    const int len = raw_length(b);
    if (!length_ok(len)) return 0;
    for (int d = 0; d < len; ++d) {
      if (!node_ok(node(b, d), num_nodes)) return 0;
    }
    return len;
  }
  __device__ __forceinline__ int node(int b, int d) const { return accepted[b * acc_sb + d * acc_sd]; }
};

Path path_of(const at::Tensor& accepted, const at::Tensor& accept_len) {
  return Path{accepted.data_ptr<int32_t>(), accepted.stride(0), accepted.stride(1), accept_len.data_ptr<int32_t>(),
              accept_len.stride(0), static_cast<int>(accepted.size(1))};
}

// ==== commit_gdn_state =========================================================================
//
// S <- e^{G_l} S + sum_d e^{G_l - G_{p_d}} k_{p_d} u_{p_d}^T, l the last path node. One block per
// (layer, b, value head, tile of kCommitGdnRows state rows). The op is memory-bound, and a block's fixed cost is
// a chain of dependent reads (accept_len -> the path's nodes -> their G -> the staged keys), so: each thread
// issues the loads of its kCommitGdnBatch packs of the tile first, and the path's nodes are read by one thread each
// (not walked by every thread). A path found unusable drops the loaded values: nothing is stored.

constexpr int kCommitGdnThreads = 256;
constexpr int kCommitGdnRows = 64;
constexpr int kCommitGdnBatch = 8;  // packs per thread in flight at once: 64 rows x 128 columns in one batch

struct GdnStrides {
  int64_t st_sb, st_sh, st_sk, st_sv;  // state [B, HV, K, V]
  int64_t su_sb, su_sn, su_sh, su_sv;  // stash_u [B, N, HV, V]
  int64_t sk_sb, sk_sn, sk_sh, sk_sk;  // stash_k [B, N, H, K]
  int64_t cg_sb, cg_sn, cg_sh;         // stash_cumg [B, N, HV]
  int num_nodes, heads, value_heads, kdim, vdim;
};

// Dynamic shared memory of commit_gdn_state_kernel for paths of up to max_len nodes and V value columns.
size_t commit_gdn_smem_bytes(int64_t max_len, int64_t vdim) {
  return sizeof(float) * max_len * (kCommitGdnRows + vdim + 2);
}

template <int VEC>
__global__ void __launch_bounds__(kCommitGdnThreads) commit_gdn_state_kernel(
    LayerTable<float> state, LayerTable<const float> stash_u, LayerTable<const float> stash_k,
    LayerTable<const float> stash_cumg, GdnStrides s, Path path, int row_tiles) {
  extern __shared__ __align__(16) float smem[];
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();  // launched as a programmatic dependent: nothing read or written before
  const int layer = blockIdx.z, b = blockIdx.y, tid = threadIdx.x;
  const int hv = blockIdx.x / row_tiles, k0 = (blockIdx.x % row_tiles) * kCommitGdnRows;
  const int h = hv / (s.value_heads / s.heads);
  const int rows = min(kCommitGdnRows, s.kdim - k0);
  const int packs_per_row = s.vdim / VEC;
  const int total = rows * packs_per_row;
  float* tile = state.ptr[layer] + b * s.st_sb + hv * s.st_sh + static_cast<int64_t>(k0) * s.st_sk;
  // Pack e of the tile: row e / packs_per_row, columns VEC (e % packs_per_row) .. + VEC - 1 (st_sv == 1 when VEC > 1).
  auto pack_ptr = [&](int e) { return tile + (e / packs_per_row) * s.st_sk + (e % packs_per_row) * VEC * s.st_sv; };

  float acc[kCommitGdnBatch][VEC];
#pragma unroll
  for (int u = 0; u < kCommitGdnBatch; ++u) {
    const int e = tid + u * kCommitGdnThreads;
    if (e < total) cuda::load_pack_float<float, VEC>(pack_ptr(e), acc[u]);
  }

  float* ks = smem;                                        // [max_len][kCommitGdnRows] e^{G_l - G_p} k_p
  float* us = ks + path.max_len * kCommitGdnRows;          // [max_len][V] u_p
  float* gs = us + path.max_len * s.vdim;                  // [max_len] G_p
  int* ps = reinterpret_cast<int*>(gs + path.max_len);     // [max_len] p
  const float* cumg = stash_cumg.ptr[layer] + b * s.cg_sb + hv * s.cg_sh;
  // Path::length's checks, with the nodes read one per thread.
  const int len = path.raw_length(b);
  bool usable = path.length_ok(len);
  if (usable) {
    for (int d = tid; d < len; d += kCommitGdnThreads) {
      const int p = path.node(b, d);
      const bool in_tree = Path::node_ok(p, s.num_nodes);
      usable = usable && in_tree;
      ps[d] = p;
      gs[d] = in_tree ? cumg[p * s.cg_sn] : 0.f;
    }
  }
  if (!__syncthreads_and(usable)) return;
  const float g_last = gs[len - 1];
  for (int e = tid; e < len * kCommitGdnRows; e += kCommitGdnThreads) {
    const int d = e / kCommitGdnRows, r = e % kCommitGdnRows;
    ks[e] = r < rows ? expf(g_last - gs[d]) *
                           stash_k.ptr[layer][b * s.sk_sb + ps[d] * s.sk_sn + h * s.sk_sh + (k0 + r) * s.sk_sk]
                     : 0.f;
  }
  for (int e = tid; e < len * s.vdim; e += kCommitGdnThreads) {
    const int d = e / s.vdim, c = e % s.vdim;
    us[e] = stash_u.ptr[layer][b * s.su_sb + ps[d] * s.su_sn + hv * s.su_sh + c * s.su_sv];
  }
  __syncthreads();

  const float decay = expf(g_last);
  // When packs_per_row divides the block (V = 128: 32 packs a row), a thread's packs share their columns and
  // sit rows_per_pass rows apart: one read of u_p serves all of them.
  const bool same_columns = kCommitGdnThreads % packs_per_row == 0;
  const int rows_per_pass = kCommitGdnThreads / packs_per_row;
  for (int base = tid; base < total; base += kCommitGdnBatch * kCommitGdnThreads) {
    if (base != tid) {  // tiles of more than one batch (V > 128): the next batch's loads
#pragma unroll
      for (int u = 0; u < kCommitGdnBatch; ++u) {
        const int e = base + u * kCommitGdnThreads;
        if (e < total) cuda::load_pack_float<float, VEC>(pack_ptr(e), acc[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kCommitGdnBatch; ++u) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[u][v] *= decay;
    }
    if (same_columns) {
      const int r0 = base / packs_per_row, c = (base % packs_per_row) * VEC;
      for (int d = 0; d < len; ++d) {
        const float* kd = ks + d * kCommitGdnRows + r0;
        float ud[VEC];
#pragma unroll
        for (int v = 0; v < VEC; ++v) ud[v] = us[d * s.vdim + c + v];
#pragma unroll
        for (int u = 0; u < kCommitGdnBatch; ++u) {
          const float kr = kd[min(u * rows_per_pass, kCommitGdnRows - 1 - r0)];  // past the tile: never stored
#pragma unroll
          for (int v = 0; v < VEC; ++v) acc[u][v] = fmaf(kr, ud[v], acc[u][v]);
        }
      }
    } else {
      for (int d = 0; d < len; ++d) {
        const float* kd = ks + d * kCommitGdnRows;
        const float* ud = us + d * s.vdim;
#pragma unroll
        for (int u = 0; u < kCommitGdnBatch; ++u) {
          const int e = base + u * kCommitGdnThreads;
          const float kr = kd[min(e / packs_per_row, kCommitGdnRows - 1)];  // past the tile: never stored
          const int c = (e % packs_per_row) * VEC;
#pragma unroll
          for (int v = 0; v < VEC; ++v) acc[u][v] = fmaf(kr, ud[c + v], acc[u][v]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kCommitGdnBatch; ++u) {
      const int e = base + u * kCommitGdnThreads;
      if (e < total) cuda::store_pack_float<float, VEC>(pack_ptr(e), acc[u]);
    }
  }
}

// ==== commit_conv_state ========================================================================
//
// conv_state[b, c, :] <- the last S entries of [conv_state[b, c, :], x[b, p_0, c], ..., x[b, p_{len-1}, c]].
// One thread per (layer, b, channel), walking the new columns oldest first: column t reads old column
// t + len (never written yet, since len >= 1) or an input row.

constexpr int kCommitConvThreads = 256;

struct ConvStrides {
  int64_t cs_sb, cs_sc, cs_ss;  // conv_state [B, C, S]
  int64_t x_sb, x_sn, x_sc;     // x [B, N, C]
  int64_t channels, state_len;
  int num_nodes;
};

template <typename T>
__global__ void __launch_bounds__(kCommitConvThreads) commit_conv_state_kernel(LayerTable<T> conv_state,
                                                                             LayerTable<const T> x, ConvStrides s,
                                                                             Path path) {
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();  // launched as a programmatic dependent: nothing read or written before
  const int layer = blockIdx.z, b = blockIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kCommitConvThreads + threadIdx.x;
  if (c >= s.channels) return;
  const int len = path.length(b, s.num_nodes);
  if (len == 0) return;
  T* row = conv_state.ptr[layer] + b * s.cs_sb + c * s.cs_sc;
  const T* xs = x.ptr[layer] + b * s.x_sb + c * s.x_sc;
  for (int64_t t = 0; t < s.state_len; ++t) {
    const int64_t src = t + len;
    row[t * s.cs_ss] = src < s.state_len ? row[src * s.cs_ss]
                                         : xs[path.node(b, static_cast<int>(src - s.state_len)) * s.x_sn];
  }
}

// ==== commit_kv ================================================================================
//
// Row prefix + p_d moves to row prefix + d. A destination can be another path row's source, so one block
// owns all rows of a (tensor, b, head, column chunk): it gathers every moving row into shared memory,
// waits, then scatters. Column chunks are independent, which keeps the staging small for any D.

constexpr int kCommitKvThreads = 256;
constexpr int kCommitKvStagingBytes = 32 * 1024;

struct KvStrides {
  int64_t sb, sh, ss;  // cache [B, H, S, Dh] (last dim contiguous, checked by check_commit_kv)
  int64_t slots, head_dim, chunk;
  int heads;
};

template <typename T, int VEC>
__global__ void __launch_bounds__(kCommitKvThreads) commit_kv_kernel(LayerTable<T> cache, KvStrides s,
                                                                   const int64_t* __restrict__ prefix_len,
                                                                   int64_t pl_s, Path path, int chunks) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();  // launched as a programmatic dependent: nothing read or written before
  T* staged = reinterpret_cast<T*>(smem_raw);  // [len][chunk]
  const int tensor = blockIdx.z, b = blockIdx.y;
  const int h = blockIdx.x / chunks;
  const int64_t c0 = (blockIdx.x % chunks) * s.chunk;
  const int64_t width = min(s.chunk, s.head_dim - c0);
  const int64_t prefix = prefix_len[b * pl_s];
  // Every path slot must lie inside the cache; otherwise the row is left alone.
  const int64_t room = s.slots - prefix;  // path nodes must land inside the cache
  const int len = path.length(b, static_cast<int>(room < INT32_MAX ? room : INT32_MAX));
  if (len == 0 || prefix < 0 || prefix + len > s.slots) return;
  T* base = cache.ptr[tensor] + b * s.sb + h * s.sh + c0;
  const int64_t packs = width / VEC;
  for (int64_t e = threadIdx.x; e < len * packs; e += kCommitKvThreads) {
    const int d = static_cast<int>(e / packs);
    const int64_t c = (e % packs) * VEC;
    *reinterpret_cast<cuda::Pack<T, VEC>*>(staged + d * s.chunk + c) =
        *reinterpret_cast<const cuda::Pack<T, VEC>*>(base + (prefix + path.node(b, d)) * s.ss + c);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < len * packs; e += kCommitKvThreads) {
    const int d = static_cast<int>(e / packs);
    if (path.node(b, d) == d) continue;  // already in place
    const int64_t c = (e % packs) * VEC;
    *reinterpret_cast<cuda::Pack<T, VEC>*>(base + (prefix + d) * s.ss + c) =
        *reinterpret_cast<const cuda::Pack<T, VEC>*>(staged + d * s.chunk + c);
  }
}

// ==== gather_rows ==============================================================================

constexpr int kGatherThreads = 128;

template <typename T, int VEC>
__global__ void __launch_bounds__(kGatherThreads) gather_rows_kernel(const T* __restrict__ src, int64_t src_sb,
                                                                    int64_t src_sn, int num_nodes, Path path,
                                                                    int64_t features, T* __restrict__ out,
                                                                    int64_t out_sb, int64_t out_sd) {
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();  // launched as a programmatic dependent: nothing read or written before
  const int b = blockIdx.x / path.max_len, d = blockIdx.x % path.max_len;
  const int64_t c = (static_cast<int64_t>(blockIdx.y) * kGatherThreads + threadIdx.x) * VEC;
  if (c >= features) return;
  const int len = path.length(b, num_nodes);
  cuda::Pack<T, VEC> pk;
  if (d < len) {
    pk = *reinterpret_cast<const cuda::Pack<T, VEC>*>(src + b * src_sb + path.node(b, d) * src_sn + c);
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) pk.v[e] = T(0);
  }
  *reinterpret_cast<cuda::Pack<T, VEC>*>(out + b * out_sb + d * out_sd + c) = pk;
}

// Row moves are plain copies, so they dispatch on the element size, not the dtype: any dtype of 1, 2,
// 4 or 8 bytes is moved as unsigned words of that size.
void check_element_size(const char* op, const char* name, const at::Tensor& t) {
  const int64_t size = t.element_size();
  TORCH_CHECK_VALUE(size == 1 || size == 2 || size == 4 || size == 8, op, ": ", name,
                    " must have elements of 1, 2, 4 or 8 bytes on CUDA, got ", t.scalar_type());
}

template <typename F>
void dispatch_element_size(const at::Tensor& t, F&& body) {
  switch (t.element_size()) {
    case 1: body(uint8_t{}); break;
    case 2: body(uint16_t{}); break;
    case 4: body(uint32_t{}); break;
    default: body(uint64_t{}); break;
  }
}

// Calls launch(std::integral_constant<int, VEC>) with VEC = 16 / sizeof(T) (16-byte packs) when the
// row length, every row stride and every base pointer allow aligned packs, else VEC = 1.
template <typename T, typename F>
void with_row_packs(int64_t row_len, std::initializer_list<int64_t> strides, const std::vector<const void*>& bases,
                    F&& launch) {
  constexpr int kVec = 16 / sizeof(T);
  bool ok = row_len % kVec == 0;
  for (int64_t st : strides) ok = ok && st % kVec == 0;
  for (const void* p : bases) ok = ok && cuda::is_aligned(p, 16);
  if (ok) {
    launch(std::integral_constant<int, kVec>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
}

}  // namespace

// ---- entry points ------------------------------------------------------------------------------

void commit_gdn_state_cuda(at::TensorList state, at::TensorList stash_u, at::TensorList stash_k,
                           at::TensorList stash_cumg, const at::Tensor& accepted, const at::Tensor& accept_len) {
  constexpr const char* op = "commit_gdn_state";
  check_commit_gdn_state(state, stash_u, stash_k, stash_cumg, accepted, accept_len);
  const c10::cuda::CUDAGuard guard(accepted.device());
  const int64_t layers = state.size();
  if (layers == 0 || accepted.size(0) == 0 || accepted.size(1) == 0) return;
  const int64_t max_len = accepted.size(1);
  // Validated for every layer before the first launch, so a failure writes nothing.
  auto staging_bytes = [&](int64_t l) { return commit_gdn_smem_bytes(max_len, state[l].size(3)); };
  for (int64_t l = 0; l < layers; ++l) {
    TORCH_CHECK_VALUE(staging_bytes(l) <= cuda::max_dynamic_smem(), op, ": paths of ", max_len, " nodes with V = ",
                      state[l].size(3), " need more shared memory than this GPU offers");
  }
  for_each_layer_run(
      layers,
      [&](int64_t a, int64_t l) {
        return same_layout(state[a], state[l]) && same_layout(stash_u[a], stash_u[l]) &&
               same_layout(stash_k[a], stash_k[l]) && same_layout(stash_cumg[a], stash_cumg[l]);
      },
      [&](int64_t first, int64_t count) {
        const at::Tensor &st = state[first], &su = stash_u[first], &sk = stash_k[first], &cg = stash_cumg[first];
        const int64_t bsz = st.size(0), hv = st.size(1), kdim = st.size(2), vdim = st.size(3);
        const GdnStrides s{st.stride(0), st.stride(1), st.stride(2), st.stride(3), su.stride(0), su.stride(1),
                           su.stride(2), su.stride(3), sk.stride(0), sk.stride(1), sk.stride(2), sk.stride(3),
                           cg.stride(0), cg.stride(1), cg.stride(2),
                           static_cast<int>(su.size(1)), static_cast<int>(sk.size(2)), static_cast<int>(hv),
                           static_cast<int>(kdim), static_cast<int>(vdim)};
        const size_t smem = staging_bytes(first);
        const int row_tiles = static_cast<int>(cuda::ceil_div(kdim, kCommitGdnRows));
        const dim3 grid(static_cast<unsigned>(hv * row_tiles), static_cast<unsigned>(bsz),
                        static_cast<unsigned>(count));
        bool packed = st.stride(3) == 1 && vdim % 4 == 0 && st.stride(0) % 4 == 0 && st.stride(1) % 4 == 0 && st.stride(2) % 4 == 0;
        for (int64_t l = first; l < first + count; ++l) packed = packed && cuda::is_aligned(state[l].data_ptr(), 16);
        auto launch = [&](auto kernel) {
          cuda::allow_dynamic_smem(kernel, smem);
          cuda::launch_programmatic(kernel, grid, dim3(kCommitGdnThreads), smem,
              table_of<float>(state, first, count), table_of<const float>(stash_u, first, count),
              table_of<const float>(stash_k, first, count), table_of<const float>(stash_cumg, first, count), s,
              path_of(accepted, accept_len), row_tiles);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        };
        if (packed) {
          launch(commit_gdn_state_kernel<4>);
        } else {
          launch(commit_gdn_state_kernel<1>);
        }
      });
}

void commit_conv_state_cuda(at::TensorList conv_state, at::TensorList x, const at::Tensor& accepted,
                            const at::Tensor& accept_len) {
  check_commit_conv_state(conv_state, x, accepted, accept_len);
  const c10::cuda::CUDAGuard guard(accepted.device());
  const int64_t layers = conv_state.size();
  if (layers == 0 || accepted.size(0) == 0 || accepted.size(1) == 0) return;
  for_each_layer_run(
      layers,
      [&](int64_t a, int64_t l) { return same_layout(conv_state[a], conv_state[l]) && same_layout(x[a], x[l]); },
      [&](int64_t first, int64_t count) {
        const at::Tensor &cs = conv_state[first], &xs = x[first];
        const ConvStrides s{cs.stride(0), cs.stride(1), cs.stride(2), xs.stride(0), xs.stride(1), xs.stride(2),
                            cs.size(1),   cs.size(2),   static_cast<int>(xs.size(1))};
        const dim3 grid(static_cast<unsigned>(cuda::ceil_div(cs.size(1), kCommitConvThreads)),
                        static_cast<unsigned>(cs.size(0)), static_cast<unsigned>(count));
        if (grid.x == 0 || s.state_len == 0) return;
        // A pure copy: moved as words of the element size (x has conv_state's dtype).
        dispatch_element_size(cs, [&](auto word) {
          using T = decltype(word);
          cuda::launch_programmatic(commit_conv_state_kernel<T>, grid, dim3(kCommitConvThreads), 0,
              table_of<T>(conv_state, first, count), table_of<const T>(x, first, count), s,
              path_of(accepted, accept_len));
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
}

void commit_kv_cuda(at::TensorList cache, const at::Tensor& prefix_len, const at::Tensor& accepted,
                    const at::Tensor& accept_len) {
  constexpr const char* op = "commit_kv";
  check_commit_kv(cache, prefix_len, accepted, accept_len);
  const c10::cuda::CUDAGuard guard(accepted.device());
  const int64_t tensors = cache.size();
  if (tensors == 0 || accepted.size(0) == 0 || accepted.size(1) == 0) return;
  const int64_t max_len = accepted.size(1);
  // Validated for every cache before the first launch, so a failure writes nothing. The staging of one
  // block never exceeds max(kCommitKvStagingBytes, 16 bytes per path node).
  for (int64_t l = 0; l < tensors; ++l) check_element_size(op, "cache", cache[l]);
  TORCH_CHECK_VALUE(static_cast<size_t>(16 * max_len) <= cuda::max_dynamic_smem(), op, ": paths of ", max_len,
                    " nodes need more shared memory than this GPU offers");
  for_each_layer_run(
      tensors, [&](int64_t a, int64_t l) { return same_layout(cache[a], cache[l]); },
      [&](int64_t first, int64_t count) {
        const at::Tensor& c = cache[first];
        const int64_t bsz = c.size(0), heads = c.size(1), head_dim = c.size(3);
        if (head_dim == 0 || heads == 0) return;
        std::vector<const void*> bases;
        for (int64_t l = first; l < first + count; ++l) bases.push_back(cache[l].data_ptr());
        dispatch_element_size(c, [&](auto word) {
          using T = decltype(word);
          with_row_packs<T>(head_dim, {c.stride(0), c.stride(1), c.stride(2)}, bases, [&](auto vec_c) {
            constexpr int kVec = decltype(vec_c)::value;
            // Column chunk: the whole head when the path's rows fit the staging budget.
            const int64_t row_budget = kCommitKvStagingBytes / (max_len * static_cast<int64_t>(sizeof(T)));
            const int64_t chunk = std::max<int64_t>(kVec, std::min<int64_t>(head_dim, row_budget / kVec * kVec));
            const int chunks = static_cast<int>(cuda::ceil_div(head_dim, chunk));
            const KvStrides s{c.stride(0), c.stride(1), c.stride(2), c.size(2), head_dim, chunk, static_cast<int>(heads)};
            const size_t smem = sizeof(T) * max_len * chunk;
            const dim3 grid(static_cast<unsigned>(heads * chunks), static_cast<unsigned>(bsz),
                            static_cast<unsigned>(count));
            auto kernel = commit_kv_kernel<T, kVec>;
            cuda::allow_dynamic_smem(kernel, smem);
            cuda::launch_programmatic(kernel, grid, dim3(kCommitKvThreads), smem, table_of<T>(cache, first, count), s,
                                      prefix_len.data_ptr<int64_t>(), prefix_len.stride(0),
                                      path_of(accepted, accept_len), chunks);
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
        });
      });
}

void gather_rows_cuda(const at::Tensor& src, const at::Tensor& accepted, const at::Tensor& accept_len,
                      at::Tensor& out) {
  constexpr const char* op = "gather_rows";
  check_gather_rows(src, accepted, accept_len, out);
  const c10::cuda::CUDAGuard guard(src.device());
  const int64_t bsz = src.size(0), n = src.size(1), features = src.size(2), max_len = accepted.size(1);
  if (bsz == 0 || max_len == 0 || features == 0) return;
  check_element_size(op, "src", src);
  dispatch_element_size(src, [&](auto word) {
    using T = decltype(word);
    with_row_packs<T>(features, {src.stride(0), src.stride(1), out.stride(0), out.stride(1)},
                      {src.data_ptr(), out.data_ptr()}, [&](auto vec_c) {
                        constexpr int kVec = decltype(vec_c)::value;
                        const dim3 grid(static_cast<unsigned>(bsz * max_len),
                                        static_cast<unsigned>(cuda::ceil_div(features, kGatherThreads * kVec)));
                        cuda::launch_programmatic(gather_rows_kernel<T, kVec>, grid, dim3(kGatherThreads), 0,
                            reinterpret_cast<const T*>(src.data_ptr()), src.stride(0), src.stride(1),
                            static_cast<int>(n), path_of(accepted, accept_len), features,
                            reinterpret_cast<T*>(out.data_ptr()), out.stride(0), out.stride(1));
                        C10_CUDA_KERNEL_LAUNCH_CHECK();
                      });
  });
}

// ---- store_kv ----------------------------------------------------------------------------------------

namespace {

struct StoreKvArgs {
  char* keys;
  char* values;
  const char* key_states;
  const char* value_states;
  const int64_t* slots;
  int64_t slots_sb;             // 0: one slot table for every batch row
  int64_t cache_strides[2][3];  // keys, values: B, H, slot (in elements)
  int64_t state_strides[2][3];  // key_states, value_states: B, H, N
  int64_t batch, heads, nodes, num_slots, packs_per_row, total;
};

// One thread per (b, h, n, pack of W bytes): copies that pack of row n's key and value to slot slots[b, n] (slots[n]
// for a shared table). A negative slot stores nothing (a padding row); one past the caches is skipped too (no
// device-side check can raise; the caller guarantees the range).
template <typename W, int ELEMENT>
__global__ void __launch_bounds__(256) store_kv_kernel(const StoreKvArgs a) {
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();  // launched as a programmatic dependent: nothing read or written before
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.total) return;
  const int64_t pack = idx % a.packs_per_row, row = idx / a.packs_per_row;
  const int64_t n = row % a.nodes, bh = row / a.nodes, h = bh % a.heads, b = bh / a.heads;
  const int64_t slot = a.slots[b * a.slots_sb + n];
  if (slot < 0 || slot >= a.num_slots) return;
  constexpr int64_t kElements = sizeof(W) / ELEMENT;  // elements per pack
  const char* src[2] = {a.key_states, a.value_states};
  char* dst[2] = {a.keys, a.values};
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const int64_t* ss = a.state_strides[t];
    const int64_t* cs = a.cache_strides[t];
    const W v = *reinterpret_cast<const W*>(src[t] + (b * ss[0] + h * ss[1] + n * ss[2] + pack * kElements) * ELEMENT);
    *reinterpret_cast<W*>(dst[t] + (b * cs[0] + h * cs[1] + slot * cs[2] + pack * kElements) * ELEMENT) = v;
  }
}

template <typename W, int ELEMENT>
void launch_store_kv(StoreKvArgs a, int64_t dim) {
  a.packs_per_row = dim * ELEMENT / static_cast<int64_t>(sizeof(W));
  a.total = a.packs_per_row * a.heads * a.nodes * a.batch;
  if (a.total == 0) return;
  const unsigned blocks = static_cast<unsigned>(cuda::ceil_div(a.total, 256));
  cuda::launch_programmatic(store_kv_kernel<W, ELEMENT>, dim3(blocks), dim3(256), 0, a);
}

template <int ELEMENT>
void dispatch_store_kv(const StoreKvArgs& a, int64_t dim, bool packed) {
  using Element = std::conditional_t<ELEMENT == 2, uint16_t, uint32_t>;
  packed ? launch_store_kv<uint4, ELEMENT>(a, dim) : launch_store_kv<Element, ELEMENT>(a, dim);
}

}  // namespace

void store_kv_cuda(at::Tensor& keys, at::Tensor& values, const at::Tensor& slots, const at::Tensor& key_states,
                   const at::Tensor& value_states) {
  check_store_kv(keys, values, slots, key_states, value_states);
  const c10::cuda::CUDAGuard guard(keys.device());
  const int64_t element = keys.element_size(), dim = keys.size(3);
  StoreKvArgs a{};
  a.keys = static_cast<char*>(keys.data_ptr());
  a.values = static_cast<char*>(values.data_ptr());
  a.key_states = static_cast<const char*>(key_states.data_ptr());
  a.value_states = static_cast<const char*>(value_states.data_ptr());
  a.slots = slots.data_ptr<int64_t>();
  a.slots_sb = slots.dim() == 2 ? slots.stride(0) : 0;
  const at::Tensor* caches[2] = {&keys, &values};
  const at::Tensor* states[2] = {&key_states, &value_states};
  // 16-byte packs when every row of all four tensors starts 16-byte aligned.
  bool packed = (dim * element) % 16 == 0;
  for (int t = 0; t < 2; ++t) {
    for (int d = 0; d < 3; ++d) {
      a.cache_strides[t][d] = caches[t]->stride(d);
      a.state_strides[t][d] = states[t]->stride(d);
      packed = packed && (caches[t]->stride(d) * element) % 16 == 0 && (states[t]->stride(d) * element) % 16 == 0;
    }
    packed = packed && cuda::is_aligned(caches[t]->data_ptr(), 16) && cuda::is_aligned(states[t]->data_ptr(), 16);
  }
  a.heads = keys.size(1);
  a.nodes = slots.size(-1);
  a.num_slots = keys.size(2);
  a.batch = keys.size(0);
  if (element == 2) {
    dispatch_store_kv<2>(a, dim, packed);
  } else {
    dispatch_store_kv<4>(a, dim, packed);
  }
}

}  // namespace ddtree
