// The pybind11 module ddtree_ext._C. Importing it loads the shared library, which registers the
// torch.ops.ddtree.* ops (python/torch_library.cpp); the module itself only reports how it was built.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#ifdef DDTREE_WITH_CUDA
#include <cuda_runtime_api.h>
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
}
