"""The layer-body ops (rms_norm, silu_mul, rope, qk_norm_rope, sigmoid_mul, gdn_gates, gqa_attention) on the CPU and the fused forwards that use them.

Each op against the Hugging Face module it replaces (the modules' own forwards, not a copy of their math)
and against the reference, over dtypes, odd sizes and strided inputs; bad input; opcheck. Then
``LayerFusion``: which modules it swaps, that it restores them, that a fused model gives the stock
model's logits, and the cases where the stock forward must stay.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from conftest import assert_close, poison

from ddtree_ext import ops, reference
from ddtree_ext._loader import load_ops
from ddtree_ext.fused import LayerFusion
from ddtree_ext.tiny import make_tiny_draft, make_tiny_target

qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (rows, features): one row (a decode step), head sizes, odd sizes, a 27B hidden state.
SHAPES = ((1, 256), (7, 128), (5, 7), (3, 129), (2, 5120))


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def _norm_module(kind: str, dim: int, dtype, gen):
    """A HF norm module with random weights (zero-centred weights near 0, the others near 1)."""
    if kind == "zero_centered":
        norm = qwen3_5.Qwen3_5RMSNorm(dim, eps=1e-6)
        norm.weight.data = torch.randn(dim, generator=gen) * 0.3
    elif kind == "plain":
        norm = qwen3.Qwen3RMSNorm(dim, eps=1e-6)
        norm.weight.data = 1 + torch.randn(dim, generator=gen) * 0.3
    else:
        norm = qwen3_5.Qwen3_5RMSNormGated(dim, eps=1e-6)
        norm.weight.data = 1 + torch.randn(dim, generator=gen) * 0.3
    return norm.to(dtype)


def _fused_norm(kind, norm, x, gate):
    if kind == "zero_centered":
        return ops.rms_norm(x, norm.weight, norm.eps, zero_centered=True)
    return ops.rms_norm(x, norm.weight, norm.variance_epsilon, gate=gate)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", SHAPES)
@pytest.mark.parametrize("kind", ["zero_centered", "plain", "gated"])
def test_rms_norm_equals_the_hf_module(kind, rows, dim, dtype, gen):
    norm = _norm_module(kind, dim, dtype, gen)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
    gate = (torch.randn(rows, dim, generator=gen) * 2).to(dtype) if kind == "gated" else None
    with torch.no_grad():
        stock = norm(x) if gate is None else norm(x, gate)
    got = _fused_norm(kind, norm, x, gate)
    assert got.dtype == dtype and got.shape == x.shape
    # Same rounding points; only the float32 sum of squares runs in another order.
    assert_close(got, stock, dtype, f"{kind} vs HF")
    expected = reference.rms_norm(x, norm.weight, 1e-6, gate=gate, zero_centered=kind == "zero_centered")
    assert_close(got, expected, dtype, f"{kind} vs reference")
    if dtype != torch.float32:  # the rounding points match: almost every element is bitwise HF's
        assert (got != stock).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", SHAPES)
@pytest.mark.parametrize("kind", ["zero_centered", "plain"])
def test_add_rms_norm_is_the_add_then_the_norm(kind, rows, dim, dtype, gen):
    """HF's ``residual + hidden_states`` then the norm: the sum bit for bit, the norm the fused norm's bits."""
    norm = _norm_module(kind, dim, dtype, gen)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
    residual = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
    zero_centered = kind == "zero_centered"
    normed, total = ops.add_rms_norm(x, residual, norm.weight, 1e-6, zero_centered=zero_centered)
    assert torch.equal(total, residual + x)
    assert torch.equal(normed, ops.rms_norm(residual + x, norm.weight, 1e-6, zero_centered=zero_centered))
    with torch.no_grad():
        assert_close(normed, norm(residual + x), dtype, f"{kind} vs HF")
    expected_normed, expected_total = reference.add_rms_norm(x, residual, norm.weight, 1e-6, zero_centered=zero_centered)
    assert torch.equal(total, expected_total)
    assert_close(normed, expected_normed, dtype, f"{kind} vs reference")


@pytest.mark.parametrize("in_place", ["x", "residual", None])
def test_add_rms_norm_strided_rows_given_outputs_and_in_place(in_place, gen):
    dtype = torch.bfloat16
    norm = _norm_module("zero_centered", 64, dtype, gen)
    wide = torch.randn(2, 5, 128, generator=gen).to(dtype)
    x, residual = wide[..., :64], wide[..., 64:]  # rows 128 apart
    expected_normed, expected_total = ops.add_rms_norm(x.clone(), residual.clone(), norm.weight, 1e-6, zero_centered=True)
    out = poison(torch.empty(2, 5, 64, dtype=dtype))
    residual_out = {"x": x, "residual": residual, None: poison(torch.empty(2, 5, 64, dtype=dtype))}[in_place]
    normed, total = ops.add_rms_norm(x, residual, norm.weight, 1e-6, zero_centered=True, out=out,
                                     residual_out=residual_out)
    assert normed is out and total is residual_out
    assert torch.equal(normed, expected_normed) and torch.equal(total, expected_total)


@pytest.mark.parametrize("kind", ["zero_centered", "gated"])
def test_rms_norm_strided_rows_and_out(kind, gen):
    """Rows of a wider tensor (q of Qwen3.5's q_proj output is half of each head's row), a given out."""
    dtype = torch.bfloat16
    norm = _norm_module(kind, 64, dtype, gen)
    wide = torch.randn(2, 5, 4, 128, generator=gen).to(dtype)
    x, gate = wide[..., :64], wide[..., 64:]
    gate = gate if kind == "gated" else None
    out = poison(torch.empty(2, 5, 4, 64, dtype=dtype))
    got = ops.rms_norm(x, norm.weight, 1e-6, gate=gate, zero_centered=kind == "zero_centered", out=out)
    assert got is out
    expected = reference.rms_norm(x, norm.weight, 1e-6, gate=gate, zero_centered=kind == "zero_centered")
    assert_close(got, expected, dtype, kind)


@pytest.mark.parametrize("kind", ["plain", "zero_centered", "gated"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reads_heads_of_a_stacked_projection_in_place(kind, dtype, gen):
    """Heads sliced from a wider row (q or k of a stacked projection's output, ``fused.stack_projections``; a gate
    likewise): no single row stride reaches them, and the op reads them as groups of rows, giving the bits of the
    copied heads."""
    norm = _norm_module(kind, 64, dtype, gen)
    stacked = torch.randn(2, 5, 4 * 64 + 3 * 64 + 8, generator=gen).to(dtype)  # [B, N, q heads | other heads]
    x = stacked[..., : 4 * 64].view(2, 5, 4, 64)
    if kind == "gated":  # the gate strided, x contiguous
        x, gate = torch.randn(2, 5, 4, 64, generator=gen).to(dtype), stacked[..., : 4 * 64].view(2, 5, 4, 64)
    else:
        gate = None
    strided = gate if kind == "gated" else x
    assert strided.reshape(-1, 64).data_ptr() != strided.data_ptr()  # the leading dims do not merge into one
    assert ops._row_groups(strided).dim() == 3 and ops._row_groups(strided).data_ptr() == strided.data_ptr()
    got = _fused_norm(kind, norm, x, gate) if kind != "plain" else ops.rms_norm(x, norm.weight, 1e-6)
    contiguous_gate = gate.contiguous() if gate is not None else None
    expected = (_fused_norm(kind, norm, x.contiguous(), contiguous_gate) if kind != "plain"
                else ops.rms_norm(x.contiguous(), norm.weight, 1e-6))
    assert got.shape == x.shape and got.is_contiguous()
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", SHAPES)
def test_silu_mul_equals_the_hf_mlp_activation(rows, dim, dtype, gen):
    gate = (torch.randn(rows, dim, generator=gen) * 4).to(dtype)
    up = torch.randn(rows, dim, generator=gen).to(dtype)
    act = qwen3.ACT2FN["silu"]
    got = ops.silu_mul(gate, up)
    assert_close(got, act(gate) * up, dtype, "silu_mul vs HF")
    assert_close(got, reference.silu_mul(gate, up), dtype, "silu_mul vs reference")


def test_silu_mul_strided():
    gen = torch.Generator().manual_seed(1)
    both = torch.randn(3, 2, 96, generator=gen).to(torch.bfloat16)
    gate, up = both[..., :48], both[..., 48:]
    assert_close(ops.silu_mul(gate, up), reference.silu_mul(gate, up), torch.bfloat16, "strided")


def _gdn_layer(dtype, gen):
    """A Qwen3_5GatedDeltaNet of a tiny config with random weights (HF's init leaves some at zero)."""
    model = make_tiny_target("qwen3_5", seed=0, dtype=dtype)
    gdn = next(m for m in model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet")
    for p in (gdn.in_proj_a.weight, gdn.in_proj_b.weight, gdn.A_log, gdn.dt_bias):
        p.data = (torch.randn(p.shape, generator=gen) * (3 if p.dim() == 1 else 1)).to(p.dtype)
    return gdn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 65])
