"""Native DFlash block-diffusion draft model (z-lab checkpoint format, no remote code).

A DFlash draft is a small stack of Qwen3-style decoder layers with no embedding and no LM head of its
own: it borrows the target's. One call of :meth:`DFlashDraftModel.propose` predicts the
``block_size - 1`` tokens that follow the root ("bonus") token, all at once:

* context features = ``hidden_norm(fc(concat of the target's tapped layer outputs))``, one row per
  committed target position; their per-layer K/V are kept in a :class:`DFlashDraftCache`;
* the block = the target's embeddings of ``[bonus, mask x (block_size - 1)]`` at positions
  ``start .. start + block_size - 1`` (``start`` = context rows held);
* every layer: queries from the block only, keys/values from ``[context ; block]``; q_norm/k_norm
  per head before rotate-half RoPE; a ``full_attention`` layer is non-causal, a ``sliding_attention``
  layer is causal and windowed, unless the config's ``is_causal`` overrides causality for all layers;
* logits of block rows 1.. through the target's LM head (optional ``output_multiplier`` and
  ``final_logit_softcapping``).

The math follows z-lab's public ``dflash/model.py``; the cache replaces its DynamicCache + crop
with static buffers whose rows past ``length`` are scratch for the block's K/V, and ``length`` is a
device tensor: a call reads no value from the device and allocates nothing sized by data, so it can be
captured in a CUDA graph (``ddtree_ext.round``).
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import torch
from torch import nn

from ddtree_ext import ops
from ddtree_ext.fused import (
    Fork, LayerFusion, _plain_module, add_norm, fused_qk_norm_rope_store_kv, gqa_attention, norm_into, ops_apply,
    rope_rows, rope_table, rope_table_serves, rotary, stacked_outputs,
)
from ddtree_ext.target import MAX_TREE_NODES

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
_CHECKPOINT_PREFIX = "model."  # some exporters prefix every weight name; accepted and stripped
# The dtypes a draft can be loaded in: those of the targets generate() runs (the tree ops take the first three).
DRAFT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _draft_value(config, name: str, default=None):
    """A DFlash setting: ``dflash_config[name]`` first, then the top-level config attribute."""
    dflash = getattr(config, "dflash_config", None) or {}
    return dflash.get(name, getattr(config, name, default))


class DFlashDraftCache:
    """Context K/V of every draft layer for one batch of sequences, in static buffers.

    ``keys[i]`` / ``values[i]``: ``[B, num_key_value_heads, capacity, head_dim]`` in the draft's dtype,
    RoPE already applied to keys. Rows ``0 .. length[b] - 1`` are row b's context (row = absolute
    position); rows past it are scratch where :meth:`DFlashDraftModel.propose` writes padding rows and
    the block's K/V for the duration of one call, so the block is never part of the cache.
    ``length`` [B] int64 lives on the draft's device. ``cos`` / ``sin`` ``[capacity, head_dim]``: the draft's RoPE
    at every row's position (row = position), in its dtype (``fused.rope_table``; None where that gives none): a call
    gathers its rows from them instead of recomputing them, where ``fused.rope_table_serves`` says they are still the
    rotary embedding's bits.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: torch.Tensor,
                 cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None):
        self.keys, self.values, self.length = keys, values, length
        self.cos, self.sin = cos, sin

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]


