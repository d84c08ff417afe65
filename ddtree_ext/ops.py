"""Typed wrappers over the compiled ``torch.ops.ddtree`` ops.

Each wrapper allocates its outputs (or takes them through ``out=`` so a caller can keep static buffers
for CUDA graphs) and calls the op. The ops check every argument before writing anything and raise
``ValueError`` naming the op, the argument and what was expected. ``ddtree_ext.reference`` holds a
pure-PyTorch twin of every function here with the same signature (minus ``out``); it is the
specification the tests compare against.

Conventions (all ops take a batch dimension B, each row with its own tree):
  N = budget + 1 tree nodes per row, node 0 the root (the last committed token, not yet run through
  the target), nodes in topological order (parent < child). Rows with fewer real nodes than N are
  padded with harmless nodes: children of the root that repeat the root's token, reachable by no walk.
  Token ids, prefix lengths and positions are int64; node indices, depths and counts are int32.
  ``prefix_len[b]`` is the number of tokens of row b already in the target's caches; node i of the
  verify block sits at cache slot ``prefix_len[b] + i`` with rotary position ``prefix_len[b] + depth[i]``.

Dtypes and layouts:
  Floating tensors are float32, float16 or bfloat16 ("float" and "one float dtype" below); float64 is refused
  (``row_argmax`` alone takes it, through torch.argmax). Feature rows (x, q, k, v, logits, caches, ...) need a
  contiguous last dim only, as each function says. Index and count tensors (parent, accepted, accept_len,
  slots, the commits' prefix_len), per-node values (g, beta, target_token, uniform), the GDN recurrent states and stashes,
  tree_conv1d's weight, gdn_gates' weights, A_log and dt_bias, and the ``out`` buffers of build_tree, the walks,
  tree_conv1d and the GDN ops must be contiguous: an expanded tensor (stride 0) is refused, not read. The error
  names the tensor by the op's own argument name (``node_token`` for a Tree's ``token``, ``mask`` for
  tree_attention_mask's ``out``).
"""

from __future__ import annotations

import operator
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from ddtree_ext._loader import load_ops


class TopK(NamedTuple):
    """Per-depth top-K of the draft: ``logp [B, L, K]`` float32 log-probabilities (descending),
    ``tokens [B, L, K]`` int64 token ids."""

    logp: torch.Tensor
    tokens: torch.Tensor


class Tree(NamedTuple):
    """A padded draft tree per batch row, in topological order.

    token [B, N] int64, parent [B, N] int32 (-1 at the root), depth [B, N] int32 (0 at the root),
    num_nodes [B] int32 (real nodes, root included), first_child / next_sibling [B, N] int32 (-1 for
    none; children ordered by index; padding nodes are linked nowhere), ancestor_mask
    [B, N, ceil(N / 64)] int64 (bit j of node i set iff j is an ancestor of i or i itself),
    position [B, N] int64 (``prefix_len + depth``).
    """

    token: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    num_nodes: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor
    ancestor_mask: torch.Tensor
    position: torch.Tensor


class GDNTreeOutput(NamedTuple):
    """Output of the tree gated delta rule.

    out [B, N, HV, V] (dtype of v): the per-node outputs. The stash is what the commit needs, a few
    kilobytes per node instead of a K x V state: stash_u [B, N, HV, V] float32 (the delta-rule update
    vector u_i), stash_k [B, N, H, K] float32 (the l2-normalised key), stash_cumg [B, N, HV] float32
    (the log decay summed along the root-to-node path, G_i).
    """

    out: torch.Tensor
    stash_u: torch.Tensor
    stash_k: torch.Tensor
    stash_cumg: torch.Tensor


class Walk(NamedTuple):
    """Result of walking the tree with the target's tokens.

    accepted [B, D] int32: node indices of the accepted path, root first, padded with -1;
    accept_len [B] int32: nodes on the path (>= 1, the root included) = tokens committed this round;
    next_token [B] int64: the target's token at the last accepted node (the bonus, next round's root).
    """

    accepted: torch.Tensor
    accept_len: torch.Tensor
    next_token: torch.Tensor


def tree_num_words(num_nodes: int) -> int:
    """int64 words per row of the packed ancestor bitmask for trees of ``num_nodes`` nodes."""
    return (num_nodes + 63) // 64


def _check_dim(op: str, name: str, t: torch.Tensor, dims: int, layout: str) -> None:
    """A ValueError naming the argument when ``t`` is not a tensor of ``dims`` dims (``layout`` names them): the
    wrappers read sizes from their inputs to allocate outputs before the op checks them."""
    if not isinstance(t, torch.Tensor) or t.dim() != dims:
        got = f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{op}: {name} must have shape {layout}, got {got}")


def _out_rows(op: str, out: torch.Tensor, shape: torch.Size, name: str = "out") -> torch.Tensor:
    """A given output ``name`` [..., D] of ``shape`` as rows [R, D] without a copy (the op writes them), else a
    ValueError."""
    if out.shape != shape:
        raise ValueError(f"{op}: {name} must have shape {list(shape)}, got {list(out.shape)}")
    return _rows_view(op, out, name)


def _rows_view(op: str, out: torch.Tensor, name: str = "out") -> torch.Tensor:
    """An output ``name`` [..., D] as rows [R, D] without a copy (the op writes them), else a ValueError."""
    if out.dim() == 2:
        return out
    _check_features(op, **{name: out})
    try:
        return out.view(-1, out.shape[-1])
    except RuntimeError:
        raise ValueError(f"{op}: {name}'s rows must be reachable by one stride (e.g. contiguous), got shape "
                         f"{list(out.shape)} with strides {list(out.stride())}") from None


