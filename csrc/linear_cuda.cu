// Weight-streaming projections for the few rows of a round: out[M, N] = x[M, K] weight[N, K]^T with M <= 72
// (a decode step, a DFlash block, a verify of up to 71 tree nodes). At these sizes a projection only streams its
// weights, and cuBLAS streams the mid-sized ones of a round well under the copy rate (27B, 65 rows: the 6144 -> 5120
// projections at 2.1 TB/s, Qwen3-8B's K/V projections at 1.3 TB/s, plus a split-K reduce kernel after many of them).
//
// Layout of the work ("swap AB": the weights are the tensor cores' A operand, the x rows their B columns):
// - A CTA takes 128 output features against all M rows (NT n8 column tiles), so every weight byte is read once.
//   Its 5 warps are specialised: one producer warp keeps the pipeline full, one warpgroup of 4 consumer warps
//   multiplies.
// - K goes through shared memory in chunks of 64 (128 bytes of a weight row), `boxes` consecutive chunks per stage and
//   `stages` stages deep, both chosen per call from the shared memory the SM can give (pipeline_for). The producer
//   loads each chunk's weight tile [128 rows][64] and x rows [8 NT][64] with the bulk tensor copy engine (TMA,
//   128-byte swizzle, completing on the stage's full mbarrier) and refills a stage once the consumers release it
//   on its empty mbarrier. Per-thread cp.async copies (v1) kept too few bytes in flight, one barrier per chunk (v4)
//   kept the copies waiting on the products, and one chunk per stage kept too little of each weight row in flight
//   together (benchmarks/results/2026-12-01-h200-linear-kernel.md).
// - The products on tensor cores, float32 sums: on sm_90a builds the consumer warpgroup issues wgmma m64nNk16
//   (N = 8 NT) on both 64-feature halves straight from the swizzled tiles (csrc/wgmma.cuh), one stage's products in
//   flight while the next stage's are issued; other builds take mma m16n8k16 per warp (32 features each) from
//   ldmatrix fragments (conflict-free on the swizzle).
// - K is split over the CTAs of a thread-block cluster (up to 8); the partial tiles are summed in split order
//   through distributed shared memory, with no workspace, no second kernel and no atomics. The split depends only
//   on (N, K) and the GPU, never on M or the pipeline, so a row's output bits do not depend on how many rows came
//   with it.
// - Launched as a programmatic dependent (PDL) of the kernel before it: barrier set-up overlaps that kernel's end,
//   and with prefetch_weight the first stages' weight tiles stream before it is done (x, and every store, wait for
//   it). Each CTA lets the next kernel launch as soon as it starts.
//
// Needs compute capability 9.0 (clusters, TMA, PDL) and 16-bit inputs; the op falls back to at::mm otherwise.
// Measured slower than cuBLAS at most round shapes (benchmarks/results/2026-12-01-h200-linear-kernel.md, with what
// bounds it), so rounds use it only when ddtree_ext.fused.linear_kernel is on.
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

constexpr int kConsumerWarps = 4;                             // one warpgroup: the tensor-core products
constexpr int kLinearThreads = (kConsumerWarps + 1) * kWarp;  // + the producer warp (the bulk copies)
constexpr int kWarpFeatures = 32;                             // two 16-row tensor-core tiles per warp
constexpr int kCtaFeatures = kConsumerWarps * kWarpFeatures;  // 128
constexpr int kChunk = 64;                                    // k per chunk (a stage holds `boxes` of them)
constexpr int kMaxLinearRows = 72;                            // 9 column tiles of 8
constexpr int kMaxSplits = 8;                                 // the portable cluster size
constexpr int kMaxStages = 16;
constexpr int kPartStride = kCtaFeatures + 4;                 // floats per partial row: conflict-free stores
constexpr int kSplitCtasPerSm = 2;  // the CTAs the split of K aims for, per SM (M-independent; 1 measured mixed)

// Per stage: the weight tile [128 rows][128 bytes], then the x rows [NT * 8][128 bytes], both as the copy engine
// writes them with the 128-byte swizzle (16-byte piece c of row r at c ^ (r % 8)); stages 1024-byte aligned.
constexpr int kWeightTileBytes = kCtaFeatures * kChunk * 2;
constexpr int x_tile_bytes(int nt) { return nt * 8 * kChunk * 2; }
constexpr int stage_bytes(int nt) { return kWeightTileBytes + x_tile_bytes(nt); }
constexpr int part_bytes(int nt) { return nt * 8 * kPartStride * 4; }
// Shared memory of a CTA with `stages` stages: the stages (the partial tile reuses them), 2 mbarriers per stage,
// and slack to align the base to 1024 bytes.
constexpr int linear_smem_bytes(int nt, int boxes, int stages) {
  return 1024 + std::max(stages * boxes * stage_bytes(nt), part_bytes(nt)) + 16 * stages;
}

