"""Times gqa_attention (with its split combine) per call at the benchmark presets' attention shapes.

    python scripts/profile_attention.py                         # 27B and Qwen3-8B, N 1 17 65, S 528..768 2048 4096
    python scripts/profile_attention.py --shapes 27b --nodes 17 --keys 528 576 624
    python scripts/profile_attention.py --sweep-splits --keys 576 2048 8192 --json splits.json  # the op's choice of
        # key splits beside each number of splits forced through num_splits

us per call: 20 calls captured in a CUDA graph (benchmarks/test_bench_cuda.py's helpers), the median of 9 replays after
3 warm-up replays; bf16, q in the verify's [B, N, H, D] memory order, K and V sliced from a larger cache, masks 90 %
true. Each (shape, N) sweeps its key counts up and then down, so that a drift of the machine shows as a disagreement
of the two passes.
"""
import argparse
import os
import statistics
import sys
from typing import Callable, List

import torch

from ddtree_ext import ops

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from test_bench_cuda import _captured, _median_event_ms  # noqa: E402

SHAPES = {"27b": (24, 4, 256), "qwen3-8b": (32, 8, 128)}  # query heads, KV heads, head dim


def time_per_call(fn, calls: int = 20, replays: int = 9) -> float:
    """Median device time of one call in us, from replays of a graph of `calls` calls."""
    return _median_event_ms(_captured([fn] * calls).replay, replays) * 1e3 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--nodes", nargs="+", type=int, default=[1, 17, 65], help="query rows N (budget + 1)")
    parser.add_argument("--keys", nargs="+", type=int, default=[528, 576, 624, 672, 720, 768, 2048, 4096])
    parser.add_argument("--sweep-splits", action="store_true",
                        help="per (shape, N, S): the op's own split (num_splits=0, timed before and after) and every "
                             "distinct number of splits that SPLIT_COUNTS and one split a chunk give, forced through "
                             "num_splits")
    parser.add_argument("--json", help="with --sweep-splits, also write the table here")
    args = parser.parse_args()
    if args.sweep_splits:
        sweep_splits(args)
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes:
        cache = key_cache(name, max(args.keys), gen)
        for n in args.nodes:
            times = {s: [] for s in args.keys}
            for keys in (args.keys, args.keys[::-1]):
                for s in keys:
                    times[s].append(time_per_call(attention_call(name, n, s, cache, gen)))
            print(f"{name} N={n}: " + "  ".join(f"S={s} {statistics.mean(t):.2f} ({t[0]:.2f}/{t[1]:.2f})"
                                               for s, t in times.items()), flush=True)


def key_cache(name: str, keys: int, gen: torch.Generator) -> List[torch.Tensor]:
    """K and V caches of the shape's KV heads with 64 slots past ``keys``: the op reads them sliced, as a verify does."""
    _, kv_heads, dim = SHAPES[name]
    return [torch.randn(1, kv_heads, keys + 64, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2)]


def attention_call(name: str, n: int, s: int, cache: List[torch.Tensor], gen: torch.Generator,
                   num_splits: int = 0) -> Callable[[], None]:
    """One gqa_attention call of the shape over S keys of the cache, for N query rows in the verify's memory order
    with a mask 90 % true (key 0 always)."""
    heads, _, dim = SHAPES[name]
    q = torch.randn(1, n, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    mask = torch.rand(1, 1, n, s, device="cuda", generator=gen) < 0.9
    mask[..., 0] = True
    out = torch.empty(1, heads, n, dim, device="cuda", dtype=torch.bfloat16)
    k, v = cache[0][:, :, :s], cache[1][:, :, :s]
    return lambda: ops.gqa_attention(q, k, v, mask, dim**-0.5, out=out, num_splits=num_splits)


SPLIT_COUNTS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)


def sweep_splits(args) -> None:
    """For each (shape, N, S): us per call of the op's choice (timed first and last: their spread is the noise) and of
    each number of splits that runs (num_splits n takes ceil(chunks / n) 64-key chunks a split, so distinct n can run
    the same split: each split count is timed once)."""
    import json

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in args.shapes:
        cache = key_cache(name, max(args.keys), gen)
        for n in args.nodes:
            for s in args.keys:
                chunks = -(-s // 64)
                first = time_per_call(attention_call(name, n, s, cache, gen))
                forced = {}
                for want in sorted({w for w in SPLIT_COUNTS if w < chunks} | {chunks}):
                    runs = -(-chunks // -(-chunks // want))
                    if runs not in forced:
                        forced[runs] = time_per_call(attention_call(name, n, s, cache, gen, num_splits=want))
                last = time_per_call(attention_call(name, n, s, cache, gen))
                best = min(forced, key=forced.get)
                rows.append(dict(shape=name, n=n, s=s, chunks=chunks, choice_us=[first, last], forced_us=forced))
                print(f"{name} N={n} S={s}: choice {first:.2f}/{last:.2f}  best {forced[best]:.2f} ({best} splits)  "
                      + " ".join(f"{r}:{t:.2f}" for r, t in forced.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
