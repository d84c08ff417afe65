"""penalize_logits (CPU) against ddtree_ext.reference, against HF's repetition processor and vLLM's rule applied to
each node's own sequence, and bad input."""

from __future__ import annotations

import zlib

import pytest
import torch

from conftest import penalty_case, vllm_penalties
from ddtree_ext import ops
from ddtree_ext import reference as ref
from ddtree_ext._loader import load_ops

# (repetition_penalty, presence_penalty, frequency_penalty, which tables): negative penalties too (a reward).
SETTINGS = [
    (1.1, 0.0, 0.0, "seen"),
    (1.3, 0.0, 0.0, "seen"),
    (1.0, 0.5, 0.2, "counts"),
    (0.7, -1.5, 0.3, "both"),
    (1.2, 2.0, -2.0, "both"),
    (1.0, 0.0, 0.0, "neither"),
]


def tables(which, seen, counts):
    return dict(seen=seen if which in ("seen", "both") else None, counts=counts if which in ("counts", "both") else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", ["random", "chain", "star"])
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(map(str, s)))
def test_penalize_vs_reference(dtype, shape, setting):
    """Bit for bit the reference's torch operations, over random trees and every max_depth cut."""
    repetition, presence, frequency, which = setting
    gen = torch.Generator().manual_seed(zlib.crc32(repr((dtype, shape, setting)).encode()))
    for _ in range(3):
        tree, logits, seen, counts = penalty_case(3, 23, 13, gen, dtype, shape)
        kw = dict(repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency,
                  **tables(which, seen, counts))
        for max_depth in (None, 1, 2, 5):
            got = ops.penalize_logits(tree, logits, max_depth=max_depth, **kw)
            want = ref.penalize_logits(tree, logits, max_depth=max_depth, **kw)
            assert got.dtype == torch.float32 and got.shape == logits.shape
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"max_depth {max_depth}"


@pytest.mark.parametrize("setting", SETTINGS[:4], ids=lambda s: "-".join(map(str, s)))
def test_penalize_is_hf_and_vllm_on_each_nodes_sequence(setting):
    """Independent of the reference: every node's row is what HF's RepetitionPenaltyLogitsProcessor and vLLM's rule
    (conftest.vllm_penalties) give for the node's own sequence (the prompt, the tokens generated so far, then the
    node's path below the root), each row processed alone."""
    from transformers import RepetitionPenaltyLogitsProcessor

    repetition, presence, frequency, which = setting
    gen = torch.Generator().manual_seed(11)
    vocab, n = 17, 19
    prompt = torch.randint(0, vocab, (1, 9), generator=gen)
    generated = torch.randint(0, vocab, (1, 6), generator=gen)
    tree, logits, _, _ = penalty_case(1, n, vocab, gen, shape="random")
    seen = torch.zeros(1, vocab, dtype=torch.bool)
    seen[0, torch.cat([prompt, generated], 1)[0]] = True
    counts = torch.zeros(1, vocab).scatter_add_(1, generated, torch.ones(1, 6))
    on = tables(which, seen, counts)
    got = ops.penalize_logits(tree, logits, repetition_penalty=repetition, presence_penalty=presence,
                              frequency_penalty=frequency, **on)
    for i in range(n):
        path = ref.path_to(tree.parent, 0, i)[1:]
        ids = torch.cat([prompt, generated, tree.token[:, path]], 1)
        row = logits[:, i].clone()
        if on["seen"] is not None:
            row = RepetitionPenaltyLogitsProcessor(repetition)(ids, row)
        if on["counts"] is not None:
            row = vllm_penalties(prompt.shape[1], presence, frequency)(ids, row)
        assert torch.equal(got[:, i], row), f"node {i}, path {path}"


def test_penalize_paths_by_hand():
    """A chain root -> 4 -> 4 -> 2 -> 4 with 3 generated once: token 4 counts once at node 1, twice at node 2, three
    times at node 4; max_depth cuts a path to its nearest nodes."""
    parent = torch.tensor([[-1, 0, 1, 2, 3]], dtype=torch.int32)
    token = torch.tensor([[3, 4, 4, 2, 4]])
    tree = ref.tree_from_parents(parent, token, torch.zeros(1, dtype=torch.int64))
    logits = torch.full((1, 5, 6), 1.0)
    counts = torch.zeros(1, 6)
    counts[0, 3] = 1.0
    got = ops.penalize_logits(tree, logits, counts=counts, frequency_penalty=0.25, presence_penalty=0.0)
    assert got[0, :, 4].tolist() == [1.0, 0.75, 0.5, 0.5, 0.25]
    assert got[0, :, 2].tolist() == [1.0, 1.0, 1.0, 0.75, 0.75]
    assert (got[0, :, 3] == 0.75).all() and (got[0, :, [0, 1, 5]] == 1.0).all()
    cut = ops.penalize_logits(tree, logits, counts=counts, frequency_penalty=0.25, max_depth=3)  # 2 nearest nodes
    assert cut[0, :, 4].tolist() == [1.0, 0.75, 0.5, 0.75, 0.75]
    seen = torch.zeros(1, 6, dtype=torch.bool)
    rep = ops.penalize_logits(tree, -logits, seen=seen, repetition_penalty=2.0)
    assert rep[0, :, 4].tolist() == [-1.0, -2.0, -2.0, -2.0, -2.0] and (rep[0, :, 5] == -1.0).all()


