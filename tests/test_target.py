"""TargetAdapter: tree verify and commit are exact against the stock HF forward, on every family.

Every tree check compares against the stock model run on prefix + path-to-node (what the target would
compute for that node along a chain); every commit check against a fresh state prefilled by the stock
forward with the whole committed sequence. Models are tiny float32 ones of the real HF classes.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_parents, rel_err
from ddtree_ext import reference, target
from ddtree_ext.ops import Walk
from ddtree_ext.target import SUPPORTED_ARCHITECTURES, TargetAdapter
from ddtree_ext.tiny import TINY_VOCAB, make_tiny_target, tiny_qwen3_5_config

LIN, FULL = "linear_attention", "full_attention"
# Whole-model float32 comparisons, relative to the largest reference entry (conftest.rel_err). The HF
# chunked/recurrent GDN kernels and the tree ops round differently (~1e-7 per op), and the tiny random
# models amplify that through the layers to ~1e-6..3e-5 in logits, taps and caches, without drifting
# over rounds; a real error (wrong mask, window or state) is O(1).
MODEL_RTOL = 1e-4

TARGETS = {
    "qwen3": dict(family="qwen3"),
    "qwen3_5-lllf-gva3": dict(family="qwen3_5", layer_types=(LIN, LIN, LIN, FULL), value_heads_per_key_head=3),
    "qwen3_5-lflf-gva1": dict(family="qwen3_5", layer_types=(LIN, FULL, LIN, FULL), value_heads_per_key_head=1),
    "qwen3_5-lflf-gva3-eager": dict(
        family="qwen3_5", layer_types=(LIN, FULL, LIN, FULL), value_heads_per_key_head=3, attn_implementation="eager"
    ),
    # The MoE family (sparse MoE MLPs), with HF's two experts implementations: grouped_mm (its default) and the loop
    "qwen3_5_moe-lflf-gva3": dict(family="qwen3_5_moe", layer_types=(LIN, FULL, LIN, FULL), value_heads_per_key_head=3),
    "qwen3_5_moe-lflf-gva3-experts-loop": dict(
        family="qwen3_5_moe", layer_types=(LIN, FULL, LIN, FULL), value_heads_per_key_head=3,
        experts_implementation="eager",
    ),
}
TAPS = (2, 0)  # deliberately not sorted: taps are concatenated in the given order
CAPACITY = 160  # cache slots: prompts, 30 rounds of up to 7 accepted tokens, one tree


@pytest.fixture(scope="module", params=list(TARGETS), ids=list(TARGETS))
def adapter(request):
    kw = dict(TARGETS[request.param])
    family = kw.pop("family")
    if family == "qwen3_5_moe":
        pytest.importorskip("transformers.models.qwen3_5_moe")
    model = make_tiny_target(family, seed=7, **kw)
    if "experts_implementation" in kw:
        assert model.config._experts_implementation == kw["experts_implementation"]
    return TargetAdapter(model, TAPS)


def _tokens(gen, *shape):
    return torch.randint(0, TINY_VOCAB, shape, generator=gen)


def _stock_last(adapter, tokens):
    """Stock forward of a whole sequence on a fresh state: (logits [V], taps [F]) at its last position."""
    logits, taps = adapter.prefill(tokens, adapter.new_state(capacity=CAPACITY))
    return logits[0], taps[0, -1]


def _random_tree(gen, prefix_len, num_nodes, shape):
    parent = random_parents(num_nodes, gen, shape)[None]
    return reference.tree_from_parents(parent, _tokens(gen, 1, num_nodes), prefix_len)


def _draft_tree(gen, root_token, prefix_len, budget, depths=6, k=3):
    logits = torch.randn(1, depths, TINY_VOCAB, generator=gen) * 3
    logp, tokens = reference.topk_logprobs(logits, k)
    return reference.build_tree(logp, tokens, root_token, prefix_len, budget)


def _assert_verify_matches_paths(adapter, prompt, tree, logits, taps):
    parent = tree.parent
    for i in range(tree.token.shape[1]):
        path = reference.path_to(parent, 0, i)
        ref_logits, ref_taps = _stock_last(adapter, torch.cat([prompt, tree.token[:, path]], dim=1))
        err = rel_err(logits[0, i], ref_logits)
        assert err < MODEL_RTOL, f"node {i} (path {path}): logits relative error {err:.2e}"
        assert int(logits[0, i].argmax()) == int(ref_logits.argmax()), f"node {i}: argmax differs"
        assert rel_err(taps[0, i], ref_taps) < MODEL_RTOL, f"node {i}: taps differ"


TREE_SHAPES = ("random", "chain", "star", "draft")


@pytest.mark.parametrize("shape", TREE_SHAPES)
def test_verify_matches_stock_forward_per_path(adapter, shape):
    gen = torch.Generator().manual_seed(TREE_SHAPES.index(shape))
    prompt = _tokens(gen, 1, int(torch.randint(1, 12, (1,), generator=gen)))
    state = adapter.new_state(capacity=CAPACITY)
    adapter.prefill(prompt, state)
    if shape == "draft":
        tree = _draft_tree(gen, _tokens(gen, 1), state.prefix_len, budget=10)
    else:
        tree = _random_tree(gen, state.prefix_len, 9, shape)
    logits, taps = adapter.verify(tree, state)
    assert logits.dtype == torch.float32 and logits.shape == (1, tree.token.shape[1], TINY_VOCAB)
    assert taps.shape == (1, tree.token.shape[1], len(TAPS) * adapter.hidden_size)
    assert torch.equal(state.prefix_len, torch.tensor([prompt.shape[1]]))
    _assert_verify_matches_paths(adapter, prompt, tree, logits, taps)


def _cache_tensors(adapter, state):
    """Every committed tensor the next forward reads: attention K/V up to prefix_len (the slots after
    it are scratch), conv and recurrent states."""
    prefix = int(state.prefix_len.max())
    return {
        name: t[:, :, :prefix] if name.startswith(("keys", "values")) else t
        for name, t in state.tensors().items()
    }


def _random_walk(gen, tree, max_accept):
    """The path to a random node, as a Walk padded with -1 to max_accept."""
    node = int(torch.randint(0, tree.token.shape[1], (1,), generator=gen))
    path = reference.path_to(tree.parent, 0, node)[:max_accept]
    accepted = torch.full((1, max_accept), -1, dtype=torch.int32)
    accepted[0, : len(path)] = torch.tensor(path, dtype=torch.int32)
    return Walk(accepted, torch.tensor([len(path)], dtype=torch.int32), _tokens(gen, 1)), path


def _rounds(adapter, seed, num_rounds):
    """Generation-like rounds: a state verifies a random tree and commits a random path of it; the
    reference is the stock HF model over the whole committed sequence (its logits, and the caches a
    stock prefill of that sequence leaves in a fresh state).

    Yields (round, tree logits at the path's nodes [A, V], stock logits there [A, V], stock state,
    tree state) after each round, then once more for a chain forward of 4 tokens on both."""
    gen = torch.Generator().manual_seed(seed)
    sequence = _tokens(gen, 1, 5)
    tree_state = adapter.new_state(capacity=CAPACITY)
    adapter.prefill(sequence, tree_state)
    root = _tokens(gen, 1, 1)
    for rnd in range(num_rounds):
        shape = TREE_SHAPES[rnd % len(TREE_SHAPES)]
        if shape == "draft":
            budget = int(torch.randint(2, 12, (1,), generator=gen))
            tree = _draft_tree(gen, root[:, 0], tree_state.prefix_len, budget)
        else:
            tree = _random_tree(gen, tree_state.prefix_len, int(torch.randint(1, 12, (1,), generator=gen)), shape)
            tree = tree._replace(token=torch.cat([root, tree.token[:, 1:]], dim=1))
        tree_logits, _ = adapter.verify(tree, tree_state)
        walk, path = _random_walk(gen, tree, max_accept=7)
        adapter.commit(walk, tree_state)
        sequence = torch.cat([sequence, tree.token[:, path]], dim=1)
        yield (rnd, tree_logits[0, path], *_stock(adapter, sequence, len(path)), tree_state)
        root = walk.next_token[:, None]
    # The committed state stays usable: a chain forward after the rounds agrees with the stock model.
    nxt = torch.cat([root, _tokens(gen, 1, 3)], dim=1)
    chain_logits = adapter.forward_chain(nxt, tree_state)[0]
    sequence = torch.cat([sequence, nxt], dim=1)
    yield (num_rounds, chain_logits[0], *_stock(adapter, sequence, nxt.shape[1]), tree_state)


def _stock(adapter, sequence, last):
    """The stock model over ``sequence``: (logits at its last ``last`` positions [last, V], a fresh state
    prefilled with it)."""
    with torch.no_grad():
        logits = adapter.model(input_ids=sequence).logits[0, -last:].float()
    state = adapter.new_state(capacity=CAPACITY)
    adapter.prefill(sequence, state)
    return logits, state


def test_commit_equals_chain_forward_over_rounds(adapter):
    for rnd, tree_logits, chain_logits, chain_state, tree_state in _rounds(adapter, seed=11, num_rounds=30):
        assert torch.equal(tree_state.prefix_len, chain_state.prefix_len)
        assert rel_err(tree_logits, chain_logits) < MODEL_RTOL, f"round {rnd}"
        assert torch.equal(tree_logits.argmax(-1), chain_logits.argmax(-1)), f"round {rnd}"
        expected = _cache_tensors(adapter, chain_state)
        for name, actual in _cache_tensors(adapter, tree_state).items():
            assert actual.shape == expected[name].shape, f"round {rnd}: {name} shape"
            assert rel_err(actual, expected[name]) < MODEL_RTOL, f"round {rnd}: {name} differs"


# Before torch 2.11 (2.6 and 2.8 checked) the CPU's SDPA rounds a bf16 call with a mask (the tree's) apart from one
# without (the chain's): 1.6 bf16 ulps seen there, where 2.11 and later stay within one.
SDPA_BF16_ULPS = 1 if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 11) else 2


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_bf16_tree_stays_on_the_chain(attn):
    """In bf16 the tree forward rounds where HF's does, so its logits stay within one bf16 ulp of the
    largest chain logit (activating the conv before rounding it, as a fused kernel would, is several ulps off)."""
    model = make_tiny_target("qwen3_5", seed=3, dtype=torch.bfloat16, attn_implementation=attn)
    adapter = TargetAdapter(model)
    ulps = SDPA_BF16_ULPS if attn == "sdpa" else 1
    for rnd, tree_logits, chain_logits, _, _ in _rounds(adapter, seed=5, num_rounds=8):
        assert rel_err(tree_logits, chain_logits) <= ulps * 2**-8, f"round {rnd}"
        assert torch.equal(tree_logits.argmax(-1), chain_logits.argmax(-1)), f"round {rnd}"


def test_taps_are_the_tapped_layer_outputs(adapter):
    gen = torch.Generator().manual_seed(3)
    prompt = _tokens(gen, 1, 6)
    _, taps = adapter.prefill(prompt, adapter.new_state(capacity=CAPACITY))
    hidden = adapter.model(input_ids=prompt, output_hidden_states=True).hidden_states
    h = adapter.hidden_size
    for slot, layer_id in enumerate(TAPS):
        # hidden_states[id + 1] is the output of decoder layer id (ids here avoid the last, post-norm entry).
        assert torch.equal(taps[..., slot * h : (slot + 1) * h], hidden[layer_id + 1])


def test_chain_forward_matches_one_stock_forward(adapter):
    gen = torch.Generator().manual_seed(5)
    tokens = _tokens(gen, 1, 10)
    state = adapter.new_state(capacity=CAPACITY)
    last, _ = adapter.prefill(tokens[:, :4], state)
    rest, _ = adapter.forward_chain(tokens[:, 4:], state)
    full = adapter.model(input_ids=tokens).logits.float()
    assert rel_err(torch.cat([last[:, None], rest], dim=1), full[:, 3:]) < MODEL_RTOL
    assert torch.equal(state.prefix_len, torch.tensor([10]))


def test_conditional_generation_uses_its_text_model():
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    # The wider init of ddtree_ext.tiny, so the logits are peaked enough for argmax checks.
    text = tiny_qwen3_5_config(layer_types=(LIN, FULL), initializer_range=0.2)
    config = Qwen3_5Config(
        text_config=text.to_dict(),
        vision_config=dict(
            depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=text.hidden_size
        ),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3_5ForConditionalGeneration(config).eval()
    adapter = TargetAdapter(model, (0,))  # layer 1 is the last: not tappable
    assert adapter.text_model is model.model.language_model and adapter.lm_head is model.lm_head
    assert adapter.is_hybrid and adapter.num_layers == 2 and adapter.vocab_size == TINY_VOCAB

    gen = torch.Generator().manual_seed(2)
    prompt = _tokens(gen, 1, 6)
    state = adapter.new_state(capacity=CAPACITY)
    logits, _ = adapter.prefill(prompt, state)
    with torch.no_grad():
        stock = model(input_ids=prompt).logits
    assert rel_err(logits, stock[:, -1]) < MODEL_RTOL
    tree = _random_tree(gen, state.prefix_len, 6, "random")
    tree_logits, taps = adapter.verify(tree, state)
    _assert_verify_matches_paths(adapter, prompt, tree, tree_logits, taps)


# ---- validation ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid():
    return make_tiny_target("qwen3_5", seed=1, layer_types=(LIN, FULL, LIN, FULL))


def test_unsupported_architecture_names_the_supported_ones():
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    with pytest.raises(ValueError, match="LlamaForCausalLM") as info:
        TargetAdapter(llama)
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(info.value)


@pytest.mark.parametrize("taps,message", [((-1,), "out of range"), ((0, 4), "out of range"), ((7,), "out of range"),
                                          ((0, 3), "the last decoder layer")])
def test_bad_tap_ids(hybrid, taps, message):
    with pytest.raises(ValueError, match=f"tap_layer_ids: .*{message}"):
        TargetAdapter(hybrid, taps)


def test_attention_implementation_without_tree_mask_is_refused():
    model = make_tiny_target("qwen3", seed=0)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="flash_attention_2"):
        TargetAdapter(model)


def test_a_hybrid_with_no_attention_layer_is_refused():
    """transformers' hybrid cache needs a full-attention layer (HF's own generate fails deep in its mask code)."""
    model = make_tiny_target("qwen3_5", seed=0, layer_types=("linear_attention",) * 4)
    with pytest.raises(ValueError, match="TargetAdapter: model: no 'full_attention' layer"):
        TargetAdapter(model)


def test_batch_above_one_is_refused(hybrid):
    with pytest.raises(ValueError, match="batch_size"):
        TargetAdapter(hybrid).new_state(2, capacity=CAPACITY)


def test_call_order_is_checked(hybrid):
    adapter = TargetAdapter(hybrid)
    state = adapter.new_state(capacity=CAPACITY)
    gen = torch.Generator().manual_seed(0)
    tree = _random_tree(gen, state.prefix_len, 3, "random")
    with pytest.raises(ValueError, match="prefill"):
        adapter.verify(tree, state)
    walk = Walk(torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), _tokens(gen, 1))
    with pytest.raises(ValueError, match="verify"):
        adapter.commit(walk, state)
    adapter.prefill(_tokens(gen, 1, 4), state)
    with pytest.raises(ValueError, match="empty"):
        adapter.prefill(_tokens(gen, 1, 4), state)
    with pytest.raises(ValueError, match="prefix_len"):
        adapter.verify(tree, state)  # built for the empty state
    adapter.verify(reference.tree_from_parents(tree.parent, tree.token, state.prefix_len), state)
    with pytest.raises(ValueError, match="commit"):
        adapter.forward_chain(_tokens(gen, 1, 1), state)
    with pytest.raises(ValueError, match="commit"):
        adapter.verify(tree, state)


def test_failed_verify_restores_layers_and_cache(hybrid, monkeypatch):
    """An error in the second GDN layer (after an attention layer wrote the nodes' K/V into scratch
    slots) leaves the GDN forwards, the committed state and pending as they were."""
    adapter = TargetAdapter(hybrid)
    gen = torch.Generator().manual_seed(4)
    prompt = _tokens(gen, 1, 5)
    state = adapter.new_state(capacity=CAPACITY)
    adapter.prefill(prompt, state)
    before = {k: v.clone() for k, v in _cache_tensors(adapter, state).items()}

    calls = []

    def failing(op):
        def failing_delta_rule(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected failure")
            return op(*args, **kwargs)
        return failing_delta_rule

    for name in ("gdn_conv_delta_rule", "tree_gated_delta_rule"):  # the one a GDN layer calls (target.fuse_gdn_conv)
        monkeypatch.setattr(target._ops, name, failing(getattr(target._ops, name)))
    tree = _random_tree(gen, state.prefix_len, 5, "random")
    with pytest.raises(RuntimeError, match="injected"):
        adapter.verify(tree, state)
    for i in adapter.gdn_layer_ids:
        assert "forward" not in vars(hybrid.model.layers[i].linear_attn)
    assert state.pending is None
    after = _cache_tensors(adapter, state)
    for name, t in before.items():
        assert torch.equal(after[name], t), name
    # And the state is still good: a chain forward after it agrees with the stock model.
    nxt = _tokens(gen, 1, 2)
    logits, _ = adapter.forward_chain(nxt, state)
    stock = hybrid(input_ids=torch.cat([prompt, nxt], dim=1)).logits[:, -2:]
    assert rel_err(logits, stock) < MODEL_RTOL


def test_capacity_is_checked_before_any_work(hybrid):
    adapter = TargetAdapter(hybrid)
    gen = torch.Generator().manual_seed(6)
    with pytest.raises(ValueError, match="capacity must be an int"):
        adapter.new_state(capacity=0)
    state = adapter.new_state(capacity=8)
    with pytest.raises(ValueError, match="exceed the state's capacity 8"):
        adapter.prefill(_tokens(gen, 1, 9), state)
    adapter.prefill(_tokens(gen, 1, 5), state)
    with pytest.raises(ValueError, match="capacity too small"):
        adapter.verify(_random_tree(gen, state.prefix_len, 4, "random"), state)  # slots 5..8 > 8
    assert state.pending is None
    adapter.verify(_random_tree(gen, state.prefix_len, 3, "random"), state)


def test_attention_width_does_not_change_the_result(adapter):
    """kv_len (the bucket of slots attention reads) only adds masked slots: the same tree over the
    smallest width and over the whole capacity gives the same logits and taps, even with large leftovers
    (as earlier rounds leave) in the scratch slots."""
    gen = torch.Generator().manual_seed(8)
    prompt = _tokens(gen, 1, 7)
    tree = None
    results = []
    for kv_len in (7 + 9, CAPACITY):
        state = adapter.new_state(capacity=CAPACITY)
        adapter.prefill(prompt, state)
        for i in adapter.attention_layer_ids:
            state.keys[i][:, :, 7:] = 1e4
            state.values[i][:, :, 7:] = -1e4
        tree = tree if tree is not None else _random_tree(gen, state.prefix_len, 9, "random")
        results.append(adapter.verify(tree, state, kv_len=kv_len))
    for a, b in zip(*results):
        assert rel_err(a, b) < 1e-6


@pytest.mark.parametrize("num_nodes", [1, 9])
def test_fused_gdn_conv_gives_the_bits_of_the_two_ops(adapter, monkeypatch, num_nodes):
    """target.fuse_gdn_conv: a GDN layer's conv and delta rule as one op (gdn_conv_delta_rule) or as tree_conv1d then
    tree_gated_delta_rule give the same logits, taps and GDN stash, bit for bit, on a tree and on a single node; the
    fused path runs the one op per GDN layer, the other none of it."""
    gen = torch.Generator().manual_seed(11)
    prompt = _tokens(gen, 1, 6)
    tree, results = None, []
    for fuse in (True, False):
        monkeypatch.setattr(target, "fuse_gdn_conv", fuse)
        calls = []
        stock = target._ops.gdn_conv_delta_rule
        monkeypatch.setattr(target._ops, "gdn_conv_delta_rule", lambda *a, **k: calls.append(1) or stock(*a, **k))
        state = adapter.new_state(capacity=CAPACITY)
        adapter.prefill(prompt, state)
        tree = tree if tree is not None else _random_tree(gen, state.prefix_len, num_nodes, "random")
        results.append((adapter.verify(tree, state), [tuple(state.pending.gdn[i]) for i in adapter.gdn_layer_ids]))
        monkeypatch.setattr(target._ops, "gdn_conv_delta_rule", stock)
        assert len(calls) == (len(adapter.gdn_layer_ids) if fuse else 0)
    (fused_out, fused_stash), (apart_out, apart_stash) = results
    assert all(torch.equal(a, b) for a, b in zip(fused_out, apart_out))
    for a, b in zip(fused_stash, apart_stash):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


BAD_WALKS = {
    "accept_len 0": ([[0, 1, -1]], [0], "accept_len"),
    "accept_len > D": ([[0, 1, 2]], [4], "accept_len"),
    "node >= N": ([[0, 5, -1]], [2], "accepted"),
    "node < 0": ([[-1, 1, -1]], [2], "accepted"),
    "not increasing": ([[0, 2, 1]], [3], "accepted"),
    "int64": (torch.tensor([[0, 1, -1]]), [2], "accepted"),
}


@pytest.mark.parametrize("case", BAD_WALKS, ids=list(BAD_WALKS))
def test_bad_walk_leaves_the_state_untouched(hybrid, monkeypatch, case):
    """A walk that is not a path of the verified tree is refused before ANY commit op runs (K/V, GDN
    state and conv windows are written by separate ops): every cache tensor stays bitwise the same and
    a valid walk still commits afterwards."""
    accepted, accept_len, field = BAD_WALKS[case]
    adapter = TargetAdapter(hybrid)
    gen = torch.Generator().manual_seed(5)
    state = adapter.new_state(capacity=CAPACITY)
    adapter.prefill(_tokens(gen, 1, 5), state)
    tree = _random_tree(gen, state.prefix_len, 5, "chain")
    adapter.verify(tree, state)
    before = {k: v.clone() for k, v in _cache_tensors(adapter, state).items()}
    prefix_before = state.prefix_len.clone()

    calls = []
    for name in ("commit_kv", "commit_gdn_state", "commit_conv_state"):
        op = getattr(target._ops, name)
        monkeypatch.setattr(target._ops, name, lambda *a, _op=op, _name=name: (calls.append(_name), _op(*a))[1])
    accepted = accepted if isinstance(accepted, torch.Tensor) else torch.tensor(accepted, dtype=torch.int32)
    walk = Walk(accepted, torch.tensor(accept_len, dtype=torch.int32), _tokens(gen, 1))
    with pytest.raises(ValueError, match=f"TargetAdapter.commit: walk.{field}"):
        adapter.commit(walk, state)
    assert not calls, f"commit ops ran before the error: {calls}"
    after = _cache_tensors(adapter, state)
    for name, t in before.items():
        assert torch.equal(after[name], t), name
    assert torch.equal(state.prefix_len, prefix_before) and state.pending is not None

    good = Walk(torch.tensor([[0, 1, -1]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32), _tokens(gen, 1))
    adapter.commit(good, state)
    assert sorted(set(calls)) == ["commit_conv_state", "commit_gdn_state", "commit_kv"]
    assert torch.equal(state.prefix_len, prefix_before + 2)


def test_record_layer_outputs_reads_tensor_and_tuple_outputs():
    """The one tap recorder (adapter and tiny drafts): a layer's output tensor, or the first element of
    the tuple older transformers' decoder layers return; hooks are gone after the context."""

    class TupleLayer(torch.nn.Module):
        def forward(self, x):
            return (x * 3, "attention weights")

    layers = torch.nn.ModuleList([torch.nn.Identity(), TupleLayer(), torch.nn.Identity()])
    x = torch.randn(1, 2, 4)
    with target.record_layer_outputs(layers, [1, 0]) as recorded:
        layers[0](x)
        layers[1](x)
        layers[2](x)
    assert sorted(recorded) == [0, 1]
    assert torch.equal(recorded[0], x) and torch.equal(recorded[1], x * 3)
    layers[1](x + 1)
    assert torch.equal(recorded[1], x * 3)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_verify_logits_in_the_heads_dtype_are_the_float32_logits(family):
    """verify_unchecked(float32_logits=False) (what a greedy round reads) returns the LM head's bf16 logits, whose
    float32 copy is the float32 verify's logits bit for bit, so their argmax (the walk's, ties to the lower id) is the
    same; the default stays float32."""
    adapter = TargetAdapter(make_tiny_target(family, seed=3, dtype=torch.bfloat16), TAPS)
    gen = torch.Generator().manual_seed(12)
    state = adapter.new_state(capacity=CAPACITY)
    adapter.prefill(_tokens(gen, 1, 9), state)
    tree = _random_tree(gen, state.prefix_len, 11, "random")
    full, taps_full = adapter.verify_unchecked(tree, state, 9 + 11)
    low, taps_low = adapter.verify_unchecked(tree, state, 9 + 11, float32_logits=False)
    assert full.dtype == torch.float32 and low.dtype == torch.bfloat16
    assert torch.equal(low.float(), full) and torch.equal(taps_low, taps_full)
    assert torch.equal(low.argmax(-1), full.argmax(-1))