def test_gdn_gates_equal_the_hf_layer(dtype, rows, gen):
    """Against Qwen3_5GatedDeltaNet.forward's own lines on the layer's own projections; a spans
    softplus's linear branch (a + dt_bias > 20) too."""
    gdn = _gdn_layer(dtype, gen)
    x = (torch.randn(1, rows, gdn.hidden_size, generator=gen) * 2).to(dtype)
    with torch.no_grad():
        b, a = gdn.in_proj_b(x), gdn.in_proj_a(x)
        hf_beta = b.sigmoid().float()
        hf_g = -gdn.A_log.float().exp() * torch.nn.functional.softplus(a.float() + gdn.dt_bias)
    g, beta = ops.gdn_gates(x, gdn.in_proj_a.weight, gdn.in_proj_b.weight, gdn.A_log, gdn.dt_bias)
    assert g.dtype == beta.dtype == torch.float32 and g.shape == beta.shape == (1, rows, gdn.num_v_heads)
    # The projections sum in another order than the GEMM: in a 16-bit dtype a projection may round one ulp
    # apart, so g and beta are compared at that dtype's tolerance.
    tol_dtype = dtype if dtype != torch.float32 else torch.float32
    assert_close(beta, hf_beta, tol_dtype, "beta")
    assert_close(g, hf_g, tol_dtype, "g")
    ref_g, ref_beta = reference.gdn_gates(x, gdn.in_proj_a.weight, gdn.in_proj_b.weight, gdn.A_log, gdn.dt_bias)
    assert_close(beta, ref_beta, tol_dtype, "beta vs reference")
    assert_close(g, ref_g, tol_dtype, "g vs reference")


def test_gdn_gates_linear_branch_and_param_dtypes(gen):
    """float32 A_log / dt_bias with bf16 activations, and a + dt_bias far past softplus's threshold."""
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    wa = (torch.randn(5, 64, generator=gen) * 4).to(torch.bfloat16)
    wb = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    A_log, dt_bias = torch.randn(5, generator=gen), torch.full((5,), 25.0)
    g, beta = ops.gdn_gates(x, wa, wb, A_log, dt_bias)
    ref_g, ref_beta = reference.gdn_gates(x, wa, wb, A_log, dt_bias)
    assert_close(g, ref_g, torch.bfloat16, "g")
    assert_close(beta, ref_beta, torch.bfloat16, "beta")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "family,heads,n,dim,rot",
    [("qwen3", 4, 1, 128, 128), ("qwen3", 2, 7, 10, 10), ("qwen3_5", 4, 1, 128, 128), ("qwen3_5", 3, 65, 256, 64),
     ("qwen3_5", 2, 7, 10, 6)],
)
def test_rope_is_hf_apply_rotary_pos_emb_bit_for_bit(family, heads, n, dim, rot, dtype, gen):
    """q, k transposed from [B, N, H, D] as the attention layers make them; Qwen3.5's partial rotary."""
    q = torch.randn(2, n, heads, dim, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(2, n, 1, dim, generator=gen).to(dtype).transpose(1, 2)
    angles = torch.rand(2, n, rot // 2, generator=gen) * 100
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    module = qwen3 if family == "qwen3" else qwen3_5  # Qwen3's function has no partial rotary
    hf_q, hf_k = module.apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
    assert got_q.is_contiguous()
    assert torch.equal(got_q, hf_q) and torch.equal(got_k, hf_k)
    assert torch.equal(got_q, reference.rope(q, cos, sin))


def _rotary_tables(n, rot, dtype, gen):
    angles = torch.rand(2, n, rot // 2, generator=gen) * 100
    return torch.cat([angles.cos()] * 2, dim=-1).to(dtype), torch.cat([angles.sin()] * 2, dim=-1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "family,heads,kv_heads,n,dim,rot",
    [("qwen3", 4, 2, 1, 128, 128), ("qwen3", 2, 1, 7, 10, 10), ("qwen3_5", 4, 2, 1, 256, 64),
     ("qwen3_5", 3, 1, 65, 256, 64), ("qwen3_5", 2, 2, 7, 10, 6)],
)
def test_qk_norm_rope_is_the_norms_then_rope(family, heads, kv_heads, n, dim, rot, dtype, gen):
    """As the attention layers call it: q heads read in place from the q projection's rows (Qwen3.5: beside their
    gates), k contiguous. The bits of ops.rms_norm then ops.rope; HF's q_norm / k_norm and apply_rotary_pos_emb up
    to the norms' float32 sum order; the reference likewise."""
    kind = "plain" if family == "qwen3" else "zero_centered"
    width = 2 * dim if family == "qwen3_5" else dim
    q = (torch.randn(2, n, heads * width, generator=gen) * 3).to(dtype).view(2, n, heads, width)[..., :dim]
    k = (torch.randn(2, n, kv_heads, dim, generator=gen) * 3).to(dtype)
    q_norm, k_norm = _norm_module(kind, dim, dtype, gen), _norm_module(kind, dim, dtype, gen)
    cos, sin = _rotary_tables(n, rot, dtype, gen)
    eps, zero_centered = (q_norm.variance_epsilon, False) if family == "qwen3" else (q_norm.eps, True)
    got_q, got_k = ops.qk_norm_rope(q, k, q_norm.weight, k_norm.weight, cos, sin, eps, zero_centered=zero_centered)
    assert got_q.shape == (2, heads, n, dim) and got_k.shape == (2, kv_heads, n, dim) and got_q.is_contiguous()
    for got, x, norm in ((got_q, q, q_norm), (got_k, k, k_norm)):
        fused_norm = ops.rms_norm(x, norm.weight, eps, zero_centered=zero_centered)
        assert torch.equal(got, ops.rope(fused_norm.transpose(1, 2), cos, sin))
    module = qwen3 if family == "qwen3" else qwen3_5
    with torch.no_grad():
        hf_q, hf_k = module.apply_rotary_pos_emb(q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2), cos, sin)
    assert_close(got_q, hf_q, dtype, "q vs HF")
    assert_close(got_k, hf_k, dtype, "k vs HF")
    ref_q, ref_k = reference.qk_norm_rope(q, k, q_norm.weight, k_norm.weight, cos, sin, eps, zero_centered=zero_centered)
    assert_close(got_q, ref_q, dtype, "q vs reference")
    assert_close(got_k, ref_k, dtype, "k vs reference")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_table", ["shared", "per-row"])
@pytest.mark.parametrize("heads,kv_heads,n,dim,rot", [(4, 2, 1, 128, 128), (3, 1, 7, 10, 6), (4, 2, 9, 256, 64)])
def test_qk_norm_rope_store_kv_is_the_norms_rope_then_store(heads, kv_heads, n, dim, rot, slot_table, dtype, gen):
    """qk_norm_rope, then store_kv of its k and of v (read in place from wider rows), bit for bit: q's output and the
    caches, a negative slot storing nothing and every other slot keeping its bits; the reference likewise."""
    q = (torch.randn(2, n, heads, dim, generator=gen) * 3).to(dtype)
    k = (torch.randn(2, n, kv_heads, dim, generator=gen) * 3).to(dtype)
    v = (torch.randn(2, n, kv_heads, 3 * dim, generator=gen) * 3).to(dtype)[..., dim:2 * dim]
    qw, kw = ((torch.randn(dim, generator=gen) * 0.3 + 1).to(dtype) for _ in range(2))
    cos, sin = _rotary_tables(n, rot, dtype, gen)
    capacity = n + 5
    slots = torch.stack([torch.randperm(capacity, generator=gen)[:n] for _ in range(2)])
    slots[:, n // 2] = -1
    slots = slots[0] if slot_table == "shared" else slots
    keys, values = (torch.randn(2, kv_heads, capacity, dim, generator=gen).to(dtype) for _ in range(2))
    expected_keys, expected_values = keys.clone(), values.clone()
    expected_q, expected_k = ops.qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6, zero_centered=True)
    ops.store_kv(expected_keys, expected_values, slots, expected_k, v.transpose(1, 2))
    ref_keys, ref_values = keys.clone(), values.clone()
    ref_q = reference.qk_norm_rope_store_kv(q, k, v, qw, kw, cos, sin, 1e-6, ref_keys, ref_values, slots,
                                            zero_centered=True)
    got = ops.qk_norm_rope_store_kv(q, k, v, qw, kw, cos, sin, 1e-6, keys, values, slots, zero_centered=True)
    assert got.shape == (2, heads, n, dim) and got.is_contiguous()
    assert torch.equal(got, expected_q)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    assert_close(got, ref_q, dtype, "q vs reference")
    assert_close(keys, ref_keys, dtype, "keys vs reference")
    assert torch.equal(values, ref_values)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,heads,dim", [(1, 4, 256), (7, 3, 10)])
def test_sigmoid_mul_is_the_hf_output_gate(n, heads, dim, dtype, gen):
    """Qwen3.5 attention's ``attn_output * torch.sigmoid(gate)`` with the gate read in place from the q projection's
    rows; in place on x too."""
    rows = (torch.randn(2, n, heads * 2 * dim, generator=gen) * 4).to(dtype)
    gate = rows.view(2, n, heads, 2 * dim)[..., dim:]
    x = (torch.randn(2, n, heads, dim, generator=gen) * 3).to(dtype)
    hf = (x.reshape(2, n, -1) * torch.sigmoid(gate.reshape(2, n, -1))).view(2, n, heads, dim)
    got = ops.sigmoid_mul(gate, x)
    assert got.shape == x.shape and got.is_contiguous()
    assert torch.equal(got, hf)
    assert_close(got, reference.sigmoid_mul(gate, x), dtype, "vs reference")
    assert ops.sigmoid_mul(gate, x, out=x) is x and torch.equal(x, got)


# ---- bad input ---------------------------------------------------------------------------------


def test_outputs_inside_the_rows_of_sliced_inputs_are_refused():
    """An output inside the rows an input's heads are sliced from (an input ATen's overlap status cannot judge, as it
    is not dense) is refused by every op that must not write over its inputs, before anything is written."""
    rows = torch.randn(2, 5, 4, 16)
    x = rows[..., :8]  # [B, N, H, 8] heads beside other features: not dense
    inside = rows.view(-1)[8:8 + 2 * 4 * 5 * 8]
    cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="rope: out must not overlap x"):
        ops.rope(x.transpose(1, 2), cos, sin, out=inside.view(2, 4, 5, 8))
    with pytest.raises(ValueError, match="gqa_attention: out must not overlap q"):
        ops.gqa_attention(x.transpose(1, 2), torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8),
                          torch.ones(1, 1, 5, 3, dtype=torch.bool), 0.5, out=inside.view(2, 4, 5, 8))
    with pytest.raises(ValueError, match="linear: out must not overlap x"):
        ops.linear(x.reshape(2, 5, 4, 8)[:, :, 0], torch.randn(8, 8), out=rows.view(-1)[:80].view(10, 8))
    before = rows.clone()
    with pytest.raises(ValueError, match="store_kv: keys must not overlap key_states"):
        ops.store_kv(inside.view(2, 4, 5, 8), torch.zeros(2, 4, 5, 8), torch.arange(5), x.transpose(1, 2),
                     torch.randn(2, 4, 5, 8))
    assert torch.equal(rows, before)


