"""generate(): exact speculative decoding of a Hugging Face target with a DDTree over a DFlash draft.

One round, for the last emitted token (the root, not yet run through the target) at position
``prefix``: the draft proposes a block of per-depth distributions -> the tree is built from their
top-K -> ONE target forward verifies every node -> the walk accepts the longest path the target
agrees with -> the target's caches and the draft's context commit that path. The tokens emitted
per round are the accepted path (root excluded) plus the target's own token at its end (the bonus),
which becomes the next root.

Every emitted token is the target's choice given its true prefix (argmax, or a draw by the one
sampling rule of :func:`ddtree_ext.ops.walk_sample`), so all three methods produce the target's own
greedy output and sample the target's own distribution. For sampling, the uniform that draws the
token at sequence position ``p`` is the ``p``-th draw of a stream seeded by ``seed``, whatever the
method: with one seed the three methods draw the same tokens (up to float rounding of the logits).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from ddtree_ext import ops
from ddtree_ext.round import DecodeRound, kv_bucket

if TYPE_CHECKING:  # the runtime imports are lazy: importing ddtree_ext must not pull in transformers
    from ddtree_ext.draft import DFlashDraftModel
    from ddtree_ext.target import TargetAdapter

METHODS = ("ddtree", "dflash", "autoregressive")
MAX_TREE_BUDGET = 256  # the largest tree the compiled ops support (nodes besides the root)
MIN_TEMPERATURE = 1e-5  # below it (but above 0), logits / temperature can overflow float32
STAGES = ("prefill", "draft", "build", "verify", "walk", "commit")


@dataclass
class GenerationStats:
    """What one :func:`generate` call did and where its time went.

    A round is one target forward after the prefill (a tree verify, or one autoregressive step).
    ``accept_lengths[r]`` = tokens committed by round r = accepted tree tokens + the bonus token
    (always 1 for autoregressive). The prefill emits the first new token outside any round, and the
    last round may be cut short by ``max_new_tokens`` or EOS, so ``new_tokens`` can differ from
    ``1 + sum(accept_lengths)``.

    ``spine_accept_lengths`` (greedy DDTree with the spine only): per round, what the spine alone
    (the draft's top-1 chain, i.e. DFlash's chain when the budget is at least ``block_size - 1``)
    would have committed on the same verify; ``accept_lengths[r] > spine_accept_lengths[r]`` means
    the tree accepted a node off the spine. ``stage_time_s`` holds the seconds spent per stage of
    :data:`STAGES` (device time from CUDA events on GPUs, host time on CPU), and ``round_stage_s``
    the same per round; ``round_time_s`` the host wall time from the previous round's result (the
    first round: from its launch) to this one's; ``round_launched_ahead[r]`` whether round r was
    launched before round r - 1 was read, so that the host's work between rounds overlapped the
    device's (on a GPU: all rounds but the first and those after a round that began fewer than a
    longest path, ``block_size`` tokens or 1 for autoregressive, before ``max_new_tokens``; never on
    the CPU); ``round_replayed[r]`` whether round r was replayed from a CUDA graph; ``graph_captures``
    how many attention widths were captured (0 on the eager path; two graphs each, since stats time the
    stages) and ``graph_capture_s`` the host seconds that took (counted in ``round_time_s`` of the
    round read while the capture ran). Stage times are recorded only when generate() returns the stats.
    """

    method: str
    tree_budget: int  # nodes verified per round besides the root (0 for autoregressive)
    prompt_tokens: int
    new_tokens: int = 0
    accept_lengths: List[int] = field(default_factory=list)
    spine_accept_lengths: Optional[List[int]] = None
    wall_time_s: float = 0.0
    stage_time_s: Dict[str, float] = field(default_factory=dict)
    round_time_s: List[float] = field(default_factory=list)
    round_stage_s: List[Dict[str, float]] = field(default_factory=list)
    round_replayed: List[bool] = field(default_factory=list)
    round_launched_ahead: List[bool] = field(default_factory=list)
    graph_captures: int = 0
    graph_capture_s: float = 0.0

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens committed per round (NaN before the first round)."""
        return sum(self.accept_lengths) / self.rounds if self.rounds else math.nan

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of wall time, prefill included."""
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else math.nan

    def summary(self) -> str:
        budget = f", budget {self.tree_budget}" if self.method != "autoregressive" else ""
        lines = [
            f"{self.method}{budget}: {self.new_tokens} new tokens after a {self.prompt_tokens}-token prompt "
            f"in {self.rounds} rounds, tau {self.tau:.2f}",
            f"wall {self.wall_time_s:.3f} s, {self.tokens_per_s:.1f} tokens/s",
        ]
        if any(self.round_replayed):
            lines.append(
                f"{sum(self.round_replayed)} of {self.rounds} rounds replayed from CUDA graphs "
                f"({self.graph_captures} captured in {self.graph_capture_s:.2f} s)"
            )
        if any(self.round_launched_ahead):
            lines.append(f"{sum(self.round_launched_ahead)} of {self.rounds} rounds launched before the round ahead "
                         "of them was read")
        if self.stage_time_s:
            total = sum(self.stage_time_s.values()) or 1.0
            lines.append(
                "stages: "
                + ", ".join(f"{s} {t * 1e3:.1f} ms ({100 * t / total:.0f}%)" for s, t in self.stage_time_s.items())
            )
        return "\n".join(lines)


def generate(
    target,
    draft: Optional["DFlashDraftModel"],
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    method: str = "ddtree",
    tree_budget: int = 64,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    min_p: Optional[float] = None,
    repetition_penalty: Optional[float] = None,
    presence_penalty: Optional[float] = None,
    frequency_penalty: Optional[float] = None,
    eos_token_id: Union[int, Sequence[int], None] = None,
    seed: Optional[int] = None,
    attention_mask: Optional[torch.Tensor] = None,
    streamer=None,
    return_stats: bool = False,
    spine: bool = True,
    draft_top_k: int = 8,
    cuda_graph: Optional[bool] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, GenerationStats]]:
    """Generate ``max_new_tokens`` tokens (fewer if EOS) after ``input_ids``, exactly as the target would.

    Args:
        target: a loaded Hugging Face model (Qwen3ForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, or
            Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration with a text prompt), or a ready
            :class:`ddtree_ext.target.TargetAdapter` (its taps must be the draft's target layers).
        draft: a :class:`ddtree_ext.draft.DFlashDraftModel` trained for this target; ``None`` (or
            anything: it is unused) for ``method="autoregressive"``.
        input_ids: [1, T] integer token ids (T >= 1), on any device (moved to the target's).
        max_new_tokens: exact number of tokens to generate unless EOS comes first (>= 1). The caches are
            allocated for prompt + max_new_tokens (plus one verify block) when the call starts.
        method: "ddtree" (a tree of ``tree_budget`` nodes plus the root per round), "dflash" (the
            draft's top-1 block as one chain of ``block_size - 1`` nodes; ``tree_budget``, ``spine``
            and ``draft_top_k`` are ignored) or "autoregressive" (one target step per token).
        tree_budget: 1..256 tree nodes besides the root verified per DDTree round.
        temperature: 0 = greedy (argmax; ties go to the lower token id, like ``torch.argmax``);
            > 0 samples by :func:`ddtree_ext.ops.walk_sample`'s rule, after ``top_k`` (None or 0 = off;
            unlike HF, no implicit 50), ``top_p`` (None or 1 = off) and ``min_p`` (None or 0 = off), in HF's
            order. All are ignored when greedy. The kept tokens are those of HF's warpers, ties at the top_k cut
            included; a group of equal logits at the top_p cut is kept whole, where HF keeps whichever part its
            sort ranks higher; min_p keeps x = logit / temperature where x - max x >= log(min_p) in float32, HF's
            probability rule up to float32 rounding at the boundary.
        repetition_penalty: HF's repetition penalty (> 0; 1 = off), greedy or sampled, before the temperature: at
            every node the logit of each token already in the sequence (prompt, generated tokens, then the node's
            path in the tree) is divided by it, or multiplied where negative, in float32. None (the default) takes
            the target's ``generation_config.repetition_penalty``, as HF's ``generate`` does.
        presence_penalty, frequency_penalty: vLLM's and OpenAI's penalties (in [-2, 2]; None or 0 = off; HF's
            ``generate`` has none), after the repetition penalty, as vLLM applies them: at every node the presence
            penalty, and the frequency penalty times the count, are subtracted from the logit of each token generated
            so far (the prompt is not counted; the node's path is), in float32.
        eos_token_id: an id or a list of ids; generation stops after the first one emitted (the EOS
            is included in the output). None (the default) takes the target's
            ``generation_config.eos_token_id``, as HF's ``generate`` does (none there: no early stop; one that is
            not a valid id is refused, where HF warns); an empty list never stops early. Nothing else of the
            generation_config is read but ``repetition_penalty``: not its sampling settings (``temperature`` here is
            0 unless given), not its other logits processing (a UserWarning names the settings of it that HF's
            greedy generate would apply, e.g. no_repeat_ngram_size).
        seed: seeds the uniforms of sampling (reproducible output); None draws the seed from
            torch's global generator, so ``torch.manual_seed`` also makes a run reproducible. The uniforms come
            from torch's CPU generator, which keeps 32 bits of a seed: seeds equal modulo 2**32 draw alike.
        attention_mask: accepted only when all ones (no padding), as [1, T].
        streamer: an HF streamer (e.g. ``transformers.TextStreamer``): receives the prompt ([1, T] int64 on the
            CPU), then the new tokens of every round ([1, n], as HF's assisted decoding streams them), then
            ``end()``.
        return_stats: also return a :class:`GenerationStats`.
        spine: DDTree only: force the draft's top-1 chain into the tree before best-first.
        draft_top_k: DDTree only: candidates per depth the tree is built from (at least 1; more than the
            vocabulary takes the whole vocabulary).
        cuda_graph: replay each round from CUDA graphs (captured per attention width, see
            :mod:`ddtree_ext.round`); None (default) = on when the whole target sits on one CUDA
            device and its sparse MoE layers, if any, keep to the device (``TargetAdapter.moe_capturable``),
            False = run every stage eagerly (same buffers, same kernels, same output), True = required
            (ValueError if the target is not on one CUDA device, or has MoE layers whose experts forward reads the
            host: see ``TargetAdapter.moe_capturable``).

    Returns:
        int64 [1, T + new] on the target's device (prompt then new tokens), like HF ``generate``;
        with ``return_stats`` the pair ``(ids, stats)``.

    Raises:
        ValueError naming the argument, before any model forward, for: an unknown method, a
        budget outside 1..256, a negative temperature or one in (0, 1e-5) (logits / temperature would
        overflow float32), top_p outside (0, 1], min_p outside [0, 1], a repetition_penalty (given, or the
        generation_config's when none is) that is not a finite number > 0, a presence_penalty or frequency_penalty
        outside [-2, 2], a negative top_k (one beyond the vocabulary keeps every
        token), a bool where a number is expected, a non-bool spine or return_stats, an EOS id outside the
        vocabulary (given, or the generation_config's when none is), a streamer without put() and end(), a
        draft that is not a DFlashDraftModel, a
        non-integer/empty/out-of-vocabulary prompt or one that is not [1, T] (batch > 1 is not supported
        yet), an attention_mask with padding, a prompt plus max_new_tokens (plus ``block_size - 1`` for the
        draft methods, see :func:`_check_prompt`) beyond the target's max_position_embeddings, a draft that
        does not match the target (shapes, or the dtype or device of any of its weights), an unsupported
        target architecture, or ``cuda_graph=True`` for a target not on one CUDA device or with sparse MoE layers
        that a CUDA graph cannot capture.

    Calls on the same target or draft (or layers of one) from several threads take turns: a call swaps forwards
    on the models' modules while it runs (for its own thread only: HF's forward on the model from another thread
    meanwhile runs HF's code). A call from inside a call in the same thread (from a streamer) runs.
    """
    _check_options(method, tree_budget, temperature, top_k, top_p, seed, max_new_tokens, draft, draft_top_k, spine,
                   return_stats, streamer, min_p, repetition_penalty, presence_penalty, frequency_penalty)
    (max_new_tokens, tree_budget, temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
     frequency_penalty, seed, draft_top_k) = map(_plain, (
        max_new_tokens, tree_budget, temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
        frequency_penalty, seed, draft_top_k))
    eos = _eos_set(eos_token_id)
    if method == "autoregressive":
        draft = None  # a draft passed along is not used, so not checked or held either
    adapter = _as_adapter(target, draft)
    if eos_token_id is None:
        eos = _config_eos_set(adapter)
    if repetition_penalty is None:
        repetition_penalty = _config_repetition_penalty(adapter)
    _warn_unapplied_processing(adapter.model)
    # Every decoder layer too: two models may share layers under different roots.
    held = [adapter.text_model, *adapter.text_model.layers, adapter.lm_head, draft]
    with _one_call_per_model(held):
        return _generate(adapter, draft, input_ids, max_new_tokens, method, tree_budget, temperature, top_k, top_p,
                         min_p, (repetition_penalty, presence_penalty, frequency_penalty), eos, seed, attention_mask,
                         streamer, return_stats, spine, draft_top_k, cuda_graph)


def _generate(adapter, draft, input_ids, max_new_tokens, method, tree_budget, temperature, top_k, top_p, min_p,
              penalties, eos, seed, attention_mask, streamer, return_stats, spine, draft_top_k, cuda_graph):
    """generate() after its option checks, holding the models (draft is None for method="autoregressive")."""
    speculative = draft is not None
    if any(i >= adapter.vocab_size for i in eos):
        raise ValueError(f"generate: eos_token_id must lie in [0, {adapter.vocab_size}), got {sorted(eos)}")
    if top_k is not None:
        top_k = min(top_k, adapter.vocab_size)  # more than the vocabulary keeps every token, as HF's top-k does
    if speculative:
        _check_draft(draft, adapter)
    use_graphs = _use_graphs(cuda_graph, adapter)
    tree_reach = draft.block_size - 1 if speculative else 0
    input_ids = _check_prompt(input_ids, attention_mask, adapter, max_new_tokens, tree_reach)

    prompt_len = input_ids.shape[1]
    device = input_ids.device
    if speculative:
        max_accept = draft.block_size
        budget = tree_budget if method == "ddtree" else draft.block_size - 1
        top_k_draft = min(draft_top_k, adapter.vocab_size) if method == "ddtree" else 1
        use_spine = spine if method == "ddtree" else True
    else:
        max_accept, budget, top_k_draft, use_spine = 1, 0, 1, True
    # The spine statistic needs the greedy target tokens on the spine nodes 1..S (see GenerationStats).
    spine_len = min(budget, max_accept - 1) if return_stats and method == "ddtree" and spine and temperature == 0 else 0
    stats = GenerationStats(
        method=method, tree_budget=budget, prompt_tokens=prompt_len, spine_accept_lengths=[] if spine_len else None
    )
    acceptor = _Acceptor(temperature, top_k, top_p, min_p, seed, prompt_len + max_new_tokens + max_accept + 1, device,
                         *penalties, prompt=input_ids, vocab_size=adapter.vocab_size)
    clock = _StageClock(device, enabled=return_stats)
    out_tokens: List[int] = []

    def emit(tokens: List[int]) -> bool:
        """Appends the round's tokens (cut at EOS and at max_new_tokens); True when generation is done."""
        tokens = tokens[: max_new_tokens - len(out_tokens)]
        done = len(out_tokens) + len(tokens) == max_new_tokens
        for i, t in enumerate(tokens):
            if t in eos:
                tokens, done = tokens[: i + 1], True
                break
        out_tokens.extend(tokens)
        if streamer is not None:
            # [1, n] as HF's assisted decoding streams a step's tokens (a 1-D put is one token per batch row there),
            # made outside the rounds' inference mode so that a streamer may use it as any tensor.
            with torch.inference_mode(False):
                streamer.put(torch.tensor([tokens], dtype=torch.long))
        return done

    # Cache slots: the committed tokens (at most prompt + max_new_tokens - 1 before the last round)
    # plus one verify block, which is budget + 1 nodes; the draft also writes one block past its context.
    reach = max(budget + 1, max_accept)
    capacity = prompt_len + max_new_tokens + reach
    start = time.perf_counter()
    # The target's device is made current: CUDA events, graph capture and the result copy use the
    # current device's streams, and a target on cuda:1 with cuda:0 current would escape capture.
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with torch.inference_mode(), on_device:
        state = adapter.new_state(1, capacity=capacity)
        draft_cache = draft.new_cache(1, capacity=capacity) if speculative else None
        decode = DecodeRound(
            adapter, draft, state, draft_cache, acceptor, method=method, budget=budget, max_accept=max_accept,
            draft_top_k=top_k_draft, spine=use_spine, spine_len=spine_len, use_graphs=use_graphs,
        )
        if streamer is not None:  # after the last argument check (new_state's): a refused call streams nothing
            with torch.inference_mode(False):  # an ordinary tensor, as every put is
                streamer.put(input_ids.cpu())
        with clock("prefill"):
            logits, context = adapter.prefill(input_ids, state)
            # The first new token: the target's at the last prompt position (a root-only tree there).
            first = ops.chain_tree(input_ids[:, -1:], state.prefix_len - 1)
            logits = acceptor.penalize(first, logits[:, None], 1)
            root = acceptor.walk(first, logits, state.prefix_len - 1, ops.empty_walk(1, 1, device)).next_token
        decode.start(root, context)

        def launch(committed: int):
            """Enqueues the round after ``committed`` cache slots (an upper bound serves: the width only has
            to cover them)."""
            clock.next_round()
            return decode.launch(min(kv_bucket(committed + reach), capacity), clock)

        try:
            done = emit(root.tolist())
            prefix = prompt_len
            last_read = time.perf_counter()
            pending, pending_ahead = (None, False) if done else (launch(prefix), False)
            while pending is not None:
                # On a GPU the next round goes out before this one is read, so that the device need not wait
                # for the host; but only when this round cannot end the generation by length (an EOS still
                # can: the round launched ahead is then dropped unread).
                ahead = None
                if decode.launch_ahead and len(out_tokens) + max_accept < max_new_tokens:
                    ahead = launch(prefix + max_accept)
                row = decode.read(pending)
                stats.round_replayed.append(pending.replayed)
                stats.round_launched_ahead.append(pending_ahead)
                accept_len = row[0]
                tokens = row[2:accept_len + 1] + [row[1 + max_accept]]
                stats.accept_lengths.append(accept_len)
                if spine_len:
                    stats.spine_accept_lengths.append(row[2 + max_accept])
                done = emit(tokens)
                prefix += accept_len
                now = time.perf_counter()
                stats.round_time_s.append(now - last_read)
                last_read = now
                if done:
                    pending = None
                elif ahead is not None:
                    pending, pending_ahead = ahead, True
                else:
                    pending, pending_ahead = launch(prefix), False
        finally:
            decode.release()  # the graphs go now, also when a round or the streamer raised
        stats.graph_captures, stats.graph_capture_s = decode.captures, decode.capture_s
    if streamer is not None:
        streamer.end()
    prefill_s, stats.round_stage_s = clock.per_round(stats.rounds)  # not a round launched ahead and dropped
    totals = {s: prefill_s.get(s, 0.0) + sum(r.get(s, 0.0) for r in stats.round_stage_s) for s in STAGES}
    stats.stage_time_s = {s: t for s, t in totals.items() if t > 0}
    stats.wall_time_s = time.perf_counter() - start
    stats.new_tokens = len(out_tokens)

    ids = torch.cat([input_ids, torch.tensor([out_tokens], dtype=torch.long, device=device)], dim=1)
    return (ids, stats) if return_stats else ids


# generation_config fields with which HF's greedy generate (transformers 5.x: _get_logits_processor, which passes
# a decoder-only model's prompt as the "encoder" input, and beam or contrastive search) picks other tokens than the
# argmax, and the values with which it does not.
_GREEDY_PROCESSING_OFF = {
    "encoder_repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,), "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,), "sequence_bias": (None,), "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,), "min_length": (None, 0), "min_new_tokens": (None, 0),
    "exponential_decay_length_penalty": (None,), "guidance_scale": (None, 1.0), "watermarking_config": (None,),
    "num_beams": (None, 1), "penalty_alpha": (None,),
}


def _is_repetition_penalty(value) -> bool:
    return _is_number(value) and _is_finite(value) and value > 0


def _config_repetition_penalty(adapter) -> Optional[float]:
    """The target's generation_config.repetition_penalty (None if unset), checked as generate() checks its own."""
    value = getattr(getattr(adapter.model, "generation_config", None), "repetition_penalty", None)
    if value is not None and not _is_repetition_penalty(value):
        raise ValueError(
            f"generate: the target's generation_config.repetition_penalty must be a finite number > 0, got {value!r} "
            f"(pass repetition_penalty to override it)")
    return None if value is None else float(value)


def _warn_unapplied_processing(model) -> None:
    """A UserWarning when the target's generation_config asks HF's generate for logits processing that changes
    greedy tokens (no_repeat_ngram_size, say): generate() applies none, so its output is HF's with them off."""
    config = getattr(model, "generation_config", None)
    found = {}
    for name, off in _GREEDY_PROCESSING_OFF.items():
        value = getattr(config, name, None)
        if value not in off and not (isinstance(value, (list, tuple, dict)) and not value):  # empty: does nothing
            found[name] = value
    if found:
        settings = ", ".join(f"{name}={value!r}" for name, value in found.items())
        warnings.warn(
            f"generate: the target's generation_config sets {settings}, which Hugging Face's generate applies and "
            f"this one does not: the output is HF's with them off",
            UserWarning, stacklevel=3,
        )


_MODEL_LOCKS_GUARD = threading.Lock()
_MODEL_LOCKS: "weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def _one_call_per_model(models: Sequence[Optional[torch.nn.Module]]):
    """Holds each module's lock for the length of a generate() call. A call swaps the forwards of the models' modules
    for its prefill, verify and draft (fused.swapped_attributes), and on a GPU captures graphs: two calls on one model
    at once, from two threads, would run and put back each other's swaps and leave some on the model. Another thread
    waits its turn. The locks are re-entrant: a call from inside a call in the same thread (from a streamer, between
    rounds, where no swap is open) runs."""
    with _MODEL_LOCKS_GUARD:
        unique = sorted({id(m): m for m in models if m is not None}.values(), key=id)  # one order: no deadlock
        locks = [_MODEL_LOCKS.setdefault(m, threading.RLock()) for m in unique]
    with contextlib.ExitStack() as held:
        for lock in locks:
            held.enter_context(lock)
        yield


def _use_graphs(cuda_graph: Optional[bool], adapter: "TargetAdapter") -> bool:
    """Whether rounds replay CUDA graphs (see ``generate``'s ``cuda_graph``)."""
    if cuda_graph is not None and not isinstance(cuda_graph, bool):
        raise ValueError(f"generate: cuda_graph must be None, True or False, got {cuda_graph!r}")
    possible = adapter.device.type == "cuda" and adapter.single_device
    if cuda_graph and not possible:
        raise ValueError(
            f"generate: cuda_graph=True needs the whole target on one CUDA device; it is on "
            f"{sorted({str(d) for d in adapter.layer_devices} | {str(adapter.device)})}"
        )
    if cuda_graph and not adapter.moe_capturable:
        raise ValueError(
            f"generate: cuda_graph=True: the target's sparse MoE layers run HF's experts_implementation "
            f"{'/'.join(adapter.experts_implementations)} (ops.moe_experts does not apply to them: "
            f"ddtree_ext.fused.experts_op_applies), which here reads the device from the host: a CUDA graph cannot "
            f"capture it (of HF's, only \"grouped_mm\", its default, with bfloat16 expert weights on an sm_90 or "
            f"sm_100 GPU keeps to the device); pass cuda_graph=None or False"
        )
    # A MoE target's rounds are captured by default where its experts forward keeps to the device.
    return (possible and adapter.moe_capturable) if cuda_graph is None else cuda_graph


# ---- the acceptance rule ---------------------------------------------------------------------


class _Acceptor:
    """The one rule that picks every emitted token, for all methods: the walk over a tree (a root-only
    tree for autoregressive steps and for the token after the prefill).

    Greedy: :func:`ops.walk_greedy` on the target's argmax. Sampling: :func:`ops.walk_sample` with
    the uniform of sequence position p drawing the token at p, from one stream of ``length``
    uniforms drawn up front on the CPU (same numbers on every device). The penalties (HF's repetition penalty, vLLM's
    presence and frequency penalties), applied before either, count the tokens so far on the device: the prompt's
    (repetition only), then each walk's (:meth:`penalize`).
    """

    def __init__(self, temperature, top_k, top_p, min_p, seed, length: int, device: torch.device,
                 repetition_penalty=None, presence_penalty=None, frequency_penalty=None,
                 prompt: Optional[torch.Tensor] = None, vocab_size: int = 0):
        self.temperature = float(temperature)
        self.top_k = int(top_k or 0)
        self.top_p = 1.0 if top_p is None else float(top_p)
        self.min_p = float(min_p or 0.0)
        self.repetition = 1.0 if repetition_penalty is None else float(repetition_penalty)  # 1: off
        self.presence = float(presence_penalty or 0.0)
        self.frequency = float(frequency_penalty or 0.0)
        # Column V of both is a sink for padding. seen [1, V + 1] bool: the tokens of the sequence so far (the
        # repetition penalty's); generated [1, V + 1] float32: how often each token was generated (the presence and
        # frequency penalties count generated tokens only, as vLLM and OpenAI do).
        self.seen = self.generated = None
        self.sink = vocab_size  # the padding column's index
        if self.repetition != 1.0:
            self.seen = torch.zeros(1, vocab_size + 1, dtype=torch.bool, device=device)
            self.seen.scatter_(1, prompt.to(device), True)
        if self.presence or self.frequency:
            self.generated = torch.zeros(1, vocab_size + 1, dtype=torch.float32, device=device)
        self.uniform = None
        if self.temperature > 0:
            if seed is None:
                seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
            gen = torch.Generator().manual_seed(int(seed))
            self.uniform = torch.rand(1, length, generator=gen, dtype=torch.float32).to(device)

    @property
    def greedy(self) -> bool:
        return self.uniform is None

    @property
    def penalized(self) -> bool:
        return self.seen is not None or self.generated is not None

    def penalize(self, tree: ops.Tree, logits: torch.Tensor, max_depth: int) -> torch.Tensor:
        """The logits [1, N, V] as the penalties leave them at every node, in float32 (HF and vLLM upcast before them),
        over the sequence up to the node: the tokens counted so far (the root's among them), then the node's path
        below the root (at most ``max_depth - 1`` nodes): :func:`ops.penalize_logits`. Without penalties, the logits
        as they are. No host reads."""
        if not self.penalized:
            return logits
        vocab = logits.shape[-1]
        return ops.penalize_logits(
            tree, logits, seen=None if self.seen is None else self.seen[:, :vocab],
            counts=None if self.generated is None else self.generated[:, :vocab],
            repetition_penalty=self.repetition,
            presence_penalty=self.presence, frequency_penalty=self.frequency, max_depth=max_depth)

    def _record(self, tree: ops.Tree, walk: ops.Walk) -> None:
        """Counts the walk's tokens: its path below the root, then the next token (the root was counted before)."""
        if not self.penalized:
            return
        path = tree.token.gather(1, walk.accepted.clamp(min=0).long())
        below_root = torch.where(walk.accepted[:, 1:] >= 0, path[:, 1:], self.sink)
        new = torch.cat([below_root, walk.next_token[:, None]], 1)
        if self.seen is not None:
            self.seen.scatter_(1, new, True)
        if self.generated is not None:
            self.generated.scatter_add_(1, new, torch.ones_like(new, dtype=torch.float32))

    def walk(
        self, tree: ops.Tree, logits: torch.Tensor, position: torch.Tensor, out: ops.Walk,
        argmax: Optional[torch.Tensor] = None,
    ) -> ops.Walk:
        """Walk ``tree`` whose root sits at sequence position ``position`` ([1] int64 on the device;
        logits [1, N, V]: the target's at every node, float32 when sampling, any float dtype when greedy);
        writes ``out`` (its width = the longest path) and returns it. The logits are :meth:`penalize`'s; ``argmax``
        (greedy): ops.row_argmax(logits) when the caller has it. No host reads."""
        if self.greedy:
            target_argmax = ops.row_argmax(logits) if argmax is None else argmax
            walk = ops.walk_greedy(tree, target_argmax, out.accepted.shape[1], out=out)
        else:
            depth = out.accepted.shape[1]
            # The node at depth d sits at position + d and draws the token at position + d + 1.
            steps = torch.arange(1, depth + 1, device=position.device)
            uniform = self.uniform.gather(1, position[:, None] + steps)
            walk = ops.walk_sample(
                tree, logits, uniform, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                min_p=self.min_p, out=out,
            )
        self._record(tree, walk)
        return walk


# ---- timing ----------------------------------------------------------------------------------


class _StageClock:
    """Time per stage and round: CUDA events on a GPU (no sync per stage: an eager round's events are read
    once at the end, a replayed round's, recorded inside its graph, by ``DecodeRound.read`` through
    :meth:`add`), perf_counter on the CPU where ops run synchronously. Disabled (a no-op) unless
    ``enabled``."""

    def __init__(self, device: torch.device, enabled: bool):
        self.device = device
        self.cuda = device.type == "cuda"
        self.enabled = enabled
        self.records: List[tuple] = []  # (round, stage, seconds, or the CUDA event pair)
        self.round = -1  # -1: the prefill

    def next_round(self) -> None:
        self.round += 1

    @contextlib.contextmanager
    def __call__(self, stage: str):
        if not self.enabled:
            yield
        elif self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            yield
            end.record()
            self.records.append((self.round, stage, (begin, end)))
        else:
            t = time.perf_counter()
            yield
            self.records.append((self.round, stage, time.perf_counter() - t))

    def add(self, round_index: int, stage: str, seconds: float) -> None:
        """A stage time measured elsewhere (the timing events inside a replayed graph)."""
        self.records.append((round_index, stage, seconds))

    def per_round(self, rounds_read: int) -> Tuple[Dict[str, float], List[Dict[str, float]]]:
        """(the prefill's stage seconds, one dict of stage seconds for each of the first ``rounds_read``
        rounds). A round launched after those (ahead of a last one, and dropped) is left out, its events
        unread: they may still be pending."""
        records = [r for r in self.records if r[0] < rounds_read]
        if self.cuda and records:
            torch.cuda.synchronize(self.device)
        prefill: Dict[str, float] = {}
        rounds: List[Dict[str, float]] = [{} for _ in range(rounds_read)]
        for rnd, stage, t in records:
            seconds = t[0].elapsed_time(t[1]) / 1e3 if isinstance(t, tuple) else t
            into = prefill if rnd < 0 else rounds[rnd]
            into[stage] = into.get(stage, 0.0) + seconds
        return prefill, rounds


# ---- argument checks (all before any model work) ----------------------------------------------


def _is_int(x) -> bool:
    """A Python or NumPy integer, not a bool (True would otherwise pass as 1)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x) -> bool:
    """A Python or NumPy int or float, not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_finite(x) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


def _plain(x):
    """A checked number as a Python int or float (NumPy scalars pass the checks); anything else as it is."""
    if _is_int(x):
        return int(x)
    if _is_number(x):
        return float(x)
    return x


def _check_numbers(method, tree_budget, temperature, top_k, top_p, seed, max_new_tokens, draft_top_k,
                   min_p=None, repetition_penalty=None, presence_penalty=None, frequency_penalty=None) -> None:
    """The options that need no model: the command line checks them before it loads one."""
    if method not in METHODS:
        raise ValueError(f"generate: method must be one of {METHODS}, got {method!r}")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if method == "ddtree":
        if not _is_int(tree_budget) or not 1 <= tree_budget <= MAX_TREE_BUDGET:
            raise ValueError(f"generate: tree_budget must be an int in 1..{MAX_TREE_BUDGET}, got {tree_budget!r}")
        if not _is_int(draft_top_k) or draft_top_k < 1:
            raise ValueError(f"generate: draft_top_k must be an int >= 1, got {draft_top_k!r}")
    if not _is_number(temperature) or not _is_finite(temperature) or temperature < 0:
        raise ValueError(f"generate: temperature must be a finite number >= 0, got {temperature!r}")
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"generate: temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {temperature!r}")
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        raise ValueError(f"generate: top_k must be None or an int >= 0, got {top_k!r}")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise ValueError(f"generate: top_p must be None or in (0, 1], got {top_p!r}")
    if min_p is not None and (not _is_number(min_p) or not 0 <= min_p <= 1):
        raise ValueError(f"generate: min_p must be None or in [0, 1], got {min_p!r}")
    if repetition_penalty is not None and not _is_repetition_penalty(repetition_penalty):
        raise ValueError(
            f"generate: repetition_penalty must be None or a finite number > 0, got {repetition_penalty!r}")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if value is not None and (not _is_number(value) or not -2 <= value <= 2):
            raise ValueError(f"generate: {name} must be None or in [-2, 2] (vLLM's and OpenAI's range), got {value!r}")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**64):
        raise ValueError(f"generate: seed must be None or an int in [0, 2**64), got {seed!r}")


def _check_options(
    method, tree_budget, temperature, top_k, top_p, seed, max_new_tokens, draft, draft_top_k, spine, return_stats,
    streamer, min_p=None, repetition_penalty=None, presence_penalty=None, frequency_penalty=None,
) -> None:
    _check_numbers(method, tree_budget, temperature, top_k, top_p, seed, max_new_tokens, draft_top_k, min_p,
                   repetition_penalty, presence_penalty, frequency_penalty)
    if not isinstance(spine, bool):
        raise ValueError(f"generate: spine must be a bool, got {spine!r}")
    if not isinstance(return_stats, bool):
        raise ValueError(f"generate: return_stats must be a bool, got {return_stats!r}")
    if streamer is not None and not all(callable(getattr(streamer, m, None)) for m in ("put", "end")):
        raise ValueError(f"generate: streamer must have put() and end() (an HF streamer), got {type(streamer).__name__}")
    if method != "autoregressive" and draft is None:
        raise ValueError(f"generate: draft is required for method={method!r} (only 'autoregressive' runs without)")
    if method != "autoregressive":
        from ddtree_ext.draft import DFlashDraftModel

        if not isinstance(draft, DFlashDraftModel):
            raise ValueError(
                f"generate: draft must be a ddtree_ext.draft.DFlashDraftModel (e.g. DFlashDraftModel.from_pretrained), "
                f"got {type(draft).__name__}")


def _as_adapter(target, draft) -> "TargetAdapter":
    """The target as a TargetAdapter tapping the draft's layers (ValueError for unsupported models)."""
    from ddtree_ext.target import TargetAdapter

    taps = [int(i) for i in draft.target_layer_ids] if draft is not None else []
    if not isinstance(target, TargetAdapter):
        try:
            return TargetAdapter(target, taps)
        except ValueError as e:
            if taps:  # the draft's taps may be what the target cannot give: then the draft's check says so
                try:
                    untapped = TargetAdapter(target, [])
                except ValueError:
                    untapped = None
                if untapped is not None:
                    _check_draft(draft, untapped)
            raise ValueError(f"generate: target: {e}") from e
    if draft is not None and list(target.tap_layer_ids) != taps:
        raise ValueError(
            f"generate: target: the TargetAdapter taps layers {list(target.tap_layer_ids)}, the draft reads "
            f"target_layer_ids {taps}"
        )
    return target


def _check_draft(draft: "DFlashDraftModel", adapter: "TargetAdapter") -> None:
    """ValueError unless the draft can serve the target: shapes (``check_target``), and the dtype and
    device of the target's embeddings, which the draft runs its block through."""
    try:
        draft.check_target(adapter.config)
    except ValueError as e:
        raise ValueError(f"generate: draft does not match the target: {e}") from e
    expected = adapter.embed_tokens.weight
    for name, actual in draft.named_parameters():
        if actual.dtype != expected.dtype or actual.device != expected.device:
            raise ValueError(
                f"generate: draft: weights are {actual.dtype} on {actual.device}, expected the target's "
                f"{expected.dtype} on {expected.device} (the draft runs on the target's embeddings and LM head; "
                f"the first that is not: {name})"
            )


_RANGED_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)  # min/max work on these


