"""Times each projection shape of the 27B and Qwen3-8B rounds as ddtree_ext.gemm_tuning does: torch's matmul
(cuBLAS's heuristic pick) against every cuBLASLt candidate (and, for one row, ops.linear_gemv), weights rotated
out of L2.

    python scripts/profile_gemm_tuning.py --rows 1 16 17 65

For each shape and row count it prints torch's matmul, the pick, the fastest candidate and the floor (weight bytes /
the device copy rate measured here), all in us per call, and then the sum over one forward of the model's
projections (per layer counts below; the LM head once). As a check of the tuner's timing (calls queued behind a sleep
kernel), the pick and torch's matmul are timed again as graph replays.
"""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from e2e import copy_bandwidth  # noqa: E402
from test_bench_cuda import _captured, _median_event_ms  # noqa: E402

from ddtree_ext import gemm_tuning, ops  # noqa: E402

# model -> [(name, N, K, projections of this shape per forward)], with stack_projections' groups stacked (the 27B
# MLP's gate and up run apart above 16 rows: fused.stacked_gemm_pays).
SHAPES = {
    "27b": [
        ("gdn qkv", 10240, 5120, 48), ("gdn z", 6144, 5120, 48), ("gdn out", 5120, 6144, 48),
        ("attn q+k+v", 14336, 5120, 16), ("attn o", 5120, 6144, 16),
        ("mlp gate+up", 34816, 5120, 64), ("mlp gate / up", 17408, 5120, 128), ("mlp down", 5120, 17408, 64),
        ("lm head", 248320, 5120, 1),
    ],
    "qwen3-8b": [
        ("attn q+k+v", 6144, 4096, 36), ("attn o", 4096, 4096, 36), ("mlp gate+up", 24576, 4096, 36),
        ("mlp down", 4096, 12288, 36), ("lm head", 151936, 4096, 1),
    ],
}


def graph_us(copies, run) -> float:
    return _median_event_ms(_captured([lambda w=w: run(w) for w in copies]).replay, 10) * 1e3 / len(copies)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 17, 65])
    p.add_argument("--model", choices=sorted(SHAPES), action="append")
    p.add_argument("--no-gemv", action="store_true", help="leave ops.linear_gemv out of the one-row candidates")
    args = p.parse_args()
    gemm_tuning.gemv_candidate = not args.no_gemv  # shown beside the others here, though off by default in rounds
    rate = copy_bandwidth()
    print(f"copy rate {rate / 1e9:.0f} GB/s (read + write)")
    for model in args.model or sorted(SHAPES):
        sums = {rows: [0.0, 0.0, 0.0] for rows in args.rows}  # matmul, pick, floor (us per forward)
        print(f"\n## {model}\n")
        print("| shape | N x K | rows | candidates | torch matmul | pick | fastest candidate | floor | matmul / floor | "
              "pick / floor | graph: matmul | graph: pick | the pick |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for name, n, k, count in SHAPES[model]:
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
            floor_us = 2 * n * k / rate * 1e6
            for rows in args.rows:
                stacked_mlp = model == "27b" and name.startswith("mlp gate")
                if stacked_mlp and (name == "mlp gate+up") != (rows <= 16):
                    continue  # not how the fused forwards run this MLP at this many rows
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                gemm_tuning.reset()
                pick = gemm_tuning.algorithm(x, weight)
                record = gemm_tuning.picks()[0]
                copies = gemm_tuning._rotation(weight)
                g_matmul = graph_us(copies, lambda w: torch.mm(x, w.t()))
                if pick == gemm_tuning.GEMV:
                    g_pick = graph_us(copies, lambda w: ops.linear_gemv(x, w, prefetch_weight=True))
                else:
                    g_pick = g_matmul if pick is None else graph_us(copies, lambda w: ops.linear_cublaslt(x, w, pick))
                del copies
                sums[rows][0] += count * g_matmul
                sums[rows][1] += count * g_pick
                sums[rows][2] += count * floor_us
                what = "torch matmul" if pick is None else f"{pick}: {record['pick_description']}"
                if record.get("gemv_us") is not None:  # timed (one row)
                    what += f" (ops.linear_gemv {record['gemv_us']:.1f} us)"
                print(f"| {name} | {n} x {k} | {rows} | {record['candidates']} | {record['matmul_us']:.1f} | "
                      f"{record['pick_us']:.1f} | {record['best_candidate_us']:.1f} | {floor_us:.1f} | "
                      f"{record['matmul_us'] / floor_us:.2f} | {record['pick_us'] / floor_us:.2f} | {g_matmul:.1f} | "
                      f"{g_pick:.1f} | {what} |", flush=True)
            del weight
            torch.cuda.empty_cache()
        print(f"\n{model}, one forward's projections (graph replays, ms): rows: torch matmul / picks / floor")
        for rows, (matmul, picked, floor) in sums.items():
            print(f"- {rows} rows: {matmul / 1e3:.3f} / {picked / 1e3:.3f} / {floor / 1e3:.3f}")
    gemm_tuning.reset()


if __name__ == "__main__":
    main()
