"""Shared test helpers: tolerances in one place, output poisoning, random trees."""

from __future__ import annotations

import pytest
import torch

from ddtree_ext._loader import load_extension

# Register torch.ops.ddtree before any test calls an op directly (the package loads the core lazily).
load_extension()

# Relative tolerances (max abs error / max abs reference) per input dtype. float32 paths compute in
# float32 like the reference; bf16/fp16 inputs only change how inputs and outputs are rounded, so
# their bound is a few ulps of the output dtype.
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def built_for_hopper() -> bool:
    """Whether the core was built with code for compute capability 9.0 or more (its CUDA arch list)."""
    from ddtree_ext import build_info

    return any(float(a.split("+")[0].rstrip("a")) >= 9.0 for a in build_info()["cuda_archs"].split(";") if a)


def programmatic_launches() -> bool:
    """Whether the core's kernels launch as programmatic dependents on the current GPU, as the core decides it
    (ddtree_ext._C.programmatic_launches: cuda::launch_programmatic's rule). Only then does a captured graph have
    programmatic edges."""
    if not CUDA:
        return False
    from ddtree_ext import _C

    return _C.programmatic_launches(torch.cuda.current_device())


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|; inf when actual has a NaN/inf the reference lacks."""
    a, e = actual.double().cpu(), expected.double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    scale = e.abs().max().item() or 1.0
    return (a - e).abs().max().item() / scale


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, name: str = "") -> None:
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = rel_err(actual, expected)
    assert err <= RTOL[dtype], f"{name}: relative error {err:.3e} > {RTOL[dtype]:.1e} ({dtype})"


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with a value no op writes, so an unwritten element fails the comparison."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        # No bool poison exists: callers compare against both fills (see fill_both).
        return t.fill_(True)
    return t.fill_(-7777 if t.dtype != torch.uint8 else 77)


def random_parents(n: int, gen: torch.Generator, shape: str = "random", max_depth: int = 16) -> torch.Tensor:
    """parent [n] int32 in topological order: 'chain', 'star' or 'random' (depth capped at max_depth)."""
    parent = torch.full((n,), -1, dtype=torch.int32)
    depth = [0] * n
    for i in range(1, n):
        if shape == "chain":
            p = i - 1 if depth[i - 1] < max_depth else 0
        elif shape == "star":
            p = 0
        else:
            while True:
                p = int(torch.randint(0, i, (1,), generator=gen))
                if depth[p] < max_depth:
                    break
        parent[i], depth[i] = p, depth[p] + 1
    return parent


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Run the suite on one intra-op thread: the tiny models gain nothing from more, and on a busy
    2-core machine idle OpenMP threads spin (tiny-model calls ran up to 50x slower with two).
    Tests that exercise the ops' parallel loops ask for ``threads`` explicitly."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture
def threads():
    """Two intra-op threads for the duration of a test, so the ops' at::parallel_for loops really split."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(saved)


@pytest.fixture
def gen():
    g = torch.Generator().manual_seed(1234)
    return g