class DFlashAttention(nn.Module):
    """Attention of the block's queries over [context ; block] keys and values."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

        layer_type = config.layer_types[layer_idx]
        is_causal = getattr(config, "is_causal", None)
        # z-lab's rule: sliding layers are causal, full layers are not, unless the config says otherwise.
        self.is_causal = layer_type == SLIDING_ATTENTION if is_causal is None else bool(is_causal)
        self.sliding_window = config.sliding_window if layer_type == SLIDING_ATTENTION else None

    def _heads(self, proj: nn.Linear, x: torch.Tensor, heads: int) -> torch.Tensor:
        """[B, S, hidden] -> [B, heads, S, head_dim]."""
        return proj(x).view(*x.shape[:-1], heads, self.head_dim).transpose(1, 2)

    def forward(self, block, context, cos, sin, cache_keys, cache_values, kv_slots, block_rows, kv_len, mask=None,
                rows=None):
        """block [B, S, hidden] (normed), context [B, T, hidden] (new context rows, maybe padded),
        cos/sin [B, 1, T + S, head_dim] at the rows' positions; cache_keys/values this layer's buffers;
        kv_slots [B, T + S] int64 the cache row (= position) of each context and block row, negative for a
        padding context row (not stored); block_rows [B, S] int64 the block's positions; mask this layer's
        :meth:`mask` when the caller has it already (layers with one attention rule share it); rows the
        [B, T + S, hidden] rows [context ; block] when the caller keeps them so (context and block its views),
        else they are concatenated here.
        Writes the K/V of the context and the block, then attends over the first kv_len rows. Returns
        [B, S, hidden]."""
        ctx_len = context.shape[1]
        if rows is not None and rows.shape[1] != ctx_len + block.shape[1]:
            raise ValueError(f"DFlashAttention: rows must hold the {ctx_len} context and {block.shape[1]} block rows, "
                             f"got {rows.shape[1]}")
        kv_input = torch.cat([context, block], dim=1) if rows is None else rows
        cos_all, sin_all = cos[:, 0], sin[:, 0]
        # With q/k/v stacked, one GEMM over every [context ; block] row where the context rows are no more than the
        # block's (a round's; not a prompt's): their queries are computed and dropped, a few rows more of a GEMM that
        # streams its weights. Then one launch norms, rotates and stores the K/V.
        projections = (self.q_proj, self.k_proj, self.v_proj)
        outputs = stacked_outputs(projections, kv_input) if ctx_len <= block.shape[1] else None
        if outputs is not None:
            q, k, v = (t.view(*kv_input.shape[:-1], -1, self.head_dim) for t in outputs)
            query = fused_qk_norm_rope_store_kv(self.q_norm, self.k_norm, q, k, v, cos_all, sin_all, cache_keys,
                                                cache_values, kv_slots)
            if query is not None:
                query = query[:, :, ctx_len:]
            else:  # the norms' own forwards (hooks see the block's queries only, as apart)
                query = rotary(self.q_norm(q[:, ctx_len:].transpose(1, 2)), cos_all[:, ctx_len:], sin_all[:, ctx_len:])
                key = rotary(self.k_norm(k.transpose(1, 2)), cos_all, sin_all)
                self._store_kv(cache_keys, cache_values, kv_slots, key, v.transpose(1, 2))
        else:
            query = self.q_norm(self._heads(self.q_proj, block, self.num_heads))
            key = self.k_norm(self._heads(self.k_proj, kv_input, self.num_kv_heads))
            value = self._heads(self.v_proj, kv_input, self.num_kv_heads)
            query = rotary(query, cos_all[:, ctx_len:], sin_all[:, ctx_len:])
            key = rotary(key, cos_all, sin_all)
            self._store_kv(cache_keys, cache_values, kv_slots, key, value)
        attn = gqa_attention(
            query, cache_keys[:, :, :kv_len], cache_values[:, :, :kv_len],
            self.mask(block_rows, kv_len) if mask is None else mask, self.head_dim**-0.5,
        )
        return self.o_proj(attn.transpose(1, 2).reshape(*block.shape[:-1], self.num_heads * self.head_dim))

    @staticmethod
    def _store_kv(cache_keys, cache_values, kv_slots, key, value) -> None:
        """key, value [B, Hkv, T, D] into the cache rows kv_slots [B, T] (negative: padding, not stored)."""
        if ops_apply(key, value, cache_keys, cache_values):
            ops.store_kv(cache_keys, cache_values, kv_slots, key, value)  # one launch for K and V, every row
        else:  # autograd or a dtype the ops do not take: index copies, which read which rows are padding
            for b, slots in enumerate(kv_slots):
                keep = slots >= 0
                cache_keys[b].index_copy_(1, slots[keep], key[b][:, keep])
                cache_values[b].index_copy_(1, slots[keep], value[b][:, keep])

    def mask(self, block_rows: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Boolean [B, 1, S, kv_len] (True = attend) of the block's queries (positions block_rows
        [B, S]) over cache rows 0 .. kv_len - 1 (row = position): the context and the block, causal
        and windowed as the layer is; rows past the block are never visible."""
        query_pos = block_rows[:, :, None]
        key_pos = torch.arange(kv_len, device=block_rows.device)[None, None, :]
        visible = key_pos <= block_rows[:, -1:, None]
        if self.is_causal:
            visible = visible & (key_pos <= query_pos)
        if self.sliding_window is not None:
            visible = visible & (query_pos - key_pos < self.sliding_window)
            if not self.is_causal:
                visible = visible & (key_pos - query_pos < self.sliding_window)
        return visible[:, None]


