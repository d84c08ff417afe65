"""Markdown table of a pytest-benchmark JSON from benchmarks/test_bench_cuda.py, for benchmarks/results/.

    python scripts/summarize_bench.py bench.json [--out benchmarks/results/h200.md]

The commit is DDTREE_COMMIT when set (a copy of the tree whose .git is stale, as on the device machines), else
pytest-benchmark's. One row per benchmark: op, shape, median time per op call (CUDA-event median of graph replays, divided
by the calls captured per replay), its floor (bytes / measured copy bandwidth or FLOPs / measured
float32 rate, whichever is larger), the ratio of the two, and the baseline where the benchmark has one
(the stock Hugging Face computation the op replaces, timed the same way). Then issue #4's kernel targets
(TARGETS) against those rows: met, or missed by how much.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


# Issue #4's targets at Qwen3.6-27B shapes: (label, benchmark names, bound, unit). "us": the benchmarks' per-call
# medians summed; "x floor": the one benchmark's median over its floor.
TARGETS = [
    ("tree gated delta rule <= 30 us per layer at N = 65", ["test_tree_gated_delta_rule[64]"], 30.0, "us"),
    ("top-K + build <= 50 us at N = 65", ["test_topk_logprobs", "test_build_tree[64]"], 50.0, "us"),
    ("walk (greedy) <= 10 us at N = 65", ["test_walk_greedy[64]"], 10.0, "us"),
    ("commit of 48 GDN states <= 2 x its floor", ["test_commit_gdn_state"], 2.0, "x floor"),
    ("K/V compaction for 16 layers <= 20 us", ["test_commit_kv"], 20.0, "us"),
]


def _per_op_us(bench: dict) -> float:
    info = bench.get("extra_info", {})
    return info.get("per_op_us", bench["stats"]["median"] * 1e6 / info.get("calls_per_replay", 1))


def target_rows(data: dict) -> list:
    """Markdown rows (target | measured | verdict) for the TARGETS whose benchmarks are all in `data`."""
    by_name = {b["name"]: b for b in data["benchmarks"] if "floor_us" in b.get("extra_info", {})}
    rows = []
    for label, names, bound, unit in TARGETS:
        if not all(n in by_name for n in names):
            continue
        times = [_per_op_us(by_name[n]) for n in names]
        if unit == "us":
            value = sum(times)
            shown = " + ".join(f"{t:.1f}" for t in times) + (f" = {value:.1f}" if len(times) > 1 else "") + " us"
        else:
            floor = by_name[names[0]]["extra_info"]["floor_us"]
            value = times[0] / floor
            shown = f"{times[0]:.1f} us / {floor:.1f} us = {value:.2f} x"
        verdict = "met" if value <= bound else f"missed by {value / bound:.2f} x"
        rows.append(f"| {label} | {shown} | {verdict} |")
    return rows


def table(data: dict) -> str:
    rows = []
    for bench in data["benchmarks"]:
        info = bench.get("extra_info", {})
        median_us = _per_op_us(bench)
        floor_us = info.get("floor_us")
        ratio = f"{median_us / floor_us:.1f}" if floor_us else "-"
        floor = f"{floor_us:.2f}" if floor_us else "-"
        baseline_us = info.get("baseline_us")
        baseline = f"{baseline_us:.2f}" if baseline_us else "-"
        rows.append((str(info.get("op", bench["group"] or bench["name"])), str(info.get("shape", bench["name"])),
                     f"{median_us:.2f}", floor, ratio, baseline))
    lines = ["| op | shape | median us | floor us | ratio to floor | baseline us |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {' | '.join(r)} |" for r in rows]
    first = next((b["extra_info"] for b in data["benchmarks"] if "copy_GBps" in b.get("extra_info", {})), None)
    machine = data.get("machine_info", {})
    commit = os.environ.get("DDTREE_COMMIT") or data.get("commit_info", {}).get("id", "unknown commit")
    head = [f"Benchmarks of {commit[:12]} "
            f"on {machine.get('node', 'unknown host')}, {data.get('datetime', '')}."]
    if first:
        head.append(f"Ceilings measured in the same session: copy {first['copy_GBps']:.0f} GB/s (read + write), "
                    f"float32 FMA matrix rate {first['fp32_TFLOPs']:.1f} TFLOP/s.")
    targets = target_rows(data)
    if targets:
        lines += ["", "Against the issue #4 targets (computed by this script):", "", "| target | measured | verdict |",
                  "| --- | --- | --- |"] + targets
    return "\n".join(head) + "\n\n" + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", help="pytest-benchmark JSON (--benchmark-json)")
    parser.add_argument("--out", help="write the table here instead of stdout")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        text = table(json.load(f))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
