"""Fake (meta) kernels so torch.compile can trace the ops. Every op only writes into buffers the caller
passed and returns nothing, so each fake kernel has nothing to compute; it checks only that the tensors share one
device, as every op does: a call mixing meta tensors with real ones comes here, and would otherwise do nothing
without a word. The host queries linear_cublaslt_algorithms and linear_cublaslt_describe have none: they run
before tracing, not inside it."""

import torch

_OPS = (
    "topk_logprobs",
    "build_tree",
    "tree_attention_mask",
    "tree_conv1d",
    "tree_gated_delta_rule",
    "gdn_conv_delta_rule",
    "rms_norm",
    "add_rms_norm",
    "silu_mul",
    "rope",
    "qk_norm_rope",
    "qk_norm_rope_store_kv",
    "sigmoid_mul",
    "linear",
    "linear_cublaslt",
    "linear_gemv",
    "gqa_attention",
    "gdn_gates",
    "moe_experts",
    "moe_router",
    "penalize_logits",
    "row_argmax",
    "walk_greedy",
    "walk_sample",
    "commit_gdn_state",
    "commit_conv_state",
    "commit_kv",
    "store_kv",
    "gather_rows",
)


def _tensors(values):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


def _fake_kernel(name: str):
    def fake(*args, **kwargs):
        devices = {t.device for t in _tensors([*args, *kwargs.values()])}
        if len(devices) > 1:
            raise ValueError(f"{name}: every tensor argument must be on one device, got "
                             f"{', '.join(sorted(map(str, devices)))}")

    return fake


for _name in _OPS:
    torch.library.register_fake(f"ddtree::{_name}")(_fake_kernel(_name))
