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


@pytest.mark.parametrize("folded", [False, True])
def test_moe_experts_opcheck(folded, gen):
    x, ids, weights, gate_up, down = moe_case(3, 2, 4, 16, 8, gen)
    routing = torch.empty(ops.moe_routing_size(4, 6), dtype=torch.int32)
    shared = (torch.randn(3, 16, generator=gen), torch.randn(3, 1, generator=gen)) if folded else (None, None)
    torch.library.opcheck(torch.ops.ddtree.moe_experts.default,
                          (x, ids, weights, gate_up, down, *shared, routing, torch.empty(6, 8), torch.empty(6, 16),
                           torch.empty(3, 16)))


# ---- the shared expert, folded into the combine -------------------------------------------------------------


def shared_case(tokens, hidden, gen, dtype, gate_stride=1):
    """The shared expert's output [T, H] and its gate's logits [T, 1] (every ``gate_stride``-th of a wider row, as a
    slice of a stacked projection's output)."""
    shared = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate = (2 * torch.randn(tokens, gate_stride, generator=gen)).to(dtype)[:, :1]
    return shared, gate


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("gated", [True, False])
def test_moe_experts_with_shared_expert_matches_reference(dtype, gated, gen):
    case = moe_case(9, 3, 8, 32, 16, gen, dtype)
    shared, gate = shared_case(9, 32, gen, dtype, gate_stride=5)
    gate = gate if gated else None
    got = ops.moe_experts(*case, shared=shared, shared_gate=gate)
    assert_close(got, reference.moe_experts(*case, shared, gate), dtype, "moe_experts with the shared expert")
    # The fold rounds where HF's block does: the routed sum first, then the gated shared rows, then their sum. Bit for
    # bit on gates whose sigmoid is exact in float32 (0.5 and 1; torch's vectorised CPU sigmoid rounds otherwise
    # apart from the op's expf here and there; tests/test_cuda.py checks torch's CUDA sigmoid's bits).
    if gate is not None:
        gate = torch.where(torch.arange(9)[:, None] % 2 == 0, 0.0, 40.0).to(dtype)
        got = ops.moe_experts(*case, shared=shared, shared_gate=gate)
    routed = ops.moe_experts(*case)
    scale = 1.0 if gate is None else torch.where(gate == 0, 0.5, 1.0)
    assert torch.equal(got, (routed.float() + (scale * shared.float()).to(dtype).float()).to(dtype))


def test_moe_experts_shared_bad_input(gen):
    case = moe_case(3, 2, 4, 16, 8, gen)
    shared, gate = shared_case(3, 16, gen, torch.float32)
    cases = [
        ("shared must have shape \\[3, 16\\]", dict(shared=shared[:, :8])),
        ("shared must have dtype Float", dict(shared=shared.half())),
        ("shared must be contiguous", dict(shared=torch.randn(16, 3).t())),
        ("shared_gate needs shared", dict(shared=None)),
        ("shared_gate must have shape \\[3, 1\\]", dict(shared_gate=gate.expand(3, 2))),
        ("shared_gate must have dtype Float", dict(shared_gate=gate.double())),
    ]
    for message, change in cases:
        args = dict(shared=shared, shared_gate=gate, **{})
        args.update(change)
        out = torch.full((3, 16), 7.0)
        with pytest.raises(ValueError, match=message):
            ops.moe_experts(*case, **args, out=out)
        assert torch.equal(out, torch.full((3, 16), 7.0)), "a refused call wrote its output"
    with pytest.raises(ValueError, match="out must not share memory with shared"):
        ops.moe_experts(*case, shared=shared, out=shared)


# ---- moe_router ---------------------------------------------------------------------------------------------


def router_logits(tokens, experts, gen, dtype, spread=2.0):
    return (spread * torch.randn(tokens, experts, generator=gen)).to(dtype)


def assert_same_choice(weights, ids, ref_weights, ref_ids, probs, what=""):
    """The same weights bit for bit and the same experts, up to the order (and, at the k-th place, the choice) among
    experts of exactly equal probability: the probabilities at each pick agree."""
    assert torch.equal(weights, ref_weights), f"{what}: weights"
    assert torch.equal(probs.gather(1, ids), probs.gather(1, ref_ids)), f"{what}: the picked probabilities"
    untied = (probs.gather(1, ref_ids)[:, None, :] == probs.gather(1, ref_ids)[:, :, None]).sum((1, 2)) == ids.shape[1]
    assert torch.equal(ids[untied], ref_ids[untied]), f"{what}: ids of rows without ties"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("experts,top_k", [(1, 1), (8, 2), (40, 3), (256, 8), (1000, 32), (64, 64)])