def _check_features(op: str, **tensors: Optional[torch.Tensor]) -> None:
    """Each given tensor [..., D] must have a last dim D >= 1 (rows of features): a scalar or an empty last dim is
    refused here, naming the op and the argument, before a reshape fails less clearly."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and (t.dim() == 0 or t.shape[-1] == 0):
            raise ValueError(f"{op}: {name} must have shape [..., D] with D >= 1, got {list(t.shape)}")


def _check_count(op: str, name: str, value, low: int, high: Optional[int] = None) -> int:
    """``value`` as an int in [low, high] (an int, not a bool), else a ValueError naming the argument: the sizes the
    wrappers allocate with are checked before torch's allocator sees them."""
    try:
        count = None if isinstance(value, bool) else operator.index(value)  # numpy and 0-dim integer tensors too
    except TypeError:
        count = None
    if count is None or count < low or (high is not None and count > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{op}: {name} must be an int {bound}, got {value!r}")
    return count


def empty_tree(batch: int, budget: int, device: torch.device | str = "cpu") -> Tree:
    """Uninitialised buffers for a batch of trees with ``budget`` nodes plus the root (a batch may be empty)."""
    batch = _check_count("empty_tree", "batch", batch, 0)
    n = _check_count("empty_tree", "budget", budget, 0) + 1
    i32 = dict(dtype=torch.int32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    return Tree(
        token=torch.empty(batch, n, **i64),
        parent=torch.empty(batch, n, **i32),
        depth=torch.empty(batch, n, **i32),
        num_nodes=torch.empty(batch, **i32),
        first_child=torch.empty(batch, n, **i32),
        next_sibling=torch.empty(batch, n, **i32),
        ancestor_mask=torch.empty(batch, n, tree_num_words(n), **i64),
        position=torch.empty(batch, n, **i64),
    )


def empty_walk(batch: int, max_accept: int, device: torch.device | str = "cpu") -> Walk:
    """Uninitialised buffers for a walk over paths of at most ``max_accept`` nodes (a batch may be empty)."""
    batch = _check_count("empty_walk", "batch", batch, 0)
    max_accept = _check_count("empty_walk", "max_accept", max_accept, 1)
    return Walk(
        accepted=torch.empty(batch, max_accept, dtype=torch.int32, device=device),
        accept_len=torch.empty(batch, dtype=torch.int32, device=device),
        next_token=torch.empty(batch, dtype=torch.int64, device=device),
    )


def chain_tree(tokens: torch.Tensor, prefix_len: torch.Tensor, *, out: Optional[Tree] = None) -> Tree:
    """The tree of a chain: node i = tokens[:, i], parent i - 1, at position prefix_len + i.

    tokens [B, N] int64, prefix_len [B] int64 -> :class:`Tree` (every node real). Device ops only, no
    host reads: a root-only tree (N = 1) is what an autoregressive step verifies. ``out`` (an
    :func:`empty_tree` of N nodes) is written in place.
    """
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.int64 or tokens.shape[1] < 1:
        got = f"{tokens.dtype} {list(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"chain_tree: tokens must be int64 [B, N] with N >= 1, got {got}")
    bsz, n = tokens.shape
    if (not isinstance(prefix_len, torch.Tensor) or prefix_len.shape != (bsz,) or prefix_len.dtype != torch.int64
            or prefix_len.device != tokens.device):
        got = (f"{prefix_len.dtype} {list(prefix_len.shape)} on {prefix_len.device}" if isinstance(prefix_len, torch.Tensor)
               else type(prefix_len).__name__)
        raise ValueError(f"chain_tree: prefix_len must be int64 [{bsz}] on {tokens.device}, got {got}")
    if out is not None:  # every field, before the first is written
        like = empty_tree(bsz, n - 1, "meta")
        for name, want, got in zip(Tree._fields, like, out):
            if (not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype
                    or got.device != tokens.device):
                described = (f"{got.dtype} {list(got.shape)} on {got.device}" if isinstance(got, torch.Tensor)
                             else type(got).__name__)
                raise ValueError(f"chain_tree: out must be an empty_tree of {n} nodes for batch {bsz} on "
                                 f"{tokens.device}; its {name} must be {want.dtype} {list(want.shape)}, got {described}")
    if out is None:
        out = empty_tree(bsz, n - 1, tokens.device)
    nodes = torch.arange(n, device=tokens.device)
    out.token.copy_(tokens)
    out.parent.copy_((nodes - 1).to(torch.int32).expand(bsz, n))
    out.depth.copy_(nodes.to(torch.int32).expand(bsz, n))
    out.num_nodes.fill_(n)
    out.first_child.copy_(torch.where(nodes + 1 < n, nodes + 1, -1).to(torch.int32).expand(bsz, n))
    out.next_sibling.fill_(-1)
    # Word w of node i holds bits 0 .. i - 64 w (ancestors and itself): the low min(64, i - 64 w + 1) bits.
    words = torch.arange(out.ancestor_mask.shape[2], device=tokens.device)
    count = (nodes[:, None] - 64 * words[None, :] + 1).clamp(0, 64)
    low_bits = torch.where(count >= 64, -1, (1 << count.clamp(max=63)) - 1)
    out.ancestor_mask.copy_(low_bits.expand(bsz, n, -1))
    out.position.copy_(prefix_len[:, None] + nodes)
    return out


# ---- build -----------------------------------------------------------------------------------


def topk_logprobs(logits: torch.Tensor, k: int, *, out: Optional[TopK] = None) -> TopK:
    """Top-``k`` tokens per draft depth with their log-softmax values.

    logits [B, L, V] float32/float16/bfloat16 (last dim contiguous) -> TopK(logp [B, L, k] float32,
    tokens [B, L, k] int64), sorted by logit descending, ties broken by the lower token id, a NaN above
    every number (``torch.sort``'s order: the tokens are always ids of the row). The log-softmax is over
    the whole vocabulary, computed in float32; a NaN anywhere in a row makes all its ``logp`` NaN.
    Requires 1 <= k <= V.
    """
    if out is None:
        if logits.dim() != 3:
            raise ValueError(f"topk_logprobs: logits must have 3 dims [B, L, V], got shape {list(logits.shape)}")
        b, l, vocab = logits.shape
        k = _check_count("topk_logprobs", "k", k, 1, vocab)
        out = TopK(
            torch.empty(b, l, k, dtype=torch.float32, device=logits.device),
            torch.empty(b, l, k, dtype=torch.int64, device=logits.device),
        )
    load_ops().topk_logprobs(logits, out.logp, out.tokens)
    return out


def build_tree(
    logp: torch.Tensor,
    tokens: torch.Tensor,
    root_token: torch.Tensor,
    prefix_len: torch.Tensor,
    budget: int,
    *,
    spine: bool = True,
    out: Optional[Tree] = None,
) -> Tree:
    """Build the DDTree: the ``budget`` most probable prefixes of the per-depth top-K.

    logp [B, L, K] float32 and tokens [B, L, K] int64 (from :func:`topk_logprobs`), root_token [B]
    int64, prefix_len [B] int64, budget >= 1 -> :class:`Tree` with N = budget + 1 nodes per row.

    A prefix choosing rank r_d at depth d scores sum_d logp[d, r_d] (float32, summed root to leaf).
    Nodes are taken best-first: the highest score among the children of nodes already taken, ties
    broken by the lower parent index, then the lower rank; so node order is topological. With
    ``spine`` (default) the top-1 chain of length min(L, budget) is taken first (nodes 1..S), so the
    tree contains the draft's own chain and never accepts less than it; the remaining budget then
    goes best-first. Fewer than ``budget`` prefixes exist only when K ** depth runs out (K = 1); the
    rest is padding (see the module docstring).
    """
    if out is None:
        if not isinstance(root_token, torch.Tensor) or root_token.dim() != 1:
            got = list(root_token.shape) if isinstance(root_token, torch.Tensor) else type(root_token).__name__
            raise ValueError(f"build_tree: root_token must be a tensor [B], got {got}")
        budget = _check_count("build_tree", "budget", budget, 1)
        out = empty_tree(root_token.shape[0], budget, logp.device)
    load_ops().build_tree(logp, tokens, root_token, prefix_len, budget, spine, *out)
    return out


def tree_attention_mask(
    ancestor_mask: torch.Tensor,
    prefix_len: torch.Tensor,
    kv_len: Optional[int] = None,
    *,
    dtype: torch.dtype = torch.bool,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention mask of the verify block over the whole key/value cache.

    ancestor_mask [B, N, W] int64, prefix_len [B] int64 -> mask [B, 1, N, S] (S = ``kv_len``, or the
    last dim of ``out``; S >= prefix_len[b] + N). Row i may attend column c iff c < prefix_len[b]
    (the committed prefix) or c = prefix_len[b] + j with j an ancestor of i or i itself. bool masks
    hold True where attending; float masks (float32/float16/bfloat16) hold 0 there and the dtype's
    most negative finite value elsewhere. ``out`` may be a strided view of a larger static buffer.
    """
    if out is None:
        if kv_len is None:
            raise ValueError("tree_attention_mask: give kv_len or out")
        kv_len = _check_count("tree_attention_mask", "kv_len", kv_len, 1)
        _check_dim("tree_attention_mask", "ancestor_mask", ancestor_mask, 3, "[B, N, W]")
        b, n = ancestor_mask.shape[0], ancestor_mask.shape[1]
        out = torch.empty(b, 1, n, kv_len, dtype=dtype, device=ancestor_mask.device)
    load_ops().tree_attention_mask(ancestor_mask, prefix_len, out)
    return out


# ---- verify ----------------------------------------------------------------------------------


def tree_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    conv_state: torch.Tensor,
    parent: torch.Tensor,
    *,
    silu: bool = True,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Depthwise causal conv1d along every root-to-node path of the tree (GDN's short conv).

    x [B, N, C] pre-conv inputs (last dim contiguous), weight [C, W] (W <= 4), bias [C] or None,
    conv_state [B, C, S] (S >= W - 1: the committed pre-conv inputs, oldest first; the window uses
    the last W - 1 columns), parent [B, N] int32 -> out [B, N, C]. Node i's window is its W - 1
    nearest ancestors then itself; ancestors above the root come from conv_state. All float tensors
    share x's dtype; accumulation is float32. ``silu`` applies SiLU to the conv rounded to x's dtype, as HF's torch
    path does (``F.conv1d`` in the model dtype, then the activation): round(silu(round(conv))). causal-conv1d's
    kernel applies it to the float32 sum instead; the two differ by an ulp at times in 16-bit dtypes.
    """
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    load_ops().tree_conv1d(x, weight, bias, conv_state, parent, silu, out)
    return out


def _gdn_outputs(b: int, n: int, h: int, kd: int, hv: int, vd: int, dtype: torch.dtype,
                 device: torch.device) -> GDNTreeOutput:
    """Contiguous buffers of a GDNTreeOutput: out [B, N, HV, V] in ``dtype``, the float32 stash."""
    f32 = dict(dtype=torch.float32, device=device)
    return GDNTreeOutput(torch.empty(b, n, hv, vd, dtype=dtype, device=device), torch.empty(b, n, hv, vd, **f32),
                         torch.empty(b, n, h, kd, **f32), torch.empty(b, n, hv, **f32))


def tree_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    parent: torch.Tensor,
    *,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = True,
    out: Optional[GDNTreeOutput] = None,
) -> GDNTreeOutput:
    """Gated delta rule (GDN recurrence) on a tree, exact per node, from the committed state.

    q, k [B, N, H, K] and v [B, N, HV, V] (one float dtype, last dim contiguous), g [B, N, HV] float32
    (log decay), beta [B, N, HV] float32, state [B, HV, K, V] float32 (read only), parent [B, N]
    int32. HV is a multiple of H: value head j uses key head j // (HV / H). ``scale`` defaults to
    K ** -0.5. With ``use_qk_l2norm`` q and k are l2-normalised first: x / sqrt(sum(x^2) + 1e-6).

    Node i's output is what the recurrence S <- e^g S + k (beta (v - e^g S^T k))^T, o = S^T (scale q)
    gives when run from ``state`` along the path root..i, computed in float32 without forming a
    K x V state per node. Returns :class:`GDNTreeOutput` (outputs plus the stash for
    :func:`commit_gdn_state`).
    """
    _check_dim("tree_gated_delta_rule", "k", k, 4, "[B, N, H, K]")
    _check_dim("tree_gated_delta_rule", "v", v, 4, "[B, N, HV, V]")
    if out is None:
        out = _gdn_outputs(*k.shape, *v.shape[2:], v.dtype, v.device)
    if scale is None:
        scale = k.shape[-1] ** -0.5 if k.shape[-1] > 0 else 1.0  # K = 0: no key to scale
    load_ops().tree_gated_delta_rule(q, k, v, g, beta, state, parent, float(scale), use_qk_l2norm, *out)
    return out


def gdn_conv_delta_rule(
    x: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: Optional[torch.Tensor],
    conv_state: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    parent: torch.Tensor,
    *,
    num_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = True,
    out: Optional[GDNTreeOutput] = None,
) -> GDNTreeOutput:
    """A GDN layer's causal conv with SiLU and its gated delta rule, from the pre-conv channels: the same bits as
    :func:`tree_conv1d` (``silu=True``) whose output is split into q, k [B, N, H, K] and v [B, N, HV, V] (channels
    [0, H K), [H K, 2 H K), [2 H K, C)) and given to :func:`tree_gated_delta_rule`.

    H, K, V: ``num_heads``, ``head_k_dim``, ``head_v_dim`` (with ``out`` given, V and HV are its last two dims).
    x [B, N, C] float16/bfloat16/float32 (last dim contiguous) with C = 2 H K + HV V, conv_weight [C, W] and
    conv_bias [C] or None in x's dtype, conv_state [B, C, S] (S >= W - 1); g, beta, state, parent and the result as
    for :func:`tree_gated_delta_rule` (HV is g's last dim). On CUDA a single node (an autoregressive step) runs as one
    launch, the conv computed where the delta rule reads its inputs; a tree runs the two ops' kernels.
    """
    op = "gdn_conv_delta_rule"
    num_heads = _check_count(op, "num_heads", num_heads, 1)
    head_k_dim = _check_count(op, "head_k_dim", head_k_dim, 1)
    head_v_dim = _check_count(op, "head_v_dim", head_v_dim, 1)
    _check_dim(op, "x", x, 3, "[B, N, C]")
    _check_dim(op, "g", g, 3, "[B, N, HV]")
    if out is None:
        out = _gdn_outputs(*x.shape[:2], num_heads, head_k_dim, g.shape[-1], head_v_dim, x.dtype, x.device)
    if scale is None:
        scale = head_k_dim ** -0.5
    load_ops().gdn_conv_delta_rule(x, conv_weight, conv_bias, conv_state, g, beta, state, parent, int(num_heads),
                                   int(head_k_dim), float(scale), use_qk_l2norm, *out)
    return out


# ---- layer bodies ----------------------------------------------------------------------------


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as [R, D] without a copy when the leading dims merge (a copy otherwise)."""
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def _row_groups(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as [R, D], or as groups of rows [G, R, D] when the leading dims merge into two but not one (the
    heads of each token in a slice of a stacked projection's output), without a copy; a copy [R, D] otherwise."""
    sizes, strides = [], []
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):
        if size == 1:
            continue
        if sizes and strides[-1] == size * stride:  # merges with the dim before it
            sizes[-1] *= size
            strides[-1] = stride
        else:
            sizes.append(size)
            strides.append(stride)
    if len(sizes) == 2:
        return x.as_strided((*sizes, x.shape[-1]), (*strides, x.stride(-1)))
    return _rows(x)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    gate: Optional[torch.Tensor] = None,
    zero_centered: bool = False,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """RMSNorm over the last dim in one pass, with the rounding points of the HF Qwen norms.

    x [..., D] float16/bfloat16/float32 (last dim contiguous, any other strides: rows that no single stride reaches,
    such as heads sliced from a wider row, are read in place), weight [D] in x's dtype, gate None or
    like x -> out, shaped like x (contiguous unless given). With x_hat = x / sqrt(mean(x^2) + eps) in
    float32 and round() to x's dtype:

    * ``zero_centered`` (Qwen3_5RMSNorm): round(x_hat * (1 + weight));
    * otherwise (Qwen3RMSNorm): round(weight * round(x_hat));
    * with ``gate`` (Qwen3_5RMSNormGated): round(round(weight * round(x_hat)) * silu(gate)).
    """
    _check_features("rms_norm", x=x, weight=weight)
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"rms_norm: gate must have shape {list(x.shape)} (x's), got {list(gate.shape)}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out_rows = _out_rows("rms_norm", out, x.shape)
    gate_rows = _row_groups(gate) if gate is not None else None
    load_ops().rms_norm(_row_groups(x), weight, gate_rows, float(eps), zero_centered, out_rows)
    return out


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centered: bool = False,
    out: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's residual add and the RMSNorm after it, in one pass: returns (out, residual_out) with
    residual_out = round(residual + x) (HF's ``residual + hidden_states``) and out = ``rms_norm(residual_out, weight,
    eps, zero_centered=...)``, the same bits as the two ops one after the other.

    x, residual [..., D] one float dtype (last dim contiguous), weight [D] in that dtype -> out, residual_out shaped
    like x (contiguous unless given). ``residual_out`` may be ``x`` or ``residual`` itself (an in-place add); ``out``
    must not overlap any of them.
    """
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual must have shape {list(x.shape)} (x's), got {list(residual.shape)}")
    _check_features("add_rms_norm", x=x, weight=weight)
    for name, given in (("out", out), ("residual_out", residual_out)):
        if given is not None and given.shape != x.shape:
            raise ValueError(f"add_rms_norm: {name} must have shape {list(x.shape)} (x's), got {list(given.shape)}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual_out is None:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    load_ops().add_rms_norm(_rows(x), _rows(residual), weight, float(eps), zero_centered,
                            _out_rows("add_rms_norm", out, x.shape), _out_rows("add_rms_norm", residual_out, x.shape, "residual_out"))
    return out, residual_out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SwiGLU's product round(round(silu(gate)) * up) in one pass (what HF's ``act_fn(gate) * up`` gives).

    gate, up [..., D] one float dtype, last dim contiguous -> out like gate (contiguous unless given).
    """
    _check_features("silu_mul", gate=gate)
    if up.shape != gate.shape:
        raise ValueError(f"silu_mul: up must have shape {list(gate.shape)} (gate's), got {list(up.shape)}")
    if out is None:
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    load_ops().silu_mul(_rows(gate), _rows(up), _out_rows("silu_mul", out, gate.shape))
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rotate-half rotary embedding in one pass, as HF's ``apply_rotary_pos_emb`` computes it for q or k.

    x [B, H, N, D] float (last dim contiguous, any other strides), cos / sin [B, N, R] in x's dtype
    (R even, R <= D: partial rotary when R < D) -> out [B, H, N, D] (contiguous unless given):
    out[..., :R] = round(round(x * cos) + round(rotate_half(x) * sin)), out[..., R:] = x[..., R:].
    """
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    load_ops().rope(x, cos, sin, out)
    return out


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    *,
    zero_centered: bool = False,
    q_out: Optional[torch.Tensor] = None,
    k_out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """An attention layer's per-head q_norm and k_norm and the rotary embedding after them, in one pass: what
    ``rope(rms_norm(q, q_weight, eps).transpose(1, 2), cos, sin)`` gives, and the same for k, bit for bit.

    q [B, N, Hq, D] and k [B, N, Hk, D] (a projection's output viewed per head: last dim contiguous, any other
    strides), q_weight, k_weight [D] and cos, sin [B, N, R] (R even, R <= D) in q's dtype -> (q_out [B, Hq, N, D],
    k_out [B, Hk, N, D]), contiguous unless given; ``zero_centered`` as in :func:`rms_norm` (Qwen3_5RMSNorm). The
    outputs must not overlap the inputs. One launch on CUDA for heads of up to 32 16-byte chunks (256 features in
    16-bit dtypes, 128 in float32); longer heads, and the CPU op, run the two ops through a buffer it allocates.
    """
    def heads_first(x: torch.Tensor) -> torch.Tensor:  # an empty [B, H, N, D] for x [B, N, H, D]
        shape = (x.shape[0], x.shape[2], x.shape[1], x.shape[3]) if x.dim() == 4 else (0,)  # else: the op's error
        return torch.empty(shape, dtype=x.dtype, device=x.device)

    q_out = heads_first(q) if q_out is None else q_out
    k_out = heads_first(k) if k_out is None else k_out
    load_ops().qk_norm_rope(q, k, q_weight, k_weight, cos, sin, float(eps), zero_centered, q_out, k_out)
    return q_out, k_out


def qk_norm_rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    *,
    zero_centered: bool = False,
    q_out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`qk_norm_rope` and then :func:`store_kv` of its k and of v, in one launch on CUDA: an attention layer's
    q and k normed and rotated, and its new K/V rows written into the static caches, bit for bit what the two ops give.

    q [B, N, Hq, D], k and v [B, N, Hk, D] (projection outputs viewed per head: last dim contiguous, any other
    strides), q_weight, k_weight [D], cos, sin [B, N, R] as in :func:`qk_norm_rope`; keys, values [B, Hk, S, D] the
    caches and slots int64 [B, N] or [N] as in :func:`store_kv` (row n of batch row b goes to slot slots[b, n]; a
    negative slot stores nothing; the CPU op checks every slot is below S before it writes, on CUDA a slot past the
    caches is skipped). Returns q_out [B, Hq, N, D] (contiguous unless given). Heads longer than 32 16-byte chunks run
    the two ops through a buffer.
    """
    if q_out is None:
        shape = (q.shape[0], q.shape[2], q.shape[1], q.shape[3]) if q.dim() == 4 else (0,)  # else: the op's error
        q_out = torch.empty(shape, dtype=q.dtype, device=q.device)
    load_ops().qk_norm_rope_store_kv(q, k, v, q_weight, k_weight, cos, sin, float(eps), zero_centered, slots, q_out,
                                     keys, values)
    return q_out


