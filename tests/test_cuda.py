"""The CUDA ops against the CPU ops and the reference, on the same inputs.

Integer outputs must be identical (torch.equal); float outputs agree within conftest.RTOL. Outputs are
poisoned before every run. Every op is also captured in a CUDA graph and replayed with new inputs,
and run twice to check determinism. Skipped as a whole without a CUDA device or a CUDA build.
"""

from __future__ import annotations

import functools
import math
import os
import re
from typing import Callable, Dict, List, NamedTuple

import pytest
import torch
import torch.nn.functional as F

from conftest import (RTOL, assert_close, built_for_hopper, inverse_cdf_probes, large_logit_rows, moe_case, penalty_case,
                      poison, programmatic_launches, random_parents, rel_err, requires_cuda, root_draws, tied_rows, warped_probs)
from ddtree_ext import build_info, ops, reference
from ddtree_ext.ops import GDNTreeOutput, TopK, Tree, Walk

pytestmark = requires_cuda

DEV = "cuda"
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def cuda_build():
    try:
        info = build_info()
    except ImportError as e:  # the compiled core is missing altogether
        pytest.skip(f"ddtree_ext._C is not built: {e}")
    if not info["cuda"]:
        pytest.skip("ddtree_ext._C was built without CUDA kernels")


def make_gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def to(x, device):
    """Moves a tensor, a NamedTuple of tensors or a list of tensors."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(to(t, device) for t in x))
    return [to(t, device) for t in x]


def poisoned(x):
    """Poisons every tensor of a NamedTuple of output buffers in place and returns it."""
    for t in x:
        poison(t)
    return x


def assert_fields_equal(actual, expected, what: str) -> None:
    for name, a, e in zip(type(expected)._fields, actual, expected):
        assert torch.equal(a.cpu(), e.cpu()), f"{what}: {name} differs"


def random_tree(bsz: int, n: int, gen: torch.Generator, shape: str = "random", max_depth: int = 16,
                vocab: int = 20) -> Tree:
    """Random trees with every node real; a small vocab makes siblings share tokens."""
    parent = torch.stack([random_parents(n, gen, shape, max_depth) for _ in range(bsz)])
    token = torch.randint(0, vocab, (bsz, n), generator=gen)
    prefix = torch.randint(0, 40, (bsz,), generator=gen)
    return reference.tree_from_parents(parent, token, prefix)


def random_paths(parent: torch.Tensor, max_accept: int, gen: torch.Generator):
    """accepted [B, D] int32 (root..node of a random node, cut at D, padded with -1), accept_len [B]."""
    bsz, n = parent.shape
    accepted = torch.full((bsz, max_accept), -1, dtype=torch.int32)
    accept_len = torch.empty(bsz, dtype=torch.int32)
    for b in range(bsz):
        path = reference.path_to(parent, b, int(torch.randint(0, n, (1,), generator=gen)))[:max_accept]
        accepted[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        accept_len[b] = len(path)
    return accepted, accept_len


def random_topk(bsz: int, depths: int, k: int, gen: torch.Generator, ties: bool):
    """Per-depth top-K as topk_logprobs returns it (descending log-probs); with ties, values on a coarse
    grid so that many prefix scores are equal and the tie order decides."""
    if ties:
        raw = -torch.randint(0, 4, (bsz, depths, k), generator=gen).float() * 0.5
    else:
        raw = -torch.rand(bsz, depths, k, generator=gen) * 6
    logp = raw.sort(dim=-1, descending=True).values
    tokens = torch.randint(0, 1000, (bsz, depths, k), generator=gen)
    return logp, tokens


# ---- build -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(
    "shape,k",
    [
        ((2, 3, 1000), 1),
        ((2, 3, 1000), 8),
        ((1, 4, 7), 7),
        ((3, 2, 4099), 16),
        ((1, 2, 5000), 32),
        ((2, 2, 3000), 40),  # above the register lists: sort-based
        ((1, 2, 60001), 8),  # rows split over several blocks (ties across segments with "ties")
    ],
)
@pytest.mark.parametrize("layout", ["contiguous", "ties", "unaligned"])
def test_topk_logprobs(dtype, shape, k, layout):
    gen = make_gen(11)
    bsz, depths, vocab = shape
    if layout == "ties":  # many equal logits: the lower token id must come first
        logits = torch.randint(-3, 3, shape, generator=gen).to(dtype)
    elif layout == "unaligned":  # rows start off 16-byte boundaries and have odd strides
        logits = torch.randn(bsz, depths, vocab + 3, generator=gen).to(dtype)[..., 1 : vocab + 1]
    else:
        logits = (torch.randn(shape, generator=gen) * 3).to(dtype)
    expected_cpu = ops.topk_logprobs(logits, k)
    expected_ref = reference.topk_logprobs(logits, k)
    out = poisoned(TopK(torch.empty(bsz, depths, k, device=DEV), torch.empty(bsz, depths, k, dtype=torch.long, device=DEV)))
    got = ops.topk_logprobs(logits.to(DEV), k, out=out)
    for expected in (expected_cpu, expected_ref):
        assert torch.equal(got.tokens.cpu(), expected.tokens)
        assert_close(got.logp, expected.logp, torch.float32, "logp")


def test_topk_logprobs_full_vocab():
    """The draft's real shape: 15 depths over Qwen3.6's 248320-token vocabulary."""
    gen = make_gen(12)
    logits = (torch.randn(1, 15, 248320, generator=gen) * 4).to(torch.bfloat16)
    for k in (8, 32):
        expected = ops.topk_logprobs(logits, k)
        got = ops.topk_logprobs(logits.to(DEV), k)
        assert torch.equal(got.tokens.cpu(), expected.tokens)
        assert_close(got.logp, expected.logp, torch.float32, "logp")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("k", [1, 8, 32, 40])
def test_topk_logprobs_nan_ranks_first(dtype, k):
    """NaN logits rank above every number, the lower id first (torch.sort's order, the CPU op's) and make their row's
    logp NaN: a row with fewer than k numbers still gives k ids of the row, never the lists' padding, and the tree
    built from them holds only ids of the vocabulary. A NaN's sign bit does not matter (CPU torch's float -> bfloat16
    conversion makes every NaN 0xffff, a negative NaN), and -0 ties +0. +inf (no NaN in its row) ranks first among
    the numbers, lower id first, and makes every logp of its row NaN (log_softmax's inf - inf), one +inf as several."""
    gen = make_gen(13 + k)
    vocab = 60001  # several segments per row
    wide = torch.randn(1, 10, vocab + 1, generator=gen) * 3
    logits = wide[..., 1:]  # rows start off 16-byte boundaries: element 0 is in the kernel's unaligned head
    logits[0, 0] = float("nan")
    logits[0, 1, [5, 700, 40000]] = float("nan")
    logits[0, 2] = -float("inf")  # fewer numbers than k: two NaNs, one number
    logits[0, 2, [9, 3]] = float("nan")
    logits[0, 2, 11] = 1.0
    logits[0, 3, vocab // 2 :] = -float("inf")  # a NaN in a part of the row that holds nothing else but -inf
    logits[0, 3, vocab - 2] = float("nan")
    logits[0, 4, 0] = float("nan")  # in the unaligned head
    logits[0, 5, vocab - 1] = float("nan")  # the row's last element
    logits[0, 7] = -float("inf")  # zeros of both signs tie, the lower id first
    logits[0, 7, [30, 10, 20, 5]] = torch.tensor([-0.0, -0.0, 0.0, 1.0])
    logits[0, 8, [50000, 100, 30000]] = float("inf")  # +inf in three segments: the chunk sums go NaN without a NaN
    logits[0, 9, 12345] = float("inf")  # one +inf (a single fp16 overflow, say)
    logits = logits.to(dtype)  # row 6: numbers only
    expected = ops.topk_logprobs(logits, k)
    got = ops.topk_logprobs(logits.to(DEV), k)
    assert torch.equal(got.tokens.cpu(), expected.tokens)
    assert torch.equal(reference.topk_logprobs(logits, k).tokens, expected.tokens)
    assert torch.equal(got.logp.isnan().cpu(), expected.logp.isnan())
    assert got.logp[0, :6].isnan().all() and not got.logp[0, 6:8].isnan().any()
    assert expected.tokens[0, 8, : min(k, 3)].tolist() == [100, 30000, 50000][:k]
    assert expected.tokens[0, 9, 0] == 12345 and got.logp[0, 8:].isnan().all()
    assert_close(got.logp[0, 6].cpu(), expected.logp[0, 6], torch.float32, "logp of the row of numbers")
    finite = expected.logp[0, 7].isfinite()  # past the four numbers: -inf
    assert torch.equal(got.logp[0, 7].isfinite().cpu(), finite)
    assert_close(got.logp[0, 7].cpu()[finite], expected.logp[0, 7][finite], torch.float32, "logp of the zeros' row")
    assert expected.tokens[0, 7, : min(k, 4)].tolist() == [5, 10, 20, 30][:k]
    tree = ops.build_tree(got.logp, got.tokens, torch.zeros(1, dtype=torch.long, device=DEV),
                          torch.zeros(1, dtype=torch.long, device=DEV), 64)
    real = tree.token[0, : int(tree.num_nodes[0])]
    assert ((real >= 0) & (real < vocab)).all(), "a tree node holds an id outside the vocabulary"


BUILD_CASES = [  # (batch, budget, depths, k)
    (1, 1, 4, 3),
    (2, 5, 3, 2),
    (3, 16, 15, 8),
    (2, 64, 15, 8),
    (2, 128, 16, 8),
    (1, 256, 15, 8),
    (2, 64, 4, 1),  # K = 1: the prefixes run out, the rest is padding
    (2, 40, 3, 3),  # 3 + 9 + 27 = 39 prefixes < 40
    (1, 256, 16, 256),  # pure best-first with K = budget
    (2, 32, 3, 5000),  # logp too large to stage in shared memory
    (1, 512, 16, 64),  # the register lists' largest budget: 16 candidates a lane
    (1, 600, 5, 8),  # above the register lists' budget: candidates in shared-memory slots
]


@pytest.mark.parametrize("spine", [True, False])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("bsz,budget,depths,k", BUILD_CASES)
def test_build_tree(bsz, budget, depths, k, spine, ties):
    gen = make_gen(budget * 31 + depths)
    logp, tokens = random_topk(bsz, depths, k, gen, ties)
    root = torch.randint(0, 1000, (bsz,), generator=gen)
    prefix = torch.randint(0, 500, (bsz,), generator=gen)
    expected_ref = reference.build_tree(logp, tokens, root, prefix, budget, spine=spine)
    expected_cpu = ops.build_tree(logp, tokens, root, prefix, budget, spine=spine)
    out = poisoned(ops.empty_tree(bsz, budget, DEV))
    got = ops.build_tree(*to([logp, tokens, root, prefix], DEV), budget, spine=spine, out=out)
    assert_fields_equal(got, expected_cpu, "vs CPU op")
    assert_fields_equal(got, expected_ref, "vs reference")


@pytest.mark.parametrize("spine", [True, False])
@pytest.mark.parametrize("budget", [7, 64, 513])
def test_build_tree_infinite_logp(budget, spine):
    """-inf log-probs (a draft distribution with fewer than K tokens of nonzero mass) and -0: -inf scores are real
    candidates, equal to each other, so the tie order decides among them (register lists and shared-memory slots)."""
    gen = make_gen(budget + 11)
    bsz, depths, k = 2, 12, 6
    logp, tokens = random_topk(bsz, depths, k, gen, ties=True)
    logp[:, ::2, 3:] = -float("inf")
    logp[1, :, 0] = -0.0
    root = torch.randint(0, 1000, (bsz,), generator=gen)
    prefix = torch.randint(0, 500, (bsz,), generator=gen)
    expected_ref = reference.build_tree(logp, tokens, root, prefix, budget, spine=spine)
    expected_cpu = ops.build_tree(logp, tokens, root, prefix, budget, spine=spine)
    got = ops.build_tree(*to([logp, tokens, root, prefix], DEV), budget, spine=spine)
    assert_fields_equal(expected_cpu, expected_ref, "CPU op vs reference")
    assert_fields_equal(got, expected_cpu, "vs CPU op")


@pytest.mark.parametrize("spine", [True, False])
@pytest.mark.parametrize("budget", [7, 64, 200, 513])
def test_build_tree_unsorted(budget, spine):
    """Log-probs in no order and of either sign (children can outscore parents): the pops must still be
    the reference's, node for node."""
    gen = make_gen(budget + 5)
    bsz, depths, k = 3, 9, 6
    logp = torch.randn(bsz, depths, k, generator=gen) * 2
    logp[1] = logp[1].round()  # ties
    tokens = torch.randint(0, 1000, (bsz, depths, k), generator=gen)
    root = torch.randint(0, 1000, (bsz,), generator=gen)
    prefix = torch.randint(0, 500, (bsz,), generator=gen)
    expected = ops.build_tree(logp, tokens, root, prefix, budget, spine=spine)
    got = ops.build_tree(*to([logp, tokens, root, prefix], DEV), budget, spine=spine)
    assert_fields_equal(got, expected, "vs CPU op")


@pytest.mark.parametrize("dtype", [torch.bool, *FLOAT_DTYPES])
@pytest.mark.parametrize("n,strided", [(17, False), (65, True), (130, False), (257, True)])
def test_tree_attention_mask(dtype, n, strided):
    gen = make_gen(n)
    tree = random_tree(2, n, gen)
    prefix = torch.tensor([0, 37])
    kv_len = int(prefix.max()) + n + 9
    expected_ref = reference.tree_attention_mask(tree.ancestor_mask, prefix, kv_len, dtype=dtype)
    expected_cpu = ops.tree_attention_mask(tree.ancestor_mask, prefix, kv_len, dtype=dtype)
    assert torch.equal(expected_cpu, expected_ref)
    # bool has no poison value: fill with True, then with False; both runs must overwrite everything.
    fills = [True, False] if dtype == torch.bool else [float("nan")]
    for fill in fills:
        if strided:  # a window of a larger static buffer
            big = torch.full((2, 1, n + 3, kv_len + 21), fill, dtype=dtype, device=DEV)
            out = big[:, :, 1 : n + 1, 5 : 5 + kv_len]
        else:
            out = torch.full((2, 1, n, kv_len), fill, dtype=dtype, device=DEV)
        got = ops.tree_attention_mask(tree.ancestor_mask.to(DEV), prefix.to(DEV), out=out)
        assert torch.equal(got.cpu(), expected_ref)
        if strided:  # rows and columns outside the view keep the fill
            outside = torch.cat([big[:, :, 0].flatten(), big[:, :, n + 1 :].flatten(), big[..., :5].flatten()])
            assert (outside.isnan().all() if dtype.is_floating_point else (outside == fill).all()), "wrote outside the view"


# ---- verify: conv ----------------------------------------------------------------------------


def conv_inputs(bsz, n, channels, width, state_len, dtype, gen, shape="random", bias=True):
    parent = torch.stack([random_parents(n, gen, shape) for _ in range(bsz)])
    x = torch.randn(bsz, n, channels, generator=gen).to(dtype)
    weight = (torch.randn(channels, width, generator=gen) * 0.5).to(dtype)
    b = (torch.randn(channels, generator=gen) * 0.1).to(dtype) if bias else None
    conv_state = torch.randn(bsz, channels, state_len, generator=gen).to(dtype)
    return x, weight, b, conv_state, parent


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("width,state_len", [(4, 3), (4, 4), (3, 5), (2, 1)])
@pytest.mark.parametrize("channels", [64, 7])
@pytest.mark.parametrize("shape", ["random", "chain", "star"])
@pytest.mark.parametrize("bias,silu", [(True, True), (False, False)])
def test_tree_conv1d(dtype, width, state_len, channels, shape, bias, silu):
    gen = make_gen(width * 100 + channels)
    x, weight, b, conv_state, parent = conv_inputs(2, 17, channels, width, state_len, dtype, gen, shape, bias)
    expected_ref = reference.tree_conv1d(x, weight, b, conv_state, parent, silu=silu)
    expected_cpu = ops.tree_conv1d(x, weight, b, conv_state, parent, silu=silu)
    out = poison(torch.empty(x.shape, dtype=dtype, device=DEV))
    got = ops.tree_conv1d(*to([x, weight], DEV), None if b is None else b.to(DEV), *to([conv_state, parent], DEV),
                          silu=silu, out=out)
    # bf16/fp16: identical inputs and float32 accumulation on both sides; only the final rounding to
    # the output dtype can differ (<= 1 ulp), which RTOL[dtype] covers.
    assert_close(got, expected_cpu, dtype, "vs CPU op")
    assert_close(got, expected_ref, dtype, "vs reference")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_tree_conv1d_silu_is_torchs_silu_of_the_rounded_conv(dtype):
    """The fused activation gives the bits of HF's torch path on CUDA: the conv in the model dtype, then F.silu."""
    gen = make_gen(91)
    x, weight, b, conv_state, parent = to(conv_inputs(2, 65, 10240 // 8, 4, 3, dtype, gen, "random", True), DEV)
    fused = ops.tree_conv1d(x, weight, b, conv_state, parent, silu=True)
    two_steps = torch.nn.functional.silu(ops.tree_conv1d(x, weight, b, conv_state, parent, silu=False))
    assert torch.equal(fused, two_steps)


def test_tree_conv1d_strided_input():
    """x a slice of a wider projection output (rows 16-byte aligned, and not)."""
    gen = make_gen(5)
    _, weight, b, conv_state, parent = conv_inputs(2, 17, 64, 4, 3, torch.float32, gen)
    x_full = torch.randn(2, 17, 96, generator=gen)
    for start in (16, 3):
        x = x_full[:, :, start : start + 64]
        expected = ops.tree_conv1d(x, weight, b, conv_state, parent)
        got = ops.tree_conv1d(x_full.to(DEV)[:, :, start : start + 64], *to([weight, b, conv_state, parent], DEV),
                              out=poison(torch.empty(2, 17, 64, device=DEV)))
        assert_close(got, expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("budget", [16, 64, 256])
def test_tree_conv1d_qwen36_shape(dtype, budget):
    """Qwen3.6-27B: conv_dim 10240, kernel 4, conv_state of 4 columns."""
    gen = make_gen(budget)
    x, weight, b, conv_state, parent = conv_inputs(1, budget + 1, 10240, 4, 4, dtype, gen, bias=False)
    expected = ops.tree_conv1d(x, weight, None, conv_state, parent)
    got = ops.tree_conv1d(*to([x, weight], DEV), None, *to([conv_state, parent], DEV))
    assert_close(got, expected, dtype)


# ---- verify: gated delta rule ----------------------------------------------------------------


class GDNInputs(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    state: torch.Tensor
    parent: torch.Tensor


def gdn_inputs(bsz, n, heads, value_heads, kdim, vdim, dtype, gen, shape="random", max_depth=16) -> GDNInputs:
    parent = torch.stack([random_parents(n, gen, shape, max_depth) for _ in range(bsz)])
    return GDNInputs(
        q=torch.randn(bsz, n, heads, kdim, generator=gen).to(dtype),
        k=torch.randn(bsz, n, heads, kdim, generator=gen).to(dtype),
        v=torch.randn(bsz, n, value_heads, vdim, generator=gen).to(dtype),
        # log decays as GDN makes them: -exp(A_log) * softplus(.), mostly in [-3, 0]
        g=-torch.rand(bsz, n, value_heads, generator=gen).exp() * F.softplus(torch.randn(bsz, n, value_heads, generator=gen)),
        beta=torch.sigmoid(torch.randn(bsz, n, value_heads, generator=gen)),
        state=torch.randn(bsz, value_heads, kdim, vdim, generator=gen) * 0.3,
        parent=parent,
    )


def _fla_ops():
    """fla's (chunk, fused_recurrent) gated delta rule kernels, or skip the calling test."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as e:  # not installed, or its Triton stack does not load here
        pytest.skip(f"flash-linear-attention is not importable: {e}")
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def gdn_recurrence_fp64(x: GDNInputs, scale: float, l2norm: bool = True):
    """The recurrence run separately along every root-to-node path in float64 on the device:
    (out, stash_u, stash_k, stash_cumg) in float64. An independent high-precision truth."""
    d = torch.float64
    q, k, v, g, beta, state = (t.to(DEV, d) for t in x[:6])
    parent = x.parent
    bsz, n, heads, kdim = k.shape
    value_heads = v.shape[2]
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + reference.L2NORM_EPS)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + reference.L2NORM_EPS)
    stash_k = k.clone()
    q = q * scale
    group = value_heads // heads
    qv, kv = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    node_state = torch.empty(bsz, n, value_heads, kdim, v.shape[3], dtype=d, device=DEV)
    out = torch.empty_like(v)
    stash_u = torch.empty_like(v)
    cumg = torch.empty_like(g)
    for b in range(bsz):
        for i in range(n):
            p = int(parent[b, i])
            s = (state[b] if p < 0 else node_state[b, p]) * g[b, i].exp()[:, None, None]
            u = beta[b, i][:, None] * (v[b, i] - torch.einsum("hkv,hk->hv", s, kv[b, i]))
            s = s + kv[b, i][:, :, None] * u[:, None, :]
            node_state[b, i] = s
            out[b, i] = torch.einsum("hkv,hk->hv", s, qv[b, i])
            stash_u[b, i] = u
            cumg[b, i] = g[b, i] + (cumg[b, p] if p >= 0 else 0)
    return out, stash_u, stash_k, cumg


def run_gdn(x: GDNInputs, device, scale=None, l2norm=True) -> GDNTreeOutput:
    xs = to(list(x), device)
    bsz, n, heads, kdim = x.k.shape
    value_heads, vdim = x.v.shape[2], x.v.shape[3]
    out = poisoned(GDNTreeOutput(
        torch.empty(bsz, n, value_heads, vdim, dtype=x.v.dtype, device=device),
        torch.empty(bsz, n, value_heads, vdim, device=device),
        torch.empty(bsz, n, heads, kdim, device=device),
        torch.empty(bsz, n, value_heads, device=device),
    ))
    return ops.tree_gated_delta_rule(*xs, scale=scale, use_qk_l2norm=l2norm, out=out)


def assert_gdn_close(got: GDNTreeOutput, expected, dtype, what: str):
    # out is in the input dtype; the stash is float32 on both sides. bf16/fp16 inputs reach both
    # implementations as the same values and the math is float32, so only the rounding of out to the
    # input dtype differs (<= 1 ulp): RTOL[dtype] for out, the float32 bound for the stash.
    assert_close(got.out, expected[0], dtype, f"{what}: out")
    for name, a, e in zip(("stash_u", "stash_k", "stash_cumg"), got[1:], expected[1:]):
        assert_close(a, e, torch.float32, f"{what}: {name}")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", ["random", "chain", "star"])
@pytest.mark.parametrize(
    "bsz,n,heads,value_heads,kdim,vdim",
    [
        (2, 17, 2, 4, 16, 8),
        (1, 33, 1, 3, 32, 40),
        # The main kernel stages k/q rows in chunks of 72 nodes: N = 80 and 129 take two. K = 100 is a whole
        # number of 16-byte packs in float32 but not in 16-bit types (rows staged element by element); K = 30 is
        # not a multiple of 4 (the GEMM's depth is padded with zeros).
        (2, 80, 1, 2, 100, 33),
        (1, 129, 2, 4, 30, 40),
        # Four value heads per key head: the 16-bit prep kernel solves them in two batches (3 + 1).
        (1, 40, 2, 8, 64, 32),
    ],
)
def test_tree_gated_delta_rule(dtype, shape, bsz, n, heads, value_heads, kdim, vdim):
    gen = make_gen(n + kdim)
    x = gdn_inputs(bsz, n, heads, value_heads, kdim, vdim, dtype, gen, shape)
    got = run_gdn(x, DEV)
    assert_gdn_close(got, run_gdn(x, "cpu"), dtype, "vs CPU op")
    assert_gdn_close(got, reference.tree_gated_delta_rule(*x), dtype, "vs reference")
    assert_gdn_close(got, gdn_recurrence_fp64(x, kdim**-0.5), dtype, "vs float64 recurrence")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_tree_gated_delta_rule_options(dtype):
    """No l2norm (keys small enough to stay stable) and an explicit scale; 16-bit inputs take the tensor-core
    prep kernel, whose norms are then 1 and whose query factor is the scale alone."""
    gen = make_gen(3)
    x = gdn_inputs(2, 17, 2, 4, 16, 16, torch.float32, gen)
    x = x._replace(q=(x.q * 0.2).to(dtype), k=(x.k * 0.2).to(dtype), v=x.v.to(dtype))
    got = run_gdn(x, DEV, scale=0.37, l2norm=False)
    assert_gdn_close(got, run_gdn(x, "cpu", scale=0.37, l2norm=False), dtype, "vs CPU op")
    assert_gdn_close(got, gdn_recurrence_fp64(x, 0.37, l2norm=False), dtype, "vs float64 recurrence")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("bsz,heads,value_heads,kdim,vdim", [(2, 2, 4, 16, 8), (1, 1, 3, 32, 40), (1, 16, 48, 128, 128)])
def test_tree_gated_delta_rule_single_node(dtype, l2norm, bsz, heads, value_heads, kdim, vdim):
    """A one-node tree (an autoregressive step) has its own kernel: against the CPU op and the float64
    recurrence, with and without l2norm, V not a multiple of the 32-column tile, batches."""
    gen = make_gen(kdim + vdim + l2norm)
    x = gdn_inputs(bsz, 1, heads, value_heads, kdim, vdim, dtype, gen)
    if not l2norm:
        x = x._replace(q=x.q * 0.2, k=x.k * 0.2)
    scale = None if l2norm else 0.37
    got = run_gdn(x, DEV, scale=scale, l2norm=l2norm)
    assert_gdn_close(got, run_gdn(x, "cpu", scale=scale, l2norm=l2norm), dtype, "vs CPU op")
    assert_gdn_close(got, gdn_recurrence_fp64(x, scale or kdim**-0.5, l2norm=l2norm), dtype, "vs float64 recurrence")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(
    "n,heads,value_heads,kdim,vdim,width,state_len,bias",
    [
        (1, 2, 4, 16, 8, 4, 3, True),
        (1, 1, 3, 32, 40, 3, 5, False),  # V not a multiple of the 32-column tile, a longer state
        (1, 16, 48, 128, 128, 4, 4, True),  # Qwen3.6-27B's GDN layer
        (1, 2, 2, 160, 33, 2, 1, True),  # 2 K channels of q and k past one a thread
        (1, 2, 4, 16, 8, 1, 0, True),  # W = 1: no committed input read, an empty state
        (17, 2, 4, 16, 8, 4, 3, True),  # a tree: the conv, then the tree kernels
        (65, 16, 48, 128, 128, 4, 4, True),  # Qwen3.6-27B's GDN layer, a budget-64 tree
        (96, 2, 4, 16, 32, 3, 5, False),  # two of the main kernel's 72-node chunks
        (33, 2, 4, 16, 32, 1, 0, True),  # W = 1, an empty state
    ],
)
@pytest.mark.parametrize("l2norm,scale", [(True, None), (False, 0.37)])
def test_gdn_conv_delta_rule_is_the_two_ops(dtype, n, heads, value_heads, kdim, vdim, width, state_len, bias, l2norm,
                                            scale):
    """gdn_conv_delta_rule on CUDA has the bits of tree_conv1d (SiLU) then tree_gated_delta_rule on CUDA, x a column
    slice of a wider projection output, with and without the q/k l2 norm; a single node runs one kernel (no conv
    kernel), a tree the two ops'."""
    gen = make_gen(n + kdim + vdim + width)
    channels = 2 * heads * kdim + value_heads * vdim
    x_wide = (torch.randn(2, n, channels + 8, generator=gen) * (1.0 if l2norm else 0.2)).to(dtype).to(DEV)
    x = x_wide[..., 8:]
    weight = (torch.randn(channels, width, generator=gen) * 0.5).to(dtype).to(DEV)
    b = (torch.randn(channels, generator=gen) * 0.1).to(dtype).to(DEV) if bias else None
    conv_state = torch.randn(2, channels, state_len, generator=gen).to(dtype).to(DEV)
    parent = torch.stack([random_parents(n, gen, "random") for _ in range(2)]).to(DEV)
    g = (-torch.rand(2, n, value_heads, generator=gen).exp()).to(DEV)
    beta = torch.sigmoid(torch.randn(2, n, value_heads, generator=gen)).to(DEV)
    state = (torch.randn(2, value_heads, kdim, vdim, generator=gen) * 0.3).to(DEV)

    def outputs():
        return poisoned(GDNTreeOutput(
            torch.empty(2, n, value_heads, vdim, dtype=dtype, device=DEV),
            torch.empty(2, n, value_heads, vdim, device=DEV),
            torch.empty(2, n, heads, kdim, device=DEV),
            torch.empty(2, n, value_heads, device=DEV),
        ))

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = ops.gdn_conv_delta_rule(x, weight, b, conv_state, g, beta, state, parent, num_heads=heads,
                                      head_k_dim=kdim, head_v_dim=vdim, scale=scale, use_qk_l2norm=l2norm,
                                      out=outputs())
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("tree_conv1d_kernel" in k for k in kernels) == (n > 1), kernels
    y = ops.tree_conv1d(x, weight, b, conv_state, parent, silu=True)
    q, k, v = torch.split(y, [heads * kdim, heads * kdim, value_heads * vdim], dim=-1)
    apart = ops.tree_gated_delta_rule(q.unflatten(-1, (heads, kdim)), k.unflatten(-1, (heads, kdim)),
                                      v.unflatten(-1, (value_heads, vdim)), g, beta, state, parent, scale=scale,
                                      use_qk_l2norm=l2norm, out=outputs())
    for name, a, e in zip(GDNTreeOutput._fields, got, apart):
        assert torch.equal(a, e), name
    cpu = ops.gdn_conv_delta_rule(x.cpu(), weight.cpu(), None if b is None else b.cpu(), conv_state.cpu(), g.cpu(),
                                  beta.cpu(), state.cpu(), parent.cpu(), num_heads=heads, head_k_dim=kdim,
                                  head_v_dim=vdim, scale=scale, use_qk_l2norm=l2norm)
    assert_gdn_close(got, cpu, dtype, "vs CPU op")


@pytest.mark.parametrize("dtype,n", [(torch.float32, 48), (torch.bfloat16, 100), (torch.bfloat16, 64), (torch.float16, 96)])
def test_tree_gated_delta_rule_deep_chain(dtype, n):
    """Paths longer than the 17 ancestor distances the kernels keep in shared memory (and than a warp): the
    general path-row solve, dot products recomputed, path sums walked past the cached terms; at N = 100 also
    over two of the main kernel's 72-node chunks. 16-bit inputs with N <= 96 take the tensor-core prep kernel,
    whose solves then run over two and three blocks of 32 path entries."""
    gen = make_gen(4)
    x = gdn_inputs(1, n, 2, 2, 32, 32, dtype, gen, shape="chain", max_depth=n)
    got = run_gdn(x, DEV)
    assert_gdn_close(got, run_gdn(x, "cpu"), dtype, "vs CPU op")
    assert_gdn_close(got, gdn_recurrence_fp64(x, 32**-0.5), dtype, "vs float64 recurrence")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("budget", [16, 64, 256])
def test_tree_gated_delta_rule_qwen36_shape(dtype, budget):
    """Qwen3.6-27B: 16 key heads, 48 value heads, K = V = 128."""
    gen = make_gen(budget + 1)
    x = gdn_inputs(1, budget + 1, 16, 48, 128, 128, dtype, gen)
    got = run_gdn(x, DEV)
    assert_gdn_close(got, run_gdn(x, "cpu"), dtype, "vs CPU op")
    assert_gdn_close(got, gdn_recurrence_fp64(x, 128**-0.5), dtype, "vs float64 recurrence")


@pytest.mark.parametrize("kernel", ["fused_recurrent", "chunk"])
def test_tree_gated_delta_rule_chain_matches_fla(kernel):
    """On a chain the tree op is the ordinary recurrence; the committed state after the whole chain
    must match fla's final state too."""
    chunk, fused = _fla_ops()
    gen = make_gen(8)
    dtype = torch.float32 if kernel == "fused_recurrent" else torch.bfloat16
    n, heads, value_heads = 16, 2, 6
    x = gdn_inputs(2, n, heads, value_heads, 64, 64, dtype, gen, shape="chain", max_depth=100)
    got = run_gdn(x, DEV)
    group = value_heads // heads
    q, k = (t.to(DEV).repeat_interleave(group, dim=2) for t in (x.q, x.k))
    fn = fused if kernel == "fused_recurrent" else chunk
    o, final = fn(q=q, k=k, v=x.v.to(DEV), g=x.g.to(DEV), beta=x.beta.to(DEV), scale=64**-0.5,
                  initial_state=x.state.to(DEV), output_final_state=True, use_qk_l2norm_in_kernel=True)
    # fla's chunk kernel multiplies in bf16/tf32 on the tensor cores: its own error is ~1e-3.
    tol = RTOL[torch.float32] * 10 if kernel == "fused_recurrent" else RTOL[torch.bfloat16]
    assert rel_err(got.out, o) <= tol
    states = [x.state.to(DEV).clone()]
    accepted = torch.arange(n, dtype=torch.int32, device=DEV).expand(2, n).contiguous()
    accept_len = torch.full((2,), n, dtype=torch.int32, device=DEV)
    ops.commit_gdn_state(states, [got.stash_u], [got.stash_k], [got.stash_cumg], accepted, accept_len)
    assert rel_err(states[0], final) <= tol


# ---- penalize ------------------------------------------------------------------------------------

# (repetition_penalty, presence_penalty, frequency_penalty, seen given, counts given). For 1.1 and 1.05 the float32
# reciprocal of float32(r) is not float32(1 / r): torch's CUDA division by a Python number takes the latter.
PENALTY_SETTINGS = [(1.1, 0.0, 0.0, True, False), (1.0, 0.5, 0.2, False, True), (0.7, -1.5, 0.3, True, True),
                    (1.05, 2.0, -2.0, True, True), (1.3, 0.4, 0.1, True, True)]


def run_penalize(tree, logits, seen, counts, setting, device, max_depth=None, fn=None):
    repetition, presence, frequency, use_seen, use_counts = setting
    kw = dict(seen=seen.to(device) if use_seen else None, counts=counts.to(device) if use_counts else None,
              repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency, max_depth=max_depth)
    if fn is not None:
        return fn(to(tree, device), logits.to(device), **kw)
    out = poison(torch.empty(logits.shape, dtype=torch.float32, device=device))
    return ops.penalize_logits(to(tree, device), logits.to(device), out=out, **kw)


def assert_bits_equal(got, want, what=""):
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape, what
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), what


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("vocab", [13, 64, 1002, 1000])  # odd widths take the one-element path, others 4-element packs
@pytest.mark.parametrize("setting", PENALTY_SETTINGS, ids=lambda s: "-".join(map(str, s)))
def test_penalize_logits(dtype, vocab, setting):
    """Bit for bit the reference's torch operations run on the GPU (torch's CUDA division by a Python number
    included), over random trees with repeated tokens on paths, max_depth cuts, strided node rows, and tables with
    a sink column (generate's)."""
    gen = make_gen(vocab + 7 * PENALTY_SETTINGS.index(setting))
    tree, logits, seen, counts = penalty_case(3, 23, vocab, gen, dtype)
    for max_depth in (None, 1, 4):
        want = run_penalize(tree, logits, seen, counts, setting, DEV, max_depth, fn=reference.penalize_logits)
        assert_bits_equal(run_penalize(tree, logits, seen, counts, setting, DEV, max_depth), want, f"depth {max_depth}")
    want = run_penalize(tree, logits, seen, counts, setting, DEV, fn=reference.penalize_logits)
    wide = torch.zeros(3, 46, vocab + 1, dtype=dtype, device=DEV)
    wide[:, ::2, 1:] = logits.to(DEV)
    sink = lambda t: torch.cat([t, t[:, :1]], 1).to(DEV)[:, :vocab]  # noqa: E731
    assert_bits_equal(run_penalize(tree, wide[:, ::2, 1:], sink(seen), sink(counts), setting, DEV), want, "views")
    shifted = lambda t: torch.cat([t[:, :1], t], 1).to(DEV)[:, 1:]  # noqa: E731  (rows one element off 16 bytes)
    assert_bits_equal(run_penalize(tree, logits, shifted(seen), shifted(counts), setting, DEV), want, "shifted tables")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_penalize_logits_real_shape_and_graph_replay(dtype):
    """A budget-64 tree from build_tree over Qwen3.6's vocabulary with generate's [1, V + 1] tables; then the op
    captured in a CUDA graph and replayed on new tokens, counts and logits written into the captured inputs."""
    gen = make_gen(64)
    vocab, setting = 248320, (1.1, 0.5, 0.1, True, True)
    logp = (-torch.rand(1, 16, 8, generator=gen) * 4).sort(-1, descending=True).values
    tokens = torch.randint(0, 64, (1, 16, 8), generator=gen)  # few distinct tokens: repeats on paths
    tree = ops.build_tree(*to([logp, tokens, torch.tensor([3]), torch.tensor([100])], DEV), 64)
    logits = (torch.randn(1, 65, vocab, generator=gen) * 3).to(dtype).to(DEV)
    seen = torch.zeros(1, vocab + 1, dtype=torch.bool, device=DEV)
    seen[0, torch.randint(0, vocab, (3000,), generator=gen).to(DEV)] = True
    counts = torch.zeros(1, vocab + 1, device=DEV)
    counts[0, :64] = torch.randint(0, 3, (64,), generator=gen).float().to(DEV)
    args = (tree, logits, seen[:, :vocab], counts[:, :vocab], setting, DEV)
    assert_bits_equal(run_penalize(*args, max_depth=17), run_penalize(*args, max_depth=17, fn=reference.penalize_logits))
    out = torch.empty(1, 65, vocab, device=DEV)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.penalize_logits(tree, logits, seen=seen[:, :vocab], counts=counts[:, :vocab], repetition_penalty=1.1,
                            presence_penalty=0.5, frequency_penalty=0.1, max_depth=17, out=out)
    for _ in range(2):
        tree.token.copy_(torch.randint(0, 64, tree.token.shape, generator=gen).to(DEV))
        counts[0, :64] += 1
        logits.copy_((torch.randn(1, 65, vocab, generator=gen) * 3).to(dtype))
        poison(out)
        graph.replay()
        assert_bits_equal(out, run_penalize(*args, max_depth=17, fn=reference.penalize_logits), "replay")


def test_penalize_logits_more_rows_than_a_grid_dimension():
    """B * N > 65535 node rows (the rows kernel loops over grid.y): the CPU op's values (a penalty of 2, whose
    reciprocal is exact, so both devices' divisions agree)."""
    gen = make_gen(8)
    tree, logits, seen, counts = penalty_case(260, 257, 8, gen, torch.bfloat16)
    setting = (2.0, 0.5, 0.25, True, True)
    assert_bits_equal(run_penalize(tree, logits, seen, counts, setting, DEV, max_depth=5).cpu(),
                      run_penalize(tree, logits, seen, counts, setting, "cpu", max_depth=5))


def test_penalize_logits_bad_input_writes_nothing():
    """A table on another device, and paths longer than shared memory holds: a ValueError before any launch."""
    gen = make_gen(3)
    tree, logits, seen, counts = to(penalty_case(2, 9, 12, gen), DEV)
    out = poison(torch.empty(logits.shape, device=DEV))
    before = out.clone()
    with pytest.raises(ValueError, match="penalize_logits: seen must be on cuda"):
        ops.penalize_logits(tree, logits, seen=seen.cpu(), counts=counts, out=out)
    n = 70000  # max_depth = N: paths of up to 69999 nodes, more int32 than a block's shared memory
    big = Tree(torch.zeros(1, n, dtype=torch.int64, device=DEV), torch.full((1, n), -1, dtype=torch.int32, device=DEV),
               *[None] * 6)  # the op reads the tokens and parents only
    big_out = poison(torch.empty(1, n, 4, device=DEV))
    big_before = big_out.clone()
    with pytest.raises(ValueError, match="penalize_logits: max_depth must keep paths within"):
        ops.penalize_logits(big, torch.zeros(1, n, 4, device=DEV), counts=torch.zeros(1, 4, device=DEV), out=big_out)
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int32), before.view(torch.int32))
    assert torch.equal(big_out.view(torch.int32), big_before.view(torch.int32))


def test_penalize_logits_garbage_trees_stay_in_bounds():
    """Parents that are not topological and tokens outside [0, V) (the CPU op refuses them; CUDA cannot read them
    back): a node with an invalid parent counts as a root, an out-of-range token is skipped, nothing is read or
    written out of bounds, and a node whose path is valid gets its penalties right."""
    gen = make_gen(5)
    tree, logits, seen, counts = penalty_case(2, 9, 20, gen)
    setting = (1.3, 0.5, 0.25, True, True)
    want = run_penalize(tree, logits, seen, counts, setting, DEV, fn=reference.penalize_logits)
    tables_only = run_penalize(tree, logits, seen, counts, setting, DEV, max_depth=1, fn=reference.penalize_logits)
    parent, token = tree.parent.clone(), tree.token.clone()
    leaves = [[i for i in range(1, 9) if (tree.parent[b] == i).sum() == 0] for b in range(2)]
    parent[0, 0] = 5  # the root's parent: later than the root
    parent[0, leaves[0][-1]] = leaves[0][-1]  # a leaf its own parent: a root, its path empty
    token[1, leaves[1][0]] = -3
    token[1, leaves[1][-1]] = 10**9
    got = run_penalize(tree._replace(parent=parent, token=token), logits, seen, counts, setting, DEV)
    torch.cuda.synchronize()
    rows_ok = [i for i in range(9) if i != leaves[0][-1]]
    assert_bits_equal(got[0, rows_ok], want[0, rows_ok], "the root's parent ignored")
    assert_bits_equal(got[0, leaves[0][-1]], tables_only[0, leaves[0][-1]], "a leaf that is its own parent")
    rows_ok = [i for i in range(9) if i not in (leaves[1][0], leaves[1][-1])]
    assert_bits_equal(got[1, rows_ok], want[1, rows_ok], "nodes off the bad tokens' paths")
    assert torch.isfinite(got).all()


# ---- walk --------------------------------------------------------------------------------------


def walk_targets(tree: Tree, gen: torch.Generator, follow: float = 0.8) -> torch.Tensor:
    """target_token [B, N]: at each node, with probability `follow` the token of a random child (so
    walks go deep), else a random token."""
    bsz, n = tree.token.shape
    target = torch.randint(0, 20, (bsz, n), generator=gen)
    for b in range(bsz):
        for i in range(n):
            kids = reference.children(tree, b, i)
            if kids and float(torch.rand(1, generator=gen)) < follow:
                target[b, i] = tree.token[b, kids[int(torch.randint(0, len(kids), (1,), generator=gen))]]
    return target


def built_tree(bsz, budget, gen, k=4, depths=6, spine=True) -> Tree:
    """A tree as the pipeline makes it (with padding nodes when K ** depth runs out), small tokens."""
    logp, _ = random_topk(bsz, depths, k, gen, ties=False)
    tokens = torch.randint(0, 6, (bsz, depths, k), generator=gen)
    root = torch.randint(0, 6, (bsz,), generator=gen)
    return reference.build_tree(logp, tokens, root, torch.zeros(bsz, dtype=torch.long), budget, spine=spine)


def run_walk_greedy(tree, target, max_accept, device) -> Walk:
    out = poisoned(ops.empty_walk(tree.token.shape[0], max_accept, device))
    return ops.walk_greedy(to(tree, device), target.to(device), max_accept, out=out)


@pytest.mark.parametrize("max_accept", [1, 3, 17])
@pytest.mark.parametrize("kind", ["random", "chain", "star", "built", "built_padded"])
def test_walk_greedy(kind, max_accept):
    gen = make_gen(max_accept)
    if kind == "built":
        tree = built_tree(3, 64, gen)
    elif kind == "built_padded":
        tree = built_tree(3, 64, gen, k=1, depths=5)
    else:
        tree = random_tree(3, 65, gen, kind, vocab=4)
    for _ in range(4):
        target = walk_targets(tree, gen)
        got = run_walk_greedy(tree, target, max_accept, DEV)
        assert_fields_equal(got, run_walk_greedy(tree, target, max_accept, "cpu"), "vs CPU op")
        assert_fields_equal(got, reference.walk_greedy(tree, target, max_accept), "vs reference")


def argmax_rows(rows, vocab, dtype, gen, ties=False, specials=False):
    """Logits [rows, vocab] with ties (a few distinct values, so every row's maximum repeats) or NaN, +-inf and -0."""
    if ties:
        x = torch.randint(0, 4, (rows, vocab), generator=gen).float()
    else:
        x = torch.randn(rows, vocab, generator=gen) * 4
    if specials:
        x[0] = -torch.inf  # all -inf: the first index
        if rows > 1:
            x[1, vocab // 3] = torch.nan  # one NaN wins over +inf
            x[1, vocab // 2] = torch.inf
        if rows > 2:
            x[2, 7:] = -0.0  # -0 and +0 tie: the first
            x[2, :7] = -1.0
            x[2, vocab - 1] = 0.0
        if rows > 3:
            x[3, [5, vocab - 2]] = torch.nan  # the first NaN
            x[3, vocab - 2].neg_()  # a NaN with the sign bit set counts as NaN too
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("rows,vocab", [(1, 1), (1, 7), (3, 2049), (1, 151936), (16, 151936), (65, 248320),
                                        (130, 5003), (300, 70000)])
@pytest.mark.parametrize("values", ["random", "ties", "specials"])
def test_row_argmax(dtype, rows, vocab, values):
    """ops.row_argmax on the GPU is torch.argmax (the first maximum, the first NaN), on rows split over one block or
    over many (then merged), for every float dtype, and on rows that start off a 16-byte boundary."""
    gen = make_gen(rows * 7 + vocab)
    x = argmax_rows(rows, vocab, dtype, gen, ties=values == "ties", specials=values == "specials")
    want = x.argmax(-1)
    assert torch.equal(ops.row_argmax(x.to(DEV)).cpu(), want)
    assert torch.equal(ops.row_argmax(x.cpu()), want)
    if vocab > 1:  # rows one element in: every row starts unaligned
        shifted = x[:, 1:]
        assert torch.equal(ops.row_argmax(shifted.to(DEV)).cpu(), shifted.argmax(-1))
    if rows > 1:  # leading dims [B, N] and a strided row view
        nodes = x.to(DEV).view(1, rows, vocab)
        assert torch.equal(ops.row_argmax(nodes).cpu(), want.view(1, rows))
        assert torch.equal(ops.row_argmax(x.to(DEV)[::2]).cpu(), want[::2])


def sample_case(bsz, n, vocab, gen):
    """A tree whose children carry the likely tokens of their parent, and peaked target logits, so that
    sampled walks go deep."""
    parent = torch.stack([random_parents(n, gen, "random", 8) for _ in range(bsz)])
    logits = torch.randn(bsz, n, vocab, generator=gen) * 2
    peak = torch.randint(0, vocab, (bsz, n), generator=gen)
    logits.scatter_add_(-1, peak[..., None], torch.full((bsz, n, 1), 6.0))
    token = torch.randint(0, vocab, (bsz, n), generator=gen)
    for b in range(bsz):
        for i in range(1, n):
            if float(torch.rand(1, generator=gen)) < 0.6:
                token[b, i] = peak[b, int(parent[b, i])]
    return reference.tree_from_parents(parent, token, torch.zeros(bsz, dtype=torch.long)), logits


SAMPLE_SETTINGS = [  # (temperature, top_k, top_p): every path of the CUDA op
    (1.0, 0, 1.0),
    (0.7, 5, 1.0),
    (0.7, 20, 0.9),
    (1.3, 64, 0.8),
    (0.6, 1, 1.0),
    (0.9, 0, 0.9),  # top_p alone: a mass select of the cut
    (0.7, 0, 0.3),
    (1.0, 0, 0.999),
    (1.0, 100, 0.95),  # top_k above the lists: a count select, then a mass select
    (0.8, 300, 1.0),
    (1.0, 10**6, 1.0),  # top_k >= vocab is off
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLE_SETTINGS)
def test_walk_sample(dtype, temperature, top_k, top_p):
    # Continuous random logits: a draw differs from the CPU op's only when uniform * total falls within
    # float rounding of a cumulative boundary (see walk_cuda.cu), which these seeds do not hit.
    gen = make_gen(top_k + 3 + round(top_p * 1000) + round(temperature * 10))  # each setting its own rows
    tree, logits = sample_case(3, 33, 3000, gen)
    logits = logits.to(dtype)
    max_accept = 9
    for _ in range(3):
        uniform = torch.rand(3, max_accept, generator=gen)
        kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        out = poisoned(ops.empty_walk(3, max_accept, DEV))
        got = ops.walk_sample(to(tree, DEV), logits.to(DEV), uniform.to(DEV), out=out, **kw)
        assert_fields_equal(got, ops.walk_sample(tree, logits, uniform, **kw), "vs CPU op")
        assert_fields_equal(got, reference.walk_sample(tree, logits, uniform, **kw), "vs reference")


MIN_P_SETTINGS = [  # (temperature, top_k, top_p, min_p): min_p on each path of the CUDA op
    (1.0, 0, 1.0, 0.05),  # min_p alone: its own cut kernel, then the draw over the row
    (0.7, 0, 1.0, 0.5),
    (0.7, 5, 1.0, 0.1),  # the lists
    (0.8, 20, 0.95, 0.2),
    (0.9, 0, 0.9, 0.1),  # the radix selects
    (1.0, 100, 0.95, 0.02),
    (1.0, 0, 1.0, 1.0),  # the max's tie group only
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("temperature,top_k,top_p,min_p", MIN_P_SETTINGS)
def test_walk_sample_min_p(dtype, temperature, top_k, top_p, min_p):
    """min_p after top_k and top_p: the CPU op's and the reference's draws on every path."""
    gen = make_gen(top_k + 5 + round(top_p * 1000) + round(min_p * 100))
    tree, logits = sample_case(3, 33, 3000, gen)
    logits = logits.to(dtype)
    for _ in range(3):
        uniform = torch.rand(3, 9, generator=gen)
        kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        got = ops.walk_sample(to(tree, DEV), logits.to(DEV), uniform.to(DEV), out=poisoned(ops.empty_walk(3, 9, DEV)),
                              **kw)
        assert_fields_equal(got, ops.walk_sample(tree, logits, uniform, **kw), "vs CPU op")
        assert_fields_equal(got, reference.walk_sample(tree, logits, uniform, **kw), "vs reference")


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.05), (0, 1.0, 1.0), (20, 0.95, 0.1), (64, 1.0, 0.3),
                                               (0, 0.6, 0.01), (100, 0.9, 0.2)])
def test_walk_sample_min_p_ties_keep_what_hf_warpers_keep(top_k, top_p, min_p):
    """Tied logits (see test_walk_sample_ties_keep_what_hf_warpers_keep) with HF's MinPLogitsWarper last: its kept set
    and weights, probed by inverse-CDF uniforms; the CPU op draws the same."""
    gen = make_gen(top_k * 100 + int(top_p * 100) + int(min_p * 1000))
    assert_tied_rows_draw_as_hf_warpers(gen, torch.bfloat16, temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)


@pytest.mark.parametrize("top_k", [0, 20, 100])
def test_walk_sample_min_p_near_its_cut_at_large_logits(top_k):
    """Logits around 1e6 (a low temperature), many tokens within a float32 step of min_p's cut
    (conftest.large_logit_rows): each path's draws are HF's warpers' and the CPU op's."""
    rows = large_logit_rows(3000, make_gen(5 + top_k))
    kw = dict(temperature=1.0, top_k=top_k, min_p=0.1)
    for row, probs in zip(rows, warped_probs(rows, **kw)):
        uniform, want = inverse_cdf_probes(probs)
        got = root_draws(row.to(DEV), uniform, **kw)
        assert torch.equal(got, want), f"{int((got != want).sum())} of {len(want)} probes differ"
        assert torch.equal(root_draws(row, uniform, **kw), got), "vs CPU op"


def test_walk_sample_full_vocab():
    """Qwen3.6's vocabulary, with the usual sampling settings (top_p alone and top_k 100: the radix selects)."""
    gen = make_gen(21)
    tree, logits = sample_case(1, 17, 248320, gen)
    logits = logits.to(torch.bfloat16)
    uniform = torch.rand(1, 17, generator=gen)
    for kw in (dict(temperature=0.6, top_k=20, top_p=0.95), dict(temperature=1.0), dict(temperature=0.7, top_p=0.9),
               dict(temperature=0.8, top_k=100)):
        got = ops.walk_sample(to(tree, DEV), logits.to(DEV), uniform.to(DEV), **kw)
        assert_fields_equal(got, ops.walk_sample(tree, logits, uniform, **kw), f"vs CPU op, {kw}")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_walk_sample_radix_selects_draw_as_the_cpu_op(dtype):
    """top_p alone and top_k above the lists (the radix selects) over many cuts: the CPU op's draws."""
    gen = make_gen(77)
    tree, logits = sample_case(3, 33, 3000, gen)
    logits = logits.to(dtype)
    for top_k, top_p in ((0, 0.05), (0, 0.5), (0, 0.9), (0, 0.99), (65, 1.0), (100, 0.9), (1000, 0.5), (2999, 0.95)):
        uniform = torch.rand(3, 9, generator=gen)
        kw = dict(temperature=0.9, top_k=top_k, top_p=top_p)
        got = ops.walk_sample(to(tree, DEV), logits.to(DEV), uniform.to(DEV), **kw)
        assert_fields_equal(got, ops.walk_sample(tree, logits, uniform, **kw), f"top_k {top_k}, top_p {top_p}")


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (0, 0.9, 0.0), (20, 0.9, 0.0), (100, 1.0, 0.0),
                                               (100, 0.9, 0.0), (0, 1.0, 0.1), (20, 0.9, 0.1), (0, 0.9, 0.1)])
def test_walk_sample_garbage_rows_draw_in_range(top_k, top_p, min_p):
    """Rows no distribution comes from (all -inf, all NaN, a NaN or a +inf among numbers, a masked tail) still
    draw a token of the vocabulary at every node, on every path, and fault nowhere (the walk stage of
    scripts/h200.sh runs this under memcheck)."""
    vocab, n = 5000, 6
    gen = make_gen(top_k + int(top_p * 10) + int(min_p * 100))
    kw = dict(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)
    logits = torch.randn(1, n, vocab, generator=gen)
    logits[0, 0] = -float("inf")
    logits[0, 1] = float("nan")
    logits[0, 2, 7] = float("nan")
    logits[0, 3, 11] = float("inf")
    logits[0, 4, vocab // 2 :] = -float("inf")
    parent = torch.tensor([[-1, 0, 1, 2, 3, 4]], dtype=torch.int32)  # one chain: every node is reachable
    tree = reference.tree_from_parents(parent, torch.zeros(1, n, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    for u in (0.0, 0.5, 0.999999):
        uniform = torch.full((1, n), u)
        for i in range(n):  # each row at the root of a one-node tree, then the chain over all of them
            row = logits[0, i].to(torch.bfloat16)
            token = root_draws(row.to(DEV), uniform[0, :1], **kw)
            assert 0 <= int(token) < vocab, f"row {i}, u {u}: drew {int(token)}"
            if i in (1, 3, 4):  # all NaN (the last id), a +inf among numbers (the kept set's largest id) and a
                # masked tail: the CPU op's draw
                assert torch.equal(token, root_draws(row, uniform[0, :1], **kw)), f"row {i}, u {u}"
        out = ops.walk_sample(to(tree, DEV), logits.to(torch.bfloat16).to(DEV), uniform.to(DEV), **kw)
        assert 0 <= int(out.next_token) < vocab


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(
    "top_k,top_p",
    [(2, 0.5), (5, 1.0), (7, 1.0), (8, 0.9), (20, 0.95), (31, 0.5), (64, 1.0), (64, 0.8), (100, 1.0), (100, 0.9),
     (0, 0.6), (0, 1.0)],
)
def test_walk_sample_ties_keep_what_hf_warpers_keep(dtype, top_k, top_p):
    """Logits tied at the top_k and top_p cuts: groups inside the kernel's list, running past it (64 tokens or
    62000 tied at the top), a k-th's group that holds most of top_p's mass, a k-th of -inf. The kept set and weights
    are HF's warpers' (a group tied at top_p's cut kept whole), probed by inverse-CDF uniforms over the whole range;
    the CPU op draws the same."""
    assert_tied_rows_draw_as_hf_warpers(make_gen(top_k * 100 + int(top_p * 100)), dtype, temperature=0.8, top_k=top_k,
                                        top_p=top_p)


def assert_tied_rows_draw_as_hf_warpers(gen, dtype, **kw):
    """conftest.tied_rows of 3000 and 248320 tokens in ``dtype``: the CUDA op's draws at inverse-CDF probes are those
    of HF's warpers with ``kw``; the CPU op's too, at 3000."""
    for vocab in (3000, 248320):
        rows = tied_rows(vocab, gen).to(dtype)
        for row, probs in zip(rows, warped_probs(rows, **kw)):
            uniform, want = inverse_cdf_probes(probs)
            got = root_draws(row.to(DEV), uniform, **kw)
            assert torch.equal(got, want), f"vocab {vocab}: {int((got != want).sum())} of {len(want)} probes differ"
            if vocab == 3000:
                assert torch.equal(root_draws(row, uniform, **kw), got), "vs CPU op"


# ---- commit ------------------------------------------------------------------------------------


def gdn_commit_case(layer_shapes, bsz, n, max_accept, gen):
    """Per-layer states and stashes from real tree_gated_delta_rule runs on one tree, and accepted
    paths. layer_shapes: (heads, value_heads, kdim, vdim) per layer."""
    parent = torch.stack([random_parents(n, gen) for _ in range(bsz)])
    states, stashes = [], []
    for heads, value_heads, kdim, vdim in layer_shapes:
        x = gdn_inputs(bsz, n, heads, value_heads, kdim, vdim, torch.float32, gen)._replace(parent=parent)
        states.append(x.state)
        stashes.append(run_gdn(x, "cpu"))
    accepted, accept_len = random_paths(parent, max_accept, gen)
    return states, stashes, accepted, accept_len


def stash_lists(stashes):
    return [[getattr(s, f) for s in stashes] for f in ("stash_u", "stash_k", "stash_cumg")]


def commit_gdn(states, stashes, accepted, accept_len, device):
    new = [s.to(device, copy=True) for s in states]
    ops.commit_gdn_state(new, *(to(lst, device) for lst in stash_lists(stashes)), accepted.to(device),
                         accept_len.to(device))
    return new


@pytest.mark.parametrize(
    "layer_shapes",
    [
        [(2, 4, 16, 8)] * 3,  # one launch
        [(2, 4, 16, 8), (1, 2, 40, 36), (1, 2, 40, 36), (2, 6, 128, 128)],  # three runs of equal layouts
        # V = 256: a 64-row tile is two batches of loads; V = 30: element by element; K = 70: a partial tile
        [(1, 2, 64, 256), (1, 3, 70, 30)],
    ],
)
def test_commit_gdn_state(layer_shapes):
    gen = make_gen(len(layer_shapes))
    states, stashes, accepted, accept_len = gdn_commit_case(layer_shapes, 3, 17, 6, gen)
    got = commit_gdn(states, stashes, accepted, accept_len, DEV)
    expected_cpu = commit_gdn(states, stashes, accepted, accept_len, "cpu")
    expected_ref = reference.commit_gdn_state(states, *stash_lists(stashes), accepted, accept_len)
    for l in range(len(states)):
        assert_close(got[l], expected_cpu[l], torch.float32, f"layer {l} vs CPU op")
        assert_close(got[l], expected_ref[l], torch.float32, f"layer {l} vs reference")


@pytest.mark.parametrize(
    "layers,n,max_accept,heads,value_heads,kdim,vdim",
    [
        (48, 65, 16, 16, 48, 128, 128),  # Qwen3.6-27B's 48 GDN layers: one launch
        (70, 9, 5, 2, 4, 8, 16),  # more layers than one launch takes (64): split over two
    ],
)
def test_commit_gdn_state_many_layers(layers, n, max_accept, heads, value_heads, kdim, vdim):
    """Many float32 GDN layers committed by one op call, launched in runs of at most 64 layers."""
    gen = make_gen(layers)
    parent = random_parents(n, gen)[None]
    accepted, accept_len = random_paths(parent, max_accept, gen)
    states = [torch.randn(1, value_heads, kdim, vdim, generator=gen) * 0.3 for _ in range(layers)]
    stash = [GDNTreeOutput(None, torch.randn(1, n, value_heads, vdim, generator=gen),
                           F.normalize(torch.randn(1, n, heads, kdim, generator=gen), dim=-1),
                           -torch.rand(1, n, value_heads, generator=gen).cumsum(1)) for _ in range(layers)]
    got = commit_gdn(states, stash, accepted, accept_len, DEV)
    expected = commit_gdn(states, stash, accepted, accept_len, "cpu")
    for l in range(layers):
        assert_close(got[l], expected[l], torch.float32, f"layer {l}")


@pytest.mark.parametrize("bad", ["length 0", "length past D", "node past N", "negative node"])
def test_commit_gdn_state_leaves_unusable_paths_alone(bad):
    """A path the kernel cannot apply (the CPU op raises on it; the CUDA op cannot read it on the host) leaves
    that row's state as it was; the other rows are committed."""
    gen = make_gen(5)
    bsz, n, max_accept = 3, 17, 6
    states, stashes, accepted, accept_len = gdn_commit_case([(2, 4, 16, 8), (1, 2, 40, 36)], bsz, n, max_accept, gen)
    expected = commit_gdn(states, stashes, accepted, accept_len, "cpu")
    broken_len, broken_acc = accept_len.clone(), accepted.clone()
    if bad == "length 0":
        broken_len[1] = 0
    elif bad == "length past D":
        broken_len[1] = max_accept + 1
    else:
        broken_acc[1, int(accept_len[1]) - 1] = n if bad == "node past N" else -1
    got = commit_gdn(states, stashes, broken_acc, broken_len, DEV)
    for l in range(len(states)):
        for b in range(bsz):
            want = states[l][b] if b == 1 else expected[l][b]
            assert_close(got[l][b], want, torch.float32, f"layer {l} row {b}")


def run_commit_conv(conv_states, xs, accepted, accept_len, device):
    new = [c.to(device, copy=True) for c in conv_states]
    ops.commit_conv_state(new, to(xs, device), accepted.to(device), accept_len.to(device))
    return new


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("state_len,max_accept", [(3, 17), (4, 2), (6, 9)])
def test_commit_conv_state(dtype, state_len, max_accept):
    gen = make_gen(state_len * 10 + max_accept)
    bsz, n, channels, layers = 3, 33, 70, 3
    parent = torch.stack([random_parents(n, gen) for _ in range(bsz)])
    accepted, accept_len = random_paths(parent, max_accept, gen)
    conv_states = [torch.randn(bsz, channels, state_len, generator=gen).to(dtype) for _ in range(layers)]
    xs = [torch.randn(bsz, n, channels, generator=gen).to(dtype) for _ in range(layers)]
    xs[2] = torch.randn(bsz, n, channels + 6, generator=gen).to(dtype)[..., 3 : channels + 3]  # strided x
    got = run_commit_conv(conv_states, xs, accepted, accept_len, DEV)
    expected_cpu = run_commit_conv(conv_states, [x.contiguous() for x in xs], accepted, accept_len, "cpu")
    expected_ref = reference.commit_conv_state(conv_states, xs, accepted, accept_len)
    for l in range(layers):
        assert torch.equal(got[l].cpu(), expected_cpu[l]), f"layer {l} vs CPU op"
        assert torch.equal(got[l].cpu(), expected_ref[l]), f"layer {l} vs reference"


def run_commit_kv(caches, prefix, accepted, accept_len, device):
    new = [c.to(device, copy=True) for c in caches]
    ops.commit_kv(new, prefix.to(device), accepted.to(device), accept_len.to(device))
    return new


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads,head_dim,max_accept", [(4, 256, 17), (2, 36, 5), (3, 7, 9)])
def test_commit_kv(dtype, heads, head_dim, max_accept):
    gen = make_gen(head_dim + max_accept)
    bsz, n, slots = 3, 65, 200
    parent = torch.stack([random_parents(n, gen) for _ in range(bsz)])
    accepted, accept_len = random_paths(parent, max_accept, gen)
    prefix = torch.tensor([0, 11, 200 - n])
    caches = [torch.randn(bsz, heads, slots, head_dim, generator=gen).to(dtype) for _ in range(4)]
    got = run_commit_kv(caches, prefix, accepted, accept_len, DEV)
    expected_cpu = run_commit_kv(caches, prefix, accepted, accept_len, "cpu")
    expected_ref = reference.commit_kv(caches, prefix, accepted, accept_len)
    for l in range(len(caches)):
        assert torch.equal(got[l].cpu(), expected_cpu[l]), f"cache {l} vs CPU op"
        assert torch.equal(got[l].cpu(), expected_ref[l]), f"cache {l} vs reference"


def test_commit_kv_qwen36_shape():
    """16 attention layers (32 caches of 4 KV heads x 256), a long accepted path that overlaps itself."""
    gen = make_gen(16)
    caches = [torch.randn(1, 4, 1024, 256, generator=gen).to(torch.bfloat16) for _ in range(32)]
    accepted = torch.tensor([[0, 2, 3, 7, 8, 9, 15, 16, 30, 31, 40, 41, 50, 60, 61, 62]], dtype=torch.int32)
    accept_len = torch.tensor([16], dtype=torch.int32)
    prefix = torch.tensor([500])
    got = run_commit_kv(caches, prefix, accepted, accept_len, DEV)
    expected = run_commit_kv(caches, prefix, accepted, accept_len, "cpu")
    for l in range(32):
        assert torch.equal(got[l].cpu(), expected[l]), f"cache {l}"


@pytest.mark.parametrize("dtype", [*FLOAT_DTYPES, torch.int64, torch.int32, torch.bool, torch.uint8])
@pytest.mark.parametrize("features", [1, 5, 64, 5120])
def test_gather_rows(dtype, features):
    gen = make_gen(features)
    bsz, n, max_accept = 3, 33, 9
    parent = torch.stack([random_parents(n, gen) for _ in range(bsz)])
    accepted, accept_len = random_paths(parent, max_accept, gen)
    src = torch.randint(0, 100, (bsz, n, features), generator=gen).to(dtype)
    expected_cpu = ops.gather_rows(src, accepted, accept_len)
    expected_ref = reference.gather_rows(src, accepted, accept_len)
    out = poison(torch.empty(bsz, max_accept, features, dtype=dtype, device=DEV))
    got = ops.gather_rows(*to([src, accepted, accept_len], DEV), out=out)
    assert torch.equal(got.cpu(), expected_cpu)
    assert torch.equal(got.cpu(), expected_ref)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("head_dim", [128, 7])
def test_store_kv(dtype, head_dim):
    """K and V rows to their slots, as the CPU op (two index_copy_); value rows a transposed view, key rows
    contiguous; odd head dims take the element path."""
    gen = make_gen(head_dim)
    keys = torch.randn(1, 4, 50, head_dim, generator=gen).to(dtype)
    values = torch.randn(1, 4, 50, head_dim, generator=gen).to(dtype)
    key_states = torch.randn(1, 4, 9, head_dim, generator=gen).to(dtype)
    value_states = torch.randn(1, 9, 4, head_dim, generator=gen).to(dtype).transpose(1, 2)
    slots = torch.arange(30, 39)
    expected = [keys.clone(), values.clone()]
    ops.store_kv(*expected, slots, key_states, value_states)
    got = to([keys, values], DEV)
    ops.store_kv(*got, *to([slots, key_states], DEV), value_states.to(DEV))
    assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[1].cpu(), expected[1])


@pytest.mark.parametrize("head_dim", [128, 7])
def test_store_kv_per_batch_row_slots(head_dim):
    """slots [B, N] (the draft's context and block rows, padding rows negative) as the CPU op stores them."""
    gen = make_gen(head_dim + 1)
    keys, values = (torch.randn(2, 4, 40, head_dim, generator=gen).to(torch.bfloat16) for _ in range(2))
    key_states = torch.randn(2, 4, 8, head_dim, generator=gen).to(torch.bfloat16)
    value_states = torch.randn(2, 8, 4, head_dim, generator=gen).to(torch.bfloat16).transpose(1, 2)
    slots = torch.tensor([[10, 11, -1, -1, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25, 26, 27]])
    expected = [keys.clone(), values.clone()]
    ops.store_kv(*expected, slots, key_states, value_states)
    got = to([keys, values], DEV)
    ops.store_kv(*got, *to([slots, key_states], DEV), value_states.to(DEV))
    assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[1].cpu(), expected[1])
    assert not torch.equal(expected[0][1], keys[1])  # the guard: batch row 1 was stored


def test_store_kv_skips_slots_outside_the_caches():
    keys, values = torch.zeros(1, 2, 10, 8, device=DEV), torch.zeros(1, 2, 10, 8, device=DEV)
    states = torch.ones(1, 2, 3, 8, device=DEV)
    ops.store_kv(keys, values, torch.tensor([9, 10, -1], device=DEV), states, states * 2)
    assert (keys[:, :, 9] == 1).all() and (values[:, :, 9] == 2).all()
    assert keys[:, :, :9].abs().sum() == 0 and values[:, :, :9].abs().sum() == 0


# ---- layer bodies ---------------------------------------------------------------------------------

# (rows, features): a decode step, head sizes (3121 x 128: the 27B GDN heads of a 65-node tree, and a row past them;
# 64: half-warp rows of 8 or 16 chunks), odd sizes (single-element path), 27B hidden and MLP rows.
LAYER_SHAPES = [(1, 5120), (65, 5120), (130, 256), (7, 128), (3121, 128), (9, 64), (5, 7), (3, 129), (3, 1037),
                (2, 17408)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("rows,dim", LAYER_SHAPES)
@pytest.mark.parametrize("kind", ["zero_centered", "plain", "gated"])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "unaligned"])
def test_rms_norm(kind, rows, dim, dtype, layout):
    gen = make_gen(rows * dim)
    pad = {"contiguous": 0, "strided": 16, "unaligned": 1}[layout]
    base = (torch.randn(rows, dim + pad, generator=gen) * 3).to(dtype)
    x = base[:, pad:] if layout == "unaligned" else base[:, :dim]
    weight = (torch.randn(dim, generator=gen) * 0.3 + (kind != "zero_centered")).to(dtype)
    gate = (torch.randn(rows, dim, generator=gen) * 2).to(dtype) if kind == "gated" else None
    args = dict(gate=gate, zero_centered=kind == "zero_centered")
    expected = ops.rms_norm(x, weight, 1e-6, **args)
    out = poison(torch.empty(rows, dim, dtype=dtype, device=DEV))
    got = ops.rms_norm(*to([x, weight], DEV), 1e-6, gate=None if gate is None else gate.to(DEV),
                       zero_centered=args["zero_centered"], out=out)
    assert_close(got, expected, dtype, f"{kind} vs CPU")
    assert_close(got, reference.rms_norm(x, weight, 1e-6, **args), dtype, f"{kind} vs reference")
    if dtype != torch.float32:  # same rounding points as the CPU op: only float32 sum orders differ
        assert (got.cpu() != expected).float().mean() < 0.01, f"{kind}: too many elements differ from the CPU op"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("kind", ["plain", "zero_centered", "gated"])
@pytest.mark.parametrize("tokens,heads,dim,pad", [(1, 32, 128, 2048), (65, 8, 128, 128), (3, 24, 256, 8), (2, 3, 7, 1)])
def test_rms_norm_of_heads_sliced_from_stacked_rows(kind, tokens, heads, dim, pad, dtype):
    """Heads of each token sliced from a wider row (q or k of a stacked q/k/v projection; a gate likewise): read in
    place as groups of rows, the bits of the same norm of their contiguous copy on the GPU; the odd head size and
    pad take the element path."""
    gen = make_gen(tokens * heads + dim)
    rows = (torch.randn(tokens, heads * dim + pad, generator=gen) * 3).to(dtype).to(DEV)
    heads_in_rows = rows[:, pad:] if pad % 8 else rows[:, : heads * dim]
    sliced = heads_in_rows.view(tokens, heads, dim)
    weight = (torch.randn(dim, generator=gen) * 0.3 + (kind != "zero_centered")).to(dtype).to(DEV)
    other = (torch.randn(tokens, heads, dim, generator=gen) * 2).to(dtype).to(DEV)
    # The gated norm: x contiguous, the gate sliced.
    x, gate = (other, sliced) if kind == "gated" else (sliced, None)
    args = dict(zero_centered=kind == "zero_centered")
    got = ops.rms_norm(x, weight, 1e-6, gate=gate, **args)
    expected = ops.rms_norm(x.contiguous(), weight, 1e-6, gate=None if gate is None else gate.contiguous(), **args)
    assert torch.equal(got, expected)
    assert_close(got.cpu(), ops.rms_norm(x.cpu(), weight.cpu(), 1e-6, gate=None if gate is None else gate.cpu(), **args),
                 dtype, f"{kind} vs CPU")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("rows,dim", LAYER_SHAPES)
@pytest.mark.parametrize("kind", ["zero_centered", "plain"])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "unaligned", "in_place"])
def test_add_rms_norm(kind, rows, dim, dtype, layout):
    """The sum bit for bit the CPU's (and torch's), the norm the bits of ops.rms_norm on that sum on the GPU."""
    gen = make_gen(rows * dim + 7)
    pad = {"contiguous": 0, "strided": 16, "unaligned": 1, "in_place": 0}[layout]
    base = (torch.randn(2, rows, dim + pad, generator=gen) * 3).to(dtype)
    x, residual = (base[:, :, pad:] if layout == "unaligned" else base[:, :, :dim]).unbind(0)
    weight = (torch.randn(dim, generator=gen) * 0.3 + (kind != "zero_centered")).to(dtype)
    zero_centered = kind == "zero_centered"
    expected_normed, expected_total = ops.add_rms_norm(x, residual, weight, 1e-6, zero_centered=zero_centered)
    x_dev, residual_dev, weight_dev = to([x, residual, weight], DEV)
    if layout == "unaligned":  # the device copies are aligned again: take the same offset there
        base_dev = base.to(DEV)
        x_dev, residual_dev = base_dev[:, :, pad:].unbind(0)
    out = poison(torch.empty(rows, dim, dtype=dtype, device=DEV))
    residual_out = residual_dev if layout == "in_place" else poison(torch.empty(rows, dim, dtype=dtype, device=DEV))
    sum_dev = x_dev + residual_dev
    normed, total = ops.add_rms_norm(x_dev, residual_dev, weight_dev, 1e-6, zero_centered=zero_centered, out=out,
                                     residual_out=residual_out)
    assert normed is out and total is residual_out
    assert torch.equal(total.cpu(), expected_total) and torch.equal(total, sum_dev)
    assert torch.equal(normed, ops.rms_norm(sum_dev, weight_dev, 1e-6, zero_centered=zero_centered))
    assert_close(normed, expected_normed, dtype, f"{kind} vs CPU")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("rows,dim", LAYER_SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "unaligned"])