def test_moe_router_matches_reference(dtype, experts, top_k, gen):
    logits = router_logits(33, experts, gen, dtype)
    weights, ids = ops.moe_router(logits, top_k)
    assert weights.dtype == dtype and ids.dtype == torch.int64 and weights.shape == ids.shape == (33, top_k)
    probs = torch.softmax(logits.float(), dim=-1)
    ref_weights, ref_ids = reference.moe_router(logits, top_k)
    # The CPU softmax sums in another order than torch's CPU softmax: float32 roundings apart.
    assert_close(weights, ref_weights, dtype, "moe_router weights")
    assert torch.equal(probs.gather(1, ids).sort(1, descending=True).values, probs.gather(1, ids)), "highest first"
    assert torch.equal(probs.gather(1, ids), probs.gather(1, ref_ids)), "the picked probabilities"
    if dtype == torch.float32:
        assert torch.equal(ids, ref_ids)  # no ties among float32 logits of random values


def test_moe_router_ties_go_to_the_lower_id():
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    weights, ids = ops.moe_router(logits, 2)
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert torch.equal(weights, torch.full((2, 2), 0.5))


def test_moe_router_nan_and_inf_logits():
    """A NaN logit makes the row's softmax NaN, as torch's: every expert ties, the lowest ids win, the weights are NaN.
    A logit of -inf gets probability 0: picked last."""
    logits = torch.tensor([[0.0, float("nan"), 1.0, 0.5], [0.0, float("-inf"), 1.0, 0.5]])
    weights, ids = ops.moe_router(logits, 4)
    assert ids[0].tolist() == [0, 1, 2, 3] and weights[0].isnan().all()
    assert ids[1].tolist() == [2, 3, 0, 1] and weights[1, 3] == 0


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_moe_router_without_renormalisation(dtype, gen):
    logits = router_logits(7, 24, gen, dtype)
    weights, ids = ops.moe_router(logits, 4, renormalize=False)
    probs = torch.softmax(logits.float(), dim=-1)
    assert_close(weights, probs.gather(1, ids).to(dtype), dtype)
    assert torch.equal(ids, ops.moe_router(logits, 4)[1])


def test_moe_router_rows_do_not_depend_on_the_batch_and_take_a_row_stride(gen):
    wide = router_logits(12, 70, gen, torch.bfloat16)
    logits = wide[:, 3:67]  # rows one stride of 70 apart
    weights, ids = ops.moe_router(logits, 6)
    contiguous = ops.moe_router(logits.contiguous(), 6)
    assert torch.equal(weights, contiguous[0]) and torch.equal(ids, contiguous[1])
    for t in range(12):
        alone = ops.moe_router(logits[t : t + 1], 6)
        assert torch.equal(alone[0], weights[t : t + 1]) and torch.equal(alone[1], ids[t : t + 1]), t


