"""Arguments that share memory, and other inputs an op can only get wrong silently: each is refused with a ValueError
naming the op and the argument, before anything is written (the tensors an op would write are compared bit for bit
after the refusal). Found by an audit of the CPU ops; every check here is shared with the CUDA ops."""

from __future__ import annotations

import pytest
import torch

from ddtree_ext import ops


def _gdn_layer(batch=2, nodes=5, heads=2, key_dim=4, value_dim=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(batch, heads, key_dim, value_dim, generator=gen)
    stash_u = torch.randn(batch, nodes, heads, value_dim, generator=gen)
    stash_k = torch.randn(batch, nodes, heads, key_dim, generator=gen)
    stash_cumg = -torch.rand(batch, nodes, heads, generator=gen).cumsum(1)
    return state, stash_u, stash_k, stash_cumg


PATH = torch.tensor([[0, 2, 3], [0, 1, -1]], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32)


def _refused(match, call, *written):
    """call() raises a ValueError matching ``match`` and leaves every tensor in ``written`` as it was."""
    before = [t.clone() for t in written]
    with pytest.raises(ValueError, match=match):
        call()
    for t, b in zip(written, before):
        assert torch.equal(t, b), "a refused call wrote"


# ---- commits: per-layer lists and paths ----------------------------------------------------


def test_commit_kv_refuses_a_cache_listed_twice():
    """Two layers in one buffer would move each row twice (and race on CUDA)."""
    cache = torch.arange(2 * 10.0).view(2, 1, 10, 1).clone()
    other = torch.zeros(2, 1, 10, 1)
    _refused(r"commit_kv: cache\[\d\] and cache\[\d\] must not share memory", lambda: ops.commit_kv(
        [cache, other, cache], torch.tensor([0, 4]), *PATH), cache, other)
    half = cache[:, :, :6]  # one layer's view inside another's
    _refused("commit_kv: cache.* must not share memory", lambda: ops.commit_kv([cache, half], torch.tensor([0, 4]),
                                                                                *PATH), cache)
    _refused(r"commit_kv: cache\[0\] must not overlap itself", lambda: ops.commit_kv(
        [torch.zeros(2, 1, 1, 1).expand(2, 1, 10, 1)], torch.tensor([0, 4]), *PATH))


def test_commit_gdn_state_refuses_shared_states_and_stashes():
    state, u, k, g = _gdn_layer()
    _refused(r"commit_gdn_state: state\[0\] and state\[1\] must not share memory",
             lambda: ops.commit_gdn_state([state, state], [u, u], [k, k], [g, g], *PATH), state)
    # A stash that is the state itself (possible when N == K): read while the state is written.
    state2, _, k2, g2 = _gdn_layer(nodes=4, key_dim=4, value_dim=3)
    _refused(r"commit_gdn_state: state\[0\] must not overlap stash_u\[0\]", lambda: ops.commit_gdn_state(
        [state2], [state2.view(2, 4, 2, 3)], [k2], [g2], *PATH), state2)


def test_commit_conv_state_refuses_shared_states():
    conv = torch.randn(2, 6, 3)
    x = torch.randn(2, 5, 6)
    _refused(r"commit_conv_state: conv_state\[0\] and conv_state\[1\] must not share memory",
             lambda: ops.commit_conv_state([conv, conv], [x, x], *PATH), conv)
    _refused(r"commit_conv_state: conv_state\[0\] must not overlap itself",
             lambda: ops.commit_conv_state([torch.zeros(2, 6, 1).expand(2, 6, 3)], [x], *PATH))


@pytest.mark.parametrize("op", ["commit_kv", "commit_gdn_state", "commit_conv_state", "gather_rows"])
def test_commit_paths_start_at_the_root(op):
    """A path that skips the root would overwrite the root's slot with another node's row."""
    accepted, accept_len = torch.tensor([[1, 2, -1], [0, 1, -1]], dtype=torch.int32), torch.tensor([2, 2],
                                                                                                 dtype=torch.int32)
    state, u, k, g = _gdn_layer()
    cache, conv, x = torch.randn(2, 1, 10, 2), torch.randn(2, 6, 3), torch.randn(2, 5, 6)
    calls = {
        "commit_kv": (lambda: ops.commit_kv([cache], torch.tensor([0, 4]), accepted, accept_len), cache),
        "commit_gdn_state": (lambda: ops.commit_gdn_state([state], [u], [k], [g], accepted, accept_len), state),
        "commit_conv_state": (lambda: ops.commit_conv_state([conv], [x], accepted, accept_len), conv),
        "gather_rows": (lambda: ops.gather_rows(x, accepted, accept_len), x),
    }
    call, written = calls[op]
    _refused(rf"{op}: accepted\[0, 0\] must be the root, 0", call, written)


# ---- store_kv ----------------------------------------------------------------------------------


def test_store_kv_refuses_overlapping_caches_and_repeated_slots():
    keys, values = torch.zeros(2, 2, 10, 4), torch.zeros(2, 2, 10, 4)
    states = torch.ones(2, 2, 3, 4), torch.ones(2, 2, 3, 4)
    slots = torch.tensor([1, 2, 3])
    _refused("store_kv: keys must not overlap values", lambda: ops.store_kv(keys, keys, slots, *states), keys)
    expanded = torch.zeros(2, 1, 10, 4).expand(2, 2, 10, 4)
    _refused("store_kv: values must not overlap itself", lambda: ops.store_kv(keys, expanded, slots, *states), keys)
    _refused("store_kv: slots stores slot 3 twice", lambda: ops.store_kv(keys, values, torch.tensor([3, -1, 3]),
                                                                        *states), keys, values)
    _refused(r"store_kv: slots\[1\] stores slot 2 twice", lambda: ops.store_kv(
        keys, values, torch.tensor([[1, 2, 3], [2, 2, -1]]), *states), keys, values)
    ops.store_kv(keys, values, torch.tensor([[1, 2, -1], [-1, -1, 2]]), *states)  # padding repeats -1: fine


# ---- outputs that overlap themselves or an input -----------------------------------------------


def _expanded(*shape):
    return torch.zeros(1, *shape[1:]).expand(*shape)


def test_outputs_must_not_overlap_themselves():
    x = torch.randn(4, 8)
    cases = [
        ("rms_norm: out must not overlap itself", lambda: ops.rms_norm(x, torch.ones(8), 1e-6, out=_expanded(4, 8))),
        ("silu_mul: out must not overlap itself", lambda: ops.silu_mul(x, x.clone(), out=_expanded(4, 8))),
        ("rope: out must not overlap itself", lambda: ops.rope(
            torch.randn(1, 2, 3, 4), torch.ones(1, 3, 4), torch.zeros(1, 3, 4),
            out=torch.zeros(1, 1, 3, 4).expand(1, 2, 3, 4))),
        ("topk_logprobs: logp must not overlap itself", lambda: ops.topk_logprobs(
            torch.randn(1, 2, 9), 3, out=ops.TopK(torch.zeros(1, 1, 3).expand(1, 2, 3),
                                                  torch.zeros(1, 2, 3, dtype=torch.long)))),
        ("tree_attention_mask: mask must not overlap itself", lambda: ops.tree_attention_mask(
            ops.chain_tree(torch.ones(1, 3, dtype=torch.long), torch.tensor([2])).ancestor_mask, torch.tensor([2]), 6,
            out=torch.zeros(1, 1, 1, 6, dtype=torch.bool).expand(1, 1, 3, 6))),
        ("gather_rows: out must not overlap itself", lambda: ops.gather_rows(
            torch.randn(2, 5, 4), *PATH, out=_expanded(2, 3, 4))),
    ]
    for match, call in cases:
        with pytest.raises(ValueError, match=match):
            call()


def test_attention_out_must_not_overlap_k_or_v():
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4)
    mask = torch.ones(1, 1, 3, 6, dtype=torch.bool)
    for name, t in (("k", k), ("v", v)):
        out = t.view(-1)[: 24].view(1, 2, 3, 4)
        _refused(f"gqa_attention: out must not overlap {name}", lambda: ops.gqa_attention(q, k, v, mask, 0.5, out=out),
                 k, v)