def test_silu_mul(rows, dim, dtype, layout):
    gen = make_gen(dim)
    pad = 1 if layout == "unaligned" else 0
    both = (torch.randn(rows, 2 * dim + pad, generator=gen) * 3).to(dtype)
    gate, up = both[:, pad : pad + dim], both[:, pad + dim :]
    out = poison(torch.empty(rows, dim, dtype=dtype, device=DEV))
    got = ops.silu_mul(*to([gate, up], DEV), out=out)
    assert_close(got, ops.silu_mul(gate, up), dtype, "vs CPU")
    assert_close(got, reference.silu_mul(gate, up), dtype, "vs reference")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_silu_mul_of_one_row_sliced_from_an_odd_width_row_takes_16_byte_packs(dtype):
    """One row of a stacked GEMM's output whose width allows no 16-byte row stride (a decode step of a MoE block's
    unpadded group: 2 x 512 + 257 outputs): a one-row dimension's stride is never stepped, so silu_mul takes its
    16-byte path there, with the bits of the contiguous copy; two such rows take the element path."""
    gen = make_gen(1281)
    vec = 16 // torch.empty(0, dtype=dtype).element_size()
    for rows, packed in ((1, True), (2, False)):
        stacked = (torch.randn(rows, 2 * 512 + 257, generator=gen) * 3).to(dtype).to(DEV)
        gate, up = stacked[:, :512], stacked[:, 512:1024]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = ops.silu_mul(gate, up)
            torch.cuda.synchronize()
        kernels = [m for m in (re.search(r"gated_mul_kernel<([^<>]*)>", e.name) for e in prof.events()) if m]
        assert kernels and all(int(m.group(1).split(",")[1]) == (vec if packed else 1) for m in kernels), kernels
        assert torch.equal(got, ops.silu_mul(gate.contiguous(), up.contiguous())), rows


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(
    "rows,heads,features",
    # 9 rows and more on 16-bit inputs: the tensor-core path (x rows unaligned at 100 features).
    [(1, 48, 5120), (65, 48, 5120), (257, 48, 5120), (3, 5, 7), (17, 3, 64), (33, 4, 100)],
)
def test_gdn_gates(rows, heads, features, dtype):
    gen = make_gen(rows + features)
    x = torch.randn(rows, features, generator=gen).to(dtype)
    wa = (torch.randn(heads, features, generator=gen) * 4 / features**0.5).to(dtype)
    wb = (torch.randn(heads, features, generator=gen) * 2 / features**0.5).to(dtype)
    A_log, dt_bias = torch.randn(heads, generator=gen), (torch.randn(heads, generator=gen) * 8).to(dtype)
    g_cpu, beta_cpu = ops.gdn_gates(x, wa, wb, A_log, dt_bias)
    g, beta = ops.gdn_gates(*to([x, wa, wb, A_log, dt_bias], DEV))
    # The dot products are rounded to dtype: CPU and GPU sum in other orders, so one ulp of dtype apart.
    assert_close(g, g_cpu, dtype, "g")
    assert_close(beta, beta_cpu, dtype, "beta")
    ref_g, ref_beta = reference.gdn_gates(x, wa, wb, A_log, dt_bias)
    assert_close(g, ref_g, dtype, "g vs reference")
    assert_close(beta, ref_beta, dtype, "beta vs reference")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads,n,dim,rot", [(24, 1, 256, 64), (4, 65, 256, 64), (32, 16, 128, 128), (3, 7, 10, 6)])
