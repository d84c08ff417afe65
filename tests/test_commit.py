"""commit_gdn_state, commit_conv_state, commit_kv and gather_rows (CPU) against ddtree_ext.reference."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close, poison, random_parents
from ddtree_ext import ops
from ddtree_ext import reference as ref
from ddtree_ext._loader import load_ops


def random_paths(batch: int, max_accept: int, num_nodes: int, gen: torch.Generator):
    """accepted [B, D] int32 (root first, strictly increasing, -1 padded) and accept_len [B] int32
    cycling through 1..D, so batch rows accept different lengths."""
    accepted = torch.full((batch, max_accept), -1, dtype=torch.int32)
    accept_len = torch.tensor([b % max_accept + 1 for b in range(batch)], dtype=torch.int32)
    for b in range(batch):
        rest = torch.randperm(num_nodes - 1, generator=gen)[: int(accept_len[b]) - 1].sort().values + 1
        accepted[b, : int(accept_len[b])] = torch.cat([torch.zeros(1, dtype=torch.int64), rest]).int()
    return accepted, accept_len


def random_cumg(batch: int, num_nodes: int, heads: int, gen: torch.Generator) -> torch.Tensor:
    """Log decays summed along paths: decreasing with the node index, as along any topological path."""
    return -torch.rand(batch, num_nodes, heads, generator=gen).cumsum(1)


# ---- commit_gdn_state ------------------------------------------------------------------------


def gdn_layers(layers, batch, num_nodes, heads, key_heads, key_dim, value_dim, gen):
    state = [torch.randn(batch, heads, key_dim, value_dim, generator=gen) for _ in range(layers)]
    stash_u = [torch.randn(batch, num_nodes, heads, value_dim, generator=gen) for _ in range(layers)]
    stash_k = [
        torch.nn.functional.normalize(torch.randn(batch, num_nodes, key_heads, key_dim, generator=gen), dim=-1)
        for _ in range(layers)
    ]
    stash_cumg = [random_cumg(batch, num_nodes, heads, gen) for _ in range(layers)]
    return state, stash_u, stash_k, stash_cumg


@pytest.mark.parametrize("heads,key_heads", [(4, 2), (3, 3), (6, 1)])
def test_gdn_state_vs_reference(heads, key_heads):
    gen = torch.Generator().manual_seed(heads * 10 + key_heads)
    batch, num_nodes, max_accept = 7, 13, 6
    state, stash_u, stash_k, stash_cumg = gdn_layers(3, batch, num_nodes, heads, key_heads, 16, 9, gen)
    accepted, accept_len = random_paths(batch, max_accept, num_nodes, gen)
    expected = ref.commit_gdn_state(state, stash_u, stash_k, stash_cumg, accepted, accept_len)
    inputs = [t.clone() for t in stash_u + stash_k + stash_cumg]
    ops.commit_gdn_state(state, stash_u, stash_k, stash_cumg, accepted, accept_len)
    for layer, (s, e) in enumerate(zip(state, expected)):
        assert_close(s, e, torch.float32, f"state[{layer}]")
    assert all(torch.equal(a, b) for a, b in zip(stash_u + stash_k + stash_cumg, inputs)), "an input changed"


def test_gdn_state_is_the_recurrence_along_the_path():
    """End to end with the reference tree rule's stash: the committed state equals running the plain
    recurrence S <- e^g S + k (beta (v - e^g S^T k))^T along the accepted path."""
    gen = torch.Generator().manual_seed(4)
    batch, num_nodes, key_heads, heads, key_dim, value_dim = 2, 8, 1, 2, 4, 3
    parent = torch.stack([random_parents(num_nodes, gen) for _ in range(batch)])
    q = torch.randn(batch, num_nodes, key_heads, key_dim, generator=gen)
    k = torch.randn(batch, num_nodes, key_heads, key_dim, generator=gen)
    v = torch.randn(batch, num_nodes, heads, value_dim, generator=gen)
    g = -torch.rand(batch, num_nodes, heads, generator=gen)
    beta = torch.rand(batch, num_nodes, heads, generator=gen)
    state0 = torch.randn(batch, heads, key_dim, value_dim, generator=gen)
    stash = ref.tree_gated_delta_rule(q, k, v, g, beta, state0, parent)
    leaf = [num_nodes - 1, int(parent[1, num_nodes - 1])]  # a deep node per row
    paths = [ref.path_to(parent, b, leaf[b]) for b in range(batch)]
    accepted = torch.full((batch, num_nodes), -1, dtype=torch.int32)
    for b, path in enumerate(paths):
        accepted[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
    accept_len = torch.tensor([len(p) for p in paths], dtype=torch.int32)

    state = [state0.clone()]
    ops.commit_gdn_state(state, [stash.stash_u], [stash.stash_k], [stash.stash_cumg], accepted, accept_len)

    kn = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + ref.L2NORM_EPS)
    expected = state0.clone()
    for b, path in enumerate(paths):
        for h in range(heads):
            s = state0[b, h].clone()
            for node in path:
                s = s * torch.exp(g[b, node, h])
                kk = kn[b, node, h // (heads // key_heads)]
                s = s + torch.outer(kk, beta[b, node, h] * (v[b, node, h] - s.T @ kk))
            expected[b, h] = s
    assert_close(state[0], expected, torch.float32, "state")


# ---- commit_conv_state -----------------------------------------------------------------------


def conv_state_view(batch, channels, width, dtype, layout, gen):
    """(view [B, C, S] to commit into, the buffer it lives in)."""
    if layout == "contiguous":
        base = torch.randn(batch, channels, width, generator=gen).to(dtype)
        return base, base
    if layout == "window":  # columns and channels of a larger buffer
        base = torch.randn(batch, channels + 3, width + 2, generator=gen).to(dtype)
        return base[:, 1 : channels + 1, 2:], base
    base = torch.randn(batch, width, channels, generator=gen).to(dtype)  # channels last
    return base.transpose(1, 2), base


@pytest.mark.parametrize("layout", ["contiguous", "window", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_conv_state_vs_reference(dtype, layout):
    gen = torch.Generator().manual_seed(len(layout))
    batch, num_nodes, max_accept = 6, 11, 6
    shapes = [(10, 3), (7, 4), (5, 1), (3, 8)]  # (channels, width): paths shorter and longer than the window
    views, bases, xs = [], [], []
    for channels, width in shapes:
        view, base = conv_state_view(batch, channels, width, dtype, layout, gen)
        views.append(view)
        bases.append(base)
        xs.append(torch.randn(batch, num_nodes, channels + 2, generator=gen).to(dtype)[..., :channels])
    accepted, accept_len = random_paths(batch, max_accept, num_nodes, gen)
    expected_bases = [b.clone() for b in bases]
    for base, view, new in zip(expected_bases, views, ref.commit_conv_state(views, xs, accepted, accept_len)):
        base.as_strided(view.shape, view.stride(), view.storage_offset()).copy_(new)
    ops.commit_conv_state(views, xs, accepted, accept_len)
    for layer, (base, expected) in enumerate(zip(bases, expected_bases)):
        assert torch.equal(base, expected), f"conv_state[{layer}] (or the buffer around it) differs"


# ---- commit_kv -------------------------------------------------------------------------------


def kv_cache_view(batch, heads, slots, head_dim, dtype, layout, gen):
    """(view [B, H, S, Dh] to commit into, the buffer it lives in)."""
    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 50).to(dtype)

    if layout == "contiguous":
        base = rand(batch, heads, slots, head_dim)
        return base, base
    if layout == "window":  # a slot range and the first head_dim entries of a padded buffer
        base = rand(batch, heads, slots + 5, head_dim + 3)
        return base[:, :, 2 : slots + 2, :head_dim], base
    base = rand(batch, slots, heads, head_dim)  # [B, S, H, Dh] storage
    return base.transpose(1, 2), base


@pytest.mark.parametrize("layout", ["contiguous", "window", "seq_major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_kv_vs_reference(dtype, layout):
    gen = torch.Generator().manual_seed(3 + len(layout))
    batch, num_nodes, max_accept, slots = 5, 12, 7, 40
    prefix_len = torch.tensor([0, 3, 17, slots - num_nodes, 9])
    # keys and values of 3 layers; head counts and head dims may differ between tensors
    views, bases = [], []
    for heads, head_dim in [(2, 8), (2, 8), (3, 5), (3, 5), (1, 16), (1, 16)]:
        view, base = kv_cache_view(batch, heads, slots, head_dim, dtype, layout, gen)
        views.append(view)
        bases.append(base)
    accepted, accept_len = random_paths(batch, max_accept, num_nodes, gen)
    # Row 0: every node moves one or more slots down onto slots other path nodes are read from.
    accepted[0] = torch.tensor([0, 2, 3, 4, 7, 8, 11], dtype=torch.int32)
    accept_len[0] = max_accept
    accepted[3, : int(accept_len[3])] = torch.arange(num_nodes - int(accept_len[3]), num_nodes, dtype=torch.int32)
    accepted[3, 0] = 0  # and row 3 reaches the last slot of the cache
    expected_bases = [b.clone() for b in bases]
    for base, view, new in zip(expected_bases, views, ref.commit_kv(views, prefix_len, accepted, accept_len)):
        base.as_strided(view.shape, view.stride(), view.storage_offset()).copy_(new)
    ops.commit_kv(views, prefix_len, accepted, accept_len)
    for layer, (base, expected) in enumerate(zip(bases, expected_bases)):
        assert torch.equal(base, expected), f"cache[{layer}] (or the buffer around it) differs"


# ---- gather_rows -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_gather_rows_vs_reference(dtype):
    gen = torch.Generator().manual_seed(6)
    batch, num_nodes, max_accept, features = 5, 10, 4, 13
    src = torch.randn(batch, num_nodes, features + 2, generator=gen)[..., :features]
    src = (src > 0) if dtype == torch.bool else (src * 100).to(dtype)
    accepted, accept_len = random_paths(batch, max_accept, num_nodes, gen)
    buffer = torch.ones(batch, max_accept + 1, features + 3, dtype=dtype)
    out = poison(buffer[:, 1:, 2 : features + 2])
    around = buffer.clone()
    ops.gather_rows(src, accepted, accept_len, out=out)
    assert torch.equal(out, ref.gather_rows(src, accepted, accept_len))
    around[:, 1:, 2 : features + 2] = out
    assert torch.equal(buffer, around), "gather_rows wrote outside out"


# ---- bad input -------------------------------------------------------------------------------


def _gdn_case():
    gen = torch.Generator().manual_seed(1)
    state, stash_u, stash_k, stash_cumg = gdn_layers(2, 3, 6, 4, 2, 5, 3, gen)
    accepted, accept_len = random_paths(3, 4, 6, gen)
    return dict(state=state, stash_u=stash_u, stash_k=stash_k, stash_cumg=stash_cumg, accepted=accepted,
                accept_len=accept_len)


def _with(t, index, value):
    t = t.clone()
    t[index] = value
    return t


# Shared path checks: each replaces accepted / accept_len (against N = 6, D = 4).
PATH_BAD = {
    "accept_len_zero": ("accept_len", lambda a, n: (a, _with(n, 1, 0))),
    "accept_len_over_d": ("accept_len", lambda a, n: (a, _with(n, 1, 5))),
    "accepted_out_of_range": ("accepted", lambda a, n: (_with(a, (2, 1), 6), n)),
    "accepted_negative": ("accepted", lambda a, n: (_with(a, (2, 1), -1), n)),
    "accepted_not_increasing": ("accepted", lambda a, n: (_with(a, (2, 2), int(a[2, 1])), n)),
    "accepted_dtype": ("accepted", lambda a, n: (a.long(), n)),
    "accept_len_shape": ("accept_len", lambda a, n: (a, n[:2])),
    "accepted_strided": ("accepted", lambda a, n: (torch.cat([a, a], 1)[:, ::2], n)),
}

GDN_BAD = {
    "layer_count": ("stash_k", lambda c: c["stash_k"].pop()),
    "batch": ("state\\[1\\]", lambda c: c["state"].__setitem__(1, c["state"][1][:2].clone())),
    "num_nodes": ("stash_u\\[1\\]", lambda c: c["stash_u"].__setitem__(1, c["stash_u"][1][:, :5].clone())),
    "key_heads": ("stash_k\\[0\\]", lambda c: c["stash_k"].__setitem__(0, torch.randn(3, 6, 3, 5))),
    "value_heads": ("stash_cumg\\[1\\]", lambda c: c["stash_cumg"].__setitem__(1, torch.randn(3, 6, 2))),
    "dtype": ("state\\[0\\]", lambda c: c["state"].__setitem__(0, c["state"][0].double())),
    "contiguity": ("state\\[1\\]", lambda c: c["state"].__setitem__(1, c["state"][1].mT.contiguous().mT)),
}


def _assert_gdn_raises(case, arg):
    state_before = [s.clone() for s in case["state"]]
    with pytest.raises(ValueError, match=f"commit_gdn_state: {arg}"):
        ops.commit_gdn_state(**case)
    assert all(torch.equal(a, b) for a, b in zip(case["state"], state_before)), "a failed call wrote state"


@pytest.mark.parametrize("name", list(GDN_BAD))
def test_gdn_state_bad_input(name):
    case = _gdn_case()
    arg, change = GDN_BAD[name]
    change(case)
    _assert_gdn_raises(case, arg)


@pytest.mark.parametrize("name", list(PATH_BAD))
def test_path_bad_input(name):
    """The shared path checks, through commit_gdn_state (value checks run before any layer is written)."""
    case = _gdn_case()
    arg, change = PATH_BAD[name]
    case["accepted"], case["accept_len"] = change(case["accepted"], case["accept_len"])
    _assert_gdn_raises(case, arg)


def _conv_case():
    gen = torch.Generator().manual_seed(2)
    conv_state = [torch.randn(3, 8, 3, generator=gen), torch.randn(3, 5, 4, generator=gen)]
    x = [torch.randn(3, 6, 8, generator=gen), torch.randn(3, 6, 5, generator=gen)]
    accepted, accept_len = random_paths(3, 4, 6, gen)
    return conv_state, x, accepted, accept_len


CONV_BAD = {
    "layer_count": ("x", lambda cs, x: (cs, x[:1])),
    "channels": ("x\\[1\\]", lambda cs, x: (cs, [x[0], x[1][:, :, :4]])),
    "num_nodes": ("x\\[1\\]", lambda cs, x: (cs, [x[0], x[1][:, :5]])),
    "dtype": ("x\\[1\\]", lambda cs, x: (cs, [x[0], x[1].bfloat16()])),
    "last_dim_strided": ("x\\[0\\]", lambda cs, x: (cs, [x[0].mT.contiguous().mT, x[1]])),
    "not_float": ("conv_state\\[0\\]", lambda cs, x: ([cs[0].long(), cs[1]], [x[0].long(), x[1]])),
}


@pytest.mark.parametrize("name", list(CONV_BAD))
def test_conv_state_bad_input(name):
    conv_state, x, accepted, accept_len = _conv_case()
    arg, change = CONV_BAD[name]
    conv_state, x = change(conv_state, x)
    before = [c.clone() for c in conv_state]
    with pytest.raises(ValueError, match=f"commit_conv_state: {arg}"):
        ops.commit_conv_state(conv_state, x, accepted, accept_len)
    assert all(torch.equal(a, b) for a, b in zip(conv_state, before)), "a failed call wrote conv_state"


KV_BAD = {
    "prefix_dtype": ("prefix_len", lambda c, p: (c, p.int())),
    "prefix_negative": ("prefix_len", lambda c, p: (c, _with(p, 1, -1))),
    "past_last_slot": ("prefix_len", lambda c, p: (c, _with(p, 2, 20 - 5))),
    "sum_would_wrap": ("prefix_len", lambda c, p: (c, _with(p, 2, 2**63 - 2))),
    "batch": ("cache\\[2\\]", lambda c, p: (c[:2] + [c[2][:2].clone()] + c[3:], p)),
    "last_dim_strided": ("cache\\[3\\]", lambda c, p: (c[:3] + [c[3].transpose(2, 3)], p)),
    "dims": ("cache\\[1\\]", lambda c, p: (c[:1] + [c[1][0]] + c[2:], p)),
}


def _kv_case():
    """Row 2's path ends at node 5 = slot 14 + 5 = 19, the last of 20."""
    gen = torch.Generator().manual_seed(3)
    cache = [torch.randn(3, 2, 20, 8, generator=gen) for _ in range(4)]
    accepted, accept_len = random_paths(3, 4, 6, gen)
    accepted[2, : int(accept_len[2])] = torch.tensor([0, 4, 5], dtype=torch.int32)
    return cache, torch.tensor([0, 5, 14]), accepted, accept_len


