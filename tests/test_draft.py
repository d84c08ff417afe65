"""DFlash draft: z-lab checkpoint loading, target checks, propose() against a dense re-derivation,
cache bookkeeping, and the tiny agreeing draft."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close, requires_cuda
from ddtree_ext.draft import DFlashDraftModel
from ddtree_ext.tiny import (
    draft_agreement,
    make_agreeing_draft,
    make_predictable_target,
    make_tiny_draft,
    make_tiny_target,
    target_taps,
    tiny_draft_config,
)


CAPACITY = 64  # draft cache rows in these tests: contexts of up to ~40 rows plus one block


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("qwen3")


def propose_args(target):
    return dict(embed_tokens=target.get_input_embeddings(), lm_head=target.get_output_embeddings())


def random_context(draft, batch, rows, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, rows, draft.context_hidden_size, generator=gen)


def random_bonus(batch, vocab, seed=0):
    return torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# Checkpoint format
# ---------------------------------------------------------------------------------------------


def save_zlab_checkpoint(draft, directory, *, shards=1, prefix=""):
    """Write ``draft`` the way z-lab publishes drafts: a Qwen3 config.json (without
    use_sliding_window, as theirs) and one safetensors file or an index of shards."""
    from safetensors.torch import save_file

    config = json.loads(draft.config.to_json_string(use_diff=False))
    config.pop("use_sliding_window")
    config["architectures"] = ["DFlashDraftModel"]
    (directory / "config.json").write_text(json.dumps(config))
    weights = {prefix + name: t.contiguous() for name, t in draft.state_dict().items()}
    if shards == 1:
        save_file(weights, directory / "model.safetensors")
        return
    names = sorted(weights)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: weights[n] for n in part}, directory / file)
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("shards,prefix", [(1, ""), (3, ""), (1, "model.")])
def test_from_pretrained_round_trip(target, tmp_path, shards, prefix):
    draft = make_tiny_draft(target, seed=3, sliding_window=4)
    save_zlab_checkpoint(draft, tmp_path, shards=shards, prefix=prefix)
    loaded = DFlashDraftModel.from_pretrained(tmp_path)

    assert loaded.config.sliding_window == 4  # kept although the file has no use_sliding_window
    assert (loaded.block_size, loaded.mask_token_id, loaded.target_layer_ids) == (
        draft.block_size,
        draft.mask_token_id,
        draft.target_layer_ids,
    )
    assert loaded.fc.weight.dtype == torch.float32 and loaded.fc.weight.device.type == "cpu"
    context, bonus = random_context(draft, 2, 12), random_bonus(2, 256)
    with torch.no_grad():
        expected = draft.propose(context, bonus, draft.new_cache(2, capacity=CAPACITY), **propose_args(target))
        actual = loaded.propose(context, bonus, loaded.new_cache(2, capacity=CAPACITY), **propose_args(target))
    assert torch.equal(actual, expected)


def test_from_pretrained_dtype(target, tmp_path):
    draft = make_tiny_draft(target)
    save_zlab_checkpoint(draft, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    loaded = DFlashDraftModel.from_pretrained(tmp_path)  # float32 weights, the config says bfloat16
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32).fc.weight.dtype == torch.float32
    # HF's spellings: "auto" (the config's), a name with or without "torch."
    assert DFlashDraftModel.from_pretrained(tmp_path, dtype="auto").fc.weight.dtype == torch.bfloat16
    assert DFlashDraftModel.from_pretrained(tmp_path, dtype="float16").fc.weight.dtype == torch.float16
    assert DFlashDraftModel.from_pretrained(tmp_path, dtype="torch.float32").fc.weight.dtype == torch.float32
    for bad in (torch.int8, "int8", "fp8", 16, torch.float8_e4m3fn, "float8_e4m3fn", torch.complex64):
        with pytest.raises(ValueError, match="from_pretrained: dtype must be None, 'auto', or one of bfloat16"):
            DFlashDraftModel.from_pretrained(tmp_path, dtype=bad)
    target_bf16 = make_tiny_target("qwen3", dtype=torch.bfloat16)
    with torch.no_grad():
        logits = loaded.propose(
            random_context(draft, 1, 5), random_bonus(1, 256), loaded.new_cache(capacity=CAPACITY), **propose_args(target_bf16)
        )
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_from_pretrained_config_variants(target, tmp_path):
    """A config that does not state its vocabulary is not checked against the target's (Qwen3Config's default 151936
    is not taken for it); num_target_layers is read from dflash_config too, as SGLang reads it."""
    draft = make_tiny_draft(target)
    save_zlab_checkpoint(draft, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("vocab_size")
    config.pop("num_target_layers", None)
    config["dflash_config"]["num_target_layers"] = 6  # the tiny target has 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert loaded.vocab_size is None
    with pytest.raises(ValueError, match="num_target_layers: the draft was trained for 6 target layers, target has 4"):
        loaded.check_target(target.config)
    config["dflash_config"]["num_target_layers"] = 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    DFlashDraftModel.from_pretrained(tmp_path).check_target(target.config)


def _edit_checkpoint(directory, edit):
    from safetensors.torch import load_file, save_file

    weights = load_file(directory / "model.safetensors")
    edit(weights)
    save_file(weights, directory / "model.safetensors")


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda w: w.pop("layers.1.self_attn.k_norm.weight"), r"missing weights layers\.1\.self_attn\.k_norm\.weight"),
        (lambda w: w.update({"lm_head.weight": torch.zeros(256, 64)}), r"unexpected weights lm_head\.weight"),
        (lambda w: w.update({"fc.weight": torch.zeros(64, 100)}), r"fc\.weight \(64, 100\) != \(64, 128\)"),
    ],
    ids=["missing", "unexpected", "shape"],
)
def test_from_pretrained_rejects_mismatched_weights(target, tmp_path, edit, message):
    save_zlab_checkpoint(make_tiny_draft(target), tmp_path)
    _edit_checkpoint(tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_from_pretrained_rejects_dflash2(target, tmp_path):
    save_zlab_checkpoint(make_tiny_draft(target), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["DFlash2DraftModel"]}))
    with pytest.raises(ValueError, match="DFlash2"):
        DFlashDraftModel.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "path, message",
    [
        (None, " must be a directory or a Hugging Face Hub id"),
        (3, " must be a directory or a Hugging Face Hub id"),
        ("./no/such/checkpoint", "no such directory"),
        ("{tmp}/missing", "no such directory"),
        ("a/b/c", "no such directory"),
        ("{tmp}/model.safetensors", "is a file; give the checkpoint's directory"),
    ],
)
def test_from_pretrained_refuses_paths(target, tmp_path, path, message):
    """A path that is no directory here and cannot be a Hub id names the argument; nothing goes to the Hub."""
    save_zlab_checkpoint(make_tiny_draft(target), tmp_path)
    if isinstance(path, str):
        path = path.format(tmp=tmp_path)
    with pytest.raises(ValueError, match=f"from_pretrained: path.*{message}"):
        DFlashDraftModel.from_pretrained(path)


def test_from_pretrained_without_config(target, tmp_path):
    save_zlab_checkpoint(make_tiny_draft(target), tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="from_pretrained: path: no config.json in"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_from_pretrained_hub_failure_names_the_path(target, monkeypatch):
    """A Hub id that the Hub does not give (unknown, or no network) is a ValueError naming the path, with the cause."""
    import huggingface_hub

    def refuse(repo_id, **kwargs):
        raise OSError(f"no repo {repo_id}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(ValueError, match=r"path 'nobody/nothing' is not a local directory.*OSError: no repo"):
        DFlashDraftModel.from_pretrained("nobody/nothing")


@pytest.mark.parametrize("device", ["gpu", 3.5, "mps", "cuda:99" if torch.cuda.is_available() else "cuda"])
def test_from_pretrained_refuses_devices(target, tmp_path, device):
    """A device the models cannot use is refused before any weight is read."""
    save_zlab_checkpoint(make_tiny_draft(target), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")  # reading it would fail differently
    with pytest.raises(ValueError, match=f"from_pretrained: device {device!r}: "):
        DFlashDraftModel.from_pretrained(tmp_path, device=device)


def test_from_pretrained_without_weights(target, tmp_path):
    save_zlab_checkpoint(make_tiny_draft(target), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        DFlashDraftModel.from_pretrained(tmp_path)


# ---------------------------------------------------------------------------------------------
# Config validation and target checks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "attributes,message",
    [
        (dict(block_size=1), "block_size"),
        (dict(block_size=258), r"block_size must be an int in 2\.\.257"),
        (dict(dflash_config={"mask_token_id": 255, "target_layer_ids": []}), "target_layer_ids"),
        (dict(dflash_config={"target_layer_ids": [1]}), "mask_token_id"),
        (dict(dflash_config={"mask_token_id": 255, "target_layer_ids": [True, 1]}),
         r"target_layer_ids must be a non-empty list of layer indices, got \[True, 1\]"),
        (dict(dflash_config={"mask_token_id": True, "target_layer_ids": [1]}), "mask_token_id must be a non-negative"),
        (dict(layer_types=["sliding_attention", "linear_attention"]), "layer_types"),
        (dict(layer_types=["full_attention"]), "layer_types has 1 entries for 2 layers"),
        (dict(sliding_window=None), "sliding_window"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(num_hidden_layers=0, layer_types=[]), "num_hidden_layers must be an int >= 1, got 0"),
    ],
)
def test_config_validation(target, attributes, message):
    config = tiny_draft_config(target.config)
    for name, value in attributes.items():  # set after construction: Qwen3Config validates some itself
        setattr(config, name, value)
    with pytest.raises(ValueError, match=message):
        DFlashDraftModel(config)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_check_target_accepts_its_target(family):
    target = make_tiny_target(family)
    make_tiny_draft(target).check_target(target.config)


@pytest.mark.parametrize("layers, taps", [(2, [0]), (3, [1]), (4, [1, 2]), (8, [1, 4, 6])])
def test_tiny_draft_taps_layers_short_of_the_last(layers, taps):
    """The tiny draft's default taps lie in 0 .. L - 2 (the last layer's HF hidden state is post-norm), for targets of
    2 layers up; a 1-layer target has no layer to tap."""
    target = make_tiny_target("qwen3", num_hidden_layers=layers)
    draft = make_tiny_draft(target)
    assert draft.target_layer_ids == taps
    draft.check_target(target.config)
    with pytest.raises(ValueError, match="needs at least 2 decoder layers, got 1"):
        tiny_draft_config(make_tiny_target("qwen3", num_hidden_layers=1).config)


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(hidden_size=96), "hidden_size"),
        (dict(vocab_size=200), "vocab_size: mask_token_id 255 is outside"),
        (dict(vocab_size=300), "vocab_size: the draft was made for a vocabulary of 256 tokens, the target has 300"),
        (dict(num_hidden_layers=2), "target_layer_ids"),  # taps [1, 2] need 3 layers
        (dict(num_hidden_layers=3), "target_layer_ids: the target's last layer"),  # tap 2 is the last
        (dict(num_hidden_layers=6), "num_target_layers"),
    ],
)
def test_check_target_names_the_mismatch(target, change, field):
    draft = make_tiny_draft(target)
    text = target.config
    fields = dict(hidden_size=text.hidden_size, vocab_size=text.vocab_size, num_hidden_layers=text.num_hidden_layers)
    with pytest.raises(ValueError, match=field):
        draft.check_target(SimpleNamespace(**{**fields, **change}))


# ---------------------------------------------------------------------------------------------
# propose(): shapes, argument checks, cache bookkeeping
# ---------------------------------------------------------------------------------------------


def test_propose_shapes_and_dtypes(target):
    draft = make_tiny_draft(target, block_size=6)
    cache = draft.new_cache(3, capacity=CAPACITY)
    with torch.no_grad():
        logits = draft.propose(random_context(draft, 3, 7), random_bonus(3, 256), cache, **propose_args(target))
    assert logits.shape == (3, 5, 256) and logits.dtype == torch.float32
    assert cache.length.tolist() == [7, 7, 7]
    assert len(cache.keys) == 2 and cache.keys[0].shape == (3, 2, CAPACITY, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scaling", [None, "output_multiplier", "final_logit_softcapping"])
def test_propose_logits_in_head_dtype(scaling, dtype):
    """float32_logits=False: the LM head's own dtype, whose float32 values are the default call's exactly; a draft
    that scales or caps its logits (in float32) still returns float32."""
    target = make_tiny_target("qwen3", dtype=dtype)
    extra = {} if scaling is None else {"dflash_config": {"mask_token_id": 7, "target_layer_ids": [0, 3], scaling: 0.4}}
    draft = make_tiny_draft(target, block_size=6, **extra)
    context, bonus = random_context(draft, 1, 7).to(dtype), random_bonus(1, 256)
    with torch.no_grad():
        default = draft.propose(context, bonus, draft.new_cache(1, capacity=CAPACITY), **propose_args(target))
        kept = draft.propose(context, bonus, draft.new_cache(1, capacity=CAPACITY), float32_logits=False,
                             **propose_args(target))
    assert default.dtype == torch.float32
    assert kept.dtype == (dtype if scaling is None else torch.float32)
    assert torch.equal(kept.float(), default)


def test_hooked_projection_keeps_its_rows(target):
    """At batch 1 the layers' [context ; block] rows live in one buffer that each layer's norm overwrites; a hook on
    the attention's projections sees its input, so with one the layers concatenate their own rows: what the hook
    kept is still the first layer's input after the call, and the logits are the same bits."""
    draft = make_tiny_draft(target, seed=1)
    context, bonus = random_context(draft, 1, 4, seed=2), random_bonus(1, 256, seed=2)
    with torch.no_grad():
        plain = draft.propose(context, bonus, draft.new_cache(1, capacity=CAPACITY), **propose_args(target))
    kept = []
    handle = draft.layers[0].self_attn.k_proj.register_forward_hook(
        lambda module, args, output: kept.append((args[0], args[0].clone())))
    with torch.no_grad():
        try:
            assert not draft._one_rows_buffer(1)
            hooked = draft.propose(context, bonus, draft.new_cache(1, capacity=CAPACITY), **propose_args(target))
        finally:
            handle.remove()
        assert draft._one_rows_buffer(1) and not draft._one_rows_buffer(2)
    assert len(kept) == 1 and torch.equal(kept[0][0], kept[0][1])
    assert torch.equal(hooked, plain)