def _count_rotary_calls(adapter, monkeypatch):
    """(the rotary embedding, a list that gets an entry per call of its class's forward, the stock forward)."""
    rotary = adapter.text_model.rotary_emb
    calls = []
    stock_forward = type(rotary).forward
    monkeypatch.setattr(type(rotary), "forward", lambda *a, **k: calls.append(1) or stock_forward(*a, **k))
    return rotary, calls, stock_forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_verify_rope_from_the_states_table_is_the_modules_rope(family, dtype, monkeypatch):
    """A verify gathers its RoPE rows from the state's table (new_state builds it with the rotary embedding itself):
    the logits, taps and GDN stash are those of a verify that runs the module (state.rope = None), bit for bit, at
    positions deep into the table; the module's own forward runs only without the table. Table rows far from the
    start are the module's output for that position alone."""
    adapter = TargetAdapter(make_tiny_target(family, seed=5, dtype=dtype), TAPS)
    rotary, calls, stock_forward = _count_rotary_calls(adapter, monkeypatch)
    gen = torch.Generator().manual_seed(13)
    prompt = _tokens(gen, 1, 9)
    results, tree = [], None
    for use_table in (True, False):
        state = adapter.new_state(capacity=CAPACITY)
        assert state.rope is not None and state.rope[0].shape[0] == CAPACITY and state.rope[0].dtype == dtype
        adapter.prefill(prompt, state)
        state.prefix_len += 120  # far rows: the slots past the prompt are zeros, masked or not, either way
        if not use_table:
            state.rope = None
        tree = tree if tree is not None else _random_tree(gen, state.prefix_len, 11, "random")
        calls.clear()
        logits, taps = adapter.verify(tree, state)
        assert bool(calls) == (not use_table)
        stash = [t for i in adapter.gdn_layer_ids for t in state.pending.gdn[i]]
        results.append((logits, taps, *stash))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    cos, sin = adapter.new_state(capacity=CAPACITY).rope
    for position in (0, 1, 77, CAPACITY - 1):
        like = torch.empty(1, 1, 1, dtype=dtype)
        positions = torch.tensor([[position]])
        own = stock_forward(rotary, like, positions[None].expand(3, -1, -1) if family == "qwen3_5" else positions)
        assert torch.equal(own[0][0, 0], cos[position]) and torch.equal(own[1][0, 0], sin[position])


