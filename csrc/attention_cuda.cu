// Split-KV masked GQA attention for verify and decode steps, in place of cuDNN's SDPA kernel under
// fused.gqa_attention: that kernel tiles only over query rows, so a decode step (G folded rows per KV head) runs
// one CTA per KV head (4 on the 27B shape) and a budget-64 verify about 28, each streaming the whole K/V.
//
// out[b, h, n] = softmax(scale q[b, h, n] . k[b, h / G, s] over s with mask[b, 0, n, s]) . v[b, h / G, s].
// Rows are folded per KV head: row r = g N + n is query head h = kvh G + g at node n. A CTA takes 64 folded rows
// (4 warps x 16; warps past the last row only help load), or 128 (8 warps) where a KV head has 65-128 and the
// head dim is 128, and one split of the keys, in chunks of 64 whose K, V and mask bytes stream through two
// shared-memory stages (cp.async). Where two stages do not fit (D = 256 on the
// H200), one stage whose K and V load as separate groups: the next chunk's K during this chunk's P V, its V during
// the next Q K^T. Q K^T and P V on tensor cores (mma m16n8k16 from ldmatrix fragments, f32 sums), the softmax online
// per row in base 2. With one split the CTA writes the normalised output; with several, unnormalised partial
// outputs and (max, sum) per row go to a workspace that a second kernel merges in a fixed order (deterministic).
#include <algorithm>
#include <type_traits>

#include "cuda_common.cuh"
#include "ops.h"

