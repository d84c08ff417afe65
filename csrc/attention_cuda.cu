// WORK IN PROGRESS (branch wip-gqa-attention; compile-checked only, never run on a GPU). Split-KV masked GQA
// attention for verify and decode steps, to replace the cuDNN SDPA kernel under fused.gqa_attention: that kernel
// tiles only over query rows, so a decode step (G folded rows per KV head) runs one CTA per KV head (4 on the 27B
// shape) and a budget-64 verify about 28, each streaming the whole K/V. Measured there (e2e profiles): 9-17 us per
// layer at decode, 47 us at a 65-node verify, against a K/V read floor under 1 us.
//
// out[b, h, n] = softmax(scale q[b, h, n] . k[b, h / G, s] over s with mask[b, 0, n, s]) . v[b, h / G, s].
// Rows are folded per KV head: row r = g N + n is query head h = kvh G + g at node n. A CTA takes 64 folded rows
// (4 warps x 16) and one split of the keys, in chunks of 64; Q K^T and P V on tensor cores (mma m16n8k16, f32
// sums), the softmax online per row in base 2. With one split the CTA writes the normalised output; with several,
// unnormalised partial outputs and (max, sum) per row go to a workspace that a second kernel merges in split order
// (deterministic).
#include <algorithm>
#include <type_traits>

#include "cuda_common.cuh"
#include "ops.h"

namespace ddtree {
namespace {

using cuda::kWarp;

constexpr int kAttnWarps = 4;
constexpr int kAttnThreads = kAttnWarps * kWarp;
constexpr int kAttnRows = 16 * kAttnWarps;  // folded query rows per CTA
constexpr int kAttnKeys = 64;               // keys per chunk
constexpr float kLog2e = 1.4426950408889634f;

template <int D>
struct AttnLayout {
  static constexpr int kStride = D + 8;  // elements per staged row: 16 bytes of padding, conflict-free fragments
  static constexpr size_t kQ = 0;
  static constexpr size_t kK = kQ + sizeof(uint16_t) * kAttnRows * kStride;
  static constexpr size_t kV = kK + sizeof(uint16_t) * kAttnKeys * kStride;
  static constexpr size_t kTotal = kV + sizeof(uint16_t) * kAttnKeys * kStride;
};

template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  uint32_t r;
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

template <typename T>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                            uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// Two 8x8 tiles of 16-bit values, transposed: for B fragments of P V from V stored [key][d].
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t& r0, uint32_t& r1, const void* row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];" : "=r"(r0), "=r"(r1) : "r"(addr));
}

struct AttnShapes {
  int batch, heads, kv_heads, group, n, s, splits, keys_per_split;
  float scale_log2;  // scale * log2(e)
};

