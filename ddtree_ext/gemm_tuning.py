"""Per-shape choice of the GEMM algorithm behind a model's projections on the GPU (opt-in: ``enabled``).

cuBLAS picks a kernel for each GEMM shape by heuristic. At the few rows of a decode step, a DFlash block or a tree
verify, a projection only streams its weight, and the heuristic's pick is not always the fastest: on the H200 the
27B MLP's stacked gate/up weight at 65 rows ran at 1.19 x its weight-read floor, its two halves apart at 1.13 x
(``benchmarks/results/2026-12-01-h200-stacked-projections.md``).

With ``enabled`` on, every projection of the fused forwards (``fused.project``) of a 16-bit CUDA model inside
:func:`round_shapes` asks :func:`algorithm` for its problem. ``round.DecodeRound`` opens that context for every round
of a generation but its first, whose draft reads the prompt (a length that changes from one generation to the next);
the prefill and the first round run torch's matmul, so every generation runs the same algorithms round by round.

The first time a problem (device, dtype, sizes, row strides, alignments) is seen outside CUDA graph capture, this
times torch's own matmul, each of cuBLASLt's candidates (``ops.linear_cublaslt``) and, for a single row, the
CUDA-core kernel ``ops.linear_gemv`` (:data:`GEMV`) on the weight itself and on
copies of it, called in turn so that every call streams its weight from memory as in a round, queued ahead so that
launch gaps do not count (one batch screens each candidate, the three fastest are timed over five). It keeps the
fastest for the process; a candidate replaces torch's matmul only when faster by more than ``MARGIN``, and one that
fails to run is dropped. Later calls, eager or captured, reuse the pick. A problem first seen while a graph is
captured keeps torch's matmul for good (nothing can be timed then), so eager rounds give the graph's bits.

The picks are timed, so two processes may pick differently where candidates are close, and their outputs may then
differ in the last bits (as with cuBLAS on two GPU models). Each algorithm is deterministic.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch

from ddtree_ext import ops

# Whether fused.project runs tuned picks (off: torch's F.linear, cuBLAS's heuristic, as before).
enabled = False

# A candidate (cuBLASLt's or ops.linear_gemv) must beat torch's matmul by this fraction to replace it (timing noise is
# below it).
MARGIN = 0.01

# The pick that names ops.linear_gemv (a candidate for single rows: a decode step's projections) rather than a cuBLASLt
# candidate's index.
GEMV = "gemv"

# Whether single-row problems also time ops.linear_gemv (off by default: cuBLAS's and cuBLASLt's candidates only).
# Timed alone it matches or beats them on several shapes, but on one H200 a 27B decode step with the default side
# streams (a GDN layer's z projection beside its qkv GEMM) ran 1.9 ms slower with it, 0.1 ms without the side streams
# (benchmarks/results/2026-12-03-h200-gdn-compact-coef.md; another H200 had run 0.33 ms faster with it). The likely
# cause, not profiled: its grid takes every resident warp of the GPU. Read when a problem is tuned: picks already made
# stay until reset().
gemv_candidate = False

# The most rows tuned: a verify of a 256-node tree and its root. A prompt's prefill of more rows runs once per
# generation, at a length that changes from one to the next: torch's matmul serves it untimed.
MAX_ROWS = 257

_ROTATED_BYTES = 3  # times the L2 size: the weights called in turn, so none is still in L2 at its next call
_MAX_COPIES = 64
_BATCH_SECONDS = 2e-3  # device time per timed batch
_MAX_CALLS = 256  # per batch: with a split-K reduce kernel each, still well inside the launch queue
_LAUNCH_SECONDS = 10e-6  # host time to queue one call, a first guess (_time lengthens the sleep if needed)
_BATCHES = 5  # timed batches per finalist
_FINALISTS = 3

# problem key -> the pick (None: torch's matmul), and what was measured for it.
_picks: Dict[Tuple, Union[int, str, None]] = {}
_reports: List[dict] = []
_open_scopes = 0  # round_shapes() contexts open


def _alignment(t: torch.Tensor) -> int:
    address = t.data_ptr()
    bytes_ = 16
    while bytes_ > 1 and address % bytes_:
        bytes_ //= 2
    return bytes_


def _problem(x: torch.Tensor, weight: torch.Tensor) -> Tuple:
    """What cuBLASLt's candidates depend on (with a new contiguous out, as ops.linear_cublaslt allocates): the row
    strides as the op's leading dimensions (those of a single row or weight row are free)."""
    rows, n, k = x.shape[0], weight.shape[0], x.shape[1]
    return (x.device, x.dtype, rows, n, k, k if rows == 1 else x.stride(0), k if n == 1 else weight.stride(0),
            _alignment(x), _alignment(weight))