@pytest.mark.parametrize("name", list(KV_BAD))
def test_kv_bad_input(name):
    cache, prefix_len, accepted, accept_len = _kv_case()
    arg, change = KV_BAD[name]
    cache, prefix_len = change(cache, prefix_len)
    before = [c.clone() for c in cache]
    with pytest.raises(ValueError, match=f"commit_kv: {arg}"):
        ops.commit_kv(cache, prefix_len, accepted, accept_len)
    assert all(torch.equal(a, b) for a, b in zip(cache, before)), "a failed call wrote the cache"


def test_kv_last_slot_is_allowed():
    """The bound is tight: a path ending exactly at the last slot commits."""
    cache, prefix_len, accepted, accept_len = _kv_case()
    expected = ref.commit_kv(cache, prefix_len, accepted, accept_len)
    ops.commit_kv(cache, prefix_len, accepted, accept_len)
    assert all(torch.equal(a, b) for a, b in zip(cache, expected))


GATHER_BAD = {
    "out_shape": ("out", lambda s, o: (s, o[:, :3])),
    "out_dtype": ("out", lambda s, o: (s, o.double())),
    "src_batch": ("src", lambda s, o: (s[:2], o)),
    "src_last_dim_strided": ("src", lambda s, o: (s.mT.contiguous().mT, o)),
    # src all NaN, so a write into out (a view of it) would show
    "out_overlaps_src": ("out must not overlap src",
                         lambda s, o: (lambda p: (p, p[:, :4]))(torch.full_like(s, torch.nan))),
}


