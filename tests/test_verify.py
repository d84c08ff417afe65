"""The verify ops (tree_conv1d, tree_gated_delta_rule) on the CPU.

Against the reference on random trees; on chains against Hugging Face's own Qwen3.5 torch kernels (outputs,
and the committed state of every prefix); the commit of a random root-to-leaf path against the sequential
recurrence along it; bad input; opcheck.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import assert_close, poison, random_parents

from ddtree_ext import ops, reference
from ddtree_ext.ops import GDNTreeOutput
from ddtree_ext._loader import load_ops

hf_qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TREE_SIZES = (1, 2, 7, 65, 257)
TREE_SHAPES = ("chain", "star", "random")
MAX_DEPTH = 16


def _hf_torch_kernel(*names):
    """The pure-torch function behind a Hugging Face kernel name (the first of ``names`` that exists):
    the module-level names may be wrapped to dispatch to fla or causal-conv1d, which need a GPU."""
    for name in names:
        fn = getattr(hf_qwen3_5, name, None)
        if fn is not None:
            return inspect.unwrap(fn)
    raise AttributeError(f"transformers' qwen3_5 module has none of {names}")


HF_RECURRENT = _hf_torch_kernel("torch_recurrent_gated_delta_rule")
HF_CHUNK = _hf_torch_kernel("torch_chunk_gated_delta_rule")
# Renamed from torch_causal_conv1d_update in later transformers releases.
HF_CONV_UPDATE = _hf_torch_kernel("torch_causal_conv1d_update", "causal_conv1d_update")


def random_tree_batch(bsz: int, n: int, gen: torch.Generator, first_shape: int = 0) -> torch.Tensor:
    """parent [bsz, n] int32: a different tree per row, shapes cycling from TREE_SHAPES[first_shape],
    depth caps drawn from 1..MAX_DEPTH."""
    rows = []
    for r in range(bsz):
        shape = TREE_SHAPES[(first_shape + r) % len(TREE_SHAPES)]
        max_depth = int(torch.randint(1, MAX_DEPTH + 1, (1,), generator=gen))
        rows.append(random_parents(n, gen, shape, max_depth))
    return torch.stack(rows)


def chain_parents(bsz: int, n: int) -> torch.Tensor:
    """parent [bsz, n] int32 of a plain chain 0 <- 1 <- ... <- n-1 in every row."""
    return (torch.arange(n, dtype=torch.int32) - 1).expand(bsz, n).contiguous()


def random_leaf_path(parent: torch.Tensor, b: int, gen: torch.Generator) -> list:
    """Node indices root..leaf of a random leaf of row b."""
    n = parent.shape[1]
    has_child = torch.zeros(n, dtype=torch.bool)
    has_child[parent[b, 1:].long()] = True
    leaves = torch.nonzero(~has_child).flatten()
    leaf = int(leaves[torch.randint(0, len(leaves), (1,), generator=gen)])
    return reference.path_to(parent, b, leaf)


# ---- inputs ----------------------------------------------------------------------------------


def conv_inputs(bsz, n, channels, width, state_cols, dtype, gen, *, bias=True):
    """(x, weight, bias, conv_state); x is a column slice of a wider buffer, like a view into a projection."""
    x = torch.randn(bsz, n, channels + 5, generator=gen).to(dtype)[..., 2 : 2 + channels]
    weight = (torch.randn(channels, width, generator=gen) / width**0.5).to(dtype)
    b = torch.randn(channels, generator=gen).to(dtype) if bias else None
    conv_state = torch.randn(bsz, channels, state_cols, generator=gen).to(dtype)
    return x, weight, b, conv_state


def empty_conv_out(x):
    """A poisoned contiguous output buffer for tree_conv1d."""
    return poison(torch.empty(x.shape, dtype=x.dtype))


def gdn_inputs(bsz, n, heads, vheads, kdim, vdim, dtype, gen, *, strided=True):
    """(q, k, v, g, beta, state) with realistic ranges: q and k of norm about 1 (so the recurrence stays
    bounded without the l2 norm too), log decays in (-0.5, 0], beta in (0, 1). With ``strided``, q, k and v
    are views of one fused projection, as in the Hugging Face GDN layer."""
    widths = [heads * kdim, heads * kdim, vheads * vdim]
    if strided:
        mixed = torch.randn(bsz, n, sum(widths), generator=gen)
        mixed[..., : 2 * heads * kdim] /= kdim**0.5
        q, k, v = torch.split(mixed.to(dtype), widths, dim=-1)
    else:
        q, k, v = (torch.randn(bsz, n, w, generator=gen) for w in widths)
        q, k, v = (q / kdim**0.5).to(dtype), (k / kdim**0.5).to(dtype), v.to(dtype)
    q, k = q.unflatten(-1, (heads, kdim)), k.unflatten(-1, (heads, kdim))
    v = v.unflatten(-1, (vheads, vdim))
    g = -0.5 * torch.rand(bsz, n, vheads, generator=gen)
    beta = torch.rand(bsz, n, vheads, generator=gen)
    state = torch.randn(bsz, vheads, kdim, vdim, generator=gen)
    return q, k, v, g, beta, state


def empty_gdn_out(q, v):
    """Poisoned output buffers for tree_gated_delta_rule."""
    bsz, n, heads, kdim = q.shape
    vheads, vdim = v.shape[2:]
    f32 = dict(dtype=torch.float32)
    return ops.GDNTreeOutput(
        poison(torch.empty(bsz, n, vheads, vdim, dtype=v.dtype)),
        poison(torch.empty(bsz, n, vheads, vdim, **f32)),
        poison(torch.empty(bsz, n, heads, kdim, **f32)),
        poison(torch.empty(bsz, n, vheads, **f32)),
    )


def assert_gdn_matches(got: ops.GDNTreeOutput, want: ops.GDNTreeOutput, dtype: torch.dtype) -> None:
    """Only ``out`` is rounded to the input dtype; the stash is float32 computed from the same upcast inputs."""
    assert_close(got.out, want.out, dtype, "out")
    for name in ("stash_u", "stash_k", "stash_cumg"):
        assert_close(getattr(got, name), getattr(want, name), torch.float32, name)


# ---- tree_conv1d vs the reference ------------------------------------------------------------


@pytest.mark.parametrize("silu", [True, False], ids=["silu", "linear"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tree_conv1d_matches_reference(dtype, width, bias, silu, gen):
    for case, n in enumerate(TREE_SIZES):
        state_cols = (width - 1, width, 6)[case % 3]
        bsz = int(torch.randint(1, 5, (1,), generator=gen))
        parent = random_tree_batch(bsz, n, gen, first_shape=case)
        x, weight, b, conv_state = conv_inputs(bsz, n, 19, width, state_cols, dtype, gen, bias=bias)
        out = empty_conv_out(x)
        ops.tree_conv1d(x, weight, b, conv_state, parent, silu=silu, out=out)
        want = reference.tree_conv1d(x, weight, b, conv_state, parent, silu=silu)
        assert_close(out, want, dtype, f"out (n={n}, S={state_cols}, B={bsz})")


def test_tree_conv1d_width_one_ignores_the_state(gen):
    """W = 1 is a per-node scale: no ancestor and no state column enters, even with an empty state."""
    parent = random_tree_batch(2, 7, gen)
    x, weight, b, conv_state = conv_inputs(2, 7, 8, 1, 0, torch.float32, gen)
    out = ops.tree_conv1d(x, weight, b, conv_state, parent, silu=False, out=empty_conv_out(x))
    assert_close(out, x * weight[:, 0] + b, torch.float32, "out")


# ---- tree_gated_delta_rule vs the reference --------------------------------------------------


@pytest.mark.parametrize("heads,vheads", [(2, 2), (2, 6)], ids=["gva1", "gva3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tree_gated_delta_rule_matches_reference(dtype, heads, vheads, gen):
    kdim, vdim = 16, 8
    for case, n in enumerate(TREE_SIZES):
        bsz = 1 if n > 65 else int(torch.randint(1, 5, (1,), generator=gen))
        use_qk_l2norm = case % 2 == 0
        scale = None if case % 3 else 0.3
        parent = random_tree_batch(bsz, n, gen, first_shape=case)
        q, k, v, g, beta, state = gdn_inputs(bsz, n, heads, vheads, kdim, vdim, dtype, gen)
        state_before = state.clone()
        got = ops.tree_gated_delta_rule(
            q, k, v, g, beta, state, parent, scale=scale, use_qk_l2norm=use_qk_l2norm, out=empty_gdn_out(q, v)
        )
        want = reference.tree_gated_delta_rule(
            q, k, v, g, beta, state, parent, scale=scale, use_qk_l2norm=use_qk_l2norm
        )
        assert_gdn_matches(got, want, dtype)
        assert torch.equal(state, state_before), "state is read only"


def test_tree_gated_delta_rule_decay_underflow_stays_finite(gen):
    """Strong decays along a deep path underflow e^{G_i}; the pairwise decays e^{G_i - G_j} stay exact."""
    n = 17
    parent = chain_parents(1, n)
    q, k, v, g, beta, state = gdn_inputs(1, n, 1, 1, 8, 8, torch.float32, gen)
    g = torch.full_like(g, -12.0)  # G reaches -204: e^G is 0 in float32
    got = ops.tree_gated_delta_rule(q, k, v, g, beta, state, parent, out=empty_gdn_out(q, v))
    want = reference.tree_gated_delta_rule(q, k, v, g, beta, state, parent)
    assert_gdn_matches(got, want, torch.float32)


# ---- chains against Hugging Face's own kernels -----------------------------------------------


@pytest.mark.parametrize("silu", [True, False], ids=["silu", "linear"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("state_cols", [3, 4, 6])
@pytest.mark.parametrize("n", [1, 7, 65])
def test_chain_conv1d_matches_hf(n, state_cols, bias, silu, gen):
    bsz, channels, width = 2, 24, 4
    x, weight, b, conv_state = conv_inputs(bsz, n, channels, width, state_cols, torch.float32, gen, bias=bias)
    out = ops.tree_conv1d(x, weight, b, conv_state, chain_parents(bsz, n), silu=silu, out=empty_conv_out(x))
    hf_state = conv_state.clone()  # HF's update advances the state in place
    want = HF_CONV_UPDATE(x.transpose(1, 2), hf_state, weight, b, "silu" if silu else None).transpose(1, 2)
    assert_close(out, want, torch.float32, "out")


@pytest.mark.parametrize("use_qk_l2norm", [True, False], ids=["l2norm", "raw"])
@pytest.mark.parametrize("n", [1, 7, 65])
@pytest.mark.parametrize("hf_kernel", [HF_RECURRENT, HF_CHUNK], ids=["recurrent", "chunk"])
def test_chain_gated_delta_rule_and_commit_match_hf(hf_kernel, n, use_qk_l2norm, gen):
    """A chain is a sequence: outputs equal HF's, and committing a prefix of it from the stash (the whole
    chain, one node, about half; one length per row) gives HF's final state after that prefix."""
    heads, vheads, kdim, vdim = 2, 6, 16, 16
    lengths = (n, 1, (n + 1) // 2)
    bsz = len(lengths)
    q, k, v, g, beta, state = gdn_inputs(bsz, n, heads, vheads, kdim, vdim, torch.float32, gen, strided=False)
    tree = ops.tree_gated_delta_rule(
        q, k, v, g, beta, state, chain_parents(bsz, n), use_qk_l2norm=use_qk_l2norm, out=empty_gdn_out(q, v)
    )

    # transformers 5.17's kernels expect q and k already repeated to the value heads (its GDN layer
    # repeats them); 5.24's accept either. Repeating here works with both.
    q_rep, k_rep = (x.repeat_interleave(vheads // heads, dim=2) for x in (q, k))

    def hf(rows, length):
        return hf_kernel(
            q_rep[rows, :length], k_rep[rows, :length], v[rows, :length], g[rows, :length], beta[rows, :length],
            initial_state=state[rows], output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
        )

    hf_out, hf_final = hf(slice(None), n)
    assert_close(tree.out, hf_out, torch.float32, "out")

    accept_len = torch.tensor(lengths, dtype=torch.int32)
    accepted = torch.arange(n, dtype=torch.int32).expand(bsz, n).clone()
    accepted[torch.arange(n) >= accept_len[:, None]] = -1
    (committed,) = reference.commit_gdn_state(
        [state], [tree.stash_u], [tree.stash_k], [tree.stash_cumg], accepted, accept_len
    )
    for b, length in enumerate(lengths):
        want = hf_final[b] if length == n else hf(slice(b, b + 1), length)[1][0]
        assert_close(committed[b], want, torch.float32, f"state after {length} of {n} nodes")


# ---- commit of a random path vs the sequential recurrence ------------------------------------


@pytest.mark.parametrize("heads,vheads", [(2, 2), (1, 3)], ids=["gva1", "gva3"])
@pytest.mark.parametrize("n", TREE_SIZES)
def test_committed_path_matches_sequential_recurrence(n, heads, vheads, gen):
    """For a random root-to-leaf path of each row: the outputs of its nodes and the state committed from the
    stash equal HF's recurrence run along that path alone."""
    bsz, kdim, vdim = 4, 16, 16
    for first_shape in range(len(TREE_SHAPES)):
        parent = random_tree_batch(bsz, n, gen, first_shape)
        q, k, v, g, beta, state = gdn_inputs(bsz, n, heads, vheads, kdim, vdim, torch.float32, gen)
        tree = ops.tree_gated_delta_rule(q, k, v, g, beta, state, parent, out=empty_gdn_out(q, v))
        paths = [random_leaf_path(parent, b, gen) for b in range(bsz)]
        accepted = torch.full((bsz, MAX_DEPTH + 1), -1, dtype=torch.int32)
        for b, path in enumerate(paths):
            accepted[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        accept_len = torch.tensor([len(p) for p in paths], dtype=torch.int32)
        (committed,) = reference.commit_gdn_state(
            [state], [tree.stash_u], [tree.stash_k], [tree.stash_cumg], accepted, accept_len
        )
        for b, path in enumerate(paths):
            seq_out, seq_state = HF_RECURRENT(
                *(t[b : b + 1, path] for t in (q, k, v, g, beta)),
                initial_state=state[b : b + 1], output_final_state=True, use_qk_l2norm_in_kernel=True,
            )
            assert_close(tree.out[b, path], seq_out[0], torch.float32, f"out on the path (row {b})")
            assert_close(committed[b], seq_state[0], torch.float32, f"committed state (row {b})")


# ---- bad input -------------------------------------------------------------------------------


def _conv_case(gen):
    bsz, n, channels, width = 2, 5, 8, 4
    x, weight, b, conv_state = conv_inputs(bsz, n, channels, width, width - 1, torch.float32, gen)
    return dict(x=x, weight=weight, bias=b, conv_state=conv_state, parent=random_tree_batch(bsz, n, gen),
                out=empty_conv_out(x))


def _set_parent(index, value):
    def mutate(a):
        p = a["parent"].clone()
        p[index] = value
        a["parent"] = p

    return mutate


def _replace(name, make):
    def mutate(a):
        a[name] = make(a[name])

    return mutate


BAD_CONV = {
    "x_dims": (_replace("x", lambda t: t[0]), "x must have 3 dims"),
    "x_dtype": (_replace("x", lambda t: t.to(torch.float64)), "x must be float32, float16 or bfloat16"),
    "x_last_dim_strided": (_replace("x", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)),
                           "x must be contiguous in its last dim"),
    "weight_channels": (_replace("weight", lambda t: t[1:]), "weight must have shape"),
    "weight_width": (_replace("weight", lambda t: torch.cat([t, t[:, :1]], 1)), "weight's width W must be in"),
    "weight_dtype": (_replace("weight", lambda t: t.half()), "weight must have dtype Float"),
    "weight_strided": (_replace("weight", lambda t: t.T.contiguous().T), "weight must be contiguous"),
    "bias_shape": (_replace("bias", lambda t: t[1:]), "bias must have shape"),
    "bias_dtype": (_replace("bias", lambda t: t.bfloat16()), "bias must have dtype Float"),
    "state_rows": (_replace("conv_state", lambda t: t[:1]), r"conv_state must have shape \[B, C, S\]"),
    "state_too_short": (_replace("conv_state", lambda t: t[..., 1:]), "conv_state must hold at least W - 1 = 3"),
    "state_dtype": (_replace("conv_state", lambda t: t.half()), "conv_state must have dtype Float"),
    "parent_dtype": (_replace("parent", lambda t: t.long()), "parent must have dtype Int"),
    "parent_shape": (_replace("parent", lambda t: t[:, :-1].contiguous()), "parent must have shape"),
    "parent_strided": (_replace("parent", lambda t: torch.stack([t, t], -1)[..., 0]), "parent must be contiguous"),
    "parent_root": (_set_parent((1, 0), 0), r"parent\[1, 0\] must be -1"),
    "parent_forward": (_set_parent((0, 3), 3), r"parent\[0, 3\] must be in \[0, 3\)"),
    "parent_negative": (_set_parent((1, 2), -1), r"parent\[1, 2\] must be in \[0, 2\)"),
    "out_shape": (_replace("out", lambda t: poison(torch.empty(t.shape[0], t.shape[1] + 1, t.shape[2]))),
                  "out must have shape"),
    "out_dtype": (_replace("out", lambda t: poison(t.half())), "out must have dtype Float"),
    "out_strided": (_replace("out", lambda t: poison(t.transpose(1, 2).contiguous().transpose(1, 2))),
                    "out must be contiguous"),
}


@pytest.mark.parametrize("mistake", list(BAD_CONV))
def test_tree_conv1d_rejects_bad_input(mistake, gen):
    mutate, message = BAD_CONV[mistake]
    args = _conv_case(gen)
    mutate(args)
    with pytest.raises(ValueError, match=f"^tree_conv1d: ({message})"):
        load_ops().tree_conv1d(args["x"], args["weight"], args["bias"], args["conv_state"], args["parent"], True,
                               args["out"])
    assert torch.isnan(args["out"]).all(), "out was written before the error"


def _gdn_case(gen):
    bsz, n, heads, vheads = 2, 5, 2, 6
    q, k, v, g, beta, state = gdn_inputs(bsz, n, heads, vheads, 8, 4, torch.float32, gen)
    out = empty_gdn_out(q, v)
    return dict(q=q, k=k, v=v, g=g, beta=beta, state=state, parent=random_tree_batch(bsz, n, gen), **out._asdict())


BAD_GDN = {
    "q_dims": (_replace("q", lambda t: t[0]), "q must have 4 dims"),
    "q_dtype": (_replace("q", lambda t: t.to(torch.float64)), "q must be float32, float16 or bfloat16"),
    "q_last_dim_strided": (_replace("q", lambda t: t.transpose(2, 3).contiguous().transpose(2, 3)),
                           "q must be contiguous in its last dim"),
    "k_shape": (_replace("k", lambda t: t[:, :, :1]), "k must have shape"),
    "k_dtype": (_replace("k", lambda t: t.bfloat16()), "k must have dtype Float"),
    "v_rows": (_replace("v", lambda t: t[:, 1:]), r"v must have shape \[B, N, HV, V\]"),
    "v_heads_not_multiple": (_replace("v", lambda t: t[:, :, :5]), "v's value heads HV = 5 must be a multiple"),
    "v_dtype": (_replace("v", lambda t: t.half()), "v must have dtype Float"),
    "g_dtype": (_replace("g", lambda t: t.bfloat16()), "g must have dtype Float"),
    "g_shape": (_replace("g", lambda t: t[..., :2].contiguous()), "g must have shape"),
    "beta_strided": (_replace("beta", lambda t: torch.stack([t, t], -1)[..., 0]), "beta must be contiguous"),
    "state_dtype": (_replace("state", lambda t: t.bfloat16()), "state must have dtype Float"),
    "state_shape": (_replace("state", lambda t: t[..., :2].contiguous()), "state must have shape"),
    "parent_dtype": (_replace("parent", lambda t: t.long()), "parent must have dtype Int"),
    "parent_root": (_set_parent((0, 0), 2), r"parent\[0, 0\] must be -1"),
    "parent_forward": (_set_parent((1, 4), 4), r"parent\[1, 4\] must be in \[0, 4\)"),
    "out_dtype": (_replace("out", lambda t: poison(t.bfloat16())), "out must have dtype Float"),
    "stash_u_dtype": (_replace("stash_u", lambda t: poison(t.half())), "stash_u must have dtype Float"),
    "stash_k_shape": (_replace("stash_k", lambda t: poison(torch.empty(2, 5, 6, 8))), "stash_k must have shape"),
    "stash_cumg_strided": (_replace("stash_cumg", lambda t: poison(t.transpose(0, 1).contiguous().transpose(0, 1))),
                           "stash_cumg must be contiguous"),
}
GDN_OUTPUTS = ops.GDNTreeOutput._fields


def test_tree_conv1d_refuses_out_over_its_inputs():
    """A node's window reads its ancestors' x rows: writing out over x (or the conv state) would feed later nodes
    convolved values. Refused before anything is written."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 6, generator=gen)
    weight, state = torch.randn(6, 4, generator=gen), torch.randn(1, 6, 4, generator=gen)
    parent = torch.tensor([[-1, 0, 1, 2]], dtype=torch.int32)
    before = x.clone()
    with pytest.raises(ValueError, match="tree_conv1d: out must not overlap x"):
        ops.tree_conv1d(x, weight, None, state, parent, out=x)
    with pytest.raises(ValueError, match="tree_conv1d: out must not overlap conv_state"):
        ops.tree_conv1d(x, weight, None, state, parent, out=state.view(1, 4, 6))
    assert torch.equal(x, before)


@pytest.mark.parametrize("call, message", [
    (lambda: ops.tree_gated_delta_rule(torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2),
                                       torch.zeros(1, 3, 2), torch.ones(1, 3, 2), torch.zeros(1, 2, 4, 4),
                                       torch.tensor([[-1, 0, 1]], dtype=torch.int32)),
     "tree_gated_delta_rule: v must have shape \\[B, N, HV, V\\], got shape \\[1, 3, 2\\]"),
    (lambda: ops.gdn_conv_delta_rule(torch.randn(1, 3, 24), torch.randn(24, 4), None, torch.zeros(1, 24, 3),
                                     torch.zeros(1, 3, 2), torch.ones(1, 3, 2), torch.zeros(1, 2, 4, 4),
                                     torch.tensor([[-1, 0, 1]], dtype=torch.int32), num_heads=-1, head_k_dim=4,
                                     head_v_dim=4), "gdn_conv_delta_rule: num_heads must be an int >= 1, got -1"),
    (lambda: ops.gdn_conv_delta_rule(torch.randn(1, 3, 24), torch.randn(24, 4), None, torch.zeros(1, 24, 3),
                                     torch.zeros(1, 3, 2), torch.ones(1, 3, 2), torch.zeros(1, 2, 4, 4),
                                     torch.tensor([[-1, 0, 1]], dtype=torch.int32), num_heads=2, head_k_dim=0,
                                     head_v_dim=4), "gdn_conv_delta_rule: head_k_dim must be an int >= 1, got 0"),
    (lambda: ops.gather_rows(torch.randn(1, 3), torch.zeros(1, 2, dtype=torch.int32),
                             torch.ones(1, dtype=torch.int32)), "gather_rows: src must have shape \\[B, N, F\\]"),
    (lambda: ops.tree_attention_mask(torch.zeros(3, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 8),
     "tree_attention_mask: ancestor_mask must have shape \\[B, N, W\\]"),
], ids=["delta-rule-v-3d", "conv-delta-num-heads", "conv-delta-head-k-dim", "gather-src-2d", "mask-ancestors-1d"])
def test_wrappers_check_the_sizes_they_allocate_with(call, message):
    """The wrappers read sizes from their inputs to allocate the outputs: a wrong rank or count is a ValueError naming
    the argument, not a TypeError, IndexError or an allocator error."""
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("mistake", list(BAD_GDN))
def test_tree_gated_delta_rule_rejects_bad_input(mistake, gen):
    mutate, message = BAD_GDN[mistake]
    args = _gdn_case(gen)
    mutate(args)
    inputs = [args[name] for name in ("q", "k", "v", "g", "beta", "state", "parent")]
    with pytest.raises(ValueError, match=f"^tree_gated_delta_rule: ({message})"):
        load_ops().tree_gated_delta_rule(*inputs, 0.25, True, *(args[name] for name in GDN_OUTPUTS))
    for name in GDN_OUTPUTS:
        assert torch.isnan(args[name]).all(), f"{name} was written before the error"


# ---- gdn_conv_delta_rule: the conv and the delta rule as one op --------------------------------


def gdn_conv_case(bsz, n, heads, vheads, kdim, vdim, width, dtype, gen, *, bias=True, parent=None):
    """The one op's inputs: pre-conv channels [q | k | v] as a column slice of a wider projection output."""
    channels = 2 * heads * kdim + vheads * vdim
    x, weight, b, conv_state = conv_inputs(bsz, n, channels, width, width + 1, dtype, gen, bias=bias)
    parent = random_tree_batch(bsz, n, gen) if parent is None else parent
    g = -0.5 * torch.rand(bsz, n, vheads, generator=gen)
    beta = torch.rand(bsz, n, vheads, generator=gen)
    state = torch.randn(bsz, vheads, kdim, vdim, generator=gen)
    return x, weight, b, conv_state, g, beta, state, parent


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 9])
def test_gdn_conv_delta_rule_is_the_conv_then_the_rule(dtype, n, gen):
    """The same bits as tree_conv1d (SiLU) split into q, k, v and tree_gated_delta_rule, and the reference's values."""
    heads, vheads, kdim, vdim = 2, 6, 16, 8
    x, weight, b, conv_state, g, beta, state, parent = gdn_conv_case(2, n, heads, vheads, kdim, vdim, 4, dtype, gen)
    q0 = torch.empty(2, n, heads, kdim, dtype=dtype)
    v0 = torch.empty(2, n, vheads, vdim, dtype=dtype)
    got = ops.gdn_conv_delta_rule(x, weight, b, conv_state, g, beta, state, parent, num_heads=heads, head_k_dim=kdim,
                                  head_v_dim=vdim, out=empty_gdn_out(q0, v0))
    y = ops.tree_conv1d(x, weight, b, conv_state, parent, silu=True)
    q, k, v = torch.split(y, [heads * kdim, heads * kdim, vheads * vdim], dim=-1)
    apart = ops.tree_gated_delta_rule(q.unflatten(-1, (heads, kdim)), k.unflatten(-1, (heads, kdim)),
                                      v.unflatten(-1, (vheads, vdim)), g, beta, state, parent)
    for name, a, e in zip(GDN_OUTPUTS, got, apart):
        assert torch.equal(a, e), name
    want = reference.gdn_conv_delta_rule(x, weight, b, conv_state, g, beta, state, parent, num_heads=heads,
                                         head_k_dim=kdim, head_v_dim=vdim)
    assert_gdn_matches(got, want, dtype)


BAD_GDN_CONV = {
    "channels": (dict(num_heads=3), r"x's channels C = 112 must be 2 \* num_heads \* head_k_dim \+ HV \* V"),
    "heads": (dict(num_heads=0), "num_heads must be >= 1, got 0"),
    "value_heads": (dict(num_heads=4, head_k_dim=8), "out's value heads HV = 6 must be a multiple of num_heads = 4"),
    "x_dtype": (dict(x=lambda t: t.double()), "x must be float32, float16 or bfloat16, got Double"),
    "bias": (dict(b=lambda t: t[:-1]), "bias must have shape"),
    "parent": (dict(parent=lambda t: t.long()), "parent must have dtype Int"),
    "head_k_dim": (dict(head_k_dim=0), "head_k_dim must be >= 1, got 0"),
    "weight": (dict(weight=lambda w: w[:-1]), r"weight must have shape \[C, W\] with C = 112"),
    "conv_state": (dict(conv_state=lambda s: s[:, :, :2]), "conv_state must hold at least W - 1 = 3 columns"),
    "g": (dict(g=lambda t: t[..., :-1]), "g must have shape"),
    "state": (dict(state=lambda t: t.double()), "state must have dtype Float"),
}


@pytest.mark.parametrize("mistake", list(BAD_GDN_CONV))
def test_gdn_conv_delta_rule_rejects_bad_input(mistake, gen):
    """Errors name the op and the argument, before any output is written."""
    change, message = BAD_GDN_CONV[mistake]
    x, weight, b, conv_state, g, beta, state, parent = gdn_conv_case(2, 5, 2, 6, 16, 8, 4, torch.float32, gen)
    args = dict(x=x, weight=weight, b=b, conv_state=conv_state, g=g, beta=beta, state=state, parent=parent)
    sizes = dict(num_heads=2, head_k_dim=16)
    for name, value in change.items():
        if name in sizes:
            sizes[name] = value
        else:
            args[name] = value(args[name])
    out = empty_gdn_out(torch.empty(2, 5, 2, 16), torch.empty(2, 5, 6, 8))
    with pytest.raises(ValueError, match=f"^gdn_conv_delta_rule: {message}"):
        load_ops().gdn_conv_delta_rule(*args.values(), sizes["num_heads"], sizes["head_k_dim"], 0.25, True, *out)
    for name, t in zip(GDN_OUTPUTS, out):
        assert torch.isnan(t).all(), f"{name} was written before the error"


def test_gdn_conv_delta_rule_opcheck(gen):
    x, weight, b, conv_state, g, beta, state, parent = gdn_conv_case(2, 3, 2, 6, 8, 4, 4, torch.bfloat16, gen)
    out = empty_gdn_out(torch.empty(2, 3, 2, 8), torch.empty(2, 3, 6, 4, dtype=torch.bfloat16))
    torch.library.opcheck(load_ops().gdn_conv_delta_rule.default,
                          (x, weight, b, conv_state, g, beta, state, parent, 2, 8, 0.35, True, *out))


# ---- registration ----------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_tree_conv1d_opcheck(bias, gen):
    parent = random_tree_batch(2, 7, gen)
    x, weight, b, conv_state = conv_inputs(2, 7, 8, 4, 4, torch.float32, gen, bias=bias)
    torch.library.opcheck(load_ops().tree_conv1d.default, (x, weight, b, conv_state, parent, True, empty_conv_out(x)))


def test_tree_gated_delta_rule_opcheck(gen):
    parent = random_tree_batch(2, 7, gen)
    q, k, v, g, beta, state = gdn_inputs(2, 7, 2, 6, 8, 4, torch.bfloat16, gen)
    args = (q, k, v, g, beta, state, parent, 0.35, True, *empty_gdn_out(q, v))
    torch.library.opcheck(load_ops().tree_gated_delta_rule.default, args)


def test_wrappers_allocate_outputs(gen):
    """Without ``out=`` the wrappers allocate outputs of the documented shapes and dtypes."""
    parent = random_tree_batch(3, 7, gen)
    x, weight, b, conv_state = conv_inputs(3, 7, 8, 4, 3, torch.bfloat16, gen)
    out = ops.tree_conv1d(x, weight, b, conv_state, parent)
    assert out.is_contiguous() and out.dtype == x.dtype
    assert_close(out, reference.tree_conv1d(x, weight, b, conv_state, parent), torch.bfloat16, "conv out")

    q, k, v, g, beta, state = gdn_inputs(3, 7, 2, 6, 8, 4, torch.bfloat16, gen)
    got = ops.tree_gated_delta_rule(q, k, v, g, beta, state, parent)
    for name, t in zip(GDN_OUTPUTS, got):
        assert t.is_contiguous(), name
    assert_gdn_matches(got, reference.tree_gated_delta_rule(q, k, v, g, beta, state, parent), torch.bfloat16)


def test_no_key_features_without_a_scale_match_the_reference():
    """K = 0 with no scale given: the op and its reference agree (the reference divided by zero to scale)."""
    parent = torch.tensor([[-1, 0, 1]], dtype=torch.int32)
    args = (torch.randn(1, 3, 1, 0), torch.randn(1, 3, 1, 0), torch.randn(1, 3, 2, 4), -torch.rand(1, 3, 2),
            torch.rand(1, 3, 2), torch.randn(1, 2, 0, 4), parent)
    got, want = ops.tree_gated_delta_rule(*args), reference.tree_gated_delta_rule(*args)
    for name in GDNTreeOutput._fields:
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape, name
        if a.numel():
            assert_close(a, b, torch.float32, name=name)