def test_penalize_edge_shapes():
    """max_depth past N (whole paths), a root-only tree, an empty batch, and a repetition penalty of 1 (the identity)
    with tables: the reference's results."""
    gen = torch.Generator().manual_seed(9)
    tree, logits, seen, counts = penalty_case(2, 9, 12, gen)
    kw = dict(seen=seen, counts=counts, repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2)
    assert torch.equal(ops.penalize_logits(tree, logits, max_depth=100, **kw), ops.penalize_logits(tree, logits, **kw))
    assert torch.equal(ops.penalize_logits(tree, logits, max_depth=100, **kw),
                       ref.penalize_logits(tree, logits, max_depth=100, **kw))
    root = ref.tree_from_parents(torch.full((2, 1), -1, dtype=torch.int32), torch.tensor([[3], [5]]),
                                 torch.zeros(2, dtype=torch.int64))
    assert torch.equal(ops.penalize_logits(root, logits[:, :1], **kw), ref.penalize_logits(root, logits[:, :1], **kw))
    empty = ref.tree_from_parents(torch.zeros(0, 9, dtype=torch.int32), torch.zeros(0, 9, dtype=torch.int64),
                                  torch.zeros(0, dtype=torch.int64))
    assert ops.penalize_logits(empty, logits[:0], **{**kw, "seen": seen[:0], "counts": counts[:0]}).shape == (0, 9, 12)
    assert torch.equal(ops.penalize_logits(tree, logits, seen=seen, repetition_penalty=1.0), logits)


def test_penalize_without_tables_upcasts():
    gen = torch.Generator().manual_seed(1)
    tree, logits, _, _ = penalty_case(2, 9, 11, gen, torch.bfloat16)
    assert torch.equal(ops.penalize_logits(tree, logits), logits.float())


def test_penalize_views_and_out():
    """Rows from wider buffers (generate's tables have a sink column; a strided node dim), and a given out."""
    gen = torch.Generator().manual_seed(2)
    tree, logits, seen, counts = penalty_case(2, 11, 29, gen)
    wide = torch.randn(2, 22, 40, generator=gen)
    wide[:, ::2, 3:32] = logits
    strided = wide[:, ::2, 3:32]
    seen_wide = torch.zeros(2, 30, dtype=torch.bool)
    seen_wide[:, :29] = seen
    counts_wide = torch.zeros(2, 30)
    counts_wide[:, :29] = counts
    kw = dict(repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.6)
    want = ref.penalize_logits(tree, logits, seen=seen, counts=counts, **kw)
    out = torch.full_like(want, 7.0)
    got = ops.penalize_logits(tree, strided, seen=seen_wide[:, :29], counts=counts_wide[:, :29], out=out, **kw)
    assert got is out and torch.equal(got, want)


def test_penalize_special_values():
    """NaN and infinities go through the same torch operations (NaN stays NaN, -inf * r stays -inf)."""
    tree = ref.tree_from_parents(torch.tensor([[-1, 0]], dtype=torch.int32), torch.tensor([[1, 2]]),
                                 torch.zeros(1, dtype=torch.int64))
    logits = torch.tensor([[[float("nan"), float("inf"), -float("inf"), 3.0]] * 2])
    seen = torch.ones(1, 4, dtype=torch.bool)
    counts = torch.ones(1, 4)
    kw = dict(seen=seen, counts=counts, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5)
    got, want = ops.penalize_logits(tree, logits, **kw), ref.penalize_logits(tree, logits, **kw)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def _bad_case():
    gen = torch.Generator().manual_seed(5)
    tree, logits, seen, counts = penalty_case(2, 7, 10, gen)
    return tree, dict(logits=logits, seen=seen, counts=counts, repetition_penalty=1.2, presence_penalty=0.1,
                      frequency_penalty=0.1, max_depth=4)


def _bad_parent(tree):
    parent = tree.parent.clone()
    parent[1, 3] = 5  # a later node: not topological
    return dict(parent=parent)


