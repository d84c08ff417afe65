"""Benchmarks of the CUDA ops at Qwen3.6-27B shapes: ``pytest benchmarks --benchmark-only``.

Each op is captured in a CUDA graph (``INNER`` calls, rotating over enough input sets that the data
does not sit in L2, like the 48 GDN layers of one verify forward) and timed by graph replay: CUDA
events give the per-call time reported in extra_info["per_op_us"] (median of the rounds), and
pytest-benchmark's own statistics time the whole replay. Every result carries its floor, measured in
the same session: bytes moved / device-to-device copy bandwidth, or FLOPs / the measured float32
(FMA, no TF32) matrix rate for the float32 arithmetic of the GDN op, whichever is larger.
scripts/summarize_bench.py turns the JSON into a table.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import pytest
import torch

from ddtree_ext import ops
from ddtree_ext import reference as ref

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

DEV = "cuda"
ROUNDS = 30
BUDGETS = [16, 64, 128, 256]
# Qwen3.6-27B
VOCAB, DEPTHS = 248320, 15
GDN_LAYERS, H, HV, KD, VD, CONV_DIM, CONV_W = 48, 16, 48, 128, 128, 10240, 4
ATTN_LAYERS, KV_HEADS, HEAD_DIM, HIDDEN = 16, 4, 256, 5120


def _median_event_ms(fn: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@pytest.fixture(scope="session")
def ceilings():
    """Device ceilings measured once per session: copy bandwidth (bytes read + written per second)
    and the float32 matrix rate without TF32 (plain FMA, what the GDN kernels run on)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    copy_ms = _median_event_ms(lambda: dst.copy_(src), 20)
    del src, dst
    n = 4096
    a = torch.randn(n, n, device=DEV)
    b = torch.randn(n, n, device=DEV)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for _ in range(3):
            a @ b
        mm_ms = _median_event_ms(lambda: a @ b, 10)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return dict(copy_bytes_per_s=2 * (1 << 30) / (copy_ms * 1e-3), fp32_flops_per_s=2 * n**3 / (mm_ms * 1e-3))