def sigmoid_mul(gate: torch.Tensor, x: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Qwen3.5 attention's output gate round(x * round(sigmoid(gate))) in one pass (HF's ``attn_output *
    torch.sigmoid(gate)``, bit for bit).

    gate, x [..., D] one float dtype, last dims contiguous (gate's rows may be heads sliced from wider rows, read in
    place) -> out like x (contiguous unless given; may be x itself).
    """
    _check_features("sigmoid_mul", x=x)
    if gate.shape != x.shape:
        raise ValueError(f"sigmoid_mul: gate must have shape {list(x.shape)} (x's), got {list(gate.shape)}")
    if out is not None and out.shape != x.shape:
        raise ValueError(f"sigmoid_mul: out must have shape {list(x.shape)} (x's), got {list(out.shape)}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    load_ops().sigmoid_mul(_row_groups(gate), _rows(x), _rows_view("sigmoid_mul", out))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, *, out: Optional[torch.Tensor] = None,
           prefetch_weight: bool = False) -> torch.Tensor:
    """A bias-free projection: x [..., K] (last dim contiguous), weight [N, K] (an ``nn.Linear``'s, last dim
    contiguous) in x's dtype -> out [..., N] = x weight^T (contiguous unless given as [rows, N]), float32 sums.

    On CUDA, bfloat16/float16 with at most 72 rows, N a multiple of 32 and K of 64 (every projection of a round on
    the Qwen shapes) run a weight-streaming tensor-core kernel on GPUs of compute capability >= 9.0: K split over a
    thread-block cluster and summed in a fixed order, the split chosen from (N, K) alone, so a row's result does
    not depend on the other rows in the call. Everything else, and the CPU op, is ``torch.mm``.

    The kernel launches as a programmatic dependent of the kernel before it on the stream: its set-up overlaps that
    kernel's end, and it reads x and writes out only once that kernel is done. ``prefetch_weight=True`` lets it start
    streaming the weight before then too; only for weights that no kernel in flight writes (a model's projections
    during generation), since nothing orders those reads after the preceding kernels.
    """
    out = _linear_out("linear", x, weight, out)
    load_ops().linear(_rows(x), weight, _rows_view("linear", out), bool(prefetch_weight))
    return out


def _linear_out(op: str, x: torch.Tensor, weight: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    """out [..., N] for x [..., K] and weight [N, K] (a new contiguous one unless given)."""
    _check_features(op, x=x, weight=weight)
    shape = (*x.shape[:-1], weight.shape[0])
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif out.dim() != 2 and tuple(out.shape) != shape:
        raise ValueError(f"{op}: out must have shape {list(shape)}, got {list(out.shape)}")
    return out


def linear_cublaslt(x: torch.Tensor, weight: torch.Tensor, algorithm: int, *,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The bias-free projection of :func:`linear`, out [..., N] = x [..., K] weight [N, K]^T, by one chosen algorithm:
    on CUDA cuBLASLt's ``algorithm``-th candidate for the problem (0: its heuristic's first pick; the count is
    :func:`linear_cublaslt_algorithms`), float32 sums; on the CPU ``torch.mm`` (algorithm 0, the only one).

    Rows may lie further apart than their length (x, weight and out rows with any stride >= K, K and N), so a row
    block of a stacked weight needs no copy. Graph-safe: the candidate's workspace comes from torch's allocator on
    the current stream. ``ddtree_ext.gemm_tuning`` times the candidates per shape and picks one.
    """
    out = _linear_out("linear_cublaslt", x, weight, out)
    load_ops().linear_cublaslt(_rows(x), weight, int(algorithm), _rows_view("linear_cublaslt", out))
    return out


