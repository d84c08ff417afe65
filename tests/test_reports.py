"""The benchmark reports' target tables, computed from a run's results (no GPU needed): benchmarks/e2e.py's
issue #5 rows and scripts/summarize_bench.py's issue #4 rows; scripts/profile_round.py's timeline summary;
scripts/compare_e2e.py's side-by-side table of e2e.py reports."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name, *path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, *path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def e2e():
    return load("ddtree_e2e_benchmark", "benchmarks", "e2e.py")


@pytest.fixture(scope="module")
def summarize():
    return load("ddtree_summarize_bench", "scripts", "summarize_bench.py")


def run(method, budget, round_ms, graphs=True, **stages):
    return dict(method=method, budget=budget, graphs=graphs, round_ms=round_ms, rounds_measured=20, tau=1.0,
                stage_ms=stages)


def preset(name, floor_ms, runs, peak_gb=60.0, static_gb=3.0):
    return dict(preset=name, family="qwen3_5", build_s=1.0, weight_bytes=int(50e9), floor_ms=floor_ms,
                prompt_len=512, hf_decode_step_ms=100.0, runs=runs, peak_memory_gb=peak_gb,
                static_buffers_max_length_gb=static_gb, max_length=32768)


def report(presets, gpu_memory_gb=141.0):
    return dict(date="2026-11-29", gpu="NVIDIA H200", commit="abc1234", command="python benchmarks/e2e.py",
                torch="2", transformers="5", fla=False, copy_gb_s=4200.0, gpu_memory_gb=gpu_memory_gb,
                presets=presets)


def test_27b_targets_met_and_missed(e2e):
    runs = [
        run("autoregressive", 0, 11.0),                      # 1.10 x floor: met
        run("autoregressive", 0, 40.0, graphs=False),        # eager: ignored
        run("dflash", 15, 20.0),
        run("ddtree", 16, 21.0),
        run("ddtree", 64, 26.0, build=0.5, walk=0.2, commit=0.1),  # 2.6 x floor, 1.3 x chain, 3.1 % tree ops
    ]
    rows = e2e.target_rows(preset("27b", 10.0, runs, peak_gb=100.0, static_gb=50.0), gpu_memory_gb=141.0)
    assert rows == [
        "| captured AR step <= 1.15 x floor | 1.10 x | met |",
        "| DDTree round, budget 64 <= 1.3 x floor | 2.60 x | missed by 2.00 x |",
        "| DDTree 64 round <= 1.05 x DFlash chain round | 1.30 x | missed by 1.24 x |",
        "| tree ops (build + walk + commit) <= 3 % of the budget-64 round | 3.1 % | missed by 1.03 x |",
        "| peak + static buffers at the maximum length fit the GPU | 106 % of the GPU's memory | missed by 1.06 x |",
    ]
    md = e2e.markdown(report([preset("27b", 10.0, runs)]))
    assert "Against the issue #5 targets" in md and "| captured AR step <= 1.15 x floor | 1.10 x | met |" in md


def test_qwen3_8b_target_and_missing_runs(e2e):
    runs = [run("ddtree", 64, 6.2, build=0.05, walk=0.05, commit=0.02)]
    rows = e2e.target_rows(preset("qwen3-8b", 3.6, runs), gpu_memory_gb=None)
    assert rows == [
        "| DDTree round, budget 64 <= 6.5 ms | 6.20 ms | met |",
        "| tree ops (build + walk + commit) <= 3 % of the budget-64 round | 1.9 % | met |",
    ]
    # Without a budget-64 round or a chain round, and for presets the issue sets no targets for: no rows.
    assert e2e.target_rows(preset("27b", 10.0, [run("autoregressive", 0, 12.0)]), None) == [
        "| captured AR step <= 1.15 x floor | 1.20 x | missed by 1.04 x |"]
    assert e2e.target_rows(preset("4b", 5.0, runs), 141.0) == []
    assert "Against the issue #5 targets" not in e2e.markdown(report([preset("4b", 5.0, runs)]))


def test_sampled_runs_are_labelled_and_not_the_targets(e2e):
    """--sample's rounds show their settings in the table and never stand in for the greedy rounds the targets
    bound; --sample's value is checked when parsed."""
    sampling = e2e.parse_sampling("0.6,20,0.95")
    assert sampling == dict(temperature=0.6, top_k=20, top_p=0.95)
    runs = [
        dict(run("autoregressive", 0, 30.0), sampling=sampling),  # a slow sampled step listed first
        run("autoregressive", 0, 11.0),
        dict(run("ddtree", 64, 40.0, walk=5.0), sampling=e2e.parse_sampling("0.7,0,0.9")),
    ]
    rows = e2e.target_rows(preset("27b", 10.0, runs), gpu_memory_gb=None)
    assert rows == ["| captured AR step <= 1.15 x floor | 1.10 x | met |"]  # no greedy budget-64 round: no row
    md = e2e.markdown(report([preset("27b", 10.0, runs)]))
    assert "| autoregressive (T 0.6, top_k 20, top_p 0.95) | 0 | graphs | 30.00 |" in md
    assert "| ddtree (T 0.7, top_k 0, top_p 0.9) | 64 | graphs | 40.00 |" in md
    assert "| autoregressive | 0 | graphs | 11.00 |" in md
    for bad in ("0.6,20", "0,20,0.9", "hot,20,0.9"):
        with pytest.raises(Exception, match="temperature"):
            e2e.parse_sampling(bad)


