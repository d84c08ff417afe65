"""Runs tree_gated_delta_rule at Qwen3.6-27B shapes for Nsight Compute (or a quick timing without it).

    ncu --clock-control none --set full --import-source yes --profile-from-start off -o gdn \
        python scripts/profile_gdn.py --nodes 65
    python scripts/profile_gdn.py --nodes 1 17 65 129 257 --time

The profiled region (cudaProfilerStart/Stop) holds one call per node count, after warm-up calls; --time
prints the median of graph-replayed calls instead (48 layers' inputs, rotated so they do not sit in L2).
"""
import argparse

import torch

from ddtree_ext import ops

H, HV, KD, VD, LAYERS = 16, 48, 128, 128, 48


def layer_inputs(n: int, gen: torch.Generator):
    dev = "cuda"
    bf16 = dict(dtype=torch.bfloat16, device=dev)
    # A spine of up to 16 nodes, the rest hung under random earlier nodes of depth < 15: build_tree's shape.
    par, depth = [-1], [0]
    for i in range(1, n):
        if i < 16:
            par.append(i - 1)
        else:
            choices = [j for j in range(i) if depth[j] < 15]
            par.append(choices[int(torch.randint(0, len(choices), (1,), generator=gen))])
        depth.append(depth[par[-1]] + 1)
    parent = torch.tensor([par], dtype=torch.int32, device=dev)
    q = torch.randn(1, n, H, KD, **bf16)
    k = torch.randn(1, n, H, KD, **bf16)
    v = torch.randn(1, n, HV, VD, **bf16)
    g = -torch.rand(1, n, HV, device=dev)
    beta = torch.rand(1, n, HV, device=dev)
    state = torch.randn(1, HV, KD, VD, device=dev) * 0.1
    out = ops.GDNTreeOutput(torch.empty(1, n, HV, VD, **bf16), torch.empty(1, n, HV, VD, device=dev),
                            torch.empty(1, n, H, KD, device=dev), torch.empty(1, n, HV, device=dev))
    return (q, k, v, g, beta, state, parent), out


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