def test_gdn_outputs_must_not_overlap_inputs():
    """A stash of the input's shape and dtype (stash_cumg like beta or g) would be written while it is read."""
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 3, 1, 4, generator=gen), torch.randn(1, 3, 1, 4, generator=gen)
    v, g = torch.randn(1, 3, 2, 4, generator=gen), -torch.rand(1, 3, 2, generator=gen)
    beta, state = torch.rand(1, 3, 2, generator=gen), torch.randn(1, 2, 4, 4, generator=gen)
    parent = torch.tensor([[-1, 0, 1]], dtype=torch.int32)
    out = ops.tree_gated_delta_rule(q, k, v, g, beta, state, parent)
    _refused("tree_gated_delta_rule: stash_cumg must not share memory with beta", lambda: ops.tree_gated_delta_rule(
        q, k, v, g, beta, state, parent, out=ops.GDNTreeOutput(out.out, out.stash_u, out.stash_k, beta)), beta, state)
    # The fused conv + delta rule: an output in the pre-conv input x (read by the conv after the stashes are written)
    x = torch.randn(1, 3, 16, generator=gen)  # C = 2 H K + HV V = 2 * 4 + 2 * 4
    conv_state = torch.randn(1, 16, 3, generator=gen)
    fused = ops.gdn_conv_delta_rule(x, torch.randn(16, 4, generator=gen), None, conv_state, g, beta, state, parent,
                                    num_heads=1, head_k_dim=4, head_v_dim=4)
    for name, host in (("x", x), ("conv_state", conv_state)):
        aliased = ops.GDNTreeOutput(fused.out, fused.stash_u, fused.stash_k, host.view(-1)[:6].view(1, 3, 2))
        _refused(f"gdn_conv_delta_rule: stash_cumg must not share memory with {name}", lambda: ops.gdn_conv_delta_rule(
            x, torch.randn(16, 4), None, conv_state, g, beta, state, parent, num_heads=1, head_k_dim=4,
            head_v_dim=4, out=aliased), x, conv_state, state)
    x, weight, buffer = torch.randn(1, 3, 5), torch.randn(5, 4), torch.randn(15)
    bias = buffer[:5]  # the first row of out
    _refused("tree_conv1d: out must not overlap bias", lambda: ops.tree_conv1d(
        x, weight, bias, torch.randn(1, 5, 3), parent, out=buffer.view(1, 3, 5)), buffer)