class _Prelude:
    """What :meth:`DFlashDraftModel.propose` computes from the cache lengths alone, on a side stream: the rows
    appended [B], the block's positions block_rows [B, S], the cache slots kv_slots [B, T + S], the positions of
    the context and block rows [B, T + S], their RoPE (cos, sin) from the cache's table (None without one) and
    one attention mask per rule (causal, window). :meth:`join` makes the current stream wait for them."""

    def __init__(self, fork: Fork, appended, block_rows, kv_slots, positions, rope, masks):
        self.fork, self.appended, self.block_rows, self.kv_slots, self.positions, self.rope, self.masks = (
            fork, appended, block_rows, kv_slots, positions, rope, masks,
        )

    def join(self) -> None:
        self.fork.join(self.appended, self.block_rows, self.kv_slots, self.positions, *(self.rope or ()),
                       *self.masks.values())


class DFlashDecoderLayer(nn.Module):
    """Pre-norm residual layer: block attention over [context ; block], then a SwiGLU MLP. ``propose`` runs its parts
    itself, each residual add fused into the next norm (``DFlashDraftModel._run_layers``: the same bits as this
    forward, which a test checks)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, context, cos, sin, cache_keys, cache_values, kv_slots, block_rows, kv_len):
        hidden = hidden + self.self_attn(
            self.input_layernorm(hidden), context, cos, sin, cache_keys, cache_values, kv_slots, block_rows, kv_len
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def _callable_device(fn, default: torch.device) -> torch.device:
    """The device of a module's parameters (a target split over GPUs keeps its embeddings and LM head
    where accelerate put them); ``default`` for a plain function."""
    if isinstance(fn, nn.Module):
        for p in fn.parameters():
            return p.device
    return default


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _validate_config(config) -> None:
    """ValueError naming the first DFlash setting that cannot work."""
    where = "DFlashDraftModel config"
    block_size = _draft_value(config, "block_size", 16)
    # A chain round verifies block_size nodes (its root and block_size - 1 drafted tokens) in one call.
    if not isinstance(block_size, int) or isinstance(block_size, bool) or not 2 <= block_size <= MAX_TREE_NODES:
        raise ValueError(
            f"{where}: block_size must be an int in 2..{MAX_TREE_NODES} (a round verifies at most "
            f"{MAX_TREE_NODES} nodes), got {block_size!r}"
        )
    mask_token_id = _draft_value(config, "mask_token_id")
    if not isinstance(mask_token_id, int) or isinstance(mask_token_id, bool) or mask_token_id < 0:
        raise ValueError(f"{where}: dflash_config.mask_token_id must be a non-negative int, got {mask_token_id!r}")
    ids = _draft_value(config, "target_layer_ids")
    if not isinstance(ids, (list, tuple)) or not ids or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
        raise ValueError(
            f"{where}: dflash_config.target_layer_ids must be a non-empty list of layer indices, got {ids!r}"
        )
    layers = config.num_hidden_layers
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise ValueError(f"{where}: num_hidden_layers must be an int >= 1, got {layers!r}")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if len(layer_types) != config.num_hidden_layers:
            raise ValueError(
                f"{where}: layer_types has {len(layer_types)} entries for {config.num_hidden_layers} layers"
            )
        unknown = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if unknown:
            raise ValueError(f"{where}: layer_types must be {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}, got {unknown}")
        window = getattr(config, "sliding_window", None)
        if SLIDING_ATTENTION in layer_types and not (isinstance(window, int) and window >= 1):
            raise ValueError(
                f"{where}: sliding_attention layers need a positive sliding_window, got {window!r} "
                "(Qwen3Config drops sliding_window unless use_sliding_window=True)"
            )
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"{where}: num_attention_heads ({config.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({config.num_key_value_heads})"
        )


def draft_config_from_dict(raw: dict):
    """A Qwen3Config from a z-lab ``config.json`` dict.

    Explicit ``sliding_attention`` layers keep the checkpoint's ``sliding_window``: Qwen3Config would
    drop it unless ``use_sliding_window`` is set, and z-lab's drafts were trained windowed.
    """
    from transformers import Qwen3Config

    raw = dict(raw)
    if SLIDING_ATTENTION in (raw.get("layer_types") or ()) and raw.get("sliding_window") is not None:
        raw["use_sliding_window"] = True
    return Qwen3Config.from_dict(raw)


class DFlashDraftModel(nn.Module):
    """The DFlash draft (see the module docstring). Weight names are z-lab's: ``layers.{i}.self_attn.
    {q,k,v,o}_proj``, ``layers.{i}.self_attn.{q,k}_norm``, ``layers.{i}.mlp.{gate,up,down}_proj``,
    ``layers.{i}.{input,post_attention}_layernorm``, ``norm``, ``fc``, ``hidden_norm``."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

        _validate_config(config)
        if getattr(config, "layer_types", None) is None:
            config.layer_types = [FULL_ATTENTION] * config.num_hidden_layers
        self.config = config
        self.block_size: int = _draft_value(config, "block_size", 16)
        self.mask_token_id: int = _draft_value(config, "mask_token_id")
        self.target_layer_ids: list[int] = list(_draft_value(config, "target_layer_ids"))
        # The vocabulary the draft was made for, checked against the target's; from_pretrained sets None for a
        # config.json that states none (Qwen3Config would fill in its own default).
        self.vocab_size: int | None = config.vocab_size
        self.input_embedding_scale = float(_draft_value(config, "input_embedding_scale", 1.0))
        self.output_multiplier = float(_draft_value(config, "output_multiplier", 1.0))
        softcap = _draft_value(config, "final_logit_softcapping")
        self.final_logit_softcapping = float(softcap) if softcap is not None and float(softcap) > 0 else None

        hidden = config.hidden_size
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        # Norms, SwiGLUs and projections as fused ops during propose (ddtree_ext.fused); RoPE and attention call them
        # directly.
        self._fusion = LayerFusion(self)

    @property
    def context_hidden_size(self) -> int:
        """Last dim of ``propose``'s context_hidden: len(target_layer_ids) * target hidden size."""
        return self.fc.in_features

    def check_target(self, target_config) -> None:
        """ValueError listing every way this draft cannot serve a target with this TEXT config
        (``hidden_size``, ``num_hidden_layers``, ``vocab_size``)."""
        problems = []
        hidden = target_config.hidden_size
        if hidden != self.config.hidden_size:
            problems.append(
                f"hidden_size: the draft runs on the target's embeddings and LM head at width "
                f"{self.config.hidden_size}, target has {hidden}"
            )
        if len(self.target_layer_ids) * hidden != self.fc.in_features:
            problems.append(
                f"hidden_size: fc takes {self.fc.in_features} = {len(self.target_layer_ids)} taps x "
                f"{self.fc.in_features // len(self.target_layer_ids)}, the target's taps give "
                f"{len(self.target_layer_ids)} x {hidden}"
            )
        if self.vocab_size is not None and self.vocab_size != target_config.vocab_size:
            problems.append(
                f"vocab_size: the draft was made for a vocabulary of {self.vocab_size} tokens, the target has "
                f"{target_config.vocab_size} (a draft of another tokenizer's model would propose meaningless tokens)"
            )
        if self.mask_token_id >= target_config.vocab_size:
            problems.append(
                f"vocab_size: mask_token_id {self.mask_token_id} is outside the target's vocabulary "
                f"of {target_config.vocab_size}"
            )
        num_layers = target_config.num_hidden_layers
        out_of_range = [i for i in self.target_layer_ids if i >= num_layers]
        if out_of_range:
            problems.append(f"target_layer_ids: {out_of_range} out of range for a target of {num_layers} layers")
        if num_layers - 1 in self.target_layer_ids:
            problems.append(
                f"target_layer_ids: the target's last layer ({num_layers - 1}) cannot be tapped: its HF hidden "
                "state is post-norm, the target adapter records raw layer outputs"
            )
        expected_layers = _draft_value(self.config, "num_target_layers")
        if expected_layers is not None and expected_layers != num_layers:
            problems.append(
                f"num_target_layers: the draft was trained for {expected_layers} target layers, target has {num_layers}"
            )
        if problems:
            raise ValueError("DFlashDraftModel.check_target: " + "; ".join(problems))

    def new_cache(self, batch_size: int = 1, *, capacity: int) -> DFlashDraftCache:
        """An empty cache (length 0) with room for ``capacity`` rows: context positions plus one
        block (and the padding rows of a padded call, see :meth:`propose`)."""
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < self.block_size:
            raise ValueError(
                f"DFlashDraftModel.new_cache: capacity must be an int >= block_size ({self.block_size}), got {capacity!r}"
            )
        attn = self.layers[0].self_attn
        like = self.fc.weight
        shape = (batch_size, attn.num_kv_heads, capacity, attn.head_dim)
        keys = [like.new_zeros(shape) for _ in self.layers]
        values = [like.new_zeros(shape) for _ in self.layers]
        cos, sin = rope_table(self.rotary_emb, capacity, like.dtype) or (None, None)
        length = torch.zeros(batch_size, dtype=torch.int64, device=like.device)
        return DFlashDraftCache(keys, values, length, cos, sin)

    def propose(
        self,
        context_hidden: torch.Tensor,
        bonus_token: torch.Tensor,
        cache: DFlashDraftCache,
        *,
        embed_tokens: Callable[[torch.Tensor], torch.Tensor],
        lm_head: Callable[[torch.Tensor], torch.Tensor],
        num_context: torch.Tensor | None = None,
        kv_len: int | None = None,
        float32_logits: bool = True,
    ) -> torch.Tensor:
        """Append context rows to the cache and draft the block after the bonus token.

        context_hidden: [B, T, context_hidden_size] (T >= 1), the concat in target_layer_ids order of
            the target's tapped layer outputs for the newly committed positions cache.length ..
            cache.length + n - 1, where n = T, or num_context[b] when given: then only the first
            num_context[b] rows of row b are real and the rest padding (T <= block_size), so a
            fixed-shape call serves any count. They become permanent context (cache.length += n).
        bonus_token: [B] int64, the root token, at position cache.length (after appending).
        embed_tokens / lm_head: the target's token embedding and LM head (any device; same dtype).
        num_context: optional [B] integer tensor on the draft's device, 1 <= num_context <= T.
        kv_len: cache rows the attention reads, >= every row's cache.length + n + block_size and
            <= capacity. None reads the lengths from the device to pick it (and checks the capacity);
            give it (with num_context) for a call with no host read, e.g. under CUDA graph capture.
        float32_logits: False keeps a 16-bit LM head's logits in its dtype where the draft scales or caps none
            (their float32 values are exactly these, converted): for a caller that only ranks them (the round's
            top-K), without writing and reading a float32 copy of [B, block_size - 1, V].
        Returns logits [B, block_size - 1, V] (float32, or see float32_logits) for positions
        cache.length + 1 .. cache.length + block_size - 1. Runs with whatever grad mode the caller set.
        """
        where = "DFlashDraftModel.propose"
        if context_hidden.dim() != 3 or context_hidden.shape[1] < 1 or context_hidden.shape[2] != self.fc.in_features:
            raise ValueError(
                f"{where}: context_hidden must be [B, T >= 1, {self.fc.in_features}], got {tuple(context_hidden.shape)}"
            )
        batch, ctx_len = context_hidden.shape[:2]
        if bonus_token.shape != (batch,) or bonus_token.dtype != torch.int64:
            raise ValueError(
                f"{where}: bonus_token must be [{batch}] int64, got {tuple(bonus_token.shape)} {bonus_token.dtype}"
            )
        if cache.keys[0].shape[0] != batch:
            raise ValueError(f"{where}: cache holds batch size {cache.keys[0].shape[0]}, got {batch}")
        device = self.fc.weight.device
        if num_context is not None:
            if num_context.shape != (batch,) or num_context.dtype.is_floating_point or num_context.device != device:
                raise ValueError(
                    f"{where}: num_context must be an integer [{batch}] tensor on {device}, got "
                    f"{num_context.dtype} {tuple(num_context.shape)} on {num_context.device}"
                )
            if ctx_len > self.block_size:
                raise ValueError(f"{where}: a padded context (num_context given) holds at most block_size = "
                                 f"{self.block_size} rows, got {ctx_len}")
        if kv_len is None:
            # Host reads: the eager convenience. Rows up to length + T (padding) + block are written.
            if num_context is not None and not bool(((num_context >= 1) & (num_context <= ctx_len)).all()):
                raise ValueError(f"{where}: num_context must lie in [1, {ctx_len}], got {num_context.tolist()}")
            need = int(cache.length.max()) + ctx_len + self.block_size
            if need > cache.capacity:
                raise ValueError(f"{where}: cache capacity {cache.capacity} < {need} rows needed")
            kv_len = need
        elif not isinstance(kv_len, int) or isinstance(kv_len, bool) or not 1 <= kv_len <= cache.capacity:
            raise ValueError(f"{where}: kv_len must be an int in [1, {cache.capacity}], got {kv_len!r}")

        # The positions, cache slots, RoPE rows and attention masks need only the lengths: on a side stream
        # (fused.Fork) they run beside the context projection, the call's first GEMM, instead of before it.
        fork = Fork(device, "draft")
        with fork.side():
            appended = num_context.to(torch.int64) if num_context is not None else torch.full_like(cache.length, ctx_len)
            steps = torch.arange(max(ctx_len, self.block_size), device=device)
            context_rows = cache.length[:, None] + steps[:ctx_len]
            start = cache.length + appended  # position of the bonus token, [B]
            block_rows = start[:, None] + steps[: self.block_size]
            # Where each context and block row's K/V goes. A padding context row (past num_context) is not stored:
            # the block's rows, which start right after the real context rows, cover its cache row.
            kv_slots = torch.cat([torch.where(steps[:ctx_len] < appended[:, None], context_rows, -1), block_rows], dim=1)
            positions = torch.cat([context_rows, block_rows], dim=1)
            rope = None
            if cache.cos is not None and cache.cos.dtype == self.fc.weight.dtype and rope_table_serves(self.rotary_emb):
                rope = rope_rows(cache.cos, cache.sin, positions)
            # One mask per attention rule (causal, window), not per layer.
            masks = {}
            for layer in self.layers:
                attn = layer.self_attn
                rule = (attn.is_causal, attn.sliding_window)
                if rule not in masks:
                    masks[rule] = attn.mask(block_rows, kv_len)
        prelude = _Prelude(fork, appended, block_rows, kv_slots, positions, rope, masks)

        with self._fusion.active():
            logits = self._forward_block(context_hidden, bonus_token, cache, embed_tokens, lm_head, prelude, kv_len,
                                         float32_logits)
        # Only now the context rows count as appended: a call that raised before this line leaves the
        # cache as it was (the rows it wrote are scratch), so a retry does not append them twice.
        cache.length += appended
        return logits

    def _forward_block(self, context_hidden, bonus_token, cache, embed_tokens, lm_head, prelude, kv_len,
                       float32_logits=True) -> torch.Tensor:
        """The layers over the context rows and the block (propose's arguments; ``prelude``: what propose computed
        on its side stream); returns the logits."""
        batch, device, dtype = bonus_token.shape[0], self.fc.weight.device, self.fc.weight.dtype
        projected = self.fc(context_hidden.to(device=device, dtype=dtype))
        ctx_len = projected.shape[1]
        rows = None
        if self._one_rows_buffer(batch):
            rows = projected.new_empty(batch, ctx_len + self.block_size, projected.shape[2])
            context = norm_into(self.hidden_norm, projected, rows[:, :ctx_len])
        else:
            context = self.hidden_norm(projected)
        block_ids = bonus_token.new_full((batch, self.block_size), self.mask_token_id)
        block_ids[:, 0] = bonus_token
        embed_device = _callable_device(embed_tokens, device)
        hidden = embed_tokens(block_ids.to(embed_device))
        if self.input_embedding_scale != 1.0:  # a product by 1 is a copy: one launch a round for nothing
            hidden = hidden * self.input_embedding_scale
        hidden = hidden.to(device=device, dtype=dtype)
        first_norm = self.layers[0].input_layernorm
        normed = first_norm(hidden) if rows is None else norm_into(first_norm, hidden, rows[:, ctx_len:])
        prelude.join()
        rope = prelude.rope if prelude.rope is not None else self.rotary_emb(hidden, prelude.positions)
        cos, sin = (t.unsqueeze(1) for t in rope)
        normed = self._run_layers(normed, hidden, context, cos, sin, cache, prelude, kv_len, rows=rows)
        logits = lm_head(normed.to(_callable_device(lm_head, device)))
        scaled = self.output_multiplier != 1.0 or self.final_logit_softcapping is not None
        keep = not (float32_logits or scaled) and logits.dtype in (torch.float16, torch.bfloat16)
        logits = (logits if keep else logits.float()).to(device)
        if self.output_multiplier != 1.0:
            logits = logits * self.output_multiplier
        if self.final_logit_softcapping is not None:
            logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
        return logits

    def _one_rows_buffer(self, batch: int) -> bool:
        """Whether the norms write the rows [context ; block] that every layer's K/V projection reads into one buffer,
        where each layer would concatenate them (one launch a layer): each layer's norm then overwrites the block's
        rows that the layers before read. So not under autograd (which keeps those inputs for the backward), nor
        with hooks on the attention or its projections (which see them, or may change them in place); and at batch 1
        only (the rounds'), where either part's rows are one stride apart, as the ops' outputs must be."""
        if batch != 1 or torch.is_grad_enabled():
            return False
        attentions = [layer.self_attn for layer in self.layers]
        return all(_plain_module(module) for attn in attentions
                   for module in (attn, attn.q_proj, attn.k_proj, attn.v_proj))

    def _run_layers(self, normed, hidden, context, cos, sin, cache, prelude, kv_len, rows=None) -> torch.Tensor:
        """The decoder layers and the final norm over the block's hidden states [B, S, hidden] (normed: their first
        input norm; rows: None, or the buffer [context ; normed] whose tail each layer's input norm is written to;
        the other arguments: _forward_block's); returns the normed rows 1 .. S - 1 (row 0 is the bonus token's: no
        logits).

        The layers' own forwards in turn, then the final norm, with two launches fewer per layer: each residual add
        runs fused into the norm after it (the next layer's input norm, the last one into the final norm; the same
        bits as the add, then the norm), and the attention mask is built once per attention rule (causal, window),
        not per layer."""
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            mask = prelude.masks[(attn.is_causal, attn.sliding_window)]
            out = attn(normed, context, cos, sin, cache.keys[i], cache.values[i], prelude.kv_slots, prelude.block_rows,
                       kv_len, mask=mask, rows=rows)
            normed, hidden = add_norm(layer.post_attention_layernorm, out, hidden)
            last = i + 1 == len(self.layers)
            next_norm = self.norm if last else self.layers[i + 1].input_layernorm
            into = None if rows is None or last else rows[:, context.shape[1]:]
            normed, hidden = add_norm(next_norm, layer.mlp(normed), hidden, out=into)
        return normed[:, 1:]

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, dtype: torch.dtype | str | None = None, device=None
    ) -> "DFlashDraftModel":
        """Load a z-lab checkpoint: ``config.json`` + ``model.safetensors`` or a sharded
        ``model.safetensors.index.json``. ``path`` is a local directory; anything else is fetched with
        ``huggingface_hub.snapshot_download``. ``dtype``: one of ``DRAFT_DTYPES`` or its name (``"bfloat16"``), or
        None / ``"auto"``: the config's ``dtype``, else the dtype the weights are stored in; ``device`` defaults to
        the CPU. Every expected weight must be present and no other (ValueError listing them). Bad arguments (a path
        that is neither a directory nor a Hub checkpoint, a dtype the ops do not take, a device this torch cannot
        use) raise ValueError naming them before any weight is read."""
        where = "DFlashDraftModel.from_pretrained"
        dtype = _dtype_argument(dtype)
        if device is not None:
            problem = device_problem(device)
            if problem:
                raise ValueError(f"{where}: device {device!r}: {problem}")
        directory = _checkpoint_directory(path)
        config_file = os.path.join(directory, "config.json")
        if not os.path.isfile(config_file):
            raise ValueError(f"{where}: path: no config.json in {directory}")
        with open(config_file) as f:
            raw = json.load(f)
        if "DFlash2DraftModel" in (raw.get("architectures") or ()):
            raise ValueError(
                f"DFlashDraftModel.from_pretrained({path!s}): DFlash2 drafts (candidate selector, convolutions) "
                "are not supported"
            )
        config = draft_config_from_dict(raw)
        tensors = _read_safetensors(directory)
        device = torch.device(device) if device is not None else torch.device("cpu")
        if dtype is None:
            dtype = _config_dtype(config) or next(iter(tensors.values())).dtype

        with torch.device("meta"):
            model = cls(config)
        model.vocab_size = raw.get("vocab_size")
        expected = {name: p.shape for name, p in model.state_dict().items()}
        missing = sorted(set(expected) - set(tensors))
        unexpected = sorted(set(tensors) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"DFlashDraftModel.from_pretrained({path!s}): checkpoint does not match the config: "
                f"missing weights {_names(missing)}; unexpected weights {_names(unexpected)}"
            )
        wrong_shape = [
            f"{name} {tuple(t.shape)} != {tuple(expected[name])}"
            for name, t in tensors.items()
            if t.shape != expected[name]
        ]
        if wrong_shape:
            raise ValueError(f"DFlashDraftModel.from_pretrained({path!s}): weight shapes differ: {_names(wrong_shape)}")
        model.load_state_dict({n: t.to(device=device, dtype=dtype) for n, t in tensors.items()}, assign=True)
        # The RoPE tables are computed, not stored: build them on the real device.
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        model.rotary_emb = Qwen3RotaryEmbedding(config).to(device)
        return model.eval()


