// The projection of one row on CUDA cores: out[1, N] = x[1, K] weight[N, K]^T (an autoregressive decode step).
//
// At one row a projection is a stream of its weight: 2 FLOPs a weight element, far under what CUDA cores do, so no
// tensor cores, no shared memory and no pipeline: a warp takes a weight row (or a half or a quarter of one, where
// that spreads the rows more evenly over the resident warps), each lane reads 16-byte chunks of it with the matching
// chunks of x (which stay in L1: every warp reads the same x) and sums in float32; the lanes then sum by a fixed
// butterfly and a row's warps in warp order. The sums' order depends only on N, K, the GPU and the build (which sets
// the kernel's occupancy): the same bits every call.
//
// What it adds over cuBLAS is an early start: launched as a programmatic dependent, it issues the loads of each warp's
// first weight chunks into registers while the kernel ahead of it (the norm or SwiGLU that writes x) is still
// running (prefetch_weight: only for weights that nothing in flight writes), and lets the kernel after it launch at
// once. cuBLAS's GEMMs launch only once the kernel ahead is done and flushed, and start by filling their pipeline:
// at most 1.3-3.5 us a projection on the H200, by a probe that let them start early (unsafely:
// benchmarks/results/2026-12-03-h200-programmatic-gemm-edges.md).
#include <array>
#include <mutex>
#include <unordered_map>

#include "cuda_common.cuh"
#include "ops.h"

namespace ddtree {
namespace {

constexpr int kGemvThreads = 128;  // 4 warps a block
constexpr int kGemvWarps = kGemvThreads / cuda::kWarp;
constexpr int kChunkElems = 8;  // 16 bytes of a 16-bit dtype
constexpr int kGroup = 8;       // chunks a lane loads together (128 bytes a lane in flight, 4 KB a warp)

template <typename T>
struct GemvArgs {
  const T* x;
  const T* weight;
  T* out;
  int64_t n, weight_stride;
  int chunks;  // K / 8
  bool prefetch_weight;
};

__device__ __forceinline__ uint4 load_chunk(const void* p) { return *reinterpret_cast<const uint4*>(p); }

// A weight chunk is read once: streamed (evict first), so that it does not push x, which every warp reads, out of
// L1 (on the H200 this took the long-K down projections from 38.1 to 29.8 us, Qwen3-8B's, at one row).
__device__ __forceinline__ uint4 load_weight_chunk(const void* p) { return __ldcs(reinterpret_cast<const uint4*>(p)); }

// acc += the dot product of two 16-byte chunks of T, element by element in order.
template <typename T>
__device__ __forceinline__ float dot_chunk(const uint4& w, const uint4& x, float acc) {
  const T* wv = reinterpret_cast<const T*>(&w);
  const T* xv = reinterpret_cast<const T*>(&x);
#pragma unroll
  for (int e = 0; e < kChunkElems; ++e) acc = fmaf(cuda::to_float(wv[e]), cuda::to_float(xv[e]), acc);
  return acc;
}

// WARPS_PER_ROW warps share a weight row: warp part p of a row takes chunks (lane + 32 p) + 32 WARPS_PER_ROW i.
template <typename T, int WARPS_PER_ROW>
__global__ void __launch_bounds__(kGemvThreads) linear_gemv_kernel(const GemvArgs<T> p) {
  constexpr int kRowsPerBlock = kGemvWarps / WARPS_PER_ROW;
  constexpr int kStride = cuda::kWarp * WARPS_PER_ROW;  // chunks between a lane's consecutive chunks
  __shared__ float partial[kGemvWarps];
  const int warp = threadIdx.x / cuda::kWarp, lane = threadIdx.x % cuda::kWarp;
  const int slot = warp / WARPS_PER_ROW, part = warp % WARPS_PER_ROW;
  const int first = lane + cuda::kWarp * part;
  const int64_t row_step = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;

  uint4 w[kGroup];
  auto load_group = [&](int64_t row, int c0) {
    const T* base = p.weight + row * p.weight_stride;
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      const int c = c0 + g * kStride;
      w[g] = row < p.n && c < p.chunks ? load_weight_chunk(base + static_cast<int64_t>(c) * kChunkElems)
                                        : make_uint4(0, 0, 0, 0);
    }
  };

  // The block's rows advance together (the row's warps meet at a barrier per row).
  int64_t block_row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  cuda::allow_dependent_launch();
  bool loaded = false;
  if (p.prefetch_weight) {  // the weight is not written by any kernel in flight: its first chunks may come now
    load_group(block_row + slot, first);
    loaded = true;
  }
  cuda::wait_for_preceding_grid();  // x is written by the kernel ahead

