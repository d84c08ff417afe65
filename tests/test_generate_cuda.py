"""generate() on a GPU: the whole round (draft, CUDA build ops, tree verify through the CUDA GDN ops, walk,
commit), eager and replayed from CUDA graphs, gives the target's own greedy output for every family (the MoE one
eagerly), and the graph path gives exactly the eager path's output, greedy and sampled. Skipped without CUDA."""

import copy
import functools
import threading

import pytest
import torch

from conftest import programmatic_launches, requires_cuda, vllm_penalties
from ddtree_ext import generate, tiny
from ddtree_ext.round import EAGER_ROUNDS_BEFORE_CAPTURE
from ddtree_ext.tiny import make_agreeing_draft, make_predictable_target, make_tiny_draft

pytestmark = requires_cuda

NEW_TOKENS = 600  # the attention width grows from 256 slots to the capacity (617 to 681): 2 or 3 captures
PROMPT = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(5))


@functools.lru_cache(maxsize=None)
def cuda_pair(family: str):
    target = make_predictable_target(family, seed=3)
    draft = make_agreeing_draft(target, seed=1)
    return target.cuda(), draft.cuda()


@functools.lru_cache(maxsize=None)
def hf_greedy(family: str) -> torch.Tensor:
    return tiny.hf_greedy(cuda_pair(family)[0], PROMPT.cuda(), NEW_TOKENS)


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("method,budget", [("autoregressive", 1), ("dflash", 1), ("ddtree", 16), ("ddtree", 64)])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_greedy_on_cuda_equals_hf_generate(family, method, budget, cuda_graph):
    """Replayed rounds with acceptance lengths varying round to round stay exact over 600 tokens (a
    stale position or length in a captured graph shows up as a wrong token)."""
    target, draft = cuda_pair(family)
    out, stats = generate(target, draft, PROMPT.cuda(), NEW_TOKENS, method=method, tree_budget=budget,
                          return_stats=True, cuda_graph=cuda_graph)
    assert out.device.type == "cuda"
    ref = hf_greedy(family)
    diff = (out != ref)[0].nonzero()
    assert diff.numel() == 0, f"first mismatch at position {int(diff[0])}"
    if method != "autoregressive":
        assert stats.tau > 1.5, stats.summary()
        assert len(set(stats.accept_lengths)) >= 3, "acceptance should vary from round to round"
    if cuda_graph:
        # Each width ran EAGER_ROUNDS_BEFORE_CAPTURE rounds eagerly, then captured once; the rest replayed.
        assert stats.graph_captures >= 2 and stats.graph_capture_s > 0, (stats.graph_captures, stats.graph_capture_s)
        eager_rounds = (EAGER_ROUNDS_BEFORE_CAPTURE + 1) * stats.graph_captures
        assert sum(stats.round_replayed) >= stats.rounds - eager_rounds - 2, (sum(stats.round_replayed), stats.rounds)
        # A replayed round's stage times come from the events inside its graph: every stage, each a positive time.
        stages = {"build", "verify", "walk", "commit"} | ({"draft"} if method != "autoregressive" else set())
        for r in (r for r, replayed in enumerate(stats.round_replayed) if replayed):
            assert set(stats.round_stage_s[r]) == stages and min(stats.round_stage_s[r].values()) > 0, stats.round_stage_s[r]
    else:
        assert stats.graph_captures == 0


