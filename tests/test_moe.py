"""moe_experts (a sparse MoE block's routed experts) on the CPU: against the reference, against Hugging Face's own
experts forwards, batch invariance, bad input, registration, and generate() running it for the MoE targets (the CUDA
kernels: tests/test_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import RTOL, assert_close, moe_case
from ddtree_ext import fused, ops, reference

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [  # tokens, top_k, experts, hidden, inter
    (1, 1, 1, 16, 8),
    (1, 8, 32, 64, 16),
    (5, 2, 8, 24, 40),
    (17, 4, 6, 32, 8),
    (65, 8, 64, 16, 8),
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_moe_experts_matches_reference(dtype, shape, gen):
    case = moe_case(*shape, gen, dtype)
    assert_close(ops.moe_experts(*case), reference.moe_experts(*case), dtype, "moe_experts")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_moe_experts_rows_do_not_depend_on_the_batch(dtype, gen):
    """A token's output is the same bits alone, in a batch, and with the batch reordered: a verify block's rows get a
    decode step's bits."""
    x, ids, weights, gate_up, down = moe_case(9, 3, 4, 32, 16, gen, dtype, crowd=True)
    batch = ops.moe_experts(x, ids, weights, gate_up, down)
    for t in range(x.shape[0]):
        alone = ops.moe_experts(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], gate_up, down)
        assert torch.equal(alone, batch[t : t + 1]), f"token {t}"
    order = torch.randperm(x.shape[0], generator=gen)
    assert torch.equal(ops.moe_experts(x[order], ids[order], weights[order], gate_up, down), batch[order])


