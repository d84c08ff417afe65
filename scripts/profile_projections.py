"""Times a layer's input projections as the fused forwards run them against one GEMM over their stacked weights.

    python scripts/profile_projections.py --rows 1 16 65

For each group (the 27B GDN layer's qkv and z, its attention layer's q, k and v, its MLP's gate and up, and the
Qwen3-8B attention and MLP) it prints the median per-layer time of graph-replayed layers, weights rotated over
>= 400 MB so they stream from memory:
- "apart": the projections as the fused forwards issue them (z, k and v on the side stream beside qkv / q; the
  MLP's two one after another);
- "stacked": one F.linear over the concatenated weight;
- the floor: weight bytes / the device copy rate measured here.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from e2e import copy_bandwidth  # noqa: E402
from test_bench_cuda import _captured, _median_event_ms  # noqa: E402

# name -> (K, [N of the main-stream projection, N of each side-stream projection...], side stream used)
GROUPS = {
    "27b gdn qkv+z": (5120, [10240, 6144], True),
    "27b attn q+k+v": (5120, [12288, 1024, 1024], True),
    "27b mlp gate+up": (5120, [17408, 17408], False),
    "8b attn q+k+v": (4096, [4096, 1024, 1024], True),
    "8b mlp gate+up": (4096, [12288, 12288], False),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 65])
    args = p.parse_args()
    rate = copy_bandwidth()
    print(f"copy rate {rate / 1e9:.0f} GB/s (read + write)")
    side = torch.cuda.Stream()
    for name, (k, widths, use_side) in GROUPS.items():
        n = sum(widths)
        copies = max(2, -(-400_000_000 // (2 * n * k)))
        stacked = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        parts = [list(torch.split(w, widths)) for w in stacked]
        parts = [[t.contiguous() for t in ws] for ws in parts]  # separate allocations, as a model holds them
        floor_us = 2 * n * k / rate * 1e6
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)

            def apart(ws=None):
                main = torch.cuda.current_stream()
                if use_side:
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        outs = [torch.nn.functional.linear(x, w) for w in ws[1:]]
                    out = torch.nn.functional.linear(x, ws[0])
                    main.wait_stream(side)
                    return out, outs
                return [torch.nn.functional.linear(x, w) for w in ws]

            t_apart = _median_event_ms(_captured([lambda ws=ws: apart(ws) for ws in parts]).replay, 20) * 1e3 / copies
            t_stacked = _median_event_ms(
                _captured([lambda w=w: torch.nn.functional.linear(x, w) for w in stacked]).replay, 20) * 1e3 / copies
            print(f"{name:16s} rows {rows:3d} [{n}, {k}]: apart {t_apart:7.2f} us, stacked {t_stacked:7.2f} us, "
                  f"floor {floor_us:6.2f} us (apart {t_apart / floor_us:.2f} x, stacked {t_stacked / floor_us:.2f} x)")
        del stacked, parts
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