def bench(name, per_op_us, floor_us=1.0):
    return dict(name=name, group=None, stats=dict(median=per_op_us * 1e-6),
                extra_info=dict(op=name, shape="s", calls_per_replay=1, per_op_us=per_op_us, floor_us=floor_us,
                                copy_GBps=4000.0, fp32_TFLOPs=50.0))


def test_moe_floor_counts_the_experts_a_run_reaches(e2e):
    """A sparse-MoE target's floor: one row reads its top_k experts per layer, a tree's rows the experts they are
    expected to reach (uniform routing); a dense model's floor does not depend on the rows. Each MoE run's x floor is
    over its own floor."""
    pytest.importorskip("transformers.models.qwen3_5_moe")
    from ddtree_ext import tiny
    from ddtree_ext.target import TargetAdapter

    moe = TargetAdapter(tiny.make_tiny_target("qwen3_5_moe", num_experts=8, num_experts_per_tok=2), [1])
    blocks = [layer.mlp for layer in moe.text_model.layers]
    expert_bytes = sum(p.numel() * p.element_size() for b in blocks for p in b.experts.parameters())
    embed = moe.embed_tokens.weight
    everything = sum(p.numel() * p.element_size() for m in (moe.text_model, moe.lm_head) for p in m.parameters()
                     if p is not embed)
    dense_bytes = everything - expert_bytes
    assert e2e.weight_bytes_read(moe, 1) == dense_bytes + expert_bytes // 4  # 2 of 8 experts
    assert e2e.weight_bytes_read(moe, 3) == int(dense_bytes + expert_bytes * (1 - 0.75 ** 3))
    assert e2e.weight_bytes_read(moe, 200) == everything  # every expert reached (to the byte)
    dense = TargetAdapter(tiny.make_tiny_target("qwen3_5"), [1])
    assert e2e.weight_bytes_read(dense, 1) == e2e.weight_bytes_read(dense, 65)
    assert not e2e.graphs_possible(moe) and not e2e.graphs_possible(dense)  # on the CPU, neither

    runs = [dict(run("autoregressive", 0, 2.0, graphs=False), floor_ms=1.0),
            dict(run("ddtree", 64, 8.0, graphs=False), floor_ms=4.0)]
    md = e2e.markdown(report([dict(preset("35b-a3b", 1.0, runs), family="qwen3_5_moe")]))
    assert "| autoregressive | 0 | eager | 2.00 | 2.00 |" in md and "| ddtree | 64 | eager | 8.00 | 2.00 |" in md
    assert "Sparse MoE" in md and "Against the issue #5 targets" not in md


