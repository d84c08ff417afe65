"""The build op group on the CPU: topk_logprobs, build_tree, tree_attention_mask.

Every op is compared against ddtree_ext.reference (integer outputs with torch.equal, into poisoned
buffers). build_tree is also checked against properties that do not go through the reference (tree
structure, node count, spine) and, on small draws, against a brute-force enumeration of every prefix.
"""

from __future__ import annotations

from typing import Callable, List, Sequence

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conftest import assert_close, poison, random_parents
from ddtree_ext import ops, reference
from ddtree_ext.ops import Tree

# Derandomized so CI sees the same draws every run; no deadline because the reference is slow Python.
HYPOTHESIS = dict(deadline=None, derandomize=True, database=None)
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal that treats NaN (the float poison) as equal to NaN."""
    if a.dtype.is_floating_point:
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    return torch.equal(a, b)


# ---- topk_logprobs ---------------------------------------------------------------------------


def make_logits(kind: str, shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """'normal': continuous; 'ties': small integers (many equal logits); 'neg_inf': about a third of
    the entries -inf, one finite entry per row kept so the log-softmax stays finite."""
    if kind == "ties":
        x = torch.randint(-3, 3, shape, generator=gen).float()
    else:
        x = 3 * torch.randn(shape, generator=gen)
    if kind == "neg_inf":
        dropped = torch.rand(shape, generator=gen) < 0.35
        keep = torch.randint(0, shape[-1], (*shape[:-1], 1), generator=gen)
        dropped.scatter_(-1, keep, False)
        x = x.masked_fill(dropped, float("-inf"))
    return x.to(dtype)


def assert_logp_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """-inf exactly where the reference has it, finite entries within tolerance. Both sides compute
    in float32 from the same (exactly widened) inputs, so float32's tolerance holds for every dtype."""
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected)), "logp: -inf entries differ"
    finite = torch.isfinite(expected)
    assert_close(torch.where(finite, actual, 0), torch.where(finite, expected, 0), torch.float32, "logp")


def poisoned_topk(batch: int, depths: int, k: int) -> ops.TopK:
    return ops.TopK(
        poison(torch.empty(batch, depths, k, dtype=torch.float32)),
        poison(torch.empty(batch, depths, k, dtype=torch.int64)),
    )


# (V, K) for V in awkward sizes and K in {1, 2, 8, V}, K <= V (K > V is a bad input, tested below).
TOPK_SIZES = sorted({(v, k) for v in (1, 7, 129, 1000, 5000) for k in (1, 2, 8, v) if k <= v})


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["normal", "ties", "neg_inf"])
@pytest.mark.parametrize("vocab,k", TOPK_SIZES)
def test_topk_matches_reference(vocab, k, kind, dtype):
    logits = make_logits(kind, (2, 3, vocab), dtype, seeded(vocab * 31 + k))
    out = ops.topk_logprobs(logits, k, out=poisoned_topk(2, 3, k))
    expected = reference.topk_logprobs(logits, k)
    assert torch.equal(out.tokens, expected.tokens)
    assert_logp_close(out.logp, expected.logp)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_topk_nonfinite_rows_match_log_softmax(dtype):
    """Rows holding one +inf, several, +inf beside NaN, only -inf: the reference's tokens and log_softmax's NaN
    pattern (one +inf makes every entry NaN, as two do)."""
    logits = torch.randn(1, 5, 300, generator=seeded(11)).to(dtype)
    logits[0, 0, 17] = float("inf")
    logits[0, 1, [3, 250]] = float("inf")
    logits[0, 2, 9], logits[0, 2, 40] = float("inf"), float("nan")
    logits[0, 3] = -float("inf")  # row 4: numbers only
    for k in (1, 8):
        out = ops.topk_logprobs(logits, k)
        expected = reference.topk_logprobs(logits, k)
        assert torch.equal(out.tokens, expected.tokens)
        assert torch.equal(out.logp.isnan(), expected.logp.isnan())
        assert out.logp[0, :4].isnan().all() and not out.logp[0, 4].isnan().any()


def test_topk_strided_views():
    """logits strided in B and L (last dim contiguous), outputs slices of larger buffers."""
    gen = seeded(7)
    big = make_logits("ties", (3, 8, 300), torch.float32, gen)
    logits = big[::2, 1::3, 5:260]
    logp_buf = poison(torch.empty(2, 3, 12, dtype=torch.float32))
    tokens_buf = poison(torch.empty(3, 2, 9, dtype=torch.int64))
    out = ops.TopK(logp_buf[:, :, 2:8], tokens_buf.transpose(0, 1)[:, :, 1:7])
    ops.topk_logprobs(logits, 6, out=out)
    expected = reference.topk_logprobs(logits, 6)
    assert torch.equal(out.tokens, expected.tokens)
    assert_logp_close(out.logp, expected.logp)
    assert logp_buf[:, :, :2].isnan().all() and logp_buf[:, :, 8:].isnan().all()
    assert (tokens_buf[:, :, 0] == -7777).all() and (tokens_buf[:, :, 7:] == -7777).all()


