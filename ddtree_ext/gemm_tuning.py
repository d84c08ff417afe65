"""Per-shape choice of the GEMM algorithm behind a model's projections on the GPU (opt-in: ``enabled``).

cuBLAS picks a kernel for each GEMM shape by heuristic. At the few rows of a decode step, a DFlash block or a tree
verify, a projection only streams its weight, and the heuristic's pick is not always the fastest: on the H200 the
27B MLP's stacked gate/up weight at 65 rows ran at 1.19 x its weight-read floor, its two halves apart at 1.13 x
(``benchmarks/results/2026-12-01-h200-stacked-projections.md``).

With ``enabled`` on, every projection of the fused forwards (``fused.project``) of a 16-bit CUDA model asks
:func:`algorithm` for its problem. The first time a problem (device, dtype, sizes, row strides, alignments) is seen
outside CUDA graph capture, this times torch's own matmul and each of cuBLASLt's candidates
(``ops.linear_cublaslt``) on the weight itself and on copies of it, called in turn so that every call streams its
weight from memory as in a round, queued ahead so that launch gaps do not count, and keeps the fastest for the
process. A candidate replaces torch's matmul only when it is faster by more than ``MARGIN``. Later calls, eager or
captured, reuse the pick; a problem first seen during a capture runs torch's matmul (nothing is timed then).

The picks are timed, so two processes may pick differently where candidates are close, and their outputs may then
differ in the last bits (as with cuBLAS on two GPU models). Within a process the eager and the graph rounds use the
same picks, and each algorithm is deterministic.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Dict, List, Optional, Tuple

import torch

from ddtree_ext import ops

# Whether fused.project runs tuned picks (off: torch's F.linear, cuBLAS's heuristic, as before).
enabled = False

# A cuBLASLt candidate must beat torch's matmul by this fraction to replace it (timing noise is below it).
MARGIN = 0.01

# The most rows tuned: a verify of a 256-node tree and its root. A prompt's prefill of more rows runs once per
# generation, at a length that changes from one to the next: torch's matmul serves it untimed.
MAX_ROWS = 257

_ROTATED_BYTES = 3  # times the L2 size: the weights called in turn, so none is still in L2 at its next call
_MAX_COPIES = 64
_BATCH_SECONDS = 2e-3  # device time per timed batch
_MAX_CALLS = 512  # per batch: well inside the launch queue
_LAUNCH_SECONDS = 20e-6  # host time to queue one call, generously
_REPLAYS = 5

# problem key -> the pick (None: torch's matmul), and what was measured for it.
_picks: Dict[Tuple, Optional[int]] = {}
_reports: List[dict] = []


def _alignment(t: torch.Tensor) -> int:
    address = t.data_ptr()
    bytes_ = 16
    while bytes_ > 1 and address % bytes_:
        bytes_ //= 2
    return bytes_


def _problem(x: torch.Tensor, weight: torch.Tensor) -> Tuple:
    """What cuBLASLt's candidates depend on (with a new contiguous out, as ops.linear_cublaslt allocates)."""
    return (x.device, x.dtype, x.shape[0], weight.shape[0], x.shape[1], x.stride(0), weight.stride(0),
            _alignment(x), _alignment(weight))


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a projection of x [M, K] over weight [N, K] is one this module tunes: 1 to MAX_ROWS rows, 16-bit CUDA
    tensors of one dtype and device, last dims contiguous, the weight 16-byte aligned (so that copies of it are the
    same problem)."""
    return (x.is_cuda and x.dim() == 2 and weight.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.device == x.device and x.shape[1] == weight.shape[1]
            and x.stride(1) == 1 and weight.stride(1) == 1 and _alignment(weight) == 16)


def algorithm(x: torch.Tensor, weight: torch.Tensor) -> Optional[int]:
    """The pick for out = x [M, K] weight [N, K]^T (tensors :func:`applies` takes): a cuBLASLt candidate for
    ``ops.linear_cublaslt``, or None for torch's matmul. Timed at the problem's first sight outside a capture."""
    key = _problem(x, weight)
    if key in _picks:
        return _picks[key]
    if torch.cuda.is_current_stream_capturing():
        return None  # nothing can be timed inside a capture; a later eager call tunes the problem
    pick = _picks[key] = _tune(x, weight)
    return pick


def picks() -> List[dict]:
    """One record per tuned problem, in the order they were tuned: rows, N, K, dtype, device, the number of
    candidates, the pick (None: torch's matmul) and its description, the microseconds per call of torch's matmul,
    of the pick and of the fastest candidate, the weight's bytes (for a floor at a measured copy rate) and the
    seconds the timing took."""
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


def _time(run, copies: List[torch.Tensor], calls: int) -> float:
    """Median device seconds per call of run(weight), the weights taken in turn, over _REPLAYS batches of ``calls``.

    Each batch is queued behind a sleep kernel longer than its launches take, so the calls run back to back, as in a
    graph, without host gaps. Not a CUDA graph: on torch 2.11 destroying a graph frees the cuBLAS workspaces of the
    stream it was captured on, also those that live round graphs captured on that (pooled) stream still use
    (pytorch/pytorch#193402)."""
    device = copies[0].device
    for w in copies:  # first calls: lazy initialisation, the problem's candidates, the stream's cuBLAS workspace
        run(w)
    clock_hz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 2_000_000) * 1e3
    sleep_cycles = int(calls * _LAUNCH_SECONDS * clock_hz)
    times = []
    for _ in range(_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(sleep_cycles)
        start.record()
        for c in range(calls):
            run(copies[c % len(copies)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / calls)
    return statistics.median(times)


def _tune(x: torch.Tensor, weight: torch.Tensor) -> Optional[int]:
    began = time.perf_counter()
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    count = ops.linear_cublaslt_algorithms(x, weight, out)
    if count == 0:
        return None
    torch.cuda.synchronize(x.device)  # x may come from any stream of the round
    copies = _rotation(weight)
    nbytes = weight.shape[0] * weight.shape[1] * weight.element_size()
    estimate = nbytes / 3e12  # seconds per call at about the copy rate of a current GPU
    calls = max(len(copies), min(_MAX_CALLS, math.ceil(_BATCH_SECONDS / max(estimate, 1e-7))))
    with torch.no_grad():
        default = _time(lambda w: torch.mm(x, w.t(), out=out), copies, calls)
        times = [_time(lambda w, i=i: ops.linear_cublaslt(x, w, i, out=out), copies, calls) for i in range(count)]
    best = min(range(count), key=times.__getitem__)
    pick = best if times[best] < (1 - MARGIN) * default else None
    _reports.append({
        "rows": x.shape[0], "n": weight.shape[0], "k": weight.shape[1], "dtype": str(x.dtype).replace("torch.", ""),
        "device": str(x.device), "candidates": count, "pick": pick,
        "pick_description": "torch matmul" if pick is None else ops.linear_cublaslt_describe(x, weight, pick, out),
        "matmul_us": default * 1e6, "pick_us": (default if pick is None else times[pick]) * 1e6,
        "best_candidate_us": times[best] * 1e6, "weight_bytes": nbytes, "seconds": time.perf_counter() - began,
    })
    return pick