@pytest.mark.parametrize("name", list(GATHER_BAD))
def test_gather_rows_bad_input(name):
    gen = torch.Generator().manual_seed(5)
    accepted, accept_len = random_paths(3, 4, 6, gen)
    arg, change = GATHER_BAD[name]
    src, out = change(torch.randn(3, 6, 5, generator=gen), poison(torch.empty(3, 4, 5)))
    with pytest.raises(ValueError, match=f"gather_rows: {arg}"):
        ops.gather_rows(src, accepted, accept_len, out=out)
    assert out.isnan().all(), "a failed call wrote out"


def test_empty_layer_lists_are_a_no_op():
    """A target without GDN layers commits nothing."""
    accepted, accept_len = random_paths(2, 3, 4, torch.Generator().manual_seed(0))
    ops.commit_gdn_state([], [], [], [], accepted, accept_len)
    ops.commit_conv_state([], [], accepted, accept_len)
    ops.commit_kv([], torch.zeros(2, dtype=torch.int64), accepted, accept_len)


def test_opcheck_commits():
    o = load_ops()
    case = _gdn_case()
    torch.library.opcheck(o.commit_gdn_state, tuple(case.values()))
    conv_state, x, accepted, accept_len = _conv_case()
    torch.library.opcheck(o.commit_conv_state, (conv_state, x, accepted, accept_len))
    cache, prefix_len, accepted, accept_len = _kv_case()
    torch.library.opcheck(o.commit_kv, (cache, prefix_len, accepted, accept_len))
    torch.library.opcheck(o.gather_rows, (torch.randn(3, 6, 5), accepted, accept_len, torch.empty(3, 4, 5)))


