"""End-to-end round timings on one GPU: python benchmarks/e2e.py [--preset 27b] [--target DIR --draft DIR]

Builds a target of a real model's shape (the transformers class from a config, random bf16 weights
initialised on the GPU) and a DFlash-shaped draft, or loads real checkpoints, and measures in one run,
medians over the replayed rounds after warm-up:

* the weight-read floor of one target forward (bytes of weights read / measured device copy rate);
* a stock Hugging Face eager decode step (DynamicCache, one token);
* our autoregressive step, DFlash chain round and DDTree rounds at several budgets, each replayed from
  CUDA graphs and eagerly, with a per-stage breakdown (draft, build, verify, walk, commit);
* on pure-attention shapes, the public DDTree reference implementation's round pattern (HF forward
  with a 4D mask over a DynamicCache, top-K and the walk on the host with a Python heap, per-layer
  index_select compaction), re-created here and timed in the same run;
* tokens/s = tau / round time, for the measured tau (random weights accept almost nothing) and,
  labelled as a projection, for tau in {3, 5, 7, 9};
* for the 27b and qwen3-8b presets, each of issue #5's targets (TARGETS) against the graph rounds: met, or
  missed by how much.

Writes ``<out>/<date>-<gpu>-e2e-<preset>.json`` and ``.md``. Needs a CUDA GPU. The report names the git
commit of the working tree, or ``DDTREE_COMMIT`` when set (for a copy of the tree whose .git is stale).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import heapq
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from typing import List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ddtree_ext  # noqa: E402
from ddtree_ext import fused, gemm_tuning, generate  # noqa: E402
from ddtree_ext import target as target_module  # noqa: E402
from ddtree_ext import round as round_module  # noqa: E402
from ddtree_ext._loader import load_extension  # noqa: E402
from ddtree_ext.draft import DFlashDraftModel  # noqa: E402
from ddtree_ext.generate import _use_graphs  # noqa: E402
from ddtree_ext.target import TargetAdapter, record_layer_outputs  # noqa: E402
from ddtree_ext.tiny import tiny_draft_config  # noqa: E402

LIN, FULL = "linear_attention", "full_attention"


def _qwen3_5(hidden: int, intermediate: int, layers: int, heads: int, value_heads: int, taps: list) -> dict:
    """A Qwen3.5 / 3.6 dense text shape ([GDN x 3, attention] x layers/4; attention 4 KV heads of 256, GDN
    16 key heads of 128) and its DFlash draft (5 layers, the target's MLP width)."""
    return dict(
        family="qwen3_5",
        target=dict(
            vocab_size=248320, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
            layer_types=[LIN, LIN, LIN, FULL] * (layers // 4), num_attention_heads=heads, num_key_value_heads=4,
            head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_num_key_heads=16, linear_num_value_heads=value_heads,
        ),
        draft=dict(num_layers=5, intermediate_size=intermediate, taps=taps, mask_token_id=248070),
    )


# Target shapes (text configs) and their DFlash drafts' shapes. 27b = Qwen3.6-27B / Qwen3.5-27B.
PRESETS = {
    "27b": _qwen3_5(5120, 17408, 64, 24, 48, [1, 16, 31, 46, 61]),
    "9b": _qwen3_5(4096, 12288, 32, 16, 32, [1, 8, 15, 22, 29]),
    "4b": _qwen3_5(2560, 9216, 32, 16, 32, [1, 8, 15, 22, 29]),
    # Qwen3.6-35B-A3B / Qwen3.5-35B-A3B: 40 layers of 2048, 256 routed experts of 512 (8 a token) and a shared
    # expert of 512 per layer, attention 16 / 2 heads of 256, GDN 16 / 32 heads of 128. Its draft's shape is assumed
    # (the dense drafts' 5 layers, an MLP of 6144).
    "35b-a3b": dict(
        family="qwen3_5_moe",
        target=dict(
            vocab_size=248320, hidden_size=2048, num_hidden_layers=40, layer_types=[LIN, LIN, LIN, FULL] * 10,
            num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        ),
        draft=dict(num_layers=5, intermediate_size=6144, taps=[1, 10, 19, 28, 37], mask_token_id=248070),
    ),
    "qwen3-8b": dict(
        family="qwen3",
        target=dict(
            vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        ),
        draft=dict(num_layers=5, intermediate_size=12288, taps=[1, 9, 17, 25, 33], mask_token_id=151669),
    ),
}
TAUS = (3, 5, 7, 9)

# Issue #5's targets, by preset (graph rounds): (label, what is measured, bound). Measures: "ar_x_floor" the
# captured autoregressive step over the floor; "ddtree64_x_floor" the budget-64 round over the floor;
# "ddtree64_x_chain" the budget-64 round over the DFlash chain round; "ddtree64_ms" the budget-64 round in ms;
# "tree_ops_share" build + walk + commit over the budget-64 round; "fits_gpu" the run's peak plus the static
# buffers for the maximum length, over the GPU's memory.
TARGETS = {
    "27b": [
        ("captured AR step <= 1.15 x floor", "ar_x_floor", 1.15),
        ("DDTree round, budget 64 <= 1.3 x floor", "ddtree64_x_floor", 1.3),
        ("DDTree 64 round <= 1.05 x DFlash chain round", "ddtree64_x_chain", 1.05),
        ("tree ops (build + walk + commit) <= 3 % of the budget-64 round", "tree_ops_share", 0.03),
        ("peak + static buffers at the maximum length fit the GPU", "fits_gpu", 1.0),
    ],
    "qwen3-8b": [
        ("DDTree round, budget 64 <= 6.5 ms", "ddtree64_ms", 6.5),
        ("tree ops (build + walk + commit) <= 3 % of the budget-64 round", "tree_ops_share", 0.03),
    ],
}


# ---- models -------------------------------------------------------------------------------------


def build_target(preset: dict, dtype=torch.bfloat16):
    """The preset's target class from its config, random weights initialised on the GPU."""
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    common = dict(max_position_embeddings=262144, tie_word_embeddings=False, attn_implementation="sdpa",
                  initializer_range=0.02)
    if preset["family"] in ("qwen3_5", "qwen3_5_moe"):
        prefix = "Qwen3_5Moe" if preset["family"] == "qwen3_5_moe" else "Qwen3_5"
        config = getattr(transformers, prefix + "TextConfig")(
            **preset["target"], **common,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                             "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        )
        cls = getattr(transformers, prefix + "ForCausalLM")
    else:
        config = Qwen3Config(**preset["target"], **common, rope_theta=1e6)
        cls = Qwen3ForCausalLM
    with torch.device("cuda"):
        model = cls._from_config(config, dtype=dtype)
    return model.eval()


def build_draft(target, preset: dict, dtype=torch.bfloat16) -> DFlashDraftModel:
    """A DFlash-shaped draft (sliding-window layers then one full layer, 32/8 heads of 128, block 16),
    random weights on the GPU."""
    d = preset["draft"]
    config = tiny_draft_config(
        target.config, num_layers=d["num_layers"], block_size=16, target_layer_ids=d["taps"], sliding_window=2048,
        intermediate_size=d["intermediate_size"], num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=262144, rope_theta=1e7,
    )
    config.dflash_config["mask_token_id"] = d["mask_token_id"]
    with torch.device("cuda"):
        draft = DFlashDraftModel(config).to(dtype)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return draft.eval()


def weight_bytes_read(adapter: TargetAdapter, rows: int = 1) -> int:
    """Bytes of weights one text forward over ``rows`` tokens reads: the text model's parameters but the input
    embedding table (one row per token), plus the LM head (a vision tower, if any, is not read for text).

    A sparse-MoE layer's routed experts count for the experts its rows reach, expected under uniform routing (each
    row picks top_k of E experts): E * (1 - (1 - top_k / E) ** rows) of them; one row reads exactly its top_k."""
    embed = adapter.embed_tokens.weight
    blocks = [layer.mlp for layer in adapter.text_model.layers if hasattr(layer.mlp, "experts")]
    routed = {id(p) for block in blocks for p in block.experts.parameters()}
    params = {id(p): p for m in (adapter.text_model, adapter.lm_head) for p in m.parameters() if p is not embed}
    total = sum(p.numel() * p.element_size() for key, p in params.items() if key not in routed)
    for block in blocks:
        share = 1.0 - (1.0 - block.gate.top_k / block.experts.num_experts) ** rows
        total += share * sum(p.numel() * p.element_size() for p in block.experts.parameters())
    return int(total)


def graphs_possible(adapter: TargetAdapter) -> bool:
    """Whether generate() takes cuda_graph=True for this target (one CUDA device; MoE experts it can capture)."""
    try:
        return _use_graphs(True, adapter)
    except ValueError:
        return False


# ---- timing helpers ---------------------------------------------------------------------------


def median_ms(values: List[float]) -> float:
    return 1e3 * statistics.median(values) if values else float("nan")


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device copy rate in bytes/s, counting bytes read plus written (median over reps)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 3):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times[3:])


def cache_kwarg(model) -> str:
    text = model.model
    return "cache" if "cache" in inspect.signature(text.forward).parameters else "past_key_values"


@torch.inference_mode()
def hf_decode_step_ms(model, prompt, steps: int) -> float:
    """Stock HF eager: one-token forwards on a DynamicCache after the prompt (median, synced)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    kw = cache_kwarg(model)
    out = model(input_ids=prompt, use_cache=True, **{kw: cache})
    token = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps + 3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model(input_ids=token, use_cache=True, **{kw: cache})
        token = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return median_ms(times[3:])


def measure_generate(target, draft, prompt, *, method, budget, graphs: bool, rounds: int,
                     sampling: dict | None = None) -> dict:
    """One generate() run; medians over its replayed rounds (graphs) or its rounds after 3 (eager), in steady state
    (the rounds of a generation but its first and last few). sampling: temperature, top_k and top_p for a sampled
    run (seed 0), None for greedy."""
    # Random weights accept about one token a round; the rounds in the last block_size tokens are not launched
    # ahead (one of them could end the generation), so they come on top.
    new_tokens = (rounds + 13 if graphs else rounds + 4) + draft.block_size
    draws = dict(sampling, seed=0) if sampling else {}
    # eos_token_id=[]: every run its full length, also for a checkpoint whose generation_config names an EOS.
    _, stats = generate(target, draft, prompt, new_tokens, method=method, tree_budget=budget, cuda_graph=graphs,
                        eos_token_id=[], return_stats=True, **draws)
    # Steady state: round r launched ahead of round r - 1's read and round r + 1 ahead of r's, so that the time
    # between r - 1's result and r's holds one launch (r + 1's: a replay too, for graph rounds) and one round on the
    # device.
    ahead = stats.round_launched_ahead
    steady = [r for r in range(stats.rounds - 1) if ahead[r] and ahead[r + 1]]
    replayed = stats.round_replayed
    picked = [r for r in steady if replayed[r] and replayed[r + 1]] if graphs else [r for r in steady if r >= 3]
    stages = {}
    for stage in ("draft", "build", "verify", "walk", "commit"):
        values = [stats.round_stage_s[r].get(stage) for r in picked if stage in stats.round_stage_s[r]]
        if values:
            stages[stage] = median_ms(values)
    return dict(
        method=method, budget=budget if method == "ddtree" else stats.tree_budget, graphs=graphs,
        rounds_measured=len(picked), round_ms=median_ms([stats.round_time_s[r] for r in picked]),
        stage_ms=stages, tau=statistics.mean(stats.accept_lengths[r] for r in picked) if picked else float("nan"),
        captures=stats.graph_captures, capture_s=stats.graph_capture_s, sampling=sampling,
    )


def parse_sampling(text: str) -> dict:
    """--sample's value, "temperature,top_k,top_p" (top_k 0 = off, top_p 1 = off)."""
    parts = text.split(",")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"--sample takes temperature,top_k,top_p, got {text!r}")
    try:
        temperature, top_k, top_p = float(parts[0]), int(parts[1]), float(parts[2])
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--sample takes temperature,top_k,top_p, got {text!r}") from err
    if temperature <= 0:
        raise argparse.ArgumentTypeError(f"--sample's temperature must be > 0 (greedy rounds run anyway), got {text!r}")
    return dict(temperature=temperature, top_k=top_k, top_p=top_p)


