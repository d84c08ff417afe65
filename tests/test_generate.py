"""generate(): exact end to end on tiny random targets of every family (Qwen3, Qwen3.5, Qwen3.5 MoE), with the
compiled CPU ops.

Greedy output must equal the target's own ``model.generate(do_sample=False)`` token for token over long
generations, for every method and budget; per round the tree must accept at least what the draft's chain
accepts on the same state, and agreeing drafts must get deep and off-spine paths accepted (counted here
from the draft's own ranks, independently of generate()). Sampling must be reproducible, identical across
methods for one seed (the uniform of a position is shared), and follow the exact target distribution.
"""

from __future__ import annotations

import copy
import functools
import math
import threading
from collections import Counter

import numpy as np
import pytest
import torch

from conftest import vllm_penalties, warped_probs
from ddtree_ext import generate, stack_projections, tiny
from ddtree_ext.generate import MAX_TREE_BUDGET, GenerationStats
from ddtree_ext.target import TargetAdapter
from ddtree_ext.tiny import (
    make_agreeing_draft,
    make_predictable_target,
    make_tiny_draft,
    make_tiny_target,
    target_taps,
)

LIN, FULL = "linear_attention", "full_attention"
TARGETS = {
    "qwen3": dict(family="qwen3"),
    "qwen3_5-lllf-gva3": dict(family="qwen3_5", layer_types=(LIN, LIN, LIN, FULL), value_heads_per_key_head=3),
    "qwen3_5-lflf-gva1": dict(family="qwen3_5", layer_types=(LIN, FULL, LIN, FULL), value_heads_per_key_head=1),
    # Qwen3.6-35B-A3B's family: the hybrid's layers with sparse MoE MLPs (8 experts, 2 a token, a shared expert)
    "qwen3_5_moe-lllf-gva3": dict(family="qwen3_5_moe", layer_types=(LIN, LIN, LIN, FULL), value_heads_per_key_head=3),
}
HYBRID = "qwen3_5-lllf-gva3"
BUDGETS = (1, 4, 16, 64, MAX_TREE_BUDGET)
LONG = 500  # new tokens of the long greedy generations: state carries over hundreds of rounds
PROMPT_LEN = 12
# Two kinds of pairs. "random": a random target (chaotic greedy output, vocabulary 256) and a random
# draft, which accepts almost nothing. "agreeing": a predictable target (vocabulary 64) and a draft
# trained on its greedy continuations, which gets deep and off-spine paths accepted.
RANDOM, AGREEING = "random", "agreeing"


# ---- models, prompts and reference outputs (built once per session) ---------------------------


@functools.lru_cache(maxsize=None)
def pair(kind: str, name: str):
    """(target, draft) of ``kind`` for the target configuration ``name``."""
    kw = dict(TARGETS[name])
    family = kw.pop("family")
    if family == "qwen3_5_moe":
        pytest.importorskip("transformers.models.qwen3_5_moe")
    if kind == AGREEING:
        target = make_predictable_target(family, seed=3, **kw)
        return target, make_agreeing_draft(target, seed=1)
    target = make_tiny_target(family, seed=3, **kw)
    return target, make_tiny_draft(target, seed=1)


def prompt(seed: int, vocab: int, length: int = PROMPT_LEN) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def pair_prompt(kind: str, name: str, seed: int) -> torch.Tensor:
    return prompt(seed, pair(kind, name)[0].config.vocab_size)


@functools.lru_cache(maxsize=None)
def hf_greedy(kind: str, name: str, prompt_seed: int, new_tokens: int) -> torch.Tensor:
    """The target's own greedy output (stock HF generate, no EOS), cached per pair and prompt."""
    return tiny.hf_greedy(pair(kind, name)[0], pair_prompt(kind, name, prompt_seed), new_tokens)


