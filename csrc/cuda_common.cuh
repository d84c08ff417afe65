// Helpers shared by the CUDA implementations of the ddtree ops: launch plumbing, dtype conversion,
// vectorised access and warp reductions. Included by csrc/*_cuda.cu only.
//
// Argument checks are the device-agnostic check_* functions of the CPU ops (csrc/ops.h): they check
// dtypes, shapes, layouts, and that every tensor is on the device of the first, so a call that reaches
// a CUDA implementation (some argument is a CUDA tensor) and passes them has every tensor on one GPU.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "checks.h"

// Kernels are instantiated for the three activation dtypes only (the check_* functions reject the rest;
// DDTREE_DISPATCH_FLOAT would also instantiate double).
#define DDTREE_CUDA_DISPATCH_FLOAT(dtype, name, ...)                                                    \
  AT_DISPATCH_SWITCH(dtype, name, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                              \
                         AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace ddtree {
namespace cuda {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarp = 32;
constexpr int kMaxGridY = 65535;  // the largest gridDim.y (and gridDim.z) a launch may have

// ---- host side -------------------------------------------------------------------------------

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline cudaStream_t current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

// Largest dynamic shared memory a block may opt into on the current device.
inline size_t max_dynamic_smem() { return at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin; }

// The PTX version a kernel's code for the current GPU was compiled from (e.g. 90): code for compute capability < 8.0
// has traps in place of the tensor-core instructions (mma_16x8x16), so callers check this before launching.
template <typename Kernel>
int ptx_version(Kernel kernel) {
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  return attr.ptxVersion;
}

// Raises a kernel's dynamic shared-memory limit when a launch needs more than the default 48 KB.
template <typename Kernel>
inline void allow_dynamic_smem(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  }
}

// Asks for the largest shared-memory carveout, so that two CTAs of a kernel with large shared memory fit on an SM
// (without a preference the driver picks the carveout itself).
template <typename Kernel>
inline void prefer_max_shared_memory(Kernel kernel) {
  C10_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
}

inline bool is_aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Programmatic dependent launch (Hopper and newer, and CUDA >= 12.3, where stream capture takes it): a kernel so
// launched may start before the one ahead of it on the stream has finished, and orders itself with
// wait_for_preceding_grid(). Off below compute capability 9.0, and with DDTREE_NO_PDL=1 in the environment (read
// once; for A/B runs).
inline bool programmatic_launch_supported() {
#if CUDART_VERSION >= 12030
  static const bool disabled = [] {
    const char* flag = std::getenv("DDTREE_NO_PDL");
    return flag != nullptr && flag[0] == '1';
  }();
  return !disabled && at::cuda::getCurrentDeviceProperties()->major >= 9;
#else
  return false;
#endif
}

// Whether a kernel's code for this GPU was compiled from PTX for 9.0 or newer, so that its griddepcontrol
// instructions are there (a `8.0+PTX` build JIT-compiles compute_80 code on a Hopper GPU: without its waits, a
// programmatic launch would race the kernel ahead). Asked once per kernel.
inline bool has_grid_dependency_control(const void* kernel) {
  static std::mutex mutex;
  static std::unordered_map<const void*, bool> known;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = known.find(kernel);
  if (it == known.end()) {
    cudaFuncAttributes attr{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    it = known.emplace(kernel, attr.ptxVersion >= 90).first;
  }
  return it->second;
}

// kernel<<<grid, block, smem, current stream>>>(args...), as a programmatic dependent launch where supported.
template <typename... Params, typename... Args>
void launch_programmatic(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = current_stream();
  cudaLaunchAttribute attribute[1]{};
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs =
      programmatic_launch_supported() && has_grid_dependency_control(reinterpret_cast<const void*>(kernel)) ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// ---- device side -----------------------------------------------------------------------------

// Lets the next kernel on the stream start, when it was launched as a programmatic dependent / waits until the
// kernel this one was launched behind has completed and its writes are visible. Both are no-ops otherwise. Before
// the wait a kernel may read only what no kernel still running can write (e.g. with prefetch_l2, which moves no
// data into registers and so can never see a stale value).
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_preceding_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Starts fetching the 128-byte line holding p from memory into L2 (no register is written).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// parent[i] when it is a valid topological parent (in [0, i)), else -1. The CPU ops reject other values;
// the CUDA ops cannot read them back without a sync, so they treat them as roots: wrong outputs for
// invalid input, but no out-of-bounds access and no endless walk up a cycle.
__device__ __forceinline__ int checked_parent(int parent, int i) { return parent >= 0 && parent < i ? parent : -1; }

// Elements before the first 16-byte boundary of a row starting at p, capped at n (the scalar head
// before 16-byte packs).
template <typename T>
__device__ __forceinline__ int64_t elements_to_16b_boundary(const T* p, int64_t n) {
  const int64_t head = static_cast<int64_t>((16 - reinterpret_cast<uintptr_t>(p) % 16) % 16 / sizeof(T));
  return head < n ? head : n;
}

// The most negative finite value of T (torch.finfo(T).min), usable in device code.
template <typename T>
__device__ __forceinline__ T lowest();
template <>
__device__ __forceinline__ float lowest<float>() {
  return -3.40282347e+38f;
}
template <>
__device__ __forceinline__ at::Half lowest<at::Half>() {
  return at::Half(0xfbff, at::Half::from_bits());  // -65504
}
template <>
__device__ __forceinline__ at::BFloat16 lowest<at::BFloat16>() {
  return at::BFloat16(0xff7f, at::BFloat16::from_bits());  // -3.3895e38
}

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return static_cast<float>(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x) {
  return static_cast<T>(x);
}

// N elements of T moved as one aligned access (16 bytes when sizeof(T) * N == 16).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void load_pack_float(const T* p, float (&out)[N]) {
  const Pack<T, N> pk = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
  for (int e = 0; e < N; ++e) out[e] = to_float(pk.v[e]);
}

template <typename T, int N>
__device__ __forceinline__ void store_pack_float(T* p, const float (&in)[N]) {
  Pack<T, N> pk;
#pragma unroll
  for (int e = 0; e < N; ++e) pk.v[e] = from_float<T>(in[e]);
  *reinterpret_cast<Pack<T, N>*>(p) = pk;
}

// The sum of x over each group of LANES consecutive lanes (a power of two <= 32; the whole warp by default),
// butterflies from LANES / 2 down; every lane of the warp must call it.
template <int LANES = kWarp>
__device__ __forceinline__ float warp_sum(float x) {
  static_assert(LANES >= 1 && LANES <= kWarp && (LANES & (LANES - 1)) == 0, "LANES: a power of two <= 32");
#pragma unroll
  for (int off = LANES / 2; off > 0; off >>= 1) x += __shfl_xor_sync(kFullMask, x, off);
  return x;
}

__device__ __forceinline__ uint64_t warp_max_u64(uint64_t x) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    const uint64_t y = __shfl_xor_sync(kFullMask, x, off);
    x = y > x ? y : x;
  }
  return x;
}

// Sum of squares of a row of `n` elements, split over the lanes of a warp (lane, lane + 32, ...) and
// reduced by a fixed butterfly, so every kernel that normalises the same row gets the same bits.
template <typename T>
__device__ __forceinline__ float warp_sum_squares(const T* row, int n, int lane) {
  float acc = 0.f;
  for (int k = lane; k < n; k += kWarp) {
    const float x = to_float(row[k]);
    acc = fmaf(x, x, acc);
  }
  return warp_sum(acc);
}

// d += a b for a 16x16 tile a (row-major) and a 16x8 tile b (column-major) of 16-bit values, float32 sums
// (mma.sync m16n8k16; fragments in the PTX ISA's layouts: lane = 4 gid + tig).
template <typename T>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    static_assert(std::is_same_v<T, at::Half>, "tensor-core products take Half or BFloat16");
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#else
  __trap();  // the launchers check ptx_version() and never get here
#endif
}

