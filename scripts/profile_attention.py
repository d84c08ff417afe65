"""Times gqa_attention (with its split combine) per call at the benchmark presets' attention shapes.

    python scripts/profile_attention.py                         # 27B and Qwen3-8B, N 1 17 65, S 528..768 2048 4096
    python scripts/profile_attention.py --shapes 27b --nodes 17 --keys 528 576 624

us per call: 20 calls captured in a CUDA graph (benchmarks/test_bench_cuda.py's helpers), the median of 9 replays after
3 warm-up replays; bf16, q in the verify's [B, N, H, D] memory order, K and V sliced from a larger cache, masks 90 %
true. Each (shape, N) sweeps its key counts up and then down, so that a drift of the machine shows as a disagreement
of the two passes.
"""
import argparse
import os
import statistics
import sys

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
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes:
        heads, kv_heads, dim = SHAPES[name]
        cache = [torch.randn(1, kv_heads, max(args.keys) + 64, dim, device="cuda", dtype=torch.bfloat16,
                             generator=gen) for _ in range(2)]
        for n in args.nodes:
            times = {s: [] for s in args.keys}
            for keys in (args.keys, args.keys[::-1]):
                for s in keys:
                    q = torch.randn(1, n, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                    q = q.transpose(1, 2)
                    mask = torch.rand(1, 1, n, s, device="cuda", generator=gen) < 0.9
                    mask[..., 0] = True
                    out = torch.empty(1, heads, n, dim, device="cuda", dtype=torch.bfloat16)
                    k, v = cache[0][:, :, :s], cache[1][:, :, :s]
                    times[s].append(time_per_call(lambda: ops.gqa_attention(q, k, v, mask, dim**-0.5, out=out)))
            print(f"{name} N={n}: " + "  ".join(f"S={s} {statistics.mean(t):.2f} ({t[0]:.2f}/{t[1]:.2f})"
                                               for s, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