struct LinearShapes {
  int rows, n, k;
  int64_t out_stride;
  int chunks_per_split;
  int boxes;  // 64-k chunks per pipeline stage (consecutive k: a row's bytes in flight together)
  int stages;
  bool prefetch_weight;  // the weight may be read before the preceding kernels complete (nothing in flight writes it)
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
using cuda::ldmatrix_x4;
using cuda::smem_addr;

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
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

// Programmatic dependent launch (cuda_common.cuh).
using cuda::allow_dependent_launch;
using cuda::wait_for_preceding_grid;

// The box at (k0, row0) of a tensor map (a [128 rows][64] weight tile, or [NT * 8][64] of x) into shared memory,
// completing on `bar`.
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

#endif

template <typename T, int NT>
__global__ void __launch_bounds__(kLinearThreads) linear_rows_kernel(const __grid_constant__ CUtensorMap weight_map,
                                                                     const __grid_constant__ CUtensorMap x_map,
                                                                     LinearShapes sh, T* __restrict__ out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kBox = stage_bytes(NT);  // one chunk: [weight tile][x rows]
  const int stages = sh.stages, boxes = sh.boxes, kStage = boxes * kBox;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + std::max(stages * kStage, part_bytes(NT)));
  uint64_t* empty = full + stages;
  const cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int n0 = blockIdx.x * kCtaFeatures;
  const int split = static_cast<int>(cluster.block_rank()), splits = static_cast<int>(cluster.num_blocks());
  const int chunk0 = split * sh.chunks_per_split;
  // Pipeline steps of `boxes` chunks each (the split's chunks are a multiple of it).
  const int steps = std::max(0, std::min(sh.chunks_per_split, sh.k / kChunk - chunk0)) / boxes;

  if (tid == 0) {
    for (int s = 0; s < stages; ++s) {
      mbarrier_init(&full[s], 1);                 // the producer's expect_tx; the copies complete it
      mbarrier_init(&empty[s], kConsumerWarps);   // one arrive per consumer warp once it is done with the stage
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the copy engine
    allow_dependent_launch();  // its CTAs take SMs as ours leave (and stream their own weights meanwhile)
  }
  __syncthreads();

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  float acc[2][4 * NT];  // per 64-feature half: wgmma's accumulator layout (csrc/wgmma.cuh)
#else
  float acc[2][NT][4];
#endif
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    float* a = reinterpret_cast<float*>(acc[m]);
#pragma unroll
    for (int q = 0; q < 4 * NT; ++q) a[q] = 0.f;
  }