// Four 8x8 tiles of 16-bit values from shared memory (ldmatrix, compute capability >= 7.5): lanes 8 i .. 8 i + 7
// give the 16-byte row addresses of tile i, and lane 4 gid + tig receives row gid, columns 2 tig and 2 tig + 1 of
// each tile (r[i] from tile i): the mma.sync fragment layouts. TRANS transposes each tile on the way.
template <bool TRANS = false>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_address) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  if constexpr (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_address));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_address));
  }
#else
  r[0] = r[1] = r[2] = r[3] = 0;
  __trap();
#endif
}

// The shared-memory address of a generic pointer into shared memory (what ldmatrix, cp.async and mbarrier take).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Asynchronous global -> shared copies of 4, 8 or 16 bytes (cp.async, compute capability >= 8): a thread issues
// all of its copies without waiting for any, so one round trip to memory serves a kernel's whole prologue;
// wait_async_copies() then waits for the calling thread's copies (a barrier makes them visible to the block).
// Both addresses must be aligned to the copy's size.
template <int BYTES>
__device__ __forceinline__ void copy_async(void* smem_dst, const void* gmem_src) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = smem_addr(smem_dst);
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem_src) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst), "l"(gmem_src), "n"(BYTES) : "memory");
  }
#else
  if constexpr (BYTES == 16) {
    *static_cast<uint4*>(smem_dst) = *static_cast<const uint4*>(gmem_src);
  } else if constexpr (BYTES == 8) {
    *static_cast<uint2*>(smem_dst) = *static_cast<const uint2*>(gmem_src);
  } else {
    *static_cast<uint32_t*>(smem_dst) = *static_cast<const uint32_t*>(gmem_src);
  }
#endif
}

__device__ __forceinline__ void wait_async_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// For pipelines: commit_async_copies() closes the group of the calling thread's copies issued since the last
// commit; wait_async_copies_but<PENDING>() waits until at most PENDING of its committed groups are in flight.
__device__ __forceinline__ void commit_async_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int PENDING>
__device__ __forceinline__ void wait_async_copies_but() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
#endif
}

// 1 / sqrt(sum + eps) with correctly rounded sqrt and division (no rsqrt approximation), as on the CPU.
__device__ __forceinline__ float inv_l2_norm(float sum_squares, float eps) { return 1.0f / sqrtf(sum_squares + eps); }

}  // namespace cuda
}  // namespace ddtree
