"""Fused forwards for the small pieces of the HF layer bodies that a round runs through.

Hugging Face's Qwen3 / Qwen3.5 layers run every norm and activation as a chain of small kernels: an
RMSNorm is about ten (casts, pow, mean, add, rsqrt, multiplies), a SwiGLU two. In a round replayed from
a CUDA graph each still costs GPU time (a 27B-shaped RMSNorm: 16 us as HF's chain, 2.8 us fused, on the
H200: ``benchmarks/results/2026-11-29-h200-layer-ops.md``); over the 64 layers of a 27B model, replacing
them (with the GDN gates, ``ddtree_ext.target``) took a captured decode step on the H200 from 22.7 to
17.5 ms.
:class:`LayerFusion` swaps the forward of each recognised submodule (per instance, for the duration of a
context) for one compiled op with the same rounding points:

=========================  ===================================================
module                     fused forward
=========================  ===================================================
``Qwen3RMSNorm``           ``ops.rms_norm``
``Qwen3_5RMSNorm``         ``ops.rms_norm(zero_centered=True)``
``Qwen3_5RMSNormGated``    ``ops.rms_norm(gate=...)``
``Qwen3MLP``/``Qwen3_5MLP``  ``down_proj(ops.silu_mul(gate_proj(x), up_proj(x)))`` (SiLU models)
``Qwen3DecoderLayer``/     HF's layer body with each residual add fused into the norm that reads the
``Qwen3_5DecoderLayer``    sum (``ops.add_rms_norm``): the post-attention norm, and the next layer's input
                           norm, handed to that layer (:class:`_NormHandoff`)
=========================  ===================================================

and every bias-free ``torch.nn.Linear`` (the projections: ``ops.linear`` on a GPU when ``linear_kernel`` is on, which
it is not by default, since cuBLAS is faster at almost every round shape measured; with ``gemm_tuning.enabled``, the
cuBLASLt algorithm timed fastest per shape; torch's ``F.linear`` otherwise).
The Qwen3.5 MoE family's classes (``Qwen3_5MoeRMSNorm``, ..., its shared expert ``Qwen3_5MoeMLP``) have the same
source under another prefix and take the same forwards (:func:`_qwen3_5_families`); its routed experts
(``Qwen3_5MoeExperts``) run ``ops.moe_experts`` (:func:`experts_op_applies`; ``moe_experts_op``), and its sparse MoE
blocks (``Qwen3_5MoeSparseMoeBlock``) their router's softmax and top-k as ``ops.moe_router`` and the shared expert's
gate and add inside the experts op (:func:`_moe_block_forward`; ``fuse_moe_block``).
For the attention layers:

* the forwards of ``q_proj``, ``k_proj`` and ``v_proj`` (plain Linear layers): on a GPU the q_proj call
  starts the K and V projections on a side stream (:class:`Fork`) and their calls take the results;
* the modeling modules' ``apply_rotary_pos_emb`` (a module global the layers look up at call time) for
  two ``ops.rope`` launches that round where it rounds, so its results are HF's bit for bit;
* their own forward, with the verify's cache: HF's body with the q/k norms and RoPE as one ``ops.qk_norm_rope``
  (where the RoPE patch above is left to other calls and to the body's fallback) and Qwen3.5's output gate as one
  ``ops.sigmoid_mul`` (:func:`_attention_forward`; ``fuse_attention_heads``);
* the "sdpa" entry of HF's attention registry for :func:`gqa_attention`, which folds a KV head's query
  heads into its query rows instead of copying K and V per query head (HF's ``repeat_kv`` under a mask),
  and on CUDA with a bool mask runs ``ops.gqa_attention`` (split over the keys).

The RoPE and "sdpa" patches are process-wide while any fusion context is open (installed by the first, removed by
the last): another model's calls meanwhile get the same results (RoPE bit for bit, attention up to float rounding).

Every fused forward checks per call that its op applies (``ops_apply``: no grad mode, float32 / float16 /
bfloat16 on CPU or CUDA, rows contiguous in their last dim; a gate, the rotary layout) and runs HF's own
code otherwise, so a swap never changes what a module accepts. Numerically, RoPE and SwiGLU give HF's bits,
a norm differs only in the order of its float32 sum of squares, and the folded attention is HF's SDPA on
another layout (float rounding).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch.nn.modules import module as _torch_module  # its global hook registries

from ddtree_ext import gemm_tuning, ops

_MISSING = object()


class _ThreadSwappedForward:
    """A module's swapped-in forward as only the thread that swapped it sees it. A call from any other thread (HF's
    own forward on the model, from user code, while a generate() call runs on it) runs what the module held before:
    its own instance forward if it had one, else its class's."""

    __slots__ = ("forward", "module", "previous", "thread")

    def __init__(self, forward: Callable, module: torch.nn.Module, previous):
        self.forward, self.module, self.previous = forward, module, previous
        self.thread = threading.get_ident()

    @property
    def __wrapped__(self) -> Callable:  # inspect.signature() reads the swapped-in forward's
        return self.forward

    def __call__(self, *args, **kwargs):
        if threading.get_ident() == self.thread:
            return self.forward(*args, **kwargs)
        if self.previous is not _MISSING:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


@contextlib.contextmanager
def swapped_attributes(swaps: Sequence[Tuple[object, str, object]]) -> Iterator[None]:
    """Sets ``owner.name = value`` for every (owner, name, value) while the context is open and puts back
    what the owner itself held before (for a module's ``forward``: an instance forward of its own, e.g.
    an accelerate hook, or none) on exit, also when the body raised; but not over a value someone else set
    meanwhile, which would then be lost (generate() runs one call per model at a time, so only user code can).
    A module's ``forward`` is swapped for this thread only (:class:`_ThreadSwappedForward`)."""
    saved: List[Tuple[object, str, object, object]] = []
    try:
        for owner, name, value in swaps:
            previous = owner.__dict__.get(name, _MISSING)
            if name == "forward" and isinstance(owner, torch.nn.Module):
                value = _ThreadSwappedForward(value, owner, previous)
            saved.append((owner, name, previous, value))
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, previous, value in reversed(saved):
            if getattr(owner, name, _MISSING) is value:  # getattr: a Module value lives in _modules
                _put_back(owner, name, previous)


def swapped_forwards(swaps: Sequence[Tuple[torch.nn.Module, Callable]]) -> contextlib.AbstractContextManager:
    """``swapped_attributes`` for the ``forward`` of every (module, forward) pair (set per instance)."""
    return swapped_attributes([(module, "forward", forward) for module, forward in swaps])


# The fused forwards are partials over the module, not closures: a deep copy of a model (and of the
# LayerFusion it holds) then swaps the copy's modules, never the original's. Each checks, per call, that its
# op applies (the ops have no backward, take three float dtypes on CPU and CUDA, and want rows contiguous in
# their last dim) and runs HF's code otherwise.

OP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the activation dtypes the compiled ops take


def ops_apply(*tensors: torch.Tensor) -> bool:
    """True when the compiled ops can stand in for HF's code on these tensors: no autograd wanted, one
    dtype the ops take, a CPU or CUDA device, each contiguous in its last dim."""
    if torch.is_grad_enabled():
        return False
    first = tensors[0]
    return (
        first.dtype in OP_DTYPES and first.device.type in ("cpu", "cuda")
        and all(t.dtype == first.dtype and t.device == first.device and t.stride(-1) == 1 for t in tensors)
    )


def _norm_forward(norm: torch.nn.Module, eps: float, zero_centered: bool, hidden_states: torch.Tensor):
    if not ops_apply(hidden_states, norm.weight):
        return type(norm).forward(norm, hidden_states)
    return ops.rms_norm(hidden_states, norm.weight, eps, zero_centered=zero_centered)


def _gated_norm_forward(norm: torch.nn.Module, hidden_states: torch.Tensor, gate=None):
    if gate is None or gate.shape != hidden_states.shape or not ops_apply(hidden_states, norm.weight, gate):
        return type(norm).forward(norm, hidden_states, gate)
    return ops.rms_norm(hidden_states, norm.weight, norm.variance_epsilon, gate=gate)


# ---- residual adds, fused into the norm after them ---------------------------------------------------------

# Whether decoder layers (the target's and the draft's) run their residual adds fused into the RMSNorm that reads the
# sum (ops.add_rms_norm: one launch where HF runs an add and a norm). ``benchmarks/e2e.py --no-fused-adds`` turns
# it off for A/B runs.
fuse_residual_adds = True


def _norm_params(norm: torch.nn.Module) -> Optional[Tuple[float, bool]]:
    """(eps, zero_centered) of an RMSNorm whose fused forward is ``ops.rms_norm`` (exact classes only), else None.
    Called by every fused add and norm: the class sets are looked up once."""
    from transformers.models.qwen3 import modeling_qwen3 as qwen3

    if type(norm) is qwen3.Qwen3RMSNorm:
        return norm.variance_epsilon, False
    if type(norm) in _zero_centered_norms():
        return norm.eps, True
    return None


# The classes of a Qwen3.5 family that the fused forwards stand in for.
_FAMILY_CLASSES = ("RMSNorm", "RMSNormGated", "MLP", "Attention", "DecoderLayer")


class _Family(NamedTuple):
    """A Qwen3.5 modeling module and the prefix of its class names: the dense and the MoE families define the same
    attention, GDN, norm and MLP classes (the MoE family's MLP is its shared expert), one source under two names."""

    module: object
    prefix: str

    def cls(self, name: str) -> type:
        return getattr(self.module, self.prefix + name)


@functools.lru_cache(maxsize=None)
def _qwen3_5_families() -> Tuple[_Family, ...]:
    """The Qwen3.5 families (dense ``qwen3_5``, MoE ``qwen3_5_moe``) this transformers install has, with every class
    of _FAMILY_CLASSES."""
    import importlib

    families = []
    for name, prefix in (("qwen3_5", "Qwen3_5"), ("qwen3_5_moe", "Qwen3_5Moe")):
        try:
            family = _Family(importlib.import_module(f"transformers.models.{name}.modeling_{name}"), prefix)
        except ImportError:  # a transformers without it
            continue
        if all(hasattr(family.module, prefix + c) for c in _FAMILY_CLASSES):
            families.append(family)
    return tuple(families)