def test_outputs_overlapping_inputs_are_refused_unless_in_place_is_allowed():
    """rms_norm (its output pass reads the row again), silu_mul and add_rms_norm's residual_out (elementwise: in
    place allowed, any other overlap not), also for strided views ATen's overlap status cannot judge; nothing is
    written on a refusal."""
    buf = torch.randn(4, 16)
    before = buf.clone()
    x, shifted = buf[:, 0:8], buf[:, 4:12]  # partial overlap of strided views
    w = torch.ones(8)
    with pytest.raises(ValueError, match="rms_norm: out must not overlap x"):
        ops.rms_norm(x, w, 1e-6, out=shifted)
    with pytest.raises(ValueError, match="rms_norm: out must not overlap gate"):
        ops.rms_norm(torch.randn(4, 8), w, 1e-6, gate=x, out=shifted)
    with pytest.raises(ValueError, match="rms_norm: out must not overlap x"):
        ops.rms_norm(x, w, 1e-6, out=x)
    with pytest.raises(ValueError, match="silu_mul: out must not overlap gate unless it is gate itself"):
        ops.silu_mul(x, torch.randn(4, 8), out=shifted)
    with pytest.raises(ValueError, match="silu_mul: out must not overlap up unless it is up itself"):
        ops.silu_mul(torch.randn(4, 8), x, out=shifted)
    with pytest.raises(ValueError, match="add_rms_norm: residual_out must be x itself or apart from it"):
        ops.add_rms_norm(x, torch.randn(4, 8), w, 1e-6, residual_out=shifted)
    assert torch.equal(buf, before)
    # in place where allowed: the same bits as apart
    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    expected = ops.silu_mul(gate, up)
    assert torch.equal(ops.silu_mul(gate, up, out=gate), expected)
    gate_up = torch.randn(4, 16)  # a stacked projection's halves: interleaved rows, no element shared
    expected = ops.silu_mul(gate_up[:, :8].clone(), gate_up[:, 8:].clone())
    assert torch.equal(ops.silu_mul(gate_up[:, :8], gate_up[:, 8:], out=gate_up[:, :8]), expected)
    xs, res = torch.randn(4, 8), torch.randn(4, 8)
    expected_out, expected_sum = ops.add_rms_norm(xs, res, w, 1e-6)
    out, summed = ops.add_rms_norm(xs, res, w, 1e-6, residual_out=xs)
    assert summed is xs and torch.equal(xs, expected_sum) and torch.equal(out, expected_out)


def test_given_outputs_whose_rows_no_stride_reaches_are_refused():
    out = torch.empty(3, 2, 8).transpose(0, 1)  # [2, 3, 8]: rows 8 apart within a batch, 16 across
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="rms_norm: out's rows must be reachable by one stride"):
        ops.rms_norm(x, torch.ones(8), 1e-6, out=out)
    with pytest.raises(ValueError, match="silu_mul: out's rows must be reachable by one stride"):
        ops.silu_mul(x, x.clone(), out=out)
    with pytest.raises(ValueError, match="add_rms_norm: residual_out's rows must be reachable by one stride"):
        ops.add_rms_norm(x, x.clone(), torch.ones(8), 1e-6, residual_out=out)
    with pytest.raises(ValueError, match="rms_norm: out must have shape \\[2, 3, 8\\], got \\[6, 8\\]"):
        ops.rms_norm(x, torch.ones(8), 1e-6, out=torch.empty(6, 8))


def test_rms_norm_bad_inputs():
    x = torch.randn(4, 8)
    w = torch.ones(8)
    out = torch.full((4, 8), 5.0)  # not empty: uninitialised memory may hold NaNs, which torch.equal never matches
    rms = load_ops().rms_norm
    cases = [
        (lambda: rms(x, w.half(), None, 1e-6, False, out), "weight must have dtype"),
        (lambda: rms(x, torch.ones(7), None, 1e-6, False, out), r"weight must have shape \[8\]"),
        (lambda: rms(x, w, torch.randn(4, 8), 1e-6, True, out), "gate is only supported with zero_centered=False"),
        (lambda: rms(x, w, torch.randn(3, 8), 1e-6, False, out), r"gate must have shape \[4, 8\]"),
        (lambda: rms(x, w, None, -1.0, False, out), "eps must be finite and >= 0"),
        (lambda: rms(x, w, None, 1e-6, False, torch.empty(4, 8, dtype=torch.bfloat16)), "out must have dtype"),
        (lambda: rms(x.t(), torch.ones(4), None, 1e-6, False, torch.empty(8, 4)), "x must be contiguous in its last dim"),
        (lambda: rms(x.long(), w, None, 1e-6, False, out), "x must be float32, float16 or bfloat16"),
        (lambda: rms(torch.randn(4, 0), torch.ones(0), None, 1e-6, False, torch.empty(4, 0)), "at least one feature"),
        (lambda: rms(x.view(2, 2, 8), w, torch.randn(3, 1, 8), 1e-6, False, out),
         r"gate must have shape \[4, 8\] or \[G, R, 8\] with G \* R = 4"),
        (lambda: rms(x.view(1, 2, 2, 8), w, None, 1e-6, False, out), r"x must have shape \[rows, D\] or \[G, R, D\]"),
    ]
    for call, message in cases:
        before = out.clone()
        with pytest.raises(ValueError, match=message):
            call()
        assert torch.equal(out, before), message  # nothing written