@pytest.mark.parametrize(
    "context_shape,bonus,message",
    [
        ((1, 4, 100), torch.tensor([3]), "context_hidden"),
        ((1, 0, 128), torch.tensor([3]), "context_hidden"),
        ((4, 128), torch.tensor([3]), "context_hidden"),
        ((1, 4, 128), torch.tensor([3], dtype=torch.int32), "bonus_token"),
        ((1, 4, 128), torch.tensor([3, 4]), "bonus_token"),
    ],
)
def test_propose_rejects_bad_arguments(target, context_shape, bonus, message):
    draft = make_tiny_draft(target)
    cache = draft.new_cache(context_shape[0], capacity=CAPACITY)
    with pytest.raises(ValueError, match=f"DFlashDraftModel.propose: {message}"):
        draft.propose(torch.zeros(context_shape), bonus, cache, **propose_args(target))
    assert int(cache.length.max()) == 0


def test_propose_rejects_batch_change(target):
    draft = make_tiny_draft(target)
    cache = draft.new_cache(2, capacity=CAPACITY)
    with torch.no_grad():
        draft.propose(random_context(draft, 2, 3), random_bonus(2, 256), cache, **propose_args(target))
        with pytest.raises(ValueError, match="batch size 2"):
            draft.propose(random_context(draft, 1, 3), random_bonus(1, 256), cache, **propose_args(target))


