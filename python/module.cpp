// The pybind11 module ddtree_ext._C. Importing it loads the shared library, which registers the
// torch.ops.ddtree.* ops (python/torch_library.cpp); the module itself reports how it was built and, in CUDA builds,
// holds two host-side helpers: whether the kernels launch as programmatic dependents on a GPU, and one for captured CUDA
// graphs (csrc/graph_cuda.cpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#ifdef DDTREE_WITH_CUDA
#include <cuda_runtime_api.h>

namespace ddtree {
int64_t graph_launch_order_edges(int64_t graph_handle);  // csrc/graph_cuda.cpp
bool programmatic_launches(int64_t device_index);         // csrc/layer_cuda.cu
}
#endif

#ifndef DDTREE_VERSION
#define DDTREE_VERSION "0.0.0+unknown"
#endif
#ifndef DDTREE_CUDA_ARCHS
#define DDTREE_CUDA_ARCHS ""
#endif

namespace py = pybind11;

static py::dict build_info() {
  py::dict info;
  info["version"] = std::string(DDTREE_VERSION);
#ifdef DDTREE_WITH_CUDA
  info["cuda"] = true;
  info["cuda_version"] = std::to_string(CUDART_VERSION / 1000) + "." + std::to_string((CUDART_VERSION % 1000) / 10);
  info["cuda_archs"] = std::string(DDTREE_CUDA_ARCHS);
#else
  info["cuda"] = false;
  info["cuda_version"] = py::none();
  info["cuda_archs"] = std::string();
#endif
  return info;
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "ddtree_ext compiled core: registers the torch.ops.ddtree ops";
  m.def("build_info", &build_info,
        "Dict with the version, whether CUDA kernels were compiled in, the CUDA version and the arch list.");
#ifdef DDTREE_WITH_CUDA
  m.def(
      "programmatic_launches",
      [](int64_t device_index) {
        int count = 0;
        if (cudaGetDeviceCount(&count) != cudaSuccess) {
          (void)cudaGetLastError();
          count = 0;
        }
        if (device_index < 0 || device_index >= count) {
          throw py::value_error("programmatic_launches: device_index must be a CUDA device index in [0, " +
                                std::to_string(count) + "), got " + std::to_string(device_index));
        }
        return ddtree::programmatic_launches(device_index);
      },
      py::arg("device_index"),
      "Whether the core's kernels launch as programmatic dependents on this CUDA device (compute capability 9.0 or "
      "more, CUDA 12.3 or later at build, code built from PTX 9.0 or newer for it, no DDTREE_NO_PDL=1): each then "
      "starts while the kernel ahead of it ends, and a captured graph has programmatic edges. False where not.");
  m.def(
      "graph_launch_order_edges",
      [](int64_t graph_handle) {
        if (graph_handle == 0) {
          throw py::value_error("graph_launch_order_edges: graph_handle must be a cudaGraph_t, got 0");
        }
        return ddtree::graph_launch_order_edges(graph_handle);
      },
      py::arg("graph_handle"),
      "Moves every programmatic edge of a captured cudaGraph_t (torch.cuda.CUDAGraph(keep_graph=True)"
      ".raw_cuda_graph()) to its upstream kernel's launch-order port; returns how many (0 before CUDA 12.3). "
      "See csrc/graph_cuda.cpp.");
#endif
}