def test_rope(heads, n, dim, rot, dtype):
    """Bit for bit the CPU op (both round where HF rounds), on q transposed from [B, N, H, D]."""
    gen = make_gen(n * dim)
    x = torch.randn(2, n, heads, dim, generator=gen).to(dtype).transpose(1, 2)
    angles = torch.rand(2, n, rot // 2, generator=gen) * 1000
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    out = poison(torch.empty(2, heads, n, dim, dtype=dtype, device=DEV))
    got = ops.rope(*to([x, cos, sin], DEV), out=out)
    assert torch.equal(got.cpu(), ops.rope(x, cos, sin))
    assert torch.equal(got.cpu(), reference.rope(x, cos, sin))


def _qk_inputs(gen, tokens, heads, kv_heads, dim, rot, dtype, gated=True):
    """q as Qwen3.5's q projection gives it (each head beside its gate: [B, N, H, D] with head stride 2D) or
    contiguous, k contiguous, cos / sin [B, N, R] from angles as HF's rotary embedding makes them."""
    width = 2 * dim if gated else dim
    q = (torch.randn(2, tokens, heads * width, generator=gen) * 3).to(dtype).view(2, tokens, heads, width)[..., :dim]
    k = (torch.randn(2, tokens, kv_heads, dim, generator=gen) * 3).to(dtype)
    angles = torch.rand(2, tokens, rot // 2, generator=gen) * 1000
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    weights = [(torch.randn(dim, generator=gen) * 0.3 + 1).to(dtype) for _ in range(2)]
    return q, k, *weights, cos, sin


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("zero_centered", [True, False])
@pytest.mark.parametrize(
    "tokens,heads,kv_heads,dim,rot,gated",
    # 27B (partial rotary), Qwen3-8B, a half-warp row, the element path (odd head), a head past a warp's chunks.
    [(1, 24, 4, 256, 64, True), (65, 24, 4, 256, 64, True), (17, 32, 8, 128, 128, False), (3, 4, 2, 64, 16, True),
     (5, 3, 1, 10, 6, True), (2, 2, 1, 512, 128, False),
     # a warp's row on the element path (16-bit 250, float32 126), aligned heads with tables read element by element
     (3, 4, 2, 250, 64, False), (3, 4, 2, 126, 12, False), (3, 4, 2, 64, 10, True)],
)
def test_qk_norm_rope_is_the_two_ops_bit_for_bit(tokens, heads, kv_heads, dim, rot, gated, zero_centered, dtype):
    """One launch gives the bits of ops.rms_norm then ops.rope on the GPU (the HF body's four launches), and
    matches the CPU op within the norms' float32 sum order."""
    q, k, qw, kw, cos, sin = to(_qk_inputs(make_gen(tokens * dim + heads), tokens, heads, kv_heads, dim, rot, dtype,
                                           gated), DEV)
    q_out = poison(torch.empty(2, heads, tokens, dim, dtype=dtype, device=DEV))
    k_out = poison(torch.empty(2, kv_heads, tokens, dim, dtype=dtype, device=DEV))
    got_q, got_k = ops.qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6, zero_centered=zero_centered, q_out=q_out,
                                    k_out=k_out)
    assert got_q is q_out and got_k is k_out
    for got, x, w in ((got_q, q, qw), (got_k, k, kw)):
        normed = ops.rms_norm(x, w, 1e-6, zero_centered=zero_centered)
        assert torch.equal(got, ops.rope(normed.transpose(1, 2), cos, sin))
    cpu_q, cpu_k = ops.qk_norm_rope(*to([q, k, qw, kw, cos, sin], "cpu"), 1e-6, zero_centered=zero_centered)
    assert_close(got_q, cpu_q, dtype, "q vs CPU")
    assert_close(got_k, cpu_k, dtype, "k vs CPU")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("slot_table,caches", [("shared", "dense"), ("per-row", "dense"), ("per-row", "padded-rows")])
@pytest.mark.parametrize(
    "tokens,heads,kv_heads,dim,rot,gated",
    # 27B (partial rotary) at one node and a 65-node verify, Qwen3-8B / the draft, a half-warp row, the element path,
    # a head past a warp's chunks (the two ops through a buffer).
    [(1, 24, 4, 256, 64, True), (65, 24, 4, 256, 64, True), (31, 32, 8, 128, 128, False), (3, 4, 2, 64, 16, True),
     (5, 3, 1, 10, 6, True), (2, 2, 1, 512, 128, False)],
)
def test_qk_norm_rope_store_kv_is_the_two_ops_bit_for_bit(tokens, heads, kv_heads, dim, rot, gated, slot_table,
                                                          caches, dtype):
    """One launch gives the bits of ops.qk_norm_rope then ops.store_kv of its k and of v: q's output, and the caches
    at the stored slots (a negative slot and one past the caches store nothing; every other slot keeps its bits), with
    one slot table for the batch or one per batch row, v read in place from a wider projection output, caches whose
    rows lie one element apart more than D (no 16-byte rows: the element path) and the zero-centred norm with them; and
    the CPU op's caches within the norms' float32 sum order."""
    gen = make_gen(tokens * dim + heads + 7)
    q, k, qw, kw, cos, sin = to(_qk_inputs(gen, tokens, heads, kv_heads, dim, rot, dtype, gated), DEV)
    v = (torch.randn(2, tokens, kv_heads, 2 * dim, generator=gen) * 3).to(dtype).to(DEV)[..., dim:]
    capacity = tokens + 9
    slots = torch.stack([torch.randperm(capacity, generator=gen)[:tokens] for _ in range(2)])
    slots[:, 0] = -1  # a padding row
    if tokens > 2:
        slots[:, 1] = capacity + 3  # past the caches: skipped on CUDA
    slots = (slots[0] if slot_table == "shared" else slots).to(DEV)
    pad = 1 if caches == "padded-rows" else 0
    zero_centered = caches == "padded-rows"
    caches = [torch.randn(2, kv_heads, capacity, dim + pad, generator=gen).to(dtype).to(DEV)[..., :dim]
              for _ in range(2)]
    expected_keys, expected_values = (c.clone() for c in caches)
    expected_q, expected_k = ops.qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6, zero_centered=zero_centered)
    ops.store_kv(expected_keys, expected_values, slots, expected_k, v.transpose(1, 2))
    q_out = poison(torch.empty(2, heads, tokens, dim, dtype=dtype, device=DEV))
    keys, values = caches
    got = ops.qk_norm_rope_store_kv(q, k, v, qw, kw, cos, sin, 1e-6, keys, values, slots, zero_centered=zero_centered,
                                    q_out=q_out)
    assert got is q_out
    assert torch.equal(got, expected_q)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    if tokens > 2:  # the CPU op refuses a slot past the caches
        return
    cpu_keys, cpu_values = (c.cpu() for c in caches)
    cpu_q = ops.qk_norm_rope_store_kv(*to([q, k, v, qw, kw, cos, sin], "cpu"), 1e-6, cpu_keys, cpu_values, slots.cpu(),
                                      zero_centered=zero_centered)
    assert_close(got, cpu_q, dtype, "q vs CPU")
    assert_close(keys, cpu_keys, dtype, "keys vs CPU")
    assert torch.equal(values.cpu(), cpu_values)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("tokens,heads,dim", [(1, 24, 256), (65, 24, 256), (17, 32, 128), (3, 5, 7)])
