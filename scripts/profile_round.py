"""One decode round replayed from CUDA graphs at a benchmark preset's shapes, for Nsight Compute, and a summary of
what it measured: each kernel's time beside the DRAM bytes it moved (in the round's cache state), by kernel.

    ncu --profile-from-start off --graph-profiling node --cache-control none --clock-control none \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv --log-file round.csv \\
        python scripts/profile_round.py --preset 27b --method ddtree --budget 64
    python scripts/profile_round.py --summarize round.csv

The profiled region (cudaProfilerStart / Stop) is one round after ``--skip`` rounds replayed from graphs. Nsight
Compute runs the kernels one at a time, so kernels that overlap in a round (programmatic dependent launches, side
streams) are timed apart: the sum is more than the round, and each kernel's own time and bytes are what it shows.
"""
import argparse
import collections
import csv
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)


class _ProfileOneRound:
    """A streamer that brackets one round with cudaProfilerStart / Stop: the round launched after the ``first``-th token
    delivery (1: the prompt, 2: the prefill's token, then one per round read). generate() launches each round before
    it reads the round ahead of it, so when delivery ``first`` comes (round ``first - 3`` read), round ``first - 2`` is
    already out: it is waited for before the start, and round ``first - 1`` is the one profiled."""

    def __init__(self, first: int):
        self.first, self.calls = first, 0

    def put(self, value):
        import torch

        self.calls += 1
        if self.calls in (self.first, self.first + 1):
            torch.cuda.synchronize()
            cudart = torch.cuda.cudart()
            (cudart.cudaProfilerStart if self.calls == self.first else cudart.cudaProfilerStop)()

    def end(self):
        pass


def run(args) -> None:
    import e2e
    import torch

    import ddtree_ext
    from ddtree_ext import generate, round as round_module
    from ddtree_ext.target import TargetAdapter

    preset = e2e.PRESETS[args.preset]
    target = e2e.build_target(preset)
    draft = e2e.build_draft(target, preset)
    ddtree_ext.stack_projections(target)
    ddtree_ext.stack_projections(draft)
    adapter = TargetAdapter(target, draft.target_layer_ids)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, adapter.vocab_size, (1, args.prompt_len), generator=gen).cuda()
    # Eager rounds, then the capturing round, then args.skip replayed rounds before the profiled one (0-based round
    # first - 1, see _ProfileOneRound). Enough tokens that the generation lasts past it, with rounds launched ahead,
    # even where every round accepts a whole block.
    first = 2 + round_module.EAGER_ROUNDS_BEFORE_CAPTURE + args.skip
    kw = dict(method=args.method, tree_budget=max(args.budget, 1), cuda_graph=True, return_stats=True)
    _, stats = generate(adapter, draft, prompt, (first + 3) * draft.block_size, streamer=_ProfileOneRound(first), **kw)
    torch.cuda.synchronize()
    profiled = first - 1
    if stats.rounds <= profiled or not stats.round_replayed[profiled]:
        raise SystemExit(f"round {profiled} was not replayed from graphs (a new attention width?): profile not valid")
    print(f"profiled round {profiled} (0-based) of {args.preset} {args.method} budget {args.budget}")


def _short(name: str) -> str:
    name = name.replace("(anonymous namespace)::", "")
    name = re.sub(r"\(.*", "", name)  # drop the argument list
    name = re.sub(r"^void ", "", name).replace("ddtree::", "")
    return name[:70]


# Nsight Compute's units of the metrics read here, to microseconds and bytes.
_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "byte": 1.0,
          "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}


def summarize(path: str, top: int) -> None:
    kernels = collections.OrderedDict()  # ncu's kernel ID -> {name, metrics}
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # the CSV rows (ncu's own messages start with ==)
    for row in csv.DictReader(lines):
        k = kernels.setdefault(row["ID"], {"name": _short(row["Kernel Name"])})
        scale = _UNITS.get(row["Metric Unit"])
        if scale is None or row["Metric Value"] in ("", "n/a"):
            continue  # a metric this summary does not read
        k[row["Metric Name"]] = float(row["Metric Value"].replace(",", "")) * scale
    rows = list(kernels.values())
    total_us = sum(k.get("gpu__time_duration.sum", 0.0) for k in rows)
    total_mb = sum(k.get("dram__bytes_read.sum", 0.0) + k.get("dram__bytes_write.sum", 0.0) for k in rows) / 1e6
    print(f"{len(rows)} kernels, {total_us / 1e3:.2f} ms in all (one at a time), {total_mb:.0f} MB of DRAM traffic")
    groups = collections.OrderedDict()
    for k in rows:
        g = groups.setdefault(k["name"], [0, 0.0, 0.0])
        g[0] += 1
        g[1] += k.get("gpu__time_duration.sum", 0.0)
        g[2] += k.get("dram__bytes_read.sum", 0.0) + k.get("dram__bytes_write.sum", 0.0)
    print("\n| kernel | calls | us in all | us per call | MB per call | GB/s | share |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (calls, us, b) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| `{name}` | {calls} | {us:.1f} | {us / calls:.2f} | {b / calls / 1e6:.2f} | "
              f"{b / max(us, 1e-9) / 1e3:.0f} | {us / total_us:.1%} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="27b")
    p.add_argument("--method", default="ddtree", choices=["ddtree", "dflash", "autoregressive"])
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--skip", type=int, default=2, help="replayed rounds before the profiled one")
    p.add_argument("--summarize", metavar="CSV", help="summarise an Nsight Compute CSV log instead of running")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    if args.summarize:
        summarize(args.summarize, args.top)
    else:
        run(args)


if __name__ == "__main__":
    main()
