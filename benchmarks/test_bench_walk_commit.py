"""CPU benchmarks of the walk and commit op groups, for regressions (not a speed claim: the real path is CUDA).

Run explicitly, outside the default test path:
    python -m pytest benchmarks/test_bench_walk_commit.py --benchmark-only
Shapes are those of one round on Qwen3.6-27B: vocabulary 248320, 48 GDN layers with 48 value heads of
128 x 128 float32 state, 16 attention layers with 4 KV heads of dim 256, a 64-node tree, 8 tokens accepted.
Each test records what it measures in benchmark.extra_info (shapes, bytes moved, achieved GB/s).
"""

from __future__ import annotations

import pytest
import torch

from ddtree_ext import ops
from ddtree_ext import reference as ref

VOCAB = 248320
DRAFT_DEPTHS = 15
TOPK = 8
BUDGET = 64
ACCEPTED = 8
GDN_LAYERS, GDN_VALUE_HEADS, GDN_KEY_HEADS, GDN_HEAD_DIM = 48, 48, 16, 128
ATTN_LAYERS, KV_HEADS, KV_HEAD_DIM, KV_SLOTS = 16, 4, 256, 4096


def record_bandwidth(benchmark, bytes_moved: int) -> None:
    benchmark.extra_info["bytes_moved"] = bytes_moved
    if benchmark.stats is not None:  # None under --benchmark-disable (a smoke run)
        benchmark.extra_info["gb_per_s"] = bytes_moved / benchmark.stats.stats.mean / 1e9


def draft_tree(budget: int, seed: int) -> ops.Tree:
    """A DDTree of one row as the build step makes it (spine first), from random draft scores."""
    gen = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(1, DRAFT_DEPTHS, TOPK, generator=gen), -1).sort(-1, descending=True).values
    tokens = torch.randint(0, VOCAB, (1, DRAFT_DEPTHS, TOPK), generator=gen)
    return ref.build_tree(logp, tokens, torch.tensor([17]), torch.tensor([1000]), budget)


def spine_path(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """accepted [1, length] / accept_len [1]: nodes 0..length-1, the spine of a draft tree."""
    return torch.arange(length, dtype=torch.int32).unsqueeze(0), torch.tensor([length], dtype=torch.int32)


@pytest.mark.benchmark(group="walk:walk_greedy")
def test_bench_walk_greedy(benchmark):
    tree = draft_tree(BUDGET, seed=0)
    target = torch.full_like(tree.token, -1)
    target[0, : ACCEPTED - 1] = tree.token[0, 1:ACCEPTED]  # the target agrees with the spine for 7 tokens
    out = ops.empty_walk(1, DRAFT_DEPTHS + 1)
    benchmark.extra_info.update(
        op="walk_greedy", measures="one call: a walk accepting 8 nodes of a 65-node tree",
        batch=1, nodes=BUDGET + 1, max_accept=DRAFT_DEPTHS + 1,
    )
    benchmark.pedantic(ops.walk_greedy, args=(tree, target, DRAFT_DEPTHS + 1), kwargs=dict(out=out), rounds=500,
                       warmup_rounds=10)
    assert int(out.accept_len) == ACCEPTED


@pytest.mark.benchmark(group="walk:walk_sample")
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (50, 0.9), (0, 0.95)])
def test_bench_walk_sample(benchmark, top_k, top_p):
    nodes = 17
    tree = draft_tree(nodes - 1, seed=1)
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(1, nodes, VOCAB, generator=gen).bfloat16()
    # The target strongly prefers the spine's next token, so the walk visits several nodes.
    logits[0, torch.arange(ACCEPTED - 1), tree.token[0, 1:ACCEPTED]] = 20.0
    uniform = torch.rand(1, DRAFT_DEPTHS + 1, generator=gen) * 0.9
    out = ops.empty_walk(1, DRAFT_DEPTHS + 1)
    kw = dict(temperature=1.0, top_k=top_k, top_p=top_p, out=out)
    ops.walk_sample(tree, logits, uniform, **kw)
    visited = int(out.accept_len)
    benchmark.extra_info.update(
        op="walk_sample", measures=f"one call: a walk sampling at {visited} nodes",
        logits_shape=list(logits.shape), dtype=str(logits.dtype), top_k=top_k, top_p=top_p, nodes_visited=visited,
    )
    benchmark.pedantic(ops.walk_sample, args=(tree, logits, uniform), kwargs=kw, rounds=10, warmup_rounds=1)
    # Each visited node's logits row is read at least three times (max, mass, scan).
    record_bandwidth(benchmark, 3 * visited * VOCAB * logits.element_size())