@pytest.mark.parametrize("in_place", [False, True])
def test_sigmoid_mul_is_torchs_gate_bit_for_bit(tokens, heads, dim, dtype, in_place):
    """Qwen3.5's output gate, the gate read in place from the q projection's rows: HF's ``x * sigmoid(gate)`` on the
    GPU bit for bit (the odd head size takes the element path); x may be the output."""
    gen = make_gen(tokens * heads + dim)
    rows = (torch.randn(tokens, heads * 2 * dim, generator=gen) * 4).to(dtype).to(DEV)
    gate = rows.view(tokens, heads, 2 * dim)[..., dim:]
    x = (torch.randn(tokens, heads, dim, generator=gen) * 3).to(dtype).to(DEV)
    expected = x * torch.sigmoid(gate)
    expected_cpu = ops.sigmoid_mul(gate.cpu(), x.cpu())
    got = ops.sigmoid_mul(gate, x, out=x if in_place else poison(torch.empty_like(x)))
    assert torch.equal(got, expected)
    assert (got.data_ptr() == x.data_ptr()) == in_place
    assert_close(got, expected_cpu, dtype, "vs CPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_ops_bits_do_not_depend_on_alignment(dtype):
    """The same values at a 16-byte aligned and at an unaligned address give the same bits (a graph replay
    and an eager call may see one tensor at different addresses; a reduction order that followed the
    load width made bf16 generations with graphs and without drift apart)."""
    gen = make_gen(7)
    for rows, dim in ((65, 128), (65, 5120)):  # a warp per row, a block per row
        values = torch.randn(rows, dim, generator=gen).to(dtype).to(DEV)
        shifted = torch.empty(rows * dim + 1, dtype=dtype, device=DEV)[1:].view(rows, dim)
        shifted.copy_(values)
        assert shifted.data_ptr() % 16 != 0
        weight = torch.randn(dim, generator=gen).to(dtype).to(DEV)
        for kw in (dict(zero_centered=True), dict(gate=values.flip(0))):
            assert torch.equal(ops.rms_norm(values, weight, 1e-6, **kw), ops.rms_norm(shifted, weight, 1e-6, **kw))
    # q/k norms and RoPE: heads of 128 and 256 features at an unaligned address (the element path) against aligned.
    for dim in (128, 256):
        q = torch.randn(3, 5, 4, dim, generator=gen).to(dtype).to(DEV)
        q_shifted = torch.empty(q.numel() + 1, dtype=dtype, device=DEV)[1:].view(q.shape)
        q_shifted.copy_(q)
        k, w = torch.randn(3, 5, 2, dim, generator=gen).to(dtype).to(DEV), torch.randn(dim, generator=gen).to(dtype).to(DEV)
        cos, sin = (torch.randn(3, 5, 64, generator=gen).to(dtype).to(DEV) for _ in range(2))
        for a, b in zip(ops.qk_norm_rope(q, k, w, w, cos, sin, 1e-6), ops.qk_norm_rope(q_shifted, k, w, w, cos, sin, 1e-6)):
            assert torch.equal(a, b)
    rows, dim, heads = 65, 5120, 48
    wa = (torch.randn(heads, dim, generator=gen) * 0.05).to(dtype).to(DEV)
    wb = (torch.randn(heads, dim, generator=gen) * 0.05).to(dtype).to(DEV)
    A_log, dt_bias = torch.randn(heads, device=DEV), torch.randn(heads, device=DEV)
    for a, b in zip(ops.gdn_gates(values, wa, wb, A_log, dt_bias), ops.gdn_gates(shifted, wa, wb, A_log, dt_bias)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,n,slots,mask_rows,dim",
                         [(4, 2, 1, 8, 1, 32), (4, 2, 5, 12, 5, 32), (4, 2, 5, 12, 1, 32), (24, 4, 65, 768, 65, 256),
                          (32, 8, 1, 700, 1, 128)])
def test_gqa_attention(heads, kv_heads, n, slots, mask_rows, dim, dtype):
    """The folded GQA attention against SDPA over K/V repeated per query head (HF's repeat_kv), on K/V
    sliced from a larger cache as the verify reads them; whatever memory order the fused kernel returns."""
    from ddtree_ext.fused import gqa_attention

    gen = make_gen(slots)
    q = torch.randn(1, heads, n, dim, generator=gen).to(dtype).to(DEV)
    k_cache = torch.randn(1, kv_heads, slots + 7, dim, generator=gen).to(dtype).to(DEV)
    v_cache = torch.randn(1, kv_heads, slots + 7, dim, generator=gen).to(dtype).to(DEV)
    k, v = k_cache[:, :, :slots], v_cache[:, :, :slots]
    mask = torch.rand(1, 1, mask_rows, slots, generator=gen) > 0.3
    mask[..., 0] = True
    mask = mask.to(DEV)
    groups = heads // kv_heads
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                              attn_mask=mask, scale=dim**-0.5)
    assert_close(gqa_attention(q, k, v, mask, dim**-0.5), expected, dtype, "folded GQA")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(
    "bsz,heads,kv_heads,n,slots,mask_rows,dim",
    [
        (1, 24, 4, 1, 768, 1, 256),   # 27B decode step: one split per 64 keys
        (1, 24, 4, 65, 768, 65, 256),  # 27B verify at budget 64
        (1, 32, 8, 17, 700, 17, 128),  # Qwen3-8B chain; S not a multiple of the 64-key chunk
        (1, 32, 8, 65, 1000, 65, 128),  # several chunks per split through the stages, a short last chunk
        (2, 8, 2, 5, 70, 5, 64),       # batch rows; the mask per batch row
        (2, 6, 6, 3, 9, 1, 64),        # no grouping; one mask row for all nodes; fewer keys than a chunk
        (1, 4, 2, 5, 40, 5, 48),       # a head dim the kernel does not take: ATen's SDPA
    ],
)
def test_gqa_attention_op(bsz, heads, kv_heads, n, slots, mask_rows, dim, dtype):
    """The CUDA op (split-KV tensor-core kernel for 16-bit inputs with D in {64, 128, 256}, SDPA otherwise)
    against the CPU op and the reference, K/V sliced from a larger cache, out in [B, N, H, D] memory order."""
    gen = make_gen(slots + n)
    q = torch.randn(bsz, n, heads, dim, generator=gen).to(dtype).transpose(1, 2)
    k_cache, v_cache = (torch.randn(bsz, kv_heads, slots + 9, dim, generator=gen).to(dtype) for _ in range(2))
    k, v = k_cache[:, :, :slots], v_cache[:, :, :slots]
    mask = torch.rand(bsz, 1, mask_rows, slots, generator=gen) > 0.3
    mask[..., 0] = True
    if mask_rows > 1:
        mask[:, :, 1] = False  # a row with no key to attend: zeros
    expected_cpu = ops.gqa_attention(q, k, v, mask, dim**-0.5)
    expected_ref = reference.gqa_attention(q, k, v, mask, dim**-0.5)
    out = poison(torch.empty(bsz, n, heads, dim, dtype=dtype, device=DEV)).transpose(1, 2)
    k_dev, v_dev = (t.to(DEV)[:, :, :slots] for t in (k_cache, v_cache))
    got = ops.gqa_attention(q.to(DEV), k_dev, v_dev, mask.to(DEV), dim**-0.5, out=out)
    assert_close(got, expected_cpu, dtype, "vs CPU op")
    assert_close(got, expected_ref, dtype, "vs reference")