  // Warp specialisation: the producer warp keeps up to `stages` steps in flight (weights and x rows by the copy
  // engine: rows past N or M arrive as zeros and are counted too), refilling a stage as soon as the consumers
  // release it; the consumers never wait on anything but the data of the step they are on.
  // Under a programmatic launch the first stages' weight tiles may be in flight before the preceding kernels are
  // done (prefetch_weight); everything else, the x rows and every store, waits for them.
  if (warp == kConsumerWarps) {
    if (lane == 0) {
      const int first = std::min(steps, stages);
      auto load_weight = [&](int i) {
        mbarrier_expect_bytes(&full[i % stages], kStage);
        for (int b = 0; b < boxes; ++b)
          load_tile(smem + (i % stages) * kStage + b * kBox, &weight_map, (chunk0 + i * boxes + b) * kChunk, n0,
                    &full[i % stages]);
      };
      auto load_x = [&](int i) {
        for (int b = 0; b < boxes; ++b)
          load_tile(smem + (i % stages) * kStage + b * kBox + kWeightTileBytes, &x_map,
                    (chunk0 + i * boxes + b) * kChunk, 0, &full[i % stages]);
      };
      if (sh.prefetch_weight) {
        for (int i = 0; i < first; ++i) load_weight(i);
        wait_for_preceding_grid();
        for (int i = 0; i < first; ++i) load_x(i);
      } else {
        wait_for_preceding_grid();
        for (int i = 0; i < first; ++i) {
          load_weight(i);
          load_x(i);
        }
      }
      for (int i = first; i < steps; ++i) {
        mbarrier_wait(&empty[i % stages], (i / stages - 1) & 1);
        load_weight(i);
        load_x(i);
      }
    } else {
      wait_for_preceding_grid();
    }
  } else {
    wait_for_preceding_grid();
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const bool active = n0 + warp * kWarpFeatures < sh.n;  // n is a multiple of 32: all of a warp's features or none
#endif
    for (int i = 0; i < steps; ++i) {
      const int s = i % stages;
      mbarrier_wait(&full[s], (i / stages) & 1);
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
      // The 4 warps are one warpgroup: each k16 step, D[64 features, 8 NT rows] += W[64, 16] X[16, 8 NT] for both
      // halves of the CTA's features, from the swizzled tiles (features past N are zeros). The products of a step
      // stay in flight while the next step's are issued; a stage is released once its products are done.
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll 1
      for (int bx = 0; bx < boxes; ++bx) {
        const uint32_t w_base = smem_addr(smem + s * kStage + bx * kBox), x_base = w_base + kWeightTileBytes;
#pragma unroll
        for (int ks = 0; ks < kChunk / 16; ++ks) {
          const uint64_t b = sw128_descriptor(x_base + 32 * ks);
#pragma unroll
          for (int m = 0; m < 2; ++m)
            cuda::wgmma_m64k16<T, NT>(acc[m], sw128_descriptor(w_base + m * 64 * 128 + 32 * ks), b);
        }
      }
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");  // step i - 1's products are done
      if (i > 0 && lane == 0) mbarrier_arrive(&empty[(i - 1) % stages]);
#else  // mma.sync from ldmatrix, per warp
#pragma unroll 1
      for (int bx = 0; bx < boxes && active; ++bx) {
        const uint32_t w_base = smem_addr(smem + s * kStage + bx * kBox), x_base = w_base + kWeightTileBytes;
        // ldmatrix addresses: A (weights) row warp * 32 + 16 mt + lane % 16, pieces 2 s + lane / 16; B (x) row
        // 8 j + lane % 8, pieces 4 h + lane / 8. Every row a lane names is congruent to lane % 8 mod 8: one swizzle.
        const int sw = lane & 7;
        const uint32_t a_off = (warp * kWarpFeatures + lane % 16) * 128, b_off = (lane % 8) * 128;
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // k 32 h .. 32 h + 31 of the chunk: two k16 steps
          uint32_t b[NT][4];
#pragma unroll
          for (int j = 0; j < NT; ++j)
            ldmatrix_x4(b[j], x_base + j * 8 * 128 + b_off + (((4 * h + lane / 8) ^ sw) << 4));
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
      }
      __syncwarp();  // every lane's fragments are in registers: the stage may be refilled
      if (lane == 0) mbarrier_arrive(&empty[s]);
#endif
    }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
      for (int q = 0; q < 4 * NT; ++q) asm volatile("" : "+f"(acc[m][q])::"memory");  // no read before the wait
    }
#endif
  }

  // ---- the partial tile [row][feature] in shared memory, then the cluster's sum in split order ----
  __syncthreads();  // every step arrived and was consumed: the stages are free
  float* part = reinterpret_cast<float*>(smem);  // [row][feature]
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if (warp < kConsumerWarps) {
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
  if (warp < kConsumerWarps && n0 + warp * kWarpFeatures < sh.n) {
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

// A tensor map of a row-major [rows, cols] 16-bit matrix (rows `row_stride` elements apart) whose boxes are
// [box_rows][64] with the 128-byte swizzle the kernel's tiles use.
CUtensorMap encode_tensor_map(const void* data, at::ScalarType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                              int box_rows) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    cudaDriverEntryPointQueryResult found{};
    void* fn = nullptr;
#if CUDART_VERSION >= 12050
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
#else
    C10_CUDA_CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found));
#endif
    TORCH_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr, "linear: the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_stride) * 2};
  const cuuint32_t box[2] = {kChunk, static_cast<cuuint32_t>(box_rows)}, unit[2] = {1, 1};
  const CUresult status = encode(
      &map, dtype == at::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
      const_cast<void*>(data), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(status == CUDA_SUCCESS, "linear: cuTensorMapEncodeTiled failed with error ", static_cast<int>(status));
  return map;
}

