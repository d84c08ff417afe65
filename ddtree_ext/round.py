"""One decoding round on static buffers, run eagerly or replayed from CUDA graphs.

A round, for the root token (the last emitted token, not yet run through the target) at position
``prefix_len``: draft -> build -> verify -> walk -> commit. Every stage reads and writes buffers
allocated once per generation (the target's :class:`~ddtree_ext.target.TargetState`, the draft's
cache, the tree, the walk, the next round's context rows and root, the result row), positions and
lengths are device tensors, and no stage reads the device from the host. So the same stage functions
either run eagerly or are captured once into CUDA graphs and replayed every round; the one host read
per round is the result row (accept length, emitted tokens), copied into pinned memory.

Attention widths (``kv_len``, see :func:`kv_bucket`) are the only host-side shape that changes as the
sequence grows, so graphs are made per ``kv_len``: a round at a width seen fewer than
``EAGER_ROUNDS_BEFORE_CAPTURE`` times runs eagerly (these rounds also warm up kernels and libraries
before capture), the next one captures all stages into graphs sharing one memory pool, and later
rounds at that width replay them. Only the current width's graphs are kept (widths never shrink).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ddtree_ext import gemm_tuning, ops

EAGER_ROUNDS_BEFORE_CAPTURE = 2

# Attention reads the first kv_len cache slots, kv_len a bucket of the needed length (kv_bucket), so
# that captured rounds are few (one set of graphs per width) and read little more than needed.
_MIN_KV_BUCKET = 256


def kv_bucket(length: int) -> int:
    """The attention width used for ``length`` needed cache slots: ``length`` rounded up to a multiple
    of a quarter of its octave, but of at least 256: 256, 512, 768, 1024, 1280, ..., 2048, 2560, ...
    So a width is at most 256 slots or 25% over what is needed, whichever is more, and a generation
    sees about four widths per octave of its length."""
    if length <= _MIN_KV_BUCKET:
        return _MIN_KV_BUCKET
    step = max(_MIN_KV_BUCKET, 1 << ((length - 1).bit_length() - 3))
    return -(-length // step) * step


class DecodeRound:
    """The static buffers and stages of one generation's rounds.

    method: "ddtree", "dflash" or "autoregressive" (no draft: the tree is the root alone);
    budget: tree nodes besides the root (0 for autoregressive); max_accept: longest accepted path
    (root included); acceptor: picks the target's tokens (``ddtree_ext.generate._Acceptor``);
    spine_len: > 0 to also count, per round, what the draft's top-1 chain alone would have accepted.
    ``use_graphs``: capture and replay (CUDA only).
    """

    def __init__(
        self,
        adapter,
        draft,
        state,
        draft_cache,
        acceptor,
        *,
        method: str,
        budget: int,
        max_accept: int,
        draft_top_k: int,
        spine: bool,
        spine_len: int,
        use_graphs: bool,
    ):
        self.adapter, self.draft, self.state, self.draft_cache, self.acceptor = adapter, draft, state, draft_cache, acceptor
        self.speculative = method != "autoregressive"
        self.budget, self.max_accept, self.draft_top_k, self.spine, self.spine_len = (
            budget, max_accept, draft_top_k, spine, spine_len,
        )
        device = adapter.device
        self.device = device
        self.tree = ops.empty_tree(1, budget, device)
        self.walk = ops.empty_walk(1, max_accept, device)
        self.root = torch.zeros(1, dtype=torch.int64, device=device)
        # The next draft call's context: the taps of the accepted path (rows past accept_len are padding).
        self.context_rows = None
        self.num_context = torch.ones(1, dtype=torch.int32, device=device)
        if self.speculative:
            width = draft.context_hidden_size
            self.context_rows = torch.zeros(1, max_accept, width, dtype=adapter.embed_tokens.weight.dtype, device=device)
        # The first round drafts from the prompt's taps (any length); later rounds from context_rows.
        self._first_context: Optional[torch.Tensor] = None
        # [accept_len, path tokens (max_accept, root first, -1 padded), next token, spine accept length]
        self.result_width = 1 + max_accept + 1 + (1 if spine_len else 0)
        self.result = torch.zeros(1, self.result_width, dtype=torch.int64, device=device)
        self.result_host = torch.zeros(self.result_width, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.tmp: Dict[str, object] = {}  # a round's intermediate tensors

        self.use_graphs = use_graphs
        # Capture on a stream of the target's device (torch.cuda.graph's default side stream is made
        # once per process, on whichever device was current then).
        self._capture_stream = torch.cuda.Stream(device) if use_graphs else None
        self._graphs: Dict[int, Tuple[List[Tuple[str, torch.cuda.CUDAGraph]], Dict[str, object]]] = {}
        self._eager_rounds: Dict[int, int] = {}
        self.captures = 0  # graph sets captured (one per kv_len)
        self.replays = 0  # rounds replayed from graphs

    # ---- inputs ----------------------------------------------------------------------------------

    def start(self, root: torch.Tensor, prompt_taps: torch.Tensor) -> None:
        """After the prefill: the first root [1] int64 and the prompt's taps [1, T, F] for the draft."""
        self.root.copy_(root)
        self._first_context = prompt_taps

    # ---- stages ----------------------------------------------------------------------------------

    def _draft(self, kv_len: int) -> None:
        if self._first_context is not None:
            context, num_context = self._first_context, None
        else:
            context, num_context = self.context_rows, self.num_context
        with self.adapter.fused_lm_head():
            self.tmp["draft_logits"] = self.draft.propose(
                context,
                self.root,
                self.draft_cache,
                embed_tokens=self.adapter.embed_tokens,
                lm_head=self.adapter.lm_head,
                num_context=num_context,
                kv_len=kv_len,
            )

    def _build(self) -> None:
        prefix_len = self.state.prefix_len
        if self.speculative:
            topk = ops.topk_logprobs(self.tmp["draft_logits"], self.draft_top_k)
            ops.build_tree(topk.logp, topk.tokens, self.root, prefix_len, self.budget, spine=self.spine, out=self.tree)
        else:
            ops.chain_tree(self.root[:, None], prefix_len, out=self.tree)

    def _verify(self, kv_len: int) -> None:
        self.tmp["logits"], self.tmp["taps"] = self.adapter.verify_unchecked(self.tree, self.state, kv_len)

    def _walk(self) -> None:
        logits = self.tmp["logits"]
        walk = self.acceptor.walk(self.tree, logits, self.state.prefix_len, self.walk)
        path = self.tree.token.gather(1, walk.accepted.clamp(min=0).long())
        path = torch.where(walk.accepted >= 0, path, -1)
        parts = [walk.accept_len[:, None].long(), path, walk.next_token[:, None]]
        if self.spine_len:
            # Spine node d (index d, parent d - 1) is accepted iff its token is the target's at node d - 1.
            hits = self.tree.token[:, 1 : self.spine_len + 1] == logits[:, : self.spine_len].argmax(-1)
            parts.append(hits.long().cumprod(1).sum(1, keepdim=True) + 1)
        self.result.copy_(torch.cat(parts, dim=1))

    def _commit(self) -> None:
        walk = self.walk
        self.adapter.commit_unchecked(walk, self.state)
        if self.speculative:
            ops.gather_rows(self.tmp["taps"], walk.accepted, walk.accept_len, out=self.context_rows)
            self.num_context.copy_(walk.accept_len)
        self.root.copy_(walk.next_token)

    def _stages(self, kv_len: int) -> List[Tuple[str, Callable[[], None]]]:
        stages = [("draft", lambda: self._draft(kv_len))] if self.speculative else []
        return stages + [
            ("build", self._build),
            ("verify", lambda: self._verify(kv_len)),
            ("walk", self._walk),
            ("commit", self._commit),
        ]

    # ---- running ---------------------------------------------------------------------------------

    def run(self, kv_len: int, clock) -> List[int]:
        """One round with attention over the first ``kv_len`` cache slots; ``clock(stage)`` is a
        context manager timing each stage. Returns the result row (see ``result``) as host ints."""
        captured = self._graphs.get(kv_len)
        if captured is None and self._ready_to_capture(kv_len):
            with gemm_tuning.round_shapes():
                captured = self._capture(kv_len)
        if captured is not None:
            for name, graph in captured[0]:
                with clock(name):
                    graph.replay()
            self.replays += 1
        else:
            self.tmp = {}
            # The first round's draft reads the prompt, whose length changes from one generation to the next: it runs
            # torch's matmuls; later rounds repeat their shapes and run the tuned ones (ddtree_ext.gemm_tuning).
            repeating = gemm_tuning.round_shapes() if self._first_context is None else contextlib.nullcontext()
            with repeating:
                for name, stage in self._stages(kv_len):
                    with clock(name):
                        stage()
            self.tmp = {}
            self._eager_rounds[kv_len] = self._eager_rounds.get(kv_len, 0) + 1
            self._first_context = None
        return self._read_result()

    def _ready_to_capture(self, kv_len: int) -> bool:
        return (
            self.use_graphs
            and self._first_context is None
            and self._eager_rounds.get(kv_len, 0) >= EAGER_ROUNDS_BEFORE_CAPTURE
        )

    def _capture(self, kv_len: int):
        """Capture every stage at this width into its own graph, all in one new memory pool; nothing
        runs. The intermediates the graphs own are kept with them: freeing one would let a later capture
        in the pool reuse its memory under a graph still replaying. Widths only grow within a
        generation, so the graphs of narrower widths are released first, and their pool with them (a
        pool dies with its last graph: it is never reused)."""
        torch.cuda.synchronize(self.device)  # nothing of the old graphs may still run when they go
        self._graphs.clear()
        self.tmp = {}
        graphs = []
        pool = torch.cuda.graph_pool_handle()
        for name, stage in self._stages(kv_len):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=self._capture_stream):
                stage()
            graphs.append((name, graph))
        self._graphs[kv_len] = (graphs, self.tmp)
        self.tmp = {}
        self.captures += 1
        return self._graphs[kv_len]

    def release(self) -> None:
        """Drops the captured graphs now, once the device is done with them, rather than whenever the
        garbage collector reaches this object. PyTorch frees a capture stream's cuBLAS workspaces when a
        graph captured on it is destroyed, and streams come from a small per-device pool, so a round
        collected late could free the workspace of a later generation's live graphs on the same pooled
        stream (pytorch/pytorch#193402; a suspect for this project's graphs-vs-eager flake)."""
        if self._graphs:
            torch.cuda.synchronize(self.device)
            self._graphs.clear()

    def _read_result(self) -> List[int]:
        """The round's one device-to-host copy (pinned, then wait for it)."""
        if self.result_host.is_pinned():
            self.result_host.copy_(self.result[0], non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
            return self.result_host.tolist()
        return self.result[0].tolist()
