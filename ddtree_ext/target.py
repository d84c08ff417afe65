"""The target model behind one interface: prefill, then rounds of tree verify and commit.

Wraps the real Hugging Face classes (``SUPPORTED_ARCHITECTURES``) without copying their layers, on
static buffers allocated once per generation (:class:`TargetState`): attention K/V of every
full-attention layer up to a capacity, GDN conv windows and recurrent states, and ``prefix_len`` as a
device tensor. Nothing in a round grows, allocates by data or reads the device from the host, so a
round can be captured in a CUDA graph and replayed (``ddtree_ext.round``).

* ``prefill`` is the stock HF forward with a fresh ``DynamicCache`` (exact by construction); its
  caches are then copied into the static buffers.
* ``verify`` is ONE stock forward over the N tree nodes in which the full-attention layers get the
  tree's 4D mask and a cache object (:class:`_StaticAttentionCache`) that writes node i's K/V at slot
  prefix_len + i (a device index) and returns the first ``kv_len`` slots; every Gated DeltaNet (GDN)
  layer runs a tree forward instead of its own: the same projections, norm and output as
  ``Qwen3_5GatedDeltaNet.forward``, but the causal conv and the delta rule run along each root-to-node
  path (``tree_conv1d``, ``tree_gated_delta_rule``) from the committed states, which they only read.
* ``commit`` makes the accepted path the committed state in place (K/V compaction, GDN state and conv
  window updates from the verify stash), so the state is what a stock chain forward over the accepted
  tokens would have left; ``forward_chain`` is a verify of a chain followed by its commit.

A target split over several GPUs (``device_map``) works in the eager path: each layer's buffers live on
that layer's device, and the tree tables, mask and walk are copied to it.

What this relies on in transformers (checked on 5.17 and 5.24, the MoE family, Qwen3_5Moe*, on the CPU only: its
attention, GDN, norm and MLP classes have the dense family's source, and the sparse MoE block is called as it is):

* The attention layers' only use of the cache is ``cache.update(key, value, layer_idx, ...)`` returning
  the K/V to attend over; the text models create a ``DynamicCache`` only when given none.
* A prefill with ``DynamicCache(config=text_config)`` leaves, per full-attention layer, ``.keys`` /
  ``.values`` [B, H_kv, T, Dh] and per GDN layer ``.conv_states[0]`` [B, C, W] (the last W pre-conv
  inputs, oldest first, model dtype; W = conv kernel size; zero-padded on the left after a prompt
  shorter than W) and ``.recurrent_states[0]`` [B, HV, K, V] float32.
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
import functools
import inspect
import threading
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from transformers import DynamicCache
from transformers.activations import ACT2FN

from ddtree_ext import ops
from ddtree_ext.fused import (
    OP_DTYPES, SILU_ACTIVATIONS, Fork, LayerFusion, experts_capturable, has_own_forward, is_longrope,
    ops_apply, per_position_longrope, rope_rows, rope_table, rope_table_serves, swapped_forwards,
)
from ddtree_ext.ops import GDNTreeOutput, Tree, Walk
from ddtree_ext.round import kv_bucket

# The op functions the adapter calls (tree_attention_mask, store_kv, gdn_conv_delta_rule, tree_conv1d,
# tree_gated_delta_rule, commit_kv, commit_gdn_state, commit_conv_state) all go through this one name.
_ops = ops

# Whether a GDN layer with a SiLU conv runs its conv and delta rule as one op (``ops.gdn_conv_delta_rule``: one launch
# for an autoregressive step's single node on CUDA), else as tree_conv1d then tree_gated_delta_rule. The same bits
# either way; ``benchmarks/e2e.py --no-fused-gdn-conv`` turns it off for A/B runs.
fuse_gdn_conv = True

SUPPORTED_ARCHITECTURES = (
    "Qwen3ForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
)
# The multimodal wrappers keep their text model one level deeper; prompts are text only.
_MULTIMODAL_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")

_FULL_ATTENTION = "full_attention"
_LINEAR_ATTENTION = "linear_attention"
# Attention implementations that take an arbitrary 4D mask, and how they read it: sdpa a bool mask
# (True = attend), eager an additive float mask in the model dtype (a bool mask there is silently wrong).
_TREE_MASK_IMPLEMENTATIONS = ("sdpa", "eager")
# The largest tree one verify takes (nodes, root included): the compiled ops' limit.
MAX_TREE_NODES = 257
# The widest GDN conv the tree ops take (csrc/verify.cpp, kMaxConvWidth); Qwen3.5 and 3.6 use 4.
MAX_GDN_CONV_WIDTH = 4

@dataclass
class _VerifyStash:
    """What ``verify`` leaves for ``commit``: the tree's node count N and, per GDN layer index, the
    pre-conv inputs x [B, N, C] and the tree delta rule's output with its stash."""

    num_nodes: int
    conv_input: Dict[int, torch.Tensor] = field(default_factory=dict)
    gdn: Dict[int, GDNTreeOutput] = field(default_factory=dict)