template <typename T, int D>
__global__ void __launch_bounds__(kAttnThreads, 1) gqa_attention_kernel(
    AttnShapes sh, const T* __restrict__ q, int64_t q_sb, int64_t q_sh, int64_t q_sn, const T* __restrict__ k,
    int64_t k_sb, int64_t k_sh, int64_t k_ss, const T* __restrict__ v, int64_t v_sb, int64_t v_sh, int64_t v_ss,
    const bool* __restrict__ mask, int64_t m_sb, int64_t m_sn, int64_t m_ss, T* __restrict__ out, int64_t o_sb,
    int64_t o_sh, int64_t o_sn, float* __restrict__ part_o, float2* __restrict__ part_ml) {
  using L = AttnLayout<D>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* qs = reinterpret_cast<T*>(smem_raw + L::kQ);
  T* ks = reinterpret_cast<T*>(smem_raw + L::kK);
  T* vs = reinterpret_cast<T*>(smem_raw + L::kV);
  const int bk = blockIdx.x, b = bk / sh.kv_heads, kvh = bk % sh.kv_heads;
  const int r0 = blockIdx.y * kAttnRows, split = blockIdx.z;
  const int rows = sh.group * sh.n;
  const int s_begin = split * sh.keys_per_split, s_end = min(sh.s, s_begin + sh.keys_per_split);
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp, gid = lane / 4, tig = lane % 4;
  constexpr int kPacks = D / 8;  // 16-byte packs per row

  // ---- the CTA's query rows (rows past the end: zeros) ----
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

  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // rows gid and gid + 8 of the warp's tile
  const int wr = r0 + 16 * warp;  // the warp's first folded row
  int mask_row[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) mask_row[h] = (wr + gid + 8 * h) % sh.n;  // node of the row (rows past the end: any)

  const uint32_t* qw = reinterpret_cast<const uint32_t*>(qs);
  const uint32_t* kw = reinterpret_cast<const uint32_t*>(ks);
  constexpr int kWs = L::kStride / 2;  // words per staged row

  for (int c0 = s_begin; c0 < s_end; c0 += kAttnKeys) {
    __syncthreads();  // the previous chunk's K and V are consumed
    for (int e = tid; e < kAttnKeys * kPacks; e += kAttnThreads) {
      const int key = e / kPacks, c = 8 * (e % kPacks), s = min(c0 + key, sh.s - 1);  // past the end: masked below
      cuda::copy_async<16>(ks + key * L::kStride + c, k + b * k_sb + kvh * k_sh + s * k_ss + c);
      cuda::copy_async<16>(vs + key * L::kStride + c, v + b * v_sb + kvh * v_sh + s * v_ss + c);
    }
    cuda::wait_async_copies();
    __syncthreads();

    // S = Q K^T for the warp's 16 rows and the chunk's 64 keys: 8 tiles of 16 x 8.
    float sc[kAttnKeys / 8][4];
#pragma unroll
    for (int j = 0; j < kAttnKeys / 8; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t* a = qw + (16 * warp + gid) * kWs + 8 * kk + tig;
      const uint32_t a0 = a[0], a1 = a[8 * kWs], a2 = a[4], a3 = a[8 * kWs + 4];
#pragma unroll
      for (int j = 0; j < kAttnKeys / 8; ++j) {
        const uint32_t* bp = kw + (8 * j + gid) * kWs + 8 * kk + tig;
        mma_16x8x16<T>(sc[j], a0, a1, a2, a3, bp[0], bp[4]);
      }
    }
    // Mask (and keys past the split), scale to base 2, online softmax per row.
    float rmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kAttnKeys / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e / 2, s = c0 + 8 * j + 2 * tig + e % 2;
        const bool keep = s < s_end && mask[b * m_sb + mask_row[h] * m_sn + s * m_ss];
        sc[j][e] = keep ? sc[j][e] * sh.scale_log2 : -INFINITY;
        rmax[h] = fmaxf(rmax[h], sc[j][e]);
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
        const int h = e / 2;
        sc[j][e] = exp2f(sc[j][e] - rmax[h]);
        rsum[h] += sc[j][e];
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
    // O += P V: P from the S accumulators (the m16n8 C layout of two key tiles is the m16n8k16 A layout), V
    // fragments transposed from its [key][d] rows.
#pragma unroll
    for (int kk = 0; kk < kAttnKeys / 16; ++kk) {
      const uint32_t a0 = pack_pair<T>(sc[2 * kk][0], sc[2 * kk][1]), a1 = pack_pair<T>(sc[2 * kk][2], sc[2 * kk][3]);
      const uint32_t a2 = pack_pair<T>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
      const uint32_t a3 = pack_pair<T>(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
      const T* vrow = vs + (16 * kk + (lane % 16)) * L::kStride;  // lanes 0-15: the 16 key rows of the step
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        uint32_t b0, b1;
        ldmatrix_x2_trans(b0, b1, vrow + 8 * j);
        mma_16x8x16<T>(o[j], a0, a1, a2, a3, b0, b1);
      }
    }
  }

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
      const float inv = 1.f / l_run[h];  // a row with every key masked: 0/0, as SDPA gives
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

// Merges the splits of each folded row in split order: out = sum_s O_s 2^(m_s - M) / sum_s l_s 2^(m_s - M).
template <typename T, int D>
__global__ void __launch_bounds__(D) gqa_attention_combine_kernel(AttnShapes sh, const float* __restrict__ part_o,
                                                                   const float2* __restrict__ part_ml,
                                                                   T* __restrict__ out, int64_t o_sb, int64_t o_sh,
                                                                   int64_t o_sn) {
  const int rows = sh.group * sh.n;
  const int bk = blockIdx.x / rows, fr = blockIdx.x % rows, b = bk / sh.kv_heads, kvh = bk % sh.kv_heads;
  const int64_t stride = static_cast<int64_t>(sh.batch) * sh.kv_heads * rows;  // between splits
  const int64_t row = static_cast<int64_t>(bk) * rows + fr;
  float m_all = -INFINITY;
  for (int s = 0; s < sh.splits; ++s) m_all = fmaxf(m_all, part_ml[s * stride + row].x);
  const float m_use = m_all == -INFINITY ? 0.f : m_all;
  float l = 0.f, acc = 0.f;
  for (int s = 0; s < sh.splits; ++s) {
    const float2 ml = part_ml[s * stride + row];
    const float w = exp2f(ml.x - m_use);
    l += ml.y * w;
    acc += part_o[(s * stride + row) * D + threadIdx.x] * w;
  }
  const int g = fr / sh.n, n = fr % sh.n;
  out[b * o_sb + (kvh * sh.group + g) * o_sh + n * o_sn + threadIdx.x] = cuda::from_float<T>(acc / l);
}

template <typename T, int D>
void launch_gqa_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                          double scale, at::Tensor& out) {
  const int batch = static_cast<int>(q.size(0)), heads = static_cast<int>(q.size(1)), n = static_cast<int>(q.size(2));
  const int kv_heads = static_cast<int>(k.size(1)), s = static_cast<int>(k.size(2));
  const int group = heads / kv_heads, rows = group * n;
  const int row_tiles = static_cast<int>(cuda::ceil_div(rows, kAttnRows));
  const int base_ctas = batch * kv_heads * row_tiles;
  const int sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int chunks = static_cast<int>(cuda::ceil_div(s, kAttnKeys));
  const int want = static_cast<int>(std::min<int64_t>(chunks, cuda::ceil_div(2 * sm_count, base_ctas)));
  const int keys_per_split = static_cast<int>(cuda::ceil_div(chunks, want)) * kAttnKeys;
  const int splits = static_cast<int>(cuda::ceil_div(s, keys_per_split));
  const AttnShapes sh{batch, heads, kv_heads, group, n, s, splits, keys_per_split,
                      static_cast<float>(scale) * kLog2e};
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor part_o, part_ml;
  if (splits > 1) {  // shape-dependent only: fine under graph capture
    part_o = at::empty({splits, batch * kv_heads * rows, D}, f32);
    part_ml = at::empty({splits, batch * kv_heads * rows, 2}, f32);
  }
  const cudaStream_t stream = cuda::current_stream();
  auto kernel = gqa_attention_kernel<T, D>;
  cuda::allow_dynamic_smem(kernel, AttnLayout<D>::kTotal);
  kernel<<<dim3(batch * kv_heads, row_tiles, splits), kAttnThreads, AttnLayout<D>::kTotal, stream>>>(
      sh, q.data_ptr<T>(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr<T>(), k.stride(0), k.stride(1),
      k.stride(2), v.data_ptr<T>(), v.stride(0), v.stride(1), v.stride(2), mask.data_ptr<bool>(), mask.stride(0),
      mask.stride(2), mask.stride(3), out.data_ptr<T>(), out.stride(0), out.stride(1), out.stride(2),
      splits > 1 ? part_o.data_ptr<float>() : nullptr,
      splits > 1 ? reinterpret_cast<float2*>(part_ml.data_ptr<float>()) : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (splits > 1) {
    gqa_attention_combine_kernel<T, D><<<batch * kv_heads * rows, D, 0, stream>>>(
        sh, part_o.data_ptr<float>(), reinterpret_cast<const float2*>(part_ml.data_ptr<float>()), out.data_ptr<T>(),
        out.stride(0), out.stride(1), out.stride(2));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

// The kernel takes bfloat16/float16 with head dims 64, 128 or 256, q/k/v rows starting 16-byte aligned and out rows
// 4-byte aligned; anything else takes ATen's SDPA over repeated K/V (gqa_attention_sdpa, as the CPU op).
void gqa_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                        double scale, at::Tensor& out) {
  check_gqa_attention(q, k, v, mask, out);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t dim = q.size(3);
  auto rows_aligned = [](const at::Tensor& t, int64_t elems, size_t bytes) {
    return t.stride(0) % elems == 0 && t.stride(1) % elems == 0 && t.stride(2) % elems == 0 &&
           cuda::is_aligned(t.data_ptr(), bytes);
  };
  const bool kernel_applies = (q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16) &&
                              (dim == 64 || dim == 128 || dim == 256) && rows_aligned(q, 8, 16) &&
                              rows_aligned(k, 8, 16) && rows_aligned(v, 8, 16) && rows_aligned(out, 2, 4) &&
                              at::cuda::getCurrentDeviceProperties()->major >= 8;
  if (!kernel_applies) {
    gqa_attention_sdpa(q, k, v, mask, scale, out);
    return;
  }
  // A mask with one batch row or one query row broadcasts (stride 0).
  const at::Tensor m = mask.expand({q.size(0), 1, q.size(2), k.size(2)});
  AT_DISPATCH_SWITCH(q.scalar_type(), "gqa_attention", AT_DISPATCH_CASE(at::kHalf, [&] {
    switch (dim) {
      case 64: launch_gqa_attention<scalar_t, 64>(q, k, v, m, scale, out); break;
      case 128: launch_gqa_attention<scalar_t, 128>(q, k, v, m, scale, out); break;
      default: launch_gqa_attention<scalar_t, 256>(q, k, v, m, scale, out); break;
    }
  }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
    switch (dim) {
      case 64: launch_gqa_attention<scalar_t, 64>(q, k, v, m, scale, out); break;
      case 128: launch_gqa_attention<scalar_t, 128>(q, k, v, m, scale, out); break;
      default: launch_gqa_attention<scalar_t, 256>(q, k, v, m, scale, out); break;
    }
  }));
}

}  // namespace ddtree