@pytest.fixture
def launch_ahead(monkeypatch):
    """Rounds launched before the round ahead of them is read, as on a GPU (on the CPU a round runs as it is
    launched, so generate() does not launch ahead there): the same bookkeeping, tested here."""
    from ddtree_ext import round as round_module

    init = round_module.DecodeRound.__init__

    def init_launching_ahead(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.launch_ahead = True

    monkeypatch.setattr(round_module.DecodeRound, "__init__", init_launching_ahead)


def assert_same_tokens(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == torch.int64 and out.shape == ref.shape, (out.dtype, tuple(out.shape), tuple(ref.shape))
    diff = (out != ref)[0].nonzero()
    assert diff.numel() == 0, f"first mismatch at position {int(diff[0])} of {out.shape[1]}"


def round_starts(stats: GenerationStats) -> list:
    """Prefix length at the start of every round (the root's position)."""
    starts, p = [], stats.prompt_tokens
    for n in stats.accept_lengths:
        starts.append(p)
        p += n
    return starts


# ---- greedy: exactly the target's output -------------------------------------------------------

CASES = [("autoregressive", None), ("dflash", None)] + [("ddtree", b) for b in BUDGETS]
CASE_IDS = [m if b is None else f"{m}-{b}" for m, b in CASES]
SWEEP_PROMPT = 100  # one prompt per target for the method x budget sweep: one HF reference each


def run_greedy(kind, name, method, budget, prompt_seed, new_tokens):
    """generate() greedily on a pair; asserts the output is the target's own, returns the stats."""
    target, draft = pair(kind, name)
    out, stats = generate(
        target, draft, pair_prompt(kind, name, prompt_seed), new_tokens, method=method, tree_budget=budget or 64,
        return_stats=True,
    )
    assert_same_tokens(out, hf_greedy(kind, name, prompt_seed, new_tokens))
    assert stats.new_tokens == new_tokens
    assert max(stats.accept_lengths) <= (1 if method == "autoregressive" else draft.block_size)
    return stats


GREEDY_PROMPTS = [SWEEP_PROMPT] + list(range(9))  # ten prompts for every combination


@pytest.mark.slow
@pytest.mark.parametrize("method,budget", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("name", list(TARGETS))
def test_greedy_equals_hf_generate(name, method, budget):
    """Every family x method x budget, ten prompts x 500 tokens each, with a draft that gets deep paths
    accepted: state carries over hundreds of rounds."""
    taus = [run_greedy(AGREEING, name, method, budget, seed, LONG).tau for seed in GREEDY_PROMPTS]
    if method != "autoregressive":
        # A one-node tree commits at most 2 tokens a round; deeper trees should do much better.
        floor = 1.2 if budget == 1 else 1.5
        mean_tau = sum(taus) / len(taus)
        assert mean_tau > floor, f"the agreeing draft should get draft tokens accepted, mean tau {mean_tau:.2f}"


# A long context: past 2048 slots the attention widths grow by a quarter octave (512 slots here), so these rounds
# run at 2560, 3072 and 3584 slots.
LONG_PROMPT_LEN, LONG_CONTEXT_NEW = 2300, 1000
LONG_PROMPT_SEED = 12  # a prompt whose continuations the tiny drafts mostly, not always, accept


@pytest.mark.parametrize("method,budget", [("autoregressive", None), ("dflash", None), ("ddtree", 64)],
                         ids=["autoregressive", "dflash", "ddtree-64"])
@pytest.mark.parametrize("name", ["qwen3", HYBRID])
def test_long_context_equals_hf_generate_across_widths(name, method, budget):
    """A 2300-token prompt and 1000 new tokens: the target's own greedy output over three widths past 2048 slots."""
    from ddtree_ext.round import kv_bucket

    target, draft = pair(AGREEING, name)
    ids = prompt(LONG_PROMPT_SEED, target.config.vocab_size, LONG_PROMPT_LEN)
    out, stats = generate(target, draft, ids, LONG_CONTEXT_NEW, method=method, tree_budget=budget or 64,
                          return_stats=True)
    assert_same_tokens(out, tiny.hf_greedy(target, ids, LONG_CONTEXT_NEW))
    assert len({kv_bucket(start + 65) for start in round_starts(stats)}) >= 3
    if method != "autoregressive":
        assert stats.tau > 1.5 and len(set(stats.accept_lengths)) >= 2, stats.summary()


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_greedy_rounds_read_logits_in_the_heads_dtype(temperature, monkeypatch):
    """A greedy round asks the verify for the LM head's own dtype (it reads their argmax only), a sampled one for
    float32; a round that would count a greedy spine under a sampling acceptor is refused."""
    from ddtree_ext import round as round_module
    from ddtree_ext.generate import _Acceptor

    asked = []
    stock = TargetAdapter.verify_unchecked

    def recording(self, *args, float32_logits=True, **kwargs):
        asked.append(float32_logits)
        return stock(self, *args, float32_logits=float32_logits, **kwargs)

    monkeypatch.setattr(TargetAdapter, "verify_unchecked", recording)
    target, draft = pair(RANDOM, HYBRID)
    generate(target, draft, pair_prompt(RANDOM, HYBRID, 5), 12, method="ddtree", tree_budget=8,
             temperature=temperature, seed=1)
    assert asked and set(asked) == {temperature > 0}
    sampling = _Acceptor(1.0, None, None, None, 0, 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="spine_len"):
        round_module.DecodeRound(None, None, None, None, sampling, method="ddtree", budget=4, max_accept=4,
                                 draft_top_k=2, spine=True, spine_len=3, use_graphs=False)


@pytest.mark.parametrize("spine", [True, False], ids=["spine", "best-first"])
@pytest.mark.parametrize("draft_top_k", [1, 3, 16])
def test_greedy_tree_shapes(draft_top_k, spine):
    """Other tree shapes: pure best-first, narrow and wide top-K; K = 1 leaves most of a 64-node budget
    as padding nodes, which verify and commit must ignore."""
    target, draft = pair(AGREEING, HYBRID)
    ids = pair_prompt(AGREEING, HYBRID, SWEEP_PROMPT)
    out = generate(target, draft, ids, 300, tree_budget=64, spine=spine, draft_top_k=draft_top_k)
    assert_same_tokens(out, hf_greedy(AGREEING, HYBRID, SWEEP_PROMPT, LONG)[:, : PROMPT_LEN + 300])


@pytest.mark.parametrize("penalty", [1.3, 0.9])
@pytest.mark.parametrize("method,budget", [("autoregressive", None), ("dflash", None), ("ddtree", 16), ("ddtree", 64)],
                         ids=["autoregressive", "dflash", "ddtree-16", "ddtree-64"])
@pytest.mark.parametrize("name", list(TARGETS))
def test_repetition_penalty_equals_hf_generate(name, method, budget, penalty):
    """HF's repetition penalty over the prompt, the generated tokens and, in a tree, each node's path: the target's own
    greedy output with it (HF's generate with repetition_penalty), which differs from the output without it."""
    target, draft = pair(AGREEING, name)
    ids = pair_prompt(AGREEING, name, 31)
    ref = tiny.hf_greedy(target, ids, 200, repetition_penalty=penalty)
    assert not torch.equal(ref, hf_greedy(AGREEING, name, 31, 200)), "the penalty should change the output"
    out, stats = generate(target, draft, ids, 200, method=method, tree_budget=budget or 64, repetition_penalty=penalty,
                          return_stats=True)
    assert_same_tokens(out, ref)
    if method != "autoregressive" and penalty > 1:  # paths below the root accepted: their tokens counted below them
        assert max(stats.accept_lengths) >= 4 and stats.tau > 1.5, stats.summary()


@pytest.mark.parametrize("presence,frequency,repetition", [(1.5, 0.0, None), (0.0, 0.3, None), (0.8, 0.2, 1.2),
                                                           (-0.5, 0.0, None)])
@pytest.mark.parametrize("method,budget", [("autoregressive", None), ("dflash", None), ("ddtree", 64)],
                         ids=["autoregressive", "dflash", "ddtree-64"])
@pytest.mark.parametrize("name", list(TARGETS))
def test_presence_and_frequency_penalties_follow_vllms_rule(name, method, budget, presence, frequency, repetition):
    """vLLM's presence and frequency penalties (after HF's repetition penalty, as vLLM orders them), counted over the
    generated tokens and, in a tree, each node's path: the target's greedy output under that rule (HF's generate with
    the rule as a logits processor), which differs from the output without it."""
    target, draft = pair(AGREEING, name)
    ids = pair_prompt(AGREEING, name, 31)
    ref = tiny.hf_greedy(target, ids, 150, repetition_penalty=repetition,
                         logits_processor=vllm_penalties(ids.shape[1], presence, frequency))
    assert not torch.equal(ref, hf_greedy(AGREEING, name, 31, 150)), "the penalties should change the output"
    out, stats = generate(target, draft, ids, 150, method=method, tree_budget=budget or 64, presence_penalty=presence,
                          frequency_penalty=frequency, repetition_penalty=repetition, return_stats=True)
    assert_same_tokens(out, ref)
    if method != "autoregressive":
        assert max(stats.accept_lengths) >= 2, stats.summary()  # paths below the root were accepted


def test_penalties_make_no_tensor_from_host_values(monkeypatch):
    """A round's penalties run inside a captured CUDA graph, where a tensor made from a host value (a host-to-device
    copy) fails the capture: penalize and _record make none (torch.tensor and torch.as_tensor raise while they run)."""
    from ddtree_ext.generate import _Acceptor

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor made from host values in a round's penalties")

    for name in ("penalize", "_record"):
        method = getattr(_Acceptor, name)

        def guarded(self, *args, _method=method, **kwargs):
            with monkeypatch.context() as m:
                m.setattr(torch, "tensor", refuse)
                m.setattr(torch, "as_tensor", refuse)
                return _method(self, *args, **kwargs)

        monkeypatch.setattr(_Acceptor, name, guarded)
    target, draft = pair(AGREEING, HYBRID)
    generate(target, draft, pair_prompt(AGREEING, HYBRID, 31), 40, repetition_penalty=1.2, presence_penalty=0.5,
             frequency_penalty=0.1)


def test_repetition_penalty_from_the_generation_config():
    """None takes the target's generation_config.repetition_penalty, as HF's generate does; 1.0 turns it off."""
    target, draft = pair(AGREEING, HYBRID)
    target = copy.deepcopy(target)
    target.generation_config.repetition_penalty = 1.3
    ids = pair_prompt(AGREEING, HYBRID, 31)
    assert_same_tokens(generate(target, draft, ids, 120), tiny.hf_greedy(target, ids, 120))
    assert_same_tokens(generate(target, draft, ids, 120, repetition_penalty=1.0), hf_greedy(AGREEING, HYBRID, 31, 120))
    target.generation_config.repetition_penalty = -2.0
    with pytest.raises(ValueError, match="generation_config.repetition_penalty"):
        generate(target, draft, ids, 8)


@pytest.mark.parametrize("method,budget", [("autoregressive", None), ("dflash", None), ("ddtree", 64)],
                         ids=["autoregressive", "dflash", "ddtree-64"])
@pytest.mark.parametrize("name", list(TARGETS))
def test_greedy_with_stacked_projections(name, method, budget, monkeypatch):
    """A target and draft with their projections stacked (``stack_projections``: one GEMM per attention layer's
    q, k, v, per MLP's gate, up) give the target's own greedy output over 300 tokens, and the rounds ran the
    stacked GEMMs (over a stacked weight: not a parameter of its own)."""
    from ddtree_ext import fused

    stacked_gemms = []
    project = fused.project
    monkeypatch.setattr(fused, "project", lambda w, x: stacked_gemms.append(type(w) is torch.Tensor) or project(w, x))
    target, draft = (copy.deepcopy(m) for m in pair(AGREEING, name))
    layers = target.model.layers
    # Per layer its MLP's gate, up (a sparse MoE block's shared expert's), per attention layer its q, k, v, per
    # sparse MoE block its shared expert's gate and up, router and shared gate.
    assert stack_projections(target) == len(layers) + sum(hasattr(layer, "self_attn") for layer in layers) + sum(
        hasattr(layer.mlp, "experts") for layer in layers)
    assert stack_projections(draft) == 2 * len(draft.layers)  # per layer its attention's q, k, v and its MLP's gate, up
    ids = pair_prompt(AGREEING, name, SWEEP_PROMPT)
    out = generate(target, draft, ids, 300, method=method, tree_budget=budget or 64)
    assert_same_tokens(out, hf_greedy(AGREEING, name, SWEEP_PROMPT, LONG)[:, : PROMPT_LEN + 300])
    assert sum(stacked_gemms) > 0


RANDOM_CASES = [("dflash", None), ("ddtree", 1), ("ddtree", 64)]


@pytest.mark.slow
@pytest.mark.parametrize("method,budget", RANDOM_CASES, ids=[m if b is None else f"{m}-{b}" for m, b in RANDOM_CASES])
@pytest.mark.parametrize("name", ["qwen3", HYBRID])
def test_greedy_random_draft(name, method, budget):
    """A random draft on a chaotic target: hundreds of rounds that mostly commit the bonus alone."""
    stats = run_greedy(RANDOM, name, method, budget, 7, LONG)
    assert stats.rounds >= LONG // 2


@pytest.mark.parametrize("name", list(TARGETS))
def test_tree_accepts_at_least_the_chain_each_round(name):
    """Per round, on the same state: DDTree (spine, budget >= block_size - 1) >= the draft's chain (what
    DFlash verifies). The chain's acceptance and the ranks of the accepted tokens are recomputed here by
    replaying the draft on the final sequence's taps; off-spine acceptances (a path token of draft rank
    > 0) must happen and the mean acceptance must be well above 1."""
    target, draft = pair(AGREEING, name)
    stats = run_greedy(AGREEING, name, "ddtree", 64, SWEEP_PROMPT, LONG)
    out = hf_greedy(AGREEING, name, SWEEP_PROMPT, LONG)

    taps = target_taps(target, out, draft.target_layer_ids)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    cache = draft.new_cache(1, capacity=out.shape[1] + draft.block_size)
    length = 0  # context rows in the draft cache
    chain, off_spine_rounds = [], 0
    # Rounds whose whole draft block lies inside the output (the last rounds may have been cut short).
    rounds = [(p, a) for p, a in zip(round_starts(stats), stats.accept_lengths) if p + draft.block_size <= out.shape[1]]
    assert len(rounds) >= 20
    with torch.no_grad():
        for p, accepted in rounds:
            logits = draft.propose(taps[:, length:p], out[:, p], cache, embed_tokens=embed, lm_head=head)[0]
            length = p
            truth = out[0, p + 1 : p + draft.block_size]  # the target's tokens at depths 1 .. L
            chain.append(1 + int((logits.argmax(-1) == truth).long().cumprod(0).sum()))
            # Draft rank (descending logit, ties to the lower id) of each accepted path token.
            order = torch.sort(logits[: accepted - 1], dim=-1, descending=True, stable=True).indices
            ranks = (order == truth[: accepted - 1, None]).nonzero()[:, 1]
            off_spine_rounds += bool((ranks > 0).any())
    accepted = [a for _, a in rounds]
    assert all(a >= c for a, c in zip(accepted, chain)), list(zip(accepted, chain))
    assert stats.spine_accept_lengths[: len(rounds)] == chain
    gained = sum(a > c for a, c in zip(accepted, chain))
    assert off_spine_rounds >= 3 and gained == off_spine_rounds, (off_spine_rounds, gained)
    assert stats.tau > 3.0, stats.tau

    # The first round of a DFlash run starts from the same state as DDTree's: it accepts the chain.
    dflash = run_greedy(AGREEING, name, "dflash", None, SWEEP_PROMPT, LONG)
    assert dflash.accept_lengths[0] == chain[0]


def tiny_conditional_generation(family: str = "qwen3_5"):
    """A tiny Qwen3_5ForConditionalGeneration (the Qwen3.6-27B checkpoint class) with a small vision tower, or with
    ``family="qwen3_5_moe"`` its MoE twin (Qwen3.6-35B-A3B's class)."""
    import transformers

    from ddtree_ext.tiny import tiny_qwen3_5_config, tiny_qwen3_5_moe_config

    if family == "qwen3_5_moe":
        pytest.importorskip("transformers.models.qwen3_5_moe")

    prefix, make_text = ("Qwen3_5", tiny_qwen3_5_config) if family == "qwen3_5" else ("Qwen3_5Moe", tiny_qwen3_5_moe_config)
    text = make_text(layer_types=(LIN, LIN, LIN, FULL), initializer_range=0.2)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=text.hidden_size)
    config = getattr(transformers, prefix + "Config")(text_config=text.to_dict(), vision_config=vision)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        return getattr(transformers, prefix + "ForConditionalGeneration")(config).eval()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_conditional_generation_target(tmp_path, capsys, family):
    """Text prompts on the vision-language class (dense and MoE): exact against its own generate, and the CLI loads
    such a checkpoint through AutoModelForImageTextToText."""
    from ddtree_ext.__main__ import main

    target = tiny_conditional_generation(family)
    draft = make_tiny_draft(target, seed=1)
    ids = prompt(41, target.config.get_text_config().vocab_size)
    with torch.no_grad():
        ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=100, min_new_tokens=100,
                              do_sample=False, pad_token_id=0)
    for method in ("ddtree", "dflash", "autoregressive"):
        assert_same_tokens(generate(target, draft, ids, 100, method=method, tree_budget=16), ref)

    target.save_pretrained(tmp_path)
    _save_byte_tokenizer(tmp_path)
    assert main(["generate", "--target", str(tmp_path), "--method", "autoregressive", "--max-new-tokens", "5",
                 "--device", "cpu"]) == 0
    assert "autoregressive: 5 new tokens" in capsys.readouterr().out


def _halve_output(module):
    """Patches ``module.forward`` on the instance: its class's forward, output halved (a tuple's first element)."""
    import types

    stock = type(module).forward

    def forward(self, *args, **kwargs):
        out = stock(self, *args, **kwargs)
        return out * 0.5 if isinstance(out, torch.Tensor) else (out[0] * 0.5, *out[1:])

    module.forward = types.MethodType(forward, module)


USER_CHANGES = {
    "act_fn hooked": lambda t: t.model.layers[1].mlp.act_fn.register_forward_hook(lambda m, a, out: out * 0.5),
    "act_fn replaced": lambda t: setattr(t.model.layers[1].mlp, "act_fn", torch.nn.GELU()),
    "rotary hooked": lambda t: t.model.rotary_emb.register_forward_hook(lambda m, a, out: (out[1], out[0])),
    "mlp forward patched": lambda t: _halve_output(t.model.layers[1].mlp),
    "norm forward patched": lambda t: _halve_output(t.model.layers[1].input_layernorm),
    "layer forward patched": lambda t: _halve_output(t.model.layers[1]),
    "up_proj forward patched": lambda t: _halve_output(t.model.layers[1].mlp.up_proj),
}


@pytest.mark.parametrize("change", list(USER_CHANGES))
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_user_hooks_and_patched_forwards_run(family, change):
    """A hook on a module the fused forwards call as an op (the MLP's activation, the rotary embedding), a module
    swapped in for the activation, or a forward patched onto an instance (MLP, norm, decoder layer, projection): the
    fused forwards step aside and the output stays the changed model's own (the change does change it)."""
    target = make_tiny_target(family, seed=3)
    draft = make_tiny_draft(target, seed=1)
    ids = prompt(5, target.config.vocab_size)
    before = tiny.hf_greedy(target, ids, 16)
    USER_CHANGES[change](target)
    ref = tiny.hf_greedy(target, ids, 16)
    assert not torch.equal(ref, before), "the change does not change the output: the case tests nothing"
    for method in ("ddtree", "autoregressive"):
        assert_same_tokens(generate(target, draft, ids, 16, method=method), ref)


def test_patched_gdn_forward_is_refused():
    """A tree verify runs its own GDN forward in each linear_attn's place: a forward patched onto one is refused
    before any work, naming the layer."""
    target, draft = pair(RANDOM, HYBRID)
    gdn = target.model.layers[2].linear_attn
    _halve_output(gdn)
    try:
        with pytest.raises(ValueError, match=r"GDN layer 2's linear_attn has a forward set on the instance"):
            generate(target, draft, prompt(1, target.config.vocab_size), 4)
    finally:
        del gdn.forward
    assert_same_tokens(generate(target, draft, pair_prompt(RANDOM, HYBRID, 1), 8), hf_greedy(RANDOM, HYBRID, 1, 8))


def test_moe_graph_rule():
    """Which sparse-MoE targets capture rounds: HF's grouped_mm experts forward with bfloat16 weights on an sm_90 or
    sm_100 GPU (torch's grouped GEMM kernel keeps the offsets on the device); elsewhere torch's grouped_mm and HF's
    "eager" loop read the device from the host. A dense target always can. On the CPU none is capturable, and
    cuda_graph=None or False run eager rounds, exactly."""
    pytest.importorskip("transformers.models.qwen3_5_moe")
    from ddtree_ext.tiny import make_tiny_target

    loop = TargetAdapter(make_tiny_target("qwen3_5_moe", seed=3, experts_implementation="eager"))
    assert loop.is_moe and loop.experts_implementations == ["eager"] and not loop.moe_capturable
    target, draft = pair(RANDOM, "qwen3_5_moe-lllf-gva3")
    grouped = TargetAdapter(target)
    assert grouped.is_moe and grouped.experts_implementations == ["grouped_mm"] and not grouped.moe_capturable  # CPU
    dense = TargetAdapter(pair(RANDOM, HYBRID)[0])
    assert not dense.is_moe and dense.experts_implementations == [] and dense.moe_capturable
    target.set_experts_implementation("eager")  # read when asked, not when the adapter was made
    try:
        assert grouped.experts_implementations == ["eager"]
    finally:
        target.set_experts_implementation("grouped_mm")
    assert grouped.experts_implementations == ["grouped_mm"]
    ids = pair_prompt(RANDOM, "qwen3_5_moe-lllf-gva3", 31)
    with pytest.raises(ValueError, match="needs the whole target on one CUDA device"):
        generate(target, draft, ids, 8, cuda_graph=True)
    ref = hf_greedy(RANDOM, "qwen3_5_moe-lllf-gva3", 31, 20)
    for cuda_graph in (None, False):
        out, stats = generate(target, draft, ids, 20, cuda_graph=cuda_graph, return_stats=True)
        assert_same_tokens(out, ref)
        assert not any(stats.round_replayed)


def test_moe_graph_default_and_refusal():
    """cuda_graph=None on one CUDA device: graphs for a dense target and for a MoE one whose experts forward keeps to
    the device, eager rounds for one that reads the host; cuda_graph=True is taken for a capturable MoE and refused for one whose experts forward reads the host,
    naming the experts implementation and the rule (stand-in adapters: no GPU needed)."""
    from types import SimpleNamespace

    from ddtree_ext.generate import _use_graphs

    cuda = torch.device("cuda", 0)
    for is_moe, capturable, default in ((False, True, True), (True, True, True), (True, False, False)):
        adapter = SimpleNamespace(device=cuda, single_device=True, is_moe=is_moe, moe_capturable=capturable,
                                  experts_implementations=["grouped_mm"], layer_devices=[cuda], model=None)
        assert _use_graphs(None, adapter) is default
        assert _use_graphs(False, adapter) is False
        if capturable:
            assert _use_graphs(True, adapter) is True
    with pytest.raises(ValueError, match=r"experts_implementation grouped_mm \(ops.moe_experts does not apply.*which "
                                         r"here reads the device from the host.*bfloat16 expert weights on an sm_90 "
                                         r"or sm_100 GPU"):
        _use_graphs(True, adapter)


def test_moe_experts_loop_equals_hf_generate():
    """HF's other experts implementation (a loop over the experts a batch hits) gives the same exactness."""
    from ddtree_ext.tiny import make_tiny_target

    pytest.importorskip("transformers.models.qwen3_5_moe")
    target = make_tiny_target("qwen3_5_moe", seed=3, experts_implementation="eager")
    assert target.config._experts_implementation == "eager"
    draft = make_tiny_draft(target, seed=1)
    ids = prompt(31, target.config.vocab_size)
    ref = tiny.hf_greedy(target, ids, 40)
    for method in ("ddtree", "dflash", "autoregressive"):
        assert_same_tokens(generate(target, draft, ids, 40, method=method), ref)


def test_moe_block_returning_router_logits(monkeypatch):
    """Some transformers versions' sparse MoE blocks return (hidden states, router logits), which HF's decoder layer
    unpacks: the fused layer body does too."""
    target, draft = pair(RANDOM, "qwen3_5_moe-lllf-gva3")
    block = type(target.model.layers[0].mlp)
    stock = block.forward
    monkeypatch.setattr(block, "forward", lambda self, x: (stock(self, x), torch.zeros(1)))
    ids = pair_prompt(RANDOM, "qwen3_5_moe-lllf-gva3", 31)
    assert_same_tokens(generate(target, draft, ids, 12), hf_greedy(RANDOM, "qwen3_5_moe-lllf-gva3", 31, 12))


def test_cli_tune_gemms_switches_gemm_tuning_on(tmp_path, capsys, monkeypatch):
    """--tune-gemms turns ddtree_ext.gemm_tuning on for the command's process (on the CPU nothing is tuned: the
    same tokens)."""
    from ddtree_ext import gemm_tuning
    from ddtree_ext.__main__ import main

    monkeypatch.setattr(gemm_tuning, "enabled", False)
    make_tiny_target("qwen3", seed=0).save_pretrained(tmp_path)
    _save_byte_tokenizer(tmp_path)
    argv = ["generate", "--target", str(tmp_path), "--method", "autoregressive", "--max-new-tokens", "5",
            "--device", "cpu", "--no-chat-template"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert not gemm_tuning.enabled
    assert main(argv + ["--tune-gemms"]) == 0
    assert gemm_tuning.enabled and gemm_tuning.picks() == []
    tuned = capsys.readouterr().out
    assert plain.splitlines()[0] == tuned.splitlines()[0]


def test_bfloat16_pair_runs():
    """bf16 weights (the GPU dtype) flow through every stage; tree and chain rounding differ from the stock
    decode step in bf16, so only the prefill's token is compared with HF."""
    target = make_tiny_target("qwen3_5", seed=3, dtype=torch.bfloat16)
    draft = make_tiny_draft(target, seed=1)
    ids = prompt(43, target.config.vocab_size)
    with torch.no_grad():
        first = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                                pad_token_id=0)[0, -1]
    for method in ("ddtree", "dflash", "autoregressive"):
        for temperature in (0.0, 1.0):
            out = generate(target, draft, ids, 40, method=method, temperature=temperature, seed=0)
            assert out.shape == (1, PROMPT_LEN + 40) and out.dtype == torch.int64
            assert temperature > 0 or out[0, PROMPT_LEN] == first


@pytest.mark.parametrize("method", ["ddtree", "autoregressive"])
def test_float64_pair_equals_hf_generate(method):
    """A float64 pair (no compiled layer op takes it: HF's own code runs, and the greedy argmax is torch's) gives the
    target's own greedy output."""
    target = make_tiny_target("qwen3", seed=3, dtype=torch.float64)
    draft = make_tiny_draft(target, seed=1)
    ids = prompt(44, target.config.vocab_size)
    assert_same_tokens(generate(target, draft, ids, 24, method=method), tiny.hf_greedy(target, ids, 24))


# LongRoPE: short factors in a call whose positions all lie below original_max_position_embeddings (32), long ones in
# any other call, for all of its positions.
LONGROPE = {
    "qwen3": dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=32,
                  short_factor=[1.0] * 8, long_factor=[1.0 + 0.5 * i for i in range(8)]),
    "qwen3_5": dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=32,
                    partial_rotary_factor=0.25, mrope_section=[1, 1, 0], mrope_interleaved=True,
                    short_factor=[1.0, 1.0], long_factor=[4.0, 16.0]),
}