  for (; block_row < p.n; block_row += row_step) {
    const int64_t row = block_row + slot;
    float acc = 0.f;
    for (int c0 = first; c0 < p.chunks; c0 += kGroup * kStride) {
      if (!loaded) load_group(row, c0);
      loaded = false;
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        const int c = c0 + g * kStride;
        if (c < p.chunks) acc = dot_chunk<T>(w[g], load_chunk(p.x + static_cast<int64_t>(c) * kChunkElems), acc);
      }
    }
    acc = cuda::warp_sum(acc);
    if constexpr (WARPS_PER_ROW > 1) {
      if (lane == 0) partial[warp] = acc;
      __syncthreads();
      if (part == 0 && lane == 0 && row < p.n) {
        float sum = 0.f;
#pragma unroll
        for (int q = 0; q < WARPS_PER_ROW; ++q) sum += partial[slot * WARPS_PER_ROW + q];
        p.out[row] = cuda::from_float<T>(sum);
      }
      __syncthreads();  // partial is rewritten for the next row
    } else {
      if (lane == 0 && row < p.n) p.out[row] = cuda::from_float<T>(acc);
    }
  }
}

// Resident blocks of the kernel on the whole GPU (blocks per SM from the occupancy calculator).
template <typename T, int WARPS_PER_ROW>
int64_t resident_blocks() {
  int per_sm = 0;
  C10_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, linear_gemv_kernel<T, WARPS_PER_ROW>, kGemvThreads, 0));
  return static_cast<int64_t>(std::max(per_sm, 1)) * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

// The grid fits the resident blocks (all resident at once when nothing else runs) and each block takes `passes` row
// passes (the trailing blocks one fewer), so no pass of a few warps trails the rest: N = 6144 rows over the H200's
// 4224 resident warps would otherwise leave 1920 warps on a second pass alone.
template <typename T, int WARPS_PER_ROW>
void launch_linear_gemv(const GemvArgs<T>& args, int64_t passes) {
  constexpr int kRowsPerBlock = kGemvWarps / WARPS_PER_ROW;
  const int64_t blocks = cuda::ceil_div(args.n, kRowsPerBlock * passes);
  cuda::launch_programmatic(linear_gemv_kernel<T, WARPS_PER_ROW>, dim3(static_cast<unsigned>(blocks)),
                            dim3(kGemvThreads), 0, args);
}

// Resident warps of the 1-, 2- and 4-warps-a-row kernels on the current device, asked once per device.
template <typename T>
const std::array<int64_t, 3>& resident_warps() {
  static std::mutex mutex;
  static std::unordered_map<int, std::array<int64_t, 3>> known;
  const std::lock_guard<std::mutex> lock(mutex);
  const int device = c10::cuda::current_device();
  auto it = known.find(device);
  if (it == known.end()) {
    it = known.emplace(device, std::array<int64_t, 3>{resident_blocks<T, 1>() * kGemvWarps,
                                                      resident_blocks<T, 2>() * kGemvWarps,
                                                      resident_blocks<T, 4>() * kGemvWarps}).first;
  }
  return it->second;
}

// One, two or four warps a weight row: whichever fills the passes of the resident warps best (one with fewer warps a
// row wins unless another fills them 2 % better). The choice depends on N, the GPU and the build alone, so a
// problem's bits do not change from call to call.
template <typename T>
void run_linear_gemv(const GemvArgs<T>& args) {
  const std::array<int64_t, 3>& resident = resident_warps<T>();
  int best = 0;
  int64_t best_passes = 0;
  double best_fill = -1.0;
  for (int v = 0; v < 3; ++v) {
    const int64_t tasks = args.n << v;  // (row, part) pairs
    const int64_t passes = cuda::ceil_div(tasks, resident[v]);
    const double fill = static_cast<double>(tasks) / static_cast<double>(passes * resident[v]);
    if (fill > best_fill + 0.02) {
      best = v;
      best_passes = passes;
      best_fill = fill;
    }
  }
  switch (best) {
    case 0: launch_linear_gemv<T, 1>(args, best_passes); break;
    case 1: launch_linear_gemv<T, 2>(args, best_passes); break;
    default: launch_linear_gemv<T, 4>(args, best_passes); break;
  }
}

}  // namespace

// The kernel takes 16-bit x and weight with K a multiple of 8, 16-byte aligned x and weight rows; anything else runs
// at::mm, as the CPU op does.
void linear_gemv_cuda(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, bool prefetch_weight) {
  check_linear_gemv(x, weight, out);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = weight.size(0), k = x.size(1);
  const bool kernel_applies = (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16) &&
                              k % kChunkElems == 0 && (n == 1 || weight.stride(0) % kChunkElems == 0) &&
                              cuda::is_aligned(x.data_ptr(), 16) && cuda::is_aligned(weight.data_ptr(), 16) &&
                              // chunk indices (int) run up to a lane group's stride past the last chunk
                              k / kChunkElems <= std::numeric_limits<int>::max() - kGroup * cuda::kWarp * 4;
  if (!kernel_applies) {
    linear_mm(x, weight, out);
    return;
  }
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "linear_gemv", [&] {
    run_linear_gemv<scalar_t>(GemvArgs<scalar_t>{x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                                                 out.data_ptr<scalar_t>(), n, n == 1 ? k : weight.stride(0),
                                                 static_cast<int>(k / kChunkElems), prefetch_weight});
  });
}

}  // namespace ddtree
