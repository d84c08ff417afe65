// Projections through an explicit cuBLASLt algorithm: out[M, N] = x[M, K] weight[N, K]^T by the `algorithm`-th
// candidate cuBLASLt's heuristic offers for the problem (its first pick is 0).
//
// Why: at the few rows of a round a projection only streams its weight, and cuBLAS's own choice of kernel (tile,
// split of K, stages) for a shape is a heuristic. On the H200 it ran some round shapes well above the copy rate
// (the 27B MLP's stacked 34816 x 5120 weight at 65 rows: 100.5 us against 95.3 for its two halves apart), so
// ddtree_ext.gemm times the candidates once per shape, on the weights themselves, and keeps the fastest. This file
// is the mechanism only: the candidate list per problem, and a launch of one of them.
//
// The problem in cuBLASLt's column-major terms ("TN"): out^T [N, M] = weight [N, K] (read transposed from its
// column-major [K, N]) times x^T [K, M]. Row strides become leading dimensions, so a weight that is a row block of a
// stacked tensor, and x rows further apart than K, need no copy.
//
// Beside the heuristic's candidates each problem offers their variants with other splits of K (add_split_variants).
//
// A problem's descriptors and candidates are built once (the heuristic costs host time) and kept per key: device,
// dtype, sizes, leading dimensions and the pointers' alignments, everything the candidates depend on. A launch
// allocates the candidate's workspace from torch's caching allocator on the current stream, so it is safe on side
// streams and under CUDA graph capture (the graph's pool keeps it).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

#include <algorithm>
#include <iterator>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "checks.h"
#include "ops.h"

namespace ddtree {
namespace {

constexpr int kMaxCandidates = 32;
// The most workspace a candidate may ask for (split-K partial sums): 32 MiB, what torch allows cuBLASLt on Hopper.
constexpr uint64_t kMaxWorkspaceBytes = uint64_t{32} << 20;

#define DDTREE_CUBLASLT_CHECK(call)                                                                    \
  do {                                                                                                 \
    const cublasStatus_t ddtree_status_ = (call);                                                      \
    TORCH_CHECK(ddtree_status_ == CUBLAS_STATUS_SUCCESS, "linear_cublaslt: ", #call, " failed with ", \
                cublasLtGetStatusName(ddtree_status_), " (", cublasLtGetStatusString(ddtree_status_), ")"); \
  } while (0)

// The largest power of two <= 16 that divides the address: what the heuristic may assume of the pointer.
int alignment_bytes(const void* ptr) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  int bytes = 16;
  while (bytes > 1 && address % bytes != 0) bytes /= 2;
  return bytes;
}

using ProblemKey = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int>;

// One problem's descriptors and its candidates: the heuristic's, in its order, then their split-K variants.
struct Problem {
  cublasLtMatmulDesc_t matmul = nullptr;
  cublasLtMatrixLayout_t weight_layout = nullptr, x_layout = nullptr, out_layout = nullptr;
  std::vector<cublasLtMatmulHeuristicResult_t> candidates;