# ---- build ---------------------------------------------------------------------------------------


def test_build_tree_refuses_aliased_outputs_and_bad_prefix_lengths():
    logp = torch.randn(1, 3, 2).log_softmax(-1).sort(-1, descending=True).values
    tokens = torch.arange(6).view(1, 3, 2)
    root, prefix = torch.tensor([7]), torch.tensor([4])
    tree = ops.empty_tree(1, 4)
    aliased = tree._replace(depth=tree.parent)
    _refused("build_tree: parent must not share memory with depth", lambda: ops.build_tree(
        logp, tokens, root, prefix, 4, out=aliased), tree.parent)
    for bad in (-1, 2**63 - 2):
        _refused(r"build_tree: prefix_len\[0\] must be >= 0 and leave room", lambda: ops.build_tree(
            logp, tokens, root, torch.tensor([bad]), 4, out=tree), *tree)


def test_chain_tree_checks_every_field_of_out_first():
    tokens, prefix = torch.ones(2, 5, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    tree = ops.empty_tree(2, 4)
    for field, bad in (("position", torch.zeros(2, 6, dtype=torch.long)), ("depth", torch.zeros(2, 5, dtype=torch.long)),
                       ("ancestor_mask", torch.zeros(2, 5, 2, dtype=torch.long))):
        out = tree._replace(**{field: bad})
        _refused(f"chain_tree: out must be an empty_tree of 5 nodes .* its {field} must be", lambda: ops.chain_tree(
            tokens, prefix, out=out), *out)


def test_an_empty_batch_runs():
    """Batch 0 runs without out too (empty_tree and empty_walk take it), as it does with out."""
    tree = ops.build_tree(torch.zeros(0, 3, 2), torch.zeros(0, 3, 2, dtype=torch.long),
                          torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 4)
    assert tree.token.shape == (0, 5)
    walk = ops.walk_greedy(tree, torch.zeros(0, 5, dtype=torch.long), 3)
    assert walk.accepted.shape == (0, 3)


# ---- walks and layer wrappers ------------------------------------------------------------------


def test_a_meta_tensor_among_real_ones_is_refused():
    """A call mixing meta tensors with real ones dispatches to the fake kernel, which checked nothing: the walk's
    outputs were left as they were, without an error."""
    tree = ops.chain_tree(torch.tensor([[1, 2, 3]]), torch.tensor([0]))
    out = ops.empty_walk(1, 3)
    _refused("walk_greedy: every tensor argument must be on one device, got cpu, meta", lambda: ops.walk_greedy(
        tree, torch.tensor([[2, 3, 9]], device="meta"), 3, out=out))
    ops.walk_greedy(tree._replace(**{k: v.to("meta") for k, v in tree._asdict().items()}),
                    torch.zeros(1, 3, dtype=torch.long, device="meta"), 3,
                    out=ops.Walk(*(t.to("meta") for t in out)))  # all meta: traced, nothing to compute


def test_walk_outputs_must_not_alias_the_tree():
    """A walk writes its path while it still follows the links: an output aliasing them would corrupt the tree."""
    tree = ops.chain_tree(torch.tensor([[1, 2, 3]]), torch.tensor([0]))
    target = torch.tensor([[2, 3, 9]])
    out = ops.empty_walk(1, 3)
    _refused("walk_greedy: accepted must not share memory with first_child", lambda: ops.walk_greedy(
        tree, target, 3, out=out._replace(accepted=tree.first_child)), *tree)
    _refused("walk_greedy: next_token must not share memory with target_token", lambda: ops.walk_greedy(
        tree, target, 3, out=out._replace(next_token=target[:, 0])), target)


def test_walk_sample_refuses_temperatures_zero_in_float32_and_scalar_uniforms():
    tree = ops.chain_tree(torch.tensor([[1, 2]]), torch.tensor([0]))
    logits = torch.tensor([[[3.0, 2.0, 1.0], [1.0, 2.0, 3.0]]])
    for t in (1e-300, 1e-46, 1e-39):
        with pytest.raises(ValueError, match="walk_sample: temperature must be at least float32's smallest normal"):
            ops.walk_sample(tree, logits, torch.full((1, 2), 0.5), temperature=t)
    with pytest.raises(ValueError, match=r"walk_sample: uniform must have shape \[B, D\]"):
        ops.walk_sample(tree, logits, torch.tensor(0.5), temperature=1.0)


@pytest.mark.parametrize("make", [
    lambda: ops.rms_norm(torch.tensor(1.0), torch.ones(1), 1e-6),
    lambda: ops.rms_norm(torch.randn(3, 0), torch.ones(0), 1e-6),
    lambda: ops.add_rms_norm(torch.randn(2, 3, 0), torch.randn(2, 3, 0), torch.ones(0), 1e-6),
    lambda: ops.silu_mul(torch.randn(2, 3, 0), torch.randn(2, 3, 0)),
    lambda: ops.sigmoid_mul(torch.tensor(1.0), torch.tensor(1.0)),
    lambda: ops.linear(torch.tensor(1.0), torch.randn(2, 1)),
    lambda: ops.gdn_gates(torch.randn(3, 4), torch.randn(0, 4), torch.randn(0, 4), torch.ones(0), torch.ones(0)),
    lambda: ops.sigmoid_mul(torch.randn(3, 2, 8), torch.randn(3, 2, 8), out=torch.empty(2, 3, 8).transpose(0, 1)),
    lambda: ops.linear(torch.randn(3, 2, 8), torch.randn(4, 8), out=torch.empty(2, 3, 4).transpose(0, 1)),
    lambda: ops.row_argmax(torch.randn(3, 5), out=torch.zeros(3, 2, dtype=torch.int32)[:, 0]),
])
def test_layer_wrappers_name_the_argument(make):
    """Scalars, empty feature dims, outputs no rows view reaches and an int32 argmax: ValueErrors naming the op."""
    with pytest.raises(ValueError, match=r"^(rms_norm|add_rms_norm|silu_mul|sigmoid_mul|linear|gdn_gates|row_argmax): "):
        make()