def test_topk_draft_vocabulary():
    """One row of the real draft's size, where summation order matters most for the log-sum-exp."""
    logits = make_logits("normal", (1, 2, 248320), torch.bfloat16, seeded(3))
    out = ops.topk_logprobs(logits, 8, out=poisoned_topk(1, 2, 8))
    expected = reference.topk_logprobs(logits, 8)
    assert torch.equal(out.tokens, expected.tokens)
    assert_logp_close(out.logp, expected.logp)


def test_topk_allocates_without_out():
    logits = make_logits("normal", (2, 4, 50), torch.float16, seeded(5))
    out = ops.topk_logprobs(logits, 3)
    assert out.logp.shape == out.tokens.shape == (2, 4, 3)
    assert out.logp.dtype == torch.float32 and out.tokens.dtype == torch.int64
    assert torch.equal(out.tokens, reference.topk_logprobs(logits, 3).tokens)


# ---- build_tree ------------------------------------------------------------------------------

TREE_FIELDS = Tree._fields


def make_draft(kind: str, batch: int, depths: int, k: int, gen: torch.Generator):
    """Per-depth candidates (logp [B, L, K] float32, tokens [B, L, K] int64) for build_tree.

    'continuous': distinct negative log-probs, descending per depth (what topk_logprobs gives).
    'ties': small negative integers, descending (ties between scores everywhere).
    'unsorted': continuous but in no particular order (the op must still follow the reference).
    tokens[b, d, r] = 100 * (d + 1) + r, so a node's depth and rank can be read off its token.
    """
    if kind == "ties":
        logp = -torch.randint(0, 3, (batch, depths, k), generator=gen).float()
    else:
        logp = -(0.05 + 4 * torch.rand(batch, depths, k, generator=gen))
    if kind != "unsorted":
        logp = logp.sort(dim=-1, descending=True).values
    tokens = 100 * torch.arange(1, depths + 1).view(1, depths, 1) + torch.arange(k).view(1, 1, k)
    return logp, tokens.expand(batch, depths, k).contiguous()


def row_inputs(batch: int, gen: torch.Generator):
    root_token = torch.randint(0, 50, (batch,), generator=gen)
    prefix_len = torch.randint(0, 1000, (batch,), generator=gen)
    return root_token, prefix_len


def poisoned_tree(batch: int, budget: int) -> Tree:
    return Tree(*(poison(t) for t in ops.empty_tree(batch, budget)))


def run_build(logp, tokens, root_token, prefix_len, budget, spine) -> Tree:
    return ops.build_tree(
        logp, tokens, root_token, prefix_len, budget, spine=spine, out=poisoned_tree(logp.shape[0], budget)
    )


def assert_trees_equal(actual: Tree, expected: Tree) -> None:
    for name, a, e in zip(TREE_FIELDS, actual, expected):
        assert a.dtype == e.dtype and torch.equal(a, e), f"{name} differs:\n{a}\nexpected\n{e}"


def available_prefixes(depths: int, k: int, cap: int) -> int:
    """min(cap, sum_{d=1..L} K^d)."""
    total, level = 0, 1
    for _ in range(depths):
        level *= k
        total += level
        if total >= cap:
            return cap
    return total


def unpack_ancestors(ancestor_mask: torch.Tensor) -> torch.Tensor:
    """[B, N, W] int64 bit words -> [B, N, N] bool, [b, i, j] = bit j of node i."""
    bsz, n, words = ancestor_mask.shape
    bits = (ancestor_mask.unsqueeze(-1) >> torch.arange(64)) & 1
    return bits.reshape(bsz, n, words * 64)[:, :, :n].bool()


def child_lists(tree: Tree, b: int) -> List[List[int]]:
    """Children of every node of row b by following first_child / next_sibling."""
    n = tree.token.shape[1]
    out = []
    for i in range(n):
        kids, c = [], int(tree.first_child[b, i])
        while c >= 0 and len(kids) <= n:  # the length bound stops a corrupt (cyclic) list
            kids.append(c)
            c = int(tree.next_sibling[b, c])
        out.append(kids)
    return out