def _captured(calls: Sequence[Callable[[], object]]) -> torch.cuda.CUDAGraph:
    """`calls` warmed up on a side stream, then captured in one graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    return graph


def bench(benchmark, ceilings, op: str, shape: str, calls: Sequence[Callable[[], object]], bytes_moved: float,
          flops: float = 0.0, baseline: Sequence[Callable[[], object]] = ()):
    """Captures `calls` (one op call each, on rotating inputs) in one graph and times its replay.
    bytes_moved and flops are per call. `baseline` (the same work done the stock way, e.g. the Hugging
    Face module the op replaces, one call per entry) is captured and timed the same way."""
    graph = _captured(calls)
    per_op_us = _median_event_ms(graph.replay, ROUNDS) * 1e3 / len(calls)
    if baseline:
        baseline_us = _median_event_ms(_captured(baseline).replay, ROUNDS) * 1e3 / len(baseline)
        benchmark.extra_info.update(baseline_us=baseline_us)

    def replay():
        graph.replay()
        torch.cuda.synchronize()

    benchmark.group = op
    floor_us = max(bytes_moved / ceilings["copy_bytes_per_s"], flops / ceilings["fp32_flops_per_s"]) * 1e6
    benchmark.extra_info.update(
        op=op, shape=shape, calls_per_replay=len(calls), per_op_us=per_op_us, floor_us=floor_us,
        bytes=bytes_moved, flops=flops, copy_GBps=ceilings["copy_bytes_per_s"] / 1e9,
        fp32_TFLOPs=ceilings["fp32_flops_per_s"] / 1e12,
    )
    benchmark.pedantic(replay, rounds=ROUNDS, warmup_rounds=2, iterations=1)


def built_tree(budget: int, gen: torch.Generator):
    """A real tree from build_tree on draft-like top-8 log-probs, on the device."""
    logp = (-torch.rand(1, DEPTHS, 8, generator=gen) * 4).sort(-1, descending=True).values
    tokens = torch.randint(0, VOCAB, (1, DEPTHS, 8), generator=gen)
    root = torch.randint(0, VOCAB, (1,), generator=gen)
    prefix = torch.tensor([1000])
    return ops.build_tree(logp.to(DEV), tokens.to(DEV), root.to(DEV), prefix.to(DEV), budget)


def path_of(tree, length: int):
    """An accepted path of `length` nodes down the tree (first children), as the walk returns it."""
    fc = tree.first_child.cpu()
    path = [0]
    while len(path) < length and fc[0, path[-1]] >= 0:
        path.append(int(fc[0, path[-1]]))
    accepted = torch.full((1, 16), -1, dtype=torch.int32)
    accepted[0, : len(path)] = torch.tensor(path, dtype=torch.int32)
    return accepted.to(DEV), torch.tensor([len(path)], dtype=torch.int32, device=DEV)


# ---- verify ------------------------------------------------------------------------------------


def gdn_layer_inputs(n: int):
    """One 27B GDN layer's tree_gated_delta_rule inputs for N nodes, bf16 activations (the tree aside):
    (q, k, v, g, beta, state, out). Also used by scripts/profile_gdn.py."""
    bf16 = dict(dtype=torch.bfloat16, device=DEV)
    q = torch.randn(1, n, H, KD, **bf16)
    k = torch.randn(1, n, H, KD, **bf16)
    v = torch.randn(1, n, HV, VD, **bf16)
    g = -torch.rand(1, n, HV, device=DEV)
    beta = torch.rand(1, n, HV, device=DEV)
    state = torch.randn(1, HV, KD, VD, device=DEV) * 0.1
    out = ops.GDNTreeOutput(torch.empty(1, n, HV, VD, **bf16), torch.empty(1, n, HV, VD, device=DEV),
                            torch.empty(1, n, H, KD, device=DEV), torch.empty(1, n, HV, device=DEV))
    return q, k, v, g, beta, state, out


@pytest.mark.parametrize("budget", BUDGETS)
def test_tree_gated_delta_rule(benchmark, ceilings, budget):
    gen = torch.Generator().manual_seed(budget)
    n = budget + 1
    tree = built_tree(budget, gen)
    layers = [gdn_layer_inputs(n) for _ in range(GDN_LAYERS)]
    calls = [lambda l=l: ops.tree_gated_delta_rule(*l[:6], tree.parent, out=l[6]) for l in layers]
    bytes_moved = (HV * KD * VD * 4  # the committed state, read once
                   + 2 * n * H * KD * 2 + n * HV * VD * 2 + 2 * n * HV * 4 + n * 4  # q, k, v, g, beta, parent
                   + n * HV * VD * 2 + n * HV * VD * 4 + n * H * KD * 4 + n * HV * 4)  # out and the stash
    depth_sum = int(tree.depth.sum())
    flops = (2 * 2 * n * KD * VD * HV  # K H0 and Q H0
             + 2 * 2 * (depth_sum + n) * (KD * H + VD * HV))  # ancestor dot products and sums
    bench(benchmark, ceilings, "tree_gated_delta_rule", f"N={n} H={H} HV={HV} K=V=128 bf16", calls, bytes_moved,
          flops)


@pytest.mark.parametrize("budget", BUDGETS)
def test_tree_conv1d(benchmark, ceilings, budget):
    gen = torch.Generator().manual_seed(budget)
    n = budget + 1
    tree = built_tree(budget, gen)
    bf16 = dict(dtype=torch.bfloat16, device=DEV)
    layers = [(torch.randn(1, n, CONV_DIM, **bf16), torch.randn(CONV_DIM, CONV_W, **bf16),
               torch.randn(1, CONV_DIM, CONV_W, **bf16), torch.empty(1, n, CONV_DIM, **bf16)) for _ in range(GDN_LAYERS)]
    calls = [lambda l=l: ops.tree_conv1d(l[0], l[1], None, l[2], tree.parent, out=l[3]) for l in layers]
    bytes_moved = 2 * (2 * n * CONV_DIM + CONV_DIM * CONV_W + CONV_DIM * (CONV_W - 1))
    bench(benchmark, ceilings, "tree_conv1d", f"N={n} C={CONV_DIM} W=4 bf16", calls, bytes_moved)


# ---- build -------------------------------------------------------------------------------------


def _draft_logits(count: int):
    return [torch.randn(1, DEPTHS, VOCAB, dtype=torch.bfloat16, device=DEV) * 3 for _ in range(count)]


def test_topk_logprobs(benchmark, ceilings):
    logits = _draft_logits(8)  # 8 x 7.4 MB rotate past L2
    outs = [ops.TopK(torch.empty(1, DEPTHS, 8, device=DEV), torch.empty(1, DEPTHS, 8, dtype=torch.long, device=DEV))
            for _ in logits]
    calls = [lambda x=x, o=o: ops.topk_logprobs(x, 8, out=o) for x, o in zip(logits, outs)]
    bench(benchmark, ceilings, "topk_logprobs", f"[1, {DEPTHS}, {VOCAB}] bf16 k=8", calls, DEPTHS * VOCAB * 2)


@pytest.mark.parametrize("budget", BUDGETS)
def test_topk_build_mask(benchmark, ceilings, budget):
    """One round's build: per-depth top-8 over the vocabulary, the tree, and its attention mask."""
    logits = _draft_logits(8)
    root = torch.tensor([5], device=DEV)
    prefix = torch.tensor([1000], device=DEV)
    kv_len = 4096
    topk = ops.TopK(torch.empty(1, DEPTHS, 8, device=DEV), torch.empty(1, DEPTHS, 8, dtype=torch.long, device=DEV))
    tree = ops.empty_tree(1, budget, DEV)
    mask = torch.empty(1, 1, budget + 1, kv_len, dtype=torch.bool, device=DEV)

    def call(x):
        ops.topk_logprobs(x, 8, out=topk)
        ops.build_tree(topk.logp, topk.tokens, root, prefix, budget, out=tree)
        ops.tree_attention_mask(tree.ancestor_mask, prefix, out=mask)

    calls = [lambda x=x: call(x) for x in logits]
    bytes_moved = DEPTHS * VOCAB * 2 + (budget + 1) * kv_len
    bench(benchmark, ceilings, "topk+build_tree+mask", f"N={budget + 1} V={VOCAB} kv={kv_len}", calls, bytes_moved)