def attention_launches(run) -> List[str]:
    """Names of the gqa_attention kernels (and its split combine) that run() launched, in order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if "gqa_attention_kernel" in e.name or "gqa_attention_combine" in e.name]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bsz,heads,kv_heads,n,slots,dim",
                         [(1, 24, 4, 17, 600, 256), (1, 32, 8, 65, 1000, 128), (1, 32, 8, 17, 300, 128),
                          (2, 32, 8, 17, 320, 128), (1, 8, 2, 3, 70, 64)])
def test_gqa_attention_num_splits(bsz, heads, kv_heads, n, slots, dim, dtype):
    """Any number of key splits asked for (one; a few; more than the 64-key chunks) gives the reference's attention,
    the same bits on a second call, and the default choice's result up to the rounding of the merged sums; one split
    launches no combine, more do. Eight-warp CTAs run for 65-128 folded rows a KV head at D = 128 (68 here, once with
    two batch rows and 16-byte mask rows), four-warp ones otherwise (260 rows, D = 256, D = 64)."""
    gen = make_gen(slots + n + dim)
    q = torch.randn(bsz, n, heads, dim, generator=gen).to(dtype).transpose(1, 2).to(DEV)
    k, v = (torch.randn(bsz, kv_heads, slots, dim, generator=gen).to(dtype).to(DEV) for _ in range(2))
    mask = torch.rand(bsz, 1, n, slots, generator=gen) > 0.3
    mask[..., 0] = True
    mask = mask.to(DEV)
    expected = reference.gqa_attention(q.cpu(), k.cpu(), v.cpu(), mask.cpu(), dim**-0.5)
    chosen = ops.gqa_attention(q, k, v, mask, dim**-0.5)
    rows = heads // kv_heads * n
    warps = 8 if dim == 128 and 64 < rows <= 128 else 4
    chunks = -(-slots // 64)
    for splits in (1, 2, 3, 7, 10_000):
        got = ops.gqa_attention(q, k, v, mask, dim**-0.5, num_splits=splits)
        assert_close(got, expected, dtype, f"num_splits={splits} vs reference")
        assert_close(got, chosen, dtype, f"num_splits={splits} vs the op's choice")
        names = attention_launches(lambda: ops.gqa_attention(q, k, v, mask, dim**-0.5, out=got, num_splits=splits))
        assert torch.equal(got, ops.gqa_attention(q, k, v, mask, dim**-0.5, num_splits=splits))
        kernels = [m for m in (re.search(r"gqa_attention_kernel<([^<>]*)>", name) for name in names) if m]
        assert kernels and all(int(m.group(1).split(",")[-1]) == warps for m in kernels), names  # <T, D, STAGES, WARPS>
        assert any("gqa_attention_combine" in name for name in names) == (min(splits, chunks) > 1), names
    with pytest.raises(ValueError, match="num_splits must be >= 0"):
        ops.gqa_attention(q, k, v, mask, dim**-0.5, num_splits=-2)


# ---- moe_experts ----------------------------------------------------------------------------------

MOE_SHAPES = [  # tokens, top_k, experts, hidden, inter
    (1, 8, 64, 2048, 512),  # Qwen3.6-35B-A3B's sizes (a quarter of its experts): a decode step
    (65, 8, 64, 2048, 512),  # its budget-64 verify block's rows (about 8 an expert)
    (5, 2, 8, 64, 32),
    (17, 4, 6, 128, 16),
    (3, 1, 1, 8, 8),
    (40, 3, 4, 1560, 72),  # K not a multiple of the 64-element K blocks; about 30 pairs an expert: 4 column tiles
    (12, 3, 4, 1560, 72),  # 9 to 16 rows: the two-tile kernels, about 9 pairs an expert
]


def moe_on(case, device):
    return ops.moe_experts(*to(list(case), device))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", MOE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_moe_experts(dtype, shape):
    """Against the reference (run by torch on the GPU) and, where small, the CPU op."""
    case = moe_case(*shape, make_gen(sum(shape)), dtype)
    got = moe_on(case, DEV)
    assert_close(got, reference.moe_experts(*to(list(case), DEV)), dtype, "moe_experts vs reference")
    if shape[3] * shape[4] <= 64 * 64:
        assert_close(got, ops.moe_experts(*case), dtype, "moe_experts vs CPU")
    assert torch.equal(moe_on(case, DEV), got), "not deterministic"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("hidden,inter", [(256, 64), (1560, 72)], ids=["K blocks", "K tails"])
def test_moe_experts_rows_do_not_depend_on_the_batch(dtype, hidden, inter):
    """A token's bits alone, in a batch, in the batch's first 12 rows and in a reordered batch, with one expert serving
    every token (20 pairs: 4 tensor-core column tiles in 16-bit, three chunks of staged rows in float32) and others
    serving one to four: a verify block's rows get a decode step's bits. In 16-bit a token alone (4 pairs) is ranked in
    the projection blocks, 12 rows run the two-tile kernels and 20 the four-tile ones through the route kernel."""
    gen = make_gen(8)
    x, ids, weights, gate_up, down = to(list(moe_case(20, 4, 16, hidden, inter, gen, dtype, crowd=True)), DEV)
    batch = ops.moe_experts(x, ids, weights, gate_up, down)
    for t in range(x.shape[0]):
        alone = ops.moe_experts(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], gate_up, down)
        assert torch.equal(alone, batch[t : t + 1]), f"token {t}"
    assert torch.equal(ops.moe_experts(x[:8], ids[:8], weights[:8], gate_up, down), batch[:8]), "8 rows"
    assert torch.equal(ops.moe_experts(x[:12], ids[:12], weights[:12], gate_up, down), batch[:12]), "12 rows"
    order = torch.randperm(x.shape[0], generator=gen).to(DEV)
    assert torch.equal(ops.moe_experts(x[order], ids[order], weights[order], gate_up, down), batch[order])


@pytest.mark.parametrize("tokens,top_k,experts,crowd", [(0, 2, 8, False), (3, 12, 1500, False), (60, 2, 4, True)],
                         ids=["no tokens", "more experts than route threads", "60 rows on one expert"])
def test_moe_experts_edge_shapes(tokens, top_k, experts, crowd):
    """No tokens (nothing launched), more experts than the route kernel's 1024 threads (runs of experts per thread; 36
    pairs, so the route kernel runs), and one expert serving 60 pairs (two passes of up to 32 over its weights); each
    row alone (ranked in the projection blocks) gives the batch's bits."""
    case = moe_case(tokens, top_k, experts, 64, 32, make_gen(tokens + experts), torch.bfloat16, crowd=crowd)
    got = moe_on(case, DEV)
    assert got.shape == (tokens, 64)
    if tokens:
        assert_close(got, reference.moe_experts(*to(list(case), DEV)), torch.bfloat16)
        alone = torch.cat([moe_on((case[0][t : t + 1], case[1][t : t + 1], case[2][t : t + 1], *case[3:]), DEV)
                           for t in range(tokens)])
        assert torch.equal(alone, got), "rows depend on the batch"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("tokens,hidden,inter", [(6, 64, 32), (20, 1560, 72)])