def device_problem(device) -> str:
    """Why the models cannot run on ``device`` (a torch.device, its name or a CUDA index), or "" if they can: the ops
    run on a CPU or a CUDA GPU that this torch can use."""
    try:
        # A bare index names a CUDA GPU (torch.device(0) means the current accelerator, and fails in a CPU build).
        is_index = isinstance(device, int) and not isinstance(device, bool)
        device = torch.device("cuda", device) if is_index else torch.device(device)
    except (RuntimeError, TypeError):
        return "not a device (e.g. 'cpu', 'cuda', 'cuda:1')"
    if device.type == "cpu":
        return ""
    if device.type != "cuda":
        return "the models run on a CPU or a CUDA GPU"
    if not torch.cuda.is_available():
        return "no CUDA GPU is available to this torch"
    if device.index is not None and device.index >= torch.cuda.device_count():
        return f"this machine has {torch.cuda.device_count()} CUDA GPU(s)"
    return ""


def _checkpoint_directory(path) -> str:
    """from_pretrained's path as a local directory: the path itself, or a Hugging Face Hub id downloaded (only its
    JSON and safetensors files). A path that names no directory here and cannot be a Hub id is refused."""
    where = "DFlashDraftModel.from_pretrained"
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{where}: path must be a directory or a Hugging Face Hub id (str or os.PathLike), got "
                         f"{type(path).__name__}")
    directory = os.fspath(path)
    if os.path.isdir(directory):
        return directory
    if os.path.exists(directory):
        raise ValueError(f"{where}: path {directory!r} is a file; give the checkpoint's directory")
    # A Hub id is "name" or "namespace/name": anything else (absolute, ./, ~, more separators) meant a local folder.
    parts = directory.split("/")
    local = os.path.isabs(directory) or directory.startswith((".", "~")) or "\\" in directory
    if local or len(parts) > 2 or "" in parts:
        raise ValueError(f"{where}: path {directory!r}: no such directory")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(directory, allow_patterns=["*.json", "*.safetensors"])
    except Exception as e:  # the Hub's own errors vary (unknown repo, offline, no network): name the argument
        raise ValueError(f"{where}: path {directory!r} is not a local directory, and no checkpoint of that id came "
                         f"from the Hugging Face Hub ({type(e).__name__}: {e})") from e