@pytest.mark.parametrize("path", ["table", "two-calls"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_longrope_target_stays_exact_across_its_boundary(family, path, monkeypatch):
    """Decoding token by token, a LongRoPE target rotates each token with the short factors below the boundary and
    the long ones from it. A verify reaches up to a block past the token it decides, so run over its positions at once
    the module would take the long factors for nodes still below the boundary. The rounds give each position its own
    factors: from the RoPE table built span by span, or where the table cannot serve (a hook, TF32: here forced) from
    two calls of the module. Prompt 20, 40 new tokens: the rounds cross position 32."""
    from ddtree_ext import target as target_module

    if path == "two-calls":
        monkeypatch.setattr(target_module, "rope_table_serves", lambda rotary: False)
    target = make_tiny_target(family, seed=3, max_position_embeddings=128, rope_parameters=LONGROPE[family])
    draft = make_tiny_draft(target, seed=1)
    ids = prompt(0, target.config.vocab_size, 20)
    expected = tiny.hf_greedy(target, ids, 40)
    for method in ("dflash", "ddtree"):
        assert_same_tokens(generate(target, draft, ids, 40, method=method), expected)


# ---- stopping: max_new_tokens and EOS ----------------------------------------------------------


@pytest.mark.parametrize("method", ["autoregressive", "dflash", "ddtree"])
def test_max_new_tokens_exact(method):
    target, draft = pair(AGREEING, HYBRID)
    ref = hf_greedy(AGREEING, HYBRID, 11, 40)
    for n in (1, 2, 7, 40):
        out = generate(target, draft, pair_prompt(AGREEING, HYBRID, 11), n, method=method, tree_budget=16)
        assert_same_tokens(out, ref[:, : PROMPT_LEN + n])


@pytest.mark.parametrize("ahead", [False, True], ids=["in-turn", "launched-ahead"])
def test_eos_inside_an_accepted_path(ahead, request):
    """EOS = a token the target emits inside an accepted path (not the bonus: more tokens of the round
    follow it): output stops right after it, in every method; an unrelated extra id changes nothing. With rounds
    launched ahead, the round launched behind the EOS round is dropped unread, its stage times with it."""
    if ahead:
        request.getfixturevalue("launch_ahead")
    target, draft = pair(AGREEING, HYBRID)
    ids = pair_prompt(AGREEING, HYBRID, 13)
    full, stats = generate(target, draft, ids, 200, return_stats=True)
    # Against the target's own output, not only against itself: rounds launched ahead must read their own rows.
    assert_same_tokens(full, hf_greedy(AGREEING, HYBRID, 13, 200))
    new = full[0, PROMPT_LEN:].tolist()
    eos_at = None
    for p, n in zip(round_starts(stats), stats.accept_lengths):
        # The round emits positions p + 1 .. p + n (the last one is the bonus): p + 1 .. p + n - 1
        # are path tokens with more tokens of the same round after them.
        for pos in range(p + 1, p + n):
            i = pos - PROMPT_LEN
            if new[i] not in new[:i]:
                eos_at = i
                break
        if eos_at is not None:
            break
    assert eos_at is not None, "no first-occurrence token strictly inside an accepted path"
    unused = next(t for t in range(target.config.vocab_size) if t not in new)
    for method in ("ddtree", "dflash", "autoregressive"):
        for eos in (new[eos_at], [unused, new[eos_at]]):
            out, cut = generate(target, draft, ids, 200, method=method, eos_token_id=eos, return_stats=True)
            assert_same_tokens(out, full[:, : PROMPT_LEN + eos_at + 1])
            # A round was launched ahead of the EOS round's read (far from max_new_tokens) and dropped unread,
            # its stage times with it.
            assert cut.new_tokens == eos_at + 1
            assert len(cut.round_stage_s) == len(cut.round_time_s) == len(cut.round_launched_ahead) == cut.rounds


# ---- streamer ----------------------------------------------------------------------------------


class RecordingStreamer:
    def __init__(self):
        self.puts, self.values, self.ended = [], [], 0

    def put(self, value):
        assert self.ended == 0
        self.puts.append(value.clone())
        self.values.append(value)

    def end(self):
        self.ended += 1


def test_streamer_receives_prompt_then_new_tokens():
    streamer = RecordingStreamer()
    target, draft = pair(AGREEING, HYBRID)
    ids = pair_prompt(AGREEING, HYBRID, 17)
    out = generate(target, draft, ids, 50, streamer=streamer)
    assert streamer.ended == 1
    assert torch.equal(streamer.puts[0], ids)  # the prompt first, [1, T], as HF does
    # Each round's tokens as [1, n], as HF's assisted decoding streams them, as ordinary (not inference) tensors.
    assert all(p.dim() == 2 and p.shape[0] == 1 and p.dtype == torch.int64 for p in streamer.puts[1:])
    assert not any(p.is_inference() for p in streamer.values)
    assert any(p.shape[1] > 1 for p in streamer.puts[1:])  # rounds that accepted several tokens
    assert torch.equal(torch.cat(streamer.puts[1:], dim=1), out[:, PROMPT_LEN:])
    assert len(streamer.puts) > 2


def test_a_call_refused_by_new_state_streams_nothing():
    """new_state's checks (here: a hybrid moved to float64 after its adapter was made) come before the prompt goes
    to the streamer, so a refused call leaves the streamer untouched rather than given a prompt and never ended."""
    target = make_tiny_target("qwen3_5", seed=3)
    adapter = TargetAdapter(target)
    target.to(torch.float64)
    streamer = RecordingStreamer()
    with pytest.raises(ValueError, match="TargetAdapter.new_state"):
        generate(adapter, None, prompt(5, target.config.vocab_size), 8, method="autoregressive", streamer=streamer)
    assert streamer.puts == [] and streamer.ended == 0


def test_text_streamer_prints_the_new_text(capsys):
    from transformers import TextStreamer

    class LetterTokenizer:  # TextStreamer only decodes
        def decode(self, ids, **kwargs):
            ids = [ids] if isinstance(ids, int) else ids
            return "".join(chr(ord("a") + i % 26) for i in ids)

    target, draft = pair(AGREEING, HYBRID)
    streamer = TextStreamer(LetterTokenizer(), skip_prompt=True)
    out = generate(target, draft, pair_prompt(AGREEING, HYBRID, 19), 30, streamer=streamer)
    assert capsys.readouterr().out == LetterTokenizer().decode(out[0, PROMPT_LEN:].tolist()) + "\n"


# ---- sampling ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(TARGETS))
def test_sampling_reproducible_and_identical_across_methods(name):
    """One seed -> one output, for every method: the token at position p is drawn with the p-th uniform.
    A low temperature keeps the agreeing draft useful, so sampled paths are deep."""
    target, draft = pair(AGREEING, name)
    ids = pair_prompt(AGREEING, name, 23)
    kw = dict(temperature=0.3, top_k=40, top_p=0.95, min_p=0.02)
    for seed in (0, 1):
        ref = generate(target, draft, ids, 120, method="autoregressive", seed=seed, **kw)
        for method, budget in [("dflash", 64), ("ddtree", 4), ("ddtree", 64)]:
            out, stats = generate(target, draft, ids, 120, method=method, tree_budget=budget, seed=seed,
                                  return_stats=True, **kw)
            assert_same_tokens(out, ref)
        assert stats.tau > 1.5, stats.tau  # DDTree-64 accepted deep sampled paths
        assert_same_tokens(generate(target, draft, ids, 120, seed=seed, **kw), ref)
    assert not torch.equal(generate(target, draft, ids, 120, seed=2, **kw), ref)
    assert not torch.equal(generate(target, draft, ids, 120), ref)  # sampling is not the greedy output


@pytest.mark.parametrize("name", list(TARGETS))
def test_sampling_with_penalties_identical_across_methods(name):
    """The penalties as well: every node of a tree is penalised over its own path, so the token a DDTree or DFlash
    round draws at position p is the one autoregressive sampling draws there with the p-th uniform, over 200 tokens
    (the counts carried across many rounds)."""
    target, draft = pair(AGREEING, name)
    ids = pair_prompt(AGREEING, name, 23)
    kw = dict(temperature=0.3, top_k=40, seed=4, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.2)
    ref = generate(target, draft, ids, 200, method="autoregressive", **kw)
    assert not torch.equal(ref, generate(target, draft, ids, 200, method="autoregressive", temperature=0.3, top_k=40,
                                         seed=4))  # the penalties change the output
    for method, budget in [("dflash", 64), ("ddtree", 64)]:
        out, stats = generate(target, draft, ids, 200, method=method, tree_budget=budget, return_stats=True, **kw)
        assert_same_tokens(out, ref)
        # Tokens drawn below the root (their nodes penalised over their paths) in many rounds.
        assert sum(length >= 2 for length in stats.accept_lengths) >= 10, stats.accept_lengths


def exact_joint(target, ids: torch.Tensor, steps: int, repetition_penalty=None, presence_penalty=0.0,
                frequency_penalty=0.0, **processing) -> dict:
    """P(first ``steps`` new tokens) under the processed target distribution: {token tuple: prob}. The penalties go
    first (HF's repetition processor over the prompt and the prefix, then vLLM's presence and frequency penalties over
    the prefix: conftest.vllm_penalties), then the warpers (conftest.warped_probs)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    joint = {(): 1.0}
    with torch.no_grad():
        for _ in range(steps):
            prefixes = list(joint)
            batch = torch.cat([ids.expand(len(prefixes), -1), torch.tensor(prefixes, dtype=torch.long).view(len(prefixes), -1)], 1)
            logits = target(batch).logits[:, -1]
            nxt = {}
            for k, row in zip(prefixes, logits):
                row = row[None].float()
                if repetition_penalty is not None:
                    seen = torch.cat([ids, torch.tensor([k], dtype=torch.long).view(1, -1)], 1)
                    row = RepetitionPenaltyLogitsProcessor(repetition_penalty)(seen, row)
                sequence = torch.cat([ids, torch.tensor([k], dtype=torch.long).view(1, -1)], 1)
                row = vllm_penalties(ids.shape[1], presence_penalty, frequency_penalty)(sequence, row)
                probs = warped_probs(row, **processing)[0]
                for t in probs.nonzero()[:, 0].tolist():
                    nxt[k + (t,)] = joint[k] * float(probs[t])
            joint = nxt
    return joint


def chi_square(samples: Counter, joint: dict, n: int) -> tuple:
    """(chi-square statistic, its 1 - 1e-4 quantile): cells with expected count < 5 are pooled; the
    quantile is the Wilson-Hilferty approximation. A sample outside the support fails at once."""
    assert all(k in joint for k in samples), "sampled a sequence of probability 0"
    cells, pooled_e, pooled_o = [], 0.0, 0
    for k, p in joint.items():
        e = n * p
        if e >= 5:
            cells.append((samples.get(k, 0), e))
        else:
            pooled_e, pooled_o = pooled_e + e, pooled_o + samples.get(k, 0)
    if pooled_e > 0:
        cells.append((pooled_o, pooled_e))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    z = 3.719  # standard normal quantile at 1 - 1e-4
    return stat, dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


SMALL_VOCAB = 8


@functools.lru_cache(maxsize=None)
def small_vocab_pair():
    """A random vocabulary-8 target: a top-8 tree holds every token at depth 1, so the walk samples
    below the root in almost every round."""
    target = make_tiny_target("qwen3", seed=5, vocab_size=SMALL_VOCAB)
    return target, make_tiny_draft(target, seed=2)


@pytest.mark.parametrize(
    "processing",
    [dict(temperature=1.0, top_k=0, top_p=1.0), dict(temperature=0.7, top_k=5, top_p=0.9),
     dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1), dict(temperature=0.8, top_k=6, repetition_penalty=1.8),
     dict(temperature=1.0, presence_penalty=1.5, frequency_penalty=0.5)],
    ids=["plain", "top_k-top_p", "min_p", "repetition_penalty", "presence-frequency"],
)
def test_sampling_distribution_matches_the_target(processing):
    """Many seeded runs: the first 3 new tokens of DDTree, DFlash and autoregressive sampling each follow
    the exact processed target distribution (chi-square), and a wrong temperature is rejected by the
    same test on the same samples (the test has power)."""
    target, draft = small_vocab_pair()
    ids, steps, runs = prompt(29, SMALL_VOCAB, length=6), 3, 400
    joint = exact_joint(target, ids, steps, **processing)
    wrong = exact_joint(target, ids, steps, **dict(processing, temperature=processing["temperature"] * 1.6))
    for method in ("ddtree", "dflash", "autoregressive"):
        samples = Counter(
            tuple(generate(target, draft, ids, steps, method=method, tree_budget=32, seed=s, **processing)[0, -steps:].tolist())
            for s in range(runs)
        )
        stat, bound = chi_square(samples, joint, runs)
        assert stat < bound, f"{method}: chi-square {stat:.1f} >= {bound:.1f}"
        wrong_stat, wrong_bound = chi_square(samples, wrong, runs)
        assert wrong_stat > wrong_bound, f"{method}: cannot tell a wrong temperature ({wrong_stat:.1f})"


# ---- bad input: ValueError naming the argument, before any forward -----------------------------


@pytest.fixture
def forward_counter():
    """Counts forward calls of every module of the random hybrid target and its draft."""
    target, draft = pair(RANDOM, HYBRID)
    calls = []
    handles = [m.register_forward_pre_hook(lambda *a: calls.append(1)) for m in (*target.modules(), *draft.modules())]
    yield target, draft, calls
    for h in handles:
        h.remove()


def _draft_of_another_target():
    return make_tiny_draft(make_tiny_target("qwen3_5", seed=3, hidden_size=32), seed=1)


def _unsupported_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4)
    return LlamaForCausalLM(config)


BAD_INPUTS = [
    ("method", dict(method="beam")),
    ("tree_budget", dict(tree_budget=0)),
    ("tree_budget", dict(tree_budget=MAX_TREE_BUDGET + 1)),
    ("tree_budget", dict(tree_budget=8.0)),
    ("draft_top_k", dict(draft_top_k=0)),
    ("temperature", dict(temperature=-0.5)),
    ("temperature", dict(temperature=float("nan"))),
    ("temperature", dict(temperature=True)),
    ("temperature", dict(temperature=10**400)),  # too large for a float: refused, not an OverflowError
    ("max_new_tokens", dict(max_new_tokens=np.bool_(True))),
    ("top_k", dict(top_k=np.float32(3))),
    ("top_p", dict(top_p=True)),
    ("top_k", dict(top_k=True)),
    ("max_new_tokens", dict(max_new_tokens=True)),
    ("spine", dict(spine=1)),
    ("spine", dict(spine="no")),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("min_p", dict(min_p=-0.1)),
    ("min_p", dict(min_p=1.5)),
    ("min_p", dict(min_p=True)),
    ("min_p", dict(min_p=float("nan"))),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("repetition_penalty", dict(repetition_penalty=-1.2)),
    ("repetition_penalty", dict(repetition_penalty=float("inf"))),
    ("repetition_penalty", dict(repetition_penalty=True)),
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("presence_penalty", dict(presence_penalty=float("nan"))),
    ("presence_penalty", dict(presence_penalty=True)),
    ("frequency_penalty", dict(frequency_penalty=-3)),
    ("top_k", dict(top_k=-1)),
    ("seed", dict(seed=-1)),
    ("max_new_tokens", dict(max_new_tokens=0)),
    ("max_new_tokens", dict(max_new_tokens=5000)),  # prompt + 5000 > max_position_embeddings 4096
    # 4 + 4086 fits in 4096 positions, but the last rounds verify up to block_size - 1 = 7 positions deeper
    (r"max_new_tokens.*block_size - 1 = 7", dict(max_new_tokens=4086)),
    (r"max_new_tokens.*block_size - 1 = 7", dict(max_new_tokens=4086, method="dflash")),
    ("eos_token_id", dict(eos_token_id="</s>")),
    ("input_ids", dict(input_ids=torch.zeros(1, 0, dtype=torch.long))),
    ("input_ids", dict(input_ids=torch.zeros(1, 4))),
    ("input_ids", dict(input_ids=torch.zeros(4, dtype=torch.long))),
    ("input_ids", dict(input_ids=torch.full((1, 4), 256))),
    ("input_ids is on the meta device", dict(input_ids=torch.zeros(1, 4, dtype=torch.long, device="meta"))),
    ("attention_mask is on the meta device", dict(attention_mask=torch.ones(1, 4, device="meta"))),
    ("batch size > 1 is not supported yet", dict(input_ids=torch.zeros(2, 4, dtype=torch.long))),
    ("attention_mask", dict(attention_mask=torch.tensor([[0, 1, 1, 1]]))),
    ("attention_mask", dict(attention_mask=torch.ones(1, 5))),
    (r"attention_mask must hold ones \(1 or True\)", dict(attention_mask=torch.full((1, 4), 0.5))),
    (r"attention_mask must hold ones \(1 or True\)", dict(attention_mask=torch.full((1, 4), float("nan")))),
    (r"input_ids has no sequence \(shape \[0, 4\]\)", dict(input_ids=torch.zeros(0, 4, dtype=torch.long))),
    (r"input_ids must lie in \[0, 256\), got values in \[0, 300\]",
     dict(input_ids=torch.tensor([[0, 300]], dtype=torch.uint32))),
    ("eos_token_id must be an int", dict(eos_token_id=np.array(2.5))),
    ("draft does not match the target: .*vocab_size: the draft was made for a vocabulary of 200 tokens",
     dict(draft=lambda: make_tiny_draft(make_tiny_target("qwen3_5", seed=3, vocab_size=200,
                                                         layer_types=(LIN, LIN, LIN, FULL)), seed=1))),
    ("draft", dict(draft=None)),
    ("draft", dict(draft=_draft_of_another_target)),
    # taps the 4-layer target lacks: the draft's check names them (it named the target and its adapter's taps)
    (r"generate: draft does not match the target: .*target_layer_ids: \[5\] out of range",
     dict(draft=lambda: make_tiny_draft(pair(RANDOM, HYBRID)[0], seed=1, target_layer_ids=[0, 5]))),
    ("draft: weights are torch.float64 on cpu, expected the target's torch.float32 on cpu",
     dict(draft=lambda: make_tiny_draft(pair(RANDOM, HYBRID)[0], seed=1).double())),
    ("draft: weights are torch.float32 on meta, expected the target's torch.float32 on cpu",
     dict(draft=lambda: make_tiny_draft(pair(RANDOM, HYBRID)[0], seed=1).to("meta"))),
    ("target", dict(target=_unsupported_target)),
    ("target", dict(target=lambda: TargetAdapter(pair(RANDOM, HYBRID)[0], (0,)))),  # taps != the draft's
    ("cuda_graph=True needs the whole target on one CUDA device", dict(cuda_graph=True)),  # a CPU target
    ("cuda_graph must be None, True or False", dict(cuda_graph=1)),
    # logits / 1e-38 overflow float32: the sampler would see infinities
    (r"temperature must be 0 \(greedy\) or >= 1e-05", dict(temperature=1e-38)),
    ("eos_token_id must lie in", dict(eos_token_id=256)),
    ("return_stats must be a bool", dict(return_stats="no")),
    ("streamer must have put", dict(streamer=object())),
    ("draft must be a ddtree_ext.draft.DFlashDraftModel", dict(draft=lambda: pair(RANDOM, HYBRID)[0])),
    ("draft must be a ddtree_ext.draft.DFlashDraftModel", dict(draft="z-lab/some-draft")),
    # one module in another dtype: named, before any forward
    (r"draft: weights are torch.float64 on cpu.*the first that is not: layers\.0\.",
     dict(draft=lambda: _draft_with_one_float64_layer())),
]


def test_numpy_scalars_are_the_python_numbers():
    """NumPy scalars (what a config or an array hands over) run as the Python numbers they hold, as in HF's generate;
    the output is the same (values a float32 holds exactly)."""
    target, draft = pair(RANDOM, HYBRID)
    prompt = torch.tensor([[5, 9, 2, 7]])
    plain = generate(target, draft, prompt, 12, tree_budget=8, temperature=0.75, top_k=20, top_p=0.875, seed=3,
                     eos_token_id=[255], draft_top_k=4)
    numpy = generate(target, draft, prompt, np.int64(12), tree_budget=np.int32(8), temperature=np.float32(0.75),
                     top_k=np.int64(20), top_p=np.float32(0.875), seed=np.uint64(3), eos_token_id=np.array([255]),
                     draft_top_k=np.int16(4))
    assert torch.equal(plain, numpy)
    wide = generate(target, draft, prompt.to(torch.uint64), 12, tree_budget=8, temperature=0.75, top_k=20, top_p=0.875,
                    seed=3, eos_token_id=np.array(255), draft_top_k=4)  # wide unsigned ids, a 0-d array EOS
    assert torch.equal(plain, wide)
    eos = int(plain[0, 6])  # an EOS given as a NumPy integer stops there
    stopped = generate(target, draft, prompt, 12, tree_budget=8, temperature=0.75, top_k=20, top_p=0.875, seed=3,
                       eos_token_id=np.int64(eos), draft_top_k=4)
    assert stopped.shape[1] <= 7 and int(stopped[0, -1]) == eos


def _draft_with_one_float64_layer():
    draft = make_tiny_draft(pair(RANDOM, HYBRID)[0], seed=1)
    draft.layers[0].double()
    return draft


@pytest.mark.parametrize("argument,override", BAD_INPUTS, ids=[f"{a}-{i}" for i, (a, _) in enumerate(BAD_INPUTS)])
def test_bad_input_raises_before_any_forward(forward_counter, argument, override):
    target, draft, calls = forward_counter
    kw = dict(target=target, draft=draft, input_ids=torch.zeros(1, 4, dtype=torch.long), max_new_tokens=8)
    kw.update({k: v() if callable(v) else v for k, v in override.items()})
    with pytest.raises(ValueError, match=argument):
        generate(kw.pop("target"), kw.pop("draft"), kw.pop("input_ids"), kw.pop("max_new_tokens"), **kw)
    assert not calls, f"{len(calls)} module forwards ran before the error"


@pytest.mark.parametrize("kind", ["float64", "conv-width-6"])
@pytest.mark.parametrize("method", ["autoregressive", "ddtree"])
def test_gdn_layers_the_tree_ops_cannot_run_are_refused_before_any_forward(kind, method):
    """A hybrid whose GDN layers the tree ops cannot run (float64 weights; a conv wider than 4) is refused with the
    reason before any forward, also when the model changes after an adapter was made for it (new_state checks)."""
    if kind == "float64":
        target = make_tiny_target("qwen3_5", seed=3)
        adapter = TargetAdapter(target)  # made while the weights are float32
        draft = make_tiny_draft(target, seed=1).to(torch.float64)
        target.to(torch.float64)
        message = "GDN layer 0 has torch.float64 weights; its tree ops take float32, float16 or bfloat16"
        with pytest.raises(ValueError, match="TargetAdapter.new_state: model: " + message):
            adapter.new_state(capacity=64)
    else:
        target = make_tiny_target("qwen3_5", seed=3, linear_conv_kernel_dim=6)
        draft = make_tiny_draft(target, seed=1)
        message = "GDN layer 0 has a conv of width 6 \\(linear_conv_kernel_dim\\); the tree conv takes widths 1 to 4"
    calls = []
    handles = [m.register_forward_pre_hook(lambda *a: calls.append(1)) for m in (*target.modules(), *draft.modules())]
    try:
        with pytest.raises(ValueError, match=message):
            generate(target, draft, prompt(1, target.config.vocab_size), 8, method=method)
    finally:
        for h in handles:
            h.remove()
    assert not calls, f"{len(calls)} module forwards ran before the error"


def test_eos_ids_from_a_one_shot_iterable_and_top_k_beyond_the_vocabulary():
    """An iterator of EOS ids is read once (and still stops generation); a top_k larger than the vocabulary keeps
    every token, as top_k = vocabulary does."""
    target, draft = pair(RANDOM, HYBRID)
    ids = pair_prompt(RANDOM, HYBRID, 31)
    full = generate(target, draft, ids, 12)
    eos = int(full[0, ids.shape[1] + 2])
    assert torch.equal(generate(target, draft, ids, 12, eos_token_id=iter([eos])),
                       generate(target, draft, ids, 12, eos_token_id=[eos]))
    assert generate(target, draft, ids, 12, eos_token_id=(t for t in [eos])).shape[1] <= ids.shape[1] + 3
    vocab = target.config.vocab_size
    sampled = [generate(target, draft, ids, 12, temperature=0.8, top_k=k, seed=5) for k in (vocab, 2**70)]
    assert torch.equal(sampled[0], sampled[1])


def test_eos_from_the_targets_generation_config(monkeypatch):
    """With no eos_token_id, generation stops where HF's own generate stops: at the generation_config's EOS (an id or
    a list), in every method; an explicit id replaces it, and an empty list never stops early."""
    target, draft = pair(AGREEING, HYBRID)
    ids = pair_prompt(AGREEING, HYBRID, 13)
    full = hf_greedy(AGREEING, HYBRID, 13, 40)
    new = full[0, PROMPT_LEN:].tolist()
    eos_at = next(i for i in range(5, len(new)) if new[i] not in new[:i])
    unused = next(t for t in range(target.config.vocab_size) if t not in new)
    for config_eos in (new[eos_at], [unused, new[eos_at]]):
        monkeypatch.setattr(target.generation_config, "eos_token_id", config_eos)
        with torch.no_grad():
            hf = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                 pad_token_id=0)
        assert_same_tokens(hf, full[:, : PROMPT_LEN + eos_at + 1])  # HF stops there too
        for method in ("ddtree", "dflash", "autoregressive"):
            assert_same_tokens(generate(target, draft, ids, 40, method=method), hf)
            assert_same_tokens(generate(target, draft, ids, 40, method=method, eos_token_id=[]), full)
        assert_same_tokens(generate(target, draft, ids, 40, eos_token_id=unused), full)


@pytest.mark.parametrize("config_eos, message", [
    (10**6, r"generation_config.eos_token_id \[1000000\] does not lie in \[0, 64\)"),
    ("</s>", "generation_config.eos_token_id is not an int >= 0 or a list of them"),
])
def test_a_bad_eos_in_the_generation_config_is_named(monkeypatch, config_eos, message):
    target, draft = pair(AGREEING, HYBRID)
    monkeypatch.setattr(target.generation_config, "eos_token_id", config_eos)
    with pytest.raises(ValueError, match=message):
        generate(target, draft, pair_prompt(AGREEING, HYBRID, 13), 8)
    # an explicit eos_token_id is what the call uses: the config's is not read
    assert generate(target, draft, pair_prompt(AGREEING, HYBRID, 13), 8, eos_token_id=[]).shape == (1, PROMPT_LEN + 8)


def test_attention_mask_of_another_type_is_named():
    target, draft = pair(RANDOM, HYBRID)
    with pytest.raises(ValueError, match="attention_mask must be a torch.Tensor .* got list"):
        generate(target, draft, pair_prompt(RANDOM, HYBRID, 31), 4, attention_mask=[[1] * PROMPT_LEN])


def test_all_ones_attention_mask_and_int32_prompt_accepted():
    target, draft = pair(RANDOM, HYBRID)
    ids = pair_prompt(RANDOM, HYBRID, 31)
    out = generate(target, draft, ids.int(), 10, attention_mask=torch.ones_like(ids))
    assert_same_tokens(out, hf_greedy(RANDOM, HYBRID, 31, 10))


def test_a_ready_target_adapter_is_reused():
    target, draft = pair(AGREEING, HYBRID)
    adapter = TargetAdapter(target, draft.target_layer_ids)
    for _ in range(2):
        out = generate(adapter, draft, pair_prompt(AGREEING, HYBRID, 11), 40)
        assert_same_tokens(out, hf_greedy(AGREEING, HYBRID, 11, 40))


def test_a_ready_target_adapter_follows_the_attention_implementation():
    """An adapter made under sdpa, the model then switched to eager (which takes an additive mask, not a bool one):
    the verify builds the mask eager takes, and the output is still the target's own."""
    target = make_tiny_target("qwen3", seed=3)
    draft = make_tiny_draft(target, seed=1)
    adapter = TargetAdapter(target, draft.target_layer_ids)
    target.set_attn_implementation("eager")
    ids = prompt(2, target.config.vocab_size)
    assert_same_tokens(generate(adapter, draft, ids, 40), tiny.hf_greedy(target, ids, 40))
    target.config._attn_implementation = "flash_attention_2"  # cannot take a tree mask
    with pytest.raises(ValueError, match="TargetAdapter.new_state: model: attention implementation"):
        generate(adapter, draft, ids, 4)


def test_generation_config_processing_is_named_in_a_warning():
    """generate() applies no logits processing from the target's generation_config but its repetition penalty; where
    HF's greedy generate would (a token suppression here), a warning says so. A stock generation_config gives none."""
    import warnings

    target, draft = pair(RANDOM, HYBRID)
    target = copy.deepcopy(target)
    ids = pair_prompt(RANDOM, HYBRID, 47)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(target, draft, ids, 2)
    assert not [w for w in caught if "generation_config" in str(w.message)]
    target.generation_config.suppress_tokens = []  # empty: no effect, no warning
    target.generation_config.encoder_repetition_penalty = 1.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(target, draft, ids, 2)
    assert not [w for w in caught if "generation_config" in str(w.message)]
    target.generation_config.repetition_penalty = 1.5  # applied: not named
    target.generation_config.suppress_tokens = [3]
    with pytest.warns(UserWarning, match=r"sets suppress_tokens=\[3\], which.*the output is HF's with") as record:
        out = generate(target, draft, ids, 20)
    assert not [w for w in record if "repetition_penalty" in str(w.message)]
    assert_same_tokens(out, tiny.hf_greedy(target, ids, 20, suppress_tokens=None))


def hold_thread_a_in_its_first_verify(target, forwards=None):
    """A hook (its handle returned with two events) that holds the thread named "A" at the end of its first verify
    forward, while the GDN tree forwards are swapped in: ``a_in_verify`` is set then, and A waits for ``release_a``.
    ``forwards``, if given, collects the thread name of every target forward."""
    gdn = target.model.layers[0].linear_attn
    a_in_verify, release_a = threading.Event(), threading.Event()

    def hold(module, args):
        if forwards is not None:
            forwards.append(threading.current_thread().name)
        if threading.current_thread().name == "A" and "forward" in gdn.__dict__ and not a_in_verify.is_set():
            a_in_verify.set()
            release_a.wait(timeout=60)

    return a_in_verify, release_a, target.model.norm.register_forward_pre_hook(hold)


def test_calls_on_one_model_from_two_threads_take_turns():
    """generate() swaps forwards on the models' modules while it runs: a second thread's call on the same pair waits
    until the first returns (before, each put back the other's swaps and left some on the model, which then failed).
    The first call is held inside a verify, with its tree forwards swapped in. Both outputs are the target's own, and
    no module keeps a swapped forward."""
    target, draft = pair(AGREEING, HYBRID)
    ids = pair_prompt(AGREEING, HYBRID, 41)
    forwards = []  # the thread of every target forward
    a_in_verify, release_a, hook = hold_thread_a_in_its_first_verify(target, forwards)
    outputs = {}

    def run():
        outputs[threading.current_thread().name] = generate(target, draft, ids, 30)

    try:
        first = threading.Thread(target=run, name="A", daemon=True)
        first.start()
        assert a_in_verify.wait(timeout=60)
        second = threading.Thread(target=run, name="B", daemon=True)
        second.start()
        second.join(timeout=2.0)
        assert second.is_alive() and "B" not in forwards  # B waits while A is inside its call
        release_a.set()
        first.join(timeout=120)
        second.join(timeout=120)
    finally:
        release_a.set()
        hook.remove()
    assert not first.is_alive() and not second.is_alive()
    assert forwards.index("B") > len(forwards) - 1 - forwards[::-1].index("A")  # every B forward after A's last
    for name in "AB":
        assert_same_tokens(outputs[name], hf_greedy(AGREEING, HYBRID, 41, 30))
    for model in (target, draft):
        assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == []


def test_hf_forward_from_another_thread_during_a_call_runs_hf_code():
    """While a call holds the model (held inside a verify, with its fused and tree forwards swapped in, the
    process-wide patches installed and its layer taps hooked), HF's own forward on the same model from another
    thread runs HF's code: its logits are those of the same forward before the call, bit for bit. And it leaves the
    call alone: the call's tokens and accept lengths are those of the same call undisturbed (before, the other
    thread's layer outputs replaced the call's taps, so its draft read them and accepted differently)."""
    target, draft = pair(AGREEING, HYBRID)
    ids = pair_prompt(AGREEING, HYBRID, 45)
    other = ids[:, :7]  # another length than the verify's, as a second user's prompt would be
    gdn = target.model.layers[0].linear_attn
    with torch.no_grad():
        expected = target(other).logits
    undisturbed, undisturbed_stats = generate(target, draft, ids, 30, return_stats=True)
    a_in_verify, release_a, hook = hold_thread_a_in_its_first_verify(target)
    outputs = {}

    def run_generate():
        outputs["A"] = generate(target, draft, ids, 30, return_stats=True)

    def run_hf_forward():
        try:
            with torch.no_grad():  # as a user's inference would (the fused forwards apply only without grad)
                outputs["B"] = target(other).logits
        except BaseException as e:  # reported below, not lost in the thread
            outputs["B"] = e

    try:
        first = threading.Thread(target=run_generate, name="A", daemon=True)
        first.start()
        assert a_in_verify.wait(timeout=60)
        second = threading.Thread(target=run_hf_forward, name="B", daemon=True)
        second.start()
        second.join(timeout=120)
        assert not second.is_alive()
        assert "forward" in gdn.__dict__, "A's swaps were open during B's forward"
        release_a.set()
        first.join(timeout=120)
    finally:
        release_a.set()
        hook.remove()
    assert isinstance(outputs["B"], torch.Tensor), f"HF's forward from another thread failed: {outputs['B']!r}"
    assert torch.equal(outputs["B"], expected)
    tokens, stats = outputs["A"]
    assert_same_tokens(tokens, hf_greedy(AGREEING, HYBRID, 45, 30))
    assert torch.equal(tokens, undisturbed)
    assert stats.accept_lengths == undisturbed_stats.accept_lengths
    for model in (target, draft):
        assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == []


def test_process_patches_closed_from_another_thread_count_down():
    """A fusion context's process-wide patches (RoPE, sdpa) opened in one thread and closed from another: the
    opening thread no longer counts as holding them and the last close puts them back (before, the close raised in
    the other thread and left the patches installed for good)."""
    from ddtree_ext import fused
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    stock = ALL_ATTENTION_FUNCTIONS["sdpa"]
    context = fused._PROCESS_PATCHES.held()
    context.__enter__()
    assert fused._PROCESS_PATCHES.held_here() and ALL_ATTENTION_FUNCTIONS["sdpa"] is not stock
    errors = []

    def close():
        try:
            assert not fused._PROCESS_PATCHES.held_here()
            context.__exit__(None, None, None)
        except BaseException as e:
            errors.append(e)

    closer = threading.Thread(target=close)
    closer.start()
    closer.join(timeout=60)
    assert errors == []
    assert not fused._PROCESS_PATCHES.held_here()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is stock


def test_generate_from_inside_generate_runs():
    """A streamer that calls generate() on the same models from inside the call (between rounds, where no swap is
    open): the locks are re-entrant, and both calls give the target's own output."""
    target, draft = pair(AGREEING, HYBRID)
    ids, other = pair_prompt(AGREEING, HYBRID, 43), pair_prompt(AGREEING, HYBRID, 44)
    inner = []

    class ReenteringStreamer:
        def __init__(self):
            self.puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 3:
                inner.append(generate(target, draft, other, 12))

        def end(self):
            pass

    out = generate(target, draft, ids, 30, streamer=ReenteringStreamer())
    assert len(inner) == 1
    assert_same_tokens(out, hf_greedy(AGREEING, HYBRID, 43, 30))
    assert_same_tokens(inner[0], hf_greedy(AGREEING, HYBRID, 44, 12))


# ---- stats and the CLI -------------------------------------------------------------------------


def test_stats_summary(launch_ahead):
    target, draft = pair(AGREEING, HYBRID)
    _, stats = generate(target, draft, pair_prompt(AGREEING, HYBRID, 37), 64, return_stats=True)
    assert stats.new_tokens == 64 and stats.prompt_tokens == PROMPT_LEN and stats.tree_budget == 64
    assert stats.rounds == len(stats.accept_lengths) and 1 + sum(stats.accept_lengths) >= 64
    assert stats.tau == pytest.approx(sum(stats.accept_lengths) / stats.rounds)
    assert set(stats.stage_time_s) == {"prefill", "draft", "build", "verify", "walk", "commit"}
    assert len(stats.round_time_s) == len(stats.round_stage_s) == len(stats.round_replayed) == stats.rounds
    # Round r is launched before round r - 1 is read unless round r - 1 could end the generation by length:
    # tokens out before it (the prefill's one and the rounds') plus a longest path reach max_new_tokens.
    out_before = [1 + sum(stats.accept_lengths[:r]) for r in range(stats.rounds)]
    expected = [False] + [out_before[r - 1] + draft.block_size < 64 for r in range(1, stats.rounds)]
    assert stats.round_launched_ahead == expected and sum(expected) >= 2
    assert all(set(r) == {"draft", "build", "verify", "walk", "commit"} for r in stats.round_stage_s)
    assert not any(stats.round_replayed) and stats.graph_captures == 0 and stats.graph_capture_s == 0  # CPU: eager
    text = stats.summary()
    assert "tau" in text and "tokens/s" in text and "verify" in text
    assert f"{sum(expected)} of {stats.rounds} rounds launched before the round ahead of them was read" in text


def test_rounds_on_the_cpu_run_in_turn():
    """On the CPU a round runs as it is launched: none is launched before the round ahead of it is read."""
    target, draft = pair(AGREEING, HYBRID)
    _, stats = generate(target, draft, pair_prompt(AGREEING, HYBRID, 37), 24, return_stats=True)
    assert stats.rounds >= 2 and not any(stats.round_launched_ahead)


def test_attention_widths_never_shrink(launch_ahead, monkeypatch):
    """A round launched ahead asks for the width of an upper bound of its committed length; the rounds near the
    end, launched after a read, may ask for less. Each runs at the widest width asked for so far (on a GPU a
    narrower one would be captured again), and the output is the target's."""
    from ddtree_ext import round as round_module

    asked, ran = [], []
    launch, stages = round_module.DecodeRound.launch, round_module.DecodeRound._stages
    monkeypatch.setattr(round_module.DecodeRound, "launch",
                        lambda self, kv_len, clock: asked.append(kv_len) or launch(self, kv_len, clock))
    monkeypatch.setattr(round_module.DecodeRound, "_stages",
                        lambda self, kv_len: ran.append(kv_len) or stages(self, kv_len))
    target, draft = pair(RANDOM, "qwen3")
    ids = prompt(5, target.config.vocab_size, 196)  # the capacity, 196 + 256 + 65, lies past the 512-slot width
    out = generate(target, draft, ids, 256, tree_budget=64)
    assert_same_tokens(out, tiny.hf_greedy(target, ids, 256))
    assert asked != sorted(asked), "no narrower width asked for: the case is not exercised"
    assert ran == [max(asked[: i + 1]) for i in range(len(asked))]


def test_cli_demo_reports_identical_outputs(capsys):
    from ddtree_ext.__main__ import main

    assert main(["generate"]) == 0
    out = capsys.readouterr().out
    assert "identical" in out and "autoregressive:" in out and "ddtree:" in out


def test_cli_demo_takes_sampling_and_length_options(capsys):
    """The demo samples with the options it is given, one seed for all three methods (0 when none is given), so
    their outputs still agree; --max-new-tokens sets the length."""
    from ddtree_ext.__main__ import main

    assert main(["generate", "--temperature", "1.5", "--top-p", "0.9", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "identical (12 tokens, sampled at temperature 1.5 with seed 0)" in out
    rows = [line for line in out.splitlines() if line.startswith(("autoregressive: [", "ddtree: ["))]
    assert len(rows) == 2 and all(len(row.split(": ", 1)[1].split(",")) == 12 for row in rows), rows


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_moe"])
def test_cli_demo_runs_each_tiny_family(capsys, family):
    """--tiny picks the demo's target family; the three methods still agree on it."""
    from ddtree_ext.__main__ import DEMO_FAMILIES, main

    assert main(["generate", "--tiny", family, "--max-new-tokens", "10"]) == 0
    out = capsys.readouterr().out
    assert f"tiny random {DEMO_FAMILIES[family]} target" in out and "identical (10 tokens, greedy)" in out


def test_cli_demo_trained_draft_shows_acceptance(capsys):
    """--trained-draft trains the tiny draft on its target first: the chain then accepts several tokens per round,
    the tree (which holds the chain) at least as many, and the outputs still agree."""
    import re

    from ddtree_ext.__main__ import main

    assert main(["generate", "--trained-draft", "--tiny", "qwen3", "--max-new-tokens", "48"]) == 0
    out = capsys.readouterr().out
    assert "tiny trained DFlash draft" in out and "identical (48 tokens, greedy)" in out
    tau = {m: float(t) for m, t in re.findall(r"^(ddtree|dflash|autoregressive)\b.*tau ([0-9.]+)$", out, re.M)}
    assert tau["autoregressive"] == 1.0 and tau["dflash"] > 2.0 and tau["ddtree"] >= tau["dflash"], tau


@pytest.mark.parametrize(
    "argv,message",
    [(["--budget", "0"], "tree_budget"), (["--draft", "some/draft"], "--draft needs --target"),
     (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
     (["--method", "dflash"], "--method needs --target"), (["--prompt", "hi"], "--prompt needs --target"),
     (["--target", "some/target", "--method", "ddtree"], "--method ddtree needs --draft"),
     (["--device", "foo"], "--device foo: not a device"),
     (["--target", "some/target", "--tiny", "qwen3"], "--tiny sets up the built-in demo's models"),
     (["--target", "some/target", "--trained-draft"], "--trained-draft sets up the built-in demo's models"),
     (["--tiny", "llama"], "invalid choice: 'llama'"),
     (["--device", "meta"], "--device meta: the models run on a CPU or a CUDA GPU"),
     (["--max-new-tokens", "4086"], "block_size - 1"),  # fits autoregressive decoding, not a tree's reach
     (["--temperature", "-1"], "temperature"),
     # with --target, what needs no model is refused before loading it (these paths do not exist)
     (["--target", "no/such-target", "--draft", "no/such-draft", "--budget", "0"], "tree_budget"),
     (["--target", "no/such-target", "--draft", "no/such-draft", "--top-p", "2"], "top_p"),
     (["--target", "no/such-target", "--draft", "no/such-draft", "--min-p", "-0.5"], "min_p"),
     (["--min-p", "2"], "min_p"),
     (["--repetition-penalty", "0"], "repetition_penalty"),
     (["--presence-penalty", "3"], "presence_penalty"),
     (["--target", "no/such-target", "--method", "autoregressive", "--max-new-tokens", "-3"], "--max-new-tokens"),
     (["--target", "no/such-target", "--method", "autoregressive", "--prompt", ""], "--prompt must not be empty")],
)
def test_cli_usage_errors(capsys, argv, message):
    """Usage errors exit with status 2 before any generation: the demo prints no method's output first."""
    from ddtree_ext.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(["generate", *argv])
    captured = capsys.readouterr()
    assert info.value.code == 2 and message in captured.err
    assert not any(line.startswith(("ddtree:", "dflash:", "autoregressive:")) for line in captured.out.splitlines())


def _save_byte_tokenizer(directory) -> None:
    """A 256-token byte-level tokenizer (no merges): one token per byte, like the tiny targets' vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(directory)


def test_cli_with_checkpoints(tmp_path, capsys):
    """--target / --draft directories: the target and tokenizer load through the Auto classes, the draft
    through DFlashDraftModel.from_pretrained; the text streams, then the statistics."""
    from safetensors.torch import save_file

    from ddtree_ext.__main__ import main

    target, draft = pair(RANDOM, HYBRID)
    target_dir, draft_dir = tmp_path / "target", tmp_path / "draft"
    target.save_pretrained(target_dir)
    _save_byte_tokenizer(target_dir)
    draft_dir.mkdir()
    draft.config.to_json_file(draft_dir / "config.json")
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, draft_dir / "model.safetensors")

    common = ["generate", "--target", str(target_dir), "--prompt", "hello", "--max-new-tokens", "12", "--device", "cpu"]
    assert main([*common, "--draft", str(draft_dir), "--budget", "8"]) == 0
    out = capsys.readouterr().out
    assert "ddtree, budget 8: 12 new tokens after a 5-token prompt" in out and "tokens/s" in out
    assert main([*common, "--method", "autoregressive"]) == 0
    assert "autoregressive: 12 new tokens" in capsys.readouterr().out


def test_cli_checks_the_draft_before_loading_the_target(tmp_path, capsys, monkeypatch):
    """With --target and --draft, a target path that holds no model, a draft path that holds none, and a draft made
    for another target are usage errors (status 2), and the last two are found before the target's weights load."""
    import transformers
    from safetensors.torch import save_file

    from ddtree_ext.__main__ import main

    target, _ = pair(RANDOM, HYBRID)
    target_dir, draft_dir = tmp_path / "target", tmp_path / "draft"
    target.save_pretrained(target_dir)
    other = make_tiny_draft(make_tiny_target("qwen3", seed=3, num_hidden_layers=6), seed=1)  # taps layer 4 of 6
    draft_dir.mkdir()
    other.config.to_json_file(draft_dir / "config.json")
    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, draft_dir / "model.safetensors")

    def no_target_load(*args, **kwargs):
        raise AssertionError("the target was loaded before the draft was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_target_load)
    common = ["generate", "--prompt", "hello", "--max-new-tokens", "4", "--device", "cpu"]
    cases = [
        (["--target", str(tmp_path / "none"), "--draft", str(draft_dir)], f"--target {tmp_path / 'none'}: "),
        (["--target", str(target_dir), "--draft", str(tmp_path / "none")], "DFlashDraftModel.from_pretrained: path"),
        (["--target", str(target_dir), "--draft", str(draft_dir)], "target_layer_ids: [4] out of range"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as info:
            main([*common, *argv])
        err = capsys.readouterr().err
        assert info.value.code == 2 and message in err, err


def test_rounds_release_their_graphs_when_generate_ends_or_raises(monkeypatch):
    """generate() drops the round's graphs itself, also when the streamer raises mid-generation: a round
    left to the garbage collector could free a pooled capture stream's cuBLAS workspace under a later
    generation's graphs."""
    from ddtree_ext import round as round_module

    released = []
    release = round_module.DecodeRound.release
    monkeypatch.setattr(round_module.DecodeRound, "release", lambda self: released.append(self) or release(self))
    target, draft = pair(AGREEING, HYBRID)
    ids = pair_prompt(AGREEING, HYBRID, 17)
    generate(target, draft, ids, 8)
    assert len(released) == 1

    class FailingStreamer(RecordingStreamer):
        def put(self, value):
            super().put(value)
            if len(self.puts) == 3:
                raise RuntimeError("the consumer went away")

    with pytest.raises(RuntimeError, match="the consumer went away"):
        generate(target, draft, ids, 20, streamer=FailingStreamer())
    assert len(released) == 2
