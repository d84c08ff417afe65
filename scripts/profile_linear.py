"""Runs ops.linear at a round's projection shapes for Nsight Compute (or a quick timing without it).

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --profile-from-start off python scripts/profile_linear.py --rows 1 65 --shape 10240 5120
    python scripts/profile_linear.py --rows 1 16 65 --shape 10240 5120 --time

The profiled region (cudaProfilerStart/Stop) holds one call per row count, after warm-up calls; --time prints
the median of graph-replayed calls beside F.linear's (weights rotated over >= 200 MB so they stream from memory).
"""
import argparse
import os
import sys

import torch

from ddtree_ext import ops

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from test_bench_cuda import _captured, _median_event_ms  # noqa: E402


def replay_us(calls, reps: int = 20) -> float:
    """Median per-call time of `calls` captured in one graph."""
    return _median_event_ms(_captured(calls).replay, reps) * 1e3 / len(calls)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 65])
    p.add_argument("--shape", type=int, nargs=2, default=[10240, 5120], metavar=("N", "K"))
    p.add_argument("--time", action="store_true")
    args = p.parse_args()
    n, k = args.shape
    copies = max(2, -(-200_000_000 // (2 * n * k)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
    for rows in args.rows:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        if args.time:
            ours = replay_us([lambda w=w: ops.linear(x, w, prefetch_weight=True) for w in weights])
            cublas = replay_us([lambda w=w: torch.nn.functional.linear(x, w) for w in weights])
            gbps = 2 * n * k / ours / 1e3
            print(f"rows {rows:3d} [{n}, {k}]: ops.linear {ours:7.2f} us ({gbps:5.0f} GB/s), F.linear {cublas:7.2f} us")
        else:
            for w in weights:
                ops.linear(x, w)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            ops.linear(x, weights[0])
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