// The weight's tensor map for the kernel's [128 rows][64] tiles, encoded once per (address, shape, dtype): the
// weights of a model stay where they are, so a round finds them all here. (The x rows get theirs per call.)
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
  const Key key{weight.data_ptr(), weight.size(0), weight.size(1), static_cast<int>(weight.scalar_type())};
  const std::lock_guard<std::mutex> lock(mutex);
  if (auto it = maps.find(key); it != maps.end()) return it->second;
  const CUtensorMap map = encode_tensor_map(weight.data_ptr(), weight.scalar_type(), weight.size(0), weight.size(1),
                                            weight.size(1), kCtaFeatures);
  maps.emplace(key, map);
  return map;
}

// The pipeline: `boxes` chunks per stage (consecutive k: 128 bytes of a weight row per chunk) and `stages` stages,
// as many as fit beside the other CTAs an SM holds (projections with at most one CTA per SM get an SM's shared
// memory each). More chunks per stage keep more of each weight row in flight together, which the H200 streamed
// faster (boxes 4 at 3 stages beat 1 at 11 at one row: benchmarks/results/2026-12-01-h200-linear-kernel.md), as long
// as at least kMinStages stages fit. {0, 0} where not even two stages of one chunk fit (GPUs with less shared
// memory per SM: linear_cuda checks that at 9 column tiles, the most shared memory per stage, before any launch).
// `group` (a multiple of every boxes tried) divides the split's chunks.
struct Pipeline {
  int boxes, stages;
};
constexpr int kMinStages = 3;

Pipeline pipeline_for(int nt, int group, int64_t ctas, int chunks_per_split) {
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  const int64_t per_sm = std::clamp<int64_t>(cuda::ceil_div(ctas, prop->multiProcessorCount), 1, 2);
  const int64_t budget = std::min<int64_t>(static_cast<int64_t>(prop->sharedMemPerMultiprocessor) / per_sm -
                                               static_cast<int64_t>(prop->reservedSharedMemPerBlock),
                                           static_cast<int64_t>(cuda::max_dynamic_smem()));
  auto stages_for = [&](int boxes) {
    int stages = std::min(kMaxStages, std::max(2, chunks_per_split / boxes));
    while (stages >= 2 && linear_smem_bytes(nt, boxes, stages) > budget) --stages;
    return stages;
  };
  for (int boxes = group; boxes > 1; boxes /= 2) {
    const int stages = stages_for(boxes);
    if (stages >= std::max(2, std::min(kMinStages, chunks_per_split / boxes))) return {boxes, stages};
  }
  const int stages = stages_for(1);
  return stages >= 2 ? Pipeline{1, stages} : Pipeline{0, 0};
}

template <typename T, int NT>
void launch_linear_rows(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, int splits,
                        int chunks_per_split, int group, bool prefetch_weight) {
  const int n = static_cast<int>(weight.size(0));
  const int64_t tiles = cuda::ceil_div(n, kCtaFeatures);
  const auto [boxes, stages] = pipeline_for(NT, group, tiles * splits, chunks_per_split);
  TORCH_CHECK(stages >= 2 && group % boxes == 0, "linear: internal error: no pipeline for ", NT, " column tiles");
  const LinearShapes sh{static_cast<int>(x.size(0)), n, static_cast<int>(x.size(1)), out.stride(0), chunks_per_split,
                        boxes, stages, prefetch_weight};
  const CUtensorMap weight_map = weight_tensor_map(weight);
  const CUtensorMap x_map =
      encode_tensor_map(x.data_ptr(), x.scalar_type(), x.size(0), x.size(1), x.stride(0), NT * 8);
  auto kernel = linear_rows_kernel<T, NT>;
  const int smem = linear_smem_bytes(NT, boxes, stages);
  // The function's limit at the largest a CTA may ask for (a per-call size could lower it under another thread's
  // launch of the same kernel); each launch still asks for its own size.
  cuda::allow_dynamic_smem(kernel, cuda::max_dynamic_smem());
  cuda::prefer_max_shared_memory(kernel);  // two CTAs per SM
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(splits), 1);
  config.blockDim = dim3(kLinearThreads, 1, 1);
  config.dynamicSmemBytes = smem;
  config.stream = cuda::current_stream();
  cudaLaunchAttribute attributes[2]{};
  attributes[0].id = cudaLaunchAttributeClusterDimension;
  attributes[0].val.clusterDim.x = 1;
  attributes[0].val.clusterDim.y = static_cast<unsigned>(splits);
  attributes[0].val.clusterDim.z = 1;
  attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[1].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attributes;
  config.numAttrs = cuda::programmatic_launch_supported() ? 2 : 1;  // the cluster always, PDL where supported
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, weight_map, x_map, sh, out.data_ptr<T>()));
}

