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


def warped_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0) -> torch.Tensor:
    """The distribution walk_sample draws from, float64 [R, V], out of Hugging Face's own warpers over float32 logits
    [R, V] (generate upcasts them), in generate's order: temperature, top-k, top-p, min-p, then a softmax. One change:
    where top-p's cut falls inside a group of equal logits, HF keeps the members its unstable sort happens to rank
    higher; here every token tied with a kept one is kept (HF keeps at least one of such a group exactly when the
    group is kept here)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = TemperatureLogitsWarper(temperature)(None, logits.float().cpu())
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        kept = TopPLogitsWarper(top_p)(None, scores) > -float("inf")
        lowest_kept = scores.masked_fill(~kept, float("inf")).amin(-1, keepdim=True)
        scores = scores.masked_fill(scores < lowest_kept, -float("inf"))
    if min_p > 0:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return torch.softmax(scores.double(), -1)


def vllm_penalties(prompt_len: int, presence: float = 0.0, frequency: float = 0.0):
    """vLLM's (and OpenAI's) presence and frequency penalties as a Hugging Face logits processor list, for generate's
    ``logits_processor`` (HF applies it after its own repetition penalty, as vLLM orders them): each token's count
    among the generated tokens (the ids past ``prompt_len``) times ``frequency``, and ``presence`` where it is
    nonzero, subtracted from its float32 logit."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Penalties(LogitsProcessor):
        def __call__(self, input_ids, scores):
            generated = input_ids[:, prompt_len:]
            counts = torch.zeros(scores.shape[0], scores.shape[1] + 1, dtype=torch.float32, device=scores.device)
            counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=torch.float32))
            counts = counts[:, :-1]
            return scores - frequency * counts - presence * (counts > 0).float()

    return LogitsProcessorList([Penalties()])


def inverse_cdf_probes(probs: torch.Tensor, grid: int = 2048, margin: float = 1e-6) -> tuple:
    """(uniforms, tokens) probing a sampler that draws by inverse CDF in ascending id order from one row of
    probabilities [V] (float64): an even grid of ``grid`` uniforms plus the middle of each interval of a token
    holding at least 1e-4 of the mass, less those within ``margin`` of a boundary (rounding may move one), each
    with the token ``probs`` gives it. Another kept set or other weights draw some probe's token elsewhere: a
    missing or extra token of share above about 1/grid covers a probe."""
    cum = torch.cumsum(probs.double(), 0)
    bounds = cum / cum[-1]
    big = torch.nonzero(probs >= 1e-4 * cum[-1]).flatten()
    u = torch.cat([(torch.arange(grid, dtype=torch.float64) + 0.5) / grid, bounds[big] - probs[big] / cum[-1] / 2])
    u = u.float().double()  # the sampler sees float32 uniforms
    edges = torch.cat([torch.zeros(1, dtype=torch.float64), bounds[probs > 0]])
    at = torch.searchsorted(edges, u).clamp(1, edges.shape[0] - 1)
    clear = torch.minimum((u - edges[at - 1]).abs(), (edges[at] - u).abs()) > margin
    u = u[clear]
    assert u.shape[0] > grid // 2, "too few probes clear of the boundaries"
    return u.float(), torch.searchsorted(bounds, u, right=True).clamp_max(probs.shape[0] - 1)


