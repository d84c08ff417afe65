"""Runs tree_gated_delta_rule at Qwen3.6-27B shapes for Nsight Compute (or a quick timing without it).

    ncu --clock-control none --set full --import-source yes --profile-from-start off -o gdn \
        python scripts/profile_gdn.py --nodes 65
    python scripts/profile_gdn.py --nodes 1 17 65 129 257 --time

The profiled region (cudaProfilerStart/Stop) holds one call per node count, after warm-up calls; --time
prints the median of graph-replayed calls instead (48 layers' inputs, rotated so they do not sit in L2).
"""
import argparse
import os
import sys

import torch

from ddtree_ext import ops

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from test_bench_cuda import GDN_LAYERS as LAYERS, gdn_layer_inputs  # noqa: E402


def layer_inputs(n: int, gen: torch.Generator):
    """The benchmark's inputs of one layer, with a tree of N nodes: a spine of up to 16 nodes, the rest hung
    under random earlier nodes of depth < 15 (build_tree's shape)."""
    par, depth = [-1], [0]
    for i in range(1, n):
        if i < 16:
            par.append(i - 1)
        else:
            choices = [j for j in range(i) if depth[j] < 15]
            par.append(choices[int(torch.randint(0, len(choices), (1,), generator=gen))])
        depth.append(depth[par[-1]] + 1)
    parent = torch.tensor([par], dtype=torch.int32, device="cuda")
    *inputs, out = gdn_layer_inputs(n)
    return (*inputs, parent), out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, nargs="+", default=[65])
    p.add_argument("--time", action="store_true")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    for n in args.nodes:
        layers = [layer_inputs(n, gen) for _ in range(LAYERS if args.time else 2)]
        call = lambda l: ops.tree_gated_delta_rule(*l[0][:6], l[0][6], out=l[1])  # noqa: E731
        for l in layers:
            call(l)
        torch.cuda.synchronize()
        if not args.time:
            torch.cuda.cudart().cudaProfilerStart()
            call(layers[0])
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            continue
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for l in layers:
                call(l)
        times = []
        for _ in range(30):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / len(layers))
        times.sort()
        print(f"N={n}: median {times[len(times) // 2]:.1f} us per layer")


if __name__ == "__main__":
    main()
