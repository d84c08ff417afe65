// Argument checks and dtype dispatch shared by every op, CPU and CUDA alike.
//
// Failures raise ValueError in Python (c10::ValueError). Every message names the op and the argument and says what was expected, e.g.
//   "build_tree: parent must have dtype Int, got Long".
// Checks run before an op writes anything, so a failed call leaves caller buffers untouched.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace ddtree {

inline std::string shape_str(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(sizes[i]);
  }
  return s + "]";
}

// Whether a and b are the same elements (one data pointer, sizes and strides): an elementwise op may then write in place.
inline bool same_elements(const at::Tensor& a, const at::Tensor& b) {
  return a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() && a.strides() == b.strides() &&
         a.scalar_type() == b.scalar_type();
}

// The bytes a tensor's elements span, [first, one past the last]; strides are never negative.
inline std::pair<const char*, const char*> byte_range(const at::Tensor& t) {
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const auto* begin = static_cast<const char*>(t.data_ptr());
  return {begin, begin + (last + 1) * t.element_size()};
}

// Whether a and b may share memory, for the ops' "must not overlap" checks: ATen's overlap status, and where it cannot
// tell (a tensor that is not non-overlapping and dense, such as heads sliced from wider rows):
// * for row tensors [R, D] of one row stride s (last dim contiguous), exactly: row i of a spans [i s, i s + Da) and
//   row j of b [d + j s, d + j s + Db) (in elements, d = b's offset from a's), so they meet iff some k = i - j in
//   [1 - Rb, Ra - 1] has k s in (d - Da, d + Db); interleaved slices of one buffer (a stacked projection's halves) do
//   not;
// * otherwise whether their byte ranges in one storage meet (conservative: interleaved views count as overlapping).
inline bool may_overlap(const at::Tensor& a, const at::Tensor& b) {
  const auto status = at::get_overlap_status(a, b);
  if (status == at::MemOverlapStatus::Full || status == at::MemOverlapStatus::Partial) return true;
  if (status != at::MemOverlapStatus::TooHard || a.numel() == 0 || b.numel() == 0) return false;
  if (!a.has_storage() || !b.has_storage() || !a.storage().is_alias_of(b.storage())) return false;
  const int64_t bytes = static_cast<const char*>(b.data_ptr()) - static_cast<const char*>(a.data_ptr());
  const bool rows = a.dim() == 2 && b.dim() == 2 && a.stride(1) == 1 && b.stride(1) == 1 && a.stride(0) == b.stride(0) &&
                    a.stride(0) >= a.size(1) && a.stride(0) >= b.size(1) && a.element_size() == b.element_size() &&
                    bytes % a.element_size() == 0;
  if (rows) {
    const int64_t d = bytes / a.element_size(), s = a.stride(0);
    auto floor_div = [](int64_t p, int64_t q) { return p / q - ((p % q != 0) && ((p < 0) != (q < 0))); };
    // k s > d - Da  <=>  k >= floor((d - Da) / s) + 1;  k s < d + Db  <=>  k <= ceil((d + Db) / s) - 1
    const int64_t lo = std::max(floor_div(d - a.size(1), s) + 1, 1 - b.size(0));
    const int64_t hi = std::min(-floor_div(-(d + b.size(1)), s) - 1, a.size(0) - 1);
    return lo <= hi;
  }
  const auto ra = byte_range(a), rb = byte_range(b);
  return ra.first < rb.second && rb.first < ra.second;
}

// The tensors of a per-layer list must be apart: an op that updates each in place would apply the update twice to a
// tensor listed twice (two layers' K/V in one buffer), and on CUDA from two blocks at once. Each tensor is compared
// only with those that start inside its byte range (sorted by start): O(L log L) host work for apart tensors.
inline void check_apart(const char* op, const char* list, at::TensorList tensors) {
  std::vector<std::pair<const char*, size_t>> starts;
  for (size_t l = 0; l < tensors.size(); ++l) {
    if (tensors[l].numel() > 0) starts.emplace_back(static_cast<const char*>(tensors[l].data_ptr()), l);
  }
  std::sort(starts.begin(), starts.end());
  for (size_t i = 0; i + 1 < starts.size(); ++i) {
    const at::Tensor& a = tensors[starts[i].second];
    const char* end = byte_range(a).second;
    for (size_t j = i + 1; j < starts.size() && starts[j].first < end; ++j) {
      TORCH_CHECK_VALUE(!may_overlap(a, tensors[starts[j].second]), op, ": ", list, "[", starts[i].second, "] and ",
                        list, "[", starts[j].second, "] must not share memory (one tensor per layer)");
    }
  }
}

