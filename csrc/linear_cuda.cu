// Weight-streaming projections for the few rows of a round: out[M, N] = x[M, K] weight[N, K]^T with M <= 72
// (a decode step, a DFlash block, a verify of up to 71 tree nodes). At these sizes a projection only streams its
// weights, and cuBLAS streams the mid-sized ones of a round well under the copy rate (27B, 65 rows: the 6144 -> 5120
// projections at 2.1 TB/s, Qwen3-8B's K/V projections at 1.3 TB/s, plus a split-K reduce kernel after many of them).
//
// Layout of the work ("swap AB": the weights are the tensor cores' A operand, the x rows their B columns):
// - A CTA of 4 warps takes 128 output features against all M rows (NT n8 column tiles), so every weight byte is
//   read once.
// - K goes through shared memory in chunks of 64, STAGES deep: the weight tile [128 rows][64] by the bulk tensor
//   copy engine (TMA, 128-byte swizzle, completing on an mbarrier), the x rows of the chunk by cp.async. Per-thread
//   cp.async copies alone kept too few bytes in flight: 2.4 TB/s at one row, against the 4.2 TB/s copy rate.
// - The products on tensor cores, float32 sums: on sm_90a builds the 4 warps are one warpgroup issuing wgmma
//   m64nNk16 (N = 8 NT) on both 64-feature halves straight from the swizzled tiles (csrc/wgmma.cuh); other builds
//   take mma m16n8k16 per warp (32 features each) from ldmatrix fragments (conflict-free on the swizzle).
// - K is split over the CTAs of a thread-block cluster (up to 8); the partial tiles are summed in split order
//   through distributed shared memory, with no workspace, no second kernel and no atomics. The split depends only
//   on (N, K) and the GPU, never on M, so a row's output bits do not depend on how many rows came with it.
//
// Needs compute capability 9.0 (clusters, TMA) and 16-bit inputs; the op falls back to at::mm otherwise. Measured
// slower than cuBLAS at most round shapes (benchmarks/results/2026-12-01-h200-linear-kernel.md, with what bounds
// it), so rounds use it only when ddtree_ext.fused.linear_kernel is on.
#include <cooperative_groups.h>
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "cuda_common.cuh"
#include "ops.h"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "wgmma.cuh"
#endif

