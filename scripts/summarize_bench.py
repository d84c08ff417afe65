"""Markdown table of a pytest-benchmark JSON from benchmarks/test_bench_cuda.py, for benchmarks/results/.

    python scripts/summarize_bench.py bench.json [--out benchmarks/results/h200.md]

One row per benchmark: op, shape, median time per op call (CUDA-event median of graph replays, divided
by the calls captured per replay), its floor (bytes / measured copy bandwidth or FLOPs / measured
float32 rate, whichever is larger), the ratio of the two, and the baseline where the benchmark has one
(the stock Hugging Face computation the op replaces, timed the same way).
"""

from __future__ import annotations

import argparse
import json
import sys


def table(data: dict) -> str:
    rows = []
    for bench in data["benchmarks"]:
        info = bench.get("extra_info", {})
        calls = info.get("calls_per_replay", 1)
        median_us = info.get("per_op_us", bench["stats"]["median"] * 1e6 / calls)
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
    head = [f"Benchmarks of {data.get('commit_info', {}).get('id', 'unknown commit')[:12]} "
            f"on {machine.get('node', 'unknown host')}, {data.get('datetime', '')}."]
    if first:
        head.append(f"Ceilings measured in the same session: copy {first['copy_GBps']:.0f} GB/s (read + write), "
                    f"float32 FMA matrix rate {first['fp32_TFLOPs']:.1f} TFLOP/s.")
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