def sampling_label(sampling: dict | None) -> str:
    """How a run's sampling shows in the report: empty for greedy."""
    if not sampling:
        return ""
    return f" (T {sampling['temperature']:g}, top_k {sampling['top_k']}, top_p {sampling['top_p']:g})"


# ---- the public reference implementation's round pattern ---------------------------------------


@torch.inference_mode()
def reference_round_pattern_ms(adapter: TargetAdapter, draft, prompt, budget: int, rounds: int) -> float:
    """A round as the public DDTree reference implementation runs it, on a pure-attention target:
    draft forward; log-softmax + top-K on the GPU, copied to the host; best-first tree build with a
    Python heap; the 4D mask built on the host and copied over; ONE stock HF forward over the tree with
    the mask on a DynamicCache; argmax copied to the host and walked in Python; the accepted rows kept
    by index_select per layer and the cache cut back. Returns the median round time in ms."""
    from transformers import DynamicCache

    model = adapter.model
    kw = cache_kwarg(model)
    cache = DynamicCache(config=model.config)
    taps_ids = draft.target_layer_ids
    with record_layer_outputs(adapter.text_model.layers, taps_ids) as rec:
        out = model(input_ids=prompt, use_cache=True, **{kw: cache})
    context = torch.cat([rec[i] for i in taps_ids], dim=-1)
    root = out.logits[:, -1].argmax(-1)
    prefix = prompt.shape[1]
    dcache = draft.new_cache(1, capacity=prefix + 64 * rounds + 64)
    k = 8
    device = adapter.device
    times = []
    for _ in range(rounds + 3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        logits = draft.propose(context, root, dcache, embed_tokens=adapter.embed_tokens, lm_head=adapter.lm_head)
        top = torch.log_softmax(logits[0].float(), -1).topk(k, dim=-1)
        logp, tokens = top.values.cpu().tolist(), top.indices.cpu().tolist()
        # Best-first over (score, parent, depth, rank) with heapq, as the reference does.
        nodes = [(-1, 0, int(root))]  # (parent, depth, token)
        heap = [(-logp[0][0], 0, 0, 0)]
        scores = [0.0]
        while heap and len(nodes) < budget + 1:
            neg, parent, depth, rank = heapq.heappop(heap)
            nodes.append((parent, depth + 1, tokens[depth][rank]))
            scores.append(-neg)
            me = len(nodes) - 1
            if rank + 1 < k:
                heapq.heappush(heap, (-(scores[parent] + logp[depth][rank + 1]), parent, depth, rank + 1))
            if depth + 1 < len(logp):
                heapq.heappush(heap, (-(scores[me] + logp[depth + 1][0]), me, depth + 1, 0))
        n = len(nodes)
        visible = [[False] * n for _ in range(n)]
        for i, (parent, _, _) in enumerate(nodes):
            visible[i][i] = True
            j = parent
            while j >= 0:
                visible[i][j] = True
                j = nodes[j][0]
        tree_mask = torch.tensor(visible, device=device)
        mask = torch.cat([torch.ones(n, prefix, dtype=torch.bool, device=device), tree_mask], dim=1)[None, None]
        ids = torch.tensor([[tok for _, _, tok in nodes]], device=device)
        pos = torch.tensor([[prefix + d for _, d, _ in nodes]], device=device)
        with record_layer_outputs(adapter.text_model.layers, taps_ids) as rec:
            out = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True, **{kw: cache})
        target_tokens = out.logits[0].argmax(-1).cpu().tolist()
        path, node = [0], 0
        while True:
            children = [c for c in range(1, n) if nodes[c][0] == node and nodes[c][2] == target_tokens[node]]
            if not children:
                break
            node = children[0]
            path.append(node)
        keep = torch.tensor(list(range(prefix)) + [prefix + p for p in path], device=device)
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(2, keep)
            layer.values = layer.values.index_select(2, keep)
        context = torch.cat([rec[i] for i in taps_ids], dim=-1)[:, path]
        root = torch.tensor([target_tokens[path[-1]]], device=device)
        prefix += len(path)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return median_ms(times[3:])