def check_tree_properties(tree: Tree, logp, tokens, root_token, prefix_len, budget: int, spine: bool) -> None:
    """Structure every tree must have, checked without the reference."""
    bsz, depths, k = logp.shape
    n = budget + 1
    real_count = available_prefixes(depths, k, budget) + 1
    assert torch.equal(tree.num_nodes, torch.full((bsz,), real_count, dtype=torch.int32))
    parent, depth = tree.parent.tolist(), tree.depth.tolist()
    expected_anc = torch.zeros(bsz, n, n, dtype=torch.bool)
    for b in range(bsz):
        assert parent[b][0] == -1 and depth[b][0] == 0 and int(tree.token[b, 0]) == int(root_token[b])
        expected_anc[b, 0, 0] = True
        expected_children = [[] for _ in range(n)]
        for i in range(1, n):
            if i < real_count:
                p, d = parent[b][i], depth[b][i]
                assert 0 <= p < i, f"row {b} node {i}: parent {p} breaks topological order"
                assert d == depth[b][p] + 1 and 1 <= d <= depths
                # tokens encode (depth, rank): the node carries a candidate of its own depth
                assert int(tree.token[b, i]) // 100 == d
                expected_children[p].append(i)
                expected_anc[b, i] = expected_anc[b, p]
            else:  # padding: a root child repeating the root token, linked nowhere
                assert parent[b][i] == 0 and depth[b][i] == 1
                assert int(tree.token[b, i]) == int(root_token[b])
                expected_anc[b, i, 0] = True
            expected_anc[b, i, i] = True
        assert child_lists(tree, b) == expected_children
        # siblings carry distinct candidates
        for kids in expected_children:
            sibling_tokens = [int(tree.token[b, c]) for c in kids]
            assert len(set(sibling_tokens)) == len(sibling_tokens)
        if spine:
            for d in range(1, min(depths, budget) + 1):
                assert parent[b][d] == d - 1 and int(tree.token[b, d]) == int(tokens[b, d - 1, 0])
    assert torch.equal(unpack_ancestors(tree.ancestor_mask), expected_anc)
    assert torch.equal(tree.position, prefix_len.view(-1, 1) + tree.depth.long())


def check_build(logp, tokens, root_token, prefix_len, budget: int, spine: bool) -> Tree:
    """The op against the reference (all 8 outputs), its properties and its determinism."""
    tree = run_build(logp, tokens, root_token, prefix_len, budget, spine)
    assert_trees_equal(tree, reference.build_tree(logp, tokens, root_token, prefix_len, budget, spine=spine))
    check_tree_properties(tree, logp, tokens, root_token, prefix_len, budget, spine)
    assert_trees_equal(run_build(logp, tokens, root_token, prefix_len, budget, spine), tree)
    return tree


def test_build_tree_hand_example():
    """A tree worked out by hand (independent of the reference): the spine changes which nodes win.

    Depth 1 log-probs [-1.0, -1.25], depth 2 [-2.0, -3.0]. Best-first with budget 2 takes both depth-1
    candidates (-1.0, -1.25); the spine takes the top-1 chain (-1.0, -3.0) instead.
    """
    logp = torch.tensor([[[-1.0, -1.25], [-2.0, -3.0]]])
    tokens = torch.tensor([[[10, 11], [20, 21]]])
    root, prefix = torch.tensor([7]), torch.tensor([100])
    no_spine = run_build(logp, tokens, root, prefix, 2, spine=False)
    assert no_spine.token.tolist() == [[7, 10, 11]]
    assert no_spine.parent.tolist() == [[-1, 0, 0]]
    assert no_spine.first_child.tolist() == [[1, -1, -1]]
    assert no_spine.next_sibling.tolist() == [[-1, 2, -1]]
    assert no_spine.ancestor_mask.tolist() == [[[0b001], [0b011], [0b101]]]
    assert no_spine.position.tolist() == [[100, 101, 101]]
    with_spine = run_build(logp, tokens, root, prefix, 2, spine=True)
    assert with_spine.token.tolist() == [[7, 10, 20]]
    assert with_spine.parent.tolist() == [[-1, 0, 1]]
    assert with_spine.depth.tolist() == [[0, 1, 2]]
    assert with_spine.ancestor_mask.tolist() == [[[0b001], [0b011], [0b111]]]
    # Budget 4 without the spine: scores (0) -1, (1) -1.25, (0,0) -3, (1,0) -3.25 in that order.
    full = run_build(logp, tokens, root, prefix, 4, spine=False)
    assert full.token.tolist() == [[7, 10, 11, 20, 20]]
    assert full.parent.tolist() == [[-1, 0, 0, 1, 2]]
    assert full.num_nodes.tolist() == [5]