@pytest.mark.parametrize("budget", BUDGETS)
def test_build_tree(benchmark, ceilings, budget):
    gen = torch.Generator().manual_seed(budget)
    logp = (-torch.rand(1, DEPTHS, 8, generator=gen) * 4).sort(-1, descending=True).values.to(DEV)
    tokens = torch.randint(0, VOCAB, (1, DEPTHS, 8), generator=gen).to(DEV)
    root, prefix = torch.tensor([5], device=DEV), torch.tensor([1000], device=DEV)
    tree = ops.empty_tree(1, budget, DEV)
    calls = [lambda: ops.build_tree(logp, tokens, root, prefix, budget, out=tree)] * 8
    n = budget + 1
    bytes_moved = DEPTHS * 8 * 16 + n * (8 + 4 * 4 + 8 + 8 * ((n + 63) // 64))
    bench(benchmark, ceilings, "build_tree", f"N={n} L={DEPTHS} K=8", calls, bytes_moved)


# ---- walk --------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", BUDGETS)
def test_walk_greedy(benchmark, ceilings, budget):
    gen = torch.Generator().manual_seed(budget)
    tree = built_tree(budget, gen)
    # The target agrees with the first child everywhere: the walk goes the whole 16 nodes deep.
    fc = tree.first_child.clamp(min=0)
    target = torch.where(tree.first_child >= 0, tree.token.gather(1, fc.long()), tree.token)
    walk = ops.empty_walk(1, 16, DEV)
    calls = [lambda: ops.walk_greedy(tree, target, 16, out=walk)] * 8
    n = budget + 1
    bench(benchmark, ceilings, "walk_greedy", f"N={n} D=16", calls, n * (8 + 8 + 4 + 4) + 16 * 4 + 12)


@pytest.mark.parametrize("budget", BUDGETS)
def test_walk_sample(benchmark, ceilings, budget):
    gen = torch.Generator().manual_seed(budget)
    tree = built_tree(budget, gen)
    n = budget + 1
    logits = [torch.randn(1, n, VOCAB, dtype=torch.bfloat16, device=DEV) * 3 for _ in range(2)]
    uniform = torch.rand(1, 16, device=DEV)
    walk = ops.empty_walk(1, 16, DEV)
    calls = [lambda x=x: ops.walk_sample(tree, x, uniform, temperature=0.6, top_k=20, top_p=0.95, out=walk)
             for x in logits]
    bench(benchmark, ceilings, "walk_sample", f"N={n} V={VOCAB} bf16 top_k=20 top_p=0.95", calls, n * VOCAB * 2)


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (50, 0.9, 0.0), (64, 1.0, 0.0), (0, 0.95, 0.0),
                                               (100, 0.95, 0.0), (0, 1.0, 0.05), (20, 0.95, 0.05)])
def test_walk_sample_settings(benchmark, ceilings, top_k, top_p, min_p):
    """The other draw paths at budget 64: no filter (a max pass and the draw over each row), a top_k list with top_p,
    top_k = 64 (its list is k long, so the k-th's tie group reaches its end: every node counts it over the row, and
    draws over the row where it runs past), top_p alone and top_k above the lists (the radix selects, see
    csrc/walk_cuda.cu), and min_p alone (its cut kernel, then the draw over each row above it) and after a list."""
    gen = torch.Generator().manual_seed(top_k)
    tree = built_tree(64, gen)
    n = 65
    logits = [torch.randn(1, n, VOCAB, dtype=torch.bfloat16, device=DEV) * 3 for _ in range(2)]
    uniform = torch.rand(1, 16, device=DEV)
    walk = ops.empty_walk(1, 16, DEV)
    calls = [lambda x=x: ops.walk_sample(tree, x, uniform, temperature=0.6, top_k=top_k, top_p=top_p, min_p=min_p,
                                         out=walk)
             for x in logits]
    label = f"N={n} V={VOCAB} bf16 top_k={top_k} top_p={top_p}" + (f" min_p={min_p}" if min_p else "")
    bench(benchmark, ceilings, "walk_sample", label, calls, n * VOCAB * 2)


