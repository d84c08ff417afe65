"""A sweep of whole rounds over 1000 random trees: the verify ops (tree conv, tree gated delta rule) and
every commit op, each against its reference on the same random tree and a random root-to-node path.

The per-op test files cover shapes, dtypes and edge cases; this one covers many tree shapes, so a
kernel that is right on chains and stars but wrong on some branching pattern fails here.
"""

import torch

from ddtree_ext import ops, reference
from conftest import assert_close, poison, random_parents

NUM_TREES = 1000
ROWS = 4  # trees per call, one per batch row
H, HV, KD, VD, C, W, S = 1, 3, 4, 4, 6, 4, 4


def _random_round(gen: torch.Generator):
    n = int(torch.randint(1, 12, (1,), generator=gen))
    shape = ["random", "random", "chain", "star"][int(torch.randint(0, 4, (1,), generator=gen))]
    parent = torch.stack([random_parents(n, gen, shape, max_depth=6) for _ in range(ROWS)])
    d = n  # room for the longest possible path
    accepted = torch.full((ROWS, d), -1, dtype=torch.int32)
    accept_len = torch.empty(ROWS, dtype=torch.int32)
    for b in range(ROWS):
        path = reference.path_to(parent, b, int(torch.randint(0, n, (1,), generator=gen)))
        accepted[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        accept_len[b] = len(path)
    return n, parent, accepted, accept_len


def test_rounds_over_random_trees(threads):
    gen = torch.Generator().manual_seed(2024)
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    for _ in range(NUM_TREES // ROWS):
        n, parent, accepted, accept_len = _random_round(gen)
        prefix_len = torch.randint(0, 5, (ROWS,), generator=gen)

        # verify: conv then gated delta rule
        x, weight, conv_state = randn(ROWS, n, C), randn(C, W), randn(ROWS, C, S)
        conv = ops.tree_conv1d(x, weight, None, conv_state, parent, out=poison(torch.empty(ROWS, n, C)))
        assert_close(conv, reference.tree_conv1d(x, weight, None, conv_state, parent), torch.float32, "tree_conv1d")

        q, k, v = randn(ROWS, n, H, KD), randn(ROWS, n, H, KD), randn(ROWS, n, HV, VD)
        g = -torch.rand(ROWS, n, HV, generator=gen)
        beta = torch.rand(ROWS, n, HV, generator=gen)
        state = randn(ROWS, HV, KD, VD)
        got = ops.tree_gated_delta_rule(q, k, v, g, beta, state, parent)
        want = reference.tree_gated_delta_rule(q, k, v, g, beta, state, parent)
        for name, a, e in zip(got._fields, got, want):
            assert_close(a, e, torch.float32, f"tree_gated_delta_rule.{name}")

        # commit along the path
        new_state = [state.clone()]
        ops.commit_gdn_state(new_state, [got.stash_u], [got.stash_k], [got.stash_cumg], accepted, accept_len)
        (ref_state,) = reference.commit_gdn_state([state], [want.stash_u], [want.stash_k], [want.stash_cumg],
                                                 accepted, accept_len)
        assert_close(new_state[0], ref_state, torch.float32, "commit_gdn_state")

        new_conv = [conv_state.clone()]
        ops.commit_conv_state(new_conv, [x], accepted, accept_len)
        assert torch.equal(new_conv[0], reference.commit_conv_state([conv_state], [x], accepted, accept_len)[0])

        cache = randn(ROWS, 2, 4 + n, 3)
        new_cache = [cache.clone()]
        ops.commit_kv(new_cache, prefix_len, accepted, accept_len)
        assert torch.equal(new_cache[0], reference.commit_kv([cache], prefix_len, accepted, accept_len)[0])

        rows = ops.gather_rows(x, accepted, accept_len, out=poison(torch.empty(ROWS, n, C)))
        assert torch.equal(rows, reference.gather_rows(x, accepted, accept_len))