  Problem() = default;
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;
  ~Problem() {
    if (out_layout) cublasLtMatrixLayoutDestroy(out_layout);
    if (x_layout) cublasLtMatrixLayoutDestroy(x_layout);
    if (weight_layout) cublasLtMatrixLayoutDestroy(weight_layout);
    if (matmul) cublasLtMatmulDescDestroy(matmul);
  }
};

cudaDataType_t cuda_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

// The leading dimensions of x, weight and out: their row strides, except for a single row (or weight row), whose
// stride cuBLASLt never reads (so a prefill's last row and a decode step's row are one problem).
struct LeadingDims {
  int64_t x, weight, out;
};

LeadingDims leading_dims(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  const int64_t m = x.size(0), n = weight.size(0), k = x.size(1);
  return {m == 1 ? k : x.stride(0), n == 1 ? k : weight.stride(0), m == 1 ? n : out.stride(0)};
}

ProblemKey problem_key(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  const LeadingDims ld = leading_dims(x, weight, out);
  return {static_cast<int>(x.get_device()), static_cast<int>(x.scalar_type()), x.size(0), weight.size(0), x.size(1),
          ld.x, ld.weight, ld.out, alignment_bytes(x.data_ptr()), alignment_bytes(weight.data_ptr()),
          alignment_bytes(out.data_ptr())};
}

bool same_algorithm(const cublasLtMatmulAlgo_t& a, const cublasLtMatmulAlgo_t& b) {
  return std::equal(std::begin(a.data), std::end(a.data), std::begin(b.data));
}

// The heuristic offers few candidates per problem (8 on the H200 for the round shapes) and few splits of K among
// them, though at a round's few rows a projection's time hangs on how many CTAs stream its weight. So each candidate
// is also offered with K split kSplits ways (partial sums reduced in float32 through the workspace), where cuBLASLt
// accepts the configuration (cublasLtMatmulAlgoCheck, for 16-byte aligned operands); duplicates are dropped. They
// follow the heuristic's own, so candidate 0 stays its first pick.
void add_split_variants(Problem& problem) {
  constexpr uint32_t kSplits[] = {1, 2, 3, 4, 6, 8, 12, 16};
  const size_t heuristic = problem.candidates.size();
  for (size_t c = 0; c < heuristic; ++c) {
    for (const uint32_t split : kSplits) {
      cublasLtMatmulAlgo_t algo = problem.candidates[c].algo;
      const uint32_t scheme = split == 1 ? CUBLASLT_REDUCTION_SCHEME_NONE : CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
      if (cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split, sizeof(split)) !=
              CUBLAS_STATUS_SUCCESS ||
          cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                               sizeof(scheme)) != CUBLAS_STATUS_SUCCESS) {
        continue;
      }
      const bool seen = std::any_of(problem.candidates.begin(), problem.candidates.end(),
                                    [&](const auto& known) { return same_algorithm(known.algo, algo); });
      if (seen) continue;
      cublasLtMatmulHeuristicResult_t checked{};
      if (cublasLtMatmulAlgoCheck(at::cuda::getCurrentCUDABlasLtHandle(), problem.matmul, problem.weight_layout,
                                  problem.x_layout, problem.out_layout, problem.out_layout, &algo,
                                  &checked) != CUBLAS_STATUS_SUCCESS ||
          checked.workspaceSize > kMaxWorkspaceBytes) {
        continue;
      }
      checked.algo = algo;
      checked.state = CUBLAS_STATUS_SUCCESS;
      problem.candidates.push_back(checked);
    }
  }
}

std::unique_ptr<Problem> make_problem(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  auto problem = std::make_unique<Problem>();
  const cudaDataType_t type = cuda_type(x.scalar_type());
  const int64_t m = x.size(0), n = weight.size(0), k = x.size(1);
  const LeadingDims ld = leading_dims(x, weight, out);
  const int64_t ldx = ld.x, ldw = ld.weight, ldo = ld.out;
  // float32 sums and scalars; float32 inputs keep full float32 products (no TF32), as torch's default matmul does.
  DDTREE_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&problem->matmul, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
  DDTREE_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(problem->matmul, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                                       sizeof(transpose)));
  DDTREE_CUBLASLT_CHECK(
      cublasLtMatmulDescSetAttribute(problem->matmul, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof(keep)));
  DDTREE_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&problem->weight_layout, type, k, n, ldw));
  DDTREE_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&problem->x_layout, type, k, m, ldx));
  DDTREE_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&problem->out_layout, type, n, m, ldo));

  cublasLtMatmulPreference_t preference = nullptr;
  DDTREE_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&preference));
  const uint32_t align_w = alignment_bytes(weight.data_ptr()), align_x = alignment_bytes(x.data_ptr()),
                 align_out = alignment_bytes(out.data_ptr());
  // Split-K partial sums reduced in float32 only (no reduction in the output type), as the op promises.
  const uint32_t reductions = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  struct {
    cublasLtMatmulPreferenceAttributes_t attribute;
    const void* value;
    size_t size;
  } const settings[] = {
      {CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kMaxWorkspaceBytes, sizeof(kMaxWorkspaceBytes)},
      {CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reductions, sizeof(reductions)},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_w, sizeof(align_w)},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_x, sizeof(align_x)},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_out, sizeof(align_out)},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_out, sizeof(align_out)},
  };
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  for (const auto& s : settings) {
    status = cublasLtMatmulPreferenceSetAttribute(preference, s.attribute, s.value, s.size);
    if (status != CUBLAS_STATUS_SUCCESS) break;
  }
  int returned = 0;
  std::vector<cublasLtMatmulHeuristicResult_t> results(kMaxCandidates);
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulAlgoGetHeuristic(at::cuda::getCurrentCUDABlasLtHandle(), problem->matmul,
                                            problem->weight_layout, problem->x_layout, problem->out_layout,
                                            problem->out_layout, preference, kMaxCandidates, results.data(),
                                            &returned);
  }
  cublasLtMatmulPreferenceDestroy(preference);
  // No candidate is an answer (the caller then runs torch's matmul), not an error.
  if (status != CUBLAS_STATUS_SUCCESS && status != CUBLAS_STATUS_NOT_SUPPORTED) DDTREE_CUBLASLT_CHECK(status);
  for (int i = 0; i < returned; ++i) {
    if (results[i].state == CUBLAS_STATUS_SUCCESS) problem->candidates.push_back(results[i]);
  }
  // cublasLtMatmulAlgoCheck knows no pointers: variants only where every operand has the widest alignment.
  if (align_w == 16 && align_x == 16 && align_out == 16) add_split_variants(*problem);
  return problem;
}

