"""CPU benchmarks of the verify ops at Qwen3.6-27B GDN shapes (regressions only; the GPU numbers are what
count). Run with ``pytest benchmarks/test_bench_verify.py``; not part of the default test paths."""

from __future__ import annotations

import pytest
import torch

from ddtree_ext import ops

# One GDN layer of Qwen3.6-27B (DESIGN.md section 2).
KEY_HEADS, VALUE_HEADS, HEAD_DIM = 16, 48, 128
CONV_CHANNELS, CONV_WIDTH = 2 * KEY_HEADS * HEAD_DIM + VALUE_HEADS * HEAD_DIM, 4
SPINE = 15  # draft depths: the top-1 chain a DDTree keeps


def ddtree_like_parents(n: int, seed: int = 0) -> torch.Tensor:
    """parent [1, n] int32 shaped like a DDTree: the draft's top-1 spine (nodes 1..15), the rest hung off
    random earlier nodes."""
    gen = torch.Generator().manual_seed(seed)
    parent = torch.empty(1, n, dtype=torch.int32)
    parent[0, 0] = -1
    for i in range(1, n):
        parent[0, i] = i - 1 if i <= SPINE else int(torch.randint(0, i, (1,), generator=gen))
    return parent


def run_pedantic(benchmark, fn, group: str, **shapes) -> None:
    benchmark.group = group
    benchmark.extra_info.update(shapes, threads=torch.get_num_threads())
    benchmark.pedantic(fn, rounds=20, iterations=1, warmup_rounds=2)


@pytest.mark.parametrize("n", [65])
def test_bench_tree_conv1d(benchmark, n):
    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    x = torch.randn(1, n, CONV_CHANNELS, generator=gen).to(dt)
    weight = torch.randn(CONV_CHANNELS, CONV_WIDTH, generator=gen).to(dt)
    conv_state = torch.randn(1, CONV_CHANNELS, CONV_WIDTH, generator=gen).to(dt)
    parent = ddtree_like_parents(n)
    out = torch.empty_like(x)
    run_pedantic(
        benchmark,
        lambda: ops.tree_conv1d(x, weight, None, conv_state, parent, silu=True, out=out),
        "tree_conv1d",
        B=1, N=n, C=CONV_CHANNELS, W=CONV_WIDTH, S=CONV_WIDTH, dtype=str(dt),
    )


@pytest.mark.parametrize("n", [17, 65])
def test_bench_tree_gated_delta_rule(benchmark, n):
    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    q = torch.randn(1, n, KEY_HEADS, HEAD_DIM, generator=gen).to(dt)
    k = torch.randn(1, n, KEY_HEADS, HEAD_DIM, generator=gen).to(dt)
    v = torch.randn(1, n, VALUE_HEADS, HEAD_DIM, generator=gen).to(dt)
    g = -0.5 * torch.rand(1, n, VALUE_HEADS, generator=gen)
    beta = torch.rand(1, n, VALUE_HEADS, generator=gen)
    state = torch.randn(1, VALUE_HEADS, HEAD_DIM, HEAD_DIM, generator=gen)
    parent = ddtree_like_parents(n)
    out = ops.tree_gated_delta_rule(q, k, v, g, beta, state, parent)
    run_pedantic(
        benchmark,
        lambda: ops.tree_gated_delta_rule(q, k, v, g, beta, state, parent, out=out),
        "tree_gated_delta_rule",
        B=1, N=n, H=KEY_HEADS, HV=VALUE_HEADS, K=HEAD_DIM, V=HEAD_DIM, dtype=str(dt),
    )


@pytest.mark.parametrize("implementation", ["ops.moe_experts", "hf grouped_mm"])
def test_bench_moe_experts(benchmark, implementation):
    """A 17-row verify block through a Qwen3.6-35B-A3B-sized MoE layer's routed experts (top 8, H 2048, I 512; 64
    experts to keep the weights small), bf16, on the CPU: the op's fixed-order loops against HF's grouped_mm forward,
    which is why generate() runs the op on CUDA only (fused.MOE_OP_DEVICES)."""
    modeling = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    from ddtree_ext.tiny import tiny_qwen3_5_moe_config

    experts, top_k, hidden, inter, rows = 64, 8, 2048, 512, 17
    gen = torch.Generator().manual_seed(0)
    config = tiny_qwen3_5_moe_config(num_experts=experts, num_experts_per_tok=top_k, hidden_size=hidden,
                                     moe_intermediate_size=inter, experts_implementation="grouped_mm")
    module = modeling.Qwen3_5MoeExperts(config).requires_grad_(False)
    module.gate_up_proj.normal_(0, hidden ** -0.5, generator=gen)
    module.down_proj.normal_(0, inter ** -0.5, generator=gen)
    module = module.to(torch.bfloat16)
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(rows)])
    weights = torch.softmax(torch.randn(rows, top_k, generator=gen), -1).to(torch.bfloat16)
    if implementation == "ops.moe_experts":
        fn = lambda: ops.moe_experts(x, ids, weights, module.gate_up_proj, module.down_proj)  # noqa: E731
    else:
        fn = lambda: module(x, ids, weights)  # noqa: E731
    run_pedantic(benchmark, fn, "moe_experts", T=rows, E=experts, K=top_k, H=hidden, I=inter, dtype="bfloat16",
                 implementation=implementation)