def _check_prompt(
    input_ids, attention_mask, adapter: "TargetAdapter", max_new_tokens: int, tree_reach: int
) -> torch.Tensor:
    """The validated prompt as int64 [1, T] on the target's device.

    ``tree_reach``: how far past its root a round's verify reaches (``block_size - 1`` for the draft
    methods, 0 for autoregressive). The output (T + max_new_tokens positions) must fit in the target's
    positions, and so must the nodes a round verifies beyond it: a round whose root is the last
    emitted token but one still verifies nodes up to ``block_size - 1`` positions deeper. The bound
    T + max_new_tokens + tree_reach <= max_position_embeddings covers both (with a little slack: the
    last emitted token is never run through the target)."""
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"generate: input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"generate: input_ids must hold integer token ids, got {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"generate: input_ids must have shape [batch, T], got {list(input_ids.shape)}")
    for name, t in (("input_ids", input_ids), ("attention_mask", attention_mask)):
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            raise ValueError(f"generate: {name} is on the meta device: it must hold values (CPU or GPU)")
    if input_ids.shape[0] == 0:
        raise ValueError(f"generate: input_ids has no sequence (shape {list(input_ids.shape)}): it must have shape "
                         f"[1, T]")
    if input_ids.shape[0] != 1:
        raise ValueError(f"generate: input_ids: batch size > 1 is not supported yet (got {input_ids.shape[0]})")
    prompt_len = input_ids.shape[1]
    if prompt_len == 0:
        raise ValueError("generate: input_ids is empty: the prompt needs at least one token")
    # torch has no min/max for its wider unsigned types: those are read as int64.
    ranged = input_ids if input_ids.dtype in _RANGED_ID_DTYPES else input_ids.to(torch.int64)
    lo, hi = int(ranged.min()), int(ranged.max())
    if lo < 0 or hi >= adapter.vocab_size:
        raise ValueError(f"generate: input_ids must lie in [0, {adapter.vocab_size}), got values in [{lo}, {hi}]")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise ValueError(f"generate: attention_mask must be a torch.Tensor of the shape of input_ids "
                             f"{list(input_ids.shape)}, got {type(attention_mask).__name__}")
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"generate: attention_mask must have the shape of input_ids {list(input_ids.shape)}, "
                             f"got {list(attention_mask.shape)}")
        if not bool((attention_mask != 0).all()):
            raise ValueError("generate: attention_mask has zeros (padding), which is not supported yet: pass unpadded ids")
        if not bool((attention_mask == 1).all()):
            raise ValueError("generate: attention_mask must hold ones (1 or True) for every token, got other values")
    limit = adapter.max_position_embeddings
    if limit is not None and prompt_len + max_new_tokens + tree_reach > limit:
        reach = f" + the tree's reach past the last token (block_size - 1 = {tree_reach})" if tree_reach else ""
        raise ValueError(
            f"generate: max_new_tokens: prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}){reach} exceeds "
            f"the target's max_position_embeddings ({limit})"
        )
    return input_ids.to(device=adapter.device, dtype=torch.long)