def test_rope_rows_fall_back_to_the_module_for_positions_that_differ_by_axis():
    """Qwen3.5's RoPE reads a position per axis: rows expanded from one text row gather the table; rows that differ by
    axis (a multimodal prompt's) run the module itself."""
    adapter = TargetAdapter(make_tiny_target("qwen3_5", seed=5), TAPS)
    rotary = adapter.text_model.rotary_emb
    cos, sin = adapter.new_state(capacity=CAPACITY).rope
    x = torch.empty(1, 4, 1)
    text = torch.tensor([[3, 50, 51, 140]])
    by_axis = torch.stack([text, text + 1, text + 2])
    expanded = text[None].expand(3, -1, -1)
    for position_ids in (expanded, by_axis):
        got = target._rope_rows(rotary, cos, sin, x, position_ids)
        own = type(rotary).forward(rotary, x, position_ids)
        assert all(torch.equal(a, b) for a, b in zip(got, own))
    assert not torch.equal(target._rope_rows(rotary, cos, sin, x, by_axis)[0], cos[text[0]][None])


def test_rope_table_steps_aside_for_hooks_and_inexact_float32_matmuls(monkeypatch):
    """The rotary embedding runs its own forward where the table may not give its bits: a module with an accelerate hook
    (the hook moves tensors between devices), and float32 matmuls allowed to run in TF32. A state made then has no
    table; one made before does not read it."""
    adapter = TargetAdapter(make_tiny_target("qwen3", seed=5), TAPS)
    rotary, calls, stock_forward = _count_rotary_calls(adapter, monkeypatch)
    gen = torch.Generator().manual_seed(14)
    prompt = _tokens(gen, 1, 6)

    def verify_calls(state):
        adapter.prefill(prompt, state)
        calls.clear()
        adapter.verify(_random_tree(gen, state.prefix_len, 5, "random"), state)
        return len(calls)

    assert verify_calls(adapter.new_state(capacity=CAPACITY)) == 0
    made_before = adapter.new_state(capacity=CAPACITY)
    monkeypatch.setitem(rotary.__dict__, "_hf_hook", object())
    assert adapter.new_state(capacity=CAPACITY).rope is None
    assert verify_calls(made_before) == 1
    monkeypatch.delitem(rotary.__dict__, "_hf_hook")
    made_before = adapter.new_state(capacity=CAPACITY)
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert adapter.new_state(capacity=CAPACITY).rope is None
        assert verify_calls(made_before) == 1
    finally:
        torch.set_float32_matmul_precision(previous)


def test_verify_refuses_positions_outside_the_state():
    """A tree whose nodes sit at positions outside [0, capacity) is refused before any work (the RoPE table and the
    caches hold capacity rows), naming tree.position."""
    adapter = TargetAdapter(make_tiny_target("qwen3", seed=5), TAPS)
    gen = torch.Generator().manual_seed(15)
    state = adapter.new_state(capacity=32)
    adapter.prefill(_tokens(gen, 1, 5), state)
    tree = _random_tree(gen, state.prefix_len, 3, "chain")
    for bad in (40, -1):
        broken = tree._replace(position=tree.position.clone())
        broken.position[0, 2] = bad
        with pytest.raises(ValueError, match="tree.position"):
            adapter.verify(broken, state)
        assert state.pending is None
