"""Fake (meta) kernels so torch.compile can trace the ops. Every op only writes into buffers the caller
passed and returns nothing, so each fake kernel has nothing to compute. The host queries
linear_cublaslt_algorithms and linear_cublaslt_describe have none: they run before tracing, not inside it."""

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
    "row_argmax",
    "walk_greedy",
    "walk_sample",
    "commit_gdn_state",
    "commit_conv_state",
    "commit_kv",
    "store_kv",
    "gather_rows",
)


def _returns_nothing(*args, **kwargs):
    return None


for _name in _OPS:
    torch.library.register_fake(f"ddtree::{_name}")(_returns_nothing)