def test_qk_norm_rope_bad_inputs():
    q, k = torch.randn(1, 5, 4, 8), torch.randn(1, 5, 2, 8)
    w, cos, sin = torch.ones(8), torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    q_out, k_out = torch.full((1, 4, 5, 8), 5.0), torch.full((1, 2, 5, 8), 5.0)
    rows = torch.randn(320)
    op = load_ops().qk_norm_rope
    cases = [
        (lambda: op(q[0], k, w, w, cos, sin, 1e-6, False, q_out, k_out), "q must have 4 dims"),
        (lambda: op(q, k[:, :4], w, w, cos, sin, 1e-6, False, q_out, k_out), r"k must have shape \[B, N, Hk, D\] = \[1, 5, Hk, 8\]"),
        (lambda: op(q, k.half(), w, w, cos, sin, 1e-6, False, q_out, k_out), "k must have dtype Float like q"),
        (lambda: op(q, k, torch.ones(7), w, cos, sin, 1e-6, False, q_out, k_out), r"q_weight must have shape \[8\]"),
        (lambda: op(q, k, w, w.double(), cos, sin, 1e-6, False, q_out, k_out), "k_weight must have dtype Float like q"),
        (lambda: op(q, k, w, w, cos[:, :4], sin, 1e-6, False, q_out, k_out), r"cos must have shape \[B, N, R\]"),
        (lambda: op(q, k, w, w, cos[..., :7], sin[..., :7], 1e-6, False, q_out, k_out), "the rotary width R"),
        (lambda: op(q, k, w, w, cos, sin.half(), 1e-6, False, q_out, k_out), "sin must have dtype Float like q"),
        (lambda: op(q, k, w, w, cos, sin, -1.0, False, q_out, k_out), "eps must be finite and >= 0"),
        (lambda: op(q, k, w, w, cos, sin, 1e-6, False, q_out.transpose(1, 2), k_out), r"q_out must have shape \[1, 4, 5, 8\]"),
        (lambda: op(q, k, w, w, cos, sin, 1e-6, False, q_out, k_out.half()), "k_out must have dtype Float like q"),
        (lambda: op(q, k, w, w, cos, sin, 1e-6, False, q.transpose(1, 2), k_out), "q_out must not overlap the inputs"),
        (lambda: op(q, k, w, w, cos, sin, 1e-6, False, q_out, q_out[:, :2]), "q_out and k_out must not overlap"),
        # heads sliced from wider rows (not dense: ATen's overlap check cannot tell) and an output inside those rows
        (lambda: op(rows.view(1, 5, 4, 16)[..., :8], k, w, w, cos, sin, 1e-6, False,
                    rows[1:161].view(1, 4, 5, 8), k_out), "q_out must not overlap the inputs"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
        assert (q_out == 5.0).all() and (k_out == 5.0).all(), message  # nothing written


def test_qk_norm_rope_store_kv_bad_inputs():
    """Each bad argument is named before anything is written: q's output and the caches keep their values."""
    q, k, v = torch.randn(1, 5, 4, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
    w, cos, sin = torch.ones(8), torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    slots = torch.arange(5)
    q_out, keys, values = torch.full((1, 4, 5, 8), 5.0), torch.full((1, 2, 12, 8), 5.0), torch.full((1, 2, 12, 8), 5.0)
    cache_rows = torch.randn(1, 2, 12, 8)  # a cache whose first rows are also v
    op = load_ops().qk_norm_rope_store_kv
    name = "qk_norm_rope_store_kv: "
    cases = [
        (lambda: op(q, k[:, :4], v, w, w, cos, sin, 1e-6, False, slots, q_out, keys, values),
         r"k must have shape \[B, N, Hk, D\] = \[1, 5, Hk, 8\]"),
        (lambda: op(q, k, v[:, :, :1], w, w, cos, sin, 1e-6, False, slots, q_out, keys, values),
         r"v must have k's shape \[1, 5, 2, 8\], got \[1, 5, 1, 8\]"),
        (lambda: op(q, k, v.half(), w, w, cos, sin, 1e-6, False, slots, q_out, keys, values), "v must have dtype Float like q"),
        (lambda: op(q, k, v, w, w, cos, sin, -1.0, False, slots, q_out, keys, values), "eps must be finite and >= 0"),
        (lambda: op(q, k, v, w, w, cos, sin, 1e-6, False, slots[:4], q_out, keys, values),
         "slots must have one slot for each of q's 5 nodes"),
        (lambda: op(q, k, v, w, w, cos, sin, 1e-6, False, slots.int(), q_out, keys, values), "slots must have dtype Long"),
        (lambda: op(q, k, v, w, w, cos, sin, 1e-6, False, slots.expand(2, 5), q_out, keys, values),
         r"slots must have shape \[N\] .* or \[B, N\] = \[1, N\]"),
        (lambda: op(q, k, v, w, w, cos, sin, 1e-6, False, slots, q_out, keys[:, :1], values),
         r"keys must have shape \[1, 2, 12, 8\]"),
        (lambda: op(q, k, v, w, w, cos, sin, 1e-6, False, slots, q_out, keys, values[..., :4]),
         r"values must have shape \[1, 2, 12, 8\]"),
        (lambda: op(q, k, v, w, w, cos, sin, 1e-6, False, slots, q_out, keys, values.double()),
         "values must have dtype Float like q"),
        (lambda: op(q, k, v, w, w, cos, sin, 1e-6, False, slots, q_out, keys, keys), "q_out, keys and values must not overlap each other"),
        (lambda: op(q, k, cache_rows.view(-1)[:80].view(1, 5, 2, 8), w, w, cos, sin, 1e-6, False, slots, q_out, keys,
                    cache_rows), "values must not overlap the inputs"),
        (lambda: op(q, k, v, w, w, cos, sin, 1e-6, False, torch.tensor([0, 1, 12, 3, 4]), q_out, keys, values),
         r"slots\[2\] = 12 must be below 12"),
        (lambda: op(q, k, v, w, w, cos, sin, 1e-6, False, slots, q_out, torch.zeros(1, 2, 8, 12).transpose(2, 3), values),
         "keys must be contiguous in its last dim"),
        (lambda: op(q, k, v, w, w, cos, sin, 1e-6, False, slots, q_out, torch.zeros(1, 1, 12, 8).expand(1, 2, 12, 8),
                    values), "keys must not overlap itself"),
        (lambda: op(q, k, v, w, w, cos, sin, 1e-6, False, slots, cache_rows.view(-1)[:160].view(1, 4, 5, 8), keys,
                    cache_rows), "q_out, keys and values must not overlap each other"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=name + message):
            call()
        assert (q_out == 5.0).all() and (keys == 5.0).all() and (values == 5.0).all(), message  # nothing written


def test_sigmoid_mul_bad_inputs():
    x, out = torch.randn(4, 8), torch.empty(4, 8)
    op = load_ops().sigmoid_mul
    with pytest.raises(ValueError, match=r"sigmoid_mul: gate must have shape \[4, 8\]"):
        ops.sigmoid_mul(torch.randn(4, 9), x)
    with pytest.raises(ValueError, match=r"sigmoid_mul: gate must have shape \[4, 8\] or \[G, R, 8\]"):
        op(torch.randn(3, 8), x, out)
    with pytest.raises(ValueError, match="sigmoid_mul: gate must have dtype Float"):
        op(torch.randn(4, 8).half(), x, out)
    with pytest.raises(ValueError, match="sigmoid_mul: out must not overlap gate"):
        gate = torch.randn(4, 8)
        op(gate, x, gate)
    buffer = torch.randn(33)
    with pytest.raises(ValueError, match="sigmoid_mul: out must not overlap x unless it is x itself"):
        op(torch.randn(4, 8), buffer[:32].view(4, 8), buffer[1:].view(4, 8))
    heads = torch.randn(4, 2, 16)  # the gate beside other heads in its rows: not dense
    with pytest.raises(ValueError, match="sigmoid_mul: out must not overlap gate"):
        op(heads[..., :8], torch.randn(8, 8), heads.view(-1)[4:68].view(8, 8))
    with pytest.raises(ValueError, match=r"sigmoid_mul: out must have shape \[2, 3, 8\]"):
        ops.sigmoid_mul(torch.randn(2, 3, 8), torch.randn(2, 3, 8), out=torch.empty(3, 2, 8))


def test_add_rms_norm_bad_inputs():
    buffer = torch.randn(40)
    x, r, w = buffer[:32].view(4, 8), torch.randn(4, 8), torch.ones(8)
    out, total = torch.full((4, 8), 5.0), torch.full((4, 8), 5.0)
    add = load_ops().add_rms_norm
    cases = [
        (lambda: add(x, r.half(), w, 1e-6, False, out, total), "add_rms_norm: residual must have dtype"),
        (lambda: add(x, torch.randn(3, 8), w, 1e-6, False, out, total), r"add_rms_norm: residual must have shape \[4, 8\]"),
        (lambda: add(x, r, torch.ones(7), 1e-6, False, out, total), r"add_rms_norm: weight must have shape \[8\]"),
        (lambda: add(x, r, w, float("nan"), False, out, total), "add_rms_norm: eps must be finite"),
        (lambda: add(x, r, w, 1e-6, False, out, torch.empty(4, 7)), r"add_rms_norm: residual_out must have shape"),
        (lambda: add(x, r, w, 1e-6, False, x, total), "add_rms_norm: out must not overlap x"),
        (lambda: add(x, r, w, 1e-6, False, out, out), "add_rms_norm: out must not overlap residual_out"),
        (lambda: add(x, r, w, 1e-6, False, out, buffer[1:33].view(4, 8)), "add_rms_norm: residual_out must be x"),
        (lambda: add(x, r, w, 1e-6, False, out, torch.zeros(1, 8).expand(4, 8)),
         "add_rms_norm: residual_out must not overlap itself"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
        assert (out == 5.0).all() and (total == 5.0).all(), message  # nothing written
    with pytest.raises(ValueError, match=r"add_rms_norm: residual must have shape \[4, 8\]"):
        ops.add_rms_norm(x, r.view(8, 4), w, 1e-6)  # the same rows once flattened: still refused
    with pytest.raises(ValueError, match=r"add_rms_norm: out must have shape \[4, 8\]"):
        ops.add_rms_norm(x, r, w, 1e-6, out=torch.empty(8, 4))


def test_silu_mul_and_gdn_gating_bad_inputs():
    g = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"silu_mul: up must have shape \[4, 8\]"):
        ops.silu_mul(g, torch.randn(4, 9))
    with pytest.raises(ValueError, match="silu_mul: up must have dtype"):
        ops.silu_mul(g, torch.randn(4, 8).half())
    # the same rows once flattened, but not the same shape: refused, as torch's broadcasting would
    with pytest.raises(ValueError, match=r"silu_mul: up must have shape \[2, 3, 8\]"):
        ops.silu_mul(torch.randn(2, 3, 8), torch.randn(3, 2, 8))
    with pytest.raises(ValueError, match=r"rms_norm: gate must have shape \[2, 3, 8\]"):
        ops.rms_norm(torch.randn(2, 3, 8), torch.ones(8), 1e-6, gate=torch.randn(6, 8))
    x, w = torch.randn(3, 16), torch.randn(6, 16)
    with pytest.raises(ValueError, match=r"gdn_gates: A_log must have shape \[6\]"):
        ops.gdn_gates(x, w, w, torch.randn(5), torch.randn(6))
    with pytest.raises(ValueError, match="gdn_gates: dt_bias must be float32, float16 or bfloat16"):
        ops.gdn_gates(x, w, w, torch.randn(6), torch.ones(6, dtype=torch.int64))
    with pytest.raises(ValueError, match="gdn_gates: weight_b must have dtype"):
        ops.gdn_gates(x, w, w.half(), torch.randn(6), torch.randn(6))
    with pytest.raises(ValueError, match=r"gdn_gates: weight_b must have shape \[HV, F\] = \[6, 16\]"):
        ops.gdn_gates(x, w, torch.randn(6, 15), torch.randn(6), torch.randn(6))
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"rope: cos must have shape \[B, N, R\] = \[1, 5, R\]"):
        ops.rope(q, torch.randn(1, 4, 8), torch.randn(1, 4, 8))
    with pytest.raises(ValueError, match="rope: the rotary width R"):
        ops.rope(q, torch.randn(1, 5, 7), torch.randn(1, 5, 7))
    with pytest.raises(ValueError, match="rope: sin must have dtype"):
        ops.rope(q, torch.randn(1, 5, 8), torch.randn(1, 5, 8).half())
    with pytest.raises(ValueError, match="rope: out must not overlap x"):
        ops.rope(q, torch.randn(1, 5, 8), torch.randn(1, 5, 8), out=q)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,n,mask_rows,mask_batch", [(6, 2, 5, 5, 2), (6, 2, 1, 1, 1), (4, 4, 3, 1, 2)])
def test_gqa_attention_op_equals_sdpa_and_the_reference(heads, kv_heads, n, mask_rows, mask_batch, dtype, gen):
    q = torch.randn(2, heads, n, 8, generator=gen).to(dtype)
    k_cache, v_cache = (torch.randn(2, kv_heads, 12, 8, generator=gen).to(dtype) for _ in range(2))
    k, v = k_cache[:, :, :9], v_cache[:, :, :9]  # a slice of a larger cache, as the verify reads it
    mask = torch.rand(mask_batch, 1, mask_rows, 9, generator=gen) > 0.4
    mask[..., 0] = True
    group = heads // kv_heads
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask, scale=0.3)
    got = ops.gqa_attention(q, k, v, mask, 0.3, out=poison(torch.empty(q.shape, dtype=dtype)))
    assert_close(got, expected, dtype, "vs SDPA")
    assert_close(got, reference.gqa_attention(q, k, v, mask, 0.3), dtype, "vs reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_attention_rows_with_no_key_give_zeros(dtype, gen):
    """A row whose mask is all False (e.g. a padded query) gives zeros, on every path and in the reference,
    whatever this torch's SDPA does with it; no keys at all likewise."""
    q = torch.randn(1, 4, 3, 8, generator=gen).to(dtype)
    k, v = (torch.randn(1, 2, 9, 8, generator=gen).to(dtype) for _ in range(2))
    mask = torch.rand(1, 1, 3, 9, generator=gen) > 0.4
    mask[..., 0] = True
    mask[:, :, 1] = False
    for got in (ops.gqa_attention(q, k, v, mask, 0.3), reference.gqa_attention(q, k, v, mask, 0.3)):
        assert torch.equal(got[:, :, 1], torch.zeros_like(got[:, :, 1]))
        assert torch.isfinite(got).all()
    assert_close(ops.gqa_attention(q, k, v, mask, 0.3), reference.gqa_attention(q, k, v, mask, 0.3), dtype, "vs ref")
    empty = ops.gqa_attention(q, k[:, :, :0], v[:, :, :0], mask[..., :0], 0.3, out=poison(torch.empty(q.shape, dtype=dtype)))
    assert torch.equal(empty, torch.zeros_like(empty))


def test_gqa_attention_bad_inputs():
    q, k, mask = torch.randn(1, 6, 5, 8), torch.randn(1, 2, 9, 8), torch.ones(1, 1, 5, 9, dtype=torch.bool)
    with pytest.raises(ValueError, match="gqa_attention: k must have shape"):
        ops.gqa_attention(q, torch.randn(1, 4, 9, 8), torch.randn(1, 4, 9, 8), mask, 1.0)
    with pytest.raises(ValueError, match="gqa_attention: v must have shape"):
        ops.gqa_attention(q, k, torch.randn(1, 2, 8, 8), mask, 1.0)
    with pytest.raises(ValueError, match="gqa_attention: mask must have dtype"):
        ops.gqa_attention(q, k, k, mask.float(), 1.0)
    with pytest.raises(ValueError, match="gqa_attention: mask must have shape"):
        ops.gqa_attention(q, k, k, torch.ones(1, 1, 4, 9, dtype=torch.bool), 1.0)
    with pytest.raises(ValueError, match="gqa_attention: k must have dtype"):
        ops.gqa_attention(q, k.double(), k.double(), mask, 1.0)
    with pytest.raises(ValueError, match="gqa_attention: out must have shape"):
        ops.gqa_attention(q, k, k, mask, 1.0, out=torch.empty(1, 6, 5, 7))
    with pytest.raises(ValueError, match="gqa_attention: out must not overlap q"):
        ops.gqa_attention(q, k, k, mask, 1.0, out=q)
    with pytest.raises(ValueError, match="gqa_attention: num_splits must be >= 0"):
        ops.gqa_attention(q, k, k, mask, 1.0, num_splits=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n,k", [(1, 32, 64), (7, 96, 200), (65, 48, 128)])
def test_linear_op_equals_torch(rows, n, k, dtype, gen):
    """The CPU op is torch.mm; x with a row stride that is not K, out written as a strided view."""
    x = torch.randn(rows, k + 8, generator=gen).to(dtype)[:, 3:3 + k]
    weight = torch.randn(n, k, generator=gen).to(dtype)
    out = poison(torch.empty(rows, n + 5, dtype=dtype))[:, :n]
    assert torch.equal(ops.linear(x, weight, out=out), torch.nn.functional.linear(x, weight))
    assert_close(out, reference.linear(x, weight), dtype)
    x3 = torch.randn(2, 3, k, generator=gen).to(dtype)
    assert torch.equal(ops.linear(x3, weight), torch.nn.functional.linear(x3, weight))
    # prefetch_weight only concerns the CUDA kernel's launch order
    assert torch.equal(ops.linear(x3, weight, prefetch_weight=True), torch.nn.functional.linear(x3, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cublaslt_cpu_is_torch_mm(dtype, gen):
    """On the CPU linear_cublaslt has one algorithm, torch.mm: x rows wider than K, a row block of a stacked weight,
    out written as a strided view, leading dims folded."""
    x = torch.randn(7, 200, generator=gen).to(dtype)[:, 3:131]
    stacked = torch.randn(96, 128, generator=gen).to(dtype)
    weight = stacked[32:80]
    assert ops.linear_cublaslt_algorithms(x, weight) == 1
    assert ops.linear_cublaslt_describe(x, weight, 0) == "at::mm"
    out = poison(torch.empty(7, 53, dtype=dtype))[:, :48]
    assert torch.equal(ops.linear_cublaslt(x, weight, 0, out=out), torch.nn.functional.linear(x, weight))
    x3 = torch.randn(2, 3, 128, generator=gen).to(dtype)
    assert torch.equal(ops.linear_cublaslt(x3, weight, 0), torch.nn.functional.linear(x3, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_gemv_cpu_is_torch_mm(dtype, gen):
    """On the CPU linear_gemv is torch.mm: a row taken from a wider buffer, a row block of a stacked weight, out as a
    strided view, leading dims folded; prefetch_weight only concerns the CUDA kernel's launch."""
    x = torch.randn(1, 200, generator=gen).to(dtype)[:, 3:131]
    weight = torch.randn(96, 128, generator=gen).to(dtype)[32:80]
    out = poison(torch.empty(1, 53, dtype=dtype))[:, :48]
    assert torch.equal(ops.linear_gemv(x, weight, out=out), torch.nn.functional.linear(x, weight))
    assert_close(out, reference.linear(x, weight), dtype)
    x3 = torch.randn(1, 1, 128, generator=gen).to(dtype)
    assert torch.equal(ops.linear_gemv(x3, weight, prefetch_weight=True), torch.nn.functional.linear(x3, weight))


def _check_projection_shapes(name, project, rows):
    """What every projection op checks first: the weight's shape and dtype, out's shape (x [rows, 16], w [8, 16])."""
    x, w = torch.randn(rows, 16), torch.randn(8, 16)
    for weight, out, message in ((torch.randn(8, 15), None, "weight must have shape"),
                                 (w.double(), None, "weight must have dtype"),
                                 (w, torch.empty(rows, 7), "out must have shape")):
        with pytest.raises(ValueError, match=f"{name}: {message}"):
            project(x, weight, out)


def test_linear_gemv_bad_inputs():
    _check_projection_shapes("linear_gemv", lambda x, w, out: ops.linear_gemv(x, w, out=out), 1)
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"linear_gemv: x must have one row \(a decode step's\), got shape \[3, 16\]"):
        ops.linear_gemv(torch.randn(3, 16), w)
    out = torch.full((1, 8), 5.0)
    with pytest.raises(ValueError):
        ops.linear_gemv(torch.randn(1, 16), torch.randn(8, 17), out=out)
    assert (out == 5.0).all()


def test_gemm_tuning_scope_and_problem_keys(monkeypatch):
    """gemm_tuning is active only when enabled and inside round_shapes (nested contexts count); a single row's
    stride is not part of a problem, two rows' is; CPU tensors are never tuned, so project stays F.linear."""
    from ddtree_ext import fused, gemm_tuning

    monkeypatch.setattr(gemm_tuning, "enabled", False)
    with gemm_tuning.round_shapes():
        assert not gemm_tuning.active()
    monkeypatch.setattr(gemm_tuning, "enabled", True)
    assert not gemm_tuning.active()
    with gemm_tuning.round_shapes():
        with gemm_tuning.round_shapes():
            assert gemm_tuning.active()
        assert gemm_tuning.active()
    assert not gemm_tuning.active()
    x = torch.randn(4, 6, 64).to(torch.bfloat16)
    w = torch.randn(32, 64).to(torch.bfloat16)
    key = gemm_tuning._problem
    assert key(x[0, :1], w) == key(x[1, ::3][:1], w)  # one row: its stride is free
    assert key(x[0, :2], w) != key(x[:2, 0], w)  # two rows 64 or 6 * 64 apart
    assert key(x[0, :1], w[:1]) == key(x[0, :1], w[::2][:1])  # one weight row
    assert not gemm_tuning.applies(x[0], w)  # not CUDA
    with gemm_tuning.round_shapes(), torch.no_grad():
        assert torch.equal(fused.project(w, x), torch.nn.functional.linear(x, w))
    assert gemm_tuning.picks() == []


def test_linear_cublaslt_bad_inputs():
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"linear_cublaslt: algorithm must be 0 on the CPU \(at::mm\), got 1"):
        ops.linear_cublaslt(x, w, 1)
    with pytest.raises(ValueError, match="linear_cublaslt_describe: algorithm must be 0 on the CPU"):
        ops.linear_cublaslt_describe(x, w, -1)
    with pytest.raises(ValueError, match="linear_cublaslt: weight must have shape"):
        ops.linear_cublaslt(x, torch.randn(8, 15), 0)
    with pytest.raises(ValueError, match="linear_cublaslt_algorithms: weight must have dtype"):
        ops.linear_cublaslt_algorithms(x, w.double())
    with pytest.raises(ValueError, match="linear_cublaslt: x's rows must lie at least K = 16 elements apart"):
        ops.linear_cublaslt(x[:1].expand(3, 16), w, 0)
    with pytest.raises(ValueError, match="linear_cublaslt: weight's rows must lie at least K = 16 elements apart"):
        ops.linear_cublaslt(x, torch.randn(1, 16).expand(8, 16), 0)
    with pytest.raises(ValueError, match="linear_cublaslt: out's rows must lie at least N = 8 elements apart"):
        ops.linear_cublaslt(x, w, 0, out=torch.empty(1, 8).expand(3, 8))
    with pytest.raises(ValueError, match="linear_cublaslt: out must have shape"):
        ops.linear_cublaslt(x, w, 0, out=torch.empty(3, 7))
    with pytest.raises(ValueError, match="linear_cublaslt: out must not overlap x"):
        buffer = torch.randn(3, 16)
        ops.linear_cublaslt(buffer, torch.randn(16, 16), 0, out=buffer)


def test_linear_bad_inputs():
    _check_projection_shapes("linear", lambda x, w, out: ops.linear(x, w, out=out), 3)
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="linear: out must have dtype"):
        ops.linear(x, w, out=torch.empty(3, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="linear: x must be float32, float16 or bfloat16"):
        ops.linear(x.double(), w.double())
    with pytest.raises(ValueError, match="linear: weight must be contiguous in its last dim"):
        ops.linear(x, torch.randn(16, 8).t())
    buffer = torch.randn(3, 16)
    with pytest.raises(ValueError, match="linear: out must not overlap x"):
        ops.linear(buffer, torch.randn(16, 16), out=buffer)
    with pytest.raises(ValueError, match=r"linear: out must have shape \[2, 3, 8\]"):
        ops.linear(torch.randn(2, 3, 16), w, out=torch.empty(3, 2, 8))
    out = torch.full((3, 8), 5.0)
    with pytest.raises(ValueError):
        ops.linear(x, torch.randn(8, 17), out=out)
    assert (out == 5.0).all()


def test_layer_ops_opcheck(gen):
    lib = load_ops()
    x = torch.randn(3, 16, generator=gen)
    torch.library.opcheck(lib.rms_norm.default, (x, torch.randn(16, generator=gen), x.clone(), 1e-6, False, torch.empty(3, 16)))
    torch.library.opcheck(lib.add_rms_norm.default,
                          (x, x.clone(), torch.randn(16, generator=gen), 1e-6, True, torch.empty(3, 16), torch.empty(3, 16)))
    torch.library.opcheck(lib.silu_mul.default, (x, x.clone(), torch.empty(3, 16)))
    w = torch.randn(6, 16, generator=gen)
    torch.library.opcheck(lib.gdn_gates.default, (x, w, w.clone(), torch.randn(6), torch.randn(6), torch.empty(3, 6), torch.empty(3, 6)))
    q = torch.randn(1, 2, 5, 8, generator=gen)
    torch.library.opcheck(lib.rope.default, (q, torch.randn(1, 5, 8), torch.randn(1, 5, 8), torch.empty(1, 2, 5, 8)))
    torch.library.opcheck(lib.qk_norm_rope.default, (q.transpose(1, 2), q[:, :1].transpose(1, 2), torch.randn(8),
                                                     torch.randn(8), torch.randn(1, 5, 8), torch.randn(1, 5, 8), 1e-6,
                                                     True, torch.empty(1, 2, 5, 8), torch.empty(1, 1, 5, 8)))
    torch.library.opcheck(lib.qk_norm_rope_store_kv.default,
                          (q.transpose(1, 2), q[:, :1].transpose(1, 2), q[:, 1:].transpose(1, 2).clone(),
                           torch.randn(8), torch.randn(8), torch.randn(1, 5, 8), torch.randn(1, 5, 8), 1e-6, True,
                           torch.tensor([3, -1, 0, 6, 2]), torch.empty(1, 2, 5, 8), torch.zeros(1, 1, 7, 8),
                           torch.zeros(1, 1, 7, 8)))
    torch.library.opcheck(lib.sigmoid_mul.default, (x.clone(), x, torch.empty(3, 16)))
    torch.library.opcheck(lib.linear.default, (x, w, torch.empty(3, 6)))
    torch.library.opcheck(lib.linear_cublaslt.default, (x, w, 0, torch.empty(3, 6)))
    torch.library.opcheck(lib.linear_gemv.default, (x[:1], w, torch.empty(1, 6)))
    kv = torch.randn(1, 1, 7, 8, generator=gen)
    torch.library.opcheck(lib.gqa_attention.default,
                          (q, kv, kv.clone(), torch.ones(1, 1, 5, 7, dtype=torch.bool), 0.5, torch.empty(1, 2, 5, 8)))


# ---- LayerFusion ---------------------------------------------------------------------------------


def _swapped_types(fusion):
    return sorted({type(m).__name__ for m, _ in fusion.swaps})


def runs_swapped(module, forward) -> bool:
    """Whether ``module``'s forward is ``forward`` swapped in (for this thread: fused._ThreadSwappedForward)."""
    return getattr(module.__dict__.get("forward"), "forward", None) is forward


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_fusion_swaps_the_norms_and_mlps_and_restores_them(family):
    model = make_tiny_target(family, seed=0)
    fusion = LayerFusion(model.model)
    layers = model.config.num_hidden_layers
    if family == "qwen3":
        # the layer and its attention; input + post norms and q/k norms per layer, the final norm; one MLP per layer;
        # the seven projections of a layer (q, k and v once, for the K/V prefetch; o and the MLP's three as plain
        # projections).
        assert _swapped_types(fusion) == ["Linear", "Qwen3Attention", "Qwen3DecoderLayer", "Qwen3MLP", "Qwen3RMSNorm"]
        assert len(fusion.swaps) == 14 * layers + 1
        assert len({id(m) for m, _ in fusion.swaps}) == len(fusion.swaps)  # no module swapped twice
    else:
        assert _swapped_types(fusion) == [
            "Linear", "Qwen3_5Attention", "Qwen3_5DecoderLayer", "Qwen3_5MLP", "Qwen3_5RMSNorm", "Qwen3_5RMSNormGated"
        ]
    marker = lambda *a, **k: "marker"  # an instance forward of the user's own (an accelerate hook, say)
    stock_rope = qwen3.apply_rotary_pos_emb
    first = fusion.swaps[0][0]
    first.forward = marker
    with torch.no_grad(), fusion.active():
        # The module with a forward of its own keeps it (a swap would skip it); every other one is swapped.
        assert first.forward is marker
        assert all("forward" in m.__dict__ and runs_swapped(m, f) for m, f in fusion.swaps[1:])
        assert qwen3.apply_rotary_pos_emb is not stock_rope  # swapped while active
        # Another thread runs what the module held before: its class's forward (a marker class method shows it).
        seen = []
        second = fusion.swaps[1][0]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(type(second), "forward", lambda self, *a, **k: "class forward")
            other = threading.Thread(target=lambda: seen.append(second.forward("anything")))
            other.start()
            other.join()
        assert seen == ["class forward"]
    assert first.forward is marker
    assert all("forward" not in m.__dict__ for m, _ in fusion.swaps[1:])
    assert qwen3.apply_rotary_pos_emb is stock_rope


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_model_gives_the_stock_logits(family, dtype, monkeypatch):
    """As a verify calls the model: batch 1 and a 4D mask per layer type, so every fused piece runs (the
    spies count the RoPE launches and the folded attention calls)."""
    from ddtree_ext import fused

    model = make_tiny_target(family, seed=1, dtype=dtype)
    n = 9
    tokens = torch.randint(0, model.config.get_text_config().vocab_size, (1, n), generator=torch.Generator().manual_seed(2))
    masks = {"full_attention": torch.ones(1, 1, n, n, dtype=torch.bool).tril(), "linear_attention": None}
    counts = {"rope": 0, "gqa": 0}
    rope, gqa = ops.rope, fused.gqa_attention
    monkeypatch.setattr(ops, "rope", lambda *a, **k: counts.__setitem__("rope", counts["rope"] + 1) or rope(*a, **k))
    monkeypatch.setattr(fused, "gqa_attention", lambda *a: counts.__setitem__("gqa", counts["gqa"] + 1) or gqa(*a))
    fusion = LayerFusion(model)
    attention_layers = sum(t == "full_attention" for t in model.config.get_text_config().layer_types)
    with torch.no_grad():
        stock = model(input_ids=tokens, attention_mask=masks).logits.float()
        assert counts == {"rope": 0, "gqa": 0}
        with fusion.active():
            fused_logits = model(input_ids=tokens, attention_mask=masks).logits.float()
    assert counts == {"rope": 2 * attention_layers, "gqa": attention_layers}
    assert_close(fused_logits, stock, dtype, f"{family} fused logits")
    assert torch.equal(fused_logits.argmax(-1), stock.argmax(-1))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual_adds_give_the_bits_of_the_unfused_layers(family, dtype, monkeypatch):
    """The decoder layers' residual adds fused into the norms after them (each layer's post-attention norm, and the
    next layer's input norm) give the bits of the add and the fused norm run one after the other."""
    from ddtree_ext import fused

    model = make_tiny_target(family, seed=4, dtype=dtype)
    n = 7
    tokens = torch.randint(0, 50, (1, n), generator=torch.Generator().manual_seed(3))
    masks = {"full_attention": torch.ones(1, 1, n, n, dtype=torch.bool).tril(), "linear_attention": None}
    calls = []
    add_rms_norm = ops.add_rms_norm
    monkeypatch.setattr(ops, "add_rms_norm", lambda *a, **k: calls.append(1) or add_rms_norm(*a, **k))
    fusion = LayerFusion(model)
    layers = model.config.get_text_config().num_hidden_layers
    with torch.no_grad(), fusion.active():
        monkeypatch.setattr(fused, "fuse_residual_adds", False)
        unfused = model(input_ids=tokens, attention_mask=masks, output_hidden_states=True)
        assert not calls
        monkeypatch.setattr(fused, "fuse_residual_adds", True)
        fused_out = model(input_ids=tokens, attention_mask=masks, output_hidden_states=True)
    assert len(calls) == 2 * layers - 1  # the last layer's output goes to the final norm, unfused
    assert torch.equal(fused_out.logits, unfused.logits)
    for i, (a, b) in enumerate(zip(fused_out.hidden_states, unfused.hidden_states)):
        assert torch.equal(a, b), f"hidden state {i}"


@pytest.mark.parametrize("kv_store", ["fused-kv-store", "store-kv-apart"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_attention_body_gives_the_bits_of_the_stock_body(family, dtype, device, kv_store, monkeypatch):
    """A verify (its cache lets the attention layers run fused.py's body): one ops.qk_norm_rope_store_kv per attention
    layer (fuse_kv_store; off: ops.qk_norm_rope, then the cache's store_kv) and, on Qwen3.5, one ops.sigmoid_mul;
    logits, taps and the K/V written the same bits as HF's body with the fused forwards (fuse_attention_heads off). On
    CUDA too, with its side streams and stacked projections."""
    from ddtree_ext import fused, stack_projections
    from ddtree_ext.target import TargetAdapter

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = make_tiny_target(family, seed=5, dtype=dtype).to(device)
    if device == "cuda":
        stack_projections(model)
    adapter = TargetAdapter(model, (0, 1))
    gen = torch.Generator().manual_seed(6)
    state = adapter.new_state(capacity=64)
    adapter.prefill(torch.randint(0, 50, (1, 9), generator=gen).to(device), state)
    parent = torch.tensor([[-1, 0, 0, 1, 1, 2, 4]])
    tree = reference.tree_from_parents(parent, torch.randint(0, 50, (1, 7), generator=gen), state.prefix_len.cpu())
    tree = type(tree)(*(t.to(device) for t in tree))
    monkeypatch.setattr(fused, "fuse_kv_store", kv_store == "fused-kv-store")
    names = ("qk_norm_rope", "qk_norm_rope_store_kv", "store_kv", "sigmoid_mul")
    calls = dict.fromkeys(names, 0)
    for name in names:
        op = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _op=op, _name=name, **k: calls.__setitem__(_name, calls[_name] + 1)
                            or _op(*a, **k))
    runs = {}
    attention_layers = len(state.keys)
    for fuse in (False, True):
        monkeypatch.setattr(fused, "fuse_attention_heads", fuse)
        calls.update(dict.fromkeys(names, 0))
        logits, taps = adapter.verify(tree, state)
        runs[fuse] = (logits, taps, {i: (state.keys[i].clone(), state.values[i].clone()) for i in state.keys})
        state.pending = None  # the next verify of the same tree on the same committed state
        if not fuse:
            assert calls == {"qk_norm_rope": 0, "qk_norm_rope_store_kv": 0, "store_kv": attention_layers,
                             "sigmoid_mul": 0}
    one_launch = kv_store == "fused-kv-store"
    assert attention_layers and calls == {
        "qk_norm_rope": 0 if one_launch else attention_layers,
        "qk_norm_rope_store_kv": attention_layers if one_launch else 0,
        "store_kv": 0 if one_launch else attention_layers,
        "sigmoid_mul": attention_layers if family == "qwen3_5" else 0,
    }
    assert torch.equal(runs[True][0], runs[False][0]) and torch.equal(runs[True][1], runs[False][1])
    for i, (keys, values) in runs[True][2].items():
        assert torch.equal(keys, runs[False][2][i][0]) and torch.equal(values, runs[False][2][i][1]), f"layer {i}"


def _assert_stock_logits_with_pre_hook(model, layer, hook, what):
    """With ``hook`` as a forward pre-hook (with kwargs) on ``layer``, the fused model gives the stock logits, under
    no_grad and under inference_mode (whose tensors keep no version counter)."""
    tokens = torch.randint(0, 50, (1, 5), generator=torch.Generator().manual_seed(0))
    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                stock = model(input_ids=tokens).logits
                with LayerFusion(model).active():
                    fused_logits = model(input_ids=tokens).logits
            assert_close(fused_logits, stock, torch.float32, f"{what} ({mode.__name__})")
    finally:
        handle.remove()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_a_layer_called_with_another_input_computes_its_own_norm(family):
    """The handed-over norm belongs to one tensor: a decoder layer called with any other input (a hook that
    replaced the hidden states, a caller of its own) normalises that input itself."""
    model = make_tiny_target(family, seed=5)
    layers = model.model.layers
    replaced = {}

    def replace(module, args, kwargs):  # layer 1 gets a copy of layer 0's output, not the tensor itself
        replaced["input"] = args[0].clone() * 1.5 if args else kwargs["hidden_states"].clone() * 1.5
        return ((replaced["input"], *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": replaced["input"]})

    _assert_stock_logits_with_pre_hook(model, layers[1], replace, f"{family} with a replaced layer input")


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_a_layer_input_changed_in_place_gets_its_own_norm(family):
    """A pre-hook that adds to the handed-over sum in place (steering code, say): the layer normalises the changed
    values, not the norm computed before the change."""
    model = make_tiny_target(family, seed=6)
    hidden = model.config.get_text_config().hidden_size

    def steer(module, args, kwargs):
        (args[0] if args else kwargs["hidden_states"]).add_(torch.linspace(-1, 1, hidden))

    _assert_stock_logits_with_pre_hook(model, model.model.layers[1], steer, f"{family} with an input changed in place")


def test_hooks_on_a_norm_still_fire():
    """A norm with a forward hook is called as a module (the hook sees its output), not folded into the add."""
    model = make_tiny_target("qwen3_5", seed=7)
    tokens = torch.randint(0, 50, (1, 4), generator=torch.Generator().manual_seed(2))
    seen = []
    norms = [model.model.layers[0].post_attention_layernorm, model.model.layers[1].input_layernorm]
    handles = [n.register_forward_hook(lambda m, a, out: seen.append(m)) for n in norms]
    try:
        with torch.no_grad(), LayerFusion(model).active():
            model(input_ids=tokens)
    finally:
        for h in handles:
            h.remove()
    assert seen == norms


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_fusion_keeps_the_stock_forward_where_the_ops_do_not_apply(family):
    """float64 (no op takes it), a norm input not contiguous in its last dim, and grad mode: HF's code runs,
    with HF's results."""
    model = make_tiny_target(family, seed=0, dtype=torch.float64)
    tokens = torch.randint(0, 50, (1, 7), generator=torch.Generator().manual_seed(1))
    fusion = LayerFusion(model)
    with torch.no_grad():
        stock = model(input_ids=tokens).logits
        with fusion.active():
            assert torch.equal(model(input_ids=tokens).logits, stock)
    norm = next(m for m, _ in fusion.swaps if type(m).__name__ in ("Qwen3RMSNorm", "Qwen3_5RMSNorm")).float()
    x = torch.randn(norm.weight.shape[0], 3).t()  # rows strided in their last dim
    with torch.no_grad(), fusion.active():
        assert torch.equal(norm(x), type(norm).forward(norm, x))
    # Grad mode (training a draft): no swaps, the ops have no backward.
    with fusion.active():
        assert all("forward" not in m.__dict__ for m, _ in fusion.swaps)


def test_an_open_fusion_leaves_other_models_gradients_alone():
    """While one model's fusion is open (no grad), another model trained in grad mode gets every gradient:
    the process-wide patches hand grad-mode calls to HF."""
    served, trained = make_tiny_target("qwen3", seed=0), make_tiny_target("qwen3", seed=1)
    tokens = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), LayerFusion(served).active(), torch.enable_grad():
        trained(input_ids=tokens).logits.sum().backward()
    missing = [name for name, p in trained.named_parameters() if p.requires_grad and p.grad is None]
    assert missing == []


def test_process_patches_survive_contexts_closing_out_of_order():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as registry

    stock_rope, stock_sdpa = qwen3.apply_rotary_pos_emb, registry["sdpa"]
    a = LayerFusion(make_tiny_target("qwen3", seed=0))
    b = LayerFusion(make_tiny_target("qwen3_5", seed=0))
    with torch.no_grad():
        ca, cb = a.active(), b.active()
        ca.__enter__()
        cb.__enter__()
        ca.__exit__(None, None, None)
        assert qwen3.apply_rotary_pos_emb is not stock_rope  # b is still open
        cb.__exit__(None, None, None)
    assert qwen3.apply_rotary_pos_emb is stock_rope and registry["sdpa"] is stock_sdpa
    assert "sdpa" not in registry._local_mapping


def test_modules_with_accelerate_hooks_keep_their_forward():
    """accelerate keeps its hook in the instance forward (moving inputs, loading offloaded weights): such a
    module is not swapped."""
    model = make_tiny_target("qwen3", seed=0)
    fusion = LayerFusion(model)
    hooked = fusion.swaps[0][0]
    hook_forward = lambda *a, **k: "hooked"  # noqa: E731
    hooked._hf_hook, hooked.forward = object(), hook_forward
    with torch.no_grad(), fusion.active():
        assert hooked.forward is hook_forward
        assert all(runs_swapped(m, f) for m, f in fusion.swaps[1:])


def test_fusion_of_a_deep_copy_swaps_the_copy():
    target = make_tiny_target("qwen3", seed=0)
    draft = make_tiny_draft(target, seed=0)
    twin = copy.deepcopy(draft)
    originals = {id(m) for m, _ in draft._fusion.swaps}
    assert all(id(m) not in originals for m, _ in twin._fusion.swaps)
    with torch.no_grad(), twin._fusion.active():
        assert all("forward" not in m.__dict__ for m, _ in draft._fusion.swaps)
        assert all(m.forward.forward.args[0] is m for m, _ in twin._fusion.swaps)


def test_gdn_gates_fall_back_to_hf_for_other_projections(gen):
    """A projection that is not a plain Linear (a quantised layer, say) runs as HF runs it."""
    from ddtree_ext.target import _gdn_gates

    gdn = _gdn_layer(torch.float32, gen)
    x = torch.randn(1, 3, gdn.hidden_size, generator=gen)
    fused = _gdn_gates(gdn, x)

    class ScaledLinear(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    doubled = ScaledLinear(gdn.hidden_size, gdn.num_v_heads, bias=False)
    doubled.weight.data = gdn.in_proj_a.weight.data.clone()
    gdn.in_proj_a = doubled
    with torch.no_grad():
        g, beta = _gdn_gates(gdn, x)
    ref_g, _ = reference.gdn_gates(x, 2 * doubled.weight, gdn.in_proj_b.weight, gdn.A_log, gdn.dt_bias)
    assert_close(g, ref_g, torch.float32, "g with the subclass")
    assert not torch.allclose(g, fused[0])
    assert_close(beta, fused[1], torch.float32, "beta (the fused op vs the Linear)")


@pytest.mark.parametrize("n,mask_rows", [(1, 1), (5, 5), (5, 1)])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_gqa_attention_equals_sdpa_over_repeated_kv(n, mask_rows, mask_dtype, gen):
    from ddtree_ext.fused import gqa_attention

    q = torch.randn(2, 6, n, 8, generator=gen)
    k, v = torch.randn(2, 2, 9, 8, generator=gen), torch.randn(2, 2, 9, 8, generator=gen)
    visible = torch.rand(2, 1, mask_rows, 9, generator=gen) > 0.4
    visible[..., 0] = True
    mask = visible if mask_dtype == torch.bool else torch.where(visible, 0.0, float("-inf"))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), attn_mask=mask, scale=0.3
    )
    assert_close(gqa_attention(q, k, v, mask, 0.3), expected, torch.float32, "folded GQA")


def test_fusion_routes_sdpa_through_the_folded_attention_and_restores_the_registry():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as registry

    model = make_tiny_target("qwen3_5", seed=2)
    stock = registry["sdpa"]
    calls = []
    fusion = LayerFusion(model)
    tokens = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    with torch.no_grad():
        stock_logits = model(input_ids=tokens).logits
        with fusion.active():
            folded = registry["sdpa"]
            assert folded.func.__name__ == "_sdpa_attention_forward"
            registry["sdpa"] = lambda *a, **k: calls.append(1) or folded(*a, **k)
            masks = {"full_attention": mask, "linear_attention": None}
            fused_logits = model(input_ids=tokens, attention_mask=masks).logits
            registry["sdpa"] = folded
    assert registry["sdpa"] is stock
    assert len(calls) == sum(t == "full_attention" for t in model.config.get_text_config().layer_types)
    assert_close(fused_logits, stock_logits, torch.float32, "logits through the folded attention")


# ---- stacked projections -----------------------------------------------------------------------------


def _projection_groups(model) -> int:
    """Stacked groups of a tiny target: per attention layer its q, k, v, per layer its MLP's gate, up (a sparse MoE
    block's shared expert's), per sparse MoE block its shared expert's gate and up, router and shared gate."""
    layers = model.model.layers
    return sum(hasattr(layer, "self_attn") for layer in layers) + len(layers) + sum(
        hasattr(layer.mlp, "experts") for layer in layers)


def _count_linear_calls(monkeypatch) -> list:
    calls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: calls.append(1) or linear(*a, **k))
    return calls


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "qwen3_5_moe"])
def test_stack_projections_keeps_the_parameters_and_their_values(family):
    from ddtree_ext import fused

    model = make_tiny_target(family, seed=1)
    params = dict(model.named_parameters())
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    expected = _projection_groups(model)
    assert fused.stack_projections(model) == expected
    assert dict(model.named_parameters()) == params  # the same objects
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    for projections in fused._stack_candidates(model):
        stacked = fused.stacked_weight(projections)
        assert stacked is not None
        assert torch.equal(stacked, torch.cat([p.weight for p in projections]))
    assert fused.stack_projections(model) == expected  # already stacked: left as it is
    assert fused.unstack_projections(model) == expected
    assert all(fused.stacked_weight(p) is None for p in fused._stack_candidates(model))
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert fused.unstack_projections(model) == 0


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_projections_give_the_logits_of_the_projections_apart(family, dtype, monkeypatch):
    """One GEMM per stacked group (counted), and the logits of the model with its projections apart."""
    from ddtree_ext import fused

    model = make_tiny_target(family, seed=1, dtype=dtype)
    n = 9
    tokens = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(2))
    masks = {"full_attention": torch.ones(1, 1, n, n, dtype=torch.bool).tril(), "linear_attention": None}
    calls = _count_linear_calls(monkeypatch)
    fusion = LayerFusion(model)
    with torch.no_grad(), fusion.active():
        apart = model(input_ids=tokens, attention_mask=masks).logits.float()
        gemms_apart = len(calls)
        fused.stack_projections(model)
        calls.clear()
        stacked = model(input_ids=tokens, attention_mask=masks).logits.float()
    saved = sum(2 if hasattr(layer, "self_attn") else 0 for layer in model.model.layers) + len(model.model.layers)
    assert len(calls) == gemms_apart - saved
    assert_close(stacked, apart, dtype, f"{family} stacked logits")
    assert torch.equal(stacked.argmax(-1), apart.argmax(-1))


def test_a_stacked_weight_replaced_or_hooked_ends_the_stacking(monkeypatch):
    """A weight given new storage after stacking, or a hook on a projection: that group's projections run apart
    (and the hook fires), the others stay stacked."""
    from ddtree_ext import fused

    model = make_tiny_target("qwen3", seed=1)
    tokens = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    fusion = LayerFusion(model)
    with torch.no_grad(), fusion.active():
        expected = model(input_ids=tokens).logits
    fused.stack_projections(model)
    layers = model.model.layers
    up = layers[0].mlp.up_proj
    up.weight = torch.nn.Parameter(up.weight.detach().clone())  # new storage
    seen = []
    handle = layers[1].self_attn.k_proj.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    calls = _count_linear_calls(monkeypatch)
    try:
        with torch.no_grad(), fusion.active():
            got = model(input_ids=tokens).logits
    finally:
        handle.remove()
    assert fused.stacked_weight((layers[0].mlp.gate_proj, up)) is None
    assert len(seen) == 1
    # Stacked, a layer runs 4 GEMMs (qkv, o, gate-up, down), the LM head one; apart, the MLP runs 1 more, the
    # attention 2 more.
    assert len(calls) == 4 * len(layers) + 1 + 1 + 2
    assert_close(got, expected, torch.float32, "replaced weight")


def test_unstack_separates_groups_a_hook_or_a_replaced_weight_ended():
    from ddtree_ext import fused

    model = make_tiny_target("qwen3", seed=1)
    fused.stack_projections(model)
    attn0, attn1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    handle = attn0.k_proj.register_forward_hook(lambda m, a, out: None)
    attn1.v_proj.weight = torch.nn.Parameter(attn1.v_proj.weight.detach().clone())
    try:
        assert fused.unstack_projections(model) == 2 * len(model.model.layers)
    finally:
        handle.remove()
    for projections in fused._projection_groups(model):
        storages = {p.weight.untyped_storage().data_ptr() for p in projections}
        assert len(storages) == len(projections)
        assert all(p.weight.untyped_storage().nbytes() == p.weight.numel() * p.weight.element_size()
                   for p in projections if p is not attn1.v_proj)


def test_stacking_under_inference_mode_keeps_trainable_parameters():
    from ddtree_ext import fused

    model = make_tiny_target("qwen3", seed=1)
    with torch.inference_mode():
        fused.stack_projections(model)
    weight = model.model.layers[0].mlp.gate_proj.weight
    assert not weight.is_inference() and weight.requires_grad
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()  # trains as before
    assert weight.grad is not None
    with torch.inference_mode():
        fused.unstack_projections(model)
    assert not weight.is_inference()


def test_global_module_hooks_keep_the_projections_apart():
    """A hook for every module (``register_module_forward_hook``) must see every projection: no group is stacked,
    or run stacked, while one is registered."""
    from ddtree_ext import fused

    model = make_tiny_target("qwen3", seed=1)
    fused.stack_projections(model)
    gate = model.model.layers[0].mlp.gate_proj
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: seen.append(m) if m is gate else None)
    try:
        assert fused.stacked_weight((gate, model.model.layers[0].mlp.up_proj)) is None
        with torch.no_grad(), LayerFusion(model).active():
            model(input_ids=torch.tensor([[1, 2, 3]]))
        assert fused.stack_projections(make_tiny_target("qwen3", seed=1)) == 0
    finally:
        handle.remove()
    assert seen == [gate]


def test_a_stacked_model_saves_and_loads(tmp_path):
    from ddtree_ext import fused

    model = make_tiny_target("qwen3_5", seed=1)
    fused.stack_projections(model)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    expected, got = model.state_dict(), loaded.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def test_stacking_something_else_than_a_module_is_refused():
    from ddtree_ext import fused

    for op in (fused.stack_projections, fused.unstack_projections):
        with pytest.raises(ValueError, match=f"{op.__name__}: model must be a torch.nn.Module, got dict"):
            op({"q_proj": torch.zeros(2, 2)})


def test_projections_with_hooks_or_biases_are_not_stacked():
    from ddtree_ext import fused

    model = make_tiny_target("qwen3", seed=1)
    layers = model.model.layers
    handle = layers[0].mlp.gate_proj.register_forward_pre_hook(lambda m, a: None)
    layers[1].self_attn.q_proj.bias = torch.nn.Parameter(torch.zeros(layers[1].self_attn.q_proj.out_features))
    try:
        assert fused.stack_projections(model) == 2 * len(layers) - 2
    finally:
        handle.remove()
    assert fused.stacked_weight((layers[0].mlp.gate_proj, layers[0].mlp.up_proj)) is None