@pytest.mark.parametrize("moe_op", [True, False])
@pytest.mark.parametrize("method,budget", [("autoregressive", 1), ("dflash", 1), ("ddtree", 64)])
def test_moe_target_on_cuda_equals_hf_generate(method, budget, moe_op, monkeypatch):
    """A sparse-MoE hybrid (Qwen3.6-35B-A3B's family) on the GPU in float32 gives the target's own greedy output. Its
    experts run ops.moe_experts, which keeps to the device: rounds are captured by default. With the op off, HF's
    grouped_mm runs, which torch falls back to host reads for in float32: rounds run eagerly by default and
    cuda_graph=True is refused."""
    pytest.importorskip("transformers.models.qwen3_5_moe")
    from ddtree_ext import fused

    monkeypatch.setattr(fused, "moe_experts_op", moe_op)
    target, draft = cuda_pair("qwen3_5_moe")
    if not moe_op:
        with pytest.raises(ValueError, match="reads the device from the host"):
            generate(target, draft, PROMPT.cuda(), 8, method=method, tree_budget=budget, cuda_graph=True)
    out, stats = generate(target, draft, PROMPT.cuda(), NEW_TOKENS, method=method, tree_budget=budget,
                          return_stats=True)
    diff = (out != hf_greedy("qwen3_5_moe"))[0].nonzero()
    assert diff.numel() == 0, f"first mismatch at position {int(diff[0])}"
    if moe_op:
        assert stats.graph_captures >= 1 and sum(stats.round_replayed) > stats.rounds // 2, stats.summary()
    else:
        assert stats.graph_captures == 0 and not any(stats.round_replayed)
    if method != "autoregressive":
        assert stats.tau > 1.5, stats.summary()


@functools.lru_cache(maxsize=None)
def bf16_moe_pair():
    target, draft = cuda_pair("qwen3_5_moe")
    return copy.deepcopy(target).to(torch.bfloat16), copy.deepcopy(draft).to(torch.bfloat16)


@pytest.mark.parametrize("moe_op", [True, False])
@pytest.mark.parametrize("method,budget", [("autoregressive", 1), ("dflash", 1), ("ddtree", 16), ("ddtree", 64)])
def test_moe_bf16_graph_rounds_equal_eager_rounds(method, budget, moe_op, monkeypatch):
    """The same MoE hybrid in bfloat16: its experts run ops.moe_experts (on any GPU; on an sm_90 / sm_100 GPU with the
    op off, HF's default grouped_mm experts forward, whose grouped GEMM keeps the routing on the device too), so its
    rounds are captured (by default, and with cuda_graph=True); the replayed rounds, over 600 tokens with acceptance
    varying round to round, give exactly the eager rounds' tokens (cuda_graph=False). HF's path passed on an H100,
    2026-12-06."""
    pytest.importorskip("transformers.models.qwen3_5_moe")
    from ddtree_ext import fused
    from ddtree_ext.target import TargetAdapter

    monkeypatch.setattr(fused, "moe_experts_op", moe_op)
    target, draft = bf16_moe_pair()
    if not TargetAdapter(target).moe_capturable:
        pytest.skip(f"torch's grouped_mm falls back to host reads on {torch.cuda.get_device_name()}")
    eager, eager_stats = generate(target, draft, PROMPT.cuda(), NEW_TOKENS, method=method, tree_budget=budget,
                                  return_stats=True, cuda_graph=False)
    assert eager_stats.graph_captures == 0
    out, stats = generate(target, draft, PROMPT.cuda(), NEW_TOKENS, method=method, tree_budget=budget,
                          return_stats=True, cuda_graph=True)
    diff = (out != eager)[0].nonzero()
    assert diff.numel() == 0, f"first mismatch at position {int(diff[0])}"
    assert stats.graph_captures >= 2 and sum(stats.round_replayed) > stats.rounds // 2, stats.summary()
    if method != "autoregressive":
        assert len(set(stats.accept_lengths)) >= 3, "acceptance should vary from round to round"