def linear_gemv(x: torch.Tensor, weight: torch.Tensor, *, out: Optional[torch.Tensor] = None,
                prefetch_weight: bool = False) -> torch.Tensor:
    """The bias-free projection of :func:`linear` for a single row (an autoregressive decode step): x [..., K] with one
    row in all (last dim contiguous), weight [N, K] (last dim contiguous) in x's dtype -> out [..., N], float32 sums.

    On CUDA, bfloat16/float16 with K a multiple of 8 and 16-byte aligned x and weight rows run a kernel on CUDA
    cores: one, two or four warps per weight row (whichever spreads the rows most evenly over the GPU), 16-byte
    loads, the weight streamed past L1, float32 sums in an order fixed by N, K, the GPU and the build
    (deterministic). Everything else, and the CPU op, is ``torch.mm``. It launches as a programmatic dependent of
    the kernel before it; ``prefetch_weight=True`` lets it load its first weight chunks before that kernel is done,
    as :func:`linear` does (only for weights no kernel in flight writes: a model's projections during generation).
    """
    out = _linear_out("linear_gemv", x, weight, out)
    load_ops().linear_gemv(_rows(x), weight, _rows_view("linear_gemv", out), bool(prefetch_weight))
    return out


def linear_cublaslt_algorithms(x: torch.Tensor, weight: torch.Tensor, out: Optional[torch.Tensor] = None) -> int:
    """How many algorithms :func:`linear_cublaslt` offers for x [..., K], weight [N, K] and out (default: a new
    contiguous one): on CUDA cuBLASLt's heuristic candidates for the problem (0 where it has none), then, where x,
    weight and out are 16-byte aligned, their variants with K split 1 to 16 ways that cuBLASLt accepts; 1 on the
    CPU. They depend on the device, dtype, sizes, row strides and the pointers' alignments, not on values.
    A host query: it launches nothing."""
    out = _linear_out("linear_cublaslt_algorithms", x, weight, out)
    return int(load_ops().linear_cublaslt_algorithms(_rows(x), weight, _rows_view("linear_cublaslt_algorithms", out)))


