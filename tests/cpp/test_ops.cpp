// C++ unit tests of the core, through the dispatcher (as Python reaches the ops), with no Python.
// Small cases with answers worked out by hand; the exhaustive comparisons against the reference
// live in the Python tests.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace {

int g_failures = 0;

#define EXPECT(cond)                                                     \
  do {                                                                   \
    if (!(cond)) {                                                       \
      std::fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                      \
    }                                                                    \
  } while (0)

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

at::Tensor i32(std::vector<int32_t> v) { return at::tensor(v, at::kInt); }
at::Tensor i64(std::vector<int64_t> v) { return at::tensor(v, at::kLong); }

void test_all_ops_registered() {
  for (const char* name : {"ddtree::topk_logprobs", "ddtree::build_tree", "ddtree::tree_attention_mask",
                           "ddtree::tree_conv1d", "ddtree::tree_gated_delta_rule", "ddtree::walk_greedy",
                           "ddtree::walk_sample", "ddtree::commit_gdn_state", "ddtree::commit_conv_state",
                           "ddtree::commit_kv", "ddtree::gather_rows"}) {
    EXPECT(op(name).hasKernelForDispatchKey(c10::DispatchKey::CPU));
  }
}

// Depth-1 candidates a (logp -0.1), b (-0.5); depth-2 candidates c (-0.2), d (-3.0).
// Best-first with budget 3 and no spine: a (-0.1), a->c (-0.3), b (-0.5).
void test_build_tree_and_greedy_walk() {
  auto logp = at::tensor({-0.1f, -0.5f, -0.2f, -3.0f}).view({1, 2, 2});
  auto tokens = i64({10, 11, 20, 21}).view({1, 2, 2});
  auto root = i64({5});
  auto prefix = i64({7});
  auto token = at::empty({1, 4}, at::kLong), parent = at::empty({1, 4}, at::kInt), depth = at::empty({1, 4}, at::kInt);
  auto num = at::empty({1}, at::kInt), fc = at::empty({1, 4}, at::kInt), ns = at::empty({1, 4}, at::kInt);
  auto anc = at::empty({1, 4, 1}, at::kLong), pos = at::empty({1, 4}, at::kLong);
  op("ddtree::build_tree")
      .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool,
                  at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&,
                  at::Tensor&)>()
      .call(logp, tokens, root, prefix, 3, false, token, parent, depth, num, fc, ns, anc, pos);
  EXPECT(at::equal(token, i64({5, 10, 20, 11}).view({1, 4})));
  EXPECT(at::equal(parent, i32({-1, 0, 1, 0}).view({1, 4})));
  EXPECT(at::equal(depth, i32({0, 1, 2, 1}).view({1, 4})));
  EXPECT(num.item<int32_t>() == 4);
  EXPECT(at::equal(fc, i32({1, 2, -1, -1}).view({1, 4})));
  EXPECT(at::equal(ns, i32({-1, 3, -1, -1}).view({1, 4})));
  EXPECT(at::equal(anc, i64({1, 3, 7, 9}).view({1, 4, 1})));
  EXPECT(at::equal(pos, i64({7, 8, 9, 8}).view({1, 4})));

  // The target agrees with a then c, then says 99: path 0 -> 1 -> 2, bonus 99.
  auto target = i64({10, 20, 99, 0}).view({1, 4});
  auto accepted = at::empty({1, 3}, at::kInt), accept_len = at::empty({1}, at::kInt), next = at::empty({1}, at::kLong);
  op("ddtree::walk_greedy")
      .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,
                  at::Tensor&, at::Tensor&)>()
      .call(token, fc, ns, target, accepted, accept_len, next);
  EXPECT(at::equal(accepted, i32({0, 1, 2}).view({1, 3})));
  EXPECT(accept_len.item<int32_t>() == 3);
  EXPECT(next.item<int64_t>() == 99);
}