@pytest.mark.parametrize("budget", [64, 256])
def test_penalties(benchmark, ceilings, budget):
    """A round's repetition, presence and frequency penalties (ops.penalize_logits, through generate's
    _Acceptor.penalize) over a budget-64 or -256 tree's bf16 logits, 2000 tokens counted so far. Floor: the logits
    read once and the float32 result written once. Baseline: the torch composition the op replaced (masks over the
    tree's ancestor bits, then the penalties' arithmetic as separate passes over [N, V] float32)."""
    from ddtree_ext.generate import _Acceptor

    gen = torch.Generator().manual_seed(budget)
    tree = built_tree(budget, gen)
    n = budget + 1
    prompt = torch.randint(0, VOCAB, (1, 2000), generator=gen).to(DEV)
    acceptor = _Acceptor(0.0, None, None, None, None, 1, DEV, repetition_penalty=1.1, presence_penalty=0.5,
                         frequency_penalty=0.1, prompt=prompt, vocab_size=VOCAB)
    acceptor.generated[0, :VOCAB].copy_(torch.randint(0, 3, (VOCAB,), generator=gen).float().to(DEV))
    logits = [torch.randn(1, n, VOCAB, dtype=torch.bfloat16, device=DEV) * 3 for _ in range(2)]
    calls = [lambda x=x: acceptor.penalize(tree, x, 16) for x in logits]
    baseline = [lambda x=x: _torch_penalties(acceptor, tree, x, 16) for x in logits]
    bench(benchmark, ceilings, "penalties", f"N={n} V={VOCAB} bf16 -> float32", calls, n * VOCAB * (2 + 4),
          baseline=baseline)