def test_build_tree_padding():
    """K = 1, L = 2 gives 2 real nodes; the rest of budget 5 is padding (a multi-word mask: N = 70)."""
    logp = torch.tensor([[[-0.5], [-0.25]]])
    tokens = torch.tensor([[[3], [4]]])
    tree = run_build(logp, tokens, torch.tensor([9]), torch.tensor([40]), 69, spine=False)
    assert tree.num_nodes.tolist() == [3]
    assert tree.token[0, :4].tolist() == [9, 3, 4, 9] and (tree.token[0, 3:] == 9).all()
    assert (tree.parent[0, 3:] == 0).all() and (tree.depth[0, 3:] == 1).all()
    assert (tree.first_child[0, 2:] == -1).all() and (tree.next_sibling[0] == -1).all()
    assert tree.first_child[0, :2].tolist() == [1, 2]
    assert (tree.position[0, 3:] == 41).all()
    node = 69  # in the second mask word
    assert tree.ancestor_mask[0, node].tolist() == [1, 1 << (node - 64)]


@pytest.mark.parametrize("spine", [True, False], ids=["spine", "best_first"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("budget", [1, 2, 3, 15, 16, 17, 63, 64, 65, 128, 256])
def test_build_tree_budgets(budget, k, spine):
    """Every budget class (below / at / above L, word boundaries of the mask) at L = 15."""
    gen = seeded(budget * 10 + k)
    logp, tokens = make_draft("continuous", 3, 15, k, gen)
    check_build(logp, tokens, *row_inputs(3, gen), budget, spine)


@settings(max_examples=300, **HYPOTHESIS)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 4),
    depths=st.integers(1, 16),
    k=st.sampled_from([1, 2, 4, 8]),
    budget=st.one_of(st.integers(1, 40), st.integers(1, 256)),
    spine=st.booleans(),
    kind=st.sampled_from(["continuous", "ties", "unsorted"]),
)
def test_build_tree_random(seed, batch, depths, k, budget, spine, kind):
    gen = seeded(seed)
    logp, tokens = make_draft(kind, batch, depths, k, gen)
    check_build(logp, tokens, *row_inputs(batch, gen), budget, spine)


def prefix_scores(logp_row: torch.Tensor) -> dict:
    """Every prefix (tuple of ranks, one per depth) of one row -> its float32 score summed root to leaf."""
    depths, k = logp_row.shape
    scores, level = {}, {(): torch.zeros((), dtype=torch.float32)}
    for d in range(depths):
        level = {path + (r,): s + logp_row[d, r] for path, s in level.items() for r in range(k)}
        scores.update(level)
    return {path: float(s) for path, s in scores.items()}


def rank_paths(tree: Tree, b: int) -> List[tuple]:
    """The rank tuple of every real non-root node of row b, read from tokens made by make_draft."""
    paths = {0: ()}
    for i in range(1, int(tree.num_nodes[b])):
        paths[i] = paths[int(tree.parent[b, i])] + (int(tree.token[b, i]) % 100,)
    return [paths[i] for i in range(1, int(tree.num_nodes[b]))]


@settings(max_examples=300, **HYPOTHESIS)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 3),
    shape=st.sampled_from([(1, 5), (2, 2), (2, 3), (2, 4), (3, 2), (3, 3), (3, 4), (4, 2), (5, 2)]),
    budget_fraction=st.floats(0.0, 1.2),
    spine=st.booleans(),
)
def test_build_tree_brute_force(seed, batch, shape, budget_fraction, spine):
    """Without ties the tree holds exactly the top-`budget` prefixes by score (with the spine: the
    spine plus the top of the rest), taken in non-increasing score order after the spine."""
    depths, k = shape
    total = available_prefixes(depths, k, 10**9)
    budget = max(1, round(budget_fraction * total))
    gen = seeded(seed)
    logp, tokens = make_draft("continuous", batch, depths, k, gen)
    tree = check_build(logp, tokens, *row_inputs(batch, gen), budget, spine)
    take = min(budget, total)
    for b in range(batch):
        scores = prefix_scores(logp[b])
        spine_paths = [(0,) * d for d in range(1, min(depths, budget) + 1)] if spine else []
        rest = sorted((p for p in scores if p not in spine_paths), key=lambda p: -scores[p])
        best = rest[: take - len(spine_paths)]
        if best and len(rest) > len(best):  # a tie at the cut would make "the top" ambiguous
            assume(scores[rest[len(best)]] < scores[best[-1]])
        taken = rank_paths(tree, b)
        assert set(taken) == set(spine_paths) | set(best)
        after_spine = [scores[p] for p in taken[len(spine_paths):]]
        assert after_spine == sorted(after_spine, reverse=True)


def test_build_tree_allocates_without_out():
    gen = seeded(11)
    logp, tokens = make_draft("continuous", 2, 4, 3, gen)
    root_token, prefix_len = row_inputs(2, gen)
    tree = ops.build_tree(logp, tokens, root_token, prefix_len, 10)
    assert_trees_equal(tree, reference.build_tree(logp, tokens, root_token, prefix_len, 10))


