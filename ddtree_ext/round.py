"""One decoding round on static buffers, run eagerly or replayed from CUDA graphs.

A round, for the root token (the last emitted token, not yet run through the target) at position
``prefix_len``: draft -> build -> verify -> walk -> commit. Every stage reads and writes buffers
allocated once per generation (the target's :class:`~ddtree_ext.target.TargetState`, the draft's
cache, the tree, the walk, the next round's context rows and root, the result row), positions and
lengths are device tensors, and no stage reads the device from the host. So the same stage functions
either run eagerly or are captured once into CUDA graphs and replayed every round; the one host read
per round is the result row (accept length, emitted tokens), copied into pinned memory.

A round is launched (:meth:`DecodeRound.launch`) and read (:meth:`DecodeRound.read`) separately, so the
caller can launch the next round before reading this one: the next round needs nothing from the host but
its attention width, for which an upper bound serves. The host's share of a round (reading the result,
emitting the tokens, launching the next graphs) then runs while the device works on the next round.

Attention widths (``kv_len``, see :func:`kv_bucket`) are the only host-side shape that changes as the
sequence grows, so graphs are made per ``kv_len``: a round at a width seen fewer than
``EAGER_ROUNDS_BEFORE_CAPTURE`` times runs eagerly (these rounds also warm up kernels and libraries
before capture), the next one captures the whole round, all its stages, into one CUDA graph, and later
rounds at that width replay it. Only the current width's graph is kept (widths never shrink). Stage
times, when asked for, come from timing events recorded inside the graph, off the round's own chain of kernels
(:func:`_record_aside`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ddtree_ext import gemm_tuning, ops
from ddtree_ext.fused import Fork, side_stream

EAGER_ROUNDS_BEFORE_CAPTURE = 2

# Whether a captured round's programmatic edges move to their upstream kernel's launch-order port before the graph is
# instantiated (:func:`_instantiate`): a kernel of ours after a projection then launches while the GEMM still runs,
# and waits for it on the device. On: the GPU tests pass with it (tests/test_cuda.py and tests/test_generate_cuda.py
# -k launch_order), and on the H200 it took 0.2 ms off a 27B AR step and 0.5 ms off a 27B DDTree-64 round
# (benchmarks/results/2026-12-05-h200-launch-order-edges.md); ``benchmarks/e2e.py --no-launch-order-edges`` turns it
# off for A/B runs.
launch_order_edges = True

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
        if spine_len and not acceptor.greedy:
            raise ValueError(f"DecodeRound: spine_len ({spine_len}) counts a greedy spine; the acceptor samples")
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
        if not self.speculative:
            # A root-only tree's tables never change: each round sets its token and position only (_build).
            ops.chain_tree(self.root[:, None], state.prefix_len, out=self.tree)
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
        # Two host rows, used in turn: a round launched ahead copies its result into one while the
        # host reads the round before it from the other.
        self._result_host = [
            torch.zeros(self.result_width, dtype=torch.int64, pin_memory=device.type == "cuda") for _ in range(2)
        ]
        self._launches = 0
        # Launching a round before the one ahead of it is read pays on a GPU, where the host's part of a round
        # then overlaps the device's; on the CPU a round runs as it is launched, so it would only delay the
        # tokens (and compute one round for nothing at an EOS). Read by generate(); tests set it.
        self.launch_ahead = device.type == "cuda"
        self._widest = 0  # the widest attention width launched: widths never shrink
        self.tmp: Dict[str, object] = {}  # a round's intermediate tensors

        self.use_graphs = use_graphs
        # Capture on a stream of the target's device (torch.cuda.graph's default side stream is made
        # once per process, on whichever device was current then).
        self._capture_stream = torch.cuda.Stream(device) if use_graphs else None
        # Where a captured round's stage timing events are recorded (_record_aside).
        self._timing_stream = torch.cuda.Stream(device) if use_graphs else None
        self._graphs: Dict[int, List[_CapturedRound]] = {}
        self._eager_rounds: Dict[int, int] = {}
        self.captures = 0  # widths captured (one graph each, two when timing stages)
        self.capture_s = 0.0  # host seconds spent capturing (the wait for the device before each included)
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
                float32_logits=False,  # only ranked (topk_logprobs reads the head's dtype)
            )

    def _build(self) -> None:
        prefix_len = self.state.prefix_len
        if self.speculative:
            topk = ops.topk_logprobs(self.tmp["draft_logits"], self.draft_top_k)
            ops.build_tree(topk.logp, topk.tokens, self.root, prefix_len, self.budget, spine=self.spine, out=self.tree)
        else:  # the rest of the root-only tree was set once (__init__), as ops.chain_tree sets it
            self.tree.token.copy_(self.root[:, None])
            self.tree.position.copy_(prefix_len[:, None])

    def _verify(self, kv_len: int) -> None:
        # Greedy rounds read only the logits' argmax: kept in the head's dtype (the same argmax as their float32 copy).
        self.tmp["logits"], self.tmp["taps"] = self.adapter.verify_unchecked(
            self.tree, self.state, kv_len, float32_logits=not self.acceptor.greedy
        )

    def _walk(self) -> None:
        logits = self.acceptor.penalize(self.tree, self.tmp["logits"], self.max_accept)
        argmax = ops.row_argmax(logits) if self.acceptor.greedy else None  # once, for the walk and the spine
        walk = self.acceptor.walk(self.tree, logits, self.state.prefix_len, self.walk, argmax=argmax)
        # Only the host reads the result row: it is composed on a side stream, beside the commit, which joins it.
        fork = self.tmp["result_fork"] = Fork(self.device, "walk")
        with fork.side():
            if argmax is not None:
                fork.used_on_side(argmax)
            path = self.tree.token.gather(1, walk.accepted.clamp(min=0).long())
            path = torch.where(walk.accepted >= 0, path, -1)
            parts = [walk.accept_len[:, None].long(), path, walk.next_token[:, None]]
            if self.spine_len:
                # Spine node d (index d, parent d - 1) is accepted iff its token is the target's at node d - 1.
                hits = self.tree.token[:, 1 : self.spine_len + 1] == argmax[:, : self.spine_len]  # greedy only
                parts.append(hits.long().cumprod(1).sum(1, keepdim=True) + 1)
            torch.cat(parts, dim=1, out=self.result)

    def _commit(self) -> None:
        walk = self.walk
        self.adapter.commit_unchecked(walk, self.state)
        if self.speculative:
            ops.gather_rows(self.tmp["taps"], walk.accepted, walk.accept_len, out=self.context_rows)
            self.num_context.copy_(walk.accept_len)
        self.root.copy_(walk.next_token)
        self.tmp.pop("result_fork").join()

    def _stages(self, kv_len: int) -> List[Tuple[str, Callable[[], None]]]:
        stages = [("draft", lambda: self._draft(kv_len))] if self.speculative else []
        return stages + [
            ("build", self._build),
            ("verify", lambda: self._verify(kv_len)),
            ("walk", self._walk),
            ("commit", self._commit),
        ]

    # ---- running ---------------------------------------------------------------------------------

    def launch(self, kv_len: int, clock) -> "LaunchedRound":
        """Enqueues one round with attention over the first ``kv_len`` cache slots, and the copy of its
        result row to the host. Reads nothing from the device (a capture, and a GEMM shape's first timing,
        synchronise), so it may be called while the round before is still running: this one starts from
        what that one commits. ``clock`` times the stages when ``clock.enabled``: an eager stage inside
        ``with clock(stage)``, a replayed one by the events inside its graph, which :meth:`read` hands to
        ``clock.add(clock.round at launch, stage, seconds)``. Returns the handle for :meth:`read`.

        A ``kv_len`` narrower than one launched before runs at that wider one (a width only has to cover the
        committed slots): a round launched ahead asks for the width of an upper bound, the one after it, launched
        after a read, may ask for less, and a narrower width would be captured anew."""
        kv_len = self._widest = max(kv_len, self._widest)
        captured = self._graphs.get(kv_len)
        if captured is None and self._ready_to_capture(kv_len):
            start = time.perf_counter()
            with gemm_tuning.round_shapes():
                captured = self._capture(kv_len, timed=clock.enabled)
            self.capture_s += time.perf_counter() - start
        stage_events = []
        if captured is not None:
            # With stage timing, two copies of the graph take turns: a round's events are read (read()) before
            # its copy replays again, two launches later.
            graph = captured[self.replays % len(captured)]
            graph.graph.replay()
            stage_events = graph.stage_events
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
        # The next launch overwrites self.result, so the row goes to a host buffer now, in stream order.
        # Two buffers suffice: a caller reads each round before launching the one two after it.
        row = self._result_host[self._launches % 2]
        self._launches += 1
        done = None
        if row.is_pinned():
            row.copy_(self.result[0], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            row.copy_(self.result[0])
        return LaunchedRound(row, done, replayed=captured is not None, clock=clock, stage_events=stage_events)

    def read(self, launched: "LaunchedRound") -> List[int]:
        """Waits for a launched round's result row and returns it as host ints (see ``result``). Rounds
        are read in launch order, each before the one two after it is launched."""
        if launched.done is not None:
            launched.done.synchronize()
        for stage, begin, end in launched.stage_events:
            launched.clock.add(launched.clock_round, stage, begin.elapsed_time(end) / 1e3)
        return launched.row.tolist()

    def _ready_to_capture(self, kv_len: int) -> bool:
        return (
            self.use_graphs
            and self._first_context is None
            and self._eager_rounds.get(kv_len, 0) >= EAGER_ROUNDS_BEFORE_CAPTURE
        )

    def _capture(self, kv_len: int, timed: bool) -> List["_CapturedRound"]:
        """Captures the whole round at this width into one graph (two copies with ``timed``: stage timing events
        recorded inside each), in one new memory pool; nothing runs. The intermediates a graph owns are kept
        with it: freeing one would let a later capture in the pool reuse its memory under a graph still
        replaying. Widths only grow within a generation, so the graphs of narrower widths are released first,
        and their pool with them (a pool dies with its last graph: it is never reused)."""
        torch.cuda.synchronize(self.device)  # nothing of the old graphs may still run when they go
        self._graphs.clear()
        self.tmp = {}
        copies = []
        pool = torch.cuda.graph_pool_handle()
        for _ in range(2 if timed else 1):
            graph, kept = _new_graph()
            stage_events = []
            # thread_local: CUDA work from other threads meanwhile (another model served from another thread, a
            # loader's copies) neither fails nor invalidates the capture, as it would under the default "global";
            # this thread's own unsafe calls still raise.
            with torch.cuda.graph(graph, pool=pool, stream=self._capture_stream, capture_error_mode="thread_local"):
                main = torch.cuda.current_stream(self.device)
                # Streams come from a small pool: the timing stream may be the capture's or Fork's side stream (side
                # work would then wait for the records, and the records would be on the round's chain again).
                taken = (main, side_stream(self.device))
                timing = self._timing_stream if timed and self._timing_stream not in taken else None
                try:
                    for name, stage in self._stages(kv_len):
                        if timed:  # event record nodes in the graph (external), not a capture-time dependency
                            begin, end = (torch.cuda.Event(enable_timing=True, external=True) for _ in range(2))
                            _record_aside(begin, timing, main)
                            stage()
                            _record_aside(end, timing, main)
                            stage_events.append((name, begin, end))
                        else:
                            stage()
                finally:
                    if timing is not None:
                        main.wait_stream(timing)  # a capture ends with every stream it forked joined
            if kept:
                _instantiate(graph)
            copies.append(_CapturedRound(graph, stage_events, self.tmp))
            self.tmp = {}
        self._graphs[kv_len] = copies
        self.captures += 1
        return copies

    def release(self) -> None:
        """Drops the captured graphs now, once the device is done with them, rather than whenever the
        garbage collector reaches this object. PyTorch frees a capture stream's cuBLAS workspaces when a
        graph captured on it is destroyed, and streams come from a small per-device pool, so a round
        collected late could free the workspace of a later generation's live graphs on the same pooled
        stream (pytorch/pytorch#193402; a suspect for this project's graphs-vs-eager flake)."""
        if self._graphs:
            torch.cuda.synchronize(self.device)
            self._graphs.clear()


def _new_graph() -> Tuple["torch.cuda.CUDAGraph", bool]:
    """A graph to capture a round into, and whether it keeps its cudaGraph_t after capture for :func:`_instantiate`:
    where ``launch_order_edges`` is on and torch has ``keep_graph`` (2.8 on)."""
    if launch_order_edges:
        try:
            return torch.cuda.CUDAGraph(keep_graph=True), True
        except TypeError:  # torch before 2.8: the edges stay where capture put them
            pass
    return torch.cuda.CUDAGraph(), False


def _instantiate(graph: "torch.cuda.CUDAGraph") -> None:
    """Instantiates a graph captured with ``keep_graph=True``, its programmatic edges first moved to their upstream
    kernel's launch-order port: a kernel of ours after a GEMM may then launch while the GEMM runs, and its
    ``griddepcontrol.wait`` still waits for it (why that is sound: ``csrc/graph_cuda.cpp``)."""
    from ddtree_ext._loader import load_extension

    load_extension().graph_launch_order_edges(graph.raw_cuda_graph())
    graph.instantiate()


def _record_aside(event: "torch.cuda.Event", timing: Optional["torch.cuda.Stream"], main: "torch.cuda.Stream") -> None:
    """Records a stage timing event in a graph being captured as a leaf on ``timing``: the record waits for the work
    issued so far on ``main``, and nothing waits for it but the capture's final join (a stage's begin is thus the end
    of the work before it on ``main``). Recorded on ``main`` itself, the event sat between the kernels on either side
    of each stage boundary: 15-55 us a round on the H200, where aside the rounds run within 0.03 ms of rounds captured
    with no events (benchmarks/results/2026-12-04-h200-stage-events.md). ``timing`` None (no stream of its own was
    free): on ``main``, as before."""
    if timing is None:
        event.record(main)
        return
    timing.wait_stream(main)
    event.record(timing)


class LaunchedRound:
    """A round enqueued by :meth:`DecodeRound.launch`: its host result row (valid once ``done``, a CUDA
    event, has completed; at once on the CPU), whether it was replayed from a CUDA graph, and the timing
    events recorded inside that graph ([(stage, begin, end)]), which :meth:`DecodeRound.read` hands to the
    clock for the round the clock was on at launch."""

    def __init__(self, row: torch.Tensor, done: Optional["torch.cuda.Event"], replayed: bool, clock, stage_events):
        self.row, self.done, self.replayed = row, done, replayed
        self.clock, self.clock_round, self.stage_events = clock, clock.round, stage_events


class _CapturedRound:
    """One captured round: the graph, its stage timing events (empty when untimed) and the intermediate
    tensors it owns (kept alive with it)."""

    def __init__(self, graph: "torch.cuda.CUDAGraph", stage_events: list, owned: Dict[str, object]):
        self.graph, self.stage_events, self.owned = graph, stage_events, owned