def _torch_penalties(acceptor, tree, logits, max_depth):
    """The penalties as torch operations (generate's implementation before ops.penalize_logits): every node gets
    the counted tokens' penalties by broadcast, then its path's tokens (ranked from the ancestor bits) are redone
    with its own counts."""
    logits = logits.float()
    batch, n, vocab = logits.shape
    depth = min(max_depth - 1, n)
    j = torch.arange(n, device=logits.device)
    on_path = (tree.ancestor_mask[:, :, j // 64] >> (j % 64)) & 1 != 0
    rank = torch.where(on_path & (tree.parent >= 0)[:, None, :], tree.depth[:, None, :].long() + 1, 0)
    rank, pick = rank.topk(depth, dim=2)
    valid = rank > 0
    path = torch.where(valid, tree.token.gather(1, pick.view(batch, -1)).view(batch, n, depth), 0)
    occurrences = ((path[..., :, None] == path[..., None, :]) & valid[..., None, :]).sum(-1)
    original = logits.gather(2, path)
    settings = (acceptor.repetition, acceptor.presence, acceptor.frequency)
    logits = ref.penalty_rule(logits, acceptor.seen[:, None, :vocab], acceptor.generated[:, None, :vocab], *settings)
    flat = path.view(batch, -1)
    seen = acceptor.seen.gather(1, flat).view_as(path) | (occurrences > 0)
    counts = acceptor.generated.gather(1, flat).view_as(path) + occurrences
    logits.scatter_(2, path, ref.penalty_rule(original, seen, counts, *settings))
    return logits


# ---- commit ------------------------------------------------------------------------------------


def test_commit_gdn_state(benchmark, ceilings):
    """48 GDN layers' [1, 48, 128, 128] float32 states, an 8-node accepted path."""
    gen = torch.Generator().manual_seed(0)
    budget, accept = 64, 8
    n = budget + 1
    tree = built_tree(budget, gen)
    accepted, accept_len = path_of(tree, accept)
    states = [torch.randn(1, HV, KD, VD, device=DEV) * 0.1 for _ in range(GDN_LAYERS)]
    stash_u = [torch.randn(1, n, HV, VD, device=DEV) for _ in range(GDN_LAYERS)]
    stash_k = [torch.randn(1, n, H, KD, device=DEV) for _ in range(GDN_LAYERS)]
    stash_cumg = [-torch.rand(1, n, HV, device=DEV) for _ in range(GDN_LAYERS)]
    # Four calls per replay, on the same states: one call already moves 3x the L2, and with a single call the
    # replay's launch latency (several us) would be counted as kernel time.
    calls = [lambda: ops.commit_gdn_state(states, stash_u, stash_k, stash_cumg, accepted, accept_len)] * 4
    accept = int(accept_len)
    bytes_moved = GDN_LAYERS * (2 * HV * KD * VD * 4 + accept * (HV * VD * 4 + H * KD * 4 + HV * 4))
    flops = GDN_LAYERS * HV * KD * VD * (2 * accept + 1)
    bench(benchmark, ceilings, "commit_gdn_state", f"{GDN_LAYERS} x [1, {HV}, {KD}, {VD}] fp32, path {accept}",
          calls, bytes_moved, flops)


def test_commit_conv_state(benchmark, ceilings):
    gen = torch.Generator().manual_seed(1)
    tree = built_tree(64, gen)
    accepted, accept_len = path_of(tree, 8)
    bf16 = dict(dtype=torch.bfloat16, device=DEV)
    conv = [torch.randn(1, CONV_DIM, CONV_W, **bf16) for _ in range(GDN_LAYERS)]
    xs = [torch.randn(1, 65, CONV_DIM, **bf16) for _ in range(GDN_LAYERS)]
    calls = [lambda: ops.commit_conv_state(conv, xs, accepted, accept_len)]
    bytes_moved = GDN_LAYERS * CONV_DIM * 2 * (2 * CONV_W + min(int(accept_len), CONV_W))
    bench(benchmark, ceilings, "commit_conv_state", f"{GDN_LAYERS} x [1, {CONV_DIM}, {CONV_W}] bf16, path 8", calls,
          bytes_moved)


def test_commit_kv(benchmark, ceilings):
    """K/V compaction over 16 attention layers (32 caches), an 8-node accepted path."""
    gen = torch.Generator().manual_seed(2)
    tree = built_tree(64, gen)
    accepted, accept_len = path_of(tree, 8)
    caches = [torch.randn(1, KV_HEADS, 4096, HEAD_DIM, dtype=torch.bfloat16, device=DEV) for _ in range(2 * ATTN_LAYERS)]
    prefix = torch.tensor([3000], device=DEV)
    calls = [lambda: ops.commit_kv(caches, prefix, accepted, accept_len)]
    path = accepted[0, : int(accept_len)].tolist()
    moved = sum(1 for d, p in enumerate(path) if p != d)
    bytes_moved = 2 * ATTN_LAYERS * KV_HEADS * HEAD_DIM * 2 * (len(path) + moved)
    bench(benchmark, ceilings, "commit_kv", f"{2 * ATTN_LAYERS} x [1, {KV_HEADS}, 4096, {HEAD_DIM}] bf16, path 8",
          calls, bytes_moved)


def test_gather_rows(benchmark, ceilings):
    gen = torch.Generator().manual_seed(3)
    tree = built_tree(64, gen)
    accepted, accept_len = path_of(tree, 8)
    src = [torch.randn(1, 65, HIDDEN, dtype=torch.bfloat16, device=DEV) for _ in range(8)]
    out = torch.empty(1, 16, HIDDEN, dtype=torch.bfloat16, device=DEV)
    calls = [lambda s=s: ops.gather_rows(s, accepted, accept_len, out=out) for s in src]
    bench(benchmark, ceilings, "gather_rows", f"[1, 65, {HIDDEN}] bf16 -> [1, 16, {HIDDEN}]", calls,
          HIDDEN * 2 * (int(accept_len) + 16))


def test_tree_attention_mask(benchmark, ceilings):
    gen = torch.Generator().manual_seed(4)
    tree = built_tree(256, gen)
    prefix = torch.tensor([3000], device=DEV)
    mask = torch.empty(1, 1, 257, 4096, dtype=torch.bool, device=DEV)
    calls = [lambda: ops.tree_attention_mask(tree.ancestor_mask, prefix, out=mask)] * 8
    bench(benchmark, ceilings, "tree_attention_mask", "N=257 kv=4096 bool", calls, 257 * 4096 + 257 * 5 * 8)


# ---- layer bodies (baseline: the Hugging Face modules each op replaces, timed the same way) ---------

LAYER_ROWS = [1, 65]  # a decode step, a budget-64 verify
MLP_DIM = 17408
BF16 = 2


@pytest.mark.parametrize("rows", LAYER_ROWS)
def test_rms_norm_hidden(benchmark, ceilings, rows):
    """Qwen3_5RMSNorm over the hidden state (input / post-attention norms: 2 per layer x 64 layers)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    norm = Qwen3_5RMSNorm(HIDDEN).to(device=DEV, dtype=torch.bfloat16)
    xs = [torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device=DEV) for _ in range(16)]
    out = torch.empty(rows, HIDDEN, dtype=torch.bfloat16, device=DEV)
    calls = [lambda x=x: ops.rms_norm(x, norm.weight, norm.eps, zero_centered=True, out=out) for x in xs]
    bench(benchmark, ceilings, "rms_norm", f"[{rows}, {HIDDEN}] bf16 zero-centred", calls,
          2 * rows * HIDDEN * BF16 + HIDDEN * BF16, baseline=[lambda x=x: norm(x) for x in xs])


@pytest.mark.parametrize("rows", LAYER_ROWS)
def test_rms_norm_gated(benchmark, ceilings, rows):
    """Qwen3_5RMSNormGated over the GDN output heads (one per GDN layer)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    norm = Qwen3_5RMSNormGated(VD).to(device=DEV, dtype=torch.bfloat16)
    xs = [torch.randn(rows * HV, VD, dtype=torch.bfloat16, device=DEV) for _ in range(16)]
    zs = [torch.randn(rows * HV, VD, dtype=torch.bfloat16, device=DEV) for _ in range(16)]
    out = torch.empty(rows * HV, VD, dtype=torch.bfloat16, device=DEV)
    calls = [lambda x=x, z=z: ops.rms_norm(x, norm.weight, norm.variance_epsilon, gate=z, out=out) for x, z in zip(xs, zs)]
    bench(benchmark, ceilings, "rms_norm_gated", f"[{rows * HV}, {VD}] bf16", calls, 3 * rows * HV * VD * BF16,
          baseline=[lambda x=x, z=z: norm(x, z) for x, z in zip(xs, zs)])


@pytest.mark.parametrize("rows", LAYER_ROWS)
def test_silu_mul(benchmark, ceilings, rows):
    act = torch.nn.SiLU()
    gates = [torch.randn(rows, MLP_DIM, dtype=torch.bfloat16, device=DEV) for _ in range(16)]
    ups = [torch.randn(rows, MLP_DIM, dtype=torch.bfloat16, device=DEV) for _ in range(16)]
    out = torch.empty(rows, MLP_DIM, dtype=torch.bfloat16, device=DEV)
    calls = [lambda g=g, u=u: ops.silu_mul(g, u, out=out) for g, u in zip(gates, ups)]
    bench(benchmark, ceilings, "silu_mul", f"[{rows}, {MLP_DIM}] bf16", calls, 3 * rows * MLP_DIM * BF16,
          baseline=[lambda g=g, u=u: act(g) * u for g, u in zip(gates, ups)])


@pytest.mark.parametrize("rows", LAYER_ROWS)
def test_gdn_gates(benchmark, ceilings, rows):
    """Both gate projections and the gating of one GDN layer (HF: two GEMMs and seven small kernels)."""
    bf16 = dict(dtype=torch.bfloat16, device=DEV)
    xs = [torch.randn(rows, HIDDEN, **bf16) for _ in range(16)]
    proj_a = torch.nn.Linear(HIDDEN, HV, bias=False, **bf16)
    proj_b = torch.nn.Linear(HIDDEN, HV, bias=False, **bf16)
    A_log, dt_bias = torch.randn(HV, **bf16), torch.randn(HV, **bf16)

    def stock(x):  # Qwen3_5GatedDeltaNet.forward's lines
        beta = proj_b(x).sigmoid().float()
        return -A_log.float().exp() * torch.nn.functional.softplus(proj_a(x).float() + dt_bias), beta

    calls = [lambda x=x: ops.gdn_gates(x, proj_a.weight, proj_b.weight, A_log, dt_bias) for x in xs]
    bench(benchmark, ceilings, "gdn_gates", f"[{rows}, {HIDDEN}] bf16 -> 2 x [{rows}, {HV}]", calls,
          rows * HIDDEN * BF16 + 2 * HV * HIDDEN * BF16 + 2 * rows * HV * 4,
          baseline=[lambda x=x: stock(x) for x in xs])


@pytest.mark.parametrize("rows", LAYER_ROWS)
def test_rope(benchmark, ceilings, rows):
    """q and k of one Qwen3.5 attention layer (24 / 4 heads of 256, rotary width 64)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    bf16 = dict(dtype=torch.bfloat16, device=DEV)
    qs = [torch.randn(1, rows, 24, HEAD_DIM, **bf16).transpose(1, 2) for _ in range(16)]
    ks = [torch.randn(1, rows, KV_HEADS, HEAD_DIM, **bf16).transpose(1, 2) for _ in range(16)]
    cos, sin = torch.rand(1, rows, 64, **bf16), torch.rand(1, rows, 64, **bf16)
    calls = [lambda q=q, k=k: (ops.rope(q, cos, sin), ops.rope(k, cos, sin)) for q, k in zip(qs, ks)]
    bench(benchmark, ceilings, "rope (q and k)", f"[1, 24 + {KV_HEADS}, {rows}, {HEAD_DIM}] bf16, rotary 64", calls,
          2 * rows * (24 + KV_HEADS) * HEAD_DIM * BF16 + 2 * rows * 64 * BF16,
          baseline=[lambda q=q, k=k: apply_rotary_pos_emb(q, k, cos, sin) for q, k in zip(qs, ks)])


@pytest.mark.parametrize("rows,kv_len", [(1, 1024), (1, 8192), (65, 1024), (65, 8192)])
def test_gqa_attention(benchmark, ceilings, rows, kv_len):
    """One Qwen3.5 attention layer's masked GQA attention (24 query heads over 4 KV heads of 256) against
    the folded SDPA call it replaces (cuDNN's fused kernel, query heads folded into the rows)."""
    bf16 = dict(dtype=torch.bfloat16, device=DEV)
    heads = 24
    qs = [torch.randn(1, rows, heads, HEAD_DIM, **bf16).transpose(1, 2) for _ in range(4)]
    ks = [torch.randn(1, KV_HEADS, kv_len, HEAD_DIM, **bf16) for _ in range(4)]
    vs = [torch.randn(1, KV_HEADS, kv_len, HEAD_DIM, **bf16) for _ in range(4)]
    mask = torch.rand(1, 1, rows, kv_len, device=DEV) > 0.1
    mask[..., 0] = True
    out = torch.empty(1, rows, heads, HEAD_DIM, **bf16).transpose(1, 2)
    groups = heads // KV_HEADS
    folded_mask = mask if rows == 1 else mask.repeat(1, 1, groups, 1)

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q.reshape(1, KV_HEADS, groups * rows, HEAD_DIM), k, v, attn_mask=folded_mask, scale=HEAD_DIM**-0.5)

    inputs = list(zip(qs, ks, vs))
    calls = [lambda q=q, k=k, v=v: ops.gqa_attention(q, k, v, mask, HEAD_DIM**-0.5, out=out) for q, k, v in inputs]
    bench(benchmark, ceilings, "gqa_attention", f"[1, {heads}, {rows}, {HEAD_DIM}] over {kv_len} keys bf16", calls,
          2 * KV_HEADS * kv_len * HEAD_DIM * BF16 + 2 * rows * heads * HEAD_DIM * BF16 + rows * kv_len,
          baseline=[lambda q=q, k=k, v=v: sdpa(q, k, v) for q, k, v in inputs])


# ---- sparse MoE experts (Qwen3.6-35B-A3B) ------------------------------------------------------------------

MOE_EXPERTS, MOE_TOP_K, MOE_HIDDEN, MOE_INTER = 256, 8, 2048, 512


@pytest.mark.parametrize("tokens,crowded", [(1, False), (17, False), (65, False), (17, True), (65, True),
                                            (256, False), (1024, False), (4096, False)])
def test_moe_experts(benchmark, ceilings, tokens, crowded):
    """A Qwen3.6-35B-A3B MoE layer's routed experts (ops.moe_experts), bf16, for a decode step (1 row), a DFlash
    block (17), a budget-64 verify block (65) and prefill chunks (256 to 4096: where HF's grouped GEMMs overtake the op,
    fused.MOE_OP_MAX_TOKENS), each row routed to 8 of the 256 experts uniformly at random, or (crowded) to 8 of the
    same 24, as rows that share their context may be; three layers' weights in rotation (4.8 GB, far past L2).
    Floor: the weights of the experts the rows reach, read once. Baseline: Hugging Face's default experts forward
    (Qwen3_5MoeExperts, "grouped_mm": torch's grouped GEMM)."""
    modeling = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    from ddtree_ext.tiny import tiny_qwen3_5_moe_config

    config = tiny_qwen3_5_moe_config(num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K, hidden_size=MOE_HIDDEN,
                                     moe_intermediate_size=MOE_INTER, experts_implementation="grouped_mm")
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    layers, inputs, reached = [], [], 0
    for _ in range(3):
        with torch.device(DEV):
            module = modeling.Qwen3_5MoeExperts(config).to(torch.bfloat16).requires_grad_(False)
        module.gate_up_proj.normal_(0, MOE_HIDDEN ** -0.5, generator=gen)
        module.down_proj.normal_(0, MOE_INTER ** -0.5, generator=gen)
        pool = torch.randperm(MOE_EXPERTS, device=DEV, generator=gen)[:24] if crowded else None
        choices = MOE_EXPERTS if pool is None else 24
        ids = torch.rand(tokens, choices, device=DEV, generator=gen).topk(MOE_TOP_K, dim=-1).indices
        ids = ids if pool is None else pool[ids]
        weights = torch.softmax(torch.randn(tokens, MOE_TOP_K, device=DEV, generator=gen), -1).to(torch.bfloat16)
        x = torch.randn(tokens, MOE_HIDDEN, device=DEV, generator=gen, dtype=torch.bfloat16)
        layers.append(module)
        inputs.append((x, ids, weights))
        reached += ids.unique().numel()
    calls = [lambda m=m, a=a: ops.moe_experts(*a, m.gate_up_proj, m.down_proj) for m, a in zip(layers, inputs)]
    baseline = [lambda m=m, a=a: m(*a) for m, a in zip(layers, inputs)]
    expert_bytes = 3 * MOE_HIDDEN * MOE_INTER * 2
    bench(benchmark, ceilings, "moe_experts", f"T={tokens} E={MOE_EXPERTS} K={MOE_TOP_K} H={MOE_HIDDEN} "
          f"I={MOE_INTER} bf16, {reached / len(layers):.0f} experts reached{' (crowded)' if crowded else ''}", calls,
          reached / len(layers) * expert_bytes, baseline=baseline)


MOE_SHARED_INTER = 512


@pytest.mark.parametrize("tokens", [1, 17, 65])
def test_moe_block(benchmark, ceilings, tokens):
    """A Qwen3.6-35B-A3B sparse MoE block (router, 256 routed experts of 512, top 8, a shared expert of 512 and its
    sigmoid gate), bf16, under the layer fusions a round runs: the fused block (the router's projection, ops.moe_router,
    the shared expert, its gate, ops.moe_experts with the shared expert folded in) against HF's block body with the
    same fusions (the router's softmax, top-k and renormalisation and the shared expert's gate and add as torch's
    kernels; the routed experts through ops.moe_experts), for a decode step, a DFlash block and a budget-64 verify
    block; the router's random weights route each row to its own 8 experts. Three blocks' weights in rotation. Floor:
    the router's, the shared expert's and the reached experts' weights, read once."""
    modeling = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    from ddtree_ext import fused
    from ddtree_ext.tiny import tiny_qwen3_5_moe_config

    config = tiny_qwen3_5_moe_config(num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K, hidden_size=MOE_HIDDEN,
                                     moe_intermediate_size=MOE_INTER, shared_expert_intermediate_size=MOE_SHARED_INTER,
                                     experts_implementation="grouped_mm")
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    blocks, inputs, reached = [], [], 0
    for _ in range(3):
        with torch.device(DEV):
            block = modeling.Qwen3_5MoeSparseMoeBlock(config).to(torch.bfloat16).requires_grad_(False)
        for p in block.parameters():
            p.normal_(0, p.shape[-1] ** -0.5, generator=gen)
        x = torch.randn(1, tokens, MOE_HIDDEN, device=DEV, generator=gen, dtype=torch.bfloat16)
        reached += torch.topk(x[0] @ block.gate.weight.t(), MOE_TOP_K).indices.unique().numel()
        fused.stack_projections(block)
        blocks.append(block)
        inputs.append(x)
    fusions = [fused.LayerFusion(b) for b in blocks]

    def run(block, fusion, x, fuse_block):
        saved, fused.fuse_moe_block = fused.fuse_moe_block, fuse_block
        try:
            with torch.no_grad(), fusion.active():
                return block(x)
        finally:
            fused.fuse_moe_block = saved

    with torch.no_grad():
        assert fused._moe_block_fusable(blocks[0], inputs[0][0]), "the fused block must apply here"
    calls = [lambda b=b, f=f, x=x: run(b, f, x, True) for b, f, x in zip(blocks, fusions, inputs)]
    baseline = [lambda b=b, f=f, x=x: run(b, f, x, False) for b, f, x in zip(blocks, fusions, inputs)]
    expert_bytes = 3 * MOE_HIDDEN * MOE_INTER * BF16
    dense_bytes = (MOE_EXPERTS + 1 + 3 * MOE_SHARED_INTER) * MOE_HIDDEN * BF16
    bench(benchmark, ceilings, "moe_block", f"T={tokens} E={MOE_EXPERTS} K={MOE_TOP_K} H={MOE_HIDDEN} I={MOE_INTER} "
          f"shared {MOE_SHARED_INTER} bf16, {reached / len(blocks):.0f} experts reached", calls,
          reached / len(blocks) * expert_bytes + dense_bytes, baseline=baseline)


# ---- projections ---------------------------------------------------------------------------------

# (name, N, K) of the bias-free projections a round runs: Qwen3.6-27B, then Qwen3-8B (hidden 4096, 32 / 8 heads of
# 128, MLP 12288).
PROJECTIONS = [
    ("27b gdn qkv", 10240, 5120), ("27b gdn z", 6144, 5120), ("27b out_proj / o_proj", 5120, 6144),
    ("27b q_proj", 12288, 5120), ("27b k_proj / v_proj", 1024, 5120), ("27b gate / up", 17408, 5120),
    ("27b down", 5120, 17408),
    ("8b q / o", 4096, 4096), ("8b k / v", 1024, 4096), ("8b gate / up", 12288, 4096), ("8b down", 4096, 12288),
]


@pytest.mark.parametrize("rows", [1, 16, 65])
@pytest.mark.parametrize("name,n,k", PROJECTIONS, ids=[p[0].replace(" / ", "-").replace(" ", "-") for p in PROJECTIONS])
def test_linear(benchmark, ceilings, name, n, k, rows):
    """One projection (the weight-streaming kernel) against torch's F.linear (cuBLAS) on the same inputs; the
    weights rotate over enough copies (>= 200 MB) that they stream from memory, as the layers of a forward do."""
    bf16 = dict(dtype=torch.bfloat16, device=DEV)
    copies = max(2, -(-200_000_000 // (n * k * BF16)))
    weights = [torch.randn(n, k, **bf16) * k**-0.5 for _ in range(copies)]
    x = torch.randn(rows, k, **bf16)
    out = torch.empty(rows, n, **bf16)
    bench(benchmark, ceilings, "linear", f"{name}: [{rows}, {k}] x [{n}, {k}]^T bf16",
          [lambda w=w: ops.linear(x, w, out=out, prefetch_weight=True) for w in weights],
          (n * k + rows * k + rows * n) * BF16,
          baseline=[lambda w=w: torch.nn.functional.linear(x, w) for w in weights])