# ---- store_kv (a verify's K/V rows into the static caches) -------------------------------------------------


def _store_kv_case(dtype=torch.float32, gen=None):
    gen = gen or torch.Generator().manual_seed(5)
    keys = torch.randn(1, 3, 20, 8, generator=gen).to(dtype)
    values = torch.randn(1, 3, 20, 8, generator=gen).to(dtype)
    # key_states contiguous [B, H, N, D] (RoPE's output), value_states a transposed view [B, N, H, D] -> [B, H, N, D]
    key_states = torch.randn(1, 3, 5, 8, generator=gen).to(dtype)
    value_states = torch.randn(1, 5, 3, 8, generator=gen).to(dtype).transpose(1, 2)
    slots = torch.tensor([7, 8, 9, 10, 11])
    return keys, values, slots, key_states, value_states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_is_two_index_copies(dtype):
    keys, values, slots, key_states, value_states = _store_kv_case(dtype)
    expected_k, expected_v = keys.clone(), values.clone()
    expected_k.index_copy_(2, slots, key_states)
    expected_v.index_copy_(2, slots, value_states)
    ref_k, ref_v = keys.clone(), values.clone()
    ref.store_kv(ref_k, ref_v, slots, key_states, value_states)
    ops.store_kv(keys, values, slots, key_states, value_states)
    assert torch.equal(keys, expected_k) and torch.equal(values, expected_v)
    assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_per_batch_row_slots_skip_negatives(dtype):
    """slots [B, N]: each batch row its own table; a negative slot stores nothing (a padding row), as the reference
    and per-row index copies of the kept rows do."""
    gen = torch.Generator().manual_seed(6)
    keys, values = (torch.randn(3, 2, 12, 4, generator=gen).to(dtype) for _ in range(2))
    key_states = torch.randn(3, 2, 5, 4, generator=gen).to(dtype)
    value_states = torch.randn(3, 5, 2, 4, generator=gen).to(dtype).transpose(1, 2)
    slots = torch.tensor([[3, 4, -1, -1, 5], [0, 1, 2, 3, 4], [-1, -1, -1, -1, -1]])
    original, expected_k, expected_v = keys.clone(), keys.clone(), values.clone()
    for b in range(3):
        keep = slots[b] >= 0
        expected_k[b].index_copy_(1, slots[b][keep], key_states[b][:, keep])
        expected_v[b].index_copy_(1, slots[b][keep], value_states[b][:, keep])
    ref_k, ref_v = keys.clone(), values.clone()
    ref.store_kv(ref_k, ref_v, slots, key_states, value_states)
    ops.store_kv(keys, values, slots, key_states, value_states)
    assert torch.equal(keys, expected_k) and torch.equal(values, expected_v)
    assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
    assert torch.equal(keys[2], original[2]) and not torch.equal(keys[1], original[1])  # skipped / stored


