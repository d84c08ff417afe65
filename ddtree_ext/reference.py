"""Pure-PyTorch reference of every op: clear, slow, the specification the tests compare against.

Each function has the signature of its twin in :mod:`ddtree_ext.ops` (without ``out=``) and returns
new tensors. Loops follow the definitions literally (per row, per node, per path) instead of the
parallel forms the compiled ops use.
"""

from __future__ import annotations

import heapq
import math
from typing import List, Sequence

import torch

from ddtree_ext.ops import GDNTreeOutput, TopK, Tree, Walk, tree_num_words

L2NORM_EPS = 1e-6


# ---- build -----------------------------------------------------------------------------------


def topk_logprobs(logits: torch.Tensor, k: int) -> TopK:
    x = logits.float()
    logp = torch.log_softmax(x, dim=-1)
    # Stable descending sort keeps the lower token id first among equal logits.
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]
    return TopK(torch.gather(logp, -1, order), order.to(torch.int64))


def _path_ranks_to_tree(nodes: List[tuple], root_token: int, prefix: int, budget: int, tokens_bl) -> dict:
    """nodes: list of (parent index, depth, rank) for nodes 1.. in order; returns one row's tables."""
    n = budget + 1
    token = [root_token] * n
    parent = [0] * n
    depth = [1] * n
    parent[0], depth[0] = -1, 0
    first_child = [-1] * n
    next_sibling = [-1] * n
    anc = [{0, i} for i in range(n)]
    anc[0] = {0}
    last_child = {}
    for i, (p, d, r) in enumerate(nodes, start=1):
        token[i] = int(tokens_bl[d - 1][r])
        parent[i], depth[i] = p, d
        anc[i] = anc[p] | {i}
        if p in last_child:
            next_sibling[last_child[p]] = i
        else:
            first_child[p] = i
        last_child[p] = i
    words = tree_num_words(n)
    mask = []
    for i in range(n):
        row = [0] * words
        for j in anc[i]:
            row[j // 64] |= 1 << (j % 64)
        # Pack as signed int64 (bit 63 set -> negative).
        mask.append([w - (1 << 64) if w >= 1 << 63 else w for w in row])
    return dict(
        token=token,
        parent=parent,
        depth=depth,
        num_nodes=len(nodes) + 1,
        first_child=first_child,
        next_sibling=next_sibling,
        ancestor_mask=mask,
        position=[prefix + d for d in depth],
    )


def tree_from_parents(parent: torch.Tensor, token: torch.Tensor, prefix_len: torch.Tensor) -> Tree:
    """A :class:`Tree` whose every node is real, from parent [B, N] int32 (topological, -1 at the root)
    and token [B, N] int64. For tests and for callers that shape their own trees (e.g. a chain)."""
    bsz, n = parent.shape
    rows = []
    for b in range(bsz):
        nodes = [(int(parent[b, i]), None, None) for i in range(1, n)]
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[int(parent[b, i])] + 1
        row = _path_ranks_to_tree(
            [(p, depth[i], i) for i, (p, _, _) in enumerate(nodes, start=1)],
            int(token[b, 0]), int(prefix_len[b]), n - 1, [[int(t) for t in token[b]]] * n,
        )
        rows.append(row)
    return _stack_rows(rows, parent.device, n)


def build_tree(
    logp: torch.Tensor,
    tokens: torch.Tensor,
    root_token: torch.Tensor,
    prefix_len: torch.Tensor,
    budget: int,
    *,
    spine: bool = True,
) -> Tree:
    bsz, depths, k = logp.shape
    rows = []
    for b in range(bsz):
        lp = logp[b].float().tolist()
        # Scores are float32 sums root -> leaf, exactly as the compiled ops compute them.
        f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
        nodes: List[tuple] = []  # (parent, depth, rank)
        score = {0: f32(0.0)}
        heap: list = []  # (-score, parent, rank, depth)

        def push(p, d, r):
            if d <= depths and r < k:
                s = score[p] + f32(lp[d - 1][r])
                heapq.heappush(heap, (-float(s), p, r, d, s))

        def take(p, d, r, s):
            nodes.append((p, d, r))
            i = len(nodes)
            score[i] = s
            return i

        if spine:
            prev = 0
            for d in range(1, min(depths, budget) + 1):
                s = score[prev] + f32(lp[d - 1][0])
                push(prev, d, 1)  # the spine node's next sibling
                prev = take(prev, d, 0, s)
        else:
            push(0, 1, 0)
        while len(nodes) < budget and heap:
            _, p, r, d, s = heapq.heappop(heap)
            i = take(p, d, r, s)
            push(i, d + 1, 0)  # first child
            push(p, d, r + 1)  # next sibling
        rows.append(
            _path_ranks_to_tree(nodes, int(root_token[b]), int(prefix_len[b]), budget, tokens[b].tolist())
        )
    return _stack_rows(rows, logp.device, budget + 1)


def _stack_rows(rows: List[dict], dev, n: int) -> Tree:
    """The rows' trees of n nodes as one batch (an empty batch keeps the per-row shapes: [0, n], ...)."""
    trailing = {"num_nodes": (), "ancestor_mask": (n, (n + 63) // 64)}

    def stack(key, dtype):
        if not rows:
            return torch.empty((0, *trailing.get(key, (n,))), dtype=dtype, device=dev)
        return torch.tensor([r[key] for r in rows], dtype=dtype, device=dev)

    return Tree(
        token=stack("token", torch.int64),
        parent=stack("parent", torch.int32),
        depth=stack("depth", torch.int32),
        num_nodes=stack("num_nodes", torch.int32),
        first_child=stack("first_child", torch.int32),
        next_sibling=stack("next_sibling", torch.int32),
        ancestor_mask=stack("ancestor_mask", torch.int64),
        position=stack("position", torch.int64),
    )


def ancestor_sets(ancestor_mask: torch.Tensor) -> List[List[set]]:
    """Unpack the bitmask into per-row, per-node sets of ancestor-or-self indices."""
    bsz, n, _ = ancestor_mask.shape
    out = []
    for b in range(bsz):
        row = []
        for i in range(n):
            words = [w & ((1 << 64) - 1) for w in ancestor_mask[b, i].tolist()]
            row.append({64 * wi + j for wi, w in enumerate(words) for j in range(64) if (w >> j) & 1})
        out.append(row)
    return out


def tree_attention_mask(
    ancestor_mask: torch.Tensor, prefix_len: torch.Tensor, kv_len: int, *, dtype: torch.dtype = torch.bool
) -> torch.Tensor:
    bsz, n, _ = ancestor_mask.shape
    allow = torch.zeros(bsz, 1, n, kv_len, dtype=torch.bool)
    for b, row in enumerate(ancestor_sets(ancestor_mask)):
        p = int(prefix_len[b])
        allow[b, 0, :, :p] = True
        for i, anc in enumerate(row):
            for j in anc:
                allow[b, 0, i, p + j] = True
    if dtype == torch.bool:
        return allow.to(ancestor_mask.device)
    neg = torch.finfo(dtype).min
    return torch.where(allow, 0.0, neg).to(dtype=dtype, device=ancestor_mask.device)


# ---- verify ----------------------------------------------------------------------------------


def path_to(parent: torch.Tensor, b: int, i: int) -> List[int]:
    """Node indices root..i of row b."""
    path = [i]
    while parent[b, path[-1]] >= 0:
        path.append(int(parent[b, path[-1]]))
    return path[::-1]


def tree_conv1d(x, weight, bias, conv_state, parent, *, silu: bool = True) -> torch.Tensor:
    bsz, n, c = x.shape
    w = weight.shape[1]
    out = torch.empty(bsz, n, c, dtype=torch.float32)
    for b in range(bsz):
        for i in range(n):
            path = path_to(parent, b, i)
            cols = [x[b, j].float() for j in path[-w:]]
            need = w - len(cols)
            if need > 0:  # ancestors above the root: the last columns of the committed state
                cols = [conv_state[b, :, conv_state.shape[2] - need + t].float() for t in range(need)] + cols
            window = torch.stack(cols, dim=-1)  # [C, W], oldest first
            y = (window * weight.float()).sum(-1)
            if bias is not None:
                y = y + bias.float()
            # HF's torch path: the conv in the model dtype, then its SiLU.
            out[b, i] = torch.nn.functional.silu(y.to(x.dtype).float()) if silu else y
    return out.to(dtype=x.dtype, device=x.device)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def tree_gated_delta_rule(
    q, k, v, g, beta, state, parent, *, scale=None, use_qk_l2norm: bool = True
) -> GDNTreeOutput:
    """Runs the recurrence separately along every root-to-node path (float32)."""
    bsz, n, h, kd = k.shape
    hv, vd = v.shape[2], v.shape[3]
    group = hv // h
    if scale is None:
        scale = kd**-0.5 if kd > 0 else 1.0  # K = 0: no key to scale (the op's rule)
    qf, kf = q.float(), k.float()
    if use_qk_l2norm:
        qf, kf = _l2norm(qf), _l2norm(kf)
    qf = qf * scale
    out = torch.empty(bsz, n, hv, vd, dtype=torch.float32)
    stash_u = torch.empty(bsz, n, hv, vd, dtype=torch.float32)
    stash_cumg = torch.empty(bsz, n, hv, dtype=torch.float32)
    for b in range(bsz):
        for i in range(n):
            path = path_to(parent, b, i)
            for j in range(hv):
                s = state[b, j].float().clone()  # [K, V]
                cumg = torch.zeros((), dtype=torch.float32)
                for node in path:
                    kk, vv = kf[b, node, j // group], v[b, node, j].float()
                    decay = torch.exp(g[b, node, j].float())
                    cumg = cumg + g[b, node, j].float()
                    s = s * decay
                    u = beta[b, node, j].float() * (vv - s.T @ kk)
                    s = s + torch.outer(kk, u)
                out[b, i, j] = s.T @ qf[b, i, j // group]
                stash_u[b, i, j] = u
                stash_cumg[b, i, j] = cumg
    dev = v.device
    return GDNTreeOutput(out.to(dtype=v.dtype, device=dev), stash_u.to(dev), kf.to(dev), stash_cumg.to(dev))


def gdn_conv_delta_rule(
    x, conv_weight, conv_bias, conv_state, g, beta, state, parent, *, num_heads: int, head_k_dim: int,
    head_v_dim: int, scale=None, use_qk_l2norm: bool = True
) -> GDNTreeOutput:
    """tree_conv1d (SiLU) split into q, k, v, then tree_gated_delta_rule."""
    bsz, n, _ = x.shape
    key_dim = num_heads * head_k_dim
    y = tree_conv1d(x, conv_weight, conv_bias, conv_state, parent, silu=True)
    q, k, v = torch.split(y, [key_dim, key_dim, y.shape[-1] - 2 * key_dim], dim=-1)
    return tree_gated_delta_rule(
        q.reshape(bsz, n, num_heads, head_k_dim), k.reshape(bsz, n, num_heads, head_k_dim),
        v.reshape(bsz, n, -1, head_v_dim), g, beta, state, parent, scale=scale, use_qk_l2norm=use_qk_l2norm,
    )


# ---- layer bodies ----------------------------------------------------------------------------
# The HF modules' own arithmetic (Qwen3RMSNorm, Qwen3_5RMSNorm, Qwen3_5RMSNormGated, the MLPs' SwiGLU,
# apply_rotary_pos_emb, Qwen3_5GatedDeltaNet's gates), written out so the tests need no model to check the
# fused ops.


def rms_norm(x, weight, eps, *, gate=None, zero_centered: bool = False) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    y = weight * normed.to(x.dtype)
    if gate is not None:
        y = y * torch.nn.functional.silu(gate.float())
    return y.to(x.dtype)


def add_rms_norm(x, residual, weight, eps, *, zero_centered: bool = False):
    """(normed, sum): the decoder layer's ``residual + hidden_states`` and the next norm of it."""
    total = residual + x
    return rms_norm(total, weight, eps, zero_centered=zero_centered), total


def silu_mul(gate, up) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def rope(x, cos, sin) -> torch.Tensor:
    rot = cos.shape[-1]
    c, s = cos[:, None], sin[:, None]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    rotated = torch.cat([-x_rot[..., rot // 2 :], x_rot[..., : rot // 2]], dim=-1)
    return torch.cat([x_rot * c + rotated * s, x_pass], dim=-1)


def qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, *, zero_centered: bool = False):
    """(q, k) [B, N, H, D] -> each head normed, turned to [B, H, N, D] and rotated (HF's attention layers)."""
    def one(x, weight):
        return rope(rms_norm(x, weight, eps, zero_centered=zero_centered).transpose(1, 2), cos, sin)

    return one(q, q_weight), one(k, k_weight)


def qk_norm_rope_store_kv(q, k, v, q_weight, k_weight, cos, sin, eps, keys, values, slots, *,
                          zero_centered: bool = False) -> torch.Tensor:
    """qk_norm_rope, then store_kv of its k and of v (turned to [B, Hk, N, D]); returns q's output."""
    q_out, k_out = qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, zero_centered=zero_centered)
    store_kv(keys, values, slots, k_out, v.transpose(1, 2))
    return q_out


def sigmoid_mul(gate, x) -> torch.Tensor:
    return x * torch.sigmoid(gate)


def linear(x, weight) -> torch.Tensor:
    """ops.linear in float64 math, rounded to x's dtype."""
    return (x.double() @ weight.double().T).to(x.dtype)


def gqa_attention(q, k, v, mask, scale) -> torch.Tensor:
    """ops.gqa_attention in float32 math: query head h reads KV head h // (H / Hkv); mask True = attend."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = (q.float() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(~mask.any(-1, keepdim=True), 0.0)  # no key: zeros
    return (probs @ v).to(q.dtype)


def gdn_gates(x, weight_a, weight_b, A_log, dt_bias):
    a = torch.nn.functional.linear(x, weight_a)
    b = torch.nn.functional.linear(x, weight_b)
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
    return g, b.sigmoid().float()


def moe_experts(x, expert_ids, expert_weights, gate_up_proj, down_proj, shared=None, shared_gate=None) -> torch.Tensor:
    """HF's grouped_mm experts forward, pair by pair: the projections in float32 rounded to x's dtype; then, as
    HF's sparse MoE block adds it, the shared expert's output times the sigmoid of its gate's logit."""
    dtype, inter = x.dtype, down_proj.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for k in range(expert_ids.shape[1]):
            e = int(expert_ids[t, k])
            gate_up = (gate_up_proj[e].float() @ x[t].float()).to(dtype)
            hidden = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            projected = (down_proj[e].float() @ hidden.float()).to(dtype)
            out[t] += (projected * expert_weights[t, k]).float()
    out = out.to(dtype)
    if shared is not None:
        out = out + (shared if shared_gate is None else torch.sigmoid(shared_gate) * shared)
    return out


def moe_router(logits, top_k: int, renormalize: bool = True):
    """HF's Qwen3_5MoeTopKRouter after its projection: softmax in float32, top-k, renormalised, rounded to the logits'
    dtype; the renormalisation's sum in pick order, as the op sums (HF's ``sum`` runs in torch's order: a float32
    rounding apart)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        total = torch.zeros_like(top[:, 0])
        for k in range(top_k):
            total = total + top[:, k]
        top = top / total[:, None]
    return top.to(logits.dtype), ids


# ---- penalize --------------------------------------------------------------------------------


def penalty_rule(x: torch.Tensor, seen, counts, repetition_penalty: float, presence_penalty: float,
                 frequency_penalty: float) -> torch.Tensor:
    """The penalties on float32 logits ``x`` given each token's presence in the sequence (``seen``, bool, or None:
    no repetition penalty) and its count among the generated tokens (``counts``, float32, or None: no presence or
    frequency penalty), broadcast against x: HF's repetition processor's torch operations, then vLLM's."""
    if seen is not None:
        x = torch.where(seen, torch.where(x < 0, x * repetition_penalty, x / repetition_penalty), x)
    if counts is not None:
        x = x - frequency_penalty * counts
        x = x - presence_penalty * (counts > 0).float()
    return x


def penalize_logits(tree: Tree, logits: torch.Tensor, *, seen=None, counts=None, repetition_penalty: float = 1.0,
                    presence_penalty: float = 0.0, frequency_penalty: float = 0.0, max_depth=None) -> torch.Tensor:
    """Every node's row by :func:`penalty_rule` over the tables, then each token on the node's path (its nearest
    ``max_depth - 1`` nodes below the root) again with the node's own presence and count."""
    if max_depth is not None and max_depth < 1:
        raise ValueError(f"penalize_logits: max_depth must be >= 1, got {max_depth}")
    settings = (repetition_penalty, presence_penalty, frequency_penalty)
    batch, n, _ = logits.shape
    limit = min((n if max_depth is None else max_depth) - 1, n - 1)
    x = logits.float()
    out = penalty_rule(x, None if seen is None else seen[:, None], None if counts is None else counts[:, None],
                       *settings)
    for b in range(batch):
        for i in range(n):
            path = path_to(tree.parent, b, i)[1:][::-1][:limit]  # below the root, nearest first
            tokens = tree.token[b, path]
            for t in tokens.unique():
                occurrences = (tokens == t).sum()
                node_seen = None if seen is None else torch.ones((), dtype=torch.bool, device=x.device)
                node_count = None if counts is None else counts[b, t] + occurrences
                out[b, i, t] = penalty_rule(x[b, i, t], node_seen, node_count, *settings)
    return out


# ---- walk ------------------------------------------------------------------------------------


def children(tree: Tree, b: int, i: int) -> List[int]:
    out, c = [], int(tree.first_child[b, i])
    while c >= 0:
        out.append(c)
        c = int(tree.next_sibling[b, c])
    return out


def _walk(tree: Tree, max_accept: int, token_at) -> Walk:
    bsz = tree.token.shape[0]
    accepted = torch.full((bsz, max_accept), -1, dtype=torch.int32)
    accept_len = torch.empty(bsz, dtype=torch.int32)
    next_token = torch.empty(bsz, dtype=torch.int64)
    for b in range(bsz):
        node, d = 0, 0
        while True:
            accepted[b, d] = node
            t = token_at(b, node, d)
            d += 1
            nxt = [c for c in children(tree, b, node) if int(tree.token[b, c]) == t]
            if not nxt or d == max_accept:
                break
            node = nxt[0]
        accept_len[b], next_token[b] = d, t
    dev = tree.token.device
    return Walk(accepted.to(dev), accept_len.to(dev), next_token.to(dev))


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(-1)


def walk_greedy(tree: Tree, target_token: torch.Tensor, max_accept: int) -> Walk:
    return _walk(tree, max_accept, lambda b, node, d: int(target_token[b, node]))


def sample_token(logits: torch.Tensor, u: float, temperature: float, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0) -> int:
    """One draw from the target's processed distribution (the rule of :func:`ddtree_ext.ops.walk_sample`). Every cut
    is a threshold on x = logits / temperature, so tokens of equal x are kept or dropped together."""
    x = logits.float() / temperature
    vocab = x.shape[0]
    keep = torch.ones(vocab, dtype=torch.bool)
    if 0 < top_k < vocab:
        keep = x >= torch.topk(x, top_k).values[-1]  # every token tied with the k-th stays, as in HF
    if top_p < 1.0:
        kept = torch.nonzero(keep).flatten()
        xs = torch.sort(x[kept], descending=True).values
        p = torch.softmax(xs, dim=0)
        before = torch.cumsum(p, 0) - p  # probability of the tokens ranked above
        keep &= x >= xs[before < top_p][-1]  # the last token kept in rank order, and its ties
    if min_p > 0:  # after top_k and top_p, as HF orders them: fl(x - max x) >= float32(log(min_p)), NaNs aside
        top = torch.where(torch.isnan(x), -torch.inf, x).max()
        keep &= (x - top) >= torch.tensor(math.log(min_p), dtype=torch.float32)
    probs = torch.softmax(x, dim=0) * keep
    cum = torch.cumsum(probs, 0)  # ascending token id
    hit = torch.nonzero(cum > u * cum[-1])
    kept = torch.nonzero(keep)
    return int(hit[0]) if hit.numel() else int(kept.max()) if kept.numel() else vocab - 1


def walk_sample(
    tree: Tree, logits: torch.Tensor, uniform: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
    min_p: float = 0.0,
) -> Walk:
    return _walk(
        tree,
        uniform.shape[-1],
        lambda b, node, d: sample_token(logits[b, node], float(uniform[b, d]), temperature, top_k, top_p, min_p),
    )


# ---- commit ----------------------------------------------------------------------------------


def _path(accepted: torch.Tensor, accept_len: torch.Tensor, b: int) -> List[int]:
    return [int(i) for i in accepted[b, : int(accept_len[b])]]


def commit_gdn_state(
    state: Sequence[torch.Tensor], stash_u, stash_k, stash_cumg, accepted: torch.Tensor, accept_len: torch.Tensor
) -> List[torch.Tensor]:
    """Returns the new states (the op updates them in place)."""
    new = []
    for s, u, kk, cg in zip(state, stash_u, stash_k, stash_cumg):
        s = s.clone()
        hv, group = s.shape[1], s.shape[1] // kk.shape[2]
        for b in range(s.shape[0]):
            path = _path(accepted, accept_len, b)
            last = path[-1]
            for j in range(hv):
                acc = torch.exp(cg[b, last, j]) * s[b, j]
                for node in path:
                    acc = acc + torch.exp(cg[b, last, j] - cg[b, node, j]) * torch.outer(kk[b, node, j // group], u[b, node, j])
                s[b, j] = acc
        new.append(s)
    return new


def commit_conv_state(
    conv_state: Sequence[torch.Tensor], x: Sequence[torch.Tensor], accepted: torch.Tensor, accept_len: torch.Tensor
) -> List[torch.Tensor]:
    new = []
    for cs, xx in zip(conv_state, x):
        cs = cs.clone()
        width = cs.shape[2]
        for b in range(cs.shape[0]):
            path = _path(accepted, accept_len, b)
            cols = torch.cat([cs[b], xx[b, path].T.to(cs.dtype)], dim=1)
            cs[b] = cols[:, -width:]
        new.append(cs)
    return new


def commit_kv(
    cache: Sequence[torch.Tensor], prefix_len: torch.Tensor, accepted: torch.Tensor, accept_len: torch.Tensor
) -> List[torch.Tensor]:
    new = []
    for c in cache:
        c = c.clone()
        for b in range(c.shape[0]):
            p = int(prefix_len[b])
            path = _path(accepted, accept_len, b)
            rows = c[b, :, [p + i for i in path]].clone()  # gather all first: sources and targets overlap
            c[b, :, p : p + len(path)] = rows
        new.append(c)
    return new


def store_kv(keys, values, slots, key_states, value_states) -> None:
    table = slots.expand(keys.shape[0], slots.shape[-1]).tolist()  # [N] is every batch row's table
    for b, row in enumerate(table):
        for n, slot in enumerate(row):
            if slot >= 0:  # a negative slot stores nothing
                keys[b, :, slot] = key_states[b, :, n]
                values[b, :, slot] = value_states[b, :, n]


def gather_rows(src: torch.Tensor, accepted: torch.Tensor, accept_len: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(src.shape[0], accepted.shape[1], src.shape[2], dtype=src.dtype, device=src.device)
    for b in range(src.shape[0]):
        path = _path(accepted, accept_len, b)
        out[b, : len(path)] = src[b, path]
    return out
