"""Build of ddtree_ext and its compiled core ddtree_ext._C.

CPU or CUDA is decided from the toolchain and explicit variables, never from whether a GPU is visible,
so a GPU-less machine can still build a CUDA wheel:
  DDTREE_FORCE_CPU=1   build the CPU-only core even where CUDA is available
  DDTREE_FORCE_CUDA=1  build the CUDA core (fails clearly without nvcc or a CUDA build of torch)
  otherwise            CUDA when torch was built with CUDA and a CUDA toolkit (nvcc) is found
TORCH_CUDA_ARCH_LIST picks the GPU architectures (default: the release list below); MAX_JOBS the
parallel compile jobs. Build against the torch already installed: pip install --no-build-isolation .
"""

import os
import re
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent.resolve()
VERSION = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
RELEASE_CUDA_ARCHS = "8.0;8.6;8.9;9.0a;10.0;12.0+PTX"


def _flag(name):
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def read_sources():
    """The shared source list (csrc/sources.txt): (all C++ sources, CUDA-only sources)."""
    lines = (ROOT / "csrc" / "sources.txt").read_text().splitlines()
    paths = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    cuda_only = [p for p in paths if p.endswith(".cu") or p.endswith("_cuda.cpp")]
    return [p for p in paths if p not in cuda_only], cuda_only


def want_cuda(torch_cuda_available_in_build, cuda_home):
    if _flag("DDTREE_FORCE_CPU"):
        return False
    if _flag("DDTREE_FORCE_CUDA"):
        if not torch_cuda_available_in_build:
            raise RuntimeError("DDTREE_FORCE_CUDA=1 but the installed torch was built without CUDA")
        if cuda_home is None:
            raise RuntimeError("DDTREE_FORCE_CUDA=1 but no CUDA toolkit was found (set CUDA_HOME)")
        return True
    return torch_cuda_available_in_build and cuda_home is not None


def cublaslt_link_args(cuda_home):
    """Linker flags for cuBLASLt (csrc/linear_cublaslt_cuda.cpp): the toolkit's libcublasLt.so, else the versioned
    library of the nvidia wheel that a pip-installed torch loads (no unversioned name there). At run time torch
    has already loaded that library, which satisfies the extension's dependency on its soname."""
    import torch

    site = Path(torch.__file__).resolve().parent.parent
    dirs = [Path(cuda_home) / d for d in ("lib64", "lib")] + sorted(Path(cuda_home).glob("targets/*/lib"))
    dirs += sorted((site / "nvidia").glob("*/lib"))
    for d in dirs:
        if (d / "libcublasLt.so").exists():
            return [f"-L{d}", "-lcublasLt"]
    major = (torch.version.cuda or "").split(".")[0]  # torch's own cuBLASLt, not another CUDA's wheel
    for d in dirs:
        versioned = sorted(d.glob(f"libcublasLt.so.{major}*"), key=lambda p: len(p.name))
        if major and versioned:
            return [f"-L{d}", f"-l:{versioned[0].name}"]
    raise RuntimeError(f"libcublasLt not found under {cuda_home} or {site / 'nvidia'} (needed by the CUDA build)")


def make_extension():
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    cpp_sources, cuda_sources = read_sources()
    use_cuda = want_cuda(torch.version.cuda is not None, CUDA_HOME)
    define = [("DDTREE_VERSION", f'"{VERSION}"')]
    # at::parallel_for is inline OpenMP in torch's headers: without -fopenmp the CPU ops run on one thread.
    # -ffp-contract=off: GCC's default fuses a product and a sum into one FMA where the target has one (aarch64,
    # -march=native), a rounding torch's separate operations don't have (the penalties must match them bit for bit).
    cxx_flags = ["-O3", "-fopenmp", "-ffp-contract=off"]
    link_flags = ["-fopenmp"]
    include_dirs = [str(ROOT / "csrc")]
    if use_cuda:
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or RELEASE_CUDA_ARCHS
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
        define += [("DDTREE_WITH_CUDA", None), ("DDTREE_CUDA_ARCHS", f'"{archs}"')]
        nvcc_flags = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
        ext = CUDAExtension(
            "ddtree_ext._C",
            sources=cpp_sources + cuda_sources,
            include_dirs=include_dirs,
            define_macros=define,
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
            extra_link_args=link_flags + cublaslt_link_args(CUDA_HOME),
        )
    else:
        ext = CppExtension(
            "ddtree_ext._C",
            sources=cpp_sources,
            include_dirs=include_dirs,
            define_macros=define,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
        )
    return ext, BuildExtension.with_options(use_ninja=True)


ext, build_ext = make_extension()

# Metadata, dependencies and extras live in pyproject.toml.
setup(
    packages=find_packages(include=["ddtree_ext", "ddtree_ext.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": build_ext},
)