def linear_cublaslt_describe(x: torch.Tensor, weight: torch.Tensor, algorithm: int,
                             out: Optional[torch.Tensor] = None) -> str:
    """What :func:`linear_cublaslt`'s ``algorithm`` is for these tensors, for reports: cuBLASLt's algorithm id, tile,
    stages, split of K, reduction scheme, swizzle, workspace and waves ("at::mm" on the CPU). A host query."""
    out = _linear_out("linear_cublaslt_describe", x, weight, out)
    return str(load_ops().linear_cublaslt_describe(_rows(x), weight, _rows_view("linear_cublaslt_describe", out),
                                                   int(algorithm)))


def gqa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, *,
    out: Optional[torch.Tensor] = None, num_splits: int = 0,
) -> torch.Tensor:
    """Masked grouped-query attention: query head h reads KV head h // (H / Hkv).

    q [B, H, N, D], k and v [B, Hkv, S, D] (Hkv dividing H), float (last dims contiguous, any other strides),
    mask [B or 1, 1, N or 1, S] bool (True: attend) -> out [B, H, N, D] (contiguous unless given):
    out[b, h, n] = softmax(scale q[b, h, n] . k[b, h // G, s] over the unmasked s) . v[b, h // G, s], float32
    sums. A row with no unmasked key gives zeros (as SDPA's math path does since torch 2.5). On CUDA, bfloat16/float16 with D in {64, 128, 256}
    run a split-KV tensor-core kernel; other inputs, and the CPU op, run SDPA over K/V repeated per query head.
    ``num_splits`` (as flash-attention's): 0 lets the kernel choose how many parts of the keys run apart (their
    partial results merged in a fixed order), n > 0 asks for at most n (whole 64-key chunks each, so fewer may run);
    it changes the rounding of the sums, not what is computed, and the other paths ignore it.
    """
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    load_ops().gqa_attention(q, k, v, mask, float(scale), out, int(num_splits))
    return out