@contextlib.contextmanager
def round_shapes() -> Iterator[None]:
    """A context in which the projections of ``fused.project`` run their picks (timing unseen problems): rounds whose
    shapes repeat. Outside it they run torch's matmul."""
    global _open_scopes
    _open_scopes += 1
    try:
        yield
    finally:
        _open_scopes -= 1


def active() -> bool:
    """Whether projections run picks now: ``enabled``, inside :func:`round_shapes`."""
    return enabled and _open_scopes > 0


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a projection of x [..., K] over weight [N, K] is one this module tunes: 1 to MAX_ROWS rows, 16-bit
    CUDA tensors of one dtype and device, last dims contiguous, the weight 16-byte aligned (so that copies of it are
    the same problem)."""
    rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 0
    return (x.is_cuda and x.dim() >= 1 and weight.dim() == 2 and 1 <= rows <= MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.device == x.device and x.shape[-1] == weight.shape[1]
            and x.stride(-1) == 1 and weight.stride(1) == 1 and _alignment(weight) == 16)


def algorithm(x: torch.Tensor, weight: torch.Tensor) -> Union[int, str, None]:
    """The pick for out = x [M, K] weight [N, K]^T (tensors :func:`applies` takes): a cuBLASLt candidate for
    ``ops.linear_cublaslt``, :data:`GEMV` for ``ops.linear_gemv`` (single rows), or None for torch's matmul. Timed at
    the problem's first sight outside a capture."""
    key = _problem(x, weight)
    if key in _picks:
        return _picks[key]
    with torch.cuda.device(x.device):  # the capture, sleep and events of x's device
        if torch.cuda.is_current_stream_capturing():
            # Nothing can be timed inside a capture. The graph keeps torch's matmul, and so does every later call, so
            # that eager rounds give the graph's bits.
            _picks[key] = None
            return None
        pick = _picks[key] = _tune(x, weight)
    return pick


def picks() -> List[dict]:
    """One record per tuned problem, in the order they were tuned: rows, N, K, dtype, device, the number of
    candidates, the pick (None: torch's matmul, :data:`GEMV`, or a cuBLASLt candidate's index) and its description,
    the microseconds per call of torch's matmul, of the pick and of the fastest candidate, of ops.linear_gemv where
    it was timed (``gemv_us``: its full timing if a finalist, else its screening batch; None for several rows), the
    weight's bytes (for a floor at a measured copy rate) and the seconds the timing took."""
    return [dict(r) for r in _reports]


def reset() -> None:
    """Forget every pick (the next call of each problem is timed again)."""
    _picks.clear()
    _reports.clear()


def _rotation(weight: torch.Tensor) -> List[torch.Tensor]:
    """The weight and copies of it (same strides and alignment), together over _ROTATED_BYTES x the L2 size."""
    l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size
    nbytes = weight.shape[0] * weight.stride(0) * weight.element_size()
    count = max(1, min(_MAX_COPIES, math.ceil(_ROTATED_BYTES * l2 / max(nbytes, 1))))
    copies = [weight]
    for _ in range(count - 1):
        copy = torch.empty_strided(weight.shape, weight.stride(), dtype=weight.dtype, device=weight.device)
        copies.append(copy.copy_(weight))
    return copies