# ---- profile ------------------------------------------------------------------------------------


class _ProfileRounds:
    """A streamer that starts a torch profiler when the first new token arrives (after the prefill,
    before the first round), so the profile holds rounds only."""

    def __init__(self, profiler):
        self.profiler, self.calls = profiler, 0

    def put(self, value):
        self.calls += 1
        if self.calls == 2:  # 1: the prompt; 2: the prefill's token
            torch.cuda.synchronize()
            self.profiler.start()

    def end(self):
        torch.cuda.synchronize()
        self.profiler.stop()


def profile_round(target, draft, prompt, method: str, budget: int, rounds: int = 4, top: int = 15) -> dict:
    """Kernels of ``rounds`` eager rounds (torch profiler, prefill excluded): per round the kernel count and
    CUDA time, and the top kernels by CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    kw = dict(method=method, tree_budget=budget, cuda_graph=False, eos_token_id=[])  # no EOS stop: every round
    generate(target, draft, prompt, rounds, **kw)  # warm-up
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    generate(target, draft, prompt, rounds + 1, streamer=_ProfileRounds(prof), **kw)
    rows, averages = [], prof.key_averages()
    # Host-side ops that launch kernels themselves (self device time): which torch calls the small kernels come from.
    launching = sorted((e for e in averages if e.device_type != torch.autograd.DeviceType.CUDA
                        and e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)
    ops = [dict(name=e.key[:90], calls=e.count, self_cuda_ms=e.self_device_time_total / 1e3) for e in launching[:top]]
    events = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]
    total = sum(e.device_time_total for e in events) or 1.0
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        rows.append(dict(name=e.key[:90], calls=e.count, cuda_ms=e.device_time_total / 1e3,
                         share=e.device_time_total / total))
    return dict(method=method, budget=budget, rounds=rounds, top=rows, ops=ops,
                kernels_per_round=sum(e.count for e in events) / rounds, cuda_ms_per_round=total / 1e3 / rounds)


# ---- main -------------------------------------------------------------------------------------


def load_checkpoints(target_path: str, draft_path: str):
    """A real target (the multimodal class when the checkpoint is one, e.g. Qwen3.6-27B) and its draft."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    architectures = AutoConfig.from_pretrained(target_path).architectures or []
    cls = AutoModelForImageTextToText if any("ConditionalGeneration" in a for a in architectures) else AutoModelForCausalLM
    target = cls.from_pretrained(target_path, dtype=torch.bfloat16, device_map="cuda", attn_implementation="sdpa")
    draft = DFlashDraftModel.from_pretrained(draft_path, dtype=torch.bfloat16, device="cuda")
    return target.eval(), draft