def tied_rows(vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Float32 rows [6, V] full of ties at every rank, exact in bfloat16 and float16: small integers; the same
    over a quarter of the row and 10 lower elsewhere; a peaked row of 1/8-steps with groups of 10, 10 and 40
    tokens (at most a quarter of the row each) tied at its 3rd, 8th and 20th largest value; its negation; one
    token at 3, a third of the row tied at 0 (most of the mass) and -5 elsewhere; -inf but for three tokens."""
    ints = torch.randint(0, 4, (vocab,), generator=gen).float()
    sparse = torch.where(torch.rand(vocab, generator=gen) < 0.25, ints, ints - 10)
    peaked = torch.round(torch.randn(vocab, generator=gen) * 16) / 8
    for rank, size in ((3, 10), (8, 10), (20, 40)):
        value = peaked.sort(descending=True).values[min(rank, vocab) - 1]
        peaked[torch.randperm(vocab, generator=gen)[: min(size, vocab // 4)]] = value
    wide = torch.where(torch.rand(vocab, generator=gen) < 1 / 3, 0.0, -5.0)
    wide[int(torch.randint(0, vocab, (), generator=gen))] = 3.0
    few = torch.full((vocab,), -float("inf"))
    few[torch.randperm(vocab, generator=gen)[:3]] = torch.tensor([1.0, 0.5, 0.5])
    return torch.stack([ints, sparse, peaked, -peaked, wide, few])


def large_logit_rows(vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Rows [4, V] around 1e6 (what a low temperature makes of ordinary logits), in steps of 1/16, float32's spacing
    there: many tokens sit within a step of min_p's cut, where max x + log(min_p) rounds by a whole step."""
    steps = torch.randint(-80, 1, (4, vocab), generator=gen).float()
    steps[:, 0] = 0.0  # the max
    return 1e6 + steps / 16


def root_draws(logits: torch.Tensor, uniform: torch.Tensor, batch: int = 1024, **kw) -> torch.Tensor:
    """The token walk_sample draws at the root of a one-node tree from one row of logits [V] (on its device), for
    each uniform [M]: the bonus tokens [M] of M one-node rows, on the CPU, ``batch`` rows a call."""
    from ddtree_ext import ops, reference

    tokens = []
    for part in uniform.split(batch):
        m = part.shape[0]
        tree = reference.tree_from_parents(
            torch.full((m, 1), -1, dtype=torch.int32), torch.zeros(m, 1, dtype=torch.int64),
            torch.zeros(m, dtype=torch.int64),
        )
        tree = ops.Tree(*(t.to(logits.device) for t in tree))
        out = ops.walk_sample(tree, logits.expand(m, 1, -1), part.reshape(m, 1).contiguous().to(logits.device), **kw)
        tokens.append(out.next_token.cpu())
    return torch.cat(tokens)


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


def random_trees(batch: int, n: int, vocab: int, gen: torch.Generator, shape: str = "random"):
    """A batch of different random trees (reference.tree_from_parents, on the CPU). Small vocabularies give siblings
    equal tokens, so the walk's "first matching child" rule matters, and repeat tokens along paths."""
    from ddtree_ext import reference

    parent = torch.stack([random_parents(n, gen, shape) for _ in range(batch)])
    token = torch.randint(0, vocab, (batch, n), generator=gen)
    return reference.tree_from_parents(parent, token, torch.zeros(batch, dtype=torch.int64))


def penalty_case(batch, n, vocab, gen, dtype=torch.float32, shape="random"):
    """(tree, logits [B, N, V], seen [B, V] bool, counts [B, V] float32) for penalize_logits, on the CPU: random
    trees over a small vocabulary (a token repeats along a path), logits with exact zeros, negative zeros and ties,
    and tables of the tokens seen and generated so far."""
    tree = random_trees(batch, n, vocab, gen, shape)
    logits = (torch.randn(batch, n, vocab, generator=gen) * 3).round(decimals=1)
    logits[..., 0] = -0.0
    seen = torch.rand(batch, vocab, generator=gen) < 0.3
    counts = torch.randint(0, 4, (batch, vocab), generator=gen).float() * (torch.rand(batch, vocab, generator=gen) < 0.4)
    return tree, logits.to(dtype), seen, counts


def moe_case(tokens, top_k, experts, hidden, inter, gen, dtype=torch.float32, crowd=False):
    """(x [T, H], expert_ids [T, K] int64, expert_weights [T, K], gate_up_proj [E, 2 I, H], down_proj [E, H, I]) for
    moe_experts, on the CPU: distinct experts per token (a router's top-k), weights that sum to 1 per token, as HF's
    router gives them, and projections scaled to keep activations near 1. crowd: every token's first expert is expert
    0, so one expert serves every token (more rows than the CUDA kernels stage at once)."""
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]) if tokens else \
        torch.empty(0, top_k, dtype=torch.int64)
    if crowd:
        ids = torch.where(ids == 0, ids[:, :1], ids)  # expert 0 moves to the front, where it replaces the first
        ids[:, 0] = 0
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in (x, ids, weights, gate_up, down))


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