@pytest.mark.parametrize("splits", [(5, 7), (3, 1, 1, 1, 6), (11, 1)])
def test_context_appended_in_pieces_equals_one_call(target, splits):
    """Context K/V land at their own positions however they are appended, and the blocks proposed on
    the way (with other bonus tokens) leave nothing behind: scratch rows are poisoned between calls."""
    draft = make_tiny_draft(target, sliding_window=5)
    context, bonus = random_context(draft, 2, sum(splits)), random_bonus(2, 256)
    with torch.no_grad():
        one_cache = draft.new_cache(2, capacity=CAPACITY)
        expected = draft.propose(context, bonus, one_cache, **propose_args(target))

        cache, start = draft.new_cache(2, capacity=CAPACITY), 0
        for i, rows in enumerate(splits):
            piece_bonus = bonus if i == len(splits) - 1 else random_bonus(2, 256, seed=100 + i)
            actual = draft.propose(context[:, start : start + rows], piece_bonus, cache, **propose_args(target))
            start += rows
            assert cache.length.tolist() == [start, start]
            for store in (cache.keys, cache.values):
                for buffer in store:
                    buffer[:, :, start:] = float("nan")
    assert_close(actual, expected, torch.float32, "logits")
    for i in range(len(draft.layers)):
        for name, pieces, whole in (("keys", cache.keys, one_cache.keys), ("values", cache.values, one_cache.values)):
            assert_close(pieces[i][:, :, :start], whole[i][:, :, :start], torch.float32, name)