namespace ddtree {
namespace {

namespace cg = cooperative_groups;
using cuda::kWarp;

constexpr int kLinearWarps = 4;
constexpr int kLinearThreads = kLinearWarps * kWarp;
constexpr int kWarpFeatures = 32;                             // two 16-row tensor-core tiles per warp
constexpr int kCtaFeatures = kLinearWarps * kWarpFeatures;    // 128
constexpr int kChunk = 64;                                    // k per pipeline stage: 128 bytes of a row
constexpr int kMaxLinearRows = 72;                            // 9 column tiles of 8
constexpr int kMaxSplits = 8;                                 // the portable cluster size
constexpr int kPartStride = kCtaFeatures + 4;                 // floats per partial row: conflict-free stores
constexpr int kSplitCtasPerSm = 1;  // the CTAs the split of K fills, per SM (M-independent; 2 measured slower)

template <int NT>
struct LinearLayout {
  // Per stage: the weight tile [128 rows][128 bytes], then the x rows [NT * 8][128 bytes], both with the 128-byte
  // swizzle (16-byte piece c of row r at c ^ (r % 8)); stages 1024-byte aligned, as the swizzle wants.
  static constexpr int kWeightBytes = kCtaFeatures * kChunk * 2;
  static constexpr int kXBytes = NT * 8 * kChunk * 2;
  static constexpr int kStage = kWeightBytes + kXBytes;
  // Deeper pipelines where the x rows are few: up to 110 KB of stages (100 KB at NT = 9), two CTAs per SM.
  static constexpr int kStages = std::clamp((110 * 1024) / kStage, 3, 6);
  static constexpr int kPartBytes = NT * 8 * kPartStride * 4;
  static constexpr int kBarriers = std::max(kStages * kStage, kPartBytes);  // offset of the stages' mbarriers
  static constexpr int kTotal = 1024 + kBarriers + 8 * kStages;            // + slack to align the base
};

struct LinearShapes {
  int rows, n, k;
  int64_t x_stride, out_stride;
  int chunks_per_split;
};

[[maybe_unused]] __device__ __forceinline__ int swizzled(int row, int piece) { return row * 8 + (piece ^ (row & 7)); }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// The [128 rows][64] tile at (k0, row0) of the tensor map into shared memory, completing on `bar`.
__device__ __forceinline__ void load_tile(void* dst, const CUtensorMap* map, int k0, int row0, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::
          "r"(smem_addr(dst)),
      "l"(map), "r"(k0), "r"(row0), "r"(smem_addr(bar))
      : "memory");
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// A wgmma matrix descriptor of a K-major tile in the 128-byte swizzle (TMA's SWIZZLE_128B layout): 8-row groups
// 1024 bytes apart; the start moves 32 bytes per k16 step inside the swizzled rows.
__device__ __forceinline__ uint64_t sw128_descriptor(uint32_t smem_address) {
  return uint64_t{(smem_address & 0x3FFFF) >> 4} | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}
#endif

#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
#endif
#endif

template <typename T, int NT>
__global__ void __launch_bounds__(kLinearThreads) linear_rows_kernel(const __grid_constant__ CUtensorMap weight_map,
                                                                     LinearShapes sh, const T* __restrict__ x,
                                                                     T* __restrict__ out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using L = LinearLayout<NT>;
  constexpr int STAGES = L::kStages;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBarriers);
  const cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int n0 = blockIdx.x * kCtaFeatures;
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const bool active = n0 + warp * kWarpFeatures < sh.n;  // n is a multiple of 32: all of a warp's features or none
#endif
  const int split = static_cast<int>(cluster.block_rank()), splits = static_cast<int>(cluster.num_blocks());
  const int chunk0 = split * sh.chunks_per_split;
  const int chunks = std::max(0, std::min(sh.chunks_per_split, sh.k / kChunk - chunk0));

  auto stage_at = [&](int i) { return smem + (i % STAGES) * L::kStage; };
  auto issue = [&](int i) {  // chunk i of this split into its stage: the weight tile (thread 0), the x rows (all)
    unsigned char* st = stage_at(i);
    const int k0 = (chunk0 + i) * kChunk;
    if (tid == 0) {
      mbarrier_expect_bytes(&full[i % STAGES], L::kWeightBytes);  // rows past N arrive as zeros, counted too
      load_tile(st, &weight_map, k0, n0, &full[i % STAGES]);
    }
    uint4* xs = reinterpret_cast<uint4*>(st + L::kWeightBytes);
    for (int e = tid; e < sh.rows * 8; e += kLinearThreads) {
      const int row = e / 8, piece = e % 8;
      cuda::copy_async<16>(xs + swizzled(row, piece), x + row * sh.x_stride + k0 + 8 * piece);
    }
  };

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) mbarrier_init(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the copy engine
  }
  // Rows past M read zeros: they only feed output columns nobody stores, but no product reads uninitialised memory.
  const int pad = NT * 8 - sh.rows;
  for (int e = tid; e < STAGES * pad * 8; e += kLinearThreads) {
    uint4* xs = reinterpret_cast<uint4*>(smem + (e / (pad * 8)) * L::kStage + L::kWeightBytes);
    const int rest = e % (pad * 8);
    xs[swizzled(sh.rows + rest / 8, rest % 8)] = make_uint4(0, 0, 0, 0);
  }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the zeros, for the tensor cores' reads
  float acc[2][4 * NT];  // per 64-feature half: wgmma's accumulator layout (csrc/wgmma.cuh)
#else
  float acc[2][NT][4];
#endif
  __syncthreads();
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    float* a = reinterpret_cast<float*>(acc[m]);
#pragma unroll
    for (int q = 0; q < 4 * NT; ++q) a[q] = 0.f;
  }

