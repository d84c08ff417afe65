"""Fused forwards for the small pieces of the HF layer bodies that a round runs through.

Hugging Face's Qwen3 / Qwen3.5 layers run every norm and activation as a chain of small kernels: an
RMSNorm is about ten (casts, pow, mean, add, rsqrt, multiplies), a SwiGLU two. In a round replayed from
a CUDA graph each still costs 2-3 us of GPU time, which over the 64 layers of a 27B model is a third of
a decode step. :class:`LayerFusion` swaps the forward of each recognised submodule (per instance, for
the duration of a context) for one compiled op with the same rounding points:

=========================  ===================================================
module                     fused forward
=========================  ===================================================
``Qwen3RMSNorm``           ``ops.rms_norm``
``Qwen3_5RMSNorm``         ``ops.rms_norm(zero_centered=True)``
``Qwen3_5RMSNormGated``    ``ops.rms_norm(gate=...)``
``Qwen3MLP``/``Qwen3_5MLP``  ``down_proj(ops.silu_mul(gate_proj(x), up_proj(x)))`` (SiLU models)
=========================  ===================================================

The HF forward still runs for inputs the ops do not take (a weight dtype other than the input's, a
missing gate), so a swap never changes what a module accepts. The one numerical difference from HF is
the order of the float32 sum of squares in a norm (an ulp of float32 on the normalised value).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator, List, Sequence, Tuple

import torch

from ddtree_ext import ops

_MISSING = object()


@contextlib.contextmanager
def swapped_forwards(swaps: Sequence[Tuple[torch.nn.Module, Callable]]) -> Iterator[None]:
    """Sets ``module.forward`` (an instance attribute) for every (module, forward) pair while the context
    is open and puts back what was there before (an instance forward of its own, e.g. an accelerate
    hook, or none) on exit, also when the body raised."""
    saved: List[Tuple[torch.nn.Module, object]] = []
    try:
        for module, forward in swaps:
            saved.append((module, module.__dict__.get("forward", _MISSING)))
            module.forward = forward
        yield
    finally:
        for module, previous in reversed(saved):
            if previous is _MISSING:
                del module.forward
            else:
                module.forward = previous


# The fused forwards are partials over the module, not closures: a deep copy of a model (and of the
# LayerFusion it holds) then swaps the copy's modules, never the original's.


def _norm_forward(norm: torch.nn.Module, eps: float, zero_centered: bool, hidden_states: torch.Tensor):
    if hidden_states.dtype != norm.weight.dtype:
        return type(norm).forward(norm, hidden_states)
    return ops.rms_norm(hidden_states, norm.weight, eps, zero_centered=zero_centered)


def _gated_norm_forward(norm: torch.nn.Module, hidden_states: torch.Tensor, gate=None):
    if gate is None or hidden_states.dtype != norm.weight.dtype or gate.dtype != hidden_states.dtype:
        return type(norm).forward(norm, hidden_states, gate)
    return ops.rms_norm(hidden_states, norm.weight, norm.variance_epsilon, gate=gate)


def _mlp_forward(mlp: torch.nn.Module, x: torch.Tensor):
    return mlp.down_proj(ops.silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))


def _recognised_classes() -> dict:
    """Class -> factory of a module's fused forward (None where the op does not apply), for the HF
    classes this transformers install has."""
    from transformers.models.qwen3 import modeling_qwen3 as qwen3

    table = {
        qwen3.Qwen3RMSNorm: lambda m: functools.partial(_norm_forward, m, m.variance_epsilon, False),
        qwen3.Qwen3MLP: lambda m: functools.partial(_mlp_forward, m) if _silu_mlp(m) else None,
    }
    try:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5
    except ImportError:  # a transformers without Qwen3.5
        return table
    table.update({
        qwen3_5.Qwen3_5RMSNorm: lambda m: functools.partial(_norm_forward, m, m.eps, True),
        qwen3_5.Qwen3_5RMSNormGated: lambda m: (
            functools.partial(_gated_norm_forward, m) if getattr(m, "activation", "silu") == "silu" else None
        ),
        qwen3_5.Qwen3_5MLP: lambda m: functools.partial(_mlp_forward, m) if _silu_mlp(m) else None,
    })
    return table


def _silu_mlp(module: torch.nn.Module) -> bool:
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    return act in ("silu", "swish")


class LayerFusion:
    """The fused forwards of every recognised submodule of ``root`` (exact classes only: a subclass may
    have changed the forward), found once; :meth:`active` swaps them in."""

    def __init__(self, root: torch.nn.Module):
        table = _recognised_classes()
        self.swaps: List[Tuple[torch.nn.Module, Callable]] = []
        for module in root.modules():
            factory = table.get(type(module))
            forward = factory(module) if factory is not None else None
            if forward is not None:
                self.swaps.append((module, forward))

    def active(self) -> contextlib.AbstractContextManager:
        """A context in which the recognised modules run their fused forwards. The ops have no backward:
        with grad mode on (training a draft) the stock forwards stay."""
        if torch.is_grad_enabled():
            return contextlib.nullcontext()
        return swapped_forwards(self.swaps)
