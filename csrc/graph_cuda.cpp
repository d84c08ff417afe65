// Launch-order edges in a captured CUDA graph: our kernels start while the foreign kernel ahead of them (a cuBLAS
// GEMM, a torch kernel) is still running, and wait for it on the device.
//
// Every kernel of this library is launched as a programmatic dependent (cuda::launch_programmatic): stream capture
// records the edge into it as programmatic, from the upstream kernel's programmatic port, which activates once every
// block of the upstream has called griddepcontrol.launch_dependents or exited. Our kernels call it first thing, so
// after one of ours the next launches at once. torch's kernels do not call it, nor (by what follows) cuBLAS's GEMMs:
// after a GEMM the next kernel launches once the GEMM's last block has exited, and its launch and the first loads of
// its prologue (the L2 prefetches of its weights) are on the round's critical path. A q/k norm after its projection,
// in a graph, cost 1.3-3.6 us more than the same norm after another norm on the H200
// (benchmarks/results/2026-12-04-h200-latency-chains.md), and a round has such an edge after most of its projections.
//
// Moving such an edge to the upstream's launch-order port (it activates once every block of the upstream has
// begun) keeps its type programmatic, so the dependent's griddepcontrol.wait still waits for the whole upstream grid
// to complete and its writes to be visible: CUDA documents cudaGraphDependencyTypeProgrammatic, from either port, as
// the edge across which "the downstream node [may] use cudaGridDependencySynchronize()". What changes is only when
// the dependent's blocks may be placed: once the GEMM's blocks are all running, and the work before the GEMM is
// done (its own edges are plain). Sound for any dependent that, before its griddepcontrol.wait, writes nothing and
// reads nothing the kernel ahead of it writes, which every kernel here guarantees (most only prefetch into L2, which
// loads no register; gdn_tree_main reads its inputs early, behind gdn_tree_prep, which writes none of them), the same
// condition as with the programmatic port. tests/test_cuda.py -k launch_order checks the waiting on a GPU (passed on
// the H200, 2026-12-05, as did tests/test_generate_cuda.py's exact rounds with the edges moved).
#include <cuda_runtime_api.h>

#include <c10/cuda/CUDAException.h>

#include <vector>

namespace ddtree {

// graph_handle: a cudaGraph_t, nonzero (checked by the binding, python/module.cpp).
int64_t graph_launch_order_edges(int64_t graph_handle) {
#if CUDART_VERSION >= 12030
  auto graph = reinterpret_cast<cudaGraph_t>(graph_handle);
#if CUDART_VERSION >= 13000
  auto get_edges = cudaGraphGetEdges;
  auto add = cudaGraphAddDependencies;
  auto remove = cudaGraphRemoveDependencies;
#else
  auto get_edges = cudaGraphGetEdges_v2;
  auto add = cudaGraphAddDependencies_v2;
  auto remove = cudaGraphRemoveDependencies_v2;
#endif
  size_t count = 0;
  C10_CUDA_CHECK(get_edges(graph, nullptr, nullptr, nullptr, &count));
  std::vector<cudaGraphNode_t> from(count), to(count);
  std::vector<cudaGraphEdgeData> data(count);
  if (count > 0) C10_CUDA_CHECK(get_edges(graph, from.data(), to.data(), data.data(), &count));
  std::vector<cudaGraphNode_t> moved_from, moved_to;
  std::vector<cudaGraphEdgeData> moved_data;
  for (size_t i = 0; i < count; ++i) {
    const bool programmatic = data[i].type == cudaGraphDependencyTypeProgrammatic;
    if (programmatic && data[i].from_port == cudaGraphKernelNodePortProgrammatic) {
      moved_from.push_back(from[i]);
      moved_to.push_back(to[i]);
      moved_data.push_back(data[i]);
    }
  }
  if (moved_from.empty()) return 0;
  C10_CUDA_CHECK(remove(graph, moved_from.data(), moved_to.data(), moved_data.data(), moved_from.size()));
  for (cudaGraphEdgeData& d : moved_data) d.from_port = cudaGraphKernelNodePortLaunchCompletion;  // still programmatic
  C10_CUDA_CHECK(add(graph, moved_from.data(), moved_to.data(), moved_data.data(), moved_from.size()));
  return static_cast<int64_t>(moved_from.size());
#else
  return 0;  // no edge data before CUDA 12.3: the graph keeps its programmatic-port edges
#endif
}

}  // namespace ddtree