def test_moe_experts_rounding_points(gen):
    """In bfloat16 the op rounds where HF's grouped_mm forward does: each projection's output, silu(gate), the gated
    product, the weighted expert output, the sum. Checked against the reference, which rounds there too, bit for bit
    on values whose float32 sums are exact (small integers), where no summation order can differ."""
    tokens, top_k, experts, hidden, inter = 4, 2, 3, 8, 8
    x = torch.randint(-2, 3, (tokens, hidden), generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.tensor([[0.375, 0.625]] * tokens, dtype=torch.bfloat16)
    gate_up = torch.randint(-2, 3, (experts, 2 * inter, hidden), generator=gen).to(torch.bfloat16)
    down = torch.randint(-2, 3, (experts, hidden, inter), generator=gen).to(torch.bfloat16) / 16
    got = ops.moe_experts(x, ids, weights, gate_up, down)
    assert torch.equal(got, reference.moe_experts(x, ids, weights, gate_up, down))
    unrounded = reference.moe_experts(x.float(), ids, weights.float(), gate_up.float(), down.float())
    assert not torch.equal(got.float(), unrounded), "the case must exercise a rounding"


def hf_experts(dtype, experts_implementation, gen, hidden=32, inter=16, experts=8, top_k=2):
    """HF's Qwen3_5MoeExperts from a tiny config, with random weights."""
    modeling = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    from ddtree_ext.tiny import tiny_qwen3_5_moe_config

    config = tiny_qwen3_5_moe_config(num_experts=experts, num_experts_per_tok=top_k, hidden_size=hidden,
                                     moe_intermediate_size=inter, experts_implementation=experts_implementation)
    module = modeling.Qwen3_5MoeExperts(config)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=gen) / hidden ** 0.5)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=gen) / inter ** 0.5)
    return module.to(dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_moe_experts_matches_hf_experts_forward(implementation, dtype, gen):
    """The op computes what HF's experts forwards compute, with their rounding points: in float32 every
    implementation up to the order of the float32 sums; in 16 bits grouped_mm and batched_mm, whose rounding points the
    op has, up to a rounding flipped by the sum order here and there (under 5 % of the outputs), while HF's eager loop
    rounds its running sum after each expert and differs in most outputs: the op does not stand in for it there
    (experts_op_applies)."""
    module = hf_experts(dtype, implementation, gen, hidden=256, inter=128, experts=16, top_k=8)
    if module.config._experts_implementation != implementation:
        pytest.skip(f"this transformers has no {implementation!r} experts implementation")
    x, ids, weights, _, _ = moe_case(9, 8, module.num_experts, module.hidden_dim, module.intermediate_dim, gen, dtype)
    with torch.no_grad():
        expected = module(x, ids, weights)
    got = ops.moe_experts(x, ids, weights, module.gate_up_proj, module.down_proj)
    mismatched = (got != expected).float().mean().item()
    stands_in = dtype == torch.float32 or implementation != "eager"
    assert fused.experts_op_applies(module) == stands_in
    if stands_in:
        assert_close(got, expected, dtype)
        assert dtype == torch.float32 or mismatched < 0.05, mismatched
    else:
        assert mismatched > 0.2, mismatched  # why it does not stand in: other rounding points


def test_moe_experts_out_and_empty_batch(gen):
    x, ids, weights, gate_up, down = moe_case(3, 2, 4, 16, 8, gen)
    out = torch.full((3, 16), float("nan"))
    assert ops.moe_experts(x, ids, weights, gate_up, down, out=out) is out
    assert_close(out, reference.moe_experts(x, ids, weights, gate_up, down), torch.float32)
    empty = ops.moe_experts(x[:0], ids[:0], weights[:0], gate_up, down)
    assert empty.shape == (0, 16)


def bad_cases(gen):
    x, ids, weights, gate_up, down = moe_case(3, 2, 4, 16, 8, gen)

    def with_id(t, k, value):
        changed = ids.clone()
        changed[t, k] = value
        return changed

    return [
        (r"x must have shape \[T, H\]", dict(x=x[None])),
        ("x must be float32, float16 or bfloat16", dict(x=x.double())),
        ("expert_ids must have dtype Long", dict(expert_ids=ids.int())),
        (r"expert_ids must have shape \[T, K\] = \[3, K\]", dict(expert_ids=ids[:2])),
        (r"expert_ids\[1, 0\] must be an expert in \[0, 4\), got 4", dict(expert_ids=with_id(1, 0, 4))),
        (r"expert_ids\[2, 1\] must be an expert in \[0, 4\), got -1", dict(expert_ids=with_id(2, 1, -1))),
        ("expert_weights must have dtype BFloat16",
         dict(x=x.bfloat16(), gate_up_proj=gate_up.bfloat16(), down_proj=down.bfloat16())),
        (r"expert_weights must have shape \[3, 2\]", dict(expert_weights=weights[:, :1])),
        (r"gate_up_proj must have shape \[E, 2 I, H\] = \[E, 2 I, 16\]", dict(gate_up_proj=gate_up[..., :8])),
        (r"gate_up_proj must have shape \[E, 2 I, H\]", dict(gate_up_proj=gate_up[:, :15])),
        ("gate_up_proj must have dtype Float, got Half", dict(gate_up_proj=gate_up.half())),
        ("gate_up_proj must be contiguous", dict(gate_up_proj=gate_up.transpose(1, 2).contiguous().transpose(1, 2))),
        (r"down_proj must have shape \[4, 16, 8\]", dict(down_proj=down[:3])),
        (r"down_proj must have shape \[4, 16, 8\]", dict(down_proj=down.transpose(1, 2).contiguous())),
        ("x must be contiguous", dict(x=torch.randn(16, 3).t())),
        (r"out must have shape \[3, 16\]", dict(out=torch.full((3, 15), 7.0))),
        ("out must not share memory with x", dict(out="x")),  # the test's own x
    ]


@pytest.mark.parametrize("case", range(17))
def test_moe_experts_bad_input_names_the_argument(case, gen):
    message, changes = bad_cases(gen)[case]
    x, ids, weights, gate_up, down = moe_case(3, 2, 4, 16, 8, gen)
    args = dict(x=x, expert_ids=ids, expert_weights=weights, gate_up_proj=gate_up, down_proj=down, out=None)
    args.update(changes)
    if isinstance(args["out"], str):
        args["out"] = args[args["out"]]
    before = args["out"].clone() if args["out"] is not None else None
    with pytest.raises(ValueError, match=message):
        ops.moe_experts(args["x"], args["expert_ids"], args["expert_weights"], args["gate_up_proj"], args["down_proj"],
                        out=args["out"])
    if before is not None:
        assert torch.equal(args["out"], before), "a refused call wrote its output"


def test_moe_experts_bad_input_cases_are_all_run(gen):
    assert len(bad_cases(gen)) == 17


def test_moe_experts_opcheck(gen):
    x, ids, weights, gate_up, down = moe_case(3, 2, 4, 16, 8, gen)
    routing = torch.empty(ops.moe_routing_size(4, 6), dtype=torch.int32)
    torch.library.opcheck(torch.ops.ddtree.moe_experts.default,
                          (x, ids, weights, gate_up, down, routing, torch.empty(6, 8), torch.empty(6, 16),
                           torch.empty(3, 16)))


# ---- in generate() --------------------------------------------------------------------------------------------


def moe_target_and_draft(seed=3, **kw):
    pytest.importorskip("transformers.models.qwen3_5_moe")
    from ddtree_ext.tiny import make_tiny_draft, make_tiny_target

    target = make_tiny_target("qwen3_5_moe", seed=seed, **kw)
    return target, make_tiny_draft(target, seed=1)


@pytest.mark.parametrize("op_on,devices", [(True, ("cpu", "cuda")), (False, ("cpu", "cuda")), (True, ("cuda",))])
def test_generate_runs_the_op_for_moe_targets(op_on, devices, monkeypatch):
    """generate() runs the routed experts through ops.moe_experts (every MoE layer, every round) on the devices of
    fused.MOE_OP_DEVICES (by default CUDA only: here the CPU is added), HF's experts forward with fused.moe_experts_op
    off or elsewhere; all give HF's greedy output, for all three methods."""
    from ddtree_ext import generate, tiny

    monkeypatch.setattr(fused, "MOE_OP_DEVICES", devices)
    op_on_here = op_on and "cpu" in devices

    target, draft = moe_target_and_draft()
    ids = torch.randint(0, target.config.get_text_config().vocab_size, (1, 31), generator=torch.Generator().manual_seed(5))
    ref = tiny.hf_greedy(target, ids, 24)
    calls = []
    stock = ops.moe_experts
    monkeypatch.setattr(ops, "moe_experts", lambda *a, **k: calls.append(a[0].shape[0]) or stock(*a, **k))
    monkeypatch.setattr(fused, "moe_experts_op", op_on)
    layers = sum(hasattr(layer.mlp, "experts") for layer in target.model.layers)
    for method in ("ddtree", "dflash", "autoregressive"):
        calls.clear()
        out, stats = generate(target, draft, ids, 24, method=method, return_stats=True)
        assert torch.equal(out, ref), method
        if op_on_here:
            assert len(calls) >= layers * stats.rounds, (method, len(calls))
        else:
            assert not calls


def test_experts_op_applies_only_to_hf_layout(monkeypatch):
    """The op stands in for HF's experts forward only where it computes the same thing: not with a hook on the
    module, another activation, a transposed or biased layout, or the switch off."""
    target, _ = moe_target_and_draft()
    experts = target.model.layers[0].mlp.experts
    assert fused.experts_op_applies(experts)
    handle = experts.register_forward_hook(lambda *a: None)
    assert not fused.experts_op_applies(experts)
    handle.remove()
    monkeypatch.setattr(experts, "is_transposed", True)
    assert not fused.experts_op_applies(experts)
    monkeypatch.undo()
    silu, experts.act_fn = experts.act_fn, torch.nn.GELU()  # a submodule: monkeypatch would delete it on undo
    try:
        assert not fused.experts_op_applies(experts)
    finally:
        experts.act_fn = silu
    assert fused.experts_op_applies(experts)
    monkeypatch.setattr(fused, "moe_experts_op", False)
    assert not fused.experts_op_applies(experts)


def test_long_prefills_run_hf_experts(monkeypatch):
    """Past fused.MOE_OP_MAX_TOKENS rows (a long prompt's prefill) HF's experts forward runs, not the op (its tiled
    grouped GEMMs are faster there); every round still runs the op, and the output is HF's."""
    from ddtree_ext import generate, tiny

    assert fused.MOE_OP_MAX_TOKENS >= 257, "every round of the largest tree (budget 256 + the root) runs the op"
    target, draft = moe_target_and_draft()
    ids = torch.randint(0, target.config.get_text_config().vocab_size, (1, 31), generator=torch.Generator().manual_seed(6))
    calls = []
    stock = ops.moe_experts
    monkeypatch.setattr(ops, "moe_experts", lambda *a, **k: calls.append(a[0].shape[0]) or stock(*a, **k))
    monkeypatch.setattr(fused, "MOE_OP_MAX_TOKENS", 17)
    monkeypatch.setattr(fused, "MOE_OP_DEVICES", ("cpu", "cuda"))
    out = generate(target, draft, ids, 12, method="dflash")
    assert torch.equal(out, tiny.hf_greedy(target, ids, 12))
    assert calls and max(calls) <= 17


def test_fallback_inside_a_capture_is_refused_with_the_reason(monkeypatch, gen):
    """Where the op does not take a call (here: more rows than fused.MOE_OP_MAX_TOKENS) and HF's experts forward reads
    the device from the host, a call inside a CUDA graph capture is refused naming why, instead of failing the capture
    (a capture stood in for by torch.cuda's own query; no GPU needed). Outside a capture HF's forward runs."""
    target, _ = moe_target_and_draft()
    experts = target.model.layers[0].mlp.experts
    x, ids, weights, _, _ = moe_case(3, 2, experts.num_experts, experts.hidden_dim, experts.intermediate_dim, gen)
    monkeypatch.setattr(fused, "MOE_OP_MAX_TOKENS", 2)
    with torch.no_grad():
        expected = type(experts).forward(experts, x, ids, weights)
        assert torch.equal(fused._experts_forward(experts, x, ids, weights), expected)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with pytest.raises(RuntimeError, match=r"inside a CUDA graph capture.*rows \[3, 64\], at most 2.*reads the "
                                               r"device from the host"):
            fused._experts_forward(experts, x, ids, weights)