@pytest.mark.parametrize("grad", [False, True], ids=["ops", "autograd"])
@pytest.mark.parametrize("sliding_window", [None, 3])
def test_padded_context_equals_exact_context(target, sliding_window, grad, monkeypatch):
    """The fixed-shape call of a captured round: block_size context rows of which num_context[b] are
    real, with an explicit kv_len, gives the logits and cache of a call with exactly the real rows,
    row by row (each batch row its own count), over several calls. Without grad the K/V rows go through
    ops.store_kv (padding rows skipped by their negative slots); with grad through index copies. The slots
    themselves are checked too: on CUDA the store writes rows in parallel, so a padding row given a block row's
    slot would race it, where the CPU's ordered copies let the block row win."""
    import ddtree_ext.draft as draft_module

    preludes = []

    class RecordedPrelude(draft_module._Prelude):
        def __init__(self, *args):
            super().__init__(*args)
            preludes.append(self)

    monkeypatch.setattr(draft_module, "_Prelude", RecordedPrelude)
    kw = {} if sliding_window is None else dict(sliding_window=sliding_window)
    draft = make_tiny_draft(target, seed=4, block_size=5, **kw)
    counts = [(3, 1), (5, 2), (1, 5), (2, 2)]
    context = random_context(draft, 2, 5 * len(counts), seed=7)
    with torch.set_grad_enabled(grad):
        exact = [draft.new_cache(1, capacity=CAPACITY) for _ in range(2)]
        padded = draft.new_cache(2, capacity=CAPACITY)
        offsets = [0, 0]
        for r, count in enumerate(counts):
            bonus = random_bonus(2, 256, seed=r)
            rows = torch.randn(2, draft.block_size, draft.context_hidden_size)  # padding stays random
            expected = []
            for b in range(2):
                real = context[b : b + 1, offsets[b] : offsets[b] + count[b]]
                rows[b, : count[b]] = real[0]
                expected.append(draft.propose(real, bonus[b : b + 1], exact[b], **propose_args(target)))
                offsets[b] += count[b]
            # The narrowest width the call may read: every row's length + n + block_size.
            kv_len = max(offsets) + draft.block_size
            lengths = padded.length.tolist()
            actual = draft.propose(
                rows, bonus, padded, num_context=torch.tensor(count), kv_len=kv_len, **propose_args(target)
            )
            for b in range(2):  # real context rows, padding (not stored), then the block right after the real rows
                start = lengths[b] + count[b]
                want = [*range(lengths[b], start), *[-1] * (draft.block_size - count[b]),
                        *range(start, start + draft.block_size)]
                assert preludes[-1].kv_slots[b].tolist() == want, (r, b)
            assert padded.length.tolist() == offsets
            assert_close(actual, torch.cat(expected), torch.float32, f"call {r}")
    for b in range(2):
        for i in range(len(draft.layers)):
            for name in ("keys", "values"):
                got, want = getattr(padded, name)[i][b, :, : offsets[b]], getattr(exact[b], name)[i][0, :, : offsets[b]]
                assert_close(got, want, torch.float32, name)