namespace ddtree {
namespace {

using cuda::kWarp;

constexpr int kAttnKeys = 64;  // keys per chunk
constexpr float kLog2e = 1.4426950408889634f;

// A CTA of WARPS warps takes 16 WARPS folded query rows (16 a warp).
template <int D, int STAGES, int WARPS>
struct AttnLayout {
  static constexpr int kRows = 16 * WARPS;
  static constexpr int kThreads = WARPS * kWarp;
  static constexpr int kStride = D + 8;  // elements per staged row: 16 bytes of padding, conflict-free fragments
  static constexpr size_t kQ = 0;
  static constexpr size_t kKV = kQ + sizeof(uint16_t) * kRows * kStride;  // then per stage: K, V, mask rows
  static constexpr size_t kK = 0, kV = kK + sizeof(uint16_t) * kAttnKeys * kStride;
  static constexpr size_t kMask = kV + sizeof(uint16_t) * kAttnKeys * kStride;  // [row][key] bool bytes
  static constexpr size_t kStage = kMask + kRows * kAttnKeys;
  static constexpr size_t kTotal = kKV + STAGES * kStage;
};

// The launcher runs these kernels only on builds whose code for the GPU targets compute capability >= 8.0
// (tensor_cores_built); older targets get traps in place of the instructions they lack.
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  uint32_t r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
#else
  __trap();
#endif
  return r;
}

struct AttnShapes {
  int batch, heads, kv_heads, group, n, s, splits, keys_per_split;
  float scale_log2;  // scale * log2(e)
  bool mask_vec;     // mask rows 16-byte aligned with unit key stride: staged with 16-byte copies
};

template <typename T, int D, int STAGES, int WARPS>
__global__ void __launch_bounds__(WARPS * kWarp, 1) gqa_attention_kernel(
    AttnShapes sh, const T* __restrict__ q, int64_t q_sb, int64_t q_sh, int64_t q_sn, const T* __restrict__ k,
    int64_t k_sb, int64_t k_sh, int64_t k_ss, const T* __restrict__ v, int64_t v_sb, int64_t v_sh, int64_t v_ss,
    const bool* __restrict__ mask, int64_t m_sb, int64_t m_sn, int64_t m_ss, T* __restrict__ out, int64_t o_sb,
    int64_t o_sh, int64_t o_sn, float* __restrict__ part_o, float2* __restrict__ part_ml) {
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();  // launched as a programmatic dependent: nothing read or written before
  using L = AttnLayout<D, STAGES, WARPS>;
  constexpr int kAttnRows = L::kRows, kAttnThreads = L::kThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* qs = reinterpret_cast<T*>(smem_raw + L::kQ);
  const int bk = blockIdx.x, b = bk / sh.kv_heads, kvh = bk % sh.kv_heads;
  const int r0 = blockIdx.y * kAttnRows, split = blockIdx.z;
  const int rows = sh.group * sh.n;
  const int s_begin = split * sh.keys_per_split, s_end = min(sh.s, s_begin + sh.keys_per_split);
  const int chunks = (s_end - s_begin + kAttnKeys - 1) / kAttnKeys;
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp, gid = lane / 4, tig = lane % 4;
  constexpr int kPacks = D / 8;  // 16-byte packs per row

  // ---- the CTA's query rows (rows past the end: zeros), in the first chunk's copy group ----
  for (int e = tid; e < kAttnRows * kPacks; e += kAttnThreads) {
    const int r = e / kPacks, c = 8 * (e % kPacks), fr = r0 + r;
    T* dst = qs + r * L::kStride + c;
    if (fr < rows) {
      const int g = fr / sh.n, n = fr % sh.n;
      cuda::copy_async<16>(dst, q + b * q_sb + (kvh * sh.group + g) * q_sh + n * q_sn + c);
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
  }
  auto stage = [&](int chunk) { return smem_raw + L::kKV + (chunk % STAGES) * L::kStage; };
  // The K rows (or the V rows) of a chunk into its stage (keys past the end: clamped, and masked when used).
  auto issue_rows = [&](int chunk, const T* src, int64_t s_sb, int64_t s_sh, int64_t s_ss, size_t offset) {
    T* dst = reinterpret_cast<T*>(stage(chunk) + offset);
    const int c0 = s_begin + chunk * kAttnKeys;
    for (int e = tid; e < kAttnKeys * kPacks; e += kAttnThreads) {
      const int key = e / kPacks, c = 8 * (e % kPacks), s = min(c0 + key, sh.s - 1);
      cuda::copy_async<16>(dst + key * L::kStride + c, src + b * s_sb + kvh * s_sh + s * s_ss + c);
    }
  };
  // K and the mask bytes of a chunk: what S = Q K^T and the softmax read.
  auto issue_keys = [&](int chunk) {
    issue_rows(chunk, k, k_sb, k_sh, k_ss, L::kK);
    unsigned char* st = stage(chunk);
    const int c0 = s_begin + chunk * kAttnKeys;
    // Row r of the tile is node (r0 + r) % N (rows past the end: any node).
    for (int e = tid; e < kAttnRows * (kAttnKeys / 16); e += kAttnThreads) {
      const int r = e / (kAttnKeys / 16), s0 = c0 + 16 * (e % (kAttnKeys / 16));
      unsigned char* dst = st + L::kMask + r * kAttnKeys + (s0 - c0);
      const bool* src = mask + b * m_sb + static_cast<int64_t>((r0 + r) % sh.n) * m_sn;
      if (sh.mask_vec && s0 + 16 <= sh.s) {
        cuda::copy_async<16>(dst, src + s0);
      } else {
#pragma unroll
        for (int t = 0; t < 16; ++t) dst[t] = s0 + t < sh.s ? src[(s0 + t) * m_ss] : 0;
      }
    }
  };
  auto issue_values = [&](int chunk) { issue_rows(chunk, v, v_sb, v_sh, v_ss, L::kV); };

  const int wr = r0 + 16 * warp;  // the warp's first folded row
  const bool active = wr < rows;  // a warp with no rows of its own only loads

  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // rows gid and gid + 8 of the warp's tile

  // ldmatrix row addresses (bytes; each lane gives one 16-byte row of one 8x8 tile, see cuda::ldmatrix_x4), tiles
  // in register order:
  // Q's A fragment: (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15) of the warp;
  // K's B fragments of key tiles j, j + 1: (keys 8 j.., k 0-7), (keys 8 j.., k 8-15), then the same for 8 j + 8;
  // V's B fragments of d tiles j, j + 1 (transposed): (keys 0-7 of the k step, d 8 j..), (keys 8-15, d 8 j..), then
  // the same for d 8 j + 8.
  constexpr uint32_t kRowBytes = sizeof(T) * L::kStride;
  const uint32_t q_lane = cuda::smem_addr(qs) + (16 * warp + lane % 16) * kRowBytes + sizeof(T) * 8 * (lane / 16);
  const uint32_t k_lane = (8 * (lane / 16) + lane % 8) * kRowBytes + sizeof(T) * 8 * (lane / 8 % 2);
  const uint32_t v_lane = (lane % 16) * kRowBytes + sizeof(T) * 8 * (lane / 16);

  // Two stages: chunk i + 1's K, V and mask bytes load (one copy group) while chunk i computes. One stage (where two
  // do not fit): K (with the mask) and V are separate groups, so that chunk i + 1's K loads during chunk i's P V and
  // its V during chunk i + 1's Q K^T; two more barriers a chunk.
  issue_keys(0);  // with the query rows above, in the first group
  if (STAGES == 1) cuda::commit_async_copies();
  issue_values(0);
  cuda::commit_async_copies();
  float sc[kAttnKeys / 8][4];  // S, then P, of the warp's 16 rows and the chunk's 64 keys: 8 tiles of 16 x 8
  for (int i = 0; i < chunks; ++i) {
    const int c0 = s_begin + i * kAttnKeys;
    const bool more = i + 1 < chunks;
    if (STAGES == 2 && more) {
      issue_keys(i + 1);
      issue_values(i + 1);
      cuda::commit_async_copies();
      cuda::wait_async_copies_but<1>();
    } else {
      cuda::wait_async_copies_but<STAGES == 1 ? 1 : 0>();  // one stage: this chunk's K and mask; V may still fly
    }
    __syncthreads();
    const unsigned char* st = stage(i);
    const uint32_t ks = cuda::smem_addr(st + L::kK), vs = cuda::smem_addr(st + L::kV);
    const unsigned char* ms = st + L::kMask + (16 * warp + gid) * kAttnKeys + 2 * tig;

    if (active) {
      // S = Q K^T.
#pragma unroll
      for (int j = 0; j < kAttnKeys / 8; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t af[4];
        cuda::ldmatrix_x4(af, q_lane + sizeof(T) * 16 * kk);
#pragma unroll
        for (int j = 0; j < kAttnKeys / 8; j += 2) {
          uint32_t kf[4];
          cuda::ldmatrix_x4(kf, ks + k_lane + 8 * j * kRowBytes + sizeof(T) * 16 * kk);
          cuda::mma_16x8x16<T>(sc[j], af, {kf[0], kf[1]});
          cuda::mma_16x8x16<T>(sc[j + 1], af, {kf[2], kf[3]});
        }
      }
      // Mask (and keys past the split), scale to base 2, online softmax per row.
      float rmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < kAttnKeys / 8; ++j) {
        // The mask bytes of the lane's two keys, in rows gid and gid + 8 (bools are 0 or 1).
        const uint16_t mpair[2] = {*reinterpret_cast<const uint16_t*>(ms + 8 * j),
                                   *reinterpret_cast<const uint16_t*>(ms + 8 * kAttnKeys + 8 * j)};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool keep = c0 + 8 * j + 2 * tig + e % 2 < s_end && ((mpair[e / 2] >> (8 * (e % 2))) & 0xFF) != 0;
          sc[j][e] = keep ? sc[j][e] * sh.scale_log2 : -INFINITY;
          rmax[e / 2] = fmaxf(rmax[e / 2], sc[j][e]);
        }
      }
      float alpha[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        rmax[h] = fmaxf(rmax[h], __shfl_xor_sync(cuda::kFullMask, rmax[h], 1));
        rmax[h] = fmaxf(rmax[h], __shfl_xor_sync(cuda::kFullMask, rmax[h], 2));
        const float m_new = fmaxf(m_run[h], rmax[h]);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing unmasked yet
        alpha[h] = exp2f(m_run[h] - m_use);
        m_run[h] = m_new;
        rmax[h] = m_use;
      }
      float rsum[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < kAttnKeys / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          sc[j][e] = exp2f(sc[j][e] - rmax[e / 2]);
          rsum[e / 2] += sc[j][e];
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * alpha[h] + rsum[h];  // quad-partial sums; reduced at the end
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[j][0] *= alpha[0];
        o[j][1] *= alpha[0];
        o[j][2] *= alpha[1];
        o[j][3] *= alpha[1];
      }
    }
    if (STAGES == 1) {  // every warp is done with K and the mask: chunk i + 1's load into them overlaps P V
      __syncthreads();
      if (more) {
        issue_keys(i + 1);
        cuda::commit_async_copies();
        cuda::wait_async_copies_but<1>();  // this chunk's V
      } else {
        cuda::wait_async_copies_but<0>();
      }
      __syncthreads();
    }
    if (active) {
      // O += P V: P from the S accumulators (the m16n8 C layout of two key tiles is the m16n8k16 A layout), V
      // fragments transposed from its [key][d] rows.
#pragma unroll
      for (int kk = 0; kk < kAttnKeys / 16; ++kk) {
        const uint32_t pf[4] = {pack_pair<T>(sc[2 * kk][0], sc[2 * kk][1]), pack_pair<T>(sc[2 * kk][2], sc[2 * kk][3]),
                                pack_pair<T>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                                pack_pair<T>(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
        for (int j = 0; j < D / 8; j += 2) {
          uint32_t vf[4];
          cuda::ldmatrix_x4<true>(vf, vs + v_lane + 16 * kk * kRowBytes + sizeof(T) * 8 * j);
          cuda::mma_16x8x16<T>(o[j], pf, {vf[0], vf[1]});
          cuda::mma_16x8x16<T>(o[j + 1], pf, {vf[2], vf[3]});
        }
      }
    }
    __syncthreads();  // every warp is done with this stage's V (two stages: with all of it) before it is refilled
    if (STAGES == 1 && more) {
      issue_values(i + 1);
      cuda::commit_async_copies();
    }
  }
  if (!active) return;

  // The row sums: each lane of a quad holds a quarter.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(cuda::kFullMask, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(cuda::kFullMask, l_run[h], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int fr = wr + gid + 8 * h;
    if (fr >= rows) continue;
    const int g = fr / sh.n, n = fr % sh.n;
    if (sh.splits == 1) {
      const float inv = l_run[h] > 0.f ? 1.f / l_run[h] : 0.f;  // a row with no key to attend: zeros
      T* dst = out + b * o_sb + (kvh * sh.group + g) * o_sh + n * o_sn + 2 * tig;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        *reinterpret_cast<uint32_t*>(dst + 8 * j) = pack_pair<T>(o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
      }
    } else {
      const int64_t prow = (static_cast<int64_t>(split) * sh.batch * sh.kv_heads + bk) * rows + fr;
      float* dst = part_o + prow * D + 2 * tig;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[j][2 * h], o[j][2 * h + 1]);
      if (tig == 0) part_ml[prow] = make_float2(m_run[h], l_run[h]);
    }
  }
}