@pytest.mark.parametrize("n", [1, 2, 17, 64, 65, 129, 257])
def test_chain_tree_matches_reference(n):
    """ops.chain_tree (device ops, what an autoregressive round and forward_chain verify) is the tree
    reference.tree_from_parents makes of a chain, every field, into poisoned buffers."""
    gen = torch.Generator().manual_seed(n)
    tokens = torch.randint(0, 1000, (2, n), generator=gen)
    prefix_len = torch.tensor([5, 300])
    out = ops.empty_tree(2, n - 1)
    for field in out:
        poison(field)
    got = ops.chain_tree(tokens, prefix_len, out=out)
    parent = torch.arange(-1, n - 1, dtype=torch.int32).expand(2, n).contiguous()
    expected = reference.tree_from_parents(parent, tokens, prefix_len)
    for name in Tree._fields:
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def test_wrapper_sizes_are_checked_before_allocating():
    """Sizes the wrappers allocate with: a ValueError naming the argument (not torch's allocator error, not a tree
    with no nodes); integer scalars of numpy and torch are sizes too."""
    logits = torch.randn(1, 3, 11)
    topk = ops.topk_logprobs(logits, 4)
    root, prefix = torch.tensor([2]), torch.tensor([5])
    cases = [
        (lambda: ops.topk_logprobs(logits, -1), r"topk_logprobs: k must be an int in \[1, 11\]"),
        (lambda: ops.topk_logprobs(logits, 12), r"topk_logprobs: k must be an int in \[1, 11\]"),
        (lambda: ops.topk_logprobs(logits, 2.0), "topk_logprobs: k must be an int"),
        (lambda: ops.build_tree(topk.logp, topk.tokens, root, prefix, 2.5), "build_tree: budget must be an int >= 1"),
        (lambda: ops.build_tree(topk.logp, topk.tokens, root, prefix, True), "build_tree: budget must be an int"),
        (lambda: ops.build_tree(topk.logp, topk.tokens, 2, prefix, 4), "build_tree: root_token must be a tensor"),
        (lambda: ops.empty_tree(1, -1), "empty_tree: budget must be an int >= 0"),
        (lambda: ops.empty_walk(1, 0), "empty_walk: max_accept must be an int >= 1"),
        (lambda: ops.tree_attention_mask(torch.zeros(1, 2, 1, dtype=torch.int64), prefix, -1),
         "tree_attention_mask: kv_len must be an int >= 1"),
        (lambda: ops.walk_greedy(ops.chain_tree(torch.tensor([[1, 2]]), prefix), torch.tensor([[1, 2]]), -1),
         "walk_greedy: max_accept must be an int >= 1"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    assert ops.topk_logprobs(logits, np.int64(4)).tokens.shape == (1, 3, 4)
    assert ops.empty_tree(1, torch.tensor(3)).token.shape == (1, 4)


def test_chain_tree_bad_inputs_write_nothing():
    """Wrong tokens, prefix_len or out: a ValueError naming the argument, before anything is written to out."""
    out = ops.empty_tree(1, 3)
    out.token.fill_(-7)
    prefix = torch.tensor([5])
    tokens = torch.tensor([[1, 2, 3, 4]])
    cases = [
        (lambda: ops.chain_tree(tokens[0], prefix, out=out), "tokens must be int64 \\[B, N\\]"),
        (lambda: ops.chain_tree(tokens.float(), prefix, out=out), "tokens must be int64"),
        (lambda: ops.chain_tree(tokens, 5, out=out), "prefix_len must be int64 \\[1\\]"),
        (lambda: ops.chain_tree(tokens, prefix.int(), out=out), "prefix_len must be int64"),
        (lambda: ops.chain_tree(tokens[:, :1], prefix, out=out), "out must be an empty_tree of 1 nodes"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
        assert (out.token == -7).all(), message


def test_mask_refuses_a_prefix_len_whose_sum_would_wrap():
    """prefix_len[b] + N past int64 must not wrap into range: it is refused, nothing written."""
    out = torch.ones(1, 1, 3, 8, dtype=torch.bool)
    for prefix in (2**63 - 2, 2**63 - 1, 6):
        with pytest.raises(ValueError, match="tree_attention_mask: prefix_len must satisfy"):
            ops.tree_attention_mask(torch.zeros(1, 3, 1, dtype=torch.int64), torch.tensor([prefix]), out=out)
    assert out.all()


def test_kv_bucket_widths():
    """Attention widths: never below what is needed, at most 256 slots or 25% above it (whichever is
    more), non-decreasing, and few: a quarter octave apart."""
    from ddtree_ext.round import kv_bucket

    widths = [kv_bucket(n) for n in range(1, 70000)]
    assert all(w >= n for n, w in enumerate(widths, start=1))
    assert all(w <= n + max(256, 0.25 * n) for n, w in enumerate(widths, start=1))
    assert all(a <= b for a, b in zip(widths, widths[1:]))
    assert len(set(widths)) <= 4 * 9  # 256 .. 70000: about four widths per octave


def test_build_tree_strided_inputs():
    """Inputs may be strided views (the outputs must be contiguous)."""
    gen = seeded(13)
    logp, tokens = make_draft("ties", 4, 6, 8, gen)
    root_token, prefix_len = row_inputs(8, gen)
    args = (logp[::2, :, ::2], tokens[::2, :, ::2], root_token[::4], prefix_len[1::4])
    assert not args[0].is_contiguous()
    tree = run_build(*args, 20, spine=True)
    assert_trees_equal(tree, reference.build_tree(*(a.contiguous() for a in args), 20, spine=True))


# ---- tree_attention_mask ---------------------------------------------------------------------

MASK_DTYPES = [torch.bool] + FLOAT_DTYPES


def mask_trees(n: int, gen: torch.Generator) -> torch.Tensor:
    """ancestor_mask [4, n, W]: random-shaped, chain and star trees, then a built tree with padding
    (for n = 1 the root alone)."""
    parents = torch.stack([random_parents(n, gen, shape) for shape in ("random", "chain", "star")])
    zeros = torch.zeros(3, n, dtype=torch.int64)
    shaped = reference.tree_from_parents(parents, zeros, zeros[:, 0]).ancestor_mask
    if n == 1:
        return torch.cat([shaped, shaped[:1]])
    logp, tokens = make_draft("continuous", 1, 6, 2, gen)
    built = run_build(logp, tokens, torch.tensor([1]), torch.tensor([0]), n - 1, spine=True).ancestor_mask
    return torch.cat([shaped, built])


def mask_view(buffer: torch.Tensor, layout: str, shape: Sequence[int]) -> torch.Tensor:
    bsz, _, n, s = shape
    if layout == "contiguous":
        return buffer[:bsz, :1, :n, :s]
    if layout == "slice":  # strided in every dim, the last included
        return buffer[1 : 1 + bsz, 1:2, 2 : 2 + n, 3 : 3 + 2 * s : 2]
    return buffer[:bsz, :1, :s, :n].transpose(2, 3)  # transposed: columns are the slow dim


@pytest.mark.parametrize("layout", ["contiguous", "slice", "transposed"])
@pytest.mark.parametrize("dtype", MASK_DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 17, 64, 65, 130])
def test_mask_matches_reference(n, dtype, layout):
    gen = seeded(n)
    ancestor_mask = mask_trees(n, gen)
    kv_len = n + 9
    prefix_len = torch.tensor([0, 9, 4, 9])
    expected = reference.tree_attention_mask(ancestor_mask, prefix_len, kv_len, dtype=dtype)
    # bool has no poison value: run once on all-True and once on all-False buffers.
    fills = [True, False] if dtype == torch.bool else [float("nan")]
    for fill in fills:
        big = torch.full((5, 3, 2 * kv_len + 8, 2 * kv_len + 8), fill, dtype=dtype)
        untouched = big.clone()
        out = mask_view(big, layout, (4, 1, n, kv_len))
        ops.tree_attention_mask(ancestor_mask, prefix_len, out=out)
        assert torch.equal(out, expected), f"mask differs (prefilled with {fill})"
        mask_view(untouched, layout, (4, 1, n, kv_len)).copy_(expected)
        assert same_values(big, untouched), "wrote outside the view"


def test_mask_allocates_without_out():
    ancestor_mask = mask_trees(20, seeded(2))
    prefix_len = torch.tensor([3, 0, 11, 20])
    mask = ops.tree_attention_mask(ancestor_mask, prefix_len, 40, dtype=torch.float16)
    assert mask.shape == (4, 1, 20, 40)
    assert torch.equal(mask, reference.tree_attention_mask(ancestor_mask, prefix_len, 40, dtype=torch.float16))


# ---- bad input -------------------------------------------------------------------------------


def snapshot(outputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    return [t.clone() for t in outputs]


def assert_rejected(call: Callable[[], None], op: str, argument: str, outputs: Sequence[torch.Tensor]) -> None:
    """The call raises ValueError naming the op and the argument, and leaves every output as it was."""
    before = snapshot(outputs)
    with pytest.raises(ValueError) as excinfo:
        call()
    message = str(excinfo.value)
    assert f"{op}:" in message and argument in message, message
    for t, old in zip(outputs, before):
        assert same_values(t, old), "an output was written before the error"


def topk_args(batch=2, depths=3, vocab=20, k=4):
    return dict(
        logits=torch.randn(batch, depths, vocab, generator=seeded(vocab)),
        logp=poison(torch.empty(batch, depths, k)),
        tokens=poison(torch.empty(batch, depths, k, dtype=torch.int64)),
    )


TOPK_MISTAKES = {
    "logits_dims": (lambda a: a.update(logits=a["logits"][0]), "logits"),
    "logits_dtype": (lambda a: a.update(logits=a["logits"].double()), "logits"),
    "logits_integer": (lambda a: a.update(logits=a["logits"].long()), "logits"),
    "logits_last_dim_strided": (lambda a: a.update(logits=torch.randn(2, 3, 40)[..., ::2]), "logits"),
    "logp_dtype": (lambda a: a.update(logp=a["logp"].double()), "logp"),
    "logp_dims": (lambda a: a.update(logp=a["logp"][0]), "logp"),
    "logp_shape": (lambda a: a.update(logp=poison(torch.empty(2, 4, 4))), "logp"),
    "tokens_dtype": (lambda a: a.update(tokens=a["tokens"].int()), "tokens"),
    "tokens_shape": (lambda a: a.update(tokens=poison(torch.empty(2, 3, 5, dtype=torch.int64))), "tokens"),
    "k_above_vocab": (lambda a: a.update(logits=a["logits"][..., :3]), "logp"),
    "k_zero": (lambda a: a.update(topk_args(k=0)), "logp"),
}


@pytest.mark.parametrize("mistake", list(TOPK_MISTAKES))
def test_topk_rejects(mistake):
    args = topk_args()
    mutate, argument = TOPK_MISTAKES[mistake]
    mutate(args)
    assert_rejected(
        lambda: torch.ops.ddtree.topk_logprobs(args["logits"], args["logp"], args["tokens"]),
        "topk_logprobs", argument, [args["logp"], args["tokens"]],
    )


def build_args(batch=2, depths=4, k=3, budget=9):
    gen = seeded(0)
    logp, tokens = make_draft("continuous", batch, depths, k, gen)
    root_token, prefix_len = row_inputs(batch, gen)
    return dict(
        logp=logp, tokens=tokens, root_token=root_token, prefix_len=prefix_len, budget=budget,
        **poisoned_tree(batch, budget)._asdict(),
    )


def replace_output(name, make):
    return lambda a: a.update({name: poison(make(a[name]))})


BUILD_MISTAKES = {
    "logp_dims": (lambda a: a.update(logp=a["logp"][0]), "logp"),
    "logp_dtype": (lambda a: a.update(logp=a["logp"].half()), "logp"),
    "no_depths": (lambda a: a.update(logp=a["logp"][:, :0], tokens=a["tokens"][:, :0]), "logp"),
    "no_candidates": (lambda a: a.update(logp=a["logp"][..., :0], tokens=a["tokens"][..., :0]), "logp"),
    "tokens_shape": (lambda a: a.update(tokens=a["tokens"][..., :2]), "tokens"),
    "tokens_dtype": (lambda a: a.update(tokens=a["tokens"].int()), "tokens"),
    "root_token_shape": (lambda a: a.update(root_token=a["root_token"][:1]), "root_token"),
    "root_token_dtype": (lambda a: a.update(root_token=a["root_token"].int()), "root_token"),
    "prefix_len_dtype": (lambda a: a.update(prefix_len=a["prefix_len"].int()), "prefix_len"),
    "prefix_len_shape": (lambda a: a.update(prefix_len=a["prefix_len"].view(2, 1)), "prefix_len"),
    "budget_zero": (lambda a: a.update(build_args(budget=0)), "budget"),
    "nodes_not_budget_plus_one": (lambda a: a.update(budget=8), "node_token"),
    "parent_dtype": (replace_output("parent", lambda t: t.long()), "parent"),
    "depth_dtype": (replace_output("depth", lambda t: t.long()), "depth"),
    "num_nodes_shape": (replace_output("num_nodes", lambda t: t[:1]), "num_nodes"),
    "first_child_shape": (replace_output("first_child", lambda t: t[:, :-1]), "first_child"),
    "next_sibling_dtype": (replace_output("next_sibling", lambda t: t.long()), "next_sibling"),
    "token_dtype": (replace_output("token", lambda t: t.int()), "node_token"),
    "ancestor_mask_words": (replace_output("ancestor_mask", lambda t: torch.empty(2, 10, 2, dtype=torch.int64)),
                            "ancestor_mask"),
    "position_dtype": (replace_output("position", lambda t: t.int()), "position"),
    "position_not_contiguous": (replace_output("position", lambda t: torch.empty(10, 2, dtype=torch.int64).T),
                                "position"),
    "ancestor_mask_not_contiguous": (
        replace_output("ancestor_mask", lambda t: torch.empty(2, 10, 2, dtype=torch.int64)[..., :1]), "ancestor_mask"
    ),
}


@pytest.mark.parametrize("mistake", list(BUILD_MISTAKES))
def test_build_tree_rejects(mistake):
    args = build_args()
    mutate, argument = BUILD_MISTAKES[mistake]
    mutate(args)
    outputs = [args[name] for name in TREE_FIELDS]
    assert_rejected(
        lambda: torch.ops.ddtree.build_tree(
            args["logp"], args["tokens"], args["root_token"], args["prefix_len"], args["budget"], True, *outputs
        ),
        "build_tree", argument, outputs,
    )


def mask_args(n=70, kv_len=90):
    return dict(
        ancestor_mask=mask_trees(n, seeded(1)),
        prefix_len=torch.tensor([0, 20, 5, 0]),
        mask=poison(torch.empty(4, 1, n, kv_len)),
    )


MASK_MISTAKES = {
    "ancestor_mask_dims": (lambda a: a.update(ancestor_mask=a["ancestor_mask"][0]), "ancestor_mask"),
    "ancestor_mask_dtype": (lambda a: a.update(ancestor_mask=a["ancestor_mask"].int()), "ancestor_mask"),
    "ancestor_mask_words": (lambda a: a.update(ancestor_mask=a["ancestor_mask"][..., :1]), "ancestor_mask"),
    "prefix_len_dtype": (lambda a: a.update(prefix_len=a["prefix_len"].int()), "prefix_len"),
    "prefix_len_shape": (lambda a: a.update(prefix_len=a["prefix_len"][:3]), "prefix_len"),
    "mask_dims": (lambda a: a.update(mask=poison(torch.empty(4, 70, 90))), "mask"),
    "mask_dtype": (lambda a: a.update(mask=poison(torch.empty(4, 1, 70, 90, dtype=torch.int32))), "mask"),
    "mask_double": (lambda a: a.update(mask=poison(torch.empty(4, 1, 70, 90, dtype=torch.float64))), "mask"),
    "mask_nodes": (lambda a: a.update(mask=poison(torch.empty(4, 1, 69, 90))), "mask"),
    "mask_heads": (lambda a: a.update(mask=poison(torch.empty(4, 2, 70, 90))), "mask"),
    "mask_shorter_than_tree": (lambda a: a.update(mask=poison(torch.empty(4, 1, 70, 69))), "mask"),
    "prefix_past_end": (lambda a: a.update(prefix_len=torch.tensor([0, 21, 5, 0])), "prefix_len"),
    "prefix_negative": (lambda a: a.update(prefix_len=torch.tensor([0, 20, -1, 0])), "prefix_len"),
}


@pytest.mark.parametrize("mistake", list(MASK_MISTAKES))
def test_mask_rejects(mistake):
    args = mask_args()
    mutate, argument = MASK_MISTAKES[mistake]
    mutate(args)
    assert_rejected(
        lambda: torch.ops.ddtree.tree_attention_mask(args["ancestor_mask"], args["prefix_len"], args["mask"]),
        "tree_attention_mask", argument, [args["mask"]],
    )


# ---- registration ----------------------------------------------------------------------------


def opcheck_cases():
    gen = seeded(21)
    logp, tokens = make_draft("ties", 2, 5, 4, gen)
    root_token, prefix_len = row_inputs(2, gen)
    tree = poisoned_tree(2, 12)
    return {
        "topk_logprobs": (torch.ops.ddtree.topk_logprobs.default, tuple(topk_args().values())),
        "build_tree": (
            torch.ops.ddtree.build_tree.default,
            (logp, tokens, root_token, prefix_len, 12, True, *tree),
        ),
        "tree_attention_mask": (torch.ops.ddtree.tree_attention_mask.default, tuple(mask_args().values())),
    }


@pytest.mark.parametrize("op_name", ["topk_logprobs", "build_tree", "tree_attention_mask"])
def test_opcheck(op_name):
    op, args = opcheck_cases()[op_name]
    torch.library.opcheck(op, args)


def test_an_empty_batch_has_the_shapes_of_its_rows():
    """B = 0: the op's fields and the reference's have the per-row shapes ([0, N], [0, N, W], [0]) and dtypes."""
    logp, tokens = torch.zeros(0, 3, 2), torch.zeros(0, 3, 2, dtype=torch.int64)
    empty = torch.zeros(0, dtype=torch.int64)
    got = ops.build_tree(logp, tokens, empty, empty, 4)
    want = reference.build_tree(logp, tokens, empty, empty, 4)
    from_parents = reference.tree_from_parents(torch.zeros(0, 5, dtype=torch.int32), torch.zeros(0, 5, dtype=torch.int64),
                                               empty)
    for name in Tree._fields:
        a, b, c = getattr(got, name), getattr(want, name), getattr(from_parents, name)
        assert a.shape == b.shape == c.shape and a.dtype == b.dtype == c.dtype, name
    assert got.ancestor_mask.shape == (0, 5, 1) and got.num_nodes.shape == (0,)