@dataclass
class TargetState:
    """The target's static caches for one generation (allocated by ``TargetAdapter.new_state``).

    capacity: cache slots per attention layer (committed tokens + one verify block must fit);
    prefix_len [B] int64 on the adapter's device: tokens run through the target and committed;
    layer_devices: each decoder layer's device when the state was made (its buffers live there);
    keys / values: per full-attention layer index, [B, H_kv, capacity, head_dim] in the model dtype on
    that layer's device (slots >= prefix_len are scratch for the next verify block);
    conv: per GDN layer index, [B, conv_dim, W] pre-conv inputs (model dtype), oldest first;
    recurrent: per GDN layer index, [B, HV, K, V] float32.
    Between ``verify`` and ``commit`` the verify's stash is ``pending``.
    rope: (cos, sin) [capacity, rotary dim] in the model dtype on the rotary embedding's device, its output at every
    slot's position (row = position), which a verify gathers instead of recomputing it; None where the RoPE depends
    on more than the position (see ``fused.rope_table``).
    node_ids: 0 .. MAX_TREE_NODES - 1 (int64, on the adapter's device), the node offsets a verify adds to prefix_len
    for its cache slots (made once: an arange is a launch on a round's critical path).
    """

    capacity: int
    prefix_len: torch.Tensor
    layer_devices: List[torch.device]
    keys: Dict[int, torch.Tensor]
    values: Dict[int, torch.Tensor]
    conv: Dict[int, torch.Tensor]
    recurrent: Dict[int, torch.Tensor]
    pending: Optional[_VerifyStash] = None
    rope: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    node_ids: Optional[torch.Tensor] = None

    def tensors(self) -> Dict[str, torch.Tensor]:
        """Every committed-state tensor by name (keys3, conv0, ...): what tests compare and snapshot."""
        out = {}
        for name, store in (("keys", self.keys), ("values", self.values), ("conv", self.conv), ("recurrent", self.recurrent)):
            out.update({f"{name}{i}": t for i, t in store.items()})
        return out


