"""Tiny random models of the supported families (Qwen3, Qwen3.5, Qwen3.5 MoE), for tests and the built-in demo.

The model classes are the real transformers ones, built from small configs with seeded random weights
(nothing is downloaded). Sizes keep the structure that matters: Qwen3.5 hybrids interleave GDN
("linear_attention") and full-attention layers, with a grouped value-head ratio (HV / H) of 1 or 3.
Tiny DFlash drafts go with them: random ones, and ones trained in seconds to agree with a
predictable target (:func:`make_predictable_target`, :func:`make_agreeing_draft`).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

TINY_VOCAB = 256


def tiny_qwen3_config(*, vocab_size: int = TINY_VOCAB, num_layers: int = 4, **overrides):
    """A small pure-attention Qwen3 text config."""
    from transformers import Qwen3Config

    kw = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


def tiny_qwen3_5_config(
    *,
    vocab_size: int = TINY_VOCAB,
    layer_types: Sequence[str] = ("linear_attention", "linear_attention", "linear_attention", "full_attention"),
    value_heads_per_key_head: int = 3,
    **overrides,
):
    """A small Qwen3.5 (GDN hybrid) text config. ``layer_types`` sets the pattern of GDN and attention
    layers; ``value_heads_per_key_head`` the GVA ratio HV / H of the GDN layers."""
    from transformers import Qwen3_5TextConfig

    kw = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2 * value_heads_per_key_head,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        },
    )
    kw.update(overrides)
    return Qwen3_5TextConfig(**kw)


def tiny_qwen3_5_moe_config(*, num_experts: int = 8, num_experts_per_tok: int = 2, **overrides):
    """A small Qwen3.5 MoE (GDN hybrid with sparse MoE MLPs, Qwen3.6-35B-A3B's family) text config: the layers of
    :func:`tiny_qwen3_5_config` (same keywords) with ``num_experts`` routed experts, ``num_experts_per_tok`` of them
    per token, and a shared expert (sizes ``moe_intermediate_size`` 32 and ``shared_expert_intermediate_size`` 48
    unless given; ``experts_implementation`` picks HF's experts forward)."""
    from transformers import Qwen3_5MoeTextConfig

    moe_keys = ("moe_intermediate_size", "shared_expert_intermediate_size", "experts_implementation")
    moe = {key: overrides.pop(key) for key in moe_keys if key in overrides}
    dense = tiny_qwen3_5_config(**overrides)
    names = set(Qwen3_5MoeTextConfig().to_dict()) - {"architectures", "model_type", "transformers_version", "dtype"}
    kw = {name: value for name, value in dense.to_dict().items() if name in names and name != "intermediate_size"}
    kw.update(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, attn_implementation=dense._attn_implementation)
    kw.update(moe)
    return Qwen3_5MoeTextConfig(**kw)


TINY_FAMILIES = ("qwen3", "qwen3_5", "qwen3_5_moe")


def make_tiny_target(
    family: str = "qwen3_5",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    initializer_range: float = 0.2,
    lm_head_range: float | None = None,
    **config_kw,
):
    """A tiny random target: ``family`` is "qwen3" (Qwen3ForCausalLM), "qwen3_5" (Qwen3_5ForCausalLM) or
    "qwen3_5_moe" (Qwen3_5MoeForCausalLM).
    Weights come from the model's own initialiser under ``torch.manual_seed(seed)`` with std
    ``initializer_range``; the LM head is then rescaled to std ``lm_head_range`` (default: unchanged).
    The default 0.2 (wider than HF's 0.02) gives peaked outputs that depend chaotically on the whole
    context; see :func:`make_predictable_target` for the other regime."""
    from transformers import Qwen3_5ForCausalLM, Qwen3ForCausalLM

    if family == "qwen3":
        cls, config = Qwen3ForCausalLM, tiny_qwen3_config(**config_kw)
    elif family == "qwen3_5":
        cls, config = Qwen3_5ForCausalLM, tiny_qwen3_5_config(**config_kw)
    elif family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeForCausalLM

        cls, config = Qwen3_5MoeForCausalLM, tiny_qwen3_5_moe_config(**config_kw)
    else:
        raise ValueError(f"make_tiny_target: family must be one of {TINY_FAMILIES}, got {family!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config.initializer_range = initializer_range
        model = cls(config)
    if lm_head_range is not None:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(lm_head_range / initializer_range)
    return model.to(dtype).eval()


# Per family: small enough that the current token's embedding dominates the residual stream (the
# layers add roughly initializer_range * hidden_size relative to it), large enough that the context
# still decides about a fifth of the greedy tokens at depth 1 (GDN layers add less than attention).
PREDICTABLE_INITIALIZER_RANGE = {"qwen3": 0.005, "qwen3_5": 0.015, "qwen3_5_moe": 0.015}


def make_predictable_target(family: str = "qwen3_5", *, seed: int = 0, vocab_size: int = 64, **kw):
    """A tiny target whose greedy continuations a tiny draft can learn (see :func:`make_agreeing_draft`).

    The default targets' greedy tokens are a chaotic function of the whole context: a tiny draft
    trained on them stays at chance. Here the layers are initialised small next to the embeddings
    (:data:`PREDICTABLE_INITIALIZER_RANGE`), so greedy continuations settle into short cycles whose
    exits depend on the context, over a 64-token vocabulary; the LM head keeps std 0.2 for peaked
    output distributions. Other arguments go to :func:`make_tiny_target`."""
    if family not in PREDICTABLE_INITIALIZER_RANGE:
        raise ValueError(f"make_predictable_target: family must be one of {TINY_FAMILIES}, got {family!r}")
    kw.setdefault("initializer_range", PREDICTABLE_INITIALIZER_RANGE[family])
    kw.setdefault("lm_head_range", 0.2)
    return make_tiny_target(family, seed=seed, vocab_size=vocab_size, **kw)


# ---------------------------------------------------------------------------------------------
# Tiny DFlash drafts for the tiny targets
# ---------------------------------------------------------------------------------------------


def _text_config(target):
    return target.config.get_text_config()


@contextlib.contextmanager
def _one_thread():
    """Run on one intra-op thread: these tensors are too small to gain from more (on a busy 2-core
    machine two threads made training 6x slower), and float reductions then do not depend on the
    machine's core count, so a seed gives the same draft everywhere."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def tiny_draft_config(
    target_config,
    *,
    num_layers: int = 2,
    block_size: int = 8,
    target_layer_ids: Sequence[int] | None = None,
    layer_types: Sequence[str] | None = None,
    sliding_window: int = 16,
    **overrides,
):
    """A small DFlash draft config (a Qwen3Config in z-lab's format) for a target TEXT config.

    Defaults follow the real Qwen3.6-27B draft's structure: sliding-window layers then one full
    layer, taps spread over the target's layers short of the last (whose HF hidden_states entry is
    post-norm), and the mask token the last vocabulary id."""
    from transformers import Qwen3Config

    num_target_layers = target_config.num_hidden_layers
    if target_layer_ids is None:
        if num_target_layers < 2:
            raise ValueError(
                f"tiny_draft_config: target_config: a draft taps layers 0 .. L - 2 of the target's L, so the target "
                f"needs at least 2 decoder layers, got {num_target_layers}"
            )
        first = 1 if num_target_layers > 2 else 0
        target_layer_ids = torch.linspace(first, num_target_layers - 2, 3).round().int().unique().tolist()
    if layer_types is None:
        layer_types = ["sliding_attention"] * (num_layers - 1) + ["full_attention"]
    kw = dict(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=target_config.rms_norm_eps,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        layer_types=list(layer_types),
        use_sliding_window=True,  # else Qwen3Config drops sliding_window
        sliding_window=sliding_window,
        block_size=block_size,
        num_target_layers=num_target_layers,
        dflash_config={"mask_token_id": target_config.vocab_size - 1, "target_layer_ids": list(target_layer_ids)},
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


def make_tiny_draft(target, *, seed: int = 0, weight_std: float = 0.2, **config_kw):
    """A random DFlash draft for ``target`` (config from :func:`tiny_draft_config`), in the target's
    dtype. Linear weights ~ N(0, weight_std); norm weights 1 + N(0, 0.1) so that a norm applied to the
    wrong tensor changes the output."""
    from ddtree_ext.draft import DFlashDraftModel

    config = tiny_draft_config(_text_config(target), **config_kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = DFlashDraftModel(config)
        with torch.no_grad():
            for name, param in draft.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1 + 0.1 * torch.randn_like(param))
                else:
                    param.normal_(0.0, weight_std)
    return draft.to(target.dtype).eval()


def target_taps(target, input_ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """[B, T, len(layer_ids) * hidden]: the outputs of the target's decoder layers ``layer_ids`` for a
    stock forward over ``input_ids`` [B, T], concatenated in ``layer_ids`` order (forward hooks, as
    the target adapter records them: :func:`ddtree_ext.target.record_layer_outputs`)."""
    from ddtree_ext.target import record_layer_outputs

    with record_layer_outputs(target.get_decoder().layers, layer_ids) as outputs, torch.no_grad():
        target(input_ids=input_ids, use_cache=False)
    return torch.cat([outputs[i] for i in layer_ids], dim=-1)


def hf_greedy(target, prompts: torch.Tensor, new_tokens: int, **processing) -> torch.Tensor:
    """The target's own greedy output from stock Hugging Face ``generate`` (exactly ``new_tokens`` new
    tokens, no EOS stop): [B, prompt_len + new_tokens] int64. The reference every exactness test uses.
    ``processing``: more of ``generate``'s arguments (e.g. ``repetition_penalty``)."""
    with torch.no_grad():
        return target.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            **processing,
        )


def greedy_rollouts(target, num_prompts: int, prompt_len: int, new_tokens: int) -> torch.Tensor:
    """[num_prompts, prompt_len + new_tokens] int64: uniformly random prompts (from the global RNG)
    followed by the target's greedy continuation."""
    vocab = _text_config(target).vocab_size
    return hf_greedy(target, torch.randint(0, vocab, (num_prompts, prompt_len)), new_tokens)


class Agreement(NamedTuple):
    """How often a draft's proposals match the target's greedy tokens (see :func:`draft_agreement`)."""

    top1: torch.Tensor  # [block_size - 1] float: depth-d argmax == greedy token at p + d
    topk: torch.Tensor  # [block_size - 1] float: greedy token at p + d among the depth-d top-k
    chain_accept_length: float  # mean tokens per round of the chain ("dflash") method: 1 + accepted


def draft_agreement(
    draft, target, *, seed: int = 1, num_prompts: int = 32, prompt_len: int = 16, new_tokens: int = 32, top_k: int = 4
) -> Agreement:
    """Agreement of ``draft`` with the target's greedy continuations of random prompts drawn under
    ``seed`` (the default differs from :func:`make_agreeing_draft`'s, so these are held out).

    Walks each rollout the way generation does (context appended row by row) and proposes at every root
    position p >= prompt_len that has block_size - 1 greedy tokens after it."""
    with torch.random.fork_rng(devices=[]), torch.no_grad(), _one_thread():
        torch.manual_seed(seed)
        sequences = greedy_rollouts(target, num_prompts, prompt_len, new_tokens)
        taps = target_taps(target, sequences, draft.target_layer_ids)
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        depth = draft.block_size - 1
        hits, hits_k = [], []
        cache = draft.new_cache(sequences.shape[0], capacity=sequences.shape[1] + draft.block_size)
        length = 0  # context rows in the cache
        for p in range(prompt_len, sequences.shape[1] - depth):
            logits = draft.propose(taps[:, length:p], sequences[:, p], cache, embed_tokens=embed, lm_head=head)
            length = p
            labels = sequences[:, p + 1 : p + 1 + depth]
            hits.append(logits.argmax(-1) == labels)
            hits_k.append((logits.topk(top_k, dim=-1).indices == labels[..., None]).any(-1))
    hits, hits_k = torch.cat(hits).float(), torch.cat(hits_k).float()
    return Agreement(hits.mean(0), hits_k.mean(0), 1.0 + hits.cumprod(1).sum(1).mean().item())


def make_agreeing_draft(
    target,
    *,
    seed: int = 0,
    steps: int = 300,
    batch_size: int = 64,
    num_prompts: int = 256,
    prompt_len: int = 16,
    new_tokens: int = 48,
    lr: float = 3e-3,
    weight_std: float = 0.05,
    **config_kw,
):
    """A tiny draft trained to agree with ``target``'s greedy continuations, for DDTree tests that need
    deep and off-spine acceptance. Meant for a float32 :func:`make_predictable_target`: on the default
    (chaotic) tiny targets no tiny draft gets above chance.

    Data: ``num_prompts`` random prompts and their greedy continuations. Each Adam step picks
    ``batch_size`` rollouts and one root position p >= prompt_len, and trains exactly what inference
    runs: ``propose`` on a fresh cache with the taps of positions 0 .. p - 1 as context, the token at
    p as bonus, and cross-entropy against the greedy tokens at p + 1 .. p + block_size - 1.
    Deterministic given ``seed``.

    Measured with the defaults (about 10 s on one core), held out (:func:`draft_agreement`), depth 1 -> 7:
    qwen3_5 top-1 0.72 -> 0.47, top-4 0.88 -> 0.73, chain accept length 4.3 tokens per round of 8;
    qwen3 top-1 0.76 -> 0.45, top-4 0.92 -> 0.75, 4.1. About one root in six has the greedy token in
    the depth-1 top-4 but not the top-1."""
    if target.dtype != torch.float32:
        raise ValueError(f"make_agreeing_draft: target must be float32, got {target.dtype}")
    draft = make_tiny_draft(target, seed=seed, weight_std=weight_std, **config_kw)
    depth = draft.block_size - 1
    with torch.random.fork_rng(devices=[]), _one_thread():
        torch.manual_seed(seed)
        sequences = greedy_rollouts(target, num_prompts, prompt_len, new_tokens)
        taps = target_taps(target, sequences, draft.target_layer_ids)
        # The target's embedding and head are used frozen (detached): training touches only the draft.
        embed_weight = target.get_input_embeddings().weight.detach()
        head_weight = target.get_output_embeddings().weight.detach()

        def embed(ids):
            return F.embedding(ids, embed_weight)

        def head(hidden):
            return F.linear(hidden, head_weight)

        optimizer = torch.optim.Adam(draft.parameters(), lr=lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
        for _ in range(steps):
            rows = torch.randperm(num_prompts)[:batch_size]
            p = int(torch.randint(prompt_len, sequences.shape[1] - depth, ()))
            logits = draft.propose(
                taps[rows, :p],
                sequences[rows, p],
                draft.new_cache(batch_size, capacity=p + draft.block_size),
                embed_tokens=embed,
                lm_head=head,
            )
            loss = F.cross_entropy(logits.flatten(0, 1), sequences[rows, p + 1 : p + 1 + depth].flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    return draft.eval()