def gdn_gates(
    x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gated DeltaNet's gates from the layer input in one pass, as ``Qwen3_5GatedDeltaNet.forward``
    computes them with its ``in_proj_a`` / ``in_proj_b`` projections.

    x [..., F] (last dim contiguous), weight_a, weight_b [HV, F] in x's dtype (the projections' weights,
    no bias), A_log, dt_bias [HV] (float, each its own dtype) -> (g, beta), both [..., HV] float32. With
    a = round(x W_a^T) and b = round(x W_b^T) (float32 dot products rounded to x's dtype):
    g = -exp(A_log) * softplus(a + dt_bias) in float32, beta = sigmoid(b) rounded to x's dtype. On CUDA, more
    than 8 rows of bfloat16/float16 take tensor cores (products split over the features, added in a fixed
    order): the same values, their float32 sums in another order than for fewer rows.
    """
    _check_features("gdn_gates", x=x, weight_a=weight_a)
    heads = weight_a.shape[0]
    if heads == 0:
        raise ValueError(f"gdn_gates: weight_a must have at least one value head (row), got {list(weight_a.shape)}")
    g = torch.empty(*x.shape[:-1], heads, dtype=torch.float32, device=x.device)
    beta = torch.empty_like(g)
    load_ops().gdn_gates(_rows(x), weight_a, weight_b, A_log, dt_bias, g.view(-1, heads), beta.view(-1, heads))
    return g, beta


def moe_routing_size(num_experts: int, num_pairs: int) -> int:
    """Elements of :func:`moe_experts`' int32 routing scratch: a count, three per slot (min(E, P) slots), one per
    pair."""
    return 1 + 3 * min(num_experts, num_pairs) + num_pairs


def moe_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    shared: Optional[torch.Tensor] = None,
    shared_gate: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """A sparse MoE block's routed experts (``Qwen3_5MoeExperts``: SwiGLU experts) for the router's choice, with
    the rounding points of Hugging Face's default ``grouped_mm`` experts forward; optionally with the block's shared
    expert added as ``Qwen3_5MoeSparseMoeBlock`` adds it.

    x [T, H] float32 / float16 / bfloat16, expert_ids [T, K] int64 (the router's top-k experts, each in [0, E)),
    expert_weights [T, K] in x's dtype (the routing weights), gate_up_proj [E, 2 I, H] (rows [0, I) the gate
    projection, [I, 2 I) the up projection), down_proj [E, H, I], all in x's dtype and contiguous -> out [T, H]
    (contiguous). For each pair p = (t, k) with expert e, round() a rounding to x's dtype:
    gate_up = round(W_gu[e] x[t]), h = round(round(silu(gate_up[:I])) * gate_up[I:]),
    y_p = round(round(W_d[e] h) * expert_weights[t, k]); out[t] = round(sum over k of y_p, in k order, in float32).
    With ``shared`` [T, H] (the shared expert's output, x's dtype, contiguous) and ``shared_gate`` [T, 1] (its
    gate's logit, x's dtype, any row stride): out[t] = round(round(sum) + round(round(sigmoid(shared_gate[t])) *
    shared[t])), HF's block's roundings (without ``shared_gate``: round(round(sum) + shared[t])), in the same launch.

    A row's output never depends on the other rows (fixed summation orders), so a verify block's rows give the bits
    of decode steps; the dot products sum in another order than HF's grouped GEMMs (float32 roundings apart). On
    CUDA: up to four launches; bfloat16 and float16 on tensor cores (compute capability 8.0 or newer, and a build for
    it), each expert's weights streamed once per 32 of the rows it serves; float32 on CUDA cores, once per 8. H and I
    must be multiples of 16 bytes of the dtype, the weights and ``shared`` 16-byte aligned; an expert id outside
    [0, E) adds nothing there and raises on the CPU.
    """
    op = "moe_experts"
    _check_dim(op, "x", x, 2, "[T, H]")
    _check_dim(op, "expert_ids", expert_ids, 2, "[T, K]")
    _check_dim(op, "gate_up_proj", gate_up_proj, 3, "[E, 2 I, H]")
    _check_dim(op, "down_proj", down_proj, 3, "[E, H, I]")
    tokens, hidden_size = x.shape
    pairs = tokens * expert_ids.shape[1]
    inter = down_proj.shape[2]
    if out is None:
        out = torch.empty(tokens, hidden_size, dtype=x.dtype, device=x.device)
    load_ops().moe_experts(
        x, expert_ids, expert_weights, gate_up_proj, down_proj, shared, shared_gate,
        torch.empty(moe_routing_size(gate_up_proj.shape[0], pairs), dtype=torch.int32, device=x.device),
        torch.empty(pairs, inter, dtype=x.dtype, device=x.device),
        torch.empty(pairs, hidden_size, dtype=x.dtype, device=x.device),
        out,
    )
    return out


def moe_router(
    logits: torch.Tensor, top_k: int, *, renormalize: bool = True, weights: Optional[torch.Tensor] = None,
    ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse MoE router's choice from its logits, as ``Qwen3_5MoeTopKRouter`` makes it after its projection:
    softmax in float32, the top-k experts, their probabilities renormalised to sum to 1, in one launch on CUDA.

    logits [T, E] float32 / float16 / bfloat16 (last dim contiguous, any row stride) -> (weights [T, K] in logits'
    dtype, ids [T, K] int64), both contiguous (written into ``weights`` / ``ids`` when given). Per token:
    p = softmax(logits[t]) in float32; ids[t] its K largest, highest first (ties to the lower id, where torch.topk
    leaves their order open; NaN above every number, as torch.topk puts it); weights[t, k] = round(p[ids[t, k]] /
    the sum of the K picked, summed in pick order), or round(p[ids[t, k]]) with ``renormalize=False``. The softmax
    sums its exponentials in the order torch's CUDA softmax does for E <= 1024, so on CUDA the probabilities are its
    bits; HF's renormalisation sums in torch's order, so a weight may round the other way. A row's result never
    depends on the other rows. On CUDA, E <= 1024 and K <= 32.
    """
    op = "moe_router"
    _check_dim(op, "logits", logits, 2, "[T, E]")
    _check_features(op, logits=logits)
    top_k = _check_count(op, "top_k", top_k, 1, logits.shape[1])
    if weights is None:
        weights = torch.empty(logits.shape[0], top_k, dtype=logits.dtype, device=logits.device)
    if ids is None:
        ids = torch.empty(logits.shape[0], top_k, dtype=torch.int64, device=logits.device)
    load_ops().moe_router(logits, top_k, bool(renormalize), weights, ids)
    return weights, ids


# ---- penalize ----------------------------------------------------------------------------------


def penalize_logits(
    tree: Tree,
    logits: torch.Tensor,
    *,
    seen: Optional[torch.Tensor] = None,
    counts: Optional[torch.Tensor] = None,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    max_depth: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The target's logits at every tree node after HF's repetition penalty and vLLM's presence and frequency
    penalties, each node over its own sequence: the tokens counted so far (``seen``, ``counts``) plus the tokens of
    the nodes on its path below the root (the node itself included, the root not: it was counted already).

    logits [B, N, V] (float32, float16 or bfloat16, last dim contiguous) -> out [B, N, V] float32 (contiguous; must
    not overlap the inputs). seen [B, V] bool: the tokens in the sequence so far (None: no repetition penalty, which
    must then be 1); counts [B, V] float32: how often each token was generated so far (None: no presence or frequency
    penalty, which must then be 0); both with a contiguous last dim. max_depth (default N): the longest path counted,
    root included; a node's path is cut to its max_depth - 1 nearest nodes. For node i and token t, with
    s = seen[b, t] or t on i's path and c = counts[b, t] + t's occurrences on i's path, all in float32:

    * repetition (HF's ``RepetitionPenaltyLogitsProcessor``), where s: x * r if x < 0 else x / r, the division as
      torch divides a float32 tensor by a Python number on the device (on CUDA: x * float32(1 / r), the reciprocal
      taken in double);
    * then (vLLM's order) x - frequency_penalty * c, then x - presence_penalty where c > 0.

    Bit for bit what those torch operations give on the same device. The tree's token [B, N] int64 and parent
    [B, N] int32 (contiguous) are read. repetition_penalty must be finite and > 0, the other two finite. On the CPU,
    parent[b, 0] must be -1 (the root) and every other parent an earlier node, and path tokens in [0, V); on CUDA
    (no host reads) a node with an invalid parent counts as a root (neither it nor its ancestors are on paths
    through it) and an out-of-range token is skipped. On CUDA a path is held in shared memory as int32: max_depth
    (or N) up to about 58000 on Hopper (227 KB a block); beyond, a ValueError.
    """
    _check_dim("penalize_logits", "logits", logits, 3, "[B, N, V]")
    if max_depth is None:
        max_depth = max(tree.token.shape[-1], 1) if tree.token.dim() else 1
    max_depth = _check_count("penalize_logits", "max_depth", max_depth, 1)
    if out is None:
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    load_ops().penalize_logits(
        logits, tree.token, tree.parent, seen, counts, float(repetition_penalty), float(presence_penalty),
        float(frequency_penalty), max_depth, out,
    )
    return out


# ---- walk ------------------------------------------------------------------------------------


def row_argmax(x: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The index of the largest element of every row: ``torch.argmax(x, -1)``, ties and NaNs included (the first
    maximum; a NaN counts above every number, and the first NaN wins).

    x [..., V] (1 <= V < 2^31) -> out [...] int64. The target's greedy tokens at every tree node. float32, float16 and
    bfloat16 rows (last dim contiguous) run the compiled op: on CUDA each row is split over several blocks that stream
    it in 16-byte packs and a warp per row merges their results, where torch's reduction ran a 65-row verify's logits
    at a fraction of the bandwidth. Other dtypes (a float64 model's logits) run torch.argmax.
    """
    if x.dim() == 0:
        raise ValueError("row_argmax: x must have at least one dim, got a scalar")
    if out is None:
        out = torch.empty(x.shape[:-1], dtype=torch.int64, device=x.device)
    if out.shape != x.shape[:-1] or out.dtype != torch.int64 or out.device != x.device:
        raise ValueError(f"row_argmax: out must be int64 of shape {tuple(x.shape[:-1])} on {x.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return torch.argmax(x, -1, out=out)
    flat = out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=torch.int64, device=out.device)
    load_ops().row_argmax(_rows(x), flat)
    if not out.is_contiguous():
        out.copy_(flat.view(out.shape))
    return out


def walk_greedy(tree: Tree, target_token: torch.Tensor, max_accept: int, *, out: Optional[Walk] = None) -> Walk:
    """Greedy verification: from the root, follow the child whose token equals the target's argmax.

    target_token [B, N] int64 (the target's argmax at every node) -> :class:`Walk` with paths of at
    most ``max_accept`` nodes. The walk stops at the first node with no matching child (or after
    ``max_accept`` nodes); the target's token there is ``next_token``.
    """
    if out is None:
        max_accept = _check_count("walk_greedy", "max_accept", max_accept, 1)
        out = empty_walk(tree.token.shape[0], max_accept, tree.token.device)
    load_ops().walk_greedy(tree.token, tree.first_child, tree.next_sibling, target_token, *out)
    return out


def walk_sample(
    tree: Tree,
    logits: torch.Tensor,
    uniform: torch.Tensor,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    out: Optional[Walk] = None,
) -> Walk:
    """Sampling verification: at each node on the path draw the target's token, follow it if a child
    carries it. Every committed token is then a sample of the target's own distribution given its
    true prefix, so the walk is lossless with no draft probabilities.

    logits [B, N, V] (the target's logits at every node, float32, float16 or bfloat16), uniform [B, D] float32 in
    [0, 1) (uniform[b, d] draws the token at the d-th node of row b's path; D = max_accept),
    temperature > 0, top_k (0 = off), top_p in (0, 1] (1 = off), min_p in [0, 1] (0 = off). The token is drawn
    from softmax(logits / temperature) restricted to the top_k set (every logit at or above the k-th largest, all
    its ties included, as HF's top-k warper keeps), then to the tokens whose logit has less than top_p of the
    top_k set's probability strictly above it (the smallest set in descending order whose probability reaches
    top_p, with every token tied with its last; HF's top-p warper keeps an arbitrary part of such a tie), then to
    the tokens with x = logit / temperature whose float32 x - max x is at least float32(log(min_p)) (HF's min-p
    warper: probability at least min_p times the largest; log(min_p) taken in double), by inverse CDF in ascending
    token-id order: the first kept token whose cumulative probability exceeds uniform * total.
    """
    if not isinstance(uniform, torch.Tensor) or uniform.dim() != 2 or uniform.shape[1] < 1:
        got = list(uniform.shape) if isinstance(uniform, torch.Tensor) else type(uniform).__name__
        raise ValueError(f"walk_sample: uniform must have shape [B, D] with D = max_accept >= 1, got {got}")
    if out is None:
        out = empty_walk(tree.token.shape[0], uniform.shape[-1], tree.token.device)
    load_ops().walk_sample(
        tree.token, tree.first_child, tree.next_sibling, logits, uniform, float(temperature), int(top_k),
        float(top_p), float(min_p), *out,
    )
    return out


# ---- commit ----------------------------------------------------------------------------------


def commit_gdn_state(
    state: Sequence[torch.Tensor],
    stash_u: Sequence[torch.Tensor],
    stash_k: Sequence[torch.Tensor],
    stash_cumg: Sequence[torch.Tensor],
    accepted: torch.Tensor,
    accept_len: torch.Tensor,
) -> None:
    """In place, for every GDN layer l: state[l] [B, HV, K, V] float32 becomes the state after the
    accepted path, from that layer's stash (see :class:`GDNTreeOutput`):
    S <- e^{G_last} S + sum_{j on path} e^{G_last - G_j} k_j u_j^T. accepted [B, D] int32, accept_len [B] int32.
    """
    load_ops().commit_gdn_state(list(state), list(stash_u), list(stash_k), list(stash_cumg), accepted, accept_len)


def commit_conv_state(
    conv_state: Sequence[torch.Tensor], x: Sequence[torch.Tensor], accepted: torch.Tensor, accept_len: torch.Tensor
) -> None:
    """In place, for every GDN layer l: conv_state[l] [B, C, S] becomes the last S columns of
    [conv_state[l], x[l][b, accepted[b, d]] for d < accept_len[b]], where x[l] [B, N, C] are the verify
    block's pre-conv inputs (x[l] in conv_state[l]'s float dtype with a contiguous last dim; conv_state[l] any
    strides); accepted
    [B, max_accept] int32 and accept_len [B] int32 as :func:`walk_greedy` gives them."""
    load_ops().commit_conv_state(list(conv_state), list(x), accepted, accept_len)


def commit_kv(
    cache: Sequence[torch.Tensor], prefix_len: torch.Tensor, accepted: torch.Tensor, accept_len: torch.Tensor
) -> None:
    """In place, for every key or value cache [B, H, S, Dh] in ``cache``: the row of accepted node
    accepted[b, d] moves from slot prefix_len[b] + accepted[b, d] to slot prefix_len[b] + d, for
    d < accept_len[b]. Sources and destinations may overlap; every other slot is left untouched. The caches must be
    apart from each other (one per layer and kind). A path starts at the root (accepted[b, 0] = 0) and increases;
    the CPU ops of every commit check it, the CUDA ones cannot (no host reads)."""
    load_ops().commit_kv(list(cache), prefix_len, accepted, accept_len)


def store_kv(
    keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor
) -> None:
    """New attention rows into static caches, K and V in one launch: ``keys[b, :, slots[b, n]] = key_states[b, :, n]``
    and the same for the values (what two ``index_copy_`` calls along dim 2 do, per batch row).

    keys, values [B, H, S, D] one float dtype (last dim contiguous); slots int64 on their device, [B, N] (a table per
    batch row) or [N] (one for all), a negative slot storing nothing (a padding row, as vLLM's slot mappings have
    it); key_states, value_states [B, H, N, D] in their dtype (any strides, last dim contiguous). The stored slots of
    a batch row must differ, and keys and values must be apart (from each other and from the states). The CPU op
    checks that every slot is below S and that a row's slots differ before it writes; on CUDA (no host reads) a slot
    past the caches is skipped.
    """
    load_ops().store_kv(keys, values, slots, key_states, value_states)


def gather_rows(
    src: torch.Tensor, accepted: torch.Tensor, accept_len: torch.Tensor, *, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Rows of ``src`` [B, N, F] along the accepted path -> out [B, D, F] with out[b, d] =
    src[b, accepted[b, d]] for d < accept_len[b] and zeros after. ``out`` must not overlap ``src``."""
    if out is None:
        _check_dim("gather_rows", "src", src, 3, "[B, N, F]")
        _check_dim("gather_rows", "accepted", accepted, 2, "[B, D]")
        out = torch.empty(src.shape[0], accepted.shape[1], src.shape[2], dtype=src.dtype, device=src.device)
    load_ops().gather_rows(src, accepted, accept_len, out)
    return out