def test_propose_checks_capacity_and_padding(target):
    draft = make_tiny_draft(target, block_size=4)
    with pytest.raises(ValueError, match="new_cache: capacity"):
        draft.new_cache(1, capacity=3)
    cache = draft.new_cache(1, capacity=10)
    with torch.no_grad(), pytest.raises(ValueError, match="capacity 10 < 11"):
        draft.propose(random_context(draft, 1, 7), random_bonus(1, 256), cache, **propose_args(target))
    with torch.no_grad(), pytest.raises(ValueError, match="num_context"):
        draft.propose(random_context(draft, 1, 3), random_bonus(1, 256), cache, num_context=torch.tensor([1.0]),
                      **propose_args(target))
    with torch.no_grad(), pytest.raises(ValueError, match="at most block_size"):
        draft.propose(random_context(draft, 1, 5), random_bonus(1, 256), cache, num_context=torch.tensor([2]),
                      **propose_args(target))
    for count in (0, 4):
        with torch.no_grad(), pytest.raises(ValueError, match=r"num_context must lie in \[1, 3\]"):
            draft.propose(random_context(draft, 1, 3), random_bonus(1, 256), cache,
                          num_context=torch.tensor([count]), **propose_args(target))
    for kv_len in (0, 11, 4.0, True):
        with torch.no_grad(), pytest.raises(ValueError, match="kv_len must be an int in"):
            draft.propose(random_context(draft, 1, 3), random_bonus(1, 256), cache, num_context=torch.tensor([3]),
                          kv_len=kv_len, **propose_args(target))
    assert cache.length.tolist() == [0]


def test_failed_propose_leaves_the_cache_as_it_was(target):
    """An LM head that raises once: the retry must see the cache of before the failed call (its context
    rows not counted as appended), so it equals one clean call."""
    draft = make_tiny_draft(target)
    context, bonus = random_context(draft, 1, 5), random_bonus(1, 256)
    head = target.get_output_embeddings()
    failures = []

    def failing_once(hidden):
        if not failures:
            failures.append(1)
            raise RuntimeError("lm_head failed")
        return head(hidden)

    with torch.no_grad():
        expected = draft.propose(context, bonus, draft.new_cache(capacity=CAPACITY), **propose_args(target))
        cache = draft.new_cache(capacity=CAPACITY)
        with pytest.raises(RuntimeError, match="lm_head failed"):
            draft.propose(context, bonus, cache, embed_tokens=target.get_input_embeddings(), lm_head=failing_once)
        assert cache.length.tolist() == [0]
        actual = draft.propose(context, bonus, cache, embed_tokens=target.get_input_embeddings(), lm_head=failing_once)
    assert cache.length.tolist() == [5]
    assert_close(actual, expected, torch.float32, "logits")


# ---------------------------------------------------------------------------------------------
# propose() against a dense re-derivation of the DFlash math
# ---------------------------------------------------------------------------------------------