@functools.lru_cache(maxsize=None)
def _zero_centered_norms() -> frozenset:
    """The Qwen3.5 families' RMSNorm classes (weights stored as offsets from 1)."""
    return frozenset(family.cls("RMSNorm") for family in _qwen3_5_families())


def _plain_module(module: torch.nn.Module) -> bool:
    """No forward hooks (but transformers' idle output recorders, :func:`_idle_output_recorder`), pre-hooks or
    accelerate hook, on the module or global ones (``register_module_forward_hook``), and no forward of its own
    (:func:`has_own_forward`): calling the op instead of the module skips nothing."""
    return not (
        any(not _idle_output_recorder(hook) for hook in tuple(module._forward_hooks.values()))
        or module._forward_pre_hooks or "_hf_hook" in module.__dict__
        or _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks
        or has_own_forward(module)
    )


def _idle_output_recorder(hook: Callable) -> bool:
    """Whether a forward hook is transformers' output recorder and records nothing now. A model's forward installs
    one on every module whose outputs it can return (a MoE router's logits, say) the first time a call asks for any,
    and keeps them for good; each call then names what it collects in a context variable, and a hook whose output
    is not asked for returns at once. Skipping such a module in a call that does not collect its output skips
    nothing; without this, one call with ``output_router_logits=True`` left every later round on HF's unfused MoE
    block. A hook of any other shape (or a transformers that records otherwise) counts as a hook."""
    code = getattr(hook, "__code__", None)
    if code is None or code.co_name != "output_capturing_hook" or "key" not in code.co_freevars:
        return False
    if getattr(hook, "__module__", None) != "transformers.utils.output_capturing":
        return False
    from transformers.utils import output_capturing

    try:
        key = hook.__closure__[code.co_freevars.index("key")].cell_contents
        collecting = output_capturing._active_collector.get()
    except (AttributeError, IndexError, TypeError, ValueError):  # recorded otherwise than this reads
        return False
    return collecting is None or (isinstance(key, str) and key not in collecting)


def has_own_forward(module: torch.nn.Module) -> bool:
    """The module holds an instance forward other than one of this package's thread-local swaps: accelerate's hook or
    a user's patch (``module.forward = ...``). A fused forward swapped in over it, or an op called in its place, would
    skip what it does."""
    own = module.__dict__.get("forward")
    return own is not None and not isinstance(own, _ThreadSwappedForward)