def _config_eos_set(adapter: "TargetAdapter") -> frozenset:
    """The EOS ids of the target's generation_config (where HF's generate takes them when none are passed)."""
    config_eos = getattr(getattr(adapter.model, "generation_config", None), "eos_token_id", None)
    try:
        eos = _eos_set(config_eos)
    except ValueError:
        raise ValueError(
            f"generate: eos_token_id was not given, and the target's generation_config.eos_token_id is not an int "
            f">= 0 or a list of them ({config_eos!r}): pass eos_token_id (an empty list never stops early)"
        ) from None
    if any(i >= adapter.vocab_size for i in eos):
        raise ValueError(
            f"generate: eos_token_id was not given, and the target's generation_config.eos_token_id "
            f"{sorted(eos)} does not lie in [0, {adapter.vocab_size}): pass eos_token_id (an empty list never stops "
            f"early)"
        )
    return eos


def _eos_set(eos_token_id) -> frozenset:
    if eos_token_id is None:
        return frozenset()
    ids = [eos_token_id] if _is_int(eos_token_id) else eos_token_id
    if isinstance(ids, torch.Tensor) or type(ids).__module__ == "numpy":  # a 0-d array is no iterable: flatten it
        ids = ids.flatten().tolist()
    if isinstance(ids, Iterable) and not isinstance(ids, (str, bytes)):
        ids = list(ids)  # a one-shot iterable is read once, here
    if not isinstance(ids, list) or not all(_is_int(i) and i >= 0 for i in ids):
        raise ValueError(f"generate: eos_token_id must be an int >= 0 or a list of them, got {eos_token_id!r}")
    return frozenset(int(i) for i in ids)
