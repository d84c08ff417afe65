"""Tiny random models of both supported families, for tests and the built-in demo.

The model classes are the real transformers ones, built from small configs with seeded random weights
(nothing is downloaded). Sizes keep the structure that matters: Qwen3.5 hybrids interleave GDN
("linear_attention") and full-attention layers, with a grouped value-head ratio (HV / H) of 1 or 3.
"""

from __future__ import annotations

from typing import Sequence

import torch

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


def make_tiny_target(family: str = "qwen3_5", *, seed: int = 0, dtype: torch.dtype = torch.float32, **config_kw):
    """A tiny random target: ``family`` is "qwen3" (Qwen3ForCausalLM) or "qwen3_5" (Qwen3_5ForCausalLM).
    Weights come from the model's own initialiser under ``torch.manual_seed(seed)``."""
    from transformers import Qwen3_5ForCausalLM, Qwen3ForCausalLM

    if family == "qwen3":
        cls, config = Qwen3ForCausalLM, tiny_qwen3_config(**config_kw)
    elif family == "qwen3_5":
        cls, config = Qwen3_5ForCausalLM, tiny_qwen3_5_config(**config_kw)
    else:
        raise ValueError(f"make_tiny_target: family must be 'qwen3' or 'qwen3_5', got {family!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # Wider init than the default 0.02 so tiny random models have peaked, non-degenerate outputs.
        config.initializer_range = 0.2
        model = cls(config)
    return model.to(dtype).eval()