def test_kernel_targets(summarize):
    data = dict(benchmarks=[
        bench("test_tree_gated_delta_rule[64]", 37.1, 4.2),
        bench("test_topk_logprobs", 15.6),
        bench("test_build_tree[64]", 26.7),
        bench("test_walk_greedy[64]", 3.5),
        bench("test_commit_gdn_state", 160.0, 75.0),
        # test_commit_kv missing: its row is left out
    ])
    assert summarize.target_rows(data) == [
        "| tree gated delta rule <= 30 us per layer at N = 65 | 37.1 us | missed by 1.24 x |",
        "| top-K + build <= 50 us at N = 65 | 15.6 + 26.7 = 42.3 us | met |",
        "| walk (greedy) <= 10 us at N = 65 | 3.5 us | met |",
        "| commit of 48 GDN states <= 2 x its floor | 160.0 us / 75.0 us = 2.13 x | missed by 1.07 x |",
    ]
    text = summarize.table(data)
    assert "Against the issue #4 targets" in text and text.count("| met |") == 2


def test_round_timeline_splits_the_span(tmp_path, capsys):
    """scripts/profile_round.py --summarize-timeline: overlapping kernels share their common time equally, host events
    are not kernels, and the idle time between kernels is a gap named by the kernels around it."""
    import json

    profile_round = load("ddtree_profile_round", "scripts", "profile_round.py")
    events = [
        dict(cat="kernel", name="void ddtree::(anonymous namespace)::first_kernel<float>(int)", ts=100.0, dur=10.0,
             tid=7),
        dict(cat="kernel", name="second", ts=105.0, dur=10.0, tid=8),
        dict(cat="kernel", name="third", ts=120.0, dur=2.0, tid=7),
        dict(cat="gpu_memset", name="Memset", ts=122.0, dur=1.0, tid=7),
        dict(cat="cpu_op", name="aten::mm", ts=0.0, dur=500.0, tid=1),
    ]
    path = tmp_path / "round.json"
    path.write_text(json.dumps(dict(traceEvents=events)))
    profile_round.summarize_timeline(str(path), top=10)
    out = capsys.readouterr().out
    assert out.startswith("4 kernels and copies over 23.0 us; idle 5.0 us in 1 gaps (1 of 1 us or more)\n"), out
    assert "| `first_kernel<float>` | 1 | 7.5 | 7.50 | 10.0 | 10.00 |" in out
    assert "| `second` | 1 | 7.5 | 7.50 | 10.0 | 10.00 |" in out
    assert "| `third` | 1 | 2.0 | 2.00 | 2.0 | 2.00 |" in out
    assert "  5.00  second -> third" in out


def test_compare_e2e_side_by_side(tmp_path, capsys):
    import json

    compare_e2e = load("ddtree_compare_e2e", "scripts", "compare_e2e.py")
    a = report([preset("27b", 12.0, [run("autoregressive", 0, 14.0, verify=13.8), run("ddtree", 64, 18.0, verify=16.0),
                                     run("ddtree", 16, 17.0)])])
    b = report([preset("27b", 12.0, [run("autoregressive", 0, 13.3, verify=13.1), run("ddtree", 64, 18.9, verify=16.9)])])
    a["launch_order_edges"], b["launch_order_edges"] = False, True
    a["projections"] = b["projections"] = "tuned"
    paths = []
    for name, rep in (("a", a), ("b", b)):
        paths.append(str(tmp_path / f"{name}.json"))
        with open(paths[-1], "w") as f:
            json.dump(rep, f)
    md = tmp_path / "ab.md"
    assert compare_e2e.main([*paths, "--labels", "base,new", "--out", str(md)]) == 0
    out = capsys.readouterr().out
    assert md.read_text() == out
    assert "- `launch_order_edges`: base false; new true" in out
    assert "projections" not in out  # the same on both sides
    assert "| 27b | autoregressive | 0 | graphs | 14.00 | 13.30 | 0.950 | 13.800 | 13.100 |" in out
    assert "| 27b | ddtree | 64 | graphs | 18.00 | 18.90 | 1.050 | 16.000 | 16.900 |" in out
    assert "Not in every report (left out): 27b ddtree 16 graphs" in out


@pytest.mark.parametrize("argv, message", [(["one.json"], "reports: expected at least two"),
                                           (["a.json", "b.json", "--labels", "x"], "--labels: expected 2 labels")])
def test_compare_e2e_usage_errors(argv, message, capsys):
    compare_e2e = load("ddtree_compare_e2e", "scripts", "compare_e2e.py")
    with pytest.raises(SystemExit):
        compare_e2e.main(argv)
    assert message in capsys.readouterr().err
