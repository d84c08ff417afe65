#!/usr/bin/env python3
"""Side by side: the rounds of two or more benchmarks/e2e.py runs (their JSON reports), for A/B runs.

    python scripts/compare_e2e.py A.json B.json [more.json ...] [--labels base,new] [--out table.md]

One row per preset, method, budget and path (graphs or eager) that every report has: each report's median round
time and its verify stage (CUDA-event device time), and each round time over the first report's. The header names
each report's commit and command, its copy rate, and the run settings that differ between the reports (the
switches e2e.py records: projections, residual adds, stacking, ...), so a table says what was compared with what.
Compare only runs of one call: fresh machines differ by up to 0.6 ms on a 27B round at the same code.
"""

import argparse
import json
import sys

# Top-level report keys that describe the machine or the run, not a setting being compared.
_NOT_SETTINGS = {"date", "gpu", "commit", "command", "torch", "transformers", "fla", "copy_gb_s", "copy_gb_s_measured",
                 "gpu_memory_gb", "presets"}


def run_key(preset, run):
    return (preset["preset"], run["method"], run["budget"], "graphs" if run["graphs"] else "eager")


def rounds_by_key(report):
    """{(preset, method, budget, path): run} of one report."""
    return {run_key(p, r): r for p in report["presets"] for r in p["runs"]}


def differing_settings(reports):
    """[(key, [value per report])] for the run settings whose values differ between the reports."""
    keys = sorted({k for r in reports for k in r} - _NOT_SETTINGS)
    out = []
    for key in keys:
        values = [r.get(key) for r in reports]
        if any(json.dumps(v, sort_keys=True) != json.dumps(values[0], sort_keys=True) for v in values[1:]):
            out.append((key, values))
    return out


def compare(reports, labels):
    """The Markdown comparison of reports (parsed e2e.py JSONs), labelled by labels, as a list of lines."""
    if len(reports) < 2:
        raise ValueError(f"compare: needs at least two reports, got {len(reports)}")
    if len(labels) != len(reports):
        raise ValueError(f"labels: expected {len(reports)} labels (one per report), got {len(labels)}")
    lines = ["# End-to-end A/B: " + " vs ".join(labels), ""]
    for label, r in zip(labels, reports):
        lines.append(f"- **{label}**: commit `{r.get('commit')}`, {r.get('gpu')}, copy rate "
                     f"{r.get('copy_gb_s', float('nan')):.0f} GB/s; `{r.get('command')}`")
    diffs = differing_settings(reports)
    if diffs:
        lines += ["", "Settings that differ:", ""]
        for key, values in diffs:
            lines.append(f"- `{key}`: " + "; ".join(f"{label} {json.dumps(v)}" for label, v in zip(labels, values)))
    else:
        lines += ["", "No recorded setting differs (the code, or the environment, is what was compared)."]

    by_report = [rounds_by_key(r) for r in reports]
    common = [k for k in by_report[0] if all(k in b for b in by_report[1:])]
    missing = sorted({k for b in by_report for k in b} - set(common))
    head = ["preset", "method", "budget", "path"]
    head += [f"{label} ms" for label in labels] + [f"{label} / {labels[0]}" for label in labels[1:]]
    head += [f"{label} verify" for label in labels]
    lines += ["", "Median round times (ms) and verify stages (ms, device time):", "",
              "| " + " | ".join(head) + " |",
              "| " + " | ".join(["---"] * 2 + ["---:", "---"] + ["---:"] * (len(head) - 4)) + " |"]
    for key in common:
        runs = [b[key] for b in by_report]
        base = runs[0]["round_ms"]
        cells = [key[0], key[1], str(key[2]), key[3]]
        cells += [f"{r['round_ms']:.2f}" for r in runs]
        cells += [f"{r['round_ms'] / base:.3f}" for r in runs[1:]]
        cells += [f"{r['stage_ms']['verify']:.3f}" if "verify" in r.get("stage_ms", {}) else "" for r in runs]
        lines.append("| " + " | ".join(cells) + " |")
    if missing:
        lines += ["", "Not in every report (left out): " + ", ".join(" ".join(map(str, k)) for k in missing)]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", help="benchmarks/e2e.py JSON reports; the first is the base")
    parser.add_argument("--labels", type=lambda s: s.split(","), help="one label per report (default A, B, C, ...)")
    parser.add_argument("--out", help="also write the table to this Markdown file")
    args = parser.parse_args(argv)
    if len(args.reports) < 2:
        parser.error(f"reports: expected at least two JSON reports, got {len(args.reports)}")
    labels = args.labels or [chr(ord("A") + i) for i in range(len(args.reports))]
    if len(labels) != len(args.reports):
        parser.error(f"--labels: expected {len(args.reports)} labels (one per report), got {len(labels)}")
    reports = []
    for path in args.reports:
        with open(path) as f:
            reports.append(json.load(f))
    text = "\n".join(compare(reports, labels)) + "\n"
    sys.stdout.write(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