def _time(run, copies: List[torch.Tensor], calls: int, batches: int) -> float:
    """Median device seconds per call of run(weight), the weights taken in turn, over ``batches`` batches of
    ``calls``.

    Each batch is queued behind a sleep kernel that outlasts its launches (checked: a batch queued slower than the
    sleep is queued again behind a longer one), so the calls run back to back, as in a graph, without host gaps. Not a
    CUDA graph: on torch 2.11 destroying a graph frees the cuBLAS workspaces of the stream it was captured on, also
    those that live round graphs captured on that (pooled) stream still use (pytorch/pytorch#193402)."""
    device = copies[0].device
    for w in copies:  # first calls: lazy initialisation, the problem's candidates, the stream's cuBLAS workspace
        run(w)
    clock_hz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 2_000_000) * 1e3
    sleep_s = calls * _LAUNCH_SECONDS
    times, retries = [], 0
    while len(times) < batches:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(sleep_s * clock_hz))
        began = time.perf_counter()
        start.record()
        for c in range(calls):
            run(copies[c % len(copies)])
        end.record()
        queued = time.perf_counter() - began
        end.synchronize()
        if queued > 0.9 * sleep_s and retries < 4:  # the device may have waited for launches: again, sleeping longer
            sleep_s, retries = 2 * queued, retries + 1
            continue
        times.append(start.elapsed_time(end) * 1e-3 / calls)
    return statistics.median(times)


def _tune(x: torch.Tensor, weight: torch.Tensor) -> Union[int, str, None]:
    began = time.perf_counter()
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    try:
        count = ops.linear_cublaslt_algorithms(x, weight, out)
    except RuntimeError:  # cuBLASLt refused the problem: only ops.linear_gemv (one row) may still beat torch's matmul
        count = 0
    candidates = list(range(count)) + ([GEMV] if gemv_candidate and x.shape[0] == 1 else [])
    if not candidates:
        return None
    torch.cuda.synchronize(x.device)  # x may come from any stream of the round
    copies = _rotation(weight)
    nbytes = weight.shape[0] * weight.shape[1] * weight.element_size()
    estimate = nbytes / 3e12  # seconds per call at about the copy rate of a current GPU
    calls = max(len(copies), min(_MAX_CALLS, math.ceil(_BATCH_SECONDS / max(estimate, 1e-7))))

    def candidate(i):
        if i == GEMV:  # the copies are written by nothing while they are timed: the weight may stream early
            return lambda w: ops.linear_gemv(x, w, out=out, prefetch_weight=True)
        return lambda w: ops.linear_cublaslt(x, w, i, out=out)

    with torch.no_grad():
        # One batch per candidate screens them; the _FINALISTS fastest and torch's matmul are then timed in full.
        screened = {}
        for i in candidates:
            try:
                screened[i] = _time(candidate(i), copies, calls, 1)
            except RuntimeError:  # a configuration cuBLASLt accepted but cannot launch here: dropped
                torch.cuda.synchronize(x.device)
        if not screened:
            return None
        finalists = sorted(screened, key=screened.__getitem__)[:_FINALISTS]
        default = _time(lambda w: torch.mm(x, w.t(), out=out), copies, calls, _BATCHES)
        times = {i: _time(candidate(i), copies, calls, _BATCHES) for i in finalists}
    best = min(times, key=times.__getitem__)
    pick = best if times[best] < (1 - MARGIN) * default else None
    _reports.append({
        "rows": x.shape[0], "n": weight.shape[0], "k": weight.shape[1], "dtype": str(x.dtype).replace("torch.", ""),
        "device": str(x.device), "candidates": len(screened), "pick": pick,
        "pick_description": ("torch matmul" if pick is None else "ops.linear_gemv (CUDA cores)" if pick == GEMV
                             else ops.linear_cublaslt_describe(x, weight, pick, out)),
        "matmul_us": default * 1e6, "pick_us": (default if pick is None else times[pick]) * 1e6,
        "best_candidate_us": times[best] * 1e6,
        "gemv_us": None if GEMV not in screened else times.get(GEMV, screened[GEMV]) * 1e6,
        "weight_bytes": nbytes, "seconds": time.perf_counter() - began,
    })
    return pick
