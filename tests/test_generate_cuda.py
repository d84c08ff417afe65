"""generate() on a GPU: the whole round (draft, CUDA build ops, tree verify through the CUDA GDN ops, walk,
commit) gives the target's own greedy output, for both families. Skipped without CUDA."""

import functools

import pytest
import torch

from conftest import requires_cuda
from ddtree_ext import generate, tiny
from ddtree_ext.tiny import make_agreeing_draft, make_predictable_target

pytestmark = requires_cuda

NEW_TOKENS = 300
PROMPT = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(5))


@functools.lru_cache(maxsize=None)
def cuda_pair(family: str):
    target = make_predictable_target(family, seed=3)
    draft = make_agreeing_draft(target, seed=1)
    return target.cuda(), draft.cuda()


@functools.lru_cache(maxsize=None)
def hf_greedy(family: str) -> torch.Tensor:
    return tiny.hf_greedy(cuda_pair(family)[0], PROMPT.cuda(), NEW_TOKENS)


@pytest.mark.parametrize("method,budget", [("autoregressive", 1), ("dflash", 1), ("ddtree", 16), ("ddtree", 64)])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_greedy_on_cuda_equals_hf_generate(family, method, budget):
    target, draft = cuda_pair(family)
    out, stats = generate(target, draft, PROMPT.cuda(), NEW_TOKENS, method=method, tree_budget=budget,
                          return_stats=True)
    assert out.device.type == "cuda"
    ref = hf_greedy(family)
    diff = (out != ref)[0].nonzero()
    assert diff.numel() == 0, f"first mismatch at position {int(diff[0])}"
    if method != "autoregressive":
        assert stats.tau > 1.5, stats.summary()