class _StaticAttentionCache:
    """The cache the HF attention layers see during a verify: ``update`` writes the N new K/V rows of
    layer ``layer_idx`` at slots ``slots`` (a device index [N] on that layer's device) of the static
    buffers and returns their first ``kv_len`` slots."""

    # update(key, value, layer_idx) needs nothing else: the attention layers may run fused.py's attention body (which
    # also stores through slot_buffers and stored).
    fused_attention_body = True

    def __init__(self, state: TargetState, slots: Dict[torch.device, torch.Tensor], kv_len: int):
        self.state, self.slots, self.kv_len = state, slots, kv_len

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values, slots = self.slot_buffers(layer_idx)
        key_states, value_states = key_states.to(keys.dtype), value_states.to(values.dtype)
        if ops_apply(key_states, value_states, keys, values):
            _ops.store_kv(keys, values, slots, key_states, value_states)  # one launch for both
        else:
            keys.index_copy_(2, slots, key_states)
            values.index_copy_(2, slots, value_states)
        return self.stored(layer_idx)

    def slot_buffers(self, layer_idx: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, values, slots): where ``update`` writes layer ``layer_idx``'s new rows, for an op that stores them
        itself (fused.py's attention body: ``ops.qk_norm_rope_store_kv``); :meth:`stored` then gives what ``update``
        returns."""
        keys, values = self.state.keys[layer_idx], self.state.values[layer_idx]
        return keys, values, self.slots[keys.device]

    def stored(self, layer_idx: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The first ``kv_len`` slots of layer ``layer_idx``'s caches: what attention reads."""
        return self.state.keys[layer_idx][:, :, : self.kv_len], self.state.values[layer_idx][:, :, : self.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise RuntimeError("ddtree_ext: the verify cache has no host-side length (positions are always passed)")


@contextlib.contextmanager
def record_layer_outputs(
    layers: Sequence[torch.nn.Module], layer_ids: Sequence[int]
) -> Iterator[Dict[int, torch.Tensor]]:
    """Forward hooks on ``layers[i]`` for i in ``layer_ids``, recording each one's output [B, T, hidden]
    by layer index (HF ``hidden_states[i + 1]`` for all but the last layer) while the context is open.

    The one implementation of the taps: the adapter and the tiny drafts' training data both use it.
    A layer returning a tuple (older transformers) records its first element. Only forwards in the thread that
    opened the context record: hooks run for every caller, and another thread's forward on the same model
    meanwhile (HF's own, see generate's thread notes) would otherwise replace this thread's taps.
    """
    recorded: Dict[int, torch.Tensor] = {}
    owner = threading.get_ident()

    def hook_for(layer_id):
        def hook(module, args, output):
            if threading.get_ident() == owner:
                recorded[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [layers[i].register_forward_hook(hook_for(i)) for i in set(layer_ids)]
    try:
        yield recorded
    finally:
        for h in handles:
            h.remove()


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter (where its inputs must be)."""
    return next(module.parameters()).device


class TargetAdapter:
    """A supported HF causal LM seen as prefill / verify / commit on static buffers (module docstring).

    ``tap_layer_ids`` are 0-based decoder layers whose outputs are returned, concatenated in the given
    order, as ``taps`` [B, T, len(tap_layer_ids) * hidden_size] (HF ``hidden_states[id + 1]``).
    Batch size 1 only: rows would accept paths of different lengths, which one verify block's slots
    cannot serve.
    """

    def __init__(self, model: torch.nn.Module, tap_layer_ids: Sequence[int] = ()):
        arch = type(model).__name__
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"TargetAdapter: model: unsupported architecture {arch}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self.model = model
        self.text_model = model.model.language_model if arch in _MULTIMODAL_ARCHITECTURES else model.model
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
        # Sparse MoE MLPs (Qwen3.5/3.6 MoE; a dense MLP has no experts): the routed experts run ops.moe_experts in
        # every path where it applies, else HF's experts forward as the config's experts_implementation says (see
        # moe_capturable).
        self._experts = [layer.mlp.experts for layer in self.text_model.layers if hasattr(layer.mlp, "experts")]
        self.is_moe = bool(self._experts)
        self.attention_layer_ids = [i for i, t in enumerate(self.layer_types) if t == _FULL_ATTENTION]
        self.gdn_layer_ids = [i for i, t in enumerate(self.layer_types) if t == _LINEAR_ATTENTION]
        if not self.attention_layer_ids:
            raise ValueError(
                f"TargetAdapter: model: no {_FULL_ATTENTION!r} layer (layer_types {self.layer_types}); transformers' "
                f"hybrid cache needs at least one"
            )
        self._check_gdn_layers("TargetAdapter")

        self._check_attention("TargetAdapter")

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
        # Norms, SwiGLUs, RoPE and GQA attention run as fused ops in verify (ddtree_ext.fused); the prefill
        # stays the stock forward.
        self._fusion = LayerFusion(self.text_model)
        self._head_fusion = LayerFusion(self.lm_head)  # a plain Linear's fused forward (fused.project)

    def _check_gdn_layers(self, where: str) -> None:
        """Refuses GDN layers the tree ops cannot run (``where`` names the caller): weights in a dtype the ops do not
        take (HF computes its delta rule in float32 for any dtype, so a float64 hybrid has no exactness to gain), a
        forward patched onto the instance (the tree forward would replace it), or a conv wider than the ops' window.
        Checked again by ``new_state``, before any forward: a model's dtype can change after the adapter is made."""
        for i in self.gdn_layer_ids:
            gdn = self.text_model.layers[i].linear_attn
            dtypes = {p.dtype for p in (gdn.in_proj_qkv.weight, gdn.conv1d.weight)}
            if not dtypes <= set(OP_DTYPES):
                raise ValueError(
                    f"{where}: model: GDN layer {i} has {', '.join(sorted(map(str, dtypes)))} weights; its tree ops "
                    f"take float32, float16 or bfloat16 (load the model in one of them)"
                )
            if has_own_forward(gdn) and "_hf_hook" not in gdn.__dict__:
                raise ValueError(
                    f"{where}: model: GDN layer {i}'s linear_attn has a forward set on the instance; a tree verify "
                    f"runs the tree GDN forward in its place, so that forward would not run (remove it: del "
                    f"module.forward)"
                )
            width = gdn.conv1d.weight.shape[-1]
            if not 1 <= width <= MAX_GDN_CONV_WIDTH:
                raise ValueError(
                    f"{where}: model: GDN layer {i} has a conv of width {width} (linear_conv_kernel_dim); the tree "
                    f"conv takes widths 1 to {MAX_GDN_CONV_WIDTH}"
                )

    @property
    def experts_implementations(self) -> List[str]:
        """HF's experts_implementation of the sparse MoE layers, read now (``set_experts_implementation`` may have
        changed it since the adapter was made); [] for a dense target."""
        return sorted({str(getattr(getattr(e, "config", None), "_experts_implementation", None)) for e in self._experts})

    @property
    def moe_capturable(self) -> bool:
        """Whether the sparse MoE layers' experts forward keeps to the device, so that a CUDA graph can capture it.

        ``ops.moe_experts`` does: it runs the experts wherever it applies (``fused.experts_op_applies``: HF's SwiGLU
        experts, nothing hooked, on by default; in 16-bit dtypes on compute capability 8.0 or newer), asked per module
        by ``fused.experts_capturable``. Where it does not, HF's experts forward runs, and only its default
        "grouped_mm" on torch's own grouped GEMM kernel keeps to the device: torch runs that kernel for bfloat16 on
        Hopper and Blackwell (sm_90, sm_100); for other dtypes and GPUs its grouped_mm falls back to a loop over the
        groups that copies the offsets to the host, as HF's "eager" implementation reads on the host which experts a
        batch hits. Read now (weights, settings and hooks may have changed since the adapter was made). A dense
        target: True."""
        return all(experts_capturable(e) for e in self._experts)

    @property
    def device(self) -> torch.device:
        """Where the embeddings (and so the token inputs, prefix_len, trees and walks) live."""
        return self.embed_tokens.weight.device

    @property
    def layer_devices(self) -> List[torch.device]:
        """The device of every decoder layer, read now (the model may have moved since the adapter was made)."""
        return [module_device(layer) for layer in self.text_model.layers]

    @property
    def single_device(self) -> bool:
        """True when every layer, the embeddings and the LM head share one device."""
        return {self.device, module_device(self.lm_head), *self.layer_devices} == {self.device}

    # ---- state -----------------------------------------------------------------------------------

    def _check_attention(self, where: str) -> None:
        attn_impl = self.config._attn_implementation
        if attn_impl not in _TREE_MASK_IMPLEMENTATIONS:
            raise ValueError(
                f"{where}: model: attention implementation {attn_impl!r} cannot take a tree mask; load the model "
                f"with attn_implementation in {_TREE_MASK_IMPLEMENTATIONS}"
            )

    @property
    def _mask_dtype(self) -> torch.dtype:
        """The tree mask's dtype for the model's attention implementation now: sdpa takes a bool mask, eager an
        additive one in the model's dtype."""
        if self.config._attn_implementation == "sdpa":
            return torch.bool
        return self.embed_tokens.weight.dtype

    def new_state(self, batch_size: int = 1, *, capacity: int) -> TargetState:
        """Static buffers for one generation of up to ``capacity`` cache slots (prompt + new tokens +
        one verify block), prefix_len [B] = 0. Memory: capacity x the K/V bytes per token, plus the
        fixed GDN states, plus the RoPE table (capacity x 2 x the rotary dim in the model dtype: 8 MB for the 27B
        shape at 32k)."""
        if batch_size != 1:
            raise ValueError(f"TargetAdapter.new_state: batch_size must be 1, got {batch_size}")
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"TargetAdapter.new_state: capacity must be an int >= 1, got {capacity!r}")
        # Again here: a model's dtype and attention implementation can change after the adapter is made.
        self._check_gdn_layers("TargetAdapter.new_state")
        self._check_attention("TargetAdapter.new_state")
        dtype = self.embed_tokens.weight.dtype
        devices = self.layer_devices
        if any(d.type == "meta" for d in [self.device, *devices]):
            raise ValueError(
                "TargetAdapter.new_state: model: some layers are on the meta device (offloaded?); every layer "
                "must sit on a CPU or GPU"
            )
        head_dim = getattr(self.config, "head_dim", None) or self.hidden_size // self.config.num_attention_heads
        kv_shape = (batch_size, self.config.num_key_value_heads, capacity, head_dim)
        state = TargetState(
            capacity=capacity,
            prefix_len=torch.zeros(batch_size, dtype=torch.int64, device=self.device),
            layer_devices=devices,
            keys={}, values={}, conv={}, recurrent={},
            node_ids=torch.arange(MAX_TREE_NODES, device=self.device),
        )
        for i in self.attention_layer_ids:
            # Zeros, not garbage: masked-out slots are still read by the attention kernel, and a NaN
            # there would survive a float mask (0 * NaN).
            state.keys[i] = torch.zeros(kv_shape, dtype=dtype, device=devices[i])
            state.values[i] = torch.zeros(kv_shape, dtype=dtype, device=devices[i])
        for i in self.gdn_layer_ids:
            gdn = self.text_model.layers[i].linear_attn
            device = devices[i]
            state.conv[i] = torch.zeros(batch_size, gdn.conv_dim, gdn.conv_kernel_size, dtype=dtype, device=device)
            state.recurrent[i] = torch.zeros(
                batch_size, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim, dtype=torch.float32, device=device
            )
        state.rope = rope_table(self.text_model.rotary_emb, capacity, dtype, per_position_factors=True)
        return state

    # ---- forwards ----------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, state: TargetState) -> Tuple[torch.Tensor, torch.Tensor]:
        """Stock forward over the prompt input_ids [B, T] int64 on an empty state (a fresh HF
        ``DynamicCache``, copied into the static buffers afterwards).

        Returns (logits [B, V] float32 at the last prompt position, taps [B, T, n_taps * hidden]);
        prefix_len becomes T.
        """
        self._check_tokens("prefill", input_ids, state)
        if int(state.prefix_len.max()) != 0:
            raise ValueError("TargetAdapter.prefill: state must be empty (prefill once per state)")
        length = input_ids.shape[1]
        if length > state.capacity:
            raise ValueError(f"TargetAdapter.prefill: input_ids: {length} tokens exceed the state's capacity {state.capacity}")
        cache = DynamicCache(config=self.config)
        positions = torch.arange(length, device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        hidden, taps = self._run(input_ids, positions, None, cache)
        for i in self.attention_layer_ids:
            state.keys[i][:, :, :length].copy_(cache.layers[i].keys)
            state.values[i][:, :, :length].copy_(cache.layers[i].values)
        for i in self.gdn_layer_ids:
            state.conv[i].copy_(cache.layers[i].conv_states[0])
            state.recurrent[i].copy_(cache.layers[i].recurrent_states[0])
        state.prefix_len += length
        return self._logits(hidden[:, -1]), taps

    @torch.no_grad()
    def verify(self, tree: Tree, state: TargetState, kv_len: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """ONE forward over the tree's N nodes (tokens tree.token, positions tree.position).

        Full-attention layers see the tree mask (committed prefix + ancestors) over the first
        ``kv_len`` cache slots (default: ``min(kv_bucket(prefix_len + N), capacity)``, prefix_len read
        from the device); node i's
        K/V land at slot prefix_len + i. GDN layers run the tree conv and delta rule from the committed
        states without modifying them and stash what ``commit`` needs. Returns (logits [B, N, V]
        float32, taps [B, N, n_taps * hidden]) on the adapter's device; prefix_len unchanged. Must be
        followed by ``commit``. Checks the tree against the state first (host reads); the graph-safe
        round calls ``verify_unchecked``.
        """
        self._check_tokens("verify", tree.token, state)
        num_nodes = tree.token.shape[1]
        if num_nodes > MAX_TREE_NODES:
            raise ValueError(f"TargetAdapter.verify: tree has {num_nodes} nodes, at most {MAX_TREE_NODES} supported")
        prefix = int(state.prefix_len.max())
        if prefix < 1:
            raise ValueError("TargetAdapter.verify: the state holds no committed tokens; call prefill first")
        lowest, highest = (int(v) for v in tree.position.aminmax())
        if lowest < 0 or highest >= state.capacity:
            raise ValueError(
                f"TargetAdapter.verify: tree.position must lie in [0, capacity = {state.capacity}), got "
                f"[{lowest}, {highest}]"
            )
        if not torch.equal(tree.position[:, 0], state.prefix_len):
            raise ValueError(
                f"TargetAdapter.verify: tree root position {tree.position[:, 0].tolist()} != the state's prefix_len "
                f"{state.prefix_len.tolist()} (tree built for another prefix)"
            )
        if kv_len is None:
            kv_len = min(kv_bucket(prefix + num_nodes), state.capacity)
        if not isinstance(kv_len, int) or isinstance(kv_len, bool) or not prefix + num_nodes <= kv_len <= state.capacity:
            raise ValueError(
                f"TargetAdapter.verify: kv_len must be in [prefix_len + N, capacity] = [{prefix + num_nodes}, "
                f"{state.capacity}], got {kv_len} (state capacity too small for this tree?)"
            )
        return self.verify_unchecked(tree, state, kv_len)

    @torch.no_grad()
    def verify_unchecked(
        self, tree: Tree, state: TargetState, kv_len: int, *, float32_logits: bool = True
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``verify`` without its checks: no host reads, no allocation sized by data; capturable in a
        CUDA graph. The caller guarantees prefix_len + N <= kv_len <= capacity and root position =
        prefix_len (garbage otherwise, as for any unchecked kernel). With ``float32_logits=False`` the
        logits stay in the LM head's dtype (their float32 values are exactly these, converted): for a
        caller that only takes their argmax, which is then the same, without writing and reading a
        float32 copy of [B, N, V] (tens of MB a round at a 250k vocabulary)."""
        num_nodes = tree.token.shape[1]
        mask = _ops.tree_attention_mask(tree.ancestor_mask, state.prefix_len, kv_len, dtype=self._mask_dtype)
        masks = {_FULL_ATTENTION: mask, _LINEAR_ATTENTION: None}
        devices = set(state.layer_devices)
        slots = state.prefix_len[0] + state.node_ids[:num_nodes]
        slots_by_device = {d: slots.to(d) for d in devices}
        parent_by_device = {d: tree.parent.to(d) for d in devices}
        stash = _VerifyStash(num_nodes)
        with self._tree_gdn_forwards(state, parent_by_device, stash), self._rope_from_table(state), self._fusion.active():
            hidden, taps = self._run(tree.token, tree.position, masks, _StaticAttentionCache(state, slots_by_device, kv_len))
        logits = self._logits(hidden, float32=float32_logits)
        state.pending = stash  # only once nothing can fail any more: a failed verify leaves none
        return logits, taps

    @torch.no_grad()
    def forward_chain(self, tokens: torch.Tensor, state: TargetState) -> Tuple[torch.Tensor, torch.Tensor]:
        """Tokens [B, T] (1 <= T <= 257) appended after prefix_len: a verify of the chain, then the
        commit of all of it. Returns (logits [B, T, V] float32, taps [B, T, n_taps * hidden]);
        prefix_len += T."""
        self._check_tokens("forward_chain", tokens, state)
        num = tokens.shape[1]
        if num > MAX_TREE_NODES:
            raise ValueError(f"TargetAdapter.forward_chain: tokens: at most {MAX_TREE_NODES} per call, got {num}")
        logits, taps = self.verify(_ops.chain_tree(tokens.to(torch.int64), state.prefix_len), state)
        steps = torch.arange(num, dtype=torch.int32, device=tokens.device)[None].expand(tokens.shape[0], -1)
        self.commit_unchecked(Walk(steps.contiguous(), torch.full_like(steps[:, 0], num), tokens[:, -1]), state)
        return logits, taps

    @torch.no_grad()
    def commit(self, walk: Walk, state: TargetState) -> None:
        """Make the accepted path of the last ``verify`` the committed state, in place.

        walk.accepted [B, D] int32 (root first), walk.accept_len [B] int32. Attention K/V of the path
        move to slots prefix_len .. prefix_len + accept_len - 1; GDN recurrent states and conv windows
        advance along the path. Afterwards the state is what a stock chain forward over the accepted
        tokens would have produced; prefix_len += accept_len.
        A walk that is not a path of the verified tree (see ``_check_walk``) raises ValueError before
        any write, leaving the verified state committable; checking it reads the walk to the host (the
        graph-safe round calls ``commit_unchecked`` on walks its own walk op produced).
        """
        stash = state.pending
        if stash is None:
            raise ValueError("TargetAdapter.commit: no verified tree to commit; call verify first")
        # The CPU commit ops check the walk's values but the CUDA kernels cannot (no host reads), and K/V,
        # GDN states and conv windows are written by several calls: check the whole walk here, first.
        self._check_walk(walk, state, stash.num_nodes)
        self.commit_unchecked(walk, state)

    @torch.no_grad()
    def commit_unchecked(self, walk: Walk, state: TargetState) -> None:
        """``commit`` without the host-side walk check; capturable in a CUDA graph. One launch per state
        kind and device."""
        stash = state.pending
        for device, ids in _by_device(self.attention_layer_ids, state.layer_devices).items():
            accepted, accept_len = walk.accepted.to(device), walk.accept_len.to(device)
            kv = [t for i in ids for t in (state.keys[i], state.values[i])]
            _ops.commit_kv(kv, state.prefix_len.to(device), accepted, accept_len)
        for device, ids in _by_device(self.gdn_layer_ids, state.layer_devices).items():
            accepted, accept_len = walk.accepted.to(device), walk.accept_len.to(device)
            gdn = [stash.gdn[i] for i in ids]
            _ops.commit_gdn_state(
                [state.recurrent[i] for i in ids],
                [g.stash_u for g in gdn],
                [g.stash_k for g in gdn],
                [g.stash_cumg for g in gdn],
                accepted,
                accept_len,
            )
            _ops.commit_conv_state([state.conv[i] for i in ids], [stash.conv_input[i] for i in ids], accepted, accept_len)
        state.prefix_len += walk.accept_len.to(torch.int64)
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
        if int(state.prefix_len.max()) + max(r[0] for r in rows) > state.capacity:
            raise ValueError(f"{op}: the accepted path would overrun the state's capacity {state.capacity}")

    def fused_lm_head(self) -> contextlib.AbstractContextManager:
        """A context in which the LM head runs its fused forward (``fused.project``, like the layers' projections:
        tuned GEMMs included), for the verify's logits and the draft's, which reads the target's head."""
        return self._head_fusion.active()

    def _logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """LM head logits on the adapter's device: float32, or the head's own dtype."""
        with self.fused_lm_head():
            logits = self.lm_head(hidden.to(module_device(self.lm_head)))
            return (logits.float() if float32 else logits).to(self.device)

    def _run(self, tokens, position_ids, attention_mask, cache) -> Tuple[torch.Tensor, torch.Tensor]:
        """One text-model forward; returns (final hidden states [B, T, hidden], taps on the adapter's device)."""
        with record_layer_outputs(self.text_model.layers, self.tap_layer_ids) as recorded:
            out = self.text_model(
                input_ids=tokens,
                position_ids=position_ids,
                attention_mask=attention_mask,
                use_cache=True,
                **{self._cache_kwarg: cache},
            )
        hidden = out.last_hidden_state
        if not self.tap_layer_ids:
            return hidden, hidden.new_empty(*hidden.shape[:2], 0, device=self.device)
        return hidden, torch.cat([recorded[i].to(self.device) for i in self.tap_layer_ids], dim=-1)

    def _rope_from_table(self, state: TargetState) -> contextlib.AbstractContextManager:
        """A context in which the rotary embedding gathers the state's RoPE table rows, where it has one and
        ``fused.rope_table_serves`` says it gives the module's bits now. Else a longrope embedding still gives each
        position its own factors (``fused.per_position_longrope``): run over a verify's positions at once, it would
        take the long factors for all of them once one node passes the boundary, where decoding token by token takes
        the short ones below it."""
        rotary = self.text_model.rotary_emb
        if state.rope is not None and rope_table_serves(rotary):
            return swapped_forwards([(rotary, functools.partial(_rope_rows, rotary, *state.rope))])
        if is_longrope(rotary):
            return swapped_forwards([(rotary, per_position_longrope(rotary, rotary.forward))])
        return contextlib.nullcontext()

    def _tree_gdn_forwards(
        self, state: TargetState, parent_by_device: Dict[torch.device, torch.Tensor], stash: _VerifyStash
    ) -> contextlib.AbstractContextManager:
        """A context in which every GDN layer (per instance) runs its tree forward."""
        swaps = []
        for i in self.gdn_layer_ids:
            gdn = self.text_model.layers[i].linear_attn
            parent = parent_by_device[state.layer_devices[i]]

            def tree_forward(hidden_states, *args, _gdn=gdn, _i=i, _parent=parent, **kwargs):
                out, stash.conv_input[_i], stash.gdn[_i] = _gdn_tree_forward(
                    _gdn, hidden_states, state.conv[_i], state.recurrent[_i], _parent
                )
                return out

            swaps.append((gdn, tree_forward))
        return swapped_forwards(swaps)


def _rope_rows(rotary: torch.nn.Module, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor, position_ids: torch.Tensor):
    """The rotary embedding's forward from the table (cos, sin) of ``fused.rope_table``: its rows at position_ids [B, T]
    (or Qwen3.5's [3, B, T] expanded from one row: one position for every axis), [B, T, rotary dim] each; the
    module's own forward for anything else (positions that differ by axis, another dtype or device)."""
    rows = position_ids[0] if position_ids.dim() == 3 and position_ids.stride(0) == 0 else position_ids
    if rows.dim() != 2 or x.dtype != cos.dtype or rows.device != cos.device:
        return type(rotary).forward(rotary, x, position_ids)
    return rope_rows(cos, sin, rows)


def _by_device(layer_ids: Sequence[int], devices: Sequence[torch.device]) -> Dict[torch.device, List[int]]:
    """Layer ids grouped by their device, in order."""
    groups: Dict[torch.device, List[int]] = {}
    for i in layer_ids:
        groups.setdefault(devices[i], []).append(i)
    return groups


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
    # The gates and the z projection (needed only by the delta rule and the output norm) on a side stream, beside
    # the qkv projection, the conv and the delta rule: small latency-bound kernels and an under-filled GEMM overlap
    # a GEMM. (Starting z only after the qkv projection, beside the conv and delta rule alone, measured no better.)
    fork = Fork(hidden_states.device, "gdn")
    with fork.side():
        g, beta = _gdn_gates(gdn, hidden_states)
        gates_done = fork.mark()
        z = gdn.in_proj_z(hidden_states).reshape(batch, num_nodes, -1, gdn.head_v_dim)
    mixed_qkv = gdn.in_proj_qkv(hidden_states)

    # HF's torch conv (causal_conv1d_fn / causal_conv1d_update fallbacks) rounds the conv to the model
    # dtype before the activation; the ops' SiLU does the same (one launch instead of two), another activation
    # runs after it as HF's.
    weight = gdn.conv1d.weight.squeeze(1)
    if gdn.activation in SILU_ACTIVATIONS and fuse_gdn_conv:
        # The gates are ready long before the qkv projection is: joining them before the conv costs no wait.
        fork.join(gates_done, g, beta)
        delta = _ops.gdn_conv_delta_rule(
            mixed_qkv, weight, gdn.conv1d.bias, conv_state, g, beta, recurrent_state, parent,
            num_heads=gdn.num_k_heads, head_k_dim=gdn.head_k_dim, head_v_dim=gdn.head_v_dim, use_qk_l2norm=True,
        )
    else:
        if gdn.activation in SILU_ACTIVATIONS:
            conv_out = _ops.tree_conv1d(mixed_qkv, weight, gdn.conv1d.bias, conv_state, parent, silu=True)
        else:
            conv_out = ACT2FN[gdn.activation](
                _ops.tree_conv1d(mixed_qkv, weight, gdn.conv1d.bias, conv_state, parent, silu=False)
            )
        query, key, value = torch.split(conv_out, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
        query = query.reshape(batch, num_nodes, -1, gdn.head_k_dim)
        key = key.reshape(batch, num_nodes, -1, gdn.head_k_dim)
        value = value.reshape(batch, num_nodes, -1, gdn.head_v_dim)
        fork.join(gates_done, g, beta)
        delta = _ops.tree_gated_delta_rule(query, key, value, g, beta, recurrent_state, parent, use_qk_l2norm=True)

    fork.join(z)
    core = gdn.norm(delta.out.reshape(-1, gdn.head_v_dim), z.reshape(-1, gdn.head_v_dim))
    return gdn.out_proj(core.reshape(batch, num_nodes, -1)), mixed_qkv, delta


def _gdn_gates(gdn: torch.nn.Module, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) [B, N, HV] float32 of a GDN layer: one ``gdn_gates`` launch (both projections and the
    gating) when in_proj_a / in_proj_b are plain bias-free Linear layers the op can take (``ops_apply``),
    else HF's own lines."""
    proj_a, proj_b = gdn.in_proj_a, gdn.in_proj_b
    if (
        all(type(p) is torch.nn.Linear and p.bias is None for p in (proj_a, proj_b))
        and ops_apply(hidden_states, proj_a.weight, proj_b.weight)
        and all(t.dtype in OP_DTYPES for t in (gdn.A_log, gdn.dt_bias))
    ):
        return _ops.gdn_gates(hidden_states, proj_a.weight, proj_b.weight, gdn.A_log, gdn.dt_bias)
    beta = proj_b(hidden_states).sigmoid().float()
    g = -gdn.A_log.float().exp() * torch.nn.functional.softplus(proj_a(hidden_states).float() + gdn.dt_bias)
    return g, beta