def add_norm(norm: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor,
             out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x): ``ops.add_rms_norm`` for a recognised norm without hooks on tensors the ops
    take (same bits as the add, then the norm's fused forward), HF's two steps otherwise. ``out``: where the normed
    rows go (rows of a bigger buffer, say), shaped like x, its rows one stride apart (the op's rule) and not
    overlapping x or residual; a new tensor if None."""
    params = _norm_params(norm) if fuse_residual_adds and _plain_module(norm) else None
    given = [] if out is None else [out]
    if params is None or x.shape != residual.shape or not ops_apply(x, residual, norm.weight, *given):
        total = residual + x
        return (norm(total) if out is None else out.copy_(norm(total))), total
    return ops.add_rms_norm(x, residual, norm.weight, params[0], zero_centered=params[1], out=out)


def norm_into(norm: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """norm(x) written into ``out`` (rows of a bigger buffer, say; shaped like x, its rows one stride apart, as the
    op's outputs must be) and returned: ``ops.rms_norm`` straight into it for a recognised norm without hooks on
    tensors the ops take, else the module and a copy."""
    params = _norm_params(norm) if _plain_module(norm) else None
    if params is None or not ops_apply(x, norm.weight, out):
        return out.copy_(norm(x))
    return ops.rms_norm(x, norm.weight, params[0], zero_centered=params[1], out=out)


def _version(t: torch.Tensor) -> Optional[int]:
    """t's version counter (bumped by every in-place write), None for an inference tensor (which keeps none)."""
    return None if t.is_inference() else t._version


class _NormHandoff:
    """The input norm a decoder layer computed, fused with its last residual add, for the next layer: that layer
    takes it when called with exactly the sum it belongs to (the same tensor object, not written in place since:
    its version counter unchanged; a hook may have added to it), else computes its own.

    Inference tensors keep no version counter: under ``torch.inference_mode`` the norm is not handed to a layer
    with forward pre-hooks at all (:func:`_decoder_forward`), and a forward hook of the giving layer that writes
    its output in place is the one change not seen."""

    def __init__(self):
        self._slot = None  # (layer it is for, the sum, the sum's version, its norm)

    def put(self, layer: torch.nn.Module, total: torch.Tensor, normed: torch.Tensor) -> None:
        self._slot = (layer, total, _version(total), normed)

    def take(self, layer: torch.nn.Module, hidden_states: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        slot, self._slot = self._slot, None
        if slot is not None and slot[0] is layer and slot[1] is hidden_states and _version(hidden_states) == slot[2]:
            return slot[3]
        return None


_CACHE_ARGUMENTS = ("cache", "past_key_values")  # the decoder layers' cache argument: 5.24 / 5.17


def _decoder_swap(layer: torch.nn.Module, next_layer: Optional[torch.nn.Module], handoff: _NormHandoff):
    """The fused forward of a Qwen3 / Qwen3.5 decoder layer, or None when its stock forward's signature is not the
    one :func:`_decoder_forward` was written against."""
    import inspect

    stock = type(layer).forward
    signature = inspect.signature(stock)
    params = list(signature.parameters.values())
    names = [p.name for p in params]
    cache_names = [n for n in _CACHE_ARGUMENTS if n in names]
    if (
        names[:2] != ["self", "hidden_states"] or "attention_mask" not in names or len(cache_names) != 1
        or params[-1].kind is not inspect.Parameter.VAR_KEYWORD
    ):
        return None
    mixer_cache = None
    if not hasattr(layer, "linear_attn" if getattr(layer, "block_type", None) == "linear_attention" else "self_attn"):
        return None  # a layer type without the token mixer this body calls
    if getattr(layer, "block_type", None) == "linear_attention":
        mixer_params = inspect.signature(type(layer.linear_attn).forward).parameters
        mixer_cache = next((n for n in ("cache_params", "cache") if n in mixer_params), None)
        if mixer_cache is None:
            return None
    return functools.partial(_decoder_forward, layer, signature, params[-1].name, cache_names[0], mixer_cache,
                             next_layer, handoff)


def _decoder_forward(layer, signature, var_keyword, cache_name, mixer_cache, next_layer, handoff, *args, **kwargs):
    """HF's decoder layer body (input norm, token mixer, residual add, post-attention norm, MLP, residual add) with
    each residual add fused into the norm that reads the sum: the post-attention norm, and the next layer's input
    norm (handed over through ``handoff``). The token mixer is called with what the stock forward passes it."""
    try:
        bound = signature.bind(layer, *args, **kwargs)
    except TypeError:
        bound = None
    # A call this body was not written for, or grad mode (HF's layer call then handles gradient checkpointing).
    if bound is None or any(n in bound.arguments.get(var_keyword, {}) for n in _CACHE_ARGUMENTS) \
            or torch.is_grad_enabled():
        handoff.take(layer, None)
        return type(layer).forward(layer, *args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    del arguments["self"]
    extra = arguments.pop(var_keyword)
    hidden_states = arguments.pop("hidden_states")

    residual = hidden_states
    normed = handoff.take(layer, hidden_states)
    if normed is None:
        normed = layer.input_layernorm(hidden_states)
    if mixer_cache is not None:
        mixed = layer.linear_attn(hidden_states=normed, attention_mask=arguments["attention_mask"],
                                  **{mixer_cache: arguments[cache_name]}, **extra)
    else:
        mixed, _ = layer.self_attn(hidden_states=normed, **arguments, **extra)
    normed, residual = add_norm(layer.post_attention_layernorm, mixed, residual)
    mlp_out = layer.mlp(normed)
    if isinstance(mlp_out, tuple):  # a sparse MoE block that also returns its router logits, as HF's body unpacks
        mlp_out = mlp_out[0]

    # No handover to a layer that keeps a forward of its own (an accelerate hook, a user's patch), whose norm is not
    # folded (hooks), on another device, or, without a version counter to see an in-place pre-hook, with pre-hooks.
    following = (
        next_layer is not None and not has_own_forward(next_layer) and _plain_module(next_layer.input_layernorm)
        and not (mlp_out.is_inference() and next_layer._forward_pre_hooks)
        and next_layer.input_layernorm.weight.device == mlp_out.device
    )
    if not following:
        return residual + mlp_out
    normed_next, out = add_norm(next_layer.input_layernorm, mlp_out, residual)
    handoff.put(next_layer, out, normed_next)
    return out


# ---- sparse MoE experts ---------------------------------------------------------------------------------

# Whether a sparse MoE block's routed experts (``Qwen3_5MoeExperts``) run ``ops.moe_experts`` where it applies (else
# HF's experts forward, as its config's experts_implementation picks). On: up to four launches a layer where HF's
# grouped_mm runs a dozen, it keeps to the device (so MoE rounds are captured: in float32 on every GPU, in 16-bit
# dtypes on compute capability 8.0 and newer, where its tensor-core kernels run), and a row's output does not depend
# on the batch. ``benchmarks/e2e.py --moe hf`` turns it off for A/B runs.
moe_experts_op = True
# The most rows (tokens) a call runs ops.moe_experts for: every round's (a budget-256 verify block has 257) and
# prefill chunks up to 1024 rows. Measured per 35B-A3B layer in bf16 on an H100: the op ahead of HF's grouped GEMMs at
# 256 rows (662 against 755 us) and 1024 (965 against 1011), behind at 4096 (2804 against 2059), where HF's tiled
# GEMMs reuse each x row across experts' columns (benchmarks/results/2026-12-06-h100-moe-experts-tensor-cores.md).
MOE_OP_MAX_TOKENS = 1024
# Where generate() runs the op: on the CPU its fixed-order loops are slower than HF's grouped GEMMs (107 against 18 ms
# for 17 rows of a 35B-A3B-sized layer on 2 cores: benchmarks/results/2026-12-06-cpu-moe-experts.md), and no graph
# needs it there.
MOE_OP_DEVICES = ("cuda",)


# HF's experts implementations whose rounding points the op has, in every dtype: both round each projection's output,
# the gated product and the weighted expert outputs to the dtype and sum those in float32. HF's "eager" loop adds the
# experts' outputs into a 16-bit buffer one expert at a time (other bits in 16-bit dtypes: the op stands in for it only
# in float32); hub kernels (deepgemm, sonicmoe) round their own way.
MOE_OP_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")
# The CUDA kernels' limits (csrc/moe_cuda.cu): pairs the float32 kernels stage at once per expert, and the grid's slot
# dimension. 16-bit weights run on tensor cores (compute capability 8.0 or newer) and stage nothing.
_MOE_STAGED_ROWS, _MOE_MAX_SLOTS = 8, 65535


def experts_op_applies(experts: torch.nn.Module) -> bool:
    """Whether ``ops.moe_experts`` computes what this experts module's forward computes, for the tensors generate()
    gives it: HF's SwiGLU experts layout (gate and up rows stacked in ``gate_up_proj`` [E, 2 I, H], ``down_proj``
    [E, H, I], no bias, not transposed, no expert parallelism or post-expert norm, HF's default gate), HF's SiLU, an
    experts_implementation with the op's rounding points (``MOE_OP_IMPLEMENTATIONS``; "eager" in float32), weights in
    one dtype the ops take, nothing hooked, and on CUDA the sizes, alignment and shared memory its kernels take. Asked
    per call of :meth:`TargetAdapter.moe_capturable` and per forward."""
    if not moe_experts_op or type(experts) not in _moe_classes("Experts") or not _plain_module(experts):
        return False
    layout = dict(has_gate=True, has_bias=False, is_transposed=False, is_concatenated=True, _is_expert_parallel=False,
                  has_post_expert_norm=False)
    if any(getattr(experts, name, value) != value for name, value in layout.items()):
        return False
    gate = getattr(experts, "_apply_gate", None)  # the class's (HF's decorator installs its default) or the instance's
    if gate is not None and getattr(gate, "__func__", gate) is not _hf_default_gate():
        return False
    if not _plain_silu(getattr(experts, "act_fn", None)):
        return False
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return False
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2:
        return False
    num_experts, inter, hidden = gate_up.shape[0], gate_up.shape[1] // 2, gate_up.shape[2]
    if down.shape != (num_experts, hidden, inter) or gate_up.dtype not in OP_DTYPES or down.dtype != gate_up.dtype:
        return False
    implementation = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    if implementation not in MOE_OP_IMPLEMENTATIONS and not (
        gate_up.dtype == torch.float32 and implementation in ("eager", None)  # None: a transformers with only the loop
    ):
        return False
    if gate_up.device != down.device or gate_up.device.type not in ("cpu", "cuda"):
        return False
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        return False
    if gate_up.is_cuda:  # the kernels move 16 bytes at a time; float32 stages rows in shared memory
        size = gate_up.element_size()
        vec = 16 // size
        props = torch.cuda.get_device_properties(gate_up.device)
        smem = getattr(props, "shared_memory_per_block_optin", 48 * 1024)
        staged = _MOE_STAGED_ROWS * max(hidden, inter) * size if size == 4 else 0
        return (
            hidden % vec == 0 and inter % vec == 0 and gate_up.data_ptr() % 16 == 0 and down.data_ptr() % 16 == 0
            and staged <= smem and 2 * num_experts * 4 <= smem and num_experts <= _MOE_MAX_SLOTS
            and (size == 4 or props.major >= 8)
        )
    return True


def _experts_op_serves(experts: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether a call of ``experts`` on rows x [T, H] runs ``ops.moe_experts``: at most ``MOE_OP_MAX_TOKENS`` rows, on
    ``MOE_OP_DEVICES``, where the op applies (:func:`experts_op_applies`)."""
    return (x.dim() == 2 and x.shape[0] <= MOE_OP_MAX_TOKENS and x.device.type in MOE_OP_DEVICES
            and experts_op_applies(experts))


def _experts_forward(experts: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor):
    """``Qwen3_5MoeExperts.forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])`` as one
    ``ops.moe_experts`` where it applies (on ``MOE_OP_DEVICES``, at most ``MOE_OP_MAX_TOKENS`` rows: every round),
    HF's own forward otherwise (on the CPU, a long prompt's prefill). Inside a CUDA graph capture a fallback to an HF
    forward that reads the device from the host is refused with the reason, before the capture fails on it."""
    if (
        _experts_op_serves(experts, hidden_states) and ops_apply(hidden_states, top_k_weights, experts.gate_up_proj)
        and top_k_index.dim() == 2 and top_k_index.dtype == torch.int64
        and top_k_index.device == hidden_states.device and top_k_weights.shape == top_k_index.shape
    ):
        return ops.moe_experts(hidden_states.contiguous(), top_k_index.contiguous(), top_k_weights.contiguous(),
                               experts.gate_up_proj, experts.down_proj)
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing() and not hf_experts_capturable(experts):
        raise RuntimeError(
            f"a sparse MoE experts forward inside a CUDA graph capture: ops.moe_experts does not take these inputs "
            f"(rows {list(hidden_states.shape)}, at most {MOE_OP_MAX_TOKENS}; dtypes {hidden_states.dtype}, "
            f"{top_k_weights.dtype} and {top_k_index.dtype} against the experts' {experts.gate_up_proj.dtype} and "
            f"int64), and HF's experts forward reads the device from the host here; run it with cuda_graph=False"
        )
    return type(experts).forward(experts, hidden_states, top_k_index, top_k_weights)


def _moe_block_forward(block: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``Qwen3_5MoeSparseMoeBlock.forward(hidden_states [B, S, H])`` with its router's softmax, top-k and
    renormalisation as one ``ops.moe_router``, and the shared expert's sigmoid gate and the final add folded into
    ``ops.moe_experts``' combine, where they apply (:func:`_moe_block_fusable`): a 35B-A3B decode step's MoE block in
    seven launches with its projections stacked (ten apart; the timeline in
    benchmarks/results/2026-12-06-h100-moe-block-fused.md) where HF's body with the experts op runs eighteen. HF's
    body otherwise. The same rounding points as HF's (the router's float32 softmax and renormalisation, rounded to the
    dtype; sigmoid, product and sum each rounded); the softmax sums as torch's CUDA softmax does, the renormalisation
    in pick order (torch's sum in its own: a weight may round the other way)."""
    batch, length, hidden = hidden_states.shape
    x = hidden_states.view(-1, hidden)
    if not _moe_block_fusable(block, x):
        return type(block).forward(block, hidden_states)
    mlp = block.shared_expert
    # Stacked (stack_projections): the shared expert's gate and up, the router's logits and the shared expert's gate
    # logit from one GEMM, then the shared expert as its fused forward runs it.
    outputs = (stacked_outputs((mlp.gate_proj, mlp.up_proj, block.gate, block.shared_expert_gate), x)
               if type(mlp) in _shared_expert_classes() and _plain_module(mlp) and _plain_silu(mlp.act_fn) else None)
    if outputs is not None:
        gate, up, logits, shared_gate = outputs
        shared = mlp.down_proj(ops.silu_mul(gate, up))
    else:
        shared = mlp(x)
        logits = project(block.gate.weight, x)
        shared_gate = block.shared_expert_gate(x)
    weights, ids = ops.moe_router(logits, block.gate.top_k)
    experts, x = block.experts, x.contiguous()
    if shared.shape != x.shape or shared.dtype != x.dtype or shared_gate.dtype != x.dtype:  # a shared expert of its own
        out = ops.moe_experts(x, ids, weights, experts.gate_up_proj, experts.down_proj)
        return (out + torch.sigmoid(shared_gate) * shared).view(batch, length, hidden)
    out = ops.moe_experts(x, ids, weights, experts.gate_up_proj, experts.down_proj, shared=shared.contiguous(),
                          shared_gate=shared_gate)
    return out.view(batch, length, hidden)


# Whether a sparse MoE block (``Qwen3_5MoeSparseMoeBlock``) runs :func:`_moe_block_forward` where it applies (else HF's
# block body, its experts through ``ops.moe_experts`` where that applies). ``benchmarks/e2e.py --moe ops`` turns it off
# for A/B runs.
fuse_moe_block = True
# On CUDA the router op's limits (csrc/moe_cuda.cu): experts a warp holds, picks its lanes keep.
_ROUTER_MAX_EXPERTS, _ROUTER_MAX_TOP_K = 1024, 32


def _moe_block_fusable(block: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether :func:`_moe_block_forward` computes what HF's block computes for rows x [T, H]: the routed experts run
    ``ops.moe_experts`` (as :func:`_experts_forward` asks), the router is HF's top-k router without hooks (HF's output
    recorder counts only while a call collects router logits: HF's body then runs the router, which records them),
    and the shared expert's gate is a bias-free Linear to one logit; ``fuse_moe_block`` on."""
    gate, shared_gate, experts = (getattr(block, n, None) for n in ("gate", "shared_expert_gate", "experts"))
    if not fuse_moe_block or type(gate) not in _moe_classes("TopKRouter") or not _plain_module(gate):
        return False
    if type(shared_gate) is not torch.nn.Linear:
        return False
    if shared_gate.bias is not None or shared_gate.weight.shape != (1, x.shape[1]):
        return False
    if x.shape[0] == 0 or not _experts_op_serves(experts, x):
        return False
    num_experts = experts.gate_up_proj.shape[0]
    if gate.weight.shape != (num_experts, x.shape[1]) or not 1 <= gate.top_k <= num_experts:
        return False
    if x.is_cuda and (num_experts > _ROUTER_MAX_EXPERTS or gate.top_k > _ROUTER_MAX_TOP_K):
        return False
    return ops_apply(x, gate.weight, shared_gate.weight, experts.gate_up_proj)


@functools.lru_cache(maxsize=None)
def _moe_classes(name: str) -> Tuple[type, ...]:
    """The classes named ``prefix + name`` of the Qwen3.5 families this transformers install has that define one
    (the MoE family's): "Experts", "TopKRouter" (softmax, top-k, renormalised), "SparseMoeBlock" (whose forward
    :func:`_moe_block_forward` follows)."""
    return tuple(
        cls for cls in (getattr(f.module, f.prefix + name, None) for f in _qwen3_5_families()) if cls is not None
    )


@functools.lru_cache(maxsize=None)
def _shared_expert_classes() -> Tuple[type, ...]:
    """The MLP classes of the Qwen3.5 MoE families (a sparse MoE block's shared expert)."""
    return tuple(f.cls("MLP") for f in _qwen3_5_families() if hasattr(f.module, f.prefix + "SparseMoeBlock"))


def experts_capturable(experts: torch.nn.Module) -> bool:
    """Whether a round's calls of this experts module keep to the device, so that a CUDA graph can capture them:
    ``ops.moe_experts`` runs them on a GPU (:func:`experts_op_applies`, the weights on CUDA, CUDA in
    ``MOE_OP_DEVICES``), or HF's forward that runs instead does (:func:`hf_experts_capturable`)."""
    op_here = experts_op_applies(experts) and experts.gate_up_proj.is_cuda and "cuda" in MOE_OP_DEVICES
    return op_here or hf_experts_capturable(experts)


def hf_experts_capturable(experts: torch.nn.Module) -> bool:
    """HF's own experts forward keeps to the device: its "grouped_mm" with bfloat16 weights on an sm_90 or sm_100 GPU
    (torch's grouped GEMM kernel; elsewhere torch's grouped_mm loops over the groups with their offsets copied to the
    host, and HF's "eager" loop reads on the host which experts a batch hits)."""
    if str(getattr(getattr(experts, "config", None), "_experts_implementation", None)) != "grouped_mm":
        return False
    weights = list(experts.parameters())
    return all(p.dtype == torch.bfloat16 for p in weights) and all(
        p.is_cuda and torch.cuda.get_device_capability(p.device)[0] in (9, 10) for p in weights
    )


@functools.lru_cache(maxsize=None)
def _hf_default_gate():
    """HF's default SwiGLU gate of its experts classes (``act_fn(gate) * up``), or None in a transformers without it."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return None
    return getattr(moe, "_default_apply_gate", None)


# ---- projections ----------------------------------------------------------------------------------------

# Whether bias-free Linear layers on a GPU run ``ops.linear`` (else torch's F.linear: cuBLAS). Off: on the H200
# cuBLAS is faster at most round shapes (a 65-row 27B qkv projection 30 us against the kernel's 49; end to end, the
# kernel's previous version took a 27B budget-64 round 24.4 ms against cuBLAS's 20.6:
# benchmarks/results/2026-12-01-h200-linear-kernel.md).
# ``benchmarks/e2e.py --linear ops`` turns it on for A/B runs.
linear_kernel = False


def linear(module: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's argument name)
    """A plain Linear's forward: ``ops.linear`` for a bias-free projection of CUDA rows the ops take (the op itself
    runs torch.mm where its kernel does not apply: more than 72 rows, other sizes, older GPUs), F.linear otherwise."""
    if module.bias is None:
        return project(module.weight, input)
    return torch.nn.functional.linear(input, module.weight, module.bias)


def project(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N], a model's bias-free projection: ``ops.linear`` when ``linear_kernel``
    is on and the op takes the tensors; with ``gemm_tuning`` active (enabled, inside its ``round_shapes``), the GEMM
    algorithm timed fastest for the problem (``ops.linear_cublaslt``, ``ops.linear_gemv`` for a single row when
    ``gemm_tuning.gemv_candidate`` is on, or F.linear where cuBLAS's own pick was); F.linear otherwise."""
    if linear_kernel and x.is_cuda and x.shape[-1] == weight.shape[1] and ops_apply(x, weight):
        return ops.linear(x, weight, prefetch_weight=True)  # a model's weight: nothing writes it meanwhile
    if gemm_tuning.active() and not torch.is_grad_enabled() and gemm_tuning.applies(x, weight):
        rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        algorithm = gemm_tuning.algorithm(rows, weight)
        if algorithm == gemm_tuning.GEMV:  # a model's weight: nothing writes it meanwhile
            return ops.linear_gemv(rows, weight, prefetch_weight=True).view(*x.shape[:-1], weight.shape[0])
        if algorithm is not None:
            return ops.linear_cublaslt(rows, weight, algorithm).view(*x.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(x, weight)


# ---- stacked projections ------------------------------------------------------------------------------

def _stackable_classes() -> Dict[type, Tuple[str, ...]]:
    """Layer class -> its projections that read the same input, in the order their outputs are stacked."""
    from transformers.models.qwen3 import modeling_qwen3 as qwen3

    from ddtree_ext.draft import DFlashAttention  # here: the draft module imports this one

    table = {
        qwen3.Qwen3Attention: ("q_proj", "k_proj", "v_proj"), qwen3.Qwen3MLP: ("gate_proj", "up_proj"),
        DFlashAttention: ("q_proj", "k_proj", "v_proj"),
    }
    # Not a GDN layer's qkv and z: apart, z runs on a side stream beside the qkv GEMM and the latency-bound conv and
    # delta rule after it, and the H200 measured the stacked GEMM slower end to end (a 27B budget-64 round +0.12 ms,
    # the verify of 17 nodes +0.19 ms, though alone it beats the two side by side: 42.9 against 48.1 us at 16 rows;
    # stacked for a decode step only, a 27B AR step +0.21 ms:
    # benchmarks/results/2026-12-04-h200-draft-qkv-and-kv-store.md).
    for family in _qwen3_5_families():
        table.update({family.cls("Attention"): ("q_proj", "k_proj", "v_proj"),
                      family.cls("MLP"): ("gate_proj", "up_proj")})
    # A sparse MoE block's projections of its input: the shared expert's gate and up (its MLP's group, first, so that
    # group stays stacked within this one), the router's and the shared expert's gate (_moe_block_forward).
    for cls in _moe_classes("SparseMoeBlock"):
        table[cls] = ("shared_expert.gate_proj", "shared_expert.up_proj", "gate", "shared_expert_gate")
    return table


def _projection_groups(model: torch.nn.Module) -> Iterator[List[torch.nn.Module]]:
    """Each group of projections in ``model`` that read one input (exact classes: Linear layers, MoE routers)."""
    classes = _stackable_classes()
    for module in model.modules():
        names = classes.get(type(module))
        projections = [functools.reduce(lambda m, n: getattr(m, n, None), name.split("."), module)
                       for name in names] if names is not None else []
        if projections and all(_is_projection(p) for p in projections):
            yield projections


def _is_projection(module: object) -> bool:
    """A plain Linear layer, or a sparse MoE router (its forward starts with the projection F.linear(x, weight))."""
    return type(module) is torch.nn.Linear or type(module) in _moe_classes("TopKRouter")


def _stackable(projections: Sequence[torch.nn.Module]) -> bool:
    """Plain bias-free projections (Linear layers, MoE routers) without hooks, with 2-D weights of one dtype, one CPU
    or CUDA device and one input width: what one GEMM over their stacked weights can stand in for."""
    if not all(_is_projection(p) for p in projections):
        return False
    first = projections[0].weight
    return first.device.type in ("cpu", "cuda") and all(
        getattr(p, "bias", None) is None and _plain_module(p) and p.weight.dim() == 2 and p.weight.dtype == first.dtype
        and p.weight.device == first.device and p.weight.shape[1] == first.shape[1]
        for p in projections
    )


def _stack_candidates(model: torch.nn.Module) -> Iterator[List[torch.nn.Module]]:
    """Each group of projections in ``model`` that :func:`stack_projections` can stack (:func:`_stackable`)."""
    return (projections for projections in _projection_groups(model) if _stackable(projections))


def _check_module(op: str, model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{op}: model must be a torch.nn.Module, got {type(model).__name__}")


def stack_projections(model: torch.nn.Module) -> int:
    """Stores, in place, the weights of each layer's projections that read the same input as row blocks of one
    tensor: an attention layer's q, k and v (a DFlash draft layer's too), an MLP's gate and up, a sparse MoE block's
    shared expert's gate and up, router and shared expert's gate (their MLP's group within it). The fused forwards
    then run one GEMM over the stacked weight where they ran one per projection; at decode and verify sizes a GEMM's
    fixed costs (ramp-up, tail, a split-K reduce) are a large part of its time, and the stacked GEMM pays them once
    (on the H200, a Qwen3-8B attention layer's three projections at one row: 20.1 us apart, 16.0 stacked; its MLP's
    two: 58.2 against 52.4 us; ``scripts/profile_projections.py``). A draft layer's q reads only the block, its k and
    v the context rows too: stacked, one GEMM reads them all (the context rows' queries computed and dropped).

    The parameters stay the same objects with the same values (each becomes a view of the stacked tensor), so
    ``state_dict``, ``load_state_dict`` and HF's own forwards work as before; the memory peak is one extra group.
    Anything that gives a weight new storage (``.to()`` to another dtype or device, ``.half()``, ``copy.deepcopy``,
    ``load_state_dict(assign=True)``) ends the stacking of its group, which then runs apart: stack last.
    Greedy outputs stay the target's own (the stacked GEMM rounds each output as a GEMM over its own weight does,
    up to the kernel cuBLAS picks for the shape). Groups already stacked are left as they are; projections with
    hooks (the module's or global ones) or biases, or of mixed dtypes or devices, are not stacked.

    Returns the number of stacked groups in ``model``.
    """
    _check_module("stack_projections", model)
    count = 0
    with torch.inference_mode(False), torch.no_grad():  # inference tensors as parameters could not train again
        for projections in _stack_candidates(model):
            if stacked_weight(projections) is None:
                weights = [p.weight for p in projections]
                # Zero rows after the last weight up to a multiple of 16 bytes of outputs (_stack_padding): the
                # stacked GEMM's output rows stay aligned.
                rows = sum(w.shape[0] for w in weights)
                pad = weights[0].new_zeros(_stack_padding(rows, weights[0].element_size()), weights[0].shape[1])
                stacked = torch.cat([w.detach() for w in weights] + [pad])
                offset = 0
                for w in weights:
                    w.data = stacked[offset:offset + w.shape[0]]
                    offset += w.shape[0]
            count += 1
    return count


def unstack_projections(model: torch.nn.Module) -> int:
    """Undoes :func:`stack_projections`: every projection whose weight shares storage with another of its group gets
    storage of its own (values and parameter objects unchanged), also in a group a hook or a replaced weight has
    ended the stacking of. Returns the number of groups with weights so separated (a group stacked within another,
    a sparse MoE block's shared expert's, counted as :func:`stack_projections` counts it)."""
    _check_module("unstack_projections", model)
    # Which weights share storage, for every group before any is separated: separating a MoE block's group
    # separates its shared expert's group within it too.
    groups = []
    for projections in _projection_groups(model):
        storages = [p.weight.untyped_storage().data_ptr() for p in projections]
        groups.append([p for p, s in zip(projections, storages) if storages.count(s) > 1])
    separated = set()
    with torch.inference_mode(False), torch.no_grad():
        for shared in groups:
            for p in shared:
                if id(p) not in separated:
                    p.weight.data = p.weight.detach().clone()
                    separated.add(id(p))
    return sum(bool(shared) for shared in groups)


def _stack_padding(rows: int, element_size: int) -> int:
    """Rows of zeros :func:`stack_projections` puts after a group's ``rows`` stacked rows: up to a multiple of 16 bytes
    of outputs, so that the stacked GEMM's output rows start 16-byte aligned (a sparse MoE block's group has 2 I + E + 1
    rows: at an odd width cuBLAS has few algorithms, a 35B-A3B block's 1281 x 2048 GEMM of 65 rows took 24.2 us on an
    H100, its 1024 x 2048 one 7.2, and the SwiGLU after it runs its scalar path:
    benchmarks/results/2026-12-06-h100-moe-block-fused.md; padded, 7.6 us:
    benchmarks/results/2026-12-06-h100-moe-stacked-padding.md)."""
    per_16_bytes = max(1, 16 // element_size)
    return -rows % per_16_bytes


def stacked_weight(projections: Sequence[torch.nn.Module], padded: bool = False) -> Optional[torch.Tensor]:
    """The weights of ``projections`` (plain bias-free Linear layers or MoE routers, without hooks) as one [sum N, K]
    tensor when they lie one after another in one storage (:func:`stack_projections`), else None; ``padded``: with the
    rows after them up to :func:`_stack_padding` where the storage holds them (as stack_projections leaves it; values
    that only add outputs to drop). Checked per call: a weight reassigned or loaded into new storage since simply ends
    the stacking."""
    if not _stackable(projections):
        return None
    first = projections[0].weight
    k, size, ptr, rows = first.shape[1], first.element_size(), first.data_ptr(), 0
    for p in projections:
        if not p.weight.is_contiguous() or p.weight.data_ptr() != ptr + rows * k * size:
            return None
        rows += p.weight.shape[0]
    available = first.untyped_storage().nbytes() // size - first.storage_offset()
    if rows * k > available:
        return None  # adjacent by chance, in two storages
    if padded and (rows + _stack_padding(rows, size)) * k <= available:
        rows += _stack_padding(rows, size)
    return first.as_strided((rows, k), (k, 1))


def stacked_outputs(projections: Sequence[torch.nn.Module], x: torch.Tensor) -> Optional[Tuple[torch.Tensor, ...]]:
    """Each projection's output over x, from one GEMM over their stacked weight, when they are stacked, the ops apply
    and :func:`stacked_gemm_pays`; else None (the caller runs them apart). Over two or more rows the GEMM covers the
    padding rows too (slices of its output); a single row's runs over the group's own rows, where cuBLAS had the faster
    kernel: a 35B-A3B MoE block's group 5.8 us unpadded (1281 x 2048) against 6.9 padded (1288), and 14.4 against 7.2
    at 16 rows (gemm_tuning's timings on two H100s: benchmarks/results/2026-12-06-h100-moe-stacked-padding.md)."""
    stacked = stacked_weight(projections, padded=x.numel() > x.shape[-1]) if ops_apply(x) else None
    if stacked is None or not stacked_gemm_pays(x, stacked.shape[0]):
        return None
    sizes = [p.weight.shape[0] for p in projections]
    return project(stacked, x).split([*sizes, stacked.shape[0] - sum(sizes)], dim=-1)[: len(sizes)]


def stacked_gemm_pays(x: torch.Tensor, width: int) -> bool:
    """Whether one GEMM of x's rows over ``width`` stacked outputs beats the projections apart. Measured on the H200
    (``scripts/profile_projections.py``, bf16): it does at every layer shape of Qwen3-8B and the 27B at 1, 16 and 65
    rows, but the 27B MLP's 34816 outputs at 65 rows (100.5 against 95.3 us: cuBLAS picks a slower tiling)."""
    return x.numel() <= 16 * x.shape[-1] or width <= 32768


# ---- overlap on a second stream ----------------------------------------------------------------------

# Where Forks use a side stream ("gdn": a GDN layer's gates and z projection beside its qkv projection, conv and
# delta rule; "attn": an attention layer's K and V projections beside its Q projection; "draft": the draft's
# positions, cache slots, RoPE rows and masks beside its context projection; "walk": a round's result row beside its
# commit); the others run inline.
# ``benchmarks/e2e.py --side-streams`` sets it for A/B runs. An MLP's up projection beside its gate projection was
# measured slower on the H200 (two large GEMMs only contend):
# benchmarks/results/2026-11-29-h200-e2e-27b-qwen3-8b-side-streams.md.
side_streams = {"gdn", "attn", "draft", "walk"}
_SIDE_STREAMS: Dict[torch.device, "torch.cuda.Stream"] = {}


def _cuda_device(device: torch.device) -> torch.device:
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def side_stream(device: torch.device) -> Optional["torch.cuda.Stream"]:
    """The stream :class:`Fork` issues side work on for a CUDA device, or None where it has made none yet."""
    return _SIDE_STREAMS.get(_cuda_device(device))


class Fork:
    """Work that can overlap the current stream's, issued on a second stream of the same GPU.

    A layer's independent pieces run one after another on one stream, and many leave the GPU half idle: a
    projection whose output tiles do not fill the SMs, the small latency-bound kernels of a GDN layer. Issued on
    a side stream they overlap; under CUDA graph capture the fork and the joins become graph edges::

        fork = Fork(x.device, "gdn")   # the side stream first waits for everything issued so far
        with fork.side():
            z = in_proj_z(x)           # issued on the side stream
        qkv = in_proj_qkv(x)           # meanwhile, on the current stream
        fork.join(z)                   # the current stream waits for the side work; z is now safe to use

    ``mark()`` records a point on the side stream that ``join(mark, ...)`` waits for alone (work issued on the
    side after it may still run). Results are the same bits either way: each kernel computes the same thing,
    only the order of independent launches changes. On CPU tensors, or with ``side_streams`` off, everything
    runs inline and the joins do nothing; ``use`` names the place, for ``side_streams``.
    """

    def __init__(self, device: torch.device, use: str):
        self.stream = self.main = None
        if use in side_streams and device.type == "cuda":
            device = _cuda_device(device)
            if device not in _SIDE_STREAMS:
                _SIDE_STREAMS[device] = torch.cuda.Stream(device)
            side, main = _SIDE_STREAMS[device], torch.cuda.current_stream(device)
            if side != main:  # streams come from a small pool: the current one may be it (then run inline)
                self.stream, self.main = side, main
                self.stream.wait_stream(self.main)

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        if self.stream is None:
            yield
        else:
            with torch.cuda.stream(self.stream):
                yield

    def used_on_side(self, *tensors: "torch.Tensor") -> None:
        """Records tensors made on the current stream as used by the side work too, so that the allocator does not
        hand their memory to later work on the current stream before the side work is done with them."""
        if self.stream is not None:
            for t in tensors:
                t.record_stream(self.stream)

    def mark(self) -> "Optional[torch.cuda.Event]":
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def join(self, *tensors: "torch.Tensor | torch.cuda.Event | None") -> None:
        """The current stream waits for the side work (up to the first argument when it is a ``mark()``); the
        tensors made on the side stream are recorded as used by the current one, so that the allocator does
        not hand their memory to later side work before the current stream is done with them."""
        if self.stream is None:
            return
        if tensors and isinstance(tensors[0], torch.cuda.Event):
            self.main.wait_event(tensors[0])
            tensors = tensors[1:]
        else:
            self.main.wait_stream(self.stream)
        for t in tensors:
            t.record_stream(self.main)


class _KVPrefetch:
    """An attention layer's q_proj, k_proj and v_proj read the same hidden states, and HF calls them one after
    another. The K and V projections have few outputs (Hkv heads; 1024 on the 27B shape, which cuBLAS ran at
    1.9 TB/s in the e2e profile), so when q_proj is called they start on a side stream, and their own calls then
    take the results; with the three weights stacked (:func:`stack_projections`) the q_proj call runs one GEMM for
    all three instead. Any other call order or input computes as usual."""

    def __init__(self, attn: torch.nn.Module):
        self.attn = attn
        self.pending = None  # (x, fork, k, k_done, v) of the last q_proj call

    @staticmethod
    def _linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return linear(module, x)  # not the module's call: its instance forward is swapped for this prefetch

    def q_forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = self.attn
        self.flush()
        outputs = stacked_outputs((attn.q_proj, attn.k_proj, attn.v_proj), x)
        if outputs is not None:  # one GEMM, nothing on a side stream
            q, k, v = outputs
            self.pending = (x, None, k, None, v)
            return q
        if (x.device.type == "cuda" and "attn" in side_streams
                and not any(has_own_forward(m) for m in (attn.k_proj, attn.v_proj))):
            fork = Fork(x.device, "attn")
            if fork.stream is not None:
                with fork.side():
                    k = self._linear(attn.k_proj, x)
                    k_done = fork.mark()
                    v = self._linear(attn.v_proj, x)
                self.pending = (x, fork, k, k_done, v)
        return self._linear(attn.q_proj, x)

    def k_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pending is None or self.pending[0] is not x:
            return self._linear(self.attn.k_proj, x)
        _, fork, k, k_done, _ = self.pending
        if fork is not None:
            fork.join(k_done, k)
        return k

    def v_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pending is None or self.pending[0] is not x:
            return self._linear(self.attn.v_proj, x)
        _, fork, _, _, v = self.pending
        self.pending = None
        if fork is not None:
            fork.join(v)
        return v

    def flush(self) -> None:
        """Joins and drops side work nobody took (a call order other than HF's), so that none is left behind
        on the side stream (under graph capture, work not joined back fails the capture)."""
        if self.pending is not None:
            if self.pending[1] is not None:
                self.pending[1].join()
            self.pending = None


def _kv_prefetch_swaps(attn: torch.nn.Module) -> Optional[List[Tuple[torch.nn.Module, Callable]]]:
    """The forward swaps of an attention layer's three projections (plain Linear layers only)."""
    projections = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    if not all(type(p) is torch.nn.Linear for p in projections):
        return None
    prefetch = _KVPrefetch(attn)
    return list(zip(projections, (prefetch.q_forward, prefetch.k_forward, prefetch.v_forward)))


# Whether the attention layers run the body of :func:`_attention_forward`: their q/k norms and RoPE as one
# ``ops.qk_norm_rope`` launch (HF's body: two norms and two RoPEs, four launches with the fused forwards) and Qwen3.5's
# output gate as one ``ops.sigmoid_mul`` (a copy of the strided gate, a sigmoid and a multiply in HF).
# ``benchmarks/e2e.py --no-fused-attention`` turns it off for A/B runs.
fuse_attention_heads = True

# Whether an attention layer's new K/V rows go into the static caches from the launch that norms and rotates q and k
# (``ops.qk_norm_rope_store_kv``: the target's verify cache, the draft's stacked layers), else through a store_kv launch
# of their own. ``benchmarks/e2e.py --no-fused-kv-store`` turns it off for A/B runs.
fuse_kv_store = True


def _attention_swaps(attn: torch.nn.Module, gated: bool) -> Optional[List[Tuple[torch.nn.Module, Callable]]]:
    """An attention layer's swaps: its projections' (:func:`_kv_prefetch_swaps`) and its own forward
    (:func:`_attention_forward`, where its stock forward's signature and attributes are the ones that body was written
    against); None when neither applies."""
    import inspect
    import sys

    swaps = _kv_prefetch_swaps(attn) or []
    signature = inspect.signature(type(attn).forward)
    params = list(signature.parameters.values())
    names = [p.name for p in params]
    cache_names = [n for n in _CACHE_ARGUMENTS if n in names]
    modeling = sys.modules.get(type(attn).__module__)
    heads = getattr(getattr(attn, "config", None), "num_attention_heads", None)
    head_dim = getattr(attn, "head_dim", None)
    q_proj = getattr(attn, "q_proj", None)
    if (
        names[:4] == ["self", "hidden_states", "position_embeddings", "attention_mask"] and len(cache_names) == 1
        and len(params) == 6 and params[-1].kind is inspect.Parameter.VAR_KEYWORD
        and all(hasattr(modeling, n) for n in ("ALL_ATTENTION_FUNCTIONS", "eager_attention_forward"))
        and hasattr(modeling.ALL_ATTENTION_FUNCTIONS, "get_interface")
        and all(hasattr(attn, n) for n in ("k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "scaling", "layer_idx"))
        and getattr(attn, "sliding_window", None) is None
        and isinstance(heads, int) and isinstance(head_dim, int)
        and getattr(q_proj, "out_features", None) == heads * head_dim * (2 if gated else 1)
    ):
        forward = functools.partial(_attention_forward, attn, signature, params[-1].name, cache_names[0], gated,
                                    modeling)
        swaps.append((attn, forward))
    return swaps or None


def _attention_forward(attn, signature, var_keyword, cache_name, gated, modeling, *args, **kwargs):
    """HF's Qwen3 / Qwen3.5 attention body (projections, per-head q/k norms, RoPE, cache update, the attention
    implementation, Qwen3.5's sigmoid output gate, output projection) with the norms and RoPE as one
    ``ops.qk_norm_rope`` and the gate as one ``ops.sigmoid_mul``: the same bits as the stock body with the fused
    forwards (the ops compose as those do).

    Only for a cache that says its ``update(key, value, layer_idx)`` needs nothing else (``fused_attention_body``: the
    target adapter's verify cache); with any other cache (HF's take other arguments from one transformers version to
    the next), no cache, grad mode or a call this body was not written for, the stock forward runs."""
    try:
        bound = signature.bind(attn, *args, **kwargs)
    except TypeError:
        bound = None
    if (
        bound is None or not fuse_attention_heads or torch.is_grad_enabled()
        or any(n in bound.arguments.get(var_keyword, {}) for n in _CACHE_ARGUMENTS)
        or not getattr(bound.arguments.get(cache_name), "fused_attention_body", False)
    ):
        return type(attn).forward(attn, *args, **kwargs)
    hidden_states = bound.arguments["hidden_states"]
    cos, sin = bound.arguments["position_embeddings"]
    cache = bound.arguments[cache_name]
    extra = bound.arguments.get(var_keyword, {})

    input_shape = hidden_states.shape[:-1]
    head_dim = attn.head_dim
    query = attn.q_proj(hidden_states)
    gate = None
    if gated:
        query, gate = torch.chunk(query.view(*input_shape, -1, head_dim * 2), 2, dim=-1)
    else:
        query = query.view(*input_shape, -1, head_dim)
    key = attn.k_proj(hidden_states).view(*input_shape, -1, head_dim)
    value = attn.v_proj(hidden_states).view(*input_shape, -1, head_dim)
    # The verify cache tells where update would write (slot_buffers): then one launch norms, rotates and stores.
    slot_buffers = getattr(cache, "slot_buffers", None)
    stored = None if slot_buffers is None else fused_qk_norm_rope_store_kv(
        attn.q_norm, attn.k_norm, query, key, value, cos, sin, *slot_buffers(attn.layer_idx)
    )
    if stored is not None:
        query = stored
        key, value = cache.stored(attn.layer_idx)
    else:
        query, key = _heads_norm_rope(attn, modeling, query, key, cos, sin)
        key, value = cache.update(key, value.transpose(1, 2), attn.layer_idx)

    interface = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation,
                                                               modeling.eager_attention_forward)
    # Qwen3's layers also pass their sliding window (None: the swap takes only full-attention layers); Qwen3.5's do not.
    window = {"sliding_window": None} if hasattr(attn, "sliding_window") else {}
    out, weights = interface(attn, query, key, value, bound.arguments["attention_mask"],
                             dropout=0.0 if not attn.training else attn.attention_dropout, scaling=attn.scaling,
                             **window, **extra)
    out = out.reshape(*input_shape, -1).contiguous()
    if gate is not None:
        heads_view = out.view(*input_shape, -1, head_dim)
        if ops_apply(heads_view, gate):
            out = ops.sigmoid_mul(gate, heads_view).view(*input_shape, -1)
        else:
            out = out * torch.sigmoid(gate.reshape(*input_shape, -1))
    return attn.o_proj(out), weights


def _qk_norm_rope_params(q_norm: torch.nn.Module, k_norm: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor) -> Optional[Tuple[float, bool]]:
    """(eps, zero_centered) where ``ops.qk_norm_rope`` can stand in for the two norms and the rotation (recognised norms
    without hooks, of one eps and kind; query, key [B, N, H, D] and cos, sin [B, N, R] on tensors the ops take), else
    None."""
    q_params, k_params = _norm_params(q_norm), _norm_params(k_norm)
    if (
        q_params is not None and q_params == k_params and _plain_module(q_norm) and _plain_module(k_norm)
        and query.dim() == 4 and key.dim() == 4 and key.shape[:2] == query.shape[:2]
        and cos.dim() == 3 and sin.shape == cos.shape and cos.shape[:2] == query.shape[:2]
        and cos.shape[2] % 2 == 0 and 2 <= cos.shape[2] <= query.shape[3]
        and ops_apply(query, key, cos, sin, q_norm.weight, k_norm.weight)
    ):
        return q_params
    return None


def fused_qk_norm_rope_store_kv(
    q_norm: torch.nn.Module, k_norm: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
) -> Optional[torch.Tensor]:
    """query [B, N, H, D] and key [B, N, Hk, D] normed by ``q_norm`` / ``k_norm`` and rotated as
    :func:`_heads_norm_rope` does, and the rotated key and ``value`` [B, N, Hk, D] stored into the caches keys, values
    [B, Hk, S, D] at slots ([B, N] or [N] int64, negative: not stored) as ``ops.store_kv`` would, in one launch
    (``ops.qk_norm_rope_store_kv``). Returns the query [B, H, N, D], or None where it does not apply (nothing run: the
    caller norms, rotates and stores itself, with the same bits). ``fuse_kv_store`` off: always None."""
    params = _qk_norm_rope_params(q_norm, k_norm, query, key, cos, sin) if fuse_kv_store else None
    if (
        params is None or not ops_apply(query, value, keys, values) or value.shape != key.shape
        or slots.dtype != torch.int64 or slots.device != query.device or not slots.is_contiguous()
        or slots.dim() not in (1, 2) or slots.shape[-1] != query.shape[1]
    ):
        return None
    return ops.qk_norm_rope_store_kv(query, key, value, q_norm.weight, k_norm.weight, cos, sin, params[0], keys,
                                     values, slots, zero_centered=params[1])


def _heads_norm_rope(attn, modeling, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(query, key) [B, N, H, D] -> [B, H, N, D] each, normed by the layer's q_norm / k_norm and rotated: one
    ``ops.qk_norm_rope`` launch where it applies (:func:`_qk_norm_rope_params`), else the norms' forwards and the
    modeling module's ``apply_rotary_pos_emb``, as HF's body (the same bits)."""
    params = _qk_norm_rope_params(attn.q_norm, attn.k_norm, query, key, cos, sin)
    if params is not None:
        return ops.qk_norm_rope(query, key, attn.q_norm.weight, attn.k_norm.weight, cos, sin, params[0],
                                zero_centered=params[1])
    query, key = attn.q_norm(query).transpose(1, 2), attn.k_norm(key).transpose(1, 2)
    return modeling.apply_rotary_pos_emb(query, key, cos, sin)


def _mlp_forward(mlp: torch.nn.Module, x: torch.Tensor):
    outputs = stacked_outputs((mlp.gate_proj, mlp.up_proj), x)
    gate, up = outputs if outputs is not None else (mlp.gate_proj(x), mlp.up_proj(x))
    if gate.shape != up.shape or not ops_apply(gate, up) or not _plain_silu(mlp.act_fn):
        return mlp.down_proj(mlp.act_fn(gate) * up)
    return mlp.down_proj(ops.silu_mul(gate, up))


def _apply_rotary_pos_emb(stock: Callable, q, k, cos, sin, *args, **kwargs):
    """HF's ``apply_rotary_pos_emb(q, k, cos, sin)`` for q, k [B, H, N, D] and cos, sin [B, N, R] in their
    dtype: one ``ops.rope`` launch each (bit for bit HF's rounding); anything else (or another thread's call:
    see ``_ProcessPatches``) goes to ``stock``."""
    if (
        not _PROCESS_PATCHES.held_here()
        or args or set(kwargs) - {"unsqueeze_dim"} or kwargs.get("unsqueeze_dim", 1) != 1
        or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape
        or cos.shape[0] != q.shape[0] or cos.shape[1] != q.shape[2] or k.shape[:1] + k.shape[2:] != q.shape[:1] + q.shape[2:]
        or cos.shape[2] > q.shape[3] or cos.shape[2] % 2 or not ops_apply(q, k, cos, sin)
    ):
        return stock(q, k, cos, sin, *args, **kwargs)
    return ops.rope(q, cos, sin), ops.rope(k, cos, sin)


def gqa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """SDPA of query [B, H, N, D] over key / value [B, Hkv, S, D] (H a multiple of Hkv; head h reads KV head
    h // (H / Hkv)) under a mask [B, 1, N or 1, S] shared by all heads (bool, True = attend, or additive) ->
    [B, H, N, D].

    The G = H / Hkv query heads of a KV head are folded into its query rows ([B, Hkv, G * N, D], the mask's
    rows tiled G times), so the fused kernel reads each KV head once: no [B, H, S, D] copies of K and V
    (what ``repeat_kv`` makes when a mask is given) and no math-kernel fallback (what ``enable_gqa`` with a
    mask gets).

    On CUDA with a bool mask and no grad mode this is ``ops.gqa_attention`` instead (split over the keys: SDPA's
    fused kernels tile only the query rows, a few CTAs per layer at decode), its output in [B, N, H, D] memory
    order, which is what HF's attention forward turns it into next."""
    batch, heads, n, dim = query.shape
    if query.is_cuda and mask.dtype == torch.bool and not torch.is_grad_enabled() and ops_apply(query, key, value):
        out = torch.empty(batch, n, heads, dim, dtype=query.dtype, device=query.device).transpose(1, 2)
        return ops.gqa_attention(query, key, value, mask, scale, out=out)
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    if groups == 1:
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    # A mask with one query row (a decode step, a non-causal block) broadcasts over the folded rows as it is.
    folded_mask = mask if mask.shape[-2] == 1 else mask.repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, kv_heads, groups * n, dim), key, value, attn_mask=folded_mask, scale=scale
    )
    # reshape, not view: the fused kernels may return their output in [B, rows, heads, D] memory order.
    return out.reshape(batch, heads, n, dim)


def _sdpa_attention_forward(stock: Callable, module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            is_causal=None, **kwargs):
    """HF's ``sdpa_attention_forward`` through :func:`gqa_attention` when the layer has KV groups and a 4D mask
    shared by its heads (every verify: the tree mask); anything else goes to ``stock``."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (
        not _PROCESS_PATCHES.held_here() or groups == 1 or torch.is_grad_enabled()
        or attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[1] != 1
        or dropout or is_causal or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
        or kwargs.get("output_attentions", False) or query.shape[1] != groups * key.shape[1]
        or value.shape[-1] != query.shape[-1]
    ):
        return stock(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                     **kwargs)
    out = gqa_attention(query, key, value, attention_mask, scaling if scaling is not None else query.shape[-1] ** -0.5)
    return out.transpose(1, 2).contiguous(), None


class _ProcessPatches:
    """The process-wide half of every active fusion: ``apply_rotary_pos_emb`` in the modeling modules and the
    "sdpa" entry of HF's attention registry. Installed when the first fusion context opens and removed when
    the last one closes (reference counted under a lock), so contexts may close in any order, from any
    thread, without leaving a patch behind. The patched functions act only in threads that hold a context
    (:meth:`held_here`); any other thread's model runs HF's code."""

    def __init__(self):
        self._lock = threading.Lock()
        self._count = 0
        self._restore: List[Callable[[], None]] = []
        self._depth: Dict[int, int] = {}  # thread ident -> the contexts that thread opened and holds

    def held_here(self) -> bool:
        return threading.get_ident() in self._depth

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        # Keyed by the opening thread, not a threading.local: a context closed from another thread must still
        # count down its own thread's depth and the patches' reference count.
        opener = threading.get_ident()
        with self._lock:
            if self._count == 0:
                try:
                    self._install()
                except BaseException:  # a half-installed set is put back before the error propagates
                    self._put_back_all()
                    raise
            self._count += 1
            self._depth[opener] = self._depth.get(opener, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                if self._depth[opener] == 1:
                    del self._depth[opener]
                else:
                    self._depth[opener] -= 1
                self._count -= 1
                if self._count == 0:
                    self._put_back_all()

    def _put_back_all(self) -> None:
        for restore in reversed(self._restore):
            restore()
        self._restore = []

    def _install(self) -> None:
        for owner, name, value in _rotary_patches():
            previous = owner.__dict__.get(name, _MISSING)
            setattr(owner, name, value)
            self._restore.append(functools.partial(_put_back, owner, name, previous))
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as registry

        local = getattr(registry, "_local_mapping", None)
        if local is None or "sdpa" not in registry:  # a registry of another shape: leave it alone
            return
        previous = local.get("sdpa", _MISSING)
        registry["sdpa"] = functools.partial(_sdpa_attention_forward, registry["sdpa"])
        self._restore.append(functools.partial(_put_back_item, registry, "sdpa", previous))


def _put_back(owner, name, previous) -> None:
    if previous is _MISSING:
        delattr(owner, name)
    else:
        setattr(owner, name, previous)


def _put_back_item(mapping, key, previous) -> None:
    if previous is _MISSING:
        del mapping[key]
    else:
        mapping[key] = previous


_PROCESS_PATCHES = _ProcessPatches()


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [B, H, N, D] with cos, sin [B, N, D]: ``ops.rope`` where it applies (no grad mode, a dtype
    it takes), the same formula in torch ops otherwise (the op has no backward; the draft trains through this)."""
    if ops_apply(x, cos, sin):
        return ops.rope(x, cos, sin)
    c, s = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    return x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * s


def rope_table(rotary: torch.nn.Module, capacity: int, dtype: torch.dtype, *,
               per_position_factors: bool = False) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(cos, sin) [capacity, rotary dim] in ``dtype``: a rotary embedding's output for positions 0 .. capacity - 1,
    which :func:`rope_rows` gathers instead of running the module (two launches where it launched eight on the H200:
    the product, a concat, cos, sin, two scalings, two casts). None for a RoPE that follows the sequence length
    (dynamic; longrope unless ``per_position_factors``), a module with an accelerate hook (it moves tensors between
    devices), one this table does not know, and while float32 matmuls may run in TF32 (see below).

    HF's rotary embeddings form each position's angles from that position alone (a product with the inverse
    frequencies; some transformers versions take it as a matmul of depth one, one product per output), so a table row
    holds the bits a call computes for that position. Under TF32 such a matmul's inputs are rounded or not depending on
    the kernel cuBLAS picks for the shape, so readers ask :func:`rope_table_serves` at each use too (the precision or
    a hook may change after the table is built). Qwen3.5's multimodal RoPE reads one position per axis: for text the
    axes share it (the model expands one row), and the table is built that way.

    A longrope embedding takes its short factors in a call whose largest position is below its
    ``original_max_position_embeddings`` and its long ones otherwise, for every position of the call. With
    ``per_position_factors`` each row holds what a call at that position alone gives (short factors below the
    boundary, long ones from it), as a one-token decode step computes it: what a verify of many positions must use to
    give the target's own decoding."""
    longrope = is_longrope(rotary)
    dynamic = "dynamic" in str(getattr(rotary, "rope_type", ""))
    if dynamic or (longrope and not per_position_factors) or not rope_table_serves(rotary):
        return None
    inv_freq = getattr(rotary, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.device.type == "meta":
        return None
    # Calls over [0, boundary) and [boundary, capacity): each call's largest position picks the factors of its rows.
    boundary = min(longrope_boundary(rotary), capacity) if longrope else capacity
    spans = [(start, stop) for start, stop in ((0, boundary), (boundary, capacity)) if stop > start]
    parts = []
    with torch.no_grad():
        for start, stop in spans:
            positions = torch.arange(start, stop, device=inv_freq.device)[None]
            if hasattr(rotary, "mrope_section"):  # [3, B, T], as the text model passes one text row to it
                positions = positions[None].expand(3, -1, -1)
            cos, sin = rotary(inv_freq.new_empty(1, stop - start, 1, dtype=dtype), positions)
            if cos.dim() != 3 or cos.shape[:2] != (1, stop - start) or sin.shape != cos.shape:
                return None
            parts.append((cos[0], sin[0]))
    if len(parts) == 1:
        return parts[0]
    return torch.cat([cos for cos, _ in parts]), torch.cat([sin for _, sin in parts])


def is_longrope(rotary: torch.nn.Module) -> bool:
    """Whether a rotary embedding is HF's longrope (short or long factors by the largest position of a call)."""
    return "longrope" in str(getattr(rotary, "rope_type", ""))


def longrope_boundary(rotary: torch.nn.Module) -> int:
    """A longrope rotary embedding's ``original_max_position_embeddings``, where HF's ``longrope_frequency_update``
    reads it (the config's ``rope_parameters``, or the config itself in older layouts): a call whose positions all lie
    below it takes the short factors, any other call the long ones."""
    config = getattr(rotary, "config", None)
    params = getattr(config, "rope_parameters", None)
    value = params.get("original_max_position_embeddings") if isinstance(params, dict) else None
    if value is None:
        value = getattr(config, "original_max_position_embeddings", None)
    if value is None:
        raise ValueError("target: a longrope rotary embedding without original_max_position_embeddings in its config "
                         "(rope_parameters); expected the position where its long factors begin")
    return int(value)


def per_position_longrope(rotary: torch.nn.Module, forward: Callable) -> Callable:
    """A forward for a longrope rotary embedding that gives each position the factors a call at that position alone
    takes (short below :func:`longrope_boundary`, long from it) by two calls of ``forward``: one with the positions at
    or past the boundary replaced by 0 (all short), one with those below it replaced by the boundary (all long),
    then each row from the call that computed it as itself. Positions [B, T], or [3, B, T] for Qwen3.5's text (its
    axes share one position). For where :func:`rope_table` gives no table (a hook, TF32)."""
    boundary = longrope_boundary(rotary)

    def split_forward(x: torch.Tensor, position_ids: torch.Tensor):
        below = position_ids < boundary
        cos_short, sin_short = forward(x, torch.where(below, position_ids, torch.zeros_like(position_ids)))
        cos_long, sin_long = forward(x, torch.where(below, torch.full_like(position_ids, boundary), position_ids))
        rows = below[0] if below.dim() == 3 else below
        pick = rows.to(cos_short.device)[..., None]
        return torch.where(pick, cos_short, cos_long), torch.where(pick, sin_short, sin_long)

    return split_forward


def rope_rows(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The rows of a :func:`rope_table` at positions [B, T] (int64, in range): (cos, sin) [B, T, rotary dim]."""
    rows = positions.reshape(-1)
    return tuple(t.index_select(0, rows).view(*positions.shape, -1) for t in (cos, sin))


def rope_table_serves(rotary: torch.nn.Module) -> bool:
    """Whether a :func:`rope_table` of ``rotary`` gives its bits now: the module runs its class's forward (no instance
    forward of its own, as accelerate's hook or a user's patch would set, other than this thread's swap of it), has no
    hooks, and float32 matmuls run in full float32 (torch's default), not TF32 or bf16 passes."""
    return _plain_module(rotary) and torch.get_float32_matmul_precision() == "highest"


def _recognised_classes() -> dict:
    """Class -> factory of a module's fused forward (None where the op does not apply; a list of (child, forward)
    swaps for an attention layer's projections), for the HF classes this transformers install has."""
    from transformers.models.qwen3 import modeling_qwen3 as qwen3

    table = {
        torch.nn.Linear: lambda m: functools.partial(linear, m) if m.bias is None else None,
        qwen3.Qwen3RMSNorm: lambda m: functools.partial(_norm_forward, m, *_norm_params(m)),
        qwen3.Qwen3MLP: lambda m: functools.partial(_mlp_forward, m) if _silu_mlp(m) else None,
        qwen3.Qwen3Attention: functools.partial(_attention_swaps, gated=False),
    }
    for family in _qwen3_5_families():
        table.update({
            family.cls("RMSNorm"): lambda m: functools.partial(_norm_forward, m, *_norm_params(m)),
            family.cls("RMSNormGated"): lambda m: (
                functools.partial(_gated_norm_forward, m) if getattr(m, "activation", "silu") == "silu" else None
            ),
            family.cls("MLP"): lambda m: functools.partial(_mlp_forward, m) if _silu_mlp(m) else None,
            family.cls("Attention"): functools.partial(_attention_swaps, gated=True),
        })
    for cls in _moe_classes("Experts"):
        table[cls] = lambda m: functools.partial(_experts_forward, m)
    for cls in _moe_classes("SparseMoeBlock"):
        table[cls] = lambda m: functools.partial(_moe_block_forward, m)
    return table


def _decoder_classes() -> tuple:
    """The HF decoder-layer classes whose bodies :func:`_decoder_forward` follows."""
    from transformers.models.qwen3 import modeling_qwen3 as qwen3

    return (qwen3.Qwen3DecoderLayer, *(family.cls("DecoderLayer") for family in _qwen3_5_families()))


def _rotary_patches() -> Tuple[Tuple[object, str, object], ...]:
    """(modeling module, "apply_rotary_pos_emb", fused version) for the families the attention layers
    look the function up in (a module global, so it is swapped there while a fusion is active). Read at
    each install, so the fallback is whatever the module holds then (another library's patch included)."""
    import importlib

    patches = []
    modules = [importlib.import_module("transformers.models.qwen3.modeling_qwen3")]
    modules += [family.module for family in _qwen3_5_families()]
    for module in modules:
        stock = getattr(module, "apply_rotary_pos_emb", None)
        if stock is not None:
            patches.append((module, "apply_rotary_pos_emb", functools.partial(_apply_rotary_pos_emb, stock)))
    return tuple(patches)


SILU_ACTIVATIONS = ("silu", "swish")  # the HF activation names the fused SiLUs stand in for


def _silu_mlp(module: torch.nn.Module) -> bool:
    """The MLP's activation is one of HF's SiLU modules (hooks aside: :func:`_plain_silu` asks per call)."""
    return type(getattr(module, "act_fn", None)) in _silu_classes()


@functools.lru_cache(maxsize=None)
def _silu_classes() -> Tuple[type, ...]:
    """The SiLU module classes HF installs for "silu" / "swish" (its own SiLUActivation where it has one)."""
    from transformers import activations

    return (torch.nn.SiLU, getattr(activations, "SiLUActivation", torch.nn.SiLU))


def _plain_silu(act_fn: object) -> bool:
    """``act_fn`` is one of HF's SiLU modules, with no hooks: the fused SiLU-and-multiply gives its bits. Asked per
    call: a module swapped in or hooked after the fusion was set up runs as it is."""
    return type(act_fn) in _silu_classes() and _plain_module(act_fn)


class LayerFusion:
    """The fused forwards of every recognised submodule of ``root`` (exact classes only: a subclass may
    have changed the forward), found once; :meth:`active` swaps them in."""

    def __init__(self, root: torch.nn.Module):
        table = _recognised_classes()
        self.swaps: List[Tuple[torch.nn.Module, Callable]] = []
        # Decoder layers, per stack (a ModuleList of them): each hands its last residual add, fused with the next
        # layer's input norm, to that layer.
        decoder_classes = _decoder_classes()
        handoff = _NormHandoff()
        for stack in root.modules():
            if not isinstance(stack, torch.nn.ModuleList):
                continue
            layers = list(stack)
            for i, layer in enumerate(layers):
                if type(layer) not in decoder_classes:
                    continue
                following = layers[i + 1] if i + 1 < len(layers) and type(layers[i + 1]) in decoder_classes else None
                forward = _decoder_swap(layer, following, handoff)
                if forward is not None:
                    self.swaps.append((layer, forward))
        swapped = set()  # a module's parent may have swapped it already (an attention layer's projections)
        for module in root.modules():
            factory = table.get(type(module))
            forward = factory(module) if factory is not None and id(module) not in swapped else None
            for child, child_forward in forward if isinstance(forward, list) else [(module, forward)]:
                if child_forward is not None:
                    self.swaps.append((child, child_forward))
                    swapped.add(id(child))

    def active(self) -> contextlib.AbstractContextManager:
        """A context in which the recognised modules run their fused forwards. The ops have no backward:
        with grad mode on (training a draft) the stock forwards stay."""
        if torch.is_grad_enabled():
            return contextlib.nullcontext()
        return self._active()

    @contextlib.contextmanager
    def _active(self) -> Iterator[None]:
        # A module with an instance forward of its own keeps it: accelerate's hook (which moves inputs, loads
        # offloaded weights) or a user's patch lives there, and a swap would skip it.
        swaps = [(m, "forward", f) for m, f in self.swaps if not has_own_forward(m)]
        try:
            with _PROCESS_PATCHES.held(), swapped_attributes(swaps):
                yield
        finally:
            for _, forward in self.swaps:  # K/V prefetches that no k_proj / v_proj call took
                owner = getattr(forward, "__self__", None)
                if isinstance(owner, _KVPrefetch):
                    owner.flush()