constexpr int kCombineWarps = 4;  // warps per folded row: each sums every fourth split

// Merges the splits of each folded row: out = sum_s O_s 2^(m_s - M) / sum_s l_s 2^(m_s - M). A block per row, D / 32
// consecutive elements per lane; warp w sums splits w, w + 4, ... in order, then warp 0 adds the warps' sums in warp
// order (a fixed order: deterministic), so that a row's splits are read by four warps at once.
template <typename T, int D>
__global__ void __launch_bounds__(kCombineWarps * kWarp) gqa_attention_combine_kernel(
    AttnShapes sh, const float* __restrict__ part_o, const float2* __restrict__ part_ml, T* __restrict__ out,
    int64_t o_sb, int64_t o_sh, int64_t o_sn) {
  cuda::allow_dependent_launch();
  cuda::wait_for_preceding_grid();  // launched as a programmatic dependent: nothing read or written before
  constexpr int kPerLane = D / kWarp;
  static_assert(kPerLane == 2 || kPerLane % 4 == 0, "head dims 64, 128 or 256");
  __shared__ float warp_sums[kCombineWarps - 1][D];
  const int rows = sh.group * sh.n;
  const int64_t all_rows = static_cast<int64_t>(sh.batch) * sh.kv_heads * rows;  // also the stride between splits
  const int64_t row = blockIdx.x;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  // The max over the splits, split over the lanes (fixed butterflies); every warp forms it.
  float m_all = -INFINITY;
  for (int s = lane; s < sh.splits; s += kWarp) m_all = fmaxf(m_all, part_ml[s * all_rows + row].x);
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) m_all = fmaxf(m_all, __shfl_xor_sync(cuda::kFullMask, m_all, off));
  const float m_use = m_all == -INFINITY ? 0.f : m_all;
  float acc[kPerLane] = {};