@pytest.mark.parametrize("moe_op", [False, True])
@pytest.mark.parametrize("method,budget", [("autoregressive", 1), ("ddtree", 64)])
def test_moe_experts_loop_on_cuda(method, budget, moe_op, monkeypatch):
    """A float32 MoE target configured with HF's "eager" experts loop. With ops.moe_experts off, that loop runs: it
    reads on the host which experts a batch hits, a CUDA graph cannot capture it, so the default is eager rounds. With
    the op (the default) the experts keep to the device and the rounds are captured. Both give the target's own
    greedy output over 200 tokens."""
    pytest.importorskip("transformers.models.qwen3_5_moe")
    from ddtree_ext import fused

    monkeypatch.setattr(fused, "moe_experts_op", moe_op)
    loop = tiny.make_predictable_target("qwen3_5_moe", seed=3, experts_implementation="eager").cuda()
    draft = cuda_pair("qwen3_5_moe")[1]  # same weights as its target, so it agrees with this one
    out, stats = generate(loop, draft, PROMPT.cuda(), 200, method=method, tree_budget=budget, return_stats=True)
    assert torch.equal(out, tiny.hf_greedy(loop, PROMPT.cuda(), 200))
    if moe_op:
        assert stats.graph_captures >= 1 and sum(stats.round_replayed) > stats.rounds // 2, stats.summary()
    else:
        assert stats.graph_captures == 0 and not any(stats.round_replayed)
    if method != "autoregressive":
        assert stats.tau > 1.5, stats.summary()