def _bad_token(tree):
    token = tree.token.clone()
    token[0, 6] = 10  # node 6 is on its own path (not the root)
    return dict(token=token)


PENALIZE_BAD = {  # name: (the argument the error names, change of (tree, keyword arguments))
    "logits_dtype": ("logits", lambda t, kw: (t, {**kw, "logits": kw["logits"].double()})),
    "logits_shape": ("logits", lambda t, kw: (t, {**kw, "logits": kw["logits"][:, :-1]})),
    "logits_last_dim_strided": ("logits", lambda t, kw: (t, {**kw, "logits": kw["logits"].mT.contiguous().mT})),
    "node_token_dtype": ("node_token", lambda t, kw: (t._replace(token=t.token.int()), kw)),
    "parent_dtype": ("parent", lambda t, kw: (t._replace(parent=t.parent.long()), kw)),
    "parent_value": ("parent", lambda t, kw: (t._replace(**_bad_parent(t)), kw)),
    "path_token_value": ("node_token", lambda t, kw: (t._replace(**_bad_token(t)), kw)),
    "seen_dtype": ("seen", lambda t, kw: (t, {**kw, "seen": kw["seen"].float()})),
    "seen_shape": ("seen", lambda t, kw: (t, {**kw, "seen": kw["seen"][:, :-1]})),
    "counts_dtype": ("counts", lambda t, kw: (t, {**kw, "counts": kw["counts"].long()})),
    "counts_shape": ("counts", lambda t, kw: (t, {**kw, "counts": kw["counts"][:1]})),
    "repetition_zero": ("repetition_penalty", lambda t, kw: (t, {**kw, "repetition_penalty": 0.0})),
    "repetition_nan": ("repetition_penalty", lambda t, kw: (t, {**kw, "repetition_penalty": float("nan")})),
    "repetition_subnormal": ("repetition_penalty", lambda t, kw: (t, {**kw, "repetition_penalty": 1e-40})),
    "presence_inf": ("presence_penalty", lambda t, kw: (t, {**kw, "presence_penalty": float("inf")})),
    "frequency_overflow": ("frequency_penalty", lambda t, kw: (t, {**kw, "frequency_penalty": 1e39})),
    "max_depth": ("max_depth", lambda t, kw: (t, {**kw, "max_depth": 0})),
    "repetition_without_seen": ("repetition_penalty needs seen", lambda t, kw: (t, {**kw, "seen": None})),
    "presence_without_counts": ("presence_penalty needs counts",
                                lambda t, kw: (t, {**kw, "counts": None, "frequency_penalty": 0.0})),
    "frequency_without_counts": ("frequency_penalty needs counts",
                                 lambda t, kw: (t, {**kw, "counts": None, "presence_penalty": 0.0})),
}


@pytest.mark.parametrize("name", list(PENALIZE_BAD))
def test_penalize_bad_input(name):
    tree, kw = _bad_case()
    arg, change = PENALIZE_BAD[name]
    tree, kw = change(tree, kw)
    out = torch.full(kw["logits"].shape, -7.0) if kw["logits"].dim() == 3 else None
    with pytest.raises(ValueError, match=f"penalize_logits: {arg}"):
        logits = kw.pop("logits")
        ops.penalize_logits(tree, logits, out=out, **kw)
    if out is not None:
        assert (out == -7.0).all(), "a failed call wrote its output"


def test_penalize_bad_out():
    tree, kw = _bad_case()
    logits = kw.pop("logits")
    for out in (torch.empty(logits.shape, dtype=torch.bfloat16), torch.empty(2, 7, 11),
                torch.empty(2, 7, 20)[..., ::2]):
        with pytest.raises(ValueError, match="penalize_logits: out"):
            ops.penalize_logits(tree, logits, out=out, **kw)
    with pytest.raises(ValueError, match="penalize_logits: out must not share memory with logits"):
        ops.penalize_logits(tree, logits, out=logits, **kw)
    with pytest.raises(ValueError, match="penalize_logits: out must not share memory with counts"):
        big = torch.zeros(2 * 7 * 10 + 20)
        ops.penalize_logits(tree, logits, out=big[:140].view(2, 7, 10), **{**kw, "counts": big[120:140].view(2, 10)})


def test_opcheck_penalize():
    tree, kw = _bad_case()
    o = load_ops()
    out = torch.empty(kw["logits"].shape)
    torch.library.opcheck(o.penalize_logits, (kw["logits"], tree.token, tree.parent, kw["seen"], kw["counts"], 1.2,
                                              0.1, 0.1, 4, out))
    torch.library.opcheck(o.penalize_logits, (kw["logits"].half(), tree.token, tree.parent, None, None, 1.0, 0.0,
                                              0.0, 1, out))