def test_moe_experts_unaligned_x_gives_the_same_bits(dtype, tokens, hidden, inter):
    x, ids, weights, gate_up, down = to(list(moe_case(tokens, 2, 8, hidden, inter, make_gen(3), dtype)), DEV)
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype, device=DEV)[1:].view(x.shape)
    shifted.copy_(x)
    assert shifted.data_ptr() % 16 != 0
    assert torch.equal(ops.moe_experts(shifted, ids, weights, gate_up, down),
                       ops.moe_experts(x, ids, weights, gate_up, down))


@pytest.mark.parametrize("tokens", [4, 9], ids=["ranked in the blocks", "route kernel"])
def test_moe_experts_graph_replay_with_new_routing(tokens):
    """Captured once, replayed with other tokens routed to other experts (more and fewer experts reached than at
    capture): the routing lives on the device, whether the projection blocks rank the ids (16 pairs over 4 rows) or
    the route kernel lists them (36 over 9)."""
    gen = make_gen(11)
    first = to(list(moe_case(tokens, 4, 32, 128, 64, gen, torch.bfloat16)), DEV)
    x, ids, weights, gate_up, down = (t.clone() for t in first)
    out = torch.empty_like(x)
    ops.moe_experts(x, ids, weights, gate_up, down, out=out)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.moe_experts(x, ids, weights, gate_up, down, out=out)
    for crowd in (False, True, False):
        nx, nids, nweights, _, _ = to(list(moe_case(tokens, 4, 32, 128, 64, gen, torch.bfloat16, crowd=crowd)), DEV)
        x.copy_(nx), ids.copy_(nids), weights.copy_(nweights)
        poison(out)
        graph.replay()
        assert torch.equal(out, ops.moe_experts(nx, nids, nweights, gate_up, down))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [4, 12], ids=["12 pairs", "36 pairs"])
def test_moe_experts_out_of_range_ids_add_nothing(dtype, tokens):
    """An expert id outside [0, E) (the CPU op refuses it; CUDA cannot read it back) reaches no expert: its pair adds
    nothing, the others are right, nothing is read or written out of bounds. In bfloat16, 12 pairs over 4 rows are
    ranked in the projection blocks (no route kernel), 36 go through the route kernel's table."""
    x, ids, weights, gate_up, down = to(list(moe_case(tokens, 3, 8, 64, 32, make_gen(9), dtype)), DEV)
    bad = ids.clone()
    bad[1, 2], bad[3, 0] = 8, -1
    got = ops.moe_experts(x, bad, weights, gate_up, down)
    kept = weights.clone()
    kept[1, 2], kept[3, 0] = 0.0, 0.0
    torch.cuda.synchronize()
    assert_close(got, reference.moe_experts(x, ids, kept, gate_up, down), dtype)


@pytest.mark.parametrize("tokens", [2, 5], ids=["ranked in the blocks", "route kernel"])
def test_moe_experts_repeated_ids(tokens):
    """A token that names one expert for all of its 12 pairs (HF's router never does; the op still adds each pair):
    the expert serves 12 tokens' worth of pairs, more than one pass of the narrowest kernels takes."""
    x, ids, weights, gate_up, down = to(list(moe_case(tokens, 12, 16, 64, 32, make_gen(5), torch.bfloat16)), DEV)
    ids[:] = 3
    got = ops.moe_experts(x, ids, weights, gate_up, down)
    assert_close(got, reference.moe_experts(x, ids, weights, gate_up, down), torch.bfloat16)


def test_moe_experts_matches_hf_grouped_mm_on_real_shapes():
    """Qwen3.6-35B-A3B's experts in bfloat16, HF's default experts forward against the op over a verify block's rows:
    the same values up to the order of the float32 sums (one bfloat16 rounding apart at most here and there)."""
    modeling = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    from ddtree_ext.tiny import tiny_qwen3_5_moe_config

    config = tiny_qwen3_5_moe_config(num_experts=256, num_experts_per_tok=8, hidden_size=2048,
                                     moe_intermediate_size=512, experts_implementation="grouped_mm")
    gen = make_gen(12)
    x, ids, weights, gate_up, down = to(list(moe_case(65, 8, 256, 2048, 512, gen, torch.bfloat16)), DEV)
    with torch.device(DEV):
        module = modeling.Qwen3_5MoeExperts(config).to(torch.bfloat16)
    with torch.no_grad():
        module.gate_up_proj.copy_(gate_up), module.down_proj.copy_(down)
        expected = module(x, ids, weights)
    assert_close(ops.moe_experts(x, ids, weights, module.gate_up_proj, module.down_proj), expected, torch.bfloat16)


def test_moe_experts_cuda_bad_input():
    x, ids, weights, gate_up, down = to(list(moe_case(3, 2, 4, 20, 16, make_gen(2), torch.bfloat16)), DEV)
    with pytest.raises(ValueError, match=r"on CUDA the hidden size H \(20\) and the intermediate size I \(16\) must "
                                         r"be multiples of 8"):
        ops.moe_experts(x, ids, weights, gate_up, down)
    x, ids, weights, gate_up, down = to(list(moe_case(3, 2, 4, 32, 16, make_gen(2), torch.bfloat16)), DEV)
    with pytest.raises(ValueError, match="expert_ids must be on cuda"):
        ops.moe_experts(x, ids.cpu(), weights, gate_up, down)
    odd = torch.empty(gate_up.numel() + 1, dtype=gate_up.dtype, device=DEV)[1:].view(gate_up.shape)
    with pytest.raises(ValueError, match="gate_up_proj must start on a 16-byte boundary"):
        ops.moe_experts(x, ids, weights, odd, down)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("tokens", [1, 9, 65])
@pytest.mark.parametrize("gated", [True, False])
def test_moe_experts_with_shared_expert(dtype, tokens, gated):
    """The shared expert folded into the combine gives HF's block's bits: the routed output, plus torch's own
    sigmoid(gate) * shared, each rounded where torch rounds (the gate's logits a strided column, as in a stacked
    projection's output)."""
    gen = make_gen(tokens)
    case = to(list(moe_case(tokens, 4, 16, 128, 64, gen, dtype)), DEV)
    shared = torch.randn(tokens, 128, generator=gen).to(dtype).to(DEV)
    gate = (2 * torch.randn(tokens, 5, generator=gen)).to(dtype).to(DEV)[:, 1:2] if gated else None
    got = ops.moe_experts(*case, shared=shared, shared_gate=gate)
    routed = ops.moe_experts(*case)
    assert torch.equal(got, routed + (shared if gate is None else torch.sigmoid(gate) * shared))
    odd = torch.empty(shared.numel() + 1, dtype=dtype, device=DEV)[1:].view(shared.shape)
    with pytest.raises(ValueError, match="shared must start on a 16-byte boundary"):
        ops.moe_experts(*case, shared=odd, shared_gate=gate)


# ---- moe_router ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("experts,top_k", [(1, 1), (8, 2), (40, 3), (128, 8), (256, 8), (512, 10), (1000, 32),
                                           (32, 32)])
def test_moe_router(dtype, experts, top_k):
    """Against torch's own CUDA router math (HF's Qwen3_5MoeTopKRouter after its projection): the probabilities at
    every pick are torch's softmax's bits, the weights its renormalised ones summed in pick order, bit for bit, and
    within a rounding of the renormalisation torch sums in its order; the experts the same but for the order among
    exactly tied probabilities (bfloat16 logits tie often). And the CPU op's choice."""
    gen = make_gen(experts + top_k)
    logits = (2 * torch.randn(300, experts, generator=gen)).to(dtype).to(DEV)
    weights, ids = ops.moe_router(logits, top_k)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, hf_ids = torch.topk(probs, top_k, dim=-1)
    total = torch.zeros_like(top[:, 0])
    for k in range(top_k):
        total = total + top[:, k]
    assert torch.equal(probs.gather(1, ids), top), "the picked probabilities: torch's softmax bits, in its order"
    assert torch.equal(weights, (top / total[:, None]).to(dtype)), "the weights"
    assert_close(weights, (top / top.sum(-1, keepdim=True)).to(dtype), dtype, "HF's weights")
    # Rows whose K + 1 largest probabilities all differ: torch's experts, in its order. Elsewhere: ties to the lower
    # id, within the picks and at the K-th place.
    first = torch.topk(probs, min(top_k + 1, experts), dim=-1).values
    untied = (first[:, None, :] == first[:, :, None]).sum((1, 2)) == first.shape[1]
    assert torch.equal(ids[untied], hf_ids[untied]), "ids of rows without ties"
    equal_next = top[:, 1:] == top[:, :-1]
    assert (ids[:, 1:] > ids[:, :-1])[equal_next].all(), "ties in id order"
    last = top[:, -1:]
    below_last_id = torch.arange(experts, device=DEV)[None, :] < ids[:, -1:]
    picked = torch.zeros_like(probs, dtype=torch.bool).scatter(1, ids, True)
    assert not ((probs == last) & below_last_id & ~picked).any(), "a lower id of the K-th probability left out"
    cpu_weights, cpu_ids = ops.moe_router(logits.cpu(), top_k)
    assert_close(weights.cpu(), cpu_weights, dtype, "the CPU op")
    assert torch.equal(probs.gather(1, ids).cpu(), probs.cpu().gather(1, cpu_ids)), "the CPU op's picks"
    again = ops.moe_router(logits, top_k)
    assert torch.equal(again[0], weights) and torch.equal(again[1], ids), "not deterministic"
    unnormalised, same_ids = ops.moe_router(logits, top_k, renormalize=False)
    assert torch.equal(same_ids, ids) and torch.equal(unnormalised, top.to(dtype))


def test_moe_router_ties_and_nan():
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0], [0.0, float("nan"), 1.0, 0.5, 0.0],
                           [0.0, float("-inf"), 1.0, 0.5, 0.0]])
    weights, ids = ops.moe_router(logits.to(DEV), 4)
    cpu_weights, cpu_ids = ops.moe_router(logits, 4)
    assert torch.equal(ids.cpu(), cpu_ids)
    assert ids.tolist()[:2] == [[1, 2, 4, 3], [0, 1, 2, 3]] and ids[2].tolist() == [0, 1, 2, 3]
    assert torch.equal(weights[0].cpu(), cpu_weights[0]) and weights[2].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_block_fused_forward_on_the_gpu(dtype, monkeypatch):
    """A sparse MoE block of 64 experts (8 a token, H 256) with its projections stacked (an odd stacked width:
    2 x 128 + 64 + 1 outputs), fused (ops.moe_router, the shared expert folded into ops.moe_experts; counted) against
    HF's own block forward (grouped_mm experts) over a decode step's row and a verify block's: float32 up to the
    roundings of the sums' orders; bfloat16 the same values but where a rounding, or a tie among bfloat16 router
    logits broken the other way, flips them (a few percent)."""
    modeling = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    from ddtree_ext import fused
    from ddtree_ext.tiny import tiny_qwen3_5_moe_config

    config = tiny_qwen3_5_moe_config(num_experts=64, num_experts_per_tok=8, hidden_size=256, moe_intermediate_size=128,
                                     shared_expert_intermediate_size=128, experts_implementation="grouped_mm")
    gen = make_gen(21)
    block = modeling.Qwen3_5MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    block = block.to(DEV, dtype).requires_grad_(False)
    fused.stack_projections(block)
    routes = []
    stock = ops.moe_router
    monkeypatch.setattr(ops, "moe_router", lambda *a, **k: routes.append(1) or stock(*a, **k))
    for tokens in (1, 65):
        x = torch.randn(1, tokens, 256, generator=gen).to(DEV, dtype)
        with torch.no_grad():
            expected = type(block).forward(block, x)
            with fused.LayerFusion(block).active():
                got = block(x)
        if dtype == torch.float32:
            assert_close(got, expected, dtype, f"{tokens} rows")
        else:
            assert (got != expected).float().mean() < 0.1, f"{tokens} rows"
    assert len(routes) == 2


def test_moe_router_rows_do_not_depend_on_the_batch():
    logits = (2 * torch.randn(70, 300, generator=make_gen(4))).to(torch.bfloat16).to(DEV)[:, 20:276]
    weights, ids = ops.moe_router(logits, 8)
    for t in (0, 1, 33, 69):
        alone = ops.moe_router(logits[t : t + 1], 8)
        assert torch.equal(alone[0], weights[t : t + 1]) and torch.equal(alone[1], ids[t : t + 1]), t


def test_moe_router_cuda_limits():
    with pytest.raises(ValueError, match="on CUDA the number of experts E must be at most 1024, got 1025"):
        ops.moe_router(torch.randn(2, 1025, device=DEV), 2)
    with pytest.raises(ValueError, match="on CUDA top_k must be at most 32, got 33"):
        ops.moe_router(torch.randn(2, 64, device=DEV), 33)


# ---- projections ------------------------------------------------------------------------------------