def run_preset(name: str, args, bandwidth: float) -> dict:
    torch.cuda.reset_peak_memory_stats()
    gemm_tuning.reset()  # each preset's picks timed and reported on their own
    start = time.perf_counter()
    if args.target:
        target, draft = load_checkpoints(args.target, args.draft)
    else:
        target = build_target(PRESETS[name])
        draft = build_draft(target, PRESETS[name])
    if not args.no_stacked_projections:
        ddtree_ext.stack_projections(target)
        ddtree_ext.stack_projections(draft)
    adapter = TargetAdapter(target, draft.target_layer_ids)
    build_s = time.perf_counter() - start
    vocab = adapter.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(0)).cuda()
    floor_bytes = weight_bytes_read(adapter)
    floor_ms = 1e3 * floor_bytes / bandwidth
    family = "qwen3_5_moe" if adapter.is_moe else "qwen3_5" if adapter.is_hybrid else "qwen3"
    result = dict(preset=name, family=family, build_s=build_s, weight_bytes=floor_bytes,
                  floor_ms=floor_ms, prompt_len=args.prompt_len, runs=[])
    print(f"[{name}] built in {build_s:.1f} s; weights read per forward {floor_bytes / 1e9:.2f} GB, "
          f"floor {floor_ms:.2f} ms", flush=True)

    result["hf_decode_step_ms"] = hf_decode_step_ms(target, prompt, args.hf_steps)
    print(f"[{name}] stock HF eager decode step {result['hf_decode_step_ms']:.2f} ms", flush=True)

    plans = [("autoregressive", 0), ("dflash", 0)] + [("ddtree", b) for b in args.budgets]
    # Graph rounds wherever generate() can replay them (not for a MoE target whose experts forward reads the host).
    paths = (True, False) if graphs_possible(adapter) else (False,)
    for method, budget in plans:
        for graphs in paths:
            rounds = args.rounds if graphs else args.eager_rounds
            run = measure_generate(adapter, draft, prompt, method=method, budget=max(budget, 1), graphs=graphs,
                                   rounds=rounds)
            if adapter.is_moe:  # the experts a round reads depend on its rows: the tree's nodes
                run["weight_bytes"] = weight_bytes_read(adapter, run["budget"] + 1)
            result["runs"].append(run)
            stages = ", ".join(f"{s} {t:.2f}" for s, t in run["stage_ms"].items())
            print(f"[{name}] {method} budget {run['budget']} {'graphs' if graphs else 'eager '}: "
                  f"{run['round_ms']:.2f} ms/round over {run['rounds_measured']} rounds (tau {run['tau']:.2f}); "
                  f"stages ms: {stages}", flush=True)
    # Sampled rounds, graphs only: the autoregressive step and the tree round at budget 64 (else the largest).
    tree_budget = 64 if 64 in args.budgets else max(args.budgets)
    samplings = (args.sample or []) if True in paths else []  # the sampled runs time graph rounds
    for sampling in samplings:
        for method, budget in (("autoregressive", 1), ("ddtree", tree_budget)):
            run = measure_generate(adapter, draft, prompt, method=method, budget=budget, graphs=True,
                                   rounds=args.rounds, sampling=sampling)
            result["runs"].append(run)
            print(f"[{name}] {method}{sampling_label(sampling)} budget {run['budget']} graphs: "
                  f"{run['round_ms']:.2f} ms/round over {run['rounds_measured']} rounds; walk "
                  f"{run['stage_ms'].get('walk', float('nan')):.3f} ms", flush=True)

    if family == "qwen3":
        result["reference_round_ms"] = {}
        for budget in (64, 256):  # outside rounds: its GEMMs are cuBLAS's own picks (gemm_tuning.round_shapes)
            ms = reference_round_pattern_ms(adapter, draft, prompt, budget, args.eager_rounds)
            result["reference_round_ms"][budget] = ms
            print(f"[{name}] reference implementation's round pattern, budget {budget}: {ms:.2f} ms", flush=True)
    if args.profile:
        result["profiles"] = [profile_round(adapter, draft, prompt, "autoregressive", 1, top=args.profile_top),
                              profile_round(adapter, draft, prompt, "ddtree", 64, top=args.profile_top)]

    # Static buffers for a 32k-token generation (the target's caches and the draft's), measured by
    # allocating them; the run's own peak used a capacity of prompt + a few hundred slots.
    before = torch.cuda.memory_allocated()
    state = adapter.new_state(1, capacity=args.max_length)
    draft_cache = draft.new_cache(1, capacity=args.max_length)
    result["static_buffers_max_length_gb"] = (torch.cuda.memory_allocated() - before) / 1e9
    del state, draft_cache
    result["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    result["max_length"] = args.max_length
    print(f"[{name}] peak memory {result['peak_memory_gb']:.1f} GB; static buffers at {args.max_length} tokens "
          f"{result['static_buffers_max_length_gb']:.2f} GB", flush=True)
    if gemm_tuning.enabled:
        result["gemm_picks"] = gemm_tuning.picks()
    del adapter, target, draft
    torch.cuda.empty_cache()
    return result


def _graph_run(res: dict, method: str, budget: int | None = None) -> dict | None:
    for run in res["runs"]:
        if (run["graphs"] and run["method"] == method and (budget is None or run["budget"] == budget)
                and not run.get("sampling")):  # the targets are greedy rounds'
            return run
    return None


def target_measure(res: dict, what: str, gpu_memory_gb: float | None) -> float | None:
    """The value a TARGETS entry bounds, from one preset's results; None when the run lacks it."""
    ar, chain, tree = _graph_run(res, "autoregressive"), _graph_run(res, "dflash"), _graph_run(res, "ddtree", 64)
    if what == "ar_x_floor":
        return ar and ar["round_ms"] / res["floor_ms"]
    if what == "ddtree64_x_floor":
        return tree and tree["round_ms"] / res["floor_ms"]
    if what == "ddtree64_x_chain":
        return tree and chain and tree["round_ms"] / chain["round_ms"]
    if what == "ddtree64_ms":
        return tree and tree["round_ms"]
    if what == "tree_ops_share":
        return tree and sum(tree["stage_ms"].get(s, 0.0) for s in ("build", "walk", "commit")) / tree["round_ms"]
    if what == "fits_gpu":
        if not gpu_memory_gb:
            return None
        return (res["peak_memory_gb"] + res["static_buffers_max_length_gb"]) / gpu_memory_gb
    raise ValueError(f"unknown target measure {what!r}")


def target_rows(res: dict, gpu_memory_gb: float | None) -> List[str]:
    """Markdown rows (label | measured | verdict) for the preset's issue #5 targets."""
    rows = []
    for label, what, bound in TARGETS.get(res["preset"], []):
        value = target_measure(res, what, gpu_memory_gb)
        if value is None:
            continue
        shown = (f"{100 * value:.1f} %" if what == "tree_ops_share" else f"{value:.2f} ms" if what == "ddtree64_ms"
                 else f"{100 * value:.0f} % of the GPU's memory" if what == "fits_gpu" else f"{value:.2f} x")
        verdict = "met" if value <= bound else f"missed by {value / bound:.2f} x"
        rows.append(f"| {label} | {shown} | {verdict} |")
    return rows


def markdown(report: dict) -> str:
    moe_experts = report.get("moe_experts", "HF's experts forward")
    pdl = {True: "yes", False: "no (DDTREE_NO_PDL=1, or not a Hopper GPU and build)"}.get(
        report.get("programmatic_launches"), "not recorded")
    lines = [
        f"# End-to-end rounds on {report['gpu']} ({report['date']})",
        "",
        f"- Commit `{report['commit']}`; torch {report['torch']}, transformers {report['transformers']}, "
        f"fla importable: {report['fla']}.",
        f"- Command: `{report['command']}`",
        f"- Projections: {report.get('projections', 'cuBLAS (F.linear)')}; residual adds: "
        f"{report.get('residual_adds', 'apart (torch add, then the norm)')}; GDN conv: "
        f"{report.get('gdn_conv', 'apart from the delta rule')}; attention K/V store: "
        f"{report.get('kv_store', 'a store_kv launch of its own')}; projections reading one input: "
        f"{'one GEMM over their stacked weights' if report.get('stacked_projections') else 'apart'}; "
        f"our kernels launched as programmatic dependents: "
        f"{pdl}; "
        f"sparse MoE experts (MoE targets): {moe_experts}; "
        f"graph edges into our kernels: "
        f"{'from the launch-order port' if report.get('launch_order_edges') else 'from the programmatic port'}; "
        f"the core built for CUDA architectures "
        f"{report.get('cuda_archs', 'unknown')}.",
        f"- Device copy rate {report['copy_gb_s']:.0f} GB/s (read + write), the highest of "
        f"{', '.join(f'{r:.0f}' for r in report.get('copy_gb_s_measured', [report['copy_gb_s']]))} measured in this "
        "run (at its start and after each preset). Floor = weight "
        "bytes one forward reads / that rate. Times are medians over rounds replayed from CUDA graphs (graphs) or "
        "over eager rounds after 3 warm-up rounds (eager), of the rounds in steady state (launched ahead of the "
        "round before, as the next one was); a round's time is host wall time from the round before's result to its "
        "own. Stage times are CUDA-event device times.",
        "- Random weights: the draft accepts almost nothing, so tau (measured) is about 1. tokens/s at tau 3..9 are "
        "PROJECTIONS (tau / round time), not measurements.",
        "",
    ]
    for res in report["presets"]:
        floor = res["floor_ms"]
        lines += [
            f"## {res['preset']} ({res['family']}), prompt {res['prompt_len']} tokens",
            "",
            f"Weights read per forward {res['weight_bytes'] / 1e9:.2f} GB, floor {floor:.2f} ms. Stock HF eager "
            f"decode step {res['hf_decode_step_ms']:.2f} ms ({res['hf_decode_step_ms'] / floor:.2f}x floor). "
            f"Peak memory {res['peak_memory_gb']:.1f} GB; static caches for {res['max_length']} tokens "
            f"{res['static_buffers_max_length_gb']:.2f} GB.",
            "",
            "| method | budget | path | ms / round | x floor | tau | tok/s measured | "
            + " | ".join(f"tok/s at tau {t} (proj.)" for t in TAUS)
            + " | draft | build | verify | walk | commit |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in TAUS) + " | ---: | ---: | ---: | ---: | ---: |",
        ]
        if any("floor_ms" in run for run in res["runs"]):
            lines += ["", "Sparse MoE: each run's x floor is over the weights its rows read, the routed experts counted "
                      "for the experts its budget + 1 rows are expected to reach under uniform routing (the header's "
                      "floor is one row's: its top_k experts per layer).", ""]
        for run in res["runs"]:
            ms = run["round_ms"]
            proj = " | ".join(
                "" if run["method"] == "autoregressive" else f"{1e3 * t / ms:.1f}" for t in TAUS
            )
            st = run["stage_ms"]
            stages = " | ".join(f"{st[s]:.3f}" if s in st else "" for s in ("draft", "build", "verify", "walk", "commit"))
            lines.append(
                f"| {run['method']}{sampling_label(run.get('sampling'))} | {run['budget']} | "
                f"{'graphs' if run['graphs'] else 'eager'} | {ms:.2f} | "
                f"{ms / run.get('floor_ms', floor):.2f} | {run['tau']:.2f} | {1e3 * run['tau'] / ms:.1f} | {proj} | {stages} |"
            )
        captured = [r for r in res["runs"] if r.get("captures") and "capture_s" in r]
        if captured:
            lines += ["", "Graph capture (host time, the wait for the device before each included; these runs time their "
                      "stages, so each width is captured twice, see ddtree_ext.round): " + "; ".join(
                f"{r['method']}{'' if r['method'] == 'autoregressive' else ' ' + str(r['budget'])} "
                f"{1e3 * r['capture_s'] / r['captures']:.0f} ms a width ({r['captures']} captured)" for r in captured) + "."]
        if "reference_round_ms" in res:
            lines += ["", "Reference implementation's round pattern (re-created here, eager, same run):", ""]
            for budget, ms in res["reference_round_ms"].items():
                lines.append(f"- budget {budget}: {ms:.2f} ms per round ({ms / floor:.2f}x floor)")
        targets = target_rows(res, report.get("gpu_memory_gb"))
        if targets:
            lines += ["", "Against the issue #5 targets (graph rounds; computed by this script):", "",
                      "| target | measured | verdict |", "| --- | --- | --- |"] + targets
        if res.get("gemm_picks"):
            tuning_s = sum(p.get("seconds", 0.0) for p in res["gemm_picks"])
            lines += ["", f"GEMM algorithms timed by `ddtree_ext.gemm_tuning` in this run, {tuning_s:.1f} s of timing "
                      "in all (us per call, weights rotated out of L2; floor = weight bytes / the copy rate):", "",
                      "| rows | N x K | candidates | torch matmul | pick | floor | pick / floor | the pick |",
                      "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
            for p in res["gemm_picks"]:
                floor_us = 1e6 * p["weight_bytes"] / (report["copy_gb_s"] * 1e9)
                lines.append(f"| {p['rows']} | {p['n']} x {p['k']} | {p['candidates']} | {p['matmul_us']:.1f} | "
                             f"{p['pick_us']:.1f} | {floor_us:.1f} | {p['pick_us'] / floor_us:.2f} | "
                             f"{'torch matmul' if p['pick'] is None else str(p['pick']) + ': ' + p['pick_description']} |")
        for prof in res.get("profiles", []):
            what = "autoregressive steps" if prof["method"] == "autoregressive" else f"DDTree rounds at budget {prof['budget']}"
            lines += ["", f"Top kernels by CUDA time over {prof['rounds']} eager {what}, prefill excluded (torch "
                      f"profiler; the kernels are those the graphs replay): {prof['kernels_per_round']:.0f} kernels and "
                      f"{prof['cuda_ms_per_round']:.2f} ms of CUDA time per round.", "",
                      "| kernel | calls | CUDA ms | share |", "| --- | ---: | ---: | ---: |"]
            for row in prof["top"]:
                lines.append(f"| `{row['name']}` | {row['calls']} | {row['cuda_ms']:.2f} | {100 * row['share']:.1f}% |")
            if prof.get("ops"):
                lines += ["", f"The torch ops that launch those kernels, by their kernels' CUDA time (same {what}):", "",
                          "| op | calls | CUDA ms |", "| --- | ---: | ---: |"]
                lines += [f"| `{row['name']}` | {row['calls']} | {row['self_cuda_ms']:.2f} |" for row in prof["ops"]]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS),
                        help="shape(s) to run (repeatable; default 27b and qwen3-8b)")
    parser.add_argument("--target", help="a real target checkpoint (directory or hub id) instead of a preset shape")
    parser.add_argument("--draft", help="its DFlash draft checkpoint (with --target)")
    parser.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 64, 128, 256])
    parser.add_argument("--rounds", type=int, default=30,
                        help="new tokens (+12) per graph measurement: about that many replayed rounds with random "
                             "weights, fewer with a real draft")
    parser.add_argument("--eager-rounds", type=int, default=10, help="measured rounds per eager measurement")
    parser.add_argument("--sample", action="append", type=parse_sampling, metavar="T,TOP_K,TOP_P",
                        help="also time sampled rounds (graphs; the AR step and the budget-64 tree round) with this "
                             "temperature, top_k (0 = off) and top_p (1 = off); repeatable, e.g. 0.6,20,0.95")
    parser.add_argument("--hf-steps", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-length", type=int, default=32768, help="the length the static caches are sized for")
    parser.add_argument("--side-streams", type=lambda s: [] if s == "none" else s.split(","),
                        default=sorted(fused.side_streams),
                        help="where layers overlap work on a second stream (ddtree_ext.fused.Fork): a comma list of "
                             "gdn, attn, draft, walk, or none")
    parser.add_argument("--linear", choices=["ops", "torch", "tuned"], default="tuned",
                        help="the bias-free projections of a round: per shape the fastest of F.linear and cuBLASLt's "
                             "candidates (ddtree_ext.gemm_tuning, timed in the warm-up rounds; the default), torch's "
                             "F.linear (cuBLAS's own picks, the library's default), or ops.linear (the "
                             "weight-streaming kernel), for A/B runs")
    parser.add_argument("--moe", choices=["block", "ops", "hf"], default="block",
                        help="a sparse MoE target's MoE blocks: the fused block (ops.moe_router, then ops.moe_experts "
                             "with the shared expert folded in: the library's default), HF's block body with its "
                             "routed experts through ops.moe_experts (ddtree_ext.fused.fuse_moe_block off), or HF's "
                             "block and experts forwards (ddtree_ext.fused.moe_experts_op off too), for A/B runs")
    parser.add_argument("--no-fused-adds", action="store_true",
                        help="run the decoder layers' residual adds apart from the norms after them, for A/B runs "
                             "(ddtree_ext.fused.fuse_residual_adds)")
    parser.add_argument("--no-fused-attention", action="store_true",
                        help="run the attention layers' q/k norms, RoPE and output gate as HF's body does (four "
                             "launches and a gate of three) instead of ops.qk_norm_rope and ops.sigmoid_mul "
                             "(ddtree_ext.fused.fuse_attention_heads), for A/B runs")
    parser.add_argument("--no-fused-kv-store", action="store_true",
                        help="store the attention layers' new K/V rows with a store_kv launch of their own instead of "
                             "from ops.qk_norm_rope_store_kv (ddtree_ext.fused.fuse_kv_store), for A/B runs")
    parser.add_argument("--no-fused-gdn-conv", action="store_true",
                        help="run a GDN layer's conv and delta rule as two ops (tree_conv1d, tree_gated_delta_rule) "
                             "instead of ops.gdn_conv_delta_rule (ddtree_ext.target.fuse_gdn_conv), for A/B runs")
    parser.add_argument("--no-launch-order-edges", action="store_true",
                        help="leave a captured round's programmatic edges where capture put them instead of moving them "
                             "to their upstream kernel's launch-order port (ddtree_ext.round.launch_order_edges, on by "
                             "default: our kernels launch while the GEMM ahead of them runs), for A/B runs")
    parser.add_argument("--no-stacked-projections", action="store_true",
                        help="keep each projection's weight apart (else ddtree_ext.stack_projections stacks those that "
                             "read the same input, one GEMM for each group), for A/B runs")
    parser.add_argument("--gemv", action="store_true",
                        help="with --linear tuned, add ops.linear_gemv to the single-row candidates "
                             "(gemm_tuning.gemv_candidate; off by default), for A/B runs")
    parser.add_argument("--profile", action="store_true", help="add the top kernels of eager rounds (torch profiler)")
    parser.add_argument("--profile-top", type=int, default=15, help="how many kernels each profile table lists")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    fused.side_streams = set(args.side_streams)
    fused.linear_kernel = args.linear == "ops"
    gemm_tuning.enabled = args.linear == "tuned"
    gemm_tuning.gemv_candidate = args.gemv
    fused.fuse_residual_adds = not args.no_fused_adds
    fused.moe_experts_op = args.moe in ("block", "ops")
    fused.fuse_moe_block = args.moe == "block"
    fused.fuse_attention_heads = not args.no_fused_attention
    fused.fuse_kv_store = not args.no_fused_kv_store
    target_module.fuse_gdn_conv = not args.no_fused_gdn_conv
    round_module.launch_order_edges = not args.no_launch_order_edges
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/e2e.py needs a CUDA GPU")
    if bool(args.target) != bool(args.draft):
        raise SystemExit("--target and --draft go together")
    presets = ["checkpoint"] if args.target else (args.preset or ["27b", "qwen3-8b"])

    import transformers

    try:
        import fla  # noqa: F401

        has_fla = True
    except ImportError:
        has_fla = False
    commit = os.environ.get("DDTREE_COMMIT") or _git_commit()
    bandwidth = copy_bandwidth()
    report = dict(
        date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), commit=commit,
        command="python benchmarks/e2e.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        torch=torch.__version__, transformers=transformers.__version__, fla=has_fla, copy_gb_s=bandwidth / 1e9,
        gpu_memory_gb=torch.cuda.get_device_properties(0).total_memory / 1e9, presets=[],
        projections=("ops.linear (the weight-streaming kernel)" if fused.linear_kernel else
                     "per shape the fastest of cuBLAS (F.linear) and cuBLASLt's candidates (gemm_tuning)"
                     + (", and ops.linear_gemv for single rows" if gemm_tuning.gemv_candidate else "")
                     if gemm_tuning.enabled else "cuBLAS (F.linear)"),
        residual_adds="fused into the next norm" if fused.fuse_residual_adds else "apart (torch add, then the norm)",
        moe_experts=("ops.moe_router, then ops.moe_experts with the shared expert folded in" if fused.fuse_moe_block
                     and fused.moe_experts_op else "HF's block body, its experts through ops.moe_experts"
                     if fused.moe_experts_op else "HF's experts forward (its experts_implementation)"),
        gdn_conv=("with the delta rule, one op (gdn_conv_delta_rule)" if target_module.fuse_gdn_conv
                  else "apart from the delta rule (tree_conv1d, then tree_gated_delta_rule)"),
        stacked_projections=not args.no_stacked_projections,
        launch_order_edges=round_module.launch_order_edges,
        kv_store=("with the q/k norms and RoPE, one op (qk_norm_rope_store_kv)" if fused.fuse_kv_store
                  else "a store_kv launch of its own"),
        cuda_archs=ddtree_ext.build_info().get("cuda_archs", "unknown"),
        programmatic_launches=load_extension().programmatic_launches(torch.cuda.current_device()),
    )
    print(f"device copy {bandwidth / 1e9:.0f} GB/s; {report['gpu']}; commit {commit}", flush=True)
    rates = [bandwidth]
    for name in presets:
        report["presets"].append(run_preset(name, args, bandwidth))
        rates.append(copy_bandwidth())
    # The floor is a bound: it takes the highest copy rate measured (at the start and after each preset). One
    # measurement alone has come out 3-4 % low on an H200 (4036 against 4160 GB/s in the next run on the same machine).
    bandwidth = max(rates)
    report["copy_gb_s"], report["copy_gb_s_measured"] = bandwidth / 1e9, [r / 1e9 for r in rates]
    for res in report["presets"]:
        res["floor_ms"] = 1e3 * res["weight_bytes"] / bandwidth
        for run in res["runs"]:
            if "weight_bytes" in run:
                run["floor_ms"] = 1e3 * run["weight_bytes"] / bandwidth
    os.makedirs(args.out, exist_ok=True)
    gpu = report["gpu"].split()[-1].lower()
    stem = os.path.join(args.out, f"{report['date']}-{gpu}-e2e-{'-'.join(presets)}")
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(report))
    print(markdown(report))
    print(f"wrote {stem}.json and {stem}.md")


def _git_commit() -> str:
    with contextlib.suppress(Exception):
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    return "unknown"


if __name__ == "__main__":
    main()