// The problem of (x, weight, out), built at its first sight and kept for the process (a model has a few dozen).
const Problem& problem_for(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  static std::mutex mutex;
  static std::map<ProblemKey, std::unique_ptr<Problem>> problems;
  const ProblemKey key = problem_key(x, weight, out);
  const std::lock_guard<std::mutex> lock(mutex);
  auto& slot = problems[key];
  if (!slot) slot = make_problem(x, weight, out);
  return *slot;
}

void check_algorithm(const Problem& problem, int64_t algorithm) {
  TORCH_CHECK_VALUE(algorithm >= 0 && algorithm < static_cast<int64_t>(problem.candidates.size()),
                    "linear_cublaslt: algorithm must be in [0, ", problem.candidates.size(),
                    ") (the candidates linear_cublaslt_algorithms counts for these tensors), got ", algorithm);
}

template <typename T>
T config_attribute(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attribute) {
  T value{};
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attribute, &value, sizeof(value), &written) !=
      CUBLAS_STATUS_SUCCESS) {
    return T{};
  }
  return value;
}

}  // namespace

int64_t linear_cublaslt_algorithms_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  check_linear_cublaslt("linear_cublaslt_algorithms", x, weight, out);
  if (out.numel() == 0) return 0;
  const c10::cuda::CUDAGuard guard(x.device());
  return static_cast<int64_t>(problem_for(x, weight, out).candidates.size());
}

std::string linear_cublaslt_describe_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out,
                                          int64_t algorithm) {
  check_linear_cublaslt("linear_cublaslt_describe", x, weight, out);
  TORCH_CHECK_VALUE(out.numel() > 0, "linear_cublaslt_describe: an empty problem has no algorithm, got out of shape ",
                    shape_str(out.sizes()));
  const c10::cuda::CUDAGuard guard(x.device());
  const Problem& problem = problem_for(x, weight, out);
  check_algorithm(problem, algorithm);
  const auto& candidate = problem.candidates[algorithm];
  const auto& algo = candidate.algo;
  return "id " + std::to_string(config_attribute<int32_t>(algo, CUBLASLT_ALGO_CONFIG_ID)) + ", tile " +
         std::to_string(config_attribute<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID)) + ", stages " +
         std::to_string(config_attribute<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID)) + ", split-k " +
         std::to_string(config_attribute<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM)) + ", reduction " +
         std::to_string(config_attribute<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME)) + ", swizzle " +
         std::to_string(config_attribute<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING)) + ", workspace " +
         std::to_string(candidate.workspaceSize) + " B, waves " + std::to_string(candidate.wavesCount);
}

void linear_cublaslt_cuda(const at::Tensor& x, const at::Tensor& weight, int64_t algorithm, at::Tensor& out) {
  check_linear_cublaslt("linear_cublaslt", x, weight, out);
  const c10::cuda::CUDAGuard guard(x.device());
  if (out.numel() == 0) {  // no candidates (linear_cublaslt_algorithms counts 0): only 0 names "nothing to do"
    TORCH_CHECK_VALUE(algorithm == 0, "linear_cublaslt: algorithm must be 0 for an empty problem, got ", algorithm);
    return;
  }
  const Problem& problem = problem_for(x, weight, out);
  check_algorithm(problem, algorithm);
  const auto& candidate = problem.candidates[algorithm];
  at::Tensor workspace;
  if (candidate.workspaceSize > 0) {
    workspace = at::empty({static_cast<int64_t>(candidate.workspaceSize)}, x.options().dtype(at::kByte));
  }
  const float one = 1.0f, zero = 0.0f;
  DDTREE_CUBLASLT_CHECK(cublasLtMatmul(
      at::cuda::getCurrentCUDABlasLtHandle(), problem.matmul, &one, weight.data_ptr(), problem.weight_layout,
      x.data_ptr(), problem.x_layout, &zero, out.data_ptr(), problem.out_layout, out.data_ptr(), problem.out_layout,
      &candidate.algo, workspace.defined() ? workspace.data_ptr() : nullptr, candidate.workspaceSize,
      at::cuda::getCurrentCUDAStream()));
}

}  // namespace ddtree