@pytest.mark.parametrize("mistake", ["slot_out_of_range", "batch_slot_out_of_range", "slots_batch", "int32_slots",
                                     "strided_slots", "state_shape", "state_dtype", "values_shape", "overlap"])
def test_store_kv_bad_input(mistake):
    keys, values, slots, key_states, value_states = _store_kv_case()
    message = {
        "slot_out_of_range": r"store_kv: slots\[4\] = 20 must be below 20 \(the caches' slots",
        "batch_slot_out_of_range": r"store_kv: slots\[0, 2\] = 25 must be below 20",
        "slots_batch": r"store_kv: slots must have shape \[N\] .* or \[B, N\] = \[1, N\], got \[2, 5\]",
        "int32_slots": "store_kv: slots must have dtype Long",
        "strided_slots": "store_kv: slots must be contiguous",
        "state_shape": r"store_kv: key_states must have shape \[B, H, N, D\] = \[1, 3, 5, 8\]",
        "state_dtype": "store_kv: value_states must have dtype Float",
        "values_shape": r"store_kv: values must have shape \[1, 3, 20, 8\]",
        "overlap": "store_kv: keys must not overlap key_states",
    }[mistake]
    if mistake == "slot_out_of_range":
        slots = torch.tensor([7, 8, 9, 10, 20])
    elif mistake == "batch_slot_out_of_range":
        slots = torch.tensor([[-1, 8, 25, 10, 11]])  # the negative one is fine: a row not stored
    elif mistake == "slots_batch":
        slots = torch.stack([slots, slots])
    elif mistake == "int32_slots":
        slots = slots.int()
    elif mistake == "strided_slots":
        slots = torch.arange(7, 17)[::2]
    elif mistake == "state_shape":
        key_states = key_states[:, :, :4]
    elif mistake == "state_dtype":
        value_states = value_states.double()
    elif mistake == "values_shape":
        values = values[:, :2]
    else:
        key_states = keys.view(-1)[: 3 * 5 * 8].view(1, 3, 5, 8)  # a contiguous stretch of the cache itself
    before = (keys.clone(), values.clone())
    with pytest.raises(ValueError, match=message):
        ops.store_kv(keys, values, slots, key_states, value_states)
    assert torch.equal(keys, before[0]) and torch.equal(values, before[1])  # nothing written


def test_opcheck_store_kv():
    torch.library.opcheck(load_ops().store_kv, _store_kv_case())
    keys, values, slots, key_states, value_states = _store_kv_case()
    torch.library.opcheck(load_ops().store_kv, (keys, values, slots[None].clone(), key_states, value_states))
