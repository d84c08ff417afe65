"""Loads the compiled core once. The package imports without it; an op call then says how to build it."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def load_extension():
    """The pybind11 module ``ddtree_ext._C`` (importing it registers ``torch.ops.ddtree``)."""
    try:
        from ddtree_ext import _C
    except ImportError as e:
        raise ImportError(
            "ddtree_ext: the compiled core ddtree_ext._C is not built. Install the package with "
            "`pip install --no-build-isolation -e .` (see README.md). Original error: " + str(e)
        ) from e
    from ddtree_ext import _fake  # noqa: F401  (fake kernels for torch.compile)

    return _C


def load_ops():
    """``torch.ops.ddtree``, after making sure the core is loaded."""
    load_extension()
    return torch.ops.ddtree


def build_info() -> dict:
    """How the core was built: version, whether CUDA kernels are in, CUDA version, arch list."""
    return dict(load_extension().build_info())
