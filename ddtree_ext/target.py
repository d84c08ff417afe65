"""The target model behind one interface: prefill, chain forward, tree verify and commit.

Wraps the real Hugging Face classes (``SUPPORTED_ARCHITECTURES``) without copying their layers.
Prefill and chain forwards are the stock HF forward, so they are exact by construction. A tree verify
is ONE stock forward over the N tree nodes in which

* the full-attention layers get the tree's 4D mask over the whole cache (their K/V for node i land at
  cache slot prefix_len + i through the normal cache update), and
* every Gated DeltaNet (GDN) layer runs a tree forward instead of its own: the same projections,
  norm and output as ``Qwen3_5GatedDeltaNet.forward``, but the causal conv and the delta rule run along
  each root-to-node path (``tree_conv1d``, ``tree_gated_delta_rule``) from the committed conv and
  recurrent states, which they only read.

``commit`` then makes the accepted path the committed state in place (K/V compaction, GDN state and
conv window updates from the verify stash), so the cache is what a chain forward over the accepted
tokens would have left.

What this relies on in transformers (checked on 5.17 and 5.24):

* ``DynamicCache(config=text_config)`` holds one layer object per decoder layer. Full-attention layers
  keep ``.keys`` / ``.values`` [B, H_kv, S, Dh] and grow by concatenation; the adapter compacts them
  with ``commit_kv`` and cuts them by assigning sliced tensors (never ``cache.crop()``: on a hybrid
  cache it raises or cannot roll the GDN state back).
* GDN layers keep ``.conv_states[0]`` [B, C, W] (the last W pre-conv inputs, oldest first, model dtype;
  W = conv kernel size; zero-padded on the left after a prompt shorter than W) and
  ``.recurrent_states[0]`` [B, HV, K, V] float32, both updated in place by the stock forward; a
  layer's ``.has_previous_state[0]`` turns true at its first forward. 5.24 adds the accessors
  ``get_conv_state`` / ``get_recurrent_state`` that 5.17 lacks, so the adapter reads the attributes.
* The text model takes ``attention_mask`` as a dict keyed by layer type and passes each entry to the
  layers unchanged, and 2D ``position_ids`` (expanded to the M-RoPE rows by Qwen3.5's text model).
  5.24 names the cache argument ``cache``, 5.17 ``past_key_values``: the adapter reads the name from
  the text model's signature.
* ``Qwen3_5GatedDeltaNet`` exposes ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``,
  ``conv1d``, ``A_log``, ``dt_bias``, ``norm``, ``out_proj`` and the head sizes.
* Rounding points follow HF's torch kernels (its fallbacks when causal-conv1d / fla are not installed):
  the conv is rounded to the model dtype before its activation. With causal-conv1d installed HF
  applies the activation in float32 inside the kernel, and bf16 chains and trees then differ by ulps.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.activations import ACT2FN

from ddtree_ext import ops
from ddtree_ext.ops import GDNTreeOutput, Tree, Walk

# The op functions the adapter calls (tree_attention_mask, tree_conv1d, tree_gated_delta_rule,
# commit_kv, commit_gdn_state, commit_conv_state) all go through this one name.
_ops = ops

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")

_FULL_ATTENTION = "full_attention"
_LINEAR_ATTENTION = "linear_attention"
# Attention implementations that take an arbitrary 4D mask, and how they read it: sdpa a bool mask
# (True = attend), eager an additive float mask in the model dtype (a bool mask there is silently wrong).
_TREE_MASK_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass
class _VerifyStash:
    """What ``verify`` leaves for ``commit``: the tree's node count N and, per GDN layer index, the
    pre-conv inputs x [B, N, C] and the tree delta rule's output with its stash."""

    num_nodes: int
    conv_input: Dict[int, torch.Tensor] = field(default_factory=dict)
    gdn: Dict[int, GDNTreeOutput] = field(default_factory=dict)


@dataclass
class TargetState:
    """The target's caches for one generation.

    cache: the HF ``DynamicCache`` (attention K/V, GDN conv and recurrent states);
    prefix_len [B] int64: tokens already run through the target and committed to the cache.
    Between ``verify`` and ``commit`` the cache also holds the N tree nodes' K/V and the stash.
    """

    cache: object
    prefix_len: torch.Tensor
    pending: Optional[_VerifyStash] = None