#pragma unroll 4
  for (int s = warp; s < sh.splits; s += kCombineWarps) {  // unrolled: several splits' loads in flight
    const float w = exp2f(part_ml[s * all_rows + row].x - m_use);
    const float* src = part_o + (s * all_rows + row) * D + lane * kPerLane;
    if constexpr (kPerLane % 4 == 0) {
#pragma unroll
      for (int e = 0; e < kPerLane; e += 4) {
        const float4 x = *reinterpret_cast<const float4*>(src + e);
        acc[e] += x.x * w;
        acc[e + 1] += x.y * w;
        acc[e + 2] += x.z * w;
        acc[e + 3] += x.w * w;
      }
    } else {
      const float2 x = *reinterpret_cast<const float2*>(src);
      acc[0] += x.x * w;
      acc[1] += x.y * w;
    }
  }
  if (warp > 0) {
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) warp_sums[warp - 1][lane * kPerLane + e] = acc[e];
  }
  __syncthreads();
  if (warp > 0) return;
  float l = 0.f;
  for (int s = lane; s < sh.splits; s += kWarp) {
    const float2 ml = part_ml[s * all_rows + row];
    l += ml.y * exp2f(ml.x - m_use);
  }
  l = cuda::warp_sum(l);
#pragma unroll
  for (int w = 0; w < kCombineWarps - 1; ++w) {
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) acc[e] += warp_sums[w][lane * kPerLane + e];
  }
  const int bk = static_cast<int>(row / rows), fr = static_cast<int>(row % rows);
  const int b = bk / sh.kv_heads, kvh = bk % sh.kv_heads;
  const int g = fr / sh.n, n = fr % sh.n;
  T* dst = out + b * o_sb + (kvh * sh.group + g) * o_sh + n * o_sn + lane * kPerLane;