def linear_kernel_applies(rows: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether ops.linear takes its kernel on this GPU and build (the conditions of csrc/linear_cuda.cu for
    aligned inputs): 16-bit, <= 72 rows, N % 32 == 0, K % 64 == 0, compute capability >= 9.0 in device and build."""
    return (dtype != torch.float32 and rows <= 72 and n % 32 == 0 and k % 64 == 0
            and torch.cuda.get_device_capability()[0] >= 9 and built_for_hopper())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(
    "rows,n,k",
    [
        (1, 5120, 6144),    # 27B decode step, the GDN out_proj: 40 tiles, K split over 6 CTAs of a cluster (132 SMs)
        (65, 1024, 5120),   # 27B verify at budget 64, k_proj: 8 tiles, 7 splits of 12 chunks (the last 8)
        (16, 4096, 4096),   # a DFlash block through Qwen3-8B-sized projections: 32 tiles, 8 splits
        (72, 17408, 64),    # the most rows the kernel takes, a single chunk of K (one split)
        (9, 160, 832),      # N not a multiple of the 128-feature CTA (the last CTA's last warps idle); 13 chunks
                            # (no groups of 2 or 4) over 7 splits (the last split shorter)
        (33, 96, 17408),    # the down_proj's K: 272 chunks, 8 splits of 36 (the last 20)
        (73, 256, 512),     # more rows than the kernel takes: torch.mm
        (5, 100, 64),       # N not a multiple of 32: torch.mm
        (5, 128, 100),      # K not a multiple of 64: torch.mm
    ],
)
def test_linear_op(rows, n, k, dtype):
    """The CUDA op (weight-streaming kernel for 16-bit inputs that fit it, torch.mm otherwise) against the CPU op
    and the float64 reference; x rows taken from a wider buffer, out poisoned and written as a strided view."""
    gen = make_gen(rows * 7 + n + k)
    x_wide = torch.randn(rows, k + 64, generator=gen).to(dtype)
    x = x_wide[:, 32:32 + k]  # rows 16-byte aligned, a row stride that is not K
    weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
    expected_cpu = ops.linear(x, weight)
    expected_ref = reference.linear(x, weight)
    out_wide = poison(torch.empty(rows, n + 32, dtype=dtype, device=DEV))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = ops.linear(x_wide.to(DEV)[:, 32:32 + k], weight.to(DEV), out=out_wide[:, :n])
        torch.cuda.synchronize()
    ran_kernel = any("linear_rows_kernel" in e.name for e in prof.events())
    assert ran_kernel == linear_kernel_applies(rows, n, k, dtype), "kernel versus torch.mm path"
    assert torch.isnan(out_wide[:, n:]).all(), "wrote past the output view"
    assert_close(got, expected_cpu, dtype, "vs CPU op")
    assert_close(got, expected_ref, dtype, "vs reference")


def test_linear_unaligned_inputs_take_torch_mm():
    """x rows not 16-byte aligned, x rows less than K apart (one row expanded), a weight whose rows are not contiguous
    with each other, out rows not 8-byte aligned: each takes torch.mm (no kernel launch), with the same results."""
    gen = make_gen(33)
    x_wide = torch.randn(5, 520, generator=gen).to(torch.bfloat16).to(DEV)
    w_wide = (torch.randn(256, 576, generator=gen) * 0.05).to(torch.bfloat16).to(DEV)
    out_wide = torch.empty(5, 260, dtype=torch.bfloat16, device=DEV)
    aligned_x, aligned_w = x_wide[:, :512], w_wide[:, :512].contiguous()
    for x, w, out in ((x_wide[:, 1:513], aligned_w, None), (aligned_x[:1].expand(5, 512), aligned_w, None),
                      (aligned_x, w_wide[:, :512], None), (aligned_x, aligned_w, out_wide[:, 1:257])):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = ops.linear(x, w, out=out)
            torch.cuda.synchronize()
        assert not any("linear_rows_kernel" in e.name for e in prof.events())
        assert_close(got, reference.linear(x, w), torch.bfloat16)


def test_linear_rows_do_not_depend_on_the_other_rows():
    """The split of K depends on (N, K) alone and each output column on its own x row: a row gives the same bits
    alone (a decode step), in a DFlash block or in a 65-node verify, at any position among the rows."""
    gen = make_gen(31)
    for n, k in ((5120, 6144), (1024, 5120), (256, 832)):
        x = torch.randn(72, k, generator=gen).to(torch.bfloat16).to(DEV)
        weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(torch.bfloat16).to(DEV)
        full = ops.linear(x, weight)
        # every column-tile count 1..9 (17, 25, 41, 49 and 57 rows among them)
        for lo, hi in ((0, 1), (5, 6), (0, 16), (0, 17), (3, 28), (0, 33), (0, 41), (8, 57), (0, 57), (7, 72), (0, 65),
                       (64, 65)):
            assert torch.equal(ops.linear(x[lo:hi], weight), full[lo:hi]), (n, k, lo, hi)


def test_linear_prefetch_weight_gives_the_same_bits():
    """prefetch_weight only moves the first weight reads before the preceding kernel's end: the same bits, eagerly
    and replayed from a graph right after the kernel that writes x."""
    gen = make_gen(34)
    for rows, n, k in ((1, 1024, 5120), (65, 4096, 4096), (16, 160, 832)):
        x0 = torch.randn(rows, k, generator=gen).to(torch.bfloat16).to(DEV)
        weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(torch.bfloat16).to(DEV)
        expected = ops.linear(x0 * 2, weight)
        x = torch.empty_like(x0)
        assert torch.equal(ops.linear(torch.mul(x0, 2, out=x), weight, prefetch_weight=True), expected)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.mul(x0, 2, out=x)
            got = ops.linear(x, weight, prefetch_weight=True)
        x.zero_()
        graph.replay()
        assert torch.equal(got, expected), (rows, n, k)


def test_linear_after_a_side_stream_kernel():
    """A programmatic launch waits for everything before it, also for x written on another stream and joined by an
    event (eagerly, and replayed from a graph where the join is an edge), and for a memset before it."""
    gen = make_gen(35)
    x0 = torch.randn(16, 4096, generator=gen).to(torch.bfloat16).to(DEV)
    weight = (torch.randn(1024, 4096, generator=gen) * 4096**-0.5).to(torch.bfloat16).to(DEV)
    expected = ops.linear(x0 * 3, weight)
    x = torch.empty_like(x0)
    side = torch.cuda.Stream()

    def run():
        x.zero_()  # a memset, then the side stream's kernel writes x
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.mul(x0, 3, out=x)
        torch.cuda.current_stream().wait_stream(side)
        return ops.linear(x, weight, prefetch_weight=True)

    assert torch.equal(run(), expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = run()
    x.fill_(float("nan"))
    graph.replay()
    assert torch.equal(got, expected)


def _gemm_chain(x: torch.Tensor, gen: torch.Generator, layers: int = 4):
    """An MLP-like chain on x [rows, 2048]: per layer our rms_norm, a cuBLAS GEMM, our silu_mul, a cuBLAS GEMM, so that
    each of our kernels is a programmatic dependent of a GEMM whose output it reads; returns the chain as a function."""
    hidden, inner = x.shape[1], 4 * x.shape[1]
    weights = [((torch.randn(2 * inner, hidden, generator=gen) * 0.02).to(torch.bfloat16).to(DEV),
                (torch.randn(hidden, inner, generator=gen) * 0.02).to(torch.bfloat16).to(DEV)) for _ in range(layers)]
    norm_weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16).to(DEV)

    def run() -> torch.Tensor:
        h = x
        for up, down in weights:
            gate_up = torch.mm(ops.rms_norm(h, norm_weight, 1e-6), up.t())
            h = torch.mm(ops.silu_mul(gate_up[:, :inner], gate_up[:, inner:]), down.t())
        return ops.rms_norm(h, norm_weight, 1e-6)

    return run


@pytest.mark.parametrize("rows", [1, 65])
def test_graph_launch_order_edges_keep_kernels_after_gemms_exact(rows):
    """ddtree_ext.round's captured rounds move their programmatic edges to the upstream kernel's launch-order port, so
    that a kernel of ours after a cuBLAS GEMM launches while the GEMM runs (csrc/graph_cuda.cpp). Each of our kernels
    must still wait for the GEMM's output: replayed 30 times, each time with new inputs, the chain gives eager's bits
    (a kernel that read before the GEMM was done would see the previous replay's rows)."""
    from ddtree_ext._loader import load_extension

    gen = make_gen(43)
    x = torch.empty(rows, 2048, dtype=torch.bfloat16, device=DEV)
    run = _gemm_chain(x, gen)
    inputs = [torch.randn(rows, 2048, generator=gen).to(torch.bfloat16).to(DEV) for _ in range(30)]
    x.copy_(inputs[-1])
    run()  # warm-up: cuBLAS's handles and workspaces before capture
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        got = run()
    moved = load_extension().graph_launch_order_edges(graph.raw_cuda_graph())
    if programmatic_launches():  # else no edge is programmatic, and none moves
        assert moved >= 8  # the edge into each kernel of ours after a GEMM (the first norm is the graph's root)
    graph.instantiate()
    for new in inputs:
        x.copy_(new)
        expected = run().clone()
        poison(got)
        graph.replay()
        assert torch.equal(got, expected)


def test_graph_launch_order_edges_argument_check():
    from ddtree_ext._loader import load_extension

    with pytest.raises(ValueError, match="graph_handle"):
        load_extension().graph_launch_order_edges(0)


def test_programmatic_launches_as_the_core_decides():
    """The core's answer against its rule (compute capability 9.0 in device and build, CUDA 12.3, no DDTREE_NO_PDL=1),
    the switch in a fresh process, and the device index check."""
    import os
    import subprocess
    import sys

    from ddtree_ext._loader import load_extension

    core = load_extension()
    cuda_version = tuple(int(v) for v in build_info()["cuda_version"].split("."))
    expected = (torch.cuda.get_device_capability()[0] >= 9 and built_for_hopper() and cuda_version >= (12, 3)
                and os.environ.get("DDTREE_NO_PDL", "") != "1")
    assert core.programmatic_launches(torch.cuda.current_device()) == expected
    probe = "from ddtree_ext._loader import load_extension; print(load_extension().programmatic_launches(0))"
    env = dict(os.environ, DDTREE_NO_PDL="1")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", done.stderr
    for bad in (-1, torch.cuda.device_count()):
        with pytest.raises(ValueError, match="device_index must be a CUDA device index"):
            core.programmatic_launches(bad)


def test_linear_rows_with_infinities_stay_in_their_rows():
    """A row of infinities gives inf/NaN in its own output row only (the columns of the tensor-core products are
    independent, and rows past M read zeros)."""
    gen = make_gen(32)
    x = torch.randn(11, 512, generator=gen).to(torch.bfloat16).to(DEV)
    x[4] = float("inf")
    weight = (torch.randn(256, 512, generator=gen) * 0.05).to(torch.bfloat16).to(DEV)
    got = ops.linear(x, weight)
    finite = torch.ones(11, dtype=torch.bool)
    finite[4] = False
    assert torch.isfinite(got[finite.to(DEV)]).all()
    assert not torch.isfinite(got[4]).any()
    assert_close(got[finite.to(DEV)], reference.linear(x[finite.to(DEV)], weight), torch.bfloat16)


# ---- linear_gemv ---------------------------------------------------------------------------------


def _gemv_kernel_ran(prof) -> bool:
    return any("linear_gemv_kernel" in e.name for e in prof.events())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "n,k",
    [
        (1024, 5120),    # 27B K/V projection: few rows, so two or four warps a row
        (10240, 5120),   # 27B GDN qkv
        (4097, 256),     # on an H200 (about 4200 resident warps) a warp a row, rows past N in the last block
        (6143, 512),     # on an H200 two warps a row, an odd N
        (5120, 17408),   # 27B down projection: 2176 chunks a row
        (37, 72),        # N no block divides, K of 9 chunks (fewer than a lane group)
        (1, 4096),       # a single output
        (64, 100),       # K not a multiple of 8: torch.mm
    ],
)
def test_linear_gemv_op(n, k, dtype):
    """The CUDA op (the CUDA-core kernel for 16-bit inputs that fit it, torch.mm otherwise) against the CPU op and the
    float64 reference, deterministic; x a row of a wider buffer, out poisoned and written as a strided view."""
    gen = make_gen(n + k)
    x_wide = torch.randn(1, k + 64, generator=gen).to(dtype)
    x = x_wide[:, 32:32 + k]
    weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
    out_wide = poison(torch.empty(1, n + 32, dtype=dtype, device=DEV))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = ops.linear_gemv(x_wide.to(DEV)[:, 32:32 + k], weight.to(DEV), out=out_wide[:, :n])
        torch.cuda.synchronize()
    assert _gemv_kernel_ran(prof) == (dtype != torch.float32 and k % 8 == 0), "kernel versus torch.mm path"
    assert torch.isnan(out_wide[:, n:]).all(), "wrote past the output view"
    assert_close(got, ops.linear_gemv(x, weight), dtype, "vs CPU op")
    assert_close(got, reference.linear(x, weight), dtype, "vs reference")
    again = ops.linear_gemv(x.to(DEV), weight.to(DEV), prefetch_weight=True)
    assert torch.equal(again, got), "not deterministic (or prefetch_weight changed the bits)"


def test_linear_gemv_strided_and_unaligned_weights():
    """A row block of a stacked weight (rows further apart than K) runs the kernel; a weight or x that is not 16-byte
    aligned takes torch.mm; both match the reference."""
    gen = make_gen(51)
    stacked = (torch.randn(96, 1088, generator=gen) * 0.03).to(torch.bfloat16).to(DEV)
    x_wide = torch.randn(1, 1100, generator=gen).to(torch.bfloat16).to(DEV)
    cases = (
        (x_wide[:, :1024], stacked[32:80, :1024], True),   # rows 1088 apart, aligned
        (x_wide[:, 1:1025], stacked[32:80, :1024], False),  # x not 16-byte aligned
        (x_wide[:, :1024], stacked[32:80, 4:1028], False),  # weight not 16-byte aligned
    )
    for x, w, kernel in cases:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = ops.linear_gemv(x, w)
            torch.cuda.synchronize()
        assert _gemv_kernel_ran(prof) == kernel
        assert_close(got, reference.linear(x, w), torch.bfloat16)


def test_linear_gemv_waits_for_the_kernel_writing_x():
    """With prefetch_weight the weight streams before the kernel ahead is done, x never: replayed right after the
    kernel that writes x (and after a side stream's kernel joined by an edge), the eager bits."""
    gen = make_gen(52)
    x0 = torch.randn(1, 5120, generator=gen).to(torch.bfloat16).to(DEV)
    weight = (torch.randn(6144, 5120, generator=gen) * 5120**-0.5).to(torch.bfloat16).to(DEV)
    x = torch.empty_like(x0)
    side = torch.cuda.Stream()

    def run(scale):
        torch.mul(x0, scale, out=x)
        first = ops.linear_gemv(x, weight, prefetch_weight=True)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.mul(x0, -scale, out=x)
        torch.cuda.current_stream().wait_stream(side)
        return first, ops.linear_gemv(x, weight, prefetch_weight=True)

    expected = ops.linear_gemv(x0 * 2, weight), ops.linear_gemv(x0 * -2, weight)
    assert all(torch.equal(a, b) for a, b in zip(run(2.0), expected))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = run(2.0)
    for _ in range(3):
        x.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


# ---- linear_cublaslt and gemm_tuning -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "rows,n,k",
    [
        (1, 1024, 5120),   # a decode step's K/V projection at 27B widths
        (17, 768, 1024),   # a DFlash block + 1
        (65, 512, 2048),   # a budget-64 verify
        (3, 100, 72),      # sizes no tile divides
    ],
)
def test_linear_cublaslt_every_candidate(rows, n, k, dtype):
    """Every cuBLASLt candidate against the float64 reference, twice with the same bits: x rows from a wider
    buffer, the weight a row block of a stacked tensor, out a strided view (nothing written past it)."""
    gen = make_gen(rows + n + k)
    x = torch.randn(rows, k + 64, generator=gen).to(dtype).to(DEV)[:, 32:32 + k]
    stacked = (torch.randn(n + 64, k, generator=gen) * k**-0.5).to(dtype).to(DEV)
    weight = stacked[32:32 + n]
    expected = reference.linear(x, weight)
    out_wide = torch.empty(rows, n + 32, dtype=dtype, device=DEV)
    out = out_wide[:, :n]
    count = ops.linear_cublaslt_algorithms(x, weight, out)
    assert count >= 1, "cuBLASLt offered no algorithm"
    for algorithm in range(count):
        poison(out_wide)
        ops.linear_cublaslt(x, weight, algorithm, out=out)
        first = out.clone()
        assert torch.isnan(out_wide[:, n:]).all(), f"algorithm {algorithm} wrote past the output view"
        assert_close(first, expected, dtype, f"algorithm {algorithm}: {ops.linear_cublaslt_describe(x, weight, algorithm, out)}")
        ops.linear_cublaslt(x, weight, algorithm, out=out)
        assert torch.equal(out, first), f"algorithm {algorithm} is not deterministic"
    with pytest.raises(ValueError, match=rf"linear_cublaslt: algorithm must be in \[0, {count}\)"):
        ops.linear_cublaslt(x, weight, count, out=out)


def test_linear_cublaslt_replays_from_a_graph_on_a_side_stream():
    """Captured (workspace from the graph's pool) and replayed on new inputs: the eager bits, every candidate, also
    on a second stream that waits for the kernel writing x."""
    gen = make_gen(41)
    x0 = torch.randn(65, 4096, generator=gen).to(torch.bfloat16).to(DEV)
    weight = (torch.randn(6144, 4096, generator=gen) * 0.02).to(torch.bfloat16).to(DEV)
    x = torch.empty_like(x0)
    count = ops.linear_cublaslt_algorithms(x, weight)
    outs = [torch.empty(65, 6144, dtype=torch.bfloat16, device=DEV) for _ in range(count)]
    side = torch.cuda.Stream()
    for algorithm in range(count):  # warm-up outside the capture
        ops.linear_cublaslt(x0, weight, algorithm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mul(x0, 2, out=x)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for algorithm in range(count):
                ops.linear_cublaslt(x, weight, algorithm, out=outs[algorithm])
        torch.cuda.current_stream().wait_stream(side)
    for scale in (1.0, -3.0):
        x0.mul_(scale)
        graph.replay()
        torch.cuda.synchronize()
        for algorithm in range(count):
            assert torch.equal(outs[algorithm], ops.linear_cublaslt(x0 * 2, weight, algorithm)), algorithm


def test_gemm_tuning_picks_once_per_problem(monkeypatch):
    """fused.project with gemm_tuning on, inside round_shapes: a problem is timed at its first sight (one record,
    F.linear's results up to rounding), then reused; a single row's stride does not make a new problem; a problem
    first seen inside a capture keeps F.linear, also in later eager calls; outside round_shapes, and for float32 or
    CPU tensors, nothing is tuned."""
    from ddtree_ext import fused, gemm_tuning

    monkeypatch.setattr(gemm_tuning, "enabled", True)
    monkeypatch.setattr(gemm_tuning, "MARGIN", -math.inf)  # take the fastest candidate: the cuBLASLt path runs
    gemm_tuning.reset()
    gen = make_gen(42)
    weight = (torch.randn(1024, 2048, generator=gen) * 0.02).to(torch.bfloat16).to(DEV)
    x = torch.randn(2, 9, 2048, generator=gen).to(torch.bfloat16).to(DEV)
    with torch.no_grad():
        assert torch.equal(fused.project(weight, x), F.linear(x, weight)) and gemm_tuning.picks() == []
        with gemm_tuning.round_shapes():
            got = fused.project(weight, x)
            picks = gemm_tuning.picks()
            assert len(picks) == 1 and picks[0]["rows"] == 18 and picks[0]["pick"] is not None, picks
            assert picks[0]["candidates"] >= 1 and picks[0]["pick_us"] <= picks[0]["best_candidate_us"] + 1e-9
            assert_close(got, F.linear(x, weight), torch.bfloat16)
            assert torch.equal(fused.project(weight, x), got)
            assert len(gemm_tuning.picks()) == 1, "timed twice"
            row = fused.project(weight, x[0, 3])  # one row
            assert len(gemm_tuning.picks()) == 2
            lone = fused.project(weight, x[0, ::2][:1])  # one row of a view with row stride 2 * 2048
            assert len(gemm_tuning.picks()) == 2, "a single row's stride made a new problem"
            strided = fused.project(weight, x[:, 3])  # two rows 9 * 2048 apart
            assert len(gemm_tuning.picks()) == 3
            assert_close(row, F.linear(x[0, 3], weight), torch.bfloat16)
            assert_close(lone, F.linear(x[0, :1], weight), torch.bfloat16)
            assert_close(strided, F.linear(x[:, 3], weight), torch.bfloat16)
            graph = torch.cuda.CUDAGraph()
            x5 = x[:, :5]
            with torch.cuda.graph(graph):
                captured = fused.project(weight, x5)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, F.linear(x5, weight))
            assert len(gemm_tuning.picks()) == 3, "a problem first seen during capture was timed"
            assert torch.equal(fused.project(weight, x5), captured), "eager differs from the graph"
            assert len(gemm_tuning.picks()) == 3
            fused.project(weight.float(), x.float())
            fused.project(weight.cpu(), x.cpu())
            assert len(gemm_tuning.picks()) == 3
    gemm_tuning.reset()
    assert gemm_tuning.picks() == []


# ---- CUDA graphs and determinism ---------------------------------------------------------------


class OpCase(NamedTuple):
    """inputs(gen) -> fresh CUDA tensors (the op may update some in place);
    run(inputs) -> the tensors the op wrote (allocated inside run, or updated inputs)."""

    inputs: Callable[[torch.Generator], Dict[str, torch.Tensor]]
    run: Callable[[Dict[str, torch.Tensor]], List[torch.Tensor]]


def _case_topk():
    def inputs(gen):
        return dict(logits=(torch.randn(2, 15, 4099, generator=gen) * 3).to(torch.bfloat16).to(DEV))

    return OpCase(inputs, lambda x: list(ops.topk_logprobs(x["logits"], 8)))


def _case_build():
    def inputs(gen):
        logp, tokens = random_topk(2, 15, 8, gen, ties=True)
        return dict(logp=logp.to(DEV), tokens=tokens.to(DEV), root=torch.randint(0, 9, (2,), generator=gen).to(DEV),
                    prefix=torch.randint(0, 99, (2,), generator=gen).to(DEV))

    def run(x):
        tree = ops.build_tree(x["logp"], x["tokens"], x["root"], x["prefix"], 64)
        return [*tree, ops.tree_attention_mask(tree.ancestor_mask, x["prefix"], 200)]

    return OpCase(inputs, run)


def _case_conv():
    def inputs(gen):
        x, weight, b, conv_state, parent = conv_inputs(2, 65, 256, 4, 3, torch.bfloat16, gen)
        return dict(x=x.to(DEV), weight=weight.to(DEV), bias=b.to(DEV), conv_state=conv_state.to(DEV), parent=parent.to(DEV))

    return OpCase(inputs, lambda x: [ops.tree_conv1d(x["x"], x["weight"], x["bias"], x["conv_state"], x["parent"])])


def _case_gdn():
    def inputs(gen):
        return {k: v.to(DEV) for k, v in gdn_inputs(2, 65, 2, 6, 128, 128, torch.bfloat16, gen)._asdict().items()}

    return OpCase(inputs, lambda x: list(ops.tree_gated_delta_rule(*(x[f] for f in GDNInputs._fields))))


def _case_walk_greedy():
    def inputs(gen):
        tree = built_tree(2, 64, gen)
        return {**{f: t.to(DEV) for f, t in tree._asdict().items()}, "target": walk_targets(tree, gen).to(DEV)}

    return OpCase(inputs, lambda x: list(ops.walk_greedy(Tree(*(x[f] for f in Tree._fields)), x["target"], 9)))


def _case_row_argmax():
    def inputs(gen):
        return {"x": argmax_rows(65, 20000, torch.bfloat16, gen, ties=True).to(DEV),
                "one": argmax_rows(1, 20000, torch.bfloat16, gen).to(DEV)}

    return OpCase(inputs, lambda x: [ops.row_argmax(x["x"]), ops.row_argmax(x["one"])])


def _case_walk_sample(top_k, top_p, min_p=0.0):
    def inputs(gen):
        tree, logits = sample_case(2, 33, 3000, gen)
        return {**{f: t.to(DEV) for f, t in tree._asdict().items()}, "logits": logits.to(DEV),
                "uniform": torch.rand(2, 9, generator=gen).to(DEV)}

    def run(x):
        tree = Tree(*(x[f] for f in Tree._fields))
        return list(ops.walk_sample(tree, x["logits"], x["uniform"], temperature=0.8, top_k=top_k, top_p=top_p,
                                    min_p=min_p))

    return OpCase(inputs, run)


def _case_commit():
    def inputs(gen):
        states, stashes, accepted, accept_len = gdn_commit_case([(2, 4, 32, 32)] * 2, 2, 17, 6, gen)
        conv = [torch.randn(2, 64, 3, generator=gen) for _ in range(2)]
        xs = [torch.randn(2, 17, 64, generator=gen) for _ in range(2)]
        kv = [torch.randn(2, 2, 64, 32, generator=gen).to(torch.bfloat16) for _ in range(2)]
        tensors = dict(accepted=accepted, accept_len=accept_len, prefix=torch.tensor([3, 20]),
                       gather_src=torch.randn(2, 17, 48, generator=gen))
        for l in range(2):
            tensors.update({f"state{l}": states[l], f"u{l}": stashes[l].stash_u, f"k{l}": stashes[l].stash_k,
                            f"cumg{l}": stashes[l].stash_cumg, f"conv{l}": conv[l], f"x{l}": xs[l], f"kv{l}": kv[l]})
        return {k: v.to(DEV) for k, v in tensors.items()}

    def run(x):
        path = (x["accepted"], x["accept_len"])
        states = [x["state0"], x["state1"]]
        ops.commit_gdn_state(states, [x["u0"], x["u1"]], [x["k0"], x["k1"]], [x["cumg0"], x["cumg1"]], *path)
        ops.commit_conv_state([x["conv0"], x["conv1"]], [x["x0"], x["x1"]], *path)
        ops.commit_kv([x["kv0"], x["kv1"]], x["prefix"], *path)
        gathered = ops.gather_rows(x["gather_src"], *path)
        return [*states, x["conv0"], x["conv1"], x["kv0"], x["kv1"], gathered]

    return OpCase(inputs, run)