@contextlib.contextmanager
def record_layer_outputs(
    layers: Sequence[torch.nn.Module], layer_ids: Sequence[int]
) -> Iterator[Dict[int, torch.Tensor]]:
    """Forward hooks on ``layers[i]`` for i in ``layer_ids``, recording each one's output [B, T, hidden]
    by layer index (HF ``hidden_states[i + 1]`` for all but the last layer) while the context is open.

    The one implementation of the taps: the adapter and the tiny drafts' training data both use it.
    A layer returning a tuple (older transformers) records its first element.
    """
    recorded: Dict[int, torch.Tensor] = {}

    def hook_for(layer_id):
        def hook(module, args, output):
            recorded[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [layers[i].register_forward_hook(hook_for(i)) for i in set(layer_ids)]
    try:
        yield recorded
    finally:
        for h in handles:
            h.remove()


class TargetAdapter:
    """A supported HF causal LM seen as prefill / forward_chain / verify / commit (see module docstring).

    ``tap_layer_ids`` are 0-based decoder layers whose outputs are returned, concatenated in the given
    order, as ``taps`` [B, T, len(tap_layer_ids) * hidden_size] (HF ``hidden_states[id + 1]``).
    Batch size 1 only: rows would accept paths of different lengths, which the dynamic cache cannot hold.
    """

    def __init__(self, model: torch.nn.Module, tap_layer_ids: Sequence[int] = ()):
        arch = type(model).__name__
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"TargetAdapter: model: unsupported architecture {arch}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self.model = model
        # Qwen3_5ForConditionalGeneration keeps its text model one level deeper; prompts are text only.
        self.text_model = model.model.language_model if arch == "Qwen3_5ForConditionalGeneration" else model.model
        self.config = self.text_model.config
        self.embed_tokens = self.text_model.embed_tokens
        self.lm_head = model.lm_head
        self.vocab_size = self.config.vocab_size
        self.hidden_size = self.config.hidden_size
        self.num_layers = self.config.num_hidden_layers
        self.max_position_embeddings = self.config.max_position_embeddings

        self.layer_types = list(self.config.layer_types)
        unknown = sorted(set(self.layer_types) - {_FULL_ATTENTION, _LINEAR_ATTENTION})
        if unknown:
            raise ValueError(
                f"TargetAdapter: model: layer types {unknown} are not supported (only {_FULL_ATTENTION!r} and "
                f"{_LINEAR_ATTENTION!r}; e.g. sliding-window attention would need a windowed tree mask)"
            )
        self.is_hybrid = _LINEAR_ATTENTION in self.layer_types
        self.attention_layer_ids = [i for i, t in enumerate(self.layer_types) if t == _FULL_ATTENTION]
        self.gdn_layer_ids = [i for i, t in enumerate(self.layer_types) if t == _LINEAR_ATTENTION]

        attn_impl = self.config._attn_implementation
        if attn_impl not in _TREE_MASK_IMPLEMENTATIONS:
            raise ValueError(
                f"TargetAdapter: model: attention implementation {attn_impl!r} cannot take a tree mask; load the model "
                f"with attn_implementation in {_TREE_MASK_IMPLEMENTATIONS}"
            )
        self._mask_dtype = torch.bool if attn_impl == "sdpa" else self.embed_tokens.weight.dtype

        self.tap_layer_ids = [int(i) for i in tap_layer_ids]
        bad = [i for i in self.tap_layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"TargetAdapter: tap_layer_ids: {bad} out of range for a model with {self.num_layers} decoder layers"
            )
        # The hooks record a layer's raw output, which is HF's hidden_states[id + 1] except for the last
        # layer: hidden_states[num_layers] is after the final norm, and that is what a draft reads there.
        if self.num_layers - 1 in self.tap_layer_ids:
            raise ValueError(
                f"TargetAdapter: tap_layer_ids: the last decoder layer ({self.num_layers - 1}) cannot be tapped "
                f"(its HF hidden state is post-norm); tap layers 0..{self.num_layers - 2}"
            )
        params = inspect.signature(self.text_model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        """Where the embeddings (and so the token inputs and prefix_len) live."""
        return self.embed_tokens.weight.device

    # ---- state -----------------------------------------------------------------------------------

    def new_state(self, batch_size: int = 1) -> TargetState:
        """An empty state: a fresh HF ``DynamicCache`` of the model's layer types, prefix_len [B] = 0."""
        if batch_size != 1:
            raise ValueError(f"TargetAdapter.new_state: batch_size must be 1, got {batch_size}")
        return TargetState(
            cache=DynamicCache(config=self.config),
            prefix_len=torch.zeros(batch_size, dtype=torch.int64, device=self.device),
        )

    # ---- forwards ----------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, state: TargetState) -> Tuple[torch.Tensor, torch.Tensor]:
        """Stock forward over the prompt input_ids [B, T] int64 on an empty state.

        Returns (logits [B, V] float32 at the last prompt position, taps [B, T, n_taps * hidden]);
        prefix_len becomes T.
        """
        self._check_tokens("prefill", input_ids, state)
        if int(state.prefix_len.max()) != 0:
            raise ValueError("TargetAdapter.prefill: state must be empty (use forward_chain to extend it)")
        hidden, taps = self._run_chain(input_ids, state)
        return self.lm_head(hidden[:, -1]).float(), taps

    @torch.no_grad()
    def forward_chain(self, tokens: torch.Tensor, state: TargetState) -> Tuple[torch.Tensor, torch.Tensor]:
        """Stock forward of tokens [B, T] int64 appended after prefix_len (exact for chains).

        Returns (logits [B, T, V] float32, taps [B, T, n_taps * hidden]); prefix_len += T.
        """
        self._check_tokens("forward_chain", tokens, state)
        hidden, taps = self._run_chain(tokens, state)
        return self.lm_head(hidden).float(), taps

    @torch.no_grad()
    def verify(self, tree: Tree, state: TargetState) -> Tuple[torch.Tensor, torch.Tensor]:
        """ONE forward over the tree's N nodes (tokens tree.token, positions tree.position).

        Full-attention layers see the tree mask (committed prefix + ancestors); their node K/V land at
        cache slots prefix_len + i. GDN layers run the tree conv and delta rule from the committed
        states without modifying them and stash what ``commit`` needs. Returns (logits [B, N, V] float32,
        taps [B, N, n_taps * hidden]); prefix_len unchanged. Must be followed by ``commit``.
        """
        self._check_tokens("verify", tree.token, state)
        if int(state.prefix_len.min()) < 1:
            raise ValueError("TargetAdapter.verify: the state holds no committed tokens; call prefill first")
        if not torch.equal(tree.position[:, 0], state.prefix_len):
            raise ValueError(
                f"TargetAdapter.verify: tree root position {tree.position[:, 0].tolist()} != the state's prefix_len "
                f"{state.prefix_len.tolist()} (tree built for another prefix)"
            )
        num_nodes = tree.token.shape[1]
        kv_len = int(state.prefix_len.max()) + num_nodes
        mask = _ops.tree_attention_mask(tree.ancestor_mask, state.prefix_len, kv_len, dtype=self._mask_dtype)
        masks = {_FULL_ATTENTION: mask, _LINEAR_ATTENTION: None}
        stash = _VerifyStash(num_nodes)
        try:
            with self._tree_gdn_forwards(state, tree.parent, stash):
                hidden, taps = self._run(tree.token, tree.position, masks, state)
        except BaseException:
            # Nodes already appended by attention layers that ran before the failure: drop them.
            self._truncate_attention(state, int(state.prefix_len.max()))
            raise
        state.pending = stash
        return self.lm_head(hidden).float(), taps

    @torch.no_grad()
    def commit(self, walk: Walk, state: TargetState) -> None:
        """Make the accepted path of the last ``verify`` the committed state, in place.

        walk.accepted [B, D] int32 (root first), walk.accept_len [B] int32. Attention K/V of the path
        move to slots prefix_len .. prefix_len + accept_len - 1 and the rest of the tree is dropped; GDN
        recurrent states and conv windows advance along the path. Afterwards the state is what
        forward_chain over the accepted tokens would have produced; prefix_len += accept_len.
        A walk that is not a path of the verified tree (see ``_check_walk``) raises ValueError before
        any write, leaving the verified state committable; checking it reads the walk to the host.
        """
        stash = state.pending
        if stash is None:
            raise ValueError("TargetAdapter.commit: no verified tree to commit; call verify first")
        # The commit ops each check the walk, but K/V, GDN states and conv windows are written by three
        # calls: a walk the second one refused would leave the first one's writes behind.
        self._check_walk(walk, state, stash.num_nodes)
        cache = state.cache
        kv = [t for i in self.attention_layer_ids for t in (cache.layers[i].keys, cache.layers[i].values)]
        if kv:
            _ops.commit_kv(kv, state.prefix_len, walk.accepted, walk.accept_len)
        if self.gdn_layer_ids:
            gdn = [stash.gdn[i] for i in self.gdn_layer_ids]
            _ops.commit_gdn_state(
                [cache.layers[i].recurrent_states[0] for i in self.gdn_layer_ids],
                [g.stash_u for g in gdn],
                [g.stash_k for g in gdn],
                [g.stash_cumg for g in gdn],
                walk.accepted,
                walk.accept_len,
            )
            _ops.commit_conv_state(
                [cache.layers[i].conv_states[0] for i in self.gdn_layer_ids],
                [stash.conv_input[i] for i in self.gdn_layer_ids],
                walk.accepted,
                walk.accept_len,
            )
        state.prefix_len += walk.accept_len.to(torch.int64)
        self._truncate_attention(state, int(state.prefix_len.max()))
        state.pending = None

    # ---- internals ---------------------------------------------------------------------------------

    def _check_tokens(self, op: str, tokens: torch.Tensor, state: TargetState) -> None:
        if tokens.dim() != 2 or tokens.shape[1] < 1:
            raise ValueError(f"TargetAdapter.{op}: tokens must have shape [B, T] with T >= 1, got {list(tokens.shape)}")
        if tokens.shape[0] != state.prefix_len.shape[0]:
            raise ValueError(
                f"TargetAdapter.{op}: batch {tokens.shape[0]} does not match the state's batch "
                f"{state.prefix_len.shape[0]}"
            )
        if state.pending is not None:
            raise ValueError(f"TargetAdapter.{op}: the last verify is not committed yet; call commit first")

    def _check_walk(self, walk: Walk, state: TargetState, num_nodes: int) -> None:
        """ValueError unless ``walk`` is a path of the verified tree: accepted [B, D] int32 (D >= 1) and
        accept_len [B] int32 on the target's device, 1 <= accept_len <= D, and the first accept_len
        entries node indices in [0, num_nodes), strictly increasing."""
        op = "TargetAdapter.commit"
        accepted, accept_len = walk.accepted, walk.accept_len
        batch = state.prefix_len.shape[0]
        if accepted.dtype != torch.int32 or accepted.dim() != 2 or accepted.shape[0] != batch or accepted.shape[1] < 1:
            raise ValueError(
                f"{op}: walk.accepted must be int32 [{batch}, D >= 1], got {accepted.dtype} {list(accepted.shape)}"
            )
        if accept_len.dtype != torch.int32 or tuple(accept_len.shape) != (batch,):
            raise ValueError(
                f"{op}: walk.accept_len must be int32 [{batch}], got {accept_len.dtype} {list(accept_len.shape)}"
            )
        for name, t in (("accepted", accepted), ("accept_len", accept_len)):
            if t.device != self.device:
                raise ValueError(f"{op}: walk.{name} is on {t.device}, the target on {self.device}")
        # One host read of the path (a device sync on GPUs, where the ops do not check values); it is
        # [B, D + 1] integers, next to a round's own read of the same walk.
        rows = torch.cat([accept_len[:, None], accepted], dim=1).tolist()
        max_accept = accepted.shape[1]
        for b, (length, *path) in enumerate(rows):
            if not 1 <= length <= max_accept:
                raise ValueError(f"{op}: walk.accept_len[{b}] must be in [1, {max_accept}], got {length}")
            path = path[:length]
            if not all(0 <= node < num_nodes for node in path) or any(x >= y for x, y in zip(path, path[1:])):
                raise ValueError(
                    f"{op}: walk.accepted[{b}, :{length}] must be strictly increasing node indices in "
                    f"[0, {num_nodes}), got {path}"
                )

    def _run_chain(self, tokens: torch.Tensor, state: TargetState) -> Tuple[torch.Tensor, torch.Tensor]:
        """Stock causal forward of tokens after prefix_len; advances prefix_len."""
        steps = torch.arange(tokens.shape[1], device=tokens.device)
        hidden, taps = self._run(tokens, state.prefix_len[:, None] + steps, None, state)
        state.prefix_len += tokens.shape[1]
        return hidden, taps

    def _run(self, tokens, position_ids, attention_mask, state) -> Tuple[torch.Tensor, torch.Tensor]:
        """One text-model forward; returns (final hidden states [B, T, hidden], taps)."""
        with record_layer_outputs(self.text_model.layers, self.tap_layer_ids) as recorded:
            out = self.text_model(
                input_ids=tokens,
                position_ids=position_ids,
                attention_mask=attention_mask,
                use_cache=True,
                **{self._cache_kwarg: state.cache},
            )
        hidden = out.last_hidden_state
        if not self.tap_layer_ids:
            return hidden, hidden.new_empty(*hidden.shape[:2], 0)
        return hidden, torch.cat([recorded[i] for i in self.tap_layer_ids], dim=-1)

    @contextlib.contextmanager
    def _tree_gdn_forwards(self, state: TargetState, parent: torch.Tensor, stash: _VerifyStash) -> Iterator[None]:
        """Replace every GDN layer's forward (per instance) by its tree forward; restore on exit."""
        cache = state.cache
        swapped: List[Tuple[torch.nn.Module, object]] = []
        missing = object()
        try:
            for i in self.gdn_layer_ids:
                gdn = self.text_model.layers[i].linear_attn

                def tree_forward(hidden_states, *args, _gdn=gdn, _i=i, **kwargs):
                    layer = cache.layers[_i]
                    out, stash.conv_input[_i], stash.gdn[_i] = _gdn_tree_forward(
                        _gdn, hidden_states, layer.conv_states[0], layer.recurrent_states[0], parent
                    )
                    return out

                # An instance attribute may already wrap forward (e.g. accelerate hooks): put it back after.
                swapped.append((gdn, gdn.__dict__.get("forward", missing)))
                gdn.forward = tree_forward
            yield
        finally:
            for gdn, previous in swapped:
                if previous is missing:
                    del gdn.forward
                else:
                    gdn.forward = previous

    def _truncate_attention(self, state: TargetState, length: int) -> None:
        """Keep the first ``length`` K/V slots of every full-attention layer."""
        for i in self.attention_layer_ids:
            layer = state.cache.layers[i]
            if layer.keys is not None and layer.keys.shape[-2] > length:
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]


def _gdn_tree_forward(
    gdn: torch.nn.Module,
    hidden_states: torch.Tensor,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    parent: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor, GDNTreeOutput]:
    """``Qwen3_5GatedDeltaNet.forward`` over the N tree nodes, each node seeing only its path.

    hidden_states [B, N, hidden] (after the layer's input norm), conv_state [B, C, W] and
    recurrent_state [B, HV, K, V] float32 (the committed states, read only), parent [B, N] int32.
    Returns (layer output [B, N, hidden], pre-conv inputs x [B, N, C], the delta rule's
    :class:`GDNTreeOutput`). Casts and rounding points follow the HF forward: beta is the sigmoid in the
    model dtype, g = -exp(A_log) * softplus(a + dt_bias) in float32.
    """
    if recurrent_state.dtype != torch.float32:
        raise ValueError(f"TargetAdapter.verify: GDN recurrent state must be float32, got {recurrent_state.dtype}")
    batch, num_nodes, _ = hidden_states.shape
    mixed_qkv = gdn.in_proj_qkv(hidden_states)
    z = gdn.in_proj_z(hidden_states).reshape(batch, num_nodes, -1, gdn.head_v_dim)
    b = gdn.in_proj_b(hidden_states)
    a = gdn.in_proj_a(hidden_states)

    # HF's torch conv (causal_conv1d_fn / causal_conv1d_update fallbacks) rounds the conv to the model
    # dtype before the activation; doing the same keeps bf16 tree logits equal to the chain's.
    conv = _ops.tree_conv1d(mixed_qkv, gdn.conv1d.weight.squeeze(1), gdn.conv1d.bias, conv_state, parent, silu=False)
    conv_out = ACT2FN[gdn.activation](conv)
    query, key, value = torch.split(conv_out, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
    query = query.reshape(batch, num_nodes, -1, gdn.head_k_dim)
    key = key.reshape(batch, num_nodes, -1, gdn.head_k_dim)
    value = value.reshape(batch, num_nodes, -1, gdn.head_v_dim)

    beta = b.sigmoid().float()
    g = -gdn.A_log.float().exp() * F.softplus(a.float() + gdn.dt_bias)
    delta = _ops.tree_gated_delta_rule(query, key, value, g, beta, recurrent_state, parent, use_qk_l2norm=True)

    core = gdn.norm(delta.out.reshape(-1, gdn.head_v_dim), z.reshape(-1, gdn.head_v_dim))
    return gdn.out_proj(core.reshape(batch, num_nodes, -1)), mixed_qkv, delta