def dense_reference(draft, target, context_hidden, bonus):
    """Float64 DFlash logits for one block after ALL of ``context_hidden``, written from the definition:
    dense attention scores with an explicit visibility rule, rotate-half RoPE, x * w RMSNorms."""
    cfg = draft.config
    w = {name: t.double() for name, t in draft.state_dict().items()}
    embed_weight = target.get_input_embeddings().weight.double()
    head_weight = target.get_output_embeddings().weight.double()
    dflash = cfg.dflash_config
    batch, ctx_len = context_hidden.shape[:2]
    block, heads, kv_heads, dim = draft.block_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * weight

    positions = torch.arange(ctx_len + block, dtype=torch.float64)
    inv_freq = cfg.rope_parameters["rope_theta"] ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angle = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)  # [T + S, dim]

    def rope(x, rows):  # x [B, n, H, dim] at positions rows
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * angle[rows, None].cos() + rotated * angle[rows, None].sin()

    def visible(layer_type, q, k):
        sliding = layer_type == "sliding_attention"
        causal = sliding if getattr(cfg, "is_causal", None) is None else cfg.is_causal
        if causal and k > q:
            return False
        if sliding and q - k >= cfg.sliding_window:
            return False
        return not (sliding and not causal and k - q >= cfg.sliding_window)

    context = rms(context_hidden.double() @ w["fc.weight"].T, w["hidden_norm.weight"])
    ids = torch.full((batch, block), dflash["mask_token_id"])
    ids[:, 0] = bonus
    x = F.embedding(ids, embed_weight) * dflash.get("input_embedding_scale", 1.0)
    q_rows, kv_rows = torch.arange(ctx_len, ctx_len + block), torch.arange(ctx_len + block)
    for i, layer_type in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        kv_in = torch.cat([context, h], dim=1)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(batch, block, heads, dim)
        q = rope(rms(q, w[p + "self_attn.q_norm.weight"]), q_rows)
        k = (kv_in @ w[p + "self_attn.k_proj.weight"].T).view(batch, -1, kv_heads, dim)
        k = rope(rms(k, w[p + "self_attn.k_norm.weight"]), kv_rows).repeat_interleave(heads // kv_heads, dim=2)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(batch, -1, kv_heads, dim)
        v = v.repeat_interleave(heads // kv_heads, dim=2)
        allowed = torch.tensor([[visible(layer_type, int(qp), int(kp)) for kp in kv_rows] for qp in q_rows])
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dim)
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        x = x + torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, block, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gated = F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
        x = x + gated @ w[p + "mlp.down_proj.weight"].T
    logits = rms(x[:, 1:], w["norm.weight"]) @ head_weight.T * dflash.get("output_multiplier", 1.0)
    cap = dflash.get("final_logit_softcapping")
    return torch.tanh(logits / cap) * cap if cap else logits


ATTENTION_CASES = {
    # z-lab's Qwen3.6 layout: causal windowed sliding layers, non-causal full layer.
    "sliding+full": dict(layer_types=["sliding_attention", "full_attention"]),
    "window<block": dict(layer_types=["sliding_attention", "sliding_attention"], sliding_window=3),
    "is_causal=False": dict(layer_types=["sliding_attention", "full_attention"], is_causal=False),
    "is_causal=True": dict(layer_types=["full_attention", "full_attention"], is_causal=True),
    "scaled": dict(
        layer_types=["sliding_attention", "full_attention"],
        dflash_config={
            "mask_token_id": 7,
            "target_layer_ids": [0, 3],
            "input_embedding_scale": 1.7,
            "output_multiplier": 0.4,
            "final_logit_softcapping": 2.0,
        },
    ),
}


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=list(ATTENTION_CASES))
def test_propose_matches_dense_reference(target, case):
    kw = {"sliding_window": 6, **ATTENTION_CASES[case]}
    draft = make_tiny_draft(target, seed=1, **kw)
    context, bonus = random_context(draft, 2, 13, seed=2), random_bonus(2, 256, seed=2)
    expected = dense_reference(draft, target, context, bonus)
    cache = draft.new_cache(2, capacity=CAPACITY)
    with torch.no_grad():
        draft.propose(context[:, :9], random_bonus(2, 256, seed=9), cache, **propose_args(target))
        actual = draft.propose(context[:, 9:], bonus, cache, **propose_args(target))
    assert_close(actual, expected.float(), torch.float32, case)


def _layers_one_by_one(self, normed, hidden, context, cos, sin, cache, prelude, kv_len, rows=None):
    """DFlashDraftModel._run_layers as the layers' own forwards in turn (each its own input norm and mask, its
    [context ; block] rows concatenated), then the final norm."""
    for i, layer in enumerate(self.layers):
        hidden = layer(hidden, context, cos, sin, cache.keys[i], cache.values[i], prelude.kv_slots, prelude.block_rows,
                       kv_len)
    return self.norm(hidden[:, 1:])


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["sliding+full", "is_causal=True"])
def test_propose_gives_its_layers_own_bits(target, case, dtype, batch, monkeypatch):
    """propose runs the layers with each residual add fused into the norm after it (ops.add_rms_norm), one mask per
    attention rule and, at batch 1, the norms writing the rows [context ; block] into one buffer that every layer's
    K/V projection reads (no concatenation a layer): the logits and the cache are the bits of the layers' own
    forwards run in turn, in both bf16 and float32, over two calls (the second reads the first one's cache)."""
    from ddtree_ext import ops
    from ddtree_ext.draft import DFlashAttention, DFlashDraftModel

    kw = {"sliding_window": 6, **ATTENTION_CASES[case]}
    draft = make_tiny_draft(target, seed=1, **kw).to(dtype)
    head = torch.nn.Linear(target.config.hidden_size, target.config.vocab_size, bias=False).to(dtype)
    head.weight.data.copy_(target.get_output_embeddings().weight.to(dtype))
    embed = torch.nn.Embedding.from_pretrained(target.get_input_embeddings().weight.to(dtype))
    context, bonus = random_context(draft, batch, 13, seed=2).to(dtype), random_bonus(batch, 256, seed=2)
    calls = {"add_rms_norm": 0, "store_kv": 0}
    rows_given = []
    stock_attention = DFlashAttention.forward

    def spied_attention(self, *args, rows=None, **kwargs):
        rows_given.append(rows is not None)
        return stock_attention(self, *args, rows=rows, **kwargs)

    monkeypatch.setattr(DFlashAttention, "forward", spied_attention)

    def counted(name):
        stock = getattr(ops, name)

        def count(*args, **kwargs):
            calls[name] += 1
            return stock(*args, **kwargs)

        return count

    for name in calls:
        monkeypatch.setattr(ops, name, counted(name))
    runs = []
    for run_layers in (DFlashDraftModel._run_layers, _layers_one_by_one):
        monkeypatch.setattr(DFlashDraftModel, "_run_layers", run_layers)
        cache = draft.new_cache(batch, capacity=CAPACITY)
        with torch.no_grad():
            first = draft.propose(context[:, :9], random_bonus(batch, 256, seed=9), cache, embed_tokens=embed,
                                  lm_head=head)
            runs.append((first, draft.propose(context[:, 9:], bonus, cache, embed_tokens=embed, lm_head=head), cache))
    # The first run's layers (two calls): one buffer of rows at batch 1; the second run's concatenate.
    assert rows_given == [batch == 1] * (2 * len(draft.layers)) + [False] * (2 * len(draft.layers))
    assert calls["add_rms_norm"] == 2 * 2 * len(draft.layers)  # two per layer and call, in the first run only
    assert calls["store_kv"] == 2 * 2 * len(draft.layers)  # one per layer and call (context and block), both runs
    (first_a, second_a, cache_a), (first_b, second_b, cache_b) = runs
    assert torch.equal(first_a, first_b) and torch.equal(second_a, second_b)
    assert all(torch.equal(a, b) for a, b in zip(cache_a.keys + cache_a.values, cache_b.keys + cache_b.values))