// A written tensor must not overlap itself (an expanded view): several of its elements would be one.
inline void check_no_self_overlap(const char* op, const std::string& name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": ", name,
                    " must not overlap itself (e.g. an expanded tensor)");
}

// The first `outputs` of `tensors` (name, tensor) must share no memory with each other or with any tensor after them:
// what an op writes while it still reads the others.
inline void check_outputs_apart(const char* op,
                                std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors,
                                size_t outputs) {
  const auto* t = tensors.begin();
  for (size_t i = 0; i < outputs; ++i) {
    for (size_t j = i + 1; j < tensors.size(); ++j) {
      TORCH_CHECK_VALUE(!may_overlap(*t[i].second, *t[j].second), op, ": ", t[i].first, " must not share memory with ",
                        t[j].first);
    }
  }
}

// Where row r of an activation lies, for an op that takes it as [rows, D] or as groups of rows [G, R, D]: at
// (r / inner) * outer_stride + (r % inner) * inner_stride elements. Groups of rows are the heads of a token whose
// row holds more than those heads (a slice of a stacked projection's output), which no single row stride reaches.
struct RowLayout {
  int64_t inner;         // rows per group (all rows for a [rows, D] tensor)
  int64_t outer_stride;  // between groups
  int64_t inner_stride;  // between the rows of a group
};

// t: [rows, D] or [G, R, D].
inline RowLayout row_layout(const at::Tensor& t) {
  if (t.dim() == 2) return RowLayout{std::max<int64_t>(t.size(0), 1), 0, t.stride(0)};
  return RowLayout{std::max<int64_t>(t.size(1), 1), t.stride(0), t.stride(1)};
}

#if defined(__CUDACC__)
__host__ __device__
#endif
inline int64_t row_offset(const RowLayout& l, int64_t r) {
  return (r / l.inner) * l.outer_stride + (r % l.inner) * l.inner_stride;
}

}  // namespace ddtree

#define DDTREE_CHECK(op, cond, ...) TORCH_CHECK_VALUE((cond), op, ": ", __VA_ARGS__)

#define DDTREE_CHECK_DTYPE(op, t, dtype)                                                          \
  TORCH_CHECK_VALUE((t).scalar_type() == (dtype), op, ": ", #t, " must have dtype ", (dtype), ", got ", \
              (t).scalar_type())

#define DDTREE_CHECK_FLOAT(op, t)                                                        \
  TORCH_CHECK_VALUE((t).scalar_type() == at::kFloat || (t).scalar_type() == at::kHalf ||       \
                  (t).scalar_type() == at::kBFloat16,                                    \
              op, ": ", #t, " must be float32, float16 or bfloat16, got ", (t).scalar_type())

#define DDTREE_CHECK_DIM(op, t, n) \
  TORCH_CHECK_VALUE((t).dim() == (n), op, ": ", #t, " must have ", n, " dims, got shape ", ddtree::shape_str((t).sizes()))

// Shape check with an expected shape given as a brace list, e.g. DDTREE_CHECK_SHAPE("op", x, {B, N}).
#define DDTREE_CHECK_SHAPE(op, t, ...)                                                              \
  do {                                                                                              \
    const std::vector<int64_t> ddtree_expected_ = __VA_ARGS__;                                      \
    TORCH_CHECK_VALUE((t).sizes() == at::IntArrayRef(ddtree_expected_), op, ": ", #t, " must have shape ", \
                ddtree::shape_str(ddtree_expected_), ", got ", ddtree::shape_str((t).sizes()));     \
  } while (0)

#define DDTREE_CHECK_CONTIGUOUS(op, t) \
  TORCH_CHECK_VALUE((t).is_contiguous(), op, ": ", #t, " must be contiguous, got strides ", ddtree::shape_str((t).strides()))

#define DDTREE_CHECK_LAST_DIM_CONTIGUOUS(op, t)                                                              \
  TORCH_CHECK_VALUE((t).dim() == 0 || (t).stride(-1) == 1 || (t).size(-1) == 1, op, ": ", #t,                     \
              " must be contiguous in its last dim, got strides ", ddtree::shape_str((t).strides()))

#define DDTREE_CHECK_SAME_DEVICE(op, ref, t)                                                                \
  TORCH_CHECK_VALUE((t).device() == (ref).device(), op, ": ", #t, " must be on ", (ref).device(), " like ", #ref, \
              ", got ", (t).device())

// One dispatch for the activation dtypes every op accepts.
#define DDTREE_DISPATCH_FLOAT(dtype, op, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, op, __VA_ARGS__)
