"""generate() with a target split over two GPUs by accelerate (what ``device_map="auto"`` does): each
layer's caches and tree ops on that layer's device, the eager round path. Skipped with fewer than two
GPUs."""

import pytest
import torch

from ddtree_ext import generate, tiny
from ddtree_ext.target import TargetAdapter
from ddtree_ext.tiny import make_agreeing_draft, make_predictable_target

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

NEW_TOKENS = 300
PROMPT = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(5))


def split_over_two_gpus(model):
    """accelerate's dispatch of a 4-layer model: embeddings and layers 0-1 on GPU 0, the rest on GPU 1."""
    dispatch_model = pytest.importorskip("accelerate").dispatch_model

    text = "model.language_model" if hasattr(model.model, "language_model") else "model"
    device_map = {f"{text}.embed_tokens": 0, f"{text}.rotary_emb": 0, f"{text}.norm": 1, "lm_head": 1}
    for i in range(model.config.get_text_config().num_hidden_layers):
        device_map[f"{text}.layers.{i}"] = 0 if i < 2 else 1
    return dispatch_model(model, device_map=device_map)


@pytest.mark.parametrize("method,budget", [("autoregressive", 1), ("dflash", 1), ("ddtree", 64)])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_split_target_equals_single_gpu_hf_generate(family, method, budget):
    target = make_predictable_target(family, seed=3)
    draft = make_agreeing_draft(target, seed=1)
    reference = tiny.hf_greedy(target.to("cuda:0"), PROMPT.cuda(), NEW_TOKENS)
    split = split_over_two_gpus(target)
    adapter = TargetAdapter(split, draft.target_layer_ids)
    assert {d.index for d in adapter.layer_devices} == {0, 1} and not adapter.single_device
    out, stats = generate(adapter, draft.to("cuda:0"), PROMPT.to("cuda:0"), NEW_TOKENS, method=method,
                          tree_budget=budget, return_stats=True)
    assert stats.graph_captures == 0  # graphs need one device: the default falls back to eager
    diff = (out.cpu() != reference.cpu())[0].nonzero()
    assert diff.numel() == 0, f"first mismatch at position {int(diff[0])}"
    if method != "autoregressive":
        assert stats.tau > 1.5, stats.summary()


@pytest.mark.parametrize("method", ["ddtree", "autoregressive"])
def test_graphs_on_a_gpu_that_is_not_the_current_one(method):
    """A whole target on cuda:1 while cuda:0 is current: the rounds are captured on cuda:1's streams
    (captured on cuda:0's, they would record nothing and replay stale results)."""
    target = make_predictable_target("qwen3_5", seed=3)
    draft = make_agreeing_draft(target, seed=1)
    reference = tiny.hf_greedy(target.to("cuda:1"), PROMPT.to("cuda:1"), NEW_TOKENS)
    assert torch.cuda.current_device() == 0
    out, stats = generate(target, draft.to("cuda:1"), PROMPT.to("cuda:1"), NEW_TOKENS, method=method,
                          cuda_graph=True, return_stats=True)
    assert stats.graph_captures >= 1 and sum(stats.round_replayed) > stats.rounds // 2
    diff = (out.cpu() != reference.cpu())[0].nonzero()
    assert diff.numel() == 0, f"first mismatch at position {int(diff[0])}"