@pytest.mark.parametrize("batch", [1, 2])  # 1: the rounds' one buffer of [context ; block] rows
@pytest.mark.parametrize("variant", ["fused-store", "store-apart", "padded-context"])
@pytest.mark.parametrize("case", ["sliding+full", "scaled"])
def test_stacked_draft_runs_one_gemm_and_one_norm_rope_per_layer(target, case, variant, batch, monkeypatch):
    """With its q/k/v stacked (``stack_projections``), a draft layer's attention over a round's context rows (no more
    than the block's) runs one GEMM over every [context ; block] row and one ``qk_norm_rope_store_kv`` launch (the
    context rows' queries computed and dropped), where the unstacked one runs three GEMMs, four norm and RoPE launches
    and a store_kv; with ``fuse_kv_store`` off, the norms, RoPE and store_kv after the one GEMM. A prompt's context (more
    rows than the block's) runs apart. Over two calls (the second reads the first one's cache, its context exact or
    padded to the block): the dense reference's logits, and the unstacked draft's logits and cache."""
    import copy

    from ddtree_ext import fused, ops

    monkeypatch.setattr(fused, "fuse_kv_store", variant != "store-apart")
    kw = {"sliding_window": 6, **ATTENTION_CASES[case]}
    apart = make_tiny_draft(target, seed=1, **kw)
    stacked = copy.deepcopy(apart)
    assert fused.stack_projections(stacked) == 2 * len(stacked.layers)
    block, layers = apart.block_size, len(apart.layers)
    assert 9 > block >= 4  # the first call's context is a prompt's, the second's a round's
    context, bonus = random_context(apart, batch, 13, seed=2), random_bonus(batch, 256, seed=2)
    calls, stores = [], []
    stock, stock_store = ops.qk_norm_rope_store_kv, ops.store_kv
    monkeypatch.setattr(ops, "qk_norm_rope_store_kv", lambda *a, **k: calls.append(a[0].shape) or stock(*a, **k))
    monkeypatch.setattr(ops, "store_kv", lambda *a, **k: stores.append(1) or stock_store(*a, **k))
    runs = []
    for draft in (apart, stacked):
        cache = draft.new_cache(batch, capacity=CAPACITY)
        with torch.no_grad():
            draft.propose(context[:, :9], random_bonus(batch, 256, seed=9), cache, **propose_args(target))
            assert not calls and len(stores) == layers  # the prompt's context: apart
            calls.clear()
            stores.clear()
            if variant == "padded-context":
                rows = torch.randn(batch, block, draft.context_hidden_size, generator=torch.Generator().manual_seed(3))
                rows[:, :4] = context[:, 9:]
                logits = draft.propose(rows, bonus, cache, num_context=torch.tensor([4] * batch), kv_len=13 + block,
                                       **propose_args(target))
            else:
                logits = draft.propose(context[:, 9:], bonus, cache, **propose_args(target))
        runs.append((logits, cache))
        one_launch = draft is stacked and variant != "store-apart"
        context_rows = block if variant == "padded-context" else 4
        shape = (batch, context_rows + block, draft.config.num_attention_heads, draft.config.head_dim)
        assert calls == ([shape] * layers if one_launch else [])
        assert len(stores) == (0 if one_launch else layers)
        calls.clear()
        stores.clear()
    (logits_apart, cache_apart), (logits_stacked, cache_stacked) = runs
    assert_close(logits_stacked, dense_reference(apart, target, context, bonus).float(), torch.float32, case)
    assert_close(logits_stacked, logits_apart, torch.float32, case)
    for a, b in zip(cache_apart.keys + cache_apart.values, cache_stacked.keys + cache_stacked.values):
        assert_close(b[:, :, :13], a[:, :, :13], torch.float32, f"{case} cache")  # past 13: the blocks' scratch rows


def test_dense_reference_sees_the_window(target):
    """Guard for the test above: the window and causality do change the logits of this setup."""
    context, bonus = random_context(make_tiny_draft(target), 1, 13), random_bonus(1, 256)
    variants = [
        make_tiny_draft(target, seed=1, layer_types=["sliding_attention"] * 2, sliding_window=w, is_causal=c)
        for w, c in [(3, None), (100, None), (100, False)]
    ]
    logits = [dense_reference(d, target, context, bonus) for d in variants]
    assert not torch.allclose(logits[0], logits[1]) and not torch.allclose(logits[1], logits[2])