#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < chunks) issue(i);
    cuda::commit_async_copies();
  }
  for (int i = 0; i < chunks; ++i) {
    cuda::wait_async_copies_but<STAGES - 2>();  // this thread's x pieces of chunk i
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // ... visible to the tensor cores' reads
#endif
    mbarrier_wait(&full[i % STAGES], (i / STAGES) & 1);  // the weight tile of chunk i
    __syncthreads();  // every thread's x pieces are in; every warp is done with the stage refilled next
    if (i + STAGES - 1 < chunks) issue(i + STAGES - 1);
    cuda::commit_async_copies();
    const uint32_t w_base = smem_addr(stage_at(i)), x_base = w_base + L::kWeightBytes;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    // The 4 warps are one warpgroup: each k16 step, D[64 features, 8 NT rows] += W[64, 16] X[16, 8 NT] for both
    // halves of the CTA's features, from the swizzled tiles (features past N are zeros).
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int ks = 0; ks < kChunk / 16; ++ks) {
      const uint64_t b = sw128_descriptor(x_base + 32 * ks);
#pragma unroll
      for (int m = 0; m < 2; ++m) cuda::wgmma_m64k16<T, NT>(acc[m], sw128_descriptor(w_base + m * 64 * 128 + 32 * ks), b);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");  // the stage may be refilled after the next barrier
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
      for (int q = 0; q < 4 * NT; ++q) asm volatile("" : "+f"(acc[m][q])::"memory");  // no read before the wait
    }
#else  // mma.sync from ldmatrix, per warp
    if (!active) continue;
    // ldmatrix addresses: A (weights) row warp * 32 + 16 mt + lane % 16, pieces 2 s + lane / 16; B (x) row
    // 8 j + lane % 8, pieces 4 h + lane / 8. Every row a lane names is congruent to lane % 8 mod 8: one swizzle.
    const int sw = lane & 7;
    const uint32_t a_off = (warp * kWarpFeatures + lane % 16) * 128, b_off = (lane % 8) * 128;
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // k 32 h .. 32 h + 31 of the chunk: two k16 steps
      uint32_t b[NT][4];
#pragma unroll
      for (int j = 0; j < NT; ++j) ldmatrix_x4(b[j], x_base + j * 8 * 128 + b_off + (((4 * h + lane / 8) ^ sw) << 4));
#pragma unroll
      for (int ds = 0; ds < 2; ++ds) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          uint32_t a[4];
          ldmatrix_x4(a, w_base + mt * 16 * 128 + a_off + (((4 * h + 2 * ds + lane / 16) ^ sw) << 4));
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            const uint32_t bb[2] = {b[j][2 * ds], b[j][2 * ds + 1]};
            cuda::mma_16x8x16<T>(acc[mt][j], a, bb);
          }
        }
      }
    }
#endif
  }

  // ---- the partial tile [row][feature] in shared memory, then the cluster's sum in split order ----
  cuda::wait_async_copies_but<0>();
  __syncthreads();  // the stages are free
  float* part = reinterpret_cast<float*>(smem);  // [row][feature]
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  {
    const int gid = lane / 4, tig = lane % 4;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const int f = 64 * m + 16 * warp + gid;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int r = 8 * j + 2 * tig;
        part[r * kPartStride + f] = acc[m][4 * j];
        part[(r + 1) * kPartStride + f] = acc[m][4 * j + 1];
        part[r * kPartStride + f + 8] = acc[m][4 * j + 2];
        part[(r + 1) * kPartStride + f + 8] = acc[m][4 * j + 3];
      }
    }
  }
#else
  if (active) {
    const int gid = lane / 4, tig = lane % 4;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const int f = warp * kWarpFeatures + 16 * mt + gid;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int r = 8 * j + 2 * tig;
        part[r * kPartStride + f] = acc[mt][j][0];
        part[(r + 1) * kPartStride + f] = acc[mt][j][1];
        part[r * kPartStride + f + 8] = acc[mt][j][2];
        part[(r + 1) * kPartStride + f + 8] = acc[mt][j][3];
      }
    }
  }