#pragma unroll
  for (int e = 0; e < kPerLane; e += 2) {  // a row with no key to attend (l = 0): zeros
    *reinterpret_cast<uint32_t*>(dst + e) = pack_pair<T>(l > 0.f ? acc[e] / l : 0.f, l > 0.f ? acc[e + 1] / l : 0.f);
  }
}

// Whether this build's code for the current GPU has the tensor-core instructions (compute capability >= 8.0).
bool tensor_cores_built(at::ScalarType dtype) {
  static const int bf16 = cuda::ptx_version(gqa_attention_kernel<at::BFloat16, 128, 1, 4>);
  static const int f16 = cuda::ptx_version(gqa_attention_kernel<at::Half, 128, 1, 4>);
  return (dtype == at::kBFloat16 ? bf16 : f16) >= 80;
}

// Four-warp CTAs: two shared-memory stages where two CTAs of them fit an SM, else one stage (two CTAs overlap each
// other's loads instead, e.g. D = 256 on the H200), else 0: the CTA does not fit at all.
template <int D>
int attention_stages(const cudaDeviceProp& prop) {
  if (2 * (AttnLayout<D, 2, 4>::kTotal + prop.reservedSharedMemPerBlock) <= prop.sharedMemPerMultiprocessor) return 2;
  return AttnLayout<D, 1, 4>::kTotal <= prop.sharedMemPerBlockOptin ? 1 : 0;
}

// Eight-warp CTAs (128 folded rows, two stages, one an SM by shared memory and registers) for D = 128 where a KV head
// has 65-128 folded rows (a 17-node verify at 4 query heads a KV head: DDTree at budget 16): one CTA streams the keys
// where two did, the second for a few rows (Qwen3-8B: 6-12 % faster on the H200 at 576-16384 keys). Not past 128
// rows: at 260 (65 nodes) one eight-warp CTA an SM ran 3-54 % slower than two four-warp ones, whose loads and products
// interleave. Other head dims were not measured (at D = 64 two such CTAs would fit an SM's shared memory but not its
// registers, which the split rule below does not count). benchmarks/results/2026-12-03-h200-attention-splits.md.
// (The caller instantiates it for D = 128 only.)
template <int D>
bool wide_tiles_fit(const cudaDeviceProp& prop, int rows) {
  return rows > 16 * 4 && rows <= 16 * 8 && AttnLayout<D, 2, 8>::kTotal <= prop.sharedMemPerBlockOptin;
}