// Path 0 -> 2 -> 3 in a cache with prefix 1: slots 1, 3, 4 move to 1, 2, 3; slot 0 and 4.. stay.
void test_commit_kv_overlap() {
  auto cache = at::arange(6, at::kFloat).view({1, 1, 6, 1});
  auto expected = at::tensor({0.f, 1.f, 3.f, 4.f, 4.f, 5.f}).view({1, 1, 6, 1});
  std::vector<at::Tensor> caches{cache};
  op("ddtree::commit_kv")
      .typed<void(at::TensorList, const at::Tensor&, const at::Tensor&, const at::Tensor&)>()
      .call(caches, i64({1}), i32({0, 2, 3}).view({1, 3}), i32({3}));
  EXPECT(at::equal(cache, expected));
}

// A single root node from a zero state: u = beta v, o = (scale q . k) u with unit q, k.
void test_gated_delta_rule_single_node() {
  auto q = at::tensor({1.f, 0.f}).view({1, 1, 1, 2});
  auto k = at::tensor({1.f, 0.f}).view({1, 1, 1, 2});
  auto v = at::tensor({2.f, 4.f}).view({1, 1, 1, 2});
  auto g = at::full({1, 1, 1}, -0.5f), beta = at::full({1, 1, 1}, 0.5f);
  auto state = at::zeros({1, 1, 2, 2});
  auto out = at::empty({1, 1, 1, 2}), u = at::empty({1, 1, 1, 2}), ks = at::empty({1, 1, 1, 2});
  auto cumg = at::empty({1, 1, 1});
  op("ddtree::tree_gated_delta_rule")
      .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                  const at::Tensor&, const at::Tensor&, double, bool, at::Tensor&, at::Tensor&, at::Tensor&,
                  at::Tensor&)>()
      .call(q, k, v, g, beta, state, i32({-1}).view({1, 1}), 0.5, false, out, u, ks, cumg);
  EXPECT(at::allclose(u, at::tensor({1.f, 2.f}).view({1, 1, 1, 2})));
  EXPECT(at::allclose(out, at::tensor({0.5f, 1.f}).view({1, 1, 1, 2})));
  EXPECT(std::abs(cumg.item<float>() + 0.5f) < 1e-7f);
}

// Bad input raises c10::ValueError naming the op and the argument, and writes nothing.
void test_bad_input_is_rejected_before_writing() {
  auto src = at::ones({1, 3, 2});
  auto out = at::full({1, 2, 2}, 42.f);
  bool raised = false;
  try {
    op("ddtree::gather_rows")
        .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&)>()
        .call(src, i64({0, 1}).view({1, 2}), i32({2}), out);  // accepted must be int32
  } catch (const c10::ValueError& e) {
    std::string msg = e.what();
    raised = msg.find("gather_rows") != std::string::npos && msg.find("accepted") != std::string::npos;
  }
  EXPECT(raised);
  EXPECT(at::equal(out, at::full({1, 2, 2}, 42.f)));
}

}  // namespace

int main() {
  const std::vector<std::pair<const char*, std::function<void()>>> tests = {
      {"all_ops_registered", test_all_ops_registered},
      {"build_tree_and_greedy_walk", test_build_tree_and_greedy_walk},
      {"commit_kv_overlap", test_commit_kv_overlap},
      {"gated_delta_rule_single_node", test_gated_delta_rule_single_node},
      {"bad_input_is_rejected_before_writing", test_bad_input_is_rejected_before_writing},
  };
  for (const auto& [name, fn] : tests) {
    const int before = g_failures;
    try {
      fn();
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "%s: unexpected exception: %s\n", name, e.what_without_backtrace());
      ++g_failures;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: unexpected exception: %s\n", name, e.what());
      ++g_failures;
    }
    std::printf("%s %s\n", g_failures == before ? "PASS" : "FAIL", name);
  }
  return g_failures == 0 ? 0 : 1;
}