#endif
  cluster.sync();  // every split's partial tile is visible to the cluster
  constexpr int kQuads = kCtaFeatures / 4;
  for (int e = split * kLinearThreads + tid; e < sh.rows * kQuads; e += splits * kLinearThreads) {
    const int r = e / kQuads, f = 4 * (e % kQuads);
    if (n0 + f >= sh.n) continue;
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s = 0; s < splits; ++s) {
      const float4 p = *reinterpret_cast<const float4*>(cluster.map_shared_rank(part, s) + r * kPartStride + f);
      sum[0] += p.x;
      sum[1] += p.y;
      sum[2] += p.z;
      sum[3] += p.w;
    }
    cuda::store_pack_float<T, 4>(out + r * sh.out_stride + n0 + f, sum);
  }
  cluster.sync();  // no CTA leaves while another may still read its partial tile
#else
  __trap();  // the launcher runs this kernel only on builds with code for compute capability >= 9.0
#endif
}

// The weight's tensor map for the kernel's [128 rows][64] tiles, encoded once per (address, shape, dtype): the
// weights of a model stay where they are, so a round finds them all here.
CUtensorMap weight_tensor_map(const at::Tensor& weight) {
  using Key = std::tuple<const void*, int64_t, int64_t, int>;
  struct KeyHash {
    size_t operator()(const Key& k) const {
      return std::hash<const void*>()(std::get<0>(k)) ^ (std::hash<int64_t>()(std::get<1>(k) * 31 + std::get<2>(k)) << 1) ^
             static_cast<size_t>(std::get<3>(k));
    }
  };
  static std::mutex mutex;
  static std::unordered_map<Key, CUtensorMap, KeyHash> maps;
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  const Key key{weight.data_ptr(), weight.size(0), weight.size(1), static_cast<int>(weight.scalar_type())};
  const std::lock_guard<std::mutex> lock(mutex);
  if (auto it = maps.find(key); it != maps.end()) return it->second;
  if (encode == nullptr) {
    cudaDriverEntryPointQueryResult found{};
    void* fn = nullptr;
#if CUDART_VERSION >= 12050
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
#else
    C10_CUDA_CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found));
#endif
    TORCH_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr, "linear: the driver has no cuTensorMapEncodeTiled");
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(weight.size(1)), static_cast<cuuint64_t>(weight.size(0))};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(weight.size(1)) * 2};
  const cuuint32_t box[2] = {kChunk, kCtaFeatures}, unit[2] = {1, 1};
  const CUresult status = encode(
      &map, weight.scalar_type() == at::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      2, weight.data_ptr(), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(status == CUDA_SUCCESS, "linear: cuTensorMapEncodeTiled failed with error ", static_cast<int>(status));
  maps.emplace(key, map);
  return map;
}

template <typename T, int NT>
void launch_linear_rows(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, int splits,
                        int chunks_per_split) {
  using L = LinearLayout<NT>;
  if (static_cast<size_t>(L::kTotal) > cuda::max_dynamic_smem()) {  // GPUs with less shared memory per block
    linear_mm(x, weight, out);
    return;
  }
  const int n = static_cast<int>(weight.size(0));
  const LinearShapes sh{static_cast<int>(x.size(0)), n, static_cast<int>(x.size(1)), x.stride(0), out.stride(0),
                        chunks_per_split};
  const CUtensorMap map = weight_tensor_map(weight);
  auto kernel = linear_rows_kernel<T, NT>;
  cuda::allow_dynamic_smem(kernel, L::kTotal);
  cuda::prefer_max_shared_memory(kernel);  // two CTAs per SM
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(cuda::ceil_div(n, kCtaFeatures)), static_cast<unsigned>(splits), 1);
  config.blockDim = dim3(kLinearThreads, 1, 1);
  config.dynamicSmemBytes = L::kTotal;
  config.stream = cuda::current_stream();
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = 1;
  attribute.val.clusterDim.y = static_cast<unsigned>(splits);
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, map, sh, x.data_ptr<T>(), out.data_ptr<T>()));
}