def _config_dtype(config) -> torch.dtype | None:
    """The dtype a config.json declares (transformers reads older files' ``torch_dtype`` into it)."""
    declared = getattr(config, "dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return declared if isinstance(declared, torch.dtype) else None


def _dtype_argument(dtype) -> Optional[torch.dtype]:
    """from_pretrained's dtype as a floating torch dtype, or None for the checkpoint's (None, "auto"); names as HF
    takes them ("bfloat16", "torch.bfloat16")."""
    if dtype is None or dtype == "auto":
        return None
    value = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if value not in DRAFT_DTYPES:
        raise ValueError(
            "DFlashDraftModel.from_pretrained: dtype must be None, 'auto', or one of "
            f"{', '.join(str(t).removeprefix('torch.') for t in DRAFT_DTYPES)} as a torch.dtype or its name "
            f"(e.g. torch.bfloat16 or 'bfloat16'), got {dtype!r}"
        )
    return value


def _names(names: list[str], limit: int = 20) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _read_safetensors(directory: str) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (one file or an index of shards), names without a
    leading ``model.``."""
    from safetensors.torch import load_file

    single = os.path.join(directory, "model.safetensors")
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with open(index) as f:
            files = sorted({os.path.join(directory, shard) for shard in json.load(f)["weight_map"].values()})
    else:
        raise ValueError(
            f"DFlashDraftModel.from_pretrained: no model.safetensors or model.safetensors.index.json in {directory}"
        )
    tensors = {}
    for file in files:
        for name, tensor in load_file(file).items():
            short = name.removeprefix(_CHECKPOINT_PREFIX)
            if short in tensors:
                raise ValueError(f"DFlashDraftModel.from_pretrained: weight {short!r} appears twice in {directory}")
            tensors[short] = tensor
    return tensors