template <typename T, int D, int STAGES, int WARPS>
void launch_gqa_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                          double scale, at::Tensor& out, int64_t num_splits) {
  using L = AttnLayout<D, STAGES, WARPS>;
  constexpr int kAttnRows = L::kRows, kAttnThreads = L::kThreads;
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  const int batch = static_cast<int>(q.size(0)), heads = static_cast<int>(q.size(1)), n = static_cast<int>(q.size(2));
  const int kv_heads = static_cast<int>(k.size(1)), s = static_cast<int>(k.size(2));
  const int group = heads / kv_heads, rows = group * n;
  const int row_tiles = static_cast<int>(cuda::ceil_div(rows, kAttnRows));
  const int base_ctas = batch * kv_heads * row_tiles;
  // How many splits of the keys, unless the caller asked for a number: enough that the CTAs fill the GPU once (as
  // many an SM as shared memory allows, up to 2), with two corrections measured over 576-16384 keys on the H200
  // (benchmarks/results/2026-12-03-h200-attention-splits.md):
  // - where rounding up leaves CTAs past the slots (a second wave) and splits are long (12 chunks or more), round
  //   down: the second wave then costs as much as the first (27B / Qwen3-8B verifies of 65 nodes over 8192-16384
  //   keys: 0.7-0.8 x the time), while over short splits it costs little;
  // - from 32 chunks on, at least two chunks a split: one-chunk splits spend more on each CTA's fixed costs and the
  //   merge than they gain (the 27B 16- and 17-node verifies over 2048 keys: 0.72 x).
  // Measured at batch 1 only.
  // Splits take whole chunks, the same number each but the last, so fewer may run than asked.
  const size_t cta_smem = L::kTotal + prop->reservedSharedMemPerBlock;
  const int per_sm = static_cast<int>(std::clamp<size_t>(prop->sharedMemPerMultiprocessor / cta_smem, 1, 2));
  const int chunks = static_cast<int>(cuda::ceil_div(s, kAttnKeys));
  const int64_t slots = static_cast<int64_t>(per_sm) * prop->multiProcessorCount;
  int64_t asked = num_splits;
  if (asked <= 0) {
    asked = std::min<int64_t>(cuda::ceil_div(slots, base_ctas), chunks);
    if (base_ctas * asked > slots && cuda::ceil_div(chunks, asked) >= 12) {
      asked = std::max<int64_t>(1, slots / base_ctas);
    }
    if (chunks >= 32) asked = std::min<int64_t>(asked, chunks / 2);
  }
  const int want = static_cast<int>(std::clamp<int64_t>(asked, 1, chunks));
  const int keys_per_split = static_cast<int>(cuda::ceil_div(chunks, want)) * kAttnKeys;
  const int splits = static_cast<int>(cuda::ceil_div(s, keys_per_split));
  const bool* mask_ptr = mask.data_ptr<bool>();
  const bool mask_vec = mask.stride(3) == 1 && mask.stride(2) % 16 == 0 && mask.stride(0) % 16 == 0 &&
                        cuda::is_aligned(mask_ptr, 16);
  const AttnShapes sh{batch, heads, kv_heads, group, n, s, splits, keys_per_split,
                      static_cast<float>(scale) * kLog2e, mask_vec};
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor part_o, part_ml;
  if (splits > 1) {  // shape-dependent only: fine under graph capture
    part_o = at::empty({splits, batch * kv_heads * rows, D}, f32);
    part_ml = at::empty({splits, batch * kv_heads * rows, 2}, f32);
  }
  auto kernel = gqa_attention_kernel<T, D, STAGES, WARPS>;
  cuda::allow_dynamic_smem(kernel, L::kTotal);
  cuda::launch_programmatic(
      kernel, dim3(batch * kv_heads, row_tiles, splits), dim3(kAttnThreads), L::kTotal, sh, q.data_ptr<T>(),
      q.stride(0), q.stride(1), q.stride(2), k.data_ptr<T>(), k.stride(0), k.stride(1),
      k.stride(2), v.data_ptr<T>(), v.stride(0), v.stride(1), v.stride(2), mask_ptr, mask.stride(0),
      mask.stride(2), mask.stride(3), out.data_ptr<T>(), out.stride(0), out.stride(1), out.stride(2),
      splits > 1 ? part_o.data_ptr<float>() : nullptr,
      splits > 1 ? reinterpret_cast<float2*>(part_ml.data_ptr<float>()) : nullptr);
  if (splits > 1) {
    const int64_t all_rows = static_cast<int64_t>(batch) * kv_heads * rows;
    cuda::launch_programmatic(gqa_attention_combine_kernel<T, D>,
                              dim3(static_cast<unsigned>(all_rows)),
                              dim3(kCombineWarps * kWarp), 0, sh, part_o.data_ptr<float>(),
                              reinterpret_cast<const float2*>(part_ml.data_ptr<float>()), out.data_ptr<T>(),
                              out.stride(0), out.stride(1), out.stride(2));
  }
}