template <typename T>
void launch_linear_rows(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, int splits,
                        int chunks_per_split) {
  switch (cuda::ceil_div(x.size(0), 8)) {
    case 1: launch_linear_rows<T, 1>(x, weight, out, splits, chunks_per_split); break;
    case 2: launch_linear_rows<T, 2>(x, weight, out, splits, chunks_per_split); break;
    case 3: launch_linear_rows<T, 3>(x, weight, out, splits, chunks_per_split); break;
    case 4: launch_linear_rows<T, 4>(x, weight, out, splits, chunks_per_split); break;
    case 5: launch_linear_rows<T, 5>(x, weight, out, splits, chunks_per_split); break;
    case 6: launch_linear_rows<T, 6>(x, weight, out, splits, chunks_per_split); break;
    case 7: launch_linear_rows<T, 7>(x, weight, out, splits, chunks_per_split); break;
    case 8: launch_linear_rows<T, 8>(x, weight, out, splits, chunks_per_split); break;
    default: launch_linear_rows<T, 9>(x, weight, out, splits, chunks_per_split); break;
  }
}

// Whether this build has compute capability >= 9.0 code for the current GPU (else the kernel is a trap).
bool cluster_kernels_built(at::ScalarType dtype) {
  static const int version[2] = {
      cuda::ptx_version(linear_rows_kernel<at::Half, 1>),
      cuda::ptx_version(linear_rows_kernel<at::BFloat16, 1>),
  };
  return version[dtype == at::kBFloat16 ? 1 : 0] >= 90;
}

}  // namespace

// The kernel takes bfloat16/float16 with M <= 72, N a multiple of 32, K a multiple of 64, a contiguous weight,
// x rows 16-byte aligned and out rows 8-byte aligned, on GPUs (and builds) of compute capability >= 9.0; anything
// else runs at::mm (cuBLAS), as the CPU op does.
void linear_cuda(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out) {
  check_linear(x, weight, out);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), n = weight.size(0), k = x.size(1);
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  const bool kernel_applies =
      (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16) && rows <= kMaxLinearRows &&
      n % kWarpFeatures == 0 && k % kChunk == 0 && weight.is_contiguous() &&
      x.stride(0) % 8 == 0 && cuda::is_aligned(x.data_ptr(), 16) && cuda::is_aligned(weight.data_ptr(), 16) &&
      out.stride(0) % 4 == 0 && cuda::is_aligned(out.data_ptr(), 8) && prop->major >= 9 &&
      cluster_kernels_built(x.scalar_type());
  if (!kernel_applies) {
    linear_mm(x, weight, out);
    return;
  }
  // Split K until the CTAs fill the SMs once (kSplitCtasPerSm per SM, whatever M), each split whole chunks.
  const int64_t tiles = cuda::ceil_div(n, kCtaFeatures), total_chunks = k / kChunk;
  const int64_t want = std::clamp<int64_t>(kSplitCtasPerSm * prop->multiProcessorCount / tiles, 1,
                                           std::min<int64_t>(kMaxSplits, total_chunks));
  const int chunks_per_split = static_cast<int>(cuda::ceil_div(total_chunks, want));
  const int splits = static_cast<int>(cuda::ceil_div(total_chunks, chunks_per_split));
  AT_DISPATCH_SWITCH(x.scalar_type(), "linear",
                     AT_DISPATCH_CASE(at::kHalf,
                                      [&] { launch_linear_rows<scalar_t>(x, weight, out, splits, chunks_per_split); })
                         AT_DISPATCH_CASE(at::kBFloat16, [&] {
                           launch_linear_rows<scalar_t>(x, weight, out, splits, chunks_per_split);
                         }));
}

}  // namespace ddtree