@pytest.mark.parametrize("same_as", ["capture", "side"])
def test_stage_timing_when_the_stream_pool_repeats_a_stream(same_as, monkeypatch):
    """A captured round records its stage timing events on a stream of its own, unless the stream pool handed that
    stream out as the capture stream or as Fork's side stream too: then on the round's own stream, as before. The same
    tokens, and every stage of every replayed round timed, either way."""
    from ddtree_ext import fused
    from ddtree_ext.round import DecodeRound

    target, draft = cuda_pair("qwen3_5")
    device = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(device)
    monkeypatch.setitem(fused._SIDE_STREAMS, device, side)
    made = []
    init = DecodeRound.__init__

    def init_with_a_repeated_stream(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._timing_stream = self._capture_stream if same_as == "capture" else side
        made.append(self)

    monkeypatch.setattr(DecodeRound, "__init__", init_with_a_repeated_stream)
    out, stats = generate(target, draft, PROMPT.cuda(), 200, tree_budget=16, return_stats=True, cuda_graph=True)
    assert made and torch.equal(out, hf_greedy("qwen3_5")[:, : out.shape[1]])
    replayed = [r for r, rep in enumerate(stats.round_replayed) if rep]
    assert replayed
    for r in replayed:
        assert len(stats.round_stage_s[r]) == 5 and min(stats.round_stage_s[r].values()) > 0, stats.round_stage_s[r]


def test_another_model_from_another_thread_during_captures():
    """Two models from two threads on one GPU: while one thread's generate() captures and replays its rounds, another
    thread runs HF's greedy generate on another model, over and over. Captures use capture_error_mode="thread_local"
    (round.py), so that thread's allocations and syncs neither fail nor invalidate them (under "global" they did, in
    vLLM and SGLang); both outputs are their models' own."""
    target, draft = cuda_pair("qwen3_5")
    other = cuda_pair("qwen3")[0]
    expected = hf_greedy("qwen3_5")
    other_expected = tiny.hf_greedy(other, PROMPT.cuda(), 40)
    stop, errors, other_outputs = threading.Event(), [], []

    def run_other():
        try:
            while not stop.is_set():
                other_outputs.append(tiny.hf_greedy(other, PROMPT.cuda(), 40))
        except BaseException as e:  # reported below, not lost in the thread
            errors.append(e)

    thread = threading.Thread(target=run_other, daemon=True)
    thread.start()
    try:
        out, stats = generate(target, draft, PROMPT.cuda(), NEW_TOKENS, method="ddtree", tree_budget=16,
                              return_stats=True, cuda_graph=True)
    finally:
        stop.set()
        thread.join(timeout=300)
    assert not thread.is_alive() and not errors, errors
    assert other_outputs and all(torch.equal(o, other_expected) for o in other_outputs)
    assert torch.equal(out, expected)
    assert stats.graph_captures >= 2


def test_graphs_are_the_default_on_one_gpu():
    target, draft = cuda_pair("qwen3_5")
    _, stats = generate(target, draft, PROMPT.cuda(), 200, return_stats=True)
    assert stats.graph_captures >= 1


@pytest.mark.parametrize("penalty", [None, 1.3], ids=["plain", "repetition_penalty"])
@pytest.mark.parametrize("method", ["ddtree", "autoregressive"])
def test_sampled_graph_output_equals_eager(method, penalty):
    """The uniforms are read at device positions inside the graph, as are the tokens a repetition penalty counts: same
    seed, same tokens."""
    target, draft = cuda_pair("qwen3_5")
    kw = dict(method=method, temperature=0.8, top_k=20, seed=11, repetition_penalty=penalty)
    eager = generate(target, draft, PROMPT.cuda(), 300, cuda_graph=False, **kw)
    graphed, stats = generate(target, draft, PROMPT.cuda(), 300, cuda_graph=True, return_stats=True, **kw)
    assert torch.equal(eager, graphed)
    assert sum(stats.round_replayed) > stats.rounds // 2


# 1.1 and 1.05: float32(1 / r) is not 1 / float32(r), and torch's CUDA division by r multiplies by the former.
PENALTIES = {"repetition": dict(repetition_penalty=1.1),
             "presence-frequency": dict(presence_penalty=1.5, frequency_penalty=0.2),
             "all": dict(repetition_penalty=1.05, presence_penalty=0.5, frequency_penalty=0.1)}


@pytest.mark.parametrize("penalties", list(PENALTIES))
@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("method,budget", [("autoregressive", 1), ("dflash", 1), ("ddtree", 64)])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_penalties_on_cuda_equal_hf_generate(family, method, budget, cuda_graph, penalties):
    """Penalties in replayed rounds, whose graphs add each round's tokens to the ones they count (launched ahead of
    the round before's result): the target's own greedy output with them over 300 tokens (HF's repetition penalty;
    vLLM's presence and frequency penalties as conftest.vllm_penalties)."""
    target, draft = cuda_pair(family)
    kw = PENALTIES[penalties]
    out, stats = generate(target, draft, PROMPT.cuda(), 300, method=method, tree_budget=budget, return_stats=True,
                          cuda_graph=cuda_graph, **kw)
    vllm_rule = vllm_penalties(PROMPT.shape[1], kw.get("presence_penalty", 0.0), kw.get("frequency_penalty", 0.0))
    ref = tiny.hf_greedy(target, PROMPT.cuda(), 300, repetition_penalty=kw.get("repetition_penalty"),
                         logits_processor=vllm_rule)
    assert not torch.equal(ref, hf_greedy(family)[:, : ref.shape[1]]), "the penalty should change the output"
    diff = (out != ref)[0].nonzero()
    assert diff.numel() == 0, f"first mismatch at position {int(diff[0])}"
    if cuda_graph:
        assert sum(stats.round_replayed) > stats.rounds // 2, stats.summary()


@pytest.mark.parametrize("method", ["ddtree", "autoregressive"])
def test_eos_on_graphs_drops_the_round_launched_ahead(method):
    """EOS in a replayed round: the round already launched behind it is dropped unread (the output stops at
    the EOS, as the graph-free run of the same generation does), and the next generation on the same
    target starts clean (the dropped round's graphs are released once it is done)."""
    target, draft = cuda_pair("qwen3_5")
    full, stats = generate(target, draft, PROMPT.cuda(), 300, method=method, return_stats=True)
    new = full[0, PROMPT.shape[1]:].tolist()
    # The token that first appears the latest, but 50 tokens before the end (a round that could end the generation by
    # length has nothing launched behind it): an EOS there ends the generation after rounds replayed from graphs.
    eos_at = max(i for i in (new.index(t) for t in set(new)) if i < 250)
    assert eos_at >= 30, f"every token appears within the first {eos_at + 1}: no late EOS to test"
    out, cut = generate(target, draft, PROMPT.cuda(), 300, method=method, eos_token_id=new[eos_at], return_stats=True)
    assert torch.equal(out, full[:, : PROMPT.shape[1] + eos_at + 1])
    assert any(cut.round_replayed) and cut.round_launched_ahead[-1]
    assert len(cut.round_stage_s) == len(cut.round_time_s) == cut.rounds
    assert torch.equal(generate(target, draft, PROMPT.cuda(), 300, method=method), full)


def small_real_shaped_hybrid(dtype):
    """A Qwen3.5-shaped hybrid at a small size (real head sizes: GDN 128/128 with HV = 2 H, attention
    head_dim 256 with 4 KV heads, partial RoPE; 8 layers [lll f] x 2, hidden 1024, vocabulary 4096),
    random weights, on the GPU."""
    config = tiny.tiny_qwen3_5_config(
        vocab_size=4096,
        layer_types=("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + ("full_attention",),
        hidden_size=1024,
        intermediate_size=2048,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        initializer_range=0.05,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    )
    from transformers import Qwen3_5ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3_5ForCausalLM(config).to(device="cuda", dtype=dtype).eval()
    draft = make_tiny_draft(model, seed=2, weight_std=0.05).to(device="cuda", dtype=dtype)
    return model, draft


def assert_graphs_equal_eager(target, draft, prompt, new_tokens: int) -> dict:
    """DDTree (budget 64) and autoregressive generations replayed from graphs give the eager ones' tokens.
    Returns {method: (graphed ids, stats)}."""
    runs = {}
    for method, budget in (("ddtree", 64), ("autoregressive", 1)):
        eager = generate(target, draft, prompt, new_tokens, method=method, tree_budget=budget, cuda_graph=False)
        graphed, stats = generate(target, draft, prompt, new_tokens, method=method, tree_budget=budget,
                                  cuda_graph=True, return_stats=True)
        diff = (eager != graphed)[0].nonzero()
        assert diff.numel() == 0, f"{method}: first mismatch at position {int(diff[0])}"
        runs[method] = graphed, stats
    return runs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_graph_equals_eager_over_500_tokens_on_a_real_shaped_model(dtype):
    target, draft = small_real_shaped_hybrid(dtype)
    prompt = torch.randint(0, 4096, (1, 40), generator=torch.Generator().manual_seed(1)).cuda()
    for method, (graphed, stats) in assert_graphs_equal_eager(target, draft, prompt, 520).items():
        assert stats.graph_captures >= 2
        if dtype == torch.float32:
            ref = tiny.hf_greedy(target, prompt, 520)
            diff = (graphed != ref)[0].nonzero()
            assert diff.numel() == 0, f"{method} vs HF: first mismatch at position {int(diff[0])}"


# A long context: the widths past 2048 slots grow by a quarter octave (512 slots here), so the rounds run at 2560, 3072
# and 3584 (a capture each) with the attention's keys split many ways.
LONG_PROMPT_LEN, LONG_NEW_TOKENS = 2300, 1000


@functools.lru_cache(maxsize=None)
def long_prompt(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (1, LONG_PROMPT_LEN), generator=torch.Generator().manual_seed(12)).cuda()


@functools.lru_cache(maxsize=None)
def long_hf_greedy(family: str) -> torch.Tensor:
    target = cuda_pair(family)[0]
    return tiny.hf_greedy(target, long_prompt(target.config.vocab_size), LONG_NEW_TOKENS)


@pytest.mark.parametrize("method,budget", [("autoregressive", 1), ("dflash", 1), ("ddtree", 64)])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_long_context_rounds_equal_hf_generate_across_widths(family, method, budget):
    """A 2300-token prompt and 1000 new tokens, rounds replayed from graphs: the target's own greedy output across
    three widths past 2048 slots, with acceptance varying round to round."""
    target, draft = cuda_pair(family)
    prompt = long_prompt(target.config.vocab_size)
    out, stats = generate(target, draft, prompt, LONG_NEW_TOKENS, method=method, tree_budget=budget,
                          return_stats=True, cuda_graph=True)
    diff = (out != long_hf_greedy(family))[0].nonzero()
    assert diff.numel() == 0, f"first mismatch at position {int(diff[0])}"
    assert stats.graph_captures >= 3 and sum(stats.round_replayed) > stats.rounds // 2, stats.summary()
    if method != "autoregressive":
        assert stats.tau > 1.5, stats.summary()
        assert len(set(stats.accept_lengths)) >= 2, "acceptance should vary from round to round"


def test_repetition_penalty_graph_equals_eager_on_a_real_shaped_model():
    """Greedy bf16 rounds with a repetition penalty penalise float32 copies of their logits (HF penalises after its
    upcast): replayed rounds give the eager rounds' tokens."""
    target, draft = small_real_shaped_hybrid(torch.bfloat16)
    prompt = torch.randint(0, 4096, (1, 40), generator=torch.Generator().manual_seed(4)).cuda()
    for method, budget in (("ddtree", 64), ("autoregressive", 1)):
        kw = dict(method=method, tree_budget=budget, repetition_penalty=1.2)
        eager = generate(target, draft, prompt, 300, cuda_graph=False, **kw)
        graphed = generate(target, draft, prompt, 300, cuda_graph=True, **kw)
        assert torch.equal(eager, graphed), method
        assert not torch.equal(graphed, generate(target, draft, prompt, 300, method=method, tree_budget=budget))


def test_long_context_graph_equals_eager_on_a_real_shaped_model():
    """The same long context on the real-shaped bf16 hybrid, whose attention (head_dim 256) runs the split-KV kernel
    over 2560-3072 keys: replayed rounds give the eager rounds' tokens."""
    target, draft = small_real_shaped_hybrid(torch.bfloat16)
    prompt = long_prompt(4096)
    for method, (_, stats) in assert_graphs_equal_eager(target, draft, prompt, 600).items():
        assert stats.graph_captures >= 2, (method, stats.summary())


@pytest.mark.parametrize("method,budget", [("autoregressive", 1), ("ddtree", 64)])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_stacked_projections_on_cuda_equal_hf_generate(family, method, budget):
    """With stack_projections (one GEMM per attention layer's q/k/v, per MLP's gate/up), replayed rounds give the
    target's own greedy output (float32)."""
    import copy

    from ddtree_ext import stack_projections

    target, draft = (copy.deepcopy(m) for m in cuda_pair(family))
    assert stack_projections(target) > 0
    stack_projections(draft)
    out = generate(target, draft, PROMPT.cuda(), NEW_TOKENS, method=method, tree_budget=budget, cuda_graph=True)
    diff = (out != hf_greedy(family))[0].nonzero()
    assert diff.numel() == 0, f"first mismatch at position {int(diff[0])}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_stacked_projections_graph_equals_eager_on_a_real_shaped_model(dtype):
    """The real-shaped hybrid stacked: graphs give the eager tokens; in float32 also HF's own greedy output."""
    import copy

    from ddtree_ext import stack_projections

    target, draft = (copy.deepcopy(m) for m in small_real_shaped_hybrid(dtype))
    stack_projections(target)
    stack_projections(draft)
    prompt = torch.randint(0, 4096, (1, 40), generator=torch.Generator().manual_seed(1)).cuda()
    for method, (graphed, _) in assert_graphs_equal_eager(target, draft, prompt, 300).items():
        if dtype == torch.float32:
            ref = tiny.hf_greedy(small_real_shaped_hybrid(dtype)[0], prompt, 300)
            diff = (graphed != ref)[0].nonzero()
            assert diff.numel() == 0, f"{method} vs HF: first mismatch at position {int(diff[0])}"


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graphs", "eager"])
def test_side_streams_do_not_change_the_output(cuda_graph, monkeypatch):
    """Forks (a GDN layer's gates and z projection, an attention layer's K and V projections, the draft's positions,
    slots, RoPE rows and masks, a round's result row, each on a second stream) only reorder independent launches: the
    tokens are those of the same generation with every fork inline."""
    from ddtree_ext import fused

    target, draft = small_real_shaped_hybrid(torch.bfloat16)
    prompt = torch.randint(0, 4096, (1, 40), generator=torch.Generator().manual_seed(2)).cuda()
    runs = {}
    for uses in ({"gdn", "attn", "draft", "walk"}, set()):
        monkeypatch.setattr(fused, "side_streams", uses)
        runs[bool(uses)] = generate(target, draft, prompt, 200, method="ddtree", tree_budget=64, cuda_graph=cuda_graph)
    diff = (runs[True] != runs[False])[0].nonzero()
    assert diff.numel() == 0, f"first mismatch at position {int(diff[0])}"


def _count_launch_order_edges(monkeypatch) -> list:
    """Turns ddtree_ext.round.launch_order_edges on and returns the list that each captured graph's count of moved
    edges is appended to (csrc/graph_cuda.cpp)."""
    from ddtree_ext import round as round_module
    from ddtree_ext._loader import load_extension

    ext, moved = load_extension(), []
    move = ext.graph_launch_order_edges
    monkeypatch.setattr(ext, "graph_launch_order_edges", lambda handle: moved.append(move(handle)) or moved[-1])
    monkeypatch.setattr(round_module, "launch_order_edges", True)
    return moved


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_launch_order_edges_in_rounds_equal_hf_generate(family, monkeypatch):
    """With a captured round's programmatic edges moved to the launch-order port (each kernel of ours after a GEMM
    launches while the GEMM runs, and waits for it on the device), replayed rounds give the target's own greedy
    output over 600 tokens, tree and decode step alike."""
    moved = _count_launch_order_edges(monkeypatch)
    target, draft = cuda_pair(family)
    for method, budget in (("ddtree", 64), ("autoregressive", 1)):
        out = generate(target, draft, PROMPT.cuda(), NEW_TOKENS, method=method, tree_budget=budget, cuda_graph=True)
        diff = (out != hf_greedy(family))[0].nonzero()
        assert diff.numel() == 0, f"{method}: first mismatch at position {int(diff[0])}"
    assert moved and (min(moved) > 0 or not programmatic_launches()), moved


def test_launch_order_edges_graph_equals_eager_on_a_real_shaped_model(monkeypatch):
    """The real-shaped hybrid in bfloat16 (cuBLAS's bf16 GEMMs ahead of our kernels): graphs with launch-order edges
    give the eager tokens."""
    moved = _count_launch_order_edges(monkeypatch)
    target, draft = small_real_shaped_hybrid(torch.bfloat16)
    prompt = torch.randint(0, 4096, (1, 40), generator=torch.Generator().manual_seed(3)).cuda()
    assert_graphs_equal_eager(target, draft, prompt, 300)
    assert moved and (min(moved) > 0 or not programmatic_launches()), moved


def test_tuned_gemms_in_rounds_replay_exactly(monkeypatch):
    """With gemm_tuning on (and every problem taking its fastest cuBLASLt candidate, so that the cuBLASLt path runs
    whatever the timings), graph rounds give the eager rounds' tokens; in float32 also HF's own greedy output."""
    import math

    from ddtree_ext import gemm_tuning, ops

    monkeypatch.setattr(gemm_tuning, "enabled", True)
    monkeypatch.setattr(gemm_tuning, "MARGIN", -math.inf)
    calls, timing = [0], [False]  # the rounds' own cuBLASLt calls, not the tuner's
    stock_op, stock_tune = ops.linear_cublaslt, gemm_tuning._tune

    def counted(*args, **kwargs):
        calls[0] += not timing[0]
        return stock_op(*args, **kwargs)

    def tune(*args):
        timing[0] = True
        try:
            return stock_tune(*args)
        finally:
            timing[0] = False

    monkeypatch.setattr(ops, "linear_cublaslt", counted)
    monkeypatch.setattr(gemm_tuning, "_tune", tune)
    gemm_tuning.reset()
    try:
        for dtype in (torch.bfloat16, torch.float32):
            target, draft = small_real_shaped_hybrid(dtype)
            prompt = torch.randint(0, 4096, (1, 40), generator=torch.Generator().manual_seed(3)).cuda()
            for method, (graphed, stats) in assert_graphs_equal_eager(target, draft, prompt, 300).items():
                assert sum(stats.round_replayed) > stats.rounds // 2
                if dtype == torch.float32:  # not tuned (float32): the rounds stay HF's
                    diff = (graphed != tiny.hf_greedy(target, prompt, 300))[0].nonzero()
                    assert diff.numel() == 0, f"{method} vs HF: first mismatch at position {int(diff[0])}"
        picks = gemm_tuning.picks()
        assert {p["rows"] for p in picks} >= {1, 65}, sorted({p["rows"] for p in picks})  # AR step, verify
        assert all(p["dtype"] == "bfloat16" for p in picks)
        assert calls[0] > 0
    finally:
        gemm_tuning.reset()


def test_gemv_picks_in_rounds_replay_exactly(monkeypatch):
    """With every single-row projection on ops.linear_gemv (the tuner's pick forced), graph rounds give the eager
    rounds' tokens over 300 tokens of the real-shaped hybrid in bf16: the autoregressive steps run it (DDTree's rounds,
    checked beside them, have no single-row projection)."""
    from ddtree_ext import gemm_tuning, ops

    monkeypatch.setattr(gemm_tuning, "enabled", True)
    monkeypatch.setattr(gemm_tuning, "_tune", lambda x, weight: gemm_tuning.GEMV if x.shape[0] == 1 else None)
    calls = [0]
    stock = ops.linear_gemv

    def counted(*args, **kwargs):
        calls[0] += 1
        return stock(*args, **kwargs)

    monkeypatch.setattr(ops, "linear_gemv", counted)
    gemm_tuning.reset()
    try:
        target, draft = small_real_shaped_hybrid(torch.bfloat16)
        prompt = torch.randint(0, 4096, (1, 40), generator=torch.Generator().manual_seed(5)).cuda()
        for method, (graphed, stats) in assert_graphs_equal_eager(target, draft, prompt, 300).items():
            assert sum(stats.round_replayed) > stats.rounds // 2
        assert calls[0] > 0
    finally:
        gemm_tuning.reset()


def test_projection_kernel_in_rounds_replays_exactly(monkeypatch):
    """With the projection kernel switched on (fused.linear_kernel; off by default) the rounds run it, through
    captured graphs too (its weight tensor maps and cluster launches replay): the same tokens as eager."""
    from ddtree_ext import fused, ops

    monkeypatch.setattr(fused, "linear_kernel", True)
    calls = [0]
    stock = ops.linear
    monkeypatch.setattr(ops, "linear", lambda *a, **k: calls.__setitem__(0, calls[0] + 1) or stock(*a, **k))
    target, draft = small_real_shaped_hybrid(torch.bfloat16)
    prompt = torch.randint(0, 4096, (1, 40), generator=torch.Generator().manual_seed(3)).cuda()
    for _, stats in assert_graphs_equal_eager(target, draft, prompt, 300).values():
        assert sum(stats.round_replayed) > stats.rounds // 2
    assert calls[0] > 0