template <typename T, int D>
void launch_gqa_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                          double scale, at::Tensor& out, int stages, int64_t num_splits) {
  const int rows = static_cast<int>(q.size(1) / k.size(1) * q.size(2));
  if constexpr (D == 128) {
    if (wide_tiles_fit<D>(*at::cuda::getCurrentDeviceProperties(), rows)) {
      launch_gqa_attention<T, D, 2, 8>(q, k, v, mask, scale, out, num_splits);
      return;
    }
  }
  if (stages == 2) {
    launch_gqa_attention<T, D, 2, 4>(q, k, v, mask, scale, out, num_splits);
  } else {
    launch_gqa_attention<T, D, 1, 4>(q, k, v, mask, scale, out, num_splits);
  }
}

}  // namespace

// The kernel takes bfloat16/float16 with head dims 64, 128 or 256, q/k/v rows starting 16-byte aligned and out rows
// 4-byte aligned, on builds with tensor-core code for the GPU and where its shared memory fits; anything else takes ATen's SDPA over repeated K/V (gqa_attention_sdpa, as the CPU op).
void gqa_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                        double scale, at::Tensor& out, int64_t num_splits) {
  check_gqa_attention(q, k, v, mask, out, num_splits);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  if (k.size(2) == 0) {  // no keys: every row attends to nothing
    out.zero_();
    return;
  }
  const int64_t dim = q.size(3);
  auto rows_aligned = [](const at::Tensor& t, int64_t elems, size_t bytes) {
    return t.stride(0) % elems == 0 && t.stride(1) % elems == 0 && t.stride(2) % elems == 0 &&
           cuda::is_aligned(t.data_ptr(), bytes);
  };
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  const int stages = dim == 64 ? attention_stages<64>(*prop)
                     : dim == 128 ? attention_stages<128>(*prop)
                                  : attention_stages<256>(*prop);
  const bool kernel_applies = (q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16) &&
                              (dim == 64 || dim == 128 || dim == 256) && rows_aligned(q, 8, 16) &&
                              rows_aligned(k, 8, 16) && rows_aligned(v, 8, 16) && rows_aligned(out, 2, 4) &&
                              prop->major >= 8 && stages > 0 && tensor_cores_built(q.scalar_type());
  if (!kernel_applies) {
    gqa_attention_sdpa(q, k, v, mask, scale, out);
    return;
  }
  // A mask with one batch row or one query row broadcasts (stride 0).
  const at::Tensor m = mask.expand({q.size(0), 1, q.size(2), k.size(2)});
  AT_DISPATCH_SWITCH(q.scalar_type(), "gqa_attention", AT_DISPATCH_CASE(at::kHalf, [&] {
    switch (dim) {
      case 64: launch_gqa_attention<scalar_t, 64>(q, k, v, m, scale, out, stages, num_splits); break;
      case 128: launch_gqa_attention<scalar_t, 128>(q, k, v, m, scale, out, stages, num_splits); break;
      default: launch_gqa_attention<scalar_t, 256>(q, k, v, m, scale, out, stages, num_splits); break;
    }
  }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
    switch (dim) {
      case 64: launch_gqa_attention<scalar_t, 64>(q, k, v, m, scale, out, stages, num_splits); break;
      case 128: launch_gqa_attention<scalar_t, 128>(q, k, v, m, scale, out, stages, num_splits); break;
      default: launch_gqa_attention<scalar_t, 256>(q, k, v, m, scale, out, stages, num_splits); break;
    }
  }));
}

}  // namespace ddtree