def test_moe_router_matches_hf_router(gen):
    """HF's Qwen3_5MoeTopKRouter (its projection, then softmax, top-k, renormalisation) against the projection and
    the op: the same experts and weights, up to float32 roundings of the softmax's sum (here none flips a bfloat16
    weight) and the order among tied probabilities."""
    modeling = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    from ddtree_ext.tiny import tiny_qwen3_5_moe_config

    config = tiny_qwen3_5_moe_config(num_experts=64, num_experts_per_tok=8, hidden_size=32)
    router = modeling.Qwen3_5MoeTopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    router = router.to(torch.bfloat16)
    x = torch.randn(40, 32, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(x)
    weights, ids = ops.moe_router(logits, 8)
    assert_close(weights, hf_weights, torch.bfloat16)
    probs = torch.softmax(logits.float(), dim=-1)
    assert torch.equal(probs.gather(1, ids), probs.gather(1, hf_ids))


def test_moe_router_out_and_empty_batch(gen):
    logits = router_logits(3, 16, gen, torch.float32)
    weights, ids = torch.full((3, 4), float("nan")), torch.full((3, 4), -1)
    got = ops.moe_router(logits, 4, weights=weights, ids=ids)
    assert got[0] is weights and got[1] is ids
    assert torch.equal(ids, ops.moe_router(logits, 4)[1])
    empty = ops.moe_router(logits[:0], 4)
    assert empty[0].shape == empty[1].shape == (0, 4)


ROUTER_BAD = [
    (r"logits must have shape \[T, E\]", dict(logits="1d")),
    (r"logits must have shape \[\.\.\., D\] with D >= 1", dict(logits="empty")),
    ("logits must be float32, float16 or bfloat16", dict(logits="double")),
    ("logits must be contiguous in its last dim", dict(logits="transposed")),
    (r"top_k must be an int in \[1, 16\], got 0", dict(top_k=0)),
    (r"top_k must be an int in \[1, 16\], got 17", dict(top_k=17)),
    ("weights must have dtype Float", dict(weights=torch.empty(3, 4, dtype=torch.half))),
    (r"weights must have shape \[3, 4\]", dict(weights=torch.empty(3, 5))),
    ("ids must have dtype Long", dict(ids=torch.empty(3, 4, dtype=torch.int32))),
    (r"ids must have shape \[3, 4\]", dict(ids=torch.empty(4, 4, dtype=torch.int64))),
]


@pytest.mark.parametrize("case", range(len(ROUTER_BAD)))
def test_moe_router_bad_input_names_the_argument(case, gen):
    message, change = ROUTER_BAD[case]
    logits = router_logits(3, 16, gen, torch.float32)
    args = dict(logits=logits, top_k=4, weights=None, ids=None)
    args.update(change)
    args["logits"] = {"1d": logits[0], "empty": logits[:, :0], "double": logits.double(),
                      "transposed": torch.randn(16, 3).t()}.get(args["logits"], args["logits"]) \
        if isinstance(args["logits"], str) else args["logits"]
    with pytest.raises(ValueError, match=message):
        ops.moe_router(args["logits"], args["top_k"], weights=args["weights"], ids=args["ids"])


def test_moe_router_outputs_must_not_overlap(gen):
    logits = router_logits(3, 16, gen, torch.float32)
    with pytest.raises(ValueError, match="weights must not share memory with logits"):
        ops.moe_router(logits, 4, weights=logits[:, :4].contiguous().set_(logits.untyped_storage(), 0, (3, 4)))


def test_moe_router_opcheck(gen):
    logits = router_logits(5, 16, gen, torch.bfloat16)
    outputs = (torch.empty(5, 3, dtype=torch.bfloat16), torch.empty(5, 3, dtype=torch.int64))
    torch.library.opcheck(torch.ops.ddtree.moe_router.default, (logits, 3, True, *outputs))


# ---- in generate() --------------------------------------------------------------------------------------------


def moe_target_and_draft(seed=3, **kw):
    pytest.importorskip("transformers.models.qwen3_5_moe")
    from ddtree_ext.tiny import make_tiny_draft, make_tiny_target

    target = make_tiny_target("qwen3_5_moe", seed=seed, **kw)
    return target, make_tiny_draft(target, seed=1)


@pytest.mark.parametrize("op_on,devices,stacked", [(True, ("cpu", "cuda"), False), (True, ("cpu", "cuda"), True),
                                                   (False, ("cpu", "cuda"), False), (True, ("cuda",), False)])
def test_generate_runs_the_op_for_moe_targets(op_on, devices, stacked, monkeypatch):
    """generate() runs the MoE blocks fused (ops.moe_router, then ops.moe_experts with the shared expert folded in:
    every MoE layer, every round) on the devices of fused.MOE_OP_DEVICES (by default CUDA only: here the CPU is
    added), HF's block and experts forwards with fused.moe_experts_op off or elsewhere; all give HF's greedy output,
    for all three methods, also with the projections stacked (stack_projections)."""
    from ddtree_ext import generate, stack_projections, tiny

    monkeypatch.setattr(fused, "MOE_OP_DEVICES", devices)
    op_on_here = op_on and "cpu" in devices

    target, draft = moe_target_and_draft()
    ids = torch.randint(0, target.config.get_text_config().vocab_size, (1, 31), generator=torch.Generator().manual_seed(5))
    ref = tiny.hf_greedy(target, ids, 24)
    if stacked:
        stack_projections(target)
    calls, routes = [], []
    stock, stock_router = ops.moe_experts, ops.moe_router
    monkeypatch.setattr(ops, "moe_experts",
                        lambda *a, **k: calls.append(k.get("shared_gate") is not None) or stock(*a, **k))
    monkeypatch.setattr(ops, "moe_router", lambda *a, **k: routes.append(a[0].shape[0]) or stock_router(*a, **k))
    monkeypatch.setattr(fused, "moe_experts_op", op_on)
    layers = sum(hasattr(layer.mlp, "experts") for layer in target.model.layers)
    for method in ("ddtree", "dflash", "autoregressive"):
        calls.clear()
        routes.clear()
        out, stats = generate(target, draft, ids, 24, method=method, return_stats=True)
        assert torch.equal(out, ref), method
        if op_on_here:
            # The whole block fused: the router op, and the shared expert folded into the experts op's combine.
            assert len(calls) >= layers * stats.rounds and all(calls), (method, len(calls))
            assert len(routes) == len(calls)
        else:
            assert not calls and not routes


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_block_fused_forward_matches_hf(dtype, stacked, monkeypatch, gen):
    """A sparse MoE block's fused forward (router op, experts op with the shared expert folded in; stacked: the
    shared expert's gate and up, the router and the shared gate as one GEMM, counted) against HF's own block forward
    with its experts forward: float32 up to the sums' order; bfloat16 up to a rounding flipped by it here and there."""
    monkeypatch.setattr(fused, "MOE_OP_DEVICES", ("cpu", "cuda"))
    target, _ = moe_target_and_draft()
    block = target.model.layers[0].mlp.to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    if stacked:
        assert fused.stack_projections(block) == 2  # the block's group, and its shared expert's within it
        mlp = block.shared_expert
        group = (mlp.gate_proj, mlp.up_proj, block.gate, block.shared_expert_gate)
        rows = sum(p.weight.shape[0] for p in group)  # 2 x 32 + 8 + 1: odd
        assert fused.stacked_weight(group).shape[0] == rows
        padded = fused.stacked_weight(group, padded=True)  # zero rows up to 16 bytes of outputs
        assert padded.shape[0] % (16 // padded.element_size()) == 0 and not padded[rows:].any()
    x = torch.randn(2, 9, block.experts.hidden_dim, generator=gen).to(dtype)
    gemms = []
    linear = torch.nn.functional.linear
    with torch.no_grad():
        assert fused._moe_block_fusable(block, x.view(-1, x.shape[-1]))
        expected = type(block).forward(block, x)
        monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: gemms.append(1) or linear(*a, **k))
        with fused.LayerFusion(block).active():
            got = fused._moe_block_forward(block, x)
    assert len(gemms) == (2 if stacked else 5)  # stacked: the four projections of x, then the shared down projection
    assert got.shape == expected.shape
    if dtype == torch.float32:
        assert_close(got, expected, dtype)
    else:
        assert (got != expected).float().mean() < 0.05


def test_stacked_moe_group_pads_its_gemm_past_one_row(monkeypatch, gen):
    """The stacked MoE group's GEMM runs over the padding rows for two or more rows (cuBLAS's full algorithm list at
    an aligned width) and over the group's own rows for one (where cuBLAS's one-row kernel was faster); each output
    is its projection's either way."""
    monkeypatch.setattr(fused, "MOE_OP_DEVICES", ("cpu", "cuda"))
    target, _ = moe_target_and_draft()
    block = target.model.layers[0].mlp
    fused.stack_projections(block)
    mlp = block.shared_expert
    group = (mlp.gate_proj, mlp.up_proj, block.gate, block.shared_expert_gate)
    rows = sum(p.weight.shape[0] for p in group)
    padded = fused.stacked_weight(group, padded=True).shape[0]
    assert padded > rows  # the tiny block's group has an odd width
    widths = []
    stock = fused.project
    monkeypatch.setattr(fused, "project", lambda w, x: widths.append(w.shape[0]) or stock(w, x))
    with torch.no_grad():
        for shape, width in (((1, 1), rows), ((1,), rows), ((2,), padded), ((5,), padded), ((1, 2), padded),
                             ((2, 1), padded)):
            x = torch.randn(*shape, block.experts.hidden_dim, generator=gen)
            tokens = shape
            widths.clear()
            outs = fused.stacked_outputs(group, x)
            assert widths == [width], tokens
            for p, out in zip(group, outs):  # up to the sums' order (a GEMM of another width)
                assert_close(out, torch.nn.functional.linear(x, p.weight), torch.float32)


def test_moe_block_runs_hf_body_where_the_fusion_does_not_apply(monkeypatch, gen):
    """A hooked router (a hook of the user's; HF's output recorder while a call collects router logits), a shared
    gate with a bias, the experts op not applying (off, or past its rows): the block runs HF's own body."""
    monkeypatch.setattr(fused, "MOE_OP_DEVICES", ("cpu", "cuda"))
    target, _ = moe_target_and_draft()
    block = target.model.layers[0].mlp
    x = torch.randn(5, block.experts.hidden_dim, generator=gen)
    with torch.no_grad():
        assert fused._moe_block_fusable(block, x)
        handle = block.gate.register_forward_hook(lambda *a: None)
        assert not fused._moe_block_fusable(block, x)
        handle.remove()
        block.shared_expert_gate.bias = torch.nn.Parameter(torch.zeros(1))
        assert not fused._moe_block_fusable(block, x)
        block.shared_expert_gate.bias = None
        monkeypatch.setattr(fused, "MOE_OP_MAX_TOKENS", 4)
        assert not fused._moe_block_fusable(block, x)
        monkeypatch.setattr(fused, "MOE_OP_MAX_TOKENS", 1024)
        monkeypatch.setattr(fused, "moe_experts_op", False)
        assert not fused._moe_block_fusable(block, x)
        calls = []
        monkeypatch.setattr(ops, "moe_router", lambda *a, **k: calls.append(1))
        assert torch.equal(fused._moe_block_forward(block, x[None]), type(block).forward(block, x[None]))
        assert not calls


def test_moe_block_stays_fused_after_hf_installs_its_output_recorders(monkeypatch, gen):
    """transformers hooks every router for good the first time a call asks for router logits (its output recorder).
    Calls that do not collect them still run the block fused (generate() after such a call: the router op runs, and
    the output is HF's greedy one); a call that collects them runs HF's body, so the router runs and its logits are
    returned, as without the fusion."""
    from transformers.utils import output_capturing

    from ddtree_ext import generate, tiny

    monkeypatch.setattr(fused, "MOE_OP_DEVICES", ("cpu", "cuda"))
    target, draft = moe_target_and_draft()
    ids = torch.randint(0, target.config.get_text_config().vocab_size, (1, 19), generator=gen)
    with torch.no_grad():
        plain = target(ids, output_router_logits=True).router_logits
    block = target.model.layers[0].mlp
    assert len(block.gate._forward_hooks) == 1  # HF's recorder, kept after the call
    layers = sum(hasattr(layer.mlp, "experts") for layer in target.model.layers)
    assert len(plain) == layers

    x = torch.randn(5, block.experts.hidden_dim, generator=gen)
    with torch.no_grad():
        for collecting, fusable in ((None, True), ({}, True), ({"hidden_states": []}, True),
                                    ({"router_logits": []}, False)):
            token = output_capturing._active_collector.set(collecting)
            try:
                assert fused._moe_block_fusable(block, x) == fusable, collecting
            finally:
                output_capturing._active_collector.reset(token)
        other = block.gate.register_forward_hook(lambda *a: None)  # any other hook still keeps HF's body
        assert not fused._moe_block_fusable(block, x)
        other.remove()

    with torch.no_grad(), fused.LayerFusion(target).active():
        fused_call = target(ids, output_router_logits=True).router_logits
    assert len(fused_call) == layers
    for got, expected in zip(fused_call, plain):  # the fused layers' float32 sums run in other orders
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-4)

    ref = tiny.hf_greedy(target, ids, 12)
    routes = []
    stock_router = ops.moe_router
    monkeypatch.setattr(ops, "moe_router", lambda *a, **k: routes.append(1) or stock_router(*a, **k))
    assert torch.equal(generate(target, draft, ids, 12), ref)
    assert len(routes) >= layers


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