def _case_layer():
    def inputs(gen):
        x = torch.randn(65, 5120, generator=gen).to(torch.bfloat16)
        heads = torch.randn(65, 48, 128, generator=gen).to(torch.bfloat16)
        return {k: v.to(DEV) for k, v in dict(
            x=x, weight=torch.randn(5120, generator=gen).to(torch.bfloat16), heads=heads,
            gate=torch.randn(65, 48, 128, generator=gen).to(torch.bfloat16),
            head_weight=torch.randn(128, generator=gen).to(torch.bfloat16),
            up=torch.randn(65, 5120, generator=gen).to(torch.bfloat16),
            wa=(torch.randn(48, 5120, generator=gen) * 0.05).to(torch.bfloat16),
            wb=(torch.randn(48, 5120, generator=gen) * 0.05).to(torch.bfloat16),
            A_log=torch.randn(48, generator=gen), dt_bias=torch.randn(48, generator=gen).to(torch.bfloat16),
            q=torch.randn(1, 65, 24, 256, generator=gen).to(torch.bfloat16).transpose(1, 2),
            cos=torch.rand(1, 65, 64, generator=gen).to(torch.bfloat16),
            sin=torch.rand(1, 65, 64, generator=gen).to(torch.bfloat16),
            k=torch.randn(1, 65, 4, 256, generator=gen).to(torch.bfloat16),
            q_weight=torch.randn(256, generator=gen).to(torch.bfloat16),
            k_weight=torch.randn(256, generator=gen).to(torch.bfloat16),
        ).items()}

    def run(x):
        return [
            ops.rms_norm(x["x"], x["weight"], 1e-6, zero_centered=True),
            ops.rms_norm(x["heads"], x["head_weight"], 1e-6, gate=x["gate"]),
            *ops.add_rms_norm(x["x"], x["up"], x["weight"], 1e-6),
            ops.silu_mul(x["x"], x["up"]),
            *ops.gdn_gates(x["x"], x["wa"], x["wb"], x["A_log"], x["dt_bias"]),
            ops.rope(x["q"], x["cos"], x["sin"]),
            *ops.qk_norm_rope(x["q"].transpose(1, 2), x["k"], x["q_weight"], x["k_weight"], x["cos"], x["sin"], 1e-6,
                              zero_centered=True),
            ops.sigmoid_mul(x["gate"], x["heads"]),
        ]

    return OpCase(inputs, run)


def _case_attention():
    def inputs(gen):
        q = torch.randn(1, 24, 65, 256, generator=gen).to(torch.bfloat16)
        k, v = (torch.randn(1, 4, 700, 256, generator=gen).to(torch.bfloat16) for _ in range(2))
        mask = torch.rand(1, 1, 65, 700, generator=gen) > 0.3
        return dict(q=q.to(DEV), k=k.to(DEV), v=v.to(DEV), mask=mask.to(DEV))

    return OpCase(inputs, lambda x: [ops.gqa_attention(x["q"], x["k"], x["v"], x["mask"], 0.0625)])


def _case_linear():
    def inputs(gen):
        x = torch.randn(65, 5120, generator=gen).to(torch.bfloat16)
        weight = (torch.randn(1024, 5120, generator=gen) * 0.02).to(torch.bfloat16)
        return dict(x=x.to(DEV), weight=weight.to(DEV))

    return OpCase(inputs, lambda x: [ops.linear(x["x"], x["weight"]), ops.linear(x["x"][:1], x["weight"])])


OP_CASES = {
    "topk_logprobs": _case_topk,
    "build_tree+mask": _case_build,
    "tree_conv1d": _case_conv,
    "tree_gated_delta_rule": _case_gdn,
    "walk_greedy": _case_walk_greedy,
    "row_argmax": _case_row_argmax,
    "walk_sample_top_k": functools.partial(_case_walk_sample, 20, 0.9),
    "walk_sample_full": functools.partial(_case_walk_sample, 0, 1.0),
    "walk_sample_top_p": functools.partial(_case_walk_sample, 0, 0.9),
    "walk_sample_top_k_beyond_lists": functools.partial(_case_walk_sample, 100, 0.9),
    "walk_sample_min_p": functools.partial(_case_walk_sample, 0, 1.0, 0.1),
    "walk_sample_top_k_min_p": functools.partial(_case_walk_sample, 20, 0.9, 0.1),
    "commit": _case_commit,
    "layer": _case_layer,
    "gqa_attention": _case_attention,
    "linear": _case_linear,
}


def clone_inputs(x):
    return {k: v.clone() for k, v in x.items()}


@pytest.mark.parametrize("name", OP_CASES)
def test_cuda_graph_replay(name):
    """Captured once, replayed with new inputs copied into the static buffers: same as eager."""
    case = OP_CASES[name]()
    static = case.inputs(make_gen(1))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        case.run(clone_inputs(static))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = case.run(static)
    for seed in (2, 3):
        fresh = case.inputs(make_gen(seed))
        for t in captured:
            poison(t)
        for key, t in fresh.items():  # after poisoning: in-place ops' outputs are inputs too
            static[key].copy_(t)
        graph.replay()
        expected = case.run(clone_inputs(fresh))
        torch.cuda.synchronize()
        for i, (a, e) in enumerate(zip(captured, expected)):
            assert torch.equal(a, e), f"{name}: output {i} differs from eager after replay"


@pytest.mark.parametrize("name", OP_CASES)
def test_deterministic(name):
    case = OP_CASES[name]()
    x = case.inputs(make_gen(5))
    first = case.run(clone_inputs(x))
    second = case.run(clone_inputs(x))
    for i, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), f"{name}: output {i} differs between two runs"


# ---- a long run ------------------------------------------------------------------------------------


def test_long_hybrid_stack_rounds():
    """200 rounds of tree verify + commit on a small stack of GDN layers (conv -> gated delta rule ->
    projection into the next layer) plus an attention KV cache, float32, CUDA and CPU in lockstep.
    The states evolve from the ops' own outputs, so differences would compound; the GDN recurrence
    is contractive (decays <= 1, normalised keys), and the states must stay within 1e-4."""
    gen = make_gen(2024)
    bsz, n, layers, rounds, max_accept = 2, 9, 3, 200, 5
    heads, value_heads, kdim, vdim, width = 2, 4, 16, 16, 4
    channels = 2 * heads * kdim + value_heads * vdim
    weights = [(torch.randn(channels, width, generator=gen) * 0.5) for _ in range(layers)]
    proj = [torch.randn(value_heads * vdim, channels, generator=gen) * 0.2 for _ in range(layers)]
    slots = rounds * max_accept + n + 8
    init = dict(
        conv=[torch.randn(bsz, channels, width - 1, generator=gen) for _ in range(layers)],
        gdn=[torch.randn(bsz, value_heads, kdim, vdim, generator=gen) * 0.1 for _ in range(layers)],
        kv=[torch.zeros(bsz, 2, slots, 8)],
    )
    sides = {dev: {key: [t.to(dev) for t in val] for key, val in init.items()} for dev in ("cpu", DEV)}
    prefix = torch.zeros(bsz, dtype=torch.long)
    for r in range(rounds):
        parent = torch.stack([random_parents(n, gen, "random", 4) for _ in range(bsz)])
        h0 = torch.randn(bsz, n, channels, generator=gen)
        gates = [(-torch.rand(bsz, n, value_heads, generator=gen) * 2, torch.rand(bsz, n, value_heads, generator=gen))
                 for _ in range(layers)]
        kv_rows = torch.randn(bsz, 2, n, 8, generator=gen)
        accepted, accept_len = random_paths(parent, max_accept, gen)
        for dev, side in sides.items():
            par, h, xs, stashes = parent.to(dev), h0.to(dev), [], []
            for l in range(layers):
                xs.append(h)
                y = ops.tree_conv1d(h, weights[l].to(dev), None, side["conv"][l], par)
                q, k, v = y.split([heads * kdim, heads * kdim, value_heads * vdim], dim=-1)
                q, k = q.reshape(bsz, n, heads, kdim), k.reshape(bsz, n, heads, kdim)
                v = v.reshape(bsz, n, value_heads, vdim)
                g, beta = (t.to(dev) for t in gates[l])
                res = ops.tree_gated_delta_rule(q, k, v, g, beta, side["gdn"][l], par)
                stashes.append(res)
                h = res.out.reshape(bsz, n, -1) @ proj[l].to(dev)
            for b in range(bsz):  # the verify block's K/V rows at slots prefix + i
                side["kv"][0][b, :, int(prefix[b]) : int(prefix[b]) + n] = kv_rows[b].to(dev)
            path = (accepted.to(dev), accept_len.to(dev))
            ops.commit_gdn_state(side["gdn"], [s.stash_u for s in stashes], [s.stash_k for s in stashes],
                                 [s.stash_cumg for s in stashes], *path)
            ops.commit_conv_state(side["conv"], xs, *path)
            ops.commit_kv(side["kv"], prefix.to(dev), *path)
        prefix = prefix + accept_len.long()
        for key in ("gdn", "conv"):
            for l, (a, e) in enumerate(zip(sides[DEV][key], sides["cpu"][key])):
                err = rel_err(a, e)
                assert err <= 1e-4, f"round {r}: {key} state of layer {l} drifted: {err:.2e}"
        assert torch.equal(sides[DEV]["kv"][0].cpu(), sides["cpu"]["kv"][0]), f"round {r}: KV cache differs"


# ---- arguments ---------------------------------------------------------------------------------


def test_mixed_devices_raise_before_writing():
    gen = make_gen(9)
    tree = to(random_tree(2, 17, gen), DEV)
    out = poisoned(ops.empty_walk(2, 5, DEV))
    with pytest.raises(ValueError, match="walk_greedy.*target_token"):
        ops.walk_greedy(tree, torch.zeros(2, 17, dtype=torch.long), 5, out=out)  # target on the CPU
    assert (out.accepted == -7777).all() and (out.accept_len == -7777).all()


def test_all_ops_small():
    """Every op once on small inputs against the CPU op: the subset scripts/h200.sh runs under
    compute-sanitizer (memcheck, racecheck)."""
    gen = make_gen(77)
    logits = torch.randn(2, 3, 300, generator=gen)
    assert torch.equal(ops.topk_logprobs(logits.to(DEV), 4).tokens.cpu(), ops.topk_logprobs(logits, 4).tokens)
    logp, tokens = random_topk(2, 4, 3, gen, ties=True)
    root, prefix = torch.tensor([1, 2]), torch.tensor([0, 5])
    tree = ops.build_tree(logp, tokens, root, prefix, 12)
    assert_fields_equal(ops.build_tree(*to([logp, tokens, root, prefix], DEV), 12), tree, "build_tree")
    assert torch.equal(ops.tree_attention_mask(tree.ancestor_mask.to(DEV), prefix.to(DEV), 30).cpu(),
                       ops.tree_attention_mask(tree.ancestor_mask, prefix, 30))
    x, weight, b, conv_state, parent = conv_inputs(2, 13, 32, 4, 3, torch.float32, gen)
    assert_close(ops.tree_conv1d(*to([x, weight, b, conv_state, parent], DEV)),
                 ops.tree_conv1d(x, weight, b, conv_state, parent), torch.float32)
    g = gdn_inputs(2, 13, 2, 4, 32, 32, torch.float32, gen)
    got = run_gdn(g, DEV)
    assert_gdn_close(got, run_gdn(g, "cpu"), torch.float32, "gdn")
    target = walk_targets(tree, gen)
    assert_fields_equal(run_walk_greedy(tree, target, 5, DEV), run_walk_greedy(tree, target, 5, "cpu"), "walk")
    logits = argmax_rows(3, 1000, torch.float32, gen, specials=True)
    assert torch.equal(ops.row_argmax(logits.to(DEV)).cpu(), ops.row_argmax(logits))
    for vocab in (301, 300):  # one-element and 4-element paths
        ptree, plogits, pseen, pcounts = penalty_case(2, 13, vocab, gen, torch.bfloat16)
        setting = PENALTY_SETTINGS[vocab % 2 + 2]
        assert_bits_equal(run_penalize(ptree, plogits, pseen, pcounts, setting, DEV),
                          run_penalize(ptree, plogits, pseen, pcounts, setting, DEV, fn=reference.penalize_logits))
    stree, slogits = sample_case(2, 13, 500, gen)
    uniform = torch.rand(2, 5, generator=gen)
    for kw in (dict(temperature=0.8, top_k=8, top_p=0.9), dict(temperature=1.0), dict(temperature=0.8, top_p=0.9),
               dict(temperature=0.8, top_k=100, top_p=0.9)):
        assert_fields_equal(ops.walk_sample(to(stree, DEV), slogits.to(DEV), uniform.to(DEV), **kw),
                            ops.walk_sample(stree, slogits, uniform, **kw), f"walk_sample {kw}")
    accepted, accept_len = random_paths(g.parent, 4, gen)
    states = [g.state]
    assert_close(commit_gdn(states, [got], accepted, accept_len, DEV)[0],
                 commit_gdn(states, [to(got, "cpu")], accepted, accept_len, "cpu")[0], torch.float32)
    assert torch.equal(run_commit_conv([conv_state], [x], accepted, accept_len, DEV)[0].cpu(),
                       run_commit_conv([conv_state], [x], accepted, accept_len, "cpu")[0])
    cache = [torch.randn(2, 2, 40, 16, generator=gen)]
    kv_prefix = torch.tensor([3, 20])
    assert torch.equal(run_commit_kv(cache, kv_prefix, accepted, accept_len, DEV)[0].cpu(),
                       run_commit_kv(cache, kv_prefix, accepted, accept_len, "cpu")[0])
    assert torch.equal(ops.gather_rows(*to([x, accepted, accept_len], DEV)).cpu(), ops.gather_rows(x, accepted, accept_len))
    kv_rows, kv_slots = torch.randn(2, 2, 3, 16, generator=gen), torch.tensor([4, 0, 39])
    stored = [[t.clone() for t in (cache[0], cache[0].flip(0))] for _ in range(2)]
    ops.store_kv(*stored[0], kv_slots, kv_rows, kv_rows.flip(1))
    stored[1] = to(stored[1], DEV)
    ops.store_kv(*stored[1], *to([kv_slots, kv_rows, kv_rows.flip(1)], DEV))
    assert all(torch.equal(a.cpu(), e) for a, e in zip(stored[1], stored[0]))
    moe = moe_case(5, 2, 4, 32, 16, gen, torch.float32, crowd=True)
    bad_ids = moe[1].clone()
    bad_ids[0, 1] = 4  # out of range: skipped
    assert_close(moe_on(moe, DEV), ops.moe_experts(*moe), torch.float32, "moe_experts")
    moe_on((moe[0], bad_ids, *moe[2:]), DEV)
    shared, shared_gate = torch.randn(5, 32, generator=gen), torch.randn(5, 3, generator=gen)[:, 1:2]
    assert_close(ops.moe_experts(*to(list(moe), DEV), shared=shared.to(DEV), shared_gate=shared_gate.to(DEV)),
                 ops.moe_experts(*moe, shared=shared, shared_gate=shared_gate), torch.float32, "moe_experts, shared")
    router_logits = torch.randn(5, 40, generator=gen)
    assert torch.equal(ops.moe_router(router_logits.to(DEV), 3)[1].cpu(), ops.moe_router(router_logits, 3)[1])
    # Layer bodies: both load paths (a 16-byte aligned row and an odd width), a long and a short row group.
    for rows, dim in ((3, 1040), (5, 37)):
        h = torch.randn(rows, dim, generator=gen)
        w = torch.randn(dim, generator=gen)
        for kw in (dict(zero_centered=True), dict(gate=h.flip(0))):
            dev_kw = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
            assert_close(ops.rms_norm(*to([h, w], DEV), 1e-6, **dev_kw), ops.rms_norm(h, w, 1e-6, **kw), torch.float32)
        # Heads sliced from wider rows (groups of rows: a stacked projection's q or k), x and gate.
        wide = torch.randn(rows, 4 * dim + 3, generator=gen)
        heads, gate_heads = wide[:, : 2 * dim].view(rows, 2, dim), wide[:, 2 * dim : 4 * dim].view(rows, 2, dim)
        dev_wide = wide.to(DEV)
        dev_heads, dev_gate = dev_wide[:, : 2 * dim].view(rows, 2, dim), dev_wide[:, 2 * dim : 4 * dim].view(rows, 2, dim)
        assert_close(ops.rms_norm(dev_heads, w.to(DEV), 1e-6, gate=dev_gate), ops.rms_norm(heads, w, 1e-6, gate=gate_heads),
                     torch.float32)
        for got, expected in zip(ops.add_rms_norm(*to([h, h.flip(0), w], DEV), 1e-6), ops.add_rms_norm(h, h.flip(0), w, 1e-6)):
            assert_close(got, expected, torch.float32)
        assert_close(ops.silu_mul(*to([h, h.flip(0)], DEV)), ops.silu_mul(h, h.flip(0)), torch.float32)
        wa, wb = torch.randn(3, dim, generator=gen), torch.randn(3, dim, generator=gen)
        A_log, dt_bias = torch.randn(3, generator=gen), torch.randn(3, generator=gen)
        for a, e in zip(ops.gdn_gates(*to([h, wa, wb, A_log, dt_bias], DEV)), ops.gdn_gates(h, wa, wb, A_log, dt_bias)):
            assert_close(a, e, torch.float32)
    q = torch.randn(1, 5, 3, 16, generator=gen).transpose(1, 2)
    cos, sin = torch.randn(1, 5, 8, generator=gen), torch.randn(1, 5, 8, generator=gen)
    assert torch.equal(ops.rope(*to([q, cos, sin], DEV)).cpu(), ops.rope(q, cos, sin))
    # q/k norms and RoPE: a half-warp row group (16 features, packed) and a warp's (126 features: the element path).
    for dim in (16, 126):
        qk = [torch.randn(1, 5, heads, dim, generator=gen) for heads in (3, 2)]
        w = [torch.randn(dim, generator=gen) for _ in range(2)]
        tables = [torch.randn(1, 5, 8, generator=gen) for _ in range(2)]
        for a, e in zip(ops.qk_norm_rope(*to(qk + w + tables, DEV), 1e-6), ops.qk_norm_rope(*qk, *w, *tables, 1e-6)):
            assert_close(a, e, torch.float32)
    gate_rows = torch.randn(5, 2, 32, generator=gen)
    assert_close(ops.sigmoid_mul(gate_rows.to(DEV)[..., 16:], q[0, :2].transpose(0, 1).to(DEV)),
                 ops.sigmoid_mul(gate_rows[..., 16:], q[0, :2].transpose(0, 1)), torch.float32)
    # The projection kernel: two splits in a cluster, a partial last row tile.
    x, weight = torch.randn(3, 128, generator=gen).half(), torch.randn(64, 128, generator=gen).half()
    assert_close(ops.linear(*to([x, weight], DEV)), ops.linear(x, weight), torch.float16)


# ---- side streams --------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["qkv", "kqv", "qvk", "q"])
def test_kv_prefetch_any_call_order(order):
    """Under LayerFusion an attention layer's q_proj call starts K and V on a side stream; whatever order (or
    subset) of the three projections HF calls, each returns exactly what its projection gives when called alone."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention

    from ddtree_ext import fused, tiny
    from ddtree_ext.fused import LayerFusion

    config = tiny.tiny_qwen3_5_config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        attn = Qwen3_5Attention(config, layer_idx=3).to(device=DEV, dtype=torch.bfloat16).eval()
    projections = {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj}
    x = torch.randn(1, 65, 256, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = {name: fused.linear(p, x) for name, p in projections.items()}  # each projection on its own
    with torch.no_grad(), LayerFusion(attn).active():
        for _ in range(2):  # a second round after a q_proj call whose K and V were never taken
            got = {name: projections[name](x) for name in order}
            torch.cuda.synchronize()
            for name, out in got.items():
                assert torch.equal(out, expected[name]), name
    # Captured: side work nobody took is joined when the fusion context closes, or the capture would fail.
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream), LayerFusion(attn).active():  # warm-up on the capture stream
        [projections[name](x) for name in order]
    torch.cuda.current_stream().wait_stream(stream)
    with torch.no_grad(), torch.cuda.graph(graph, stream=stream), LayerFusion(attn).active():
        got = {name: projections[name](x) for name in order}
    graph.replay()
    torch.cuda.synchronize()
    for name, out in got.items():
        assert torch.equal(out, expected[name]), name