@pytest.mark.benchmark(group="commit:commit_gdn_state")
def test_bench_commit_gdn_state(benchmark):
    gen = torch.Generator().manual_seed(3)
    batch, nodes = 1, BUDGET + 1
    state = [torch.randn(batch, GDN_VALUE_HEADS, GDN_HEAD_DIM, GDN_HEAD_DIM, generator=gen) for _ in range(GDN_LAYERS)]
    stash_u = [
        torch.randn(batch, nodes, GDN_VALUE_HEADS, GDN_HEAD_DIM, generator=gen) * 1e-3 for _ in range(GDN_LAYERS)
    ]
    stash_k = [torch.randn(batch, nodes, GDN_KEY_HEADS, GDN_HEAD_DIM, generator=gen) for _ in range(GDN_LAYERS)]
    stash_cumg = [-torch.rand(batch, nodes, GDN_VALUE_HEADS, generator=gen).cumsum(1) for _ in range(GDN_LAYERS)]
    accepted, accept_len = spine_path(ACCEPTED)
    state_bytes = sum(s.numel() for s in state) * 4
    stash_bytes = GDN_LAYERS * ACCEPTED * (GDN_VALUE_HEADS * (GDN_HEAD_DIM + 1) + GDN_KEY_HEADS * GDN_HEAD_DIM) * 4
    benchmark.extra_info.update(
        op="commit_gdn_state", measures="one call: every GDN layer's state takes the 8-node path",
        layers=GDN_LAYERS, state_shape=list(state[0].shape), stash_nodes=nodes, accept_len=ACCEPTED,
        dtype="torch.float32",
    )
    benchmark.pedantic(ops.commit_gdn_state, args=(state, stash_u, stash_k, stash_cumg, accepted, accept_len),
                       rounds=10, warmup_rounds=1)
    record_bandwidth(benchmark, 2 * state_bytes + stash_bytes)  # state read and written, stash rows read


@pytest.mark.benchmark(group="commit:commit_kv")
def test_bench_commit_kv(benchmark):
    gen = torch.Generator().manual_seed(4)
    # keys and values of every attention layer
    cache = [
        torch.randn(1, KV_HEADS, KV_SLOTS, KV_HEAD_DIM, generator=gen).bfloat16() for _ in range(2 * ATTN_LAYERS)
    ]
    # Every accepted node but the root moves: the worst case for the copy.
    accepted = torch.tensor([[0] + [2 * d + 1 for d in range(1, ACCEPTED)]], dtype=torch.int32)
    accept_len = torch.tensor([ACCEPTED], dtype=torch.int32)
    prefix_len = torch.tensor([KV_SLOTS - 2 * BUDGET])
    moved_rows = len(cache) * KV_HEADS * (ACCEPTED - 1)
    benchmark.extra_info.update(
        op="commit_kv", measures="one call: 7 rows per head move in every key and value cache",
        tensors=len(cache), cache_shape=list(cache[0].shape), dtype=str(cache[0].dtype), accept_len=ACCEPTED,
    )
    benchmark.pedantic(ops.commit_kv, args=(cache, prefix_len, accepted, accept_len), rounds=200, warmup_rounds=5)
    record_bandwidth(benchmark, 2 * moved_rows * KV_HEAD_DIM * cache[0].element_size())