template <typename T>
void launch_linear_rows(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, int splits,
                        int chunks_per_split, int group, bool prefetch_weight) {
  switch (cuda::ceil_div(x.size(0), 8)) {
    case 1: launch_linear_rows<T, 1>(x, weight, out, splits, chunks_per_split, group, prefetch_weight); break;
    case 2: launch_linear_rows<T, 2>(x, weight, out, splits, chunks_per_split, group, prefetch_weight); break;
    case 3: launch_linear_rows<T, 3>(x, weight, out, splits, chunks_per_split, group, prefetch_weight); break;
    case 4: launch_linear_rows<T, 4>(x, weight, out, splits, chunks_per_split, group, prefetch_weight); break;
    case 5: launch_linear_rows<T, 5>(x, weight, out, splits, chunks_per_split, group, prefetch_weight); break;
    case 6: launch_linear_rows<T, 6>(x, weight, out, splits, chunks_per_split, group, prefetch_weight); break;
    case 7: launch_linear_rows<T, 7>(x, weight, out, splits, chunks_per_split, group, prefetch_weight); break;
    case 8: launch_linear_rows<T, 8>(x, weight, out, splits, chunks_per_split, group, prefetch_weight); break;
    default: launch_linear_rows<T, 9>(x, weight, out, splits, chunks_per_split, group, prefetch_weight); break;
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
// x rows 16-byte aligned and at least K apart (the copy engine reads them as a matrix), out rows 8-byte aligned, on
// GPUs (and builds) of compute capability >= 9.0 with the shared memory for its deepest stages; anything
// else runs at::mm (cuBLAS), as the CPU op does.
void linear_cuda(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, bool prefetch_weight) {
  check_linear("linear", x, weight, out);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), n = weight.size(0), k = x.size(1);
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  const bool kernel_applies =
      (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16) && rows <= kMaxLinearRows &&
      n % kWarpFeatures == 0 && k > 0 && k % kChunk == 0 && weight.is_contiguous() &&
      x.stride(0) % 8 == 0 && (x.stride(0) >= k || rows == 1) && cuda::is_aligned(x.data_ptr(), 16) && cuda::is_aligned(weight.data_ptr(), 16) &&
      out.stride(0) % 4 == 0 && cuda::is_aligned(out.data_ptr(), 8) && prop->major >= 9 &&
      cluster_kernels_built(x.scalar_type());
  if (!kernel_applies) {
    linear_mm(x, weight, out);
    return;
  }
  // Split K until the CTAs fill the SMs kSplitCtasPerSm times, each split whole groups of 4 chunks (of 2 or 1 where
  // K has no such groups): the split depends on (N, K) and the GPU alone, whatever M and the pipeline.
  const int64_t tiles = cuda::ceil_div(n, kCtaFeatures), total_chunks = k / kChunk;
  const int group = total_chunks % 4 == 0 ? 4 : total_chunks % 2 == 0 ? 2 : 1;
  const int64_t groups = total_chunks / group;
  const int64_t want = std::clamp<int64_t>(kSplitCtasPerSm * prop->multiProcessorCount / tiles, 1,
                                           std::min<int64_t>(kMaxSplits, groups));
  const int chunks_per_split = static_cast<int>(cuda::ceil_div(groups, want)) * group;
  const int splits = static_cast<int>(cuda::ceil_div(total_chunks, chunks_per_split));
  // Whether the kernel runs must not depend on M either: it runs only where the most rows (9 column tiles, the
  // most shared memory per stage) get a pipeline too (not so on GPUs with about 100 KB per SM: at::mm then).
  if (pipeline_for(kMaxLinearRows / 8, group, tiles * splits, chunks_per_split).stages == 0) {
    linear_mm(x, weight, out);
    return;
  }
  AT_DISPATCH_SWITCH(x.scalar_type(), "linear",
                     AT_DISPATCH_CASE(at::kHalf,
                                      [&] { launch_linear_rows<scalar_t>(x, weight, out, splits, chunks_per_split, group, prefetch_weight); })
                         AT_DISPATCH_CASE(at::kBFloat16, [&] {
                           launch_linear_rows<scalar_t>(x, weight, out, splits, chunks_per_split, group, prefetch_weight);
                         }));
}

}  // namespace ddtree
