"""CPU benchmarks of the build op group, for regressions (not a speed claim: the real path is CUDA).

Run explicitly, outside the default test path:
    python -m pytest benchmarks/test_bench_build.py --benchmark-only
Shapes are those of one round with the Qwen3.6-27B DFlash draft: L = 15 draft depths, vocabulary 248320.
Each test records what it measures in benchmark.extra_info (shapes, bytes moved, achieved GB/s).
"""

from __future__ import annotations

import pytest
import torch

from ddtree_ext import ops

DRAFT_DEPTHS = 15
DRAFT_VOCAB = 248320
TOPK = 8


def record_bandwidth(benchmark, bytes_moved: int) -> None:
    benchmark.extra_info["bytes_moved"] = bytes_moved
    benchmark.extra_info["gb_per_s"] = bytes_moved / benchmark.stats.stats.mean / 1e9


@pytest.mark.benchmark(group="build:topk_logprobs")
def test_bench_topk_logprobs(benchmark):
    logits = torch.randn(1, DRAFT_DEPTHS, DRAFT_VOCAB, generator=torch.Generator().manual_seed(0)).bfloat16()
    out = ops.topk_logprobs(logits, TOPK)
    benchmark.extra_info.update(
        op="topk_logprobs", measures="one call: log-softmax statistics and top-K of every draft row",
        shape=list(logits.shape), dtype=str(logits.dtype), k=TOPK,
    )
    benchmark.pedantic(ops.topk_logprobs, args=(logits, TOPK), kwargs=dict(out=out), rounds=20, warmup_rounds=2)
    record_bandwidth(benchmark, logits.numel() * logits.element_size())


@pytest.mark.benchmark(group="build:build_tree")
@pytest.mark.parametrize("budget", [16, 64, 256])
def test_bench_build_tree(benchmark, budget):
    gen = torch.Generator().manual_seed(budget)
    logits = torch.randn(1, DRAFT_DEPTHS, 4096, generator=gen)
    topk = ops.topk_logprobs(logits, TOPK)
    root_token, prefix_len = torch.tensor([17]), torch.tensor([1000])
    out = ops.empty_tree(1, budget)
    benchmark.extra_info.update(
        op="build_tree", measures="one call: best-first tree with the spine, all 8 outputs written",
        batch=1, depths=DRAFT_DEPTHS, k=TOPK, budget=budget,
    )
    benchmark.pedantic(
        ops.build_tree, args=(topk.logp, topk.tokens, root_token, prefix_len, budget),
        kwargs=dict(spine=True, out=out), rounds=200, warmup_rounds=5,
    )
    benchmark.extra_info["nodes_per_s"] = (budget + 1) / benchmark.stats.stats.mean


@pytest.mark.benchmark(group="build:tree_attention_mask")
@pytest.mark.parametrize("dtype", [torch.bool, torch.bfloat16], ids=str)
def test_bench_tree_attention_mask(benchmark, dtype):
    budget, kv_len = 64, 4096
    logits = torch.randn(1, DRAFT_DEPTHS, 4096, generator=torch.Generator().manual_seed(1))
    topk = ops.topk_logprobs(logits, TOPK)
    prefix_len = torch.tensor([kv_len - budget - 1])
    tree = ops.build_tree(topk.logp, topk.tokens, torch.tensor([17]), prefix_len, budget)
    out = torch.empty(1, 1, budget + 1, kv_len, dtype=dtype)
    benchmark.extra_info.update(
        op="tree_attention_mask", measures="one call: the [1, 1, N, S] mask of a tree",
        nodes=budget + 1, kv_len=kv_len, dtype=str(dtype),
    )
    benchmark.pedantic(
        ops.tree_attention_mask, args=(tree.ancestor_mask, prefix_len), kwargs=dict(out=out), rounds=200,
        warmup_rounds=5,
    )
    record_bandwidth(benchmark, out.numel() * out.element_size())
