"""One decode round replayed from CUDA graphs at a benchmark preset's shapes, for Nsight Compute, and a summary of
what it measured: each kernel's time beside the DRAM bytes it moved (in the round's cache state), by kernel. Or the
same round's timeline as it ran (torch.profiler's CUDA activity: kernels overlapping as in any round), and where its
time went.

    ncu --profile-from-start off --graph-profiling node --cache-control none --clock-control none \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv --log-file round.csv \\
        python scripts/profile_round.py --preset 27b --method ddtree --budget 64
    python scripts/profile_round.py --summarize round.csv
    python scripts/profile_round.py --preset qwen3-8b --method ddtree --budget 64 --timeline round.json
    python scripts/profile_round.py --summarize-timeline round.json


The profiled region (cudaProfilerStart / Stop) is one round after ``--skip`` rounds replayed from graphs. Nsight
Compute runs the kernels one at a time, so kernels that overlap in a round (programmatic dependent launches, side
streams) are timed apart: the sum is more than the round, and each kernel's own time and bytes are what it shows.
With ``--timeline`` the round runs as it would (the profiler's activity records cost little per kernel), and the
summary splits the round's span between the kernels running at each instant (equal shares where several overlap),
beside the idle gaps: what each kernel costs the round, not what it costs alone. Two cautions. A kernel launched
early as a programmatic dependent starts its clock while it waits for the one before, so its own time includes part
of that one's. And under the profiler the kernels around a graph's memset node (cuBLASLt clears 4 bytes before each
call of a candidate with a workspace) started 2-5 us late, a cost a same-call A/B without the profiler did not show
(benchmarks/results/2026-12-04-h200-round-timeline.md): read those gaps as the profiler's.
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

    def __init__(self, first: int, start, stop):
        self.first, self.calls, self.start, self.stop = first, 0, start, stop

    def put(self, value):
        import torch

        self.calls += 1
        if self.calls in (self.first, self.first + 1):
            torch.cuda.synchronize()
            (self.start if self.calls == self.first else self.stop)()

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
    kw = dict(method=args.method, tree_budget=max(args.budget, 1), cuda_graph=True, return_stats=True,
              eos_token_id=[])  # no EOS stop (a checkpoint's generation_config may name one): the profiled round runs
    if args.timeline:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CUDA])
        start, stop = prof.start, prof.stop
    else:
        cudart = torch.cuda.cudart()
        start, stop = cudart.cudaProfilerStart, cudart.cudaProfilerStop
    streamer = _ProfileOneRound(first, start, stop)
    _, stats = generate(adapter, draft, prompt, (first + 3) * draft.block_size, streamer=streamer, **kw)
    torch.cuda.synchronize()
    if args.timeline:
        prof.export_chrome_trace(args.timeline)
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


def summarize_timeline(path: str, top: int) -> None:
    """The round's span split between the kernels running at each instant (equal shares where several overlap), the
    idle gaps, and each stream's busy time, from a Chrome trace of torch.profiler's CUDA activity."""
    import json

    with open(path) as f:
        events = json.load(f)["traceEvents"]
    ks = sorted(((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), _short(e["name"]), e.get("tid"))
                 for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda k: k[0])
    if not ks:
        raise SystemExit(f"{path}: no kernels in the trace")
    span = ks[-1][1] - ks[0][0]
    # Sweep the interval ends: each elementary piece of time goes to the kernels running then, in equal shares.
    cuts = sorted({t for k in ks for t in k[:2]})
    share = collections.defaultdict(float)
    idle, gaps = 0.0, []
    starts, ends_at = collections.defaultdict(list), collections.defaultdict(list)
    for i, k in enumerate(ks):
        starts[k[0]].append(i)
        ends_at[k[1]].append(i)
    running = set()
    last_ended = None
    for a, b in zip(cuts, cuts[1:]):
        running.difference_update(ends_at.get(a, ()))
        running.update(starts.get(a, ()))
        if running:
            for i in running:
                share[ks[i][2]] += (b - a) / len(running)
            last_ended = max(running, key=lambda i: ks[i][1])
        else:
            idle += b - a
            nxt = min(starts.get(b, ()), default=None)
            gaps.append((b - a, ks[last_ended][2] if last_ended is not None else "-",
                         ks[nxt][2] if nxt is not None else "-"))
    own = collections.defaultdict(lambda: [0, 0.0])
    streams = collections.defaultdict(lambda: [0, 0.0])
    for t0, t1, name, tid in ks:
        own[name][0] += 1
        own[name][1] += t1 - t0
        streams[tid][0] += 1
        streams[tid][1] += t1 - t0
    print(f"{len(ks)} kernels and copies over {span:.1f} us; idle {idle:.1f} us in {len(gaps)} gaps "
          f"({sum(1 for g in gaps if g[0] >= 1.0)} of 1 us or more)")
    # A replayed graph runs its branches on streams of its own, many of them: the busiest few are enough.
    busiest = sorted(streams.items(), key=lambda kv: -kv[1][1])[:6]
    print(f"{len(streams)} streams; the busiest: " + ", ".join(f"{tid}: {n} kernels, {us:.0f} us"
                                                            for tid, (n, us) in busiest))
    print("\n| kernel | calls | share of the span, us | per call | own time, us | per call |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, us in sorted(share.items(), key=lambda kv: -kv[1])[:top]:
        n, own_us = own[name]
        print(f"| `{name}` | {n} | {us:.1f} | {us / n:.2f} | {own_us:.1f} | {own_us / n:.2f} |")
    print("\nlongest idle gaps (us, after -> before):")
    for g, before, after in sorted(gaps, key=lambda g: -g[0])[:10]:
        print(f"  {g:.2f}  {before} -> {after}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="27b")
    p.add_argument("--method", default="ddtree", choices=["ddtree", "dflash", "autoregressive"])
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--skip", type=int, default=2, help="replayed rounds before the profiled one")
    p.add_argument("--summarize", metavar="CSV", help="summarise an Nsight Compute CSV log instead of running")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--timeline", metavar="JSON", help="record the round with torch.profiler (not under ncu) into this "
                   "Chrome trace")
    p.add_argument("--summarize-timeline", metavar="JSON", help="summarise such a trace instead of running")
    args = p.parse_args()
    if args.summarize:
        summarize(args.summarize, args.top)
    elif args.summarize_timeline:
        summarize_timeline(args.summarize_timeline, args.top)
    else:
        run(args)


if __name__ == "__main__":
    main()