# ---------------------------------------------------------------------------------------------
# The tiny agreeing draft
# ---------------------------------------------------------------------------------------------


def test_make_agreeing_draft_is_deterministic(target):
    a = make_agreeing_draft(target, seed=5, steps=3, num_prompts=8, batch_size=4, new_tokens=12)
    b = make_agreeing_draft(target, seed=5, steps=3, num_prompts=8, batch_size=4, new_tokens=12)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_target_taps_are_the_tapped_layer_outputs(family):
    """The hooks record what z-lab reads as hidden_states[id + 1] (ids short of the last layer, whose
    hidden_states entry is post-norm), in the order asked for."""
    target = make_tiny_target(family)
    ids = [2, 0, 1]
    input_ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden_states = target(input_ids=input_ids, output_hidden_states=True).hidden_states
    assert torch.equal(target_taps(target, input_ids, ids), torch.cat([hidden_states[i + 1] for i in ids], dim=-1))


@pytest.fixture(scope="module")
def agreeing_pair():
    target = make_predictable_target("qwen3_5")
    return target, make_agreeing_draft(target)


def test_agreeing_draft_agrees(agreeing_pair):
    target, draft = agreeing_pair
    agreement = draft_agreement(draft, target)
    assert agreement.top1[0] > 0.6 and agreement.top1[-1] > 0.3, agreement
    assert (agreement.topk >= agreement.top1).all()
    assert agreement.topk[0] > agreement.top1[0] + 0.05, "top-2..4 should catch some depth-1 misses"
    assert agreement.chain_accept_length > 3.0, agreement


def test_untrained_draft_does_not_agree(agreeing_pair):
    """The bounds above are not met by chance: the same draft before training fails them."""
    target, _ = agreeing_pair
    agreement = draft_agreement(make_tiny_draft(target, weight_std=0.05), target)
    assert agreement.top1[0] < 0.3 and agreement.chain_accept_length < 2.0, agreement


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_table_gives_the_rotary_embeddings_bits(target, dtype, device, monkeypatch):
    """new_cache tabulates the draft's RoPE at every row's position, and propose gathers its rows from the table instead
    of calling the rotary embedding: the same logits and cache bits as the rotary embedding's own values (a cache
    without the table, or with one that fused.rope_table_serves refuses at the call: float32 matmuls that may run in
    TF32 since it was built), over two calls with a padded context; a RoPE type that follows the sequence length gets
    no table."""
    draft = make_tiny_draft(target, seed=4, sliding_window=6).to(device=device, dtype=dtype)
    head = torch.nn.Linear(target.config.hidden_size, target.config.vocab_size, bias=False).to(device=device, dtype=dtype)
    head.weight.data.copy_(target.get_output_embeddings().weight.to(dtype))
    embed = torch.nn.Embedding.from_pretrained(target.get_input_embeddings().weight.to(device=device, dtype=dtype))
    args = dict(embed_tokens=embed, lm_head=head)
    context = random_context(draft, 2, 15, seed=5).to(device=device, dtype=dtype)
    rotary_calls = []
    stock = type(draft.rotary_emb).forward
    monkeypatch.setattr(type(draft.rotary_emb), "forward", lambda self, *a: rotary_calls.append(1) or stock(self, *a))
    runs = []
    for table in ("read", "dropped", "refused"):
        cache = draft.new_cache(2, capacity=CAPACITY)
        assert cache.cos is not None and cache.cos.shape == (CAPACITY, draft.layers[0].self_attn.head_dim)
        for row in (0, CAPACITY // 2, CAPACITY - 1):  # every row, not only those these calls read: a row alone
            alone = stock(draft.rotary_emb, context[:, :1], torch.tensor([[row]], device=device))
            assert torch.equal(cache.cos[row], alone[0][0, 0]) and torch.equal(cache.sin[row], alone[1][0, 0])
        if table == "dropped":
            cache.cos = cache.sin = None
        rotary_calls.clear()
        with torch.no_grad(), monkeypatch.context() as m:
            if table == "refused":  # only what the rule reads: the matmuls themselves stay exact
                m.setattr(torch, "get_float32_matmul_precision", lambda: "high")
            first = draft.propose(context[:, :9], random_bonus(2, 256, seed=6).to(device), cache, **args)
            second = draft.propose(context[:, 9:15], random_bonus(2, 256, seed=7).to(device), cache, **args,
                                   num_context=torch.tensor([6, 4], device=device))
        assert len(rotary_calls) == (0 if table == "read" else 2), table
        runs.append((first, second, cache))
    first_a, second_a, cache_a = runs[0]
    for first_b, second_b, cache_b in runs[1:]:
        assert torch.equal(first_a, first_b) and torch.equal(second_a, second_b)
        assert all(torch.equal(a, b) for a, b in zip(cache_a.keys + cache_a.values, cache_b.keys + cache_b.values))
    monkeypatch.setattr(draft.rotary_emb, "rope_type", "dynamic", raising=False)
    assert draft.new_cache(1, capacity=CAPACITY).cos is None
