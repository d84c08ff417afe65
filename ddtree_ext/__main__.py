"""Command line of ddtree_ext.

``python -m ddtree_ext generate --target DIR_OR_ID --draft DIR_OR_ID --prompt "..."`` streams the target's
output (DDTree by default) and prints the acceptance length, the speed and the time per stage.
``python -m ddtree_ext generate`` alone runs the built-in tiny random Qwen3.5 hybrid target and draft with
all three methods (greedily, or sampled with one seed) and checks that their outputs are identical
(``--tiny qwen3`` or ``--tiny qwen3_5_moe`` for a pure-attention Qwen3 or a sparse-MoE Qwen3.5 target instead;
``--trained-draft`` first trains the tiny draft to agree with its target, so the tree's acceptance shows).
``python -m ddtree_ext info`` prints how the compiled core was built.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

DTYPES = ("auto", "bfloat16", "float16", "float32")
# The built-in demo: a fixed prompt and length, short enough to finish in seconds on two CPU cores.
DEMO_PROMPT_LEN = 16
DEMO_NEW_TOKENS = 64
DEFAULT_NEW_TOKENS = 128
DEFAULT_PROMPT = "Write a short story about a robot learning to paint."
DEFAULT_METHOD = "ddtree"
# Options the built-in demo cannot take (it has no tokenizer, runs all three methods, and compares them in float32).
DEMO_REFUSES = {"prompt": "--prompt", "method": "--method", "no_chat_template": "--no-chat-template"}
# The demo's target families (ddtree_ext.tiny.TINY_FAMILIES) and how the demo names them.
DEMO_FAMILIES = {
    "qwen3_5": "Qwen3.5 hybrid (GDN and attention layers)",
    "qwen3": "Qwen3 (attention layers only)",
    "qwen3_5_moe": "Qwen3.5 sparse-MoE hybrid (GDN and attention layers, MoE MLPs)",
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddtree_ext", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print the build info of the compiled core")
    gen = sub.add_parser(
        "generate",
        help="generate with DDTree / DFlash / autoregressive decoding (no --target: built-in tiny demo)",
        description="Generate text with a target and its DFlash draft. Without --target and --draft, run the "
        "built-in tiny random hybrid pair with all three methods and check their outputs are identical (greedily, or "
        "with --temperature sampled with one seed: --seed, 0 if not given).",
    )
    gen.add_argument("--target", help="target model: local directory or Hugging Face id")
    gen.add_argument("--tiny", choices=tuple(DEMO_FAMILIES), default=None,
                     help="the built-in demo's target family (default qwen3_5, the GDN hybrid); not with --target")
    gen.add_argument("--trained-draft", action="store_true",
                     help="the built-in demo: a target whose continuations a tiny draft can learn, and a draft trained "
                          "to agree with it first (about 20 s on a CPU), so DDTree and DFlash accept several tokens "
                          "per round; not with --target")
    gen.add_argument("--draft", help="DFlash draft: local directory or Hugging Face id (z-lab format)")
    gen.add_argument("--prompt", default=None, help=f"default: {DEFAULT_PROMPT!r}")
    gen.add_argument("--method", choices=("ddtree", "dflash", "autoregressive"), default=None,
                     help=f"default {DEFAULT_METHOD}")
    gen.add_argument("--budget", type=int, default=64, help="DDTree nodes per round besides the root (1..256)")
    gen.add_argument("--max-new-tokens", type=int, default=None, help=f"default {DEFAULT_NEW_TOKENS} ({DEMO_NEW_TOKENS} in the demo)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--min-p", type=float, default=None, help="HF's min_p, in [0, 1] (0 = off)")
    gen.add_argument("--repetition-penalty", type=float, default=None,
                     help="HF's repetition penalty (1 = off; default: the target's generation_config)")
    gen.add_argument("--presence-penalty", type=float, default=None, help="vLLM's and OpenAI's, in [-2, 2] (0 = off)")
    gen.add_argument("--frequency-penalty", type=float, default=None, help="vLLM's and OpenAI's, in [-2, 2] (0 = off)")
    gen.add_argument("--seed", type=int, default=None, help="seed of the sampling uniforms")
    gen.add_argument("--dtype", choices=DTYPES, default="auto",
                     help="weights dtype (auto: the checkpoint's; the demo: float32, or bfloat16 / float16)")
    gen.add_argument("--device", default=None,
                     help="e.g. cuda, cuda:1, cpu (default: cuda when available with --target; the demo: cpu)")
    gen.add_argument(
        "--no-chat-template", action="store_true", help="feed the prompt as raw text instead of a chat turn"
    )
    gen.add_argument(
        "--tune-gemms", action="store_true",
        help="on a GPU, time the GEMM algorithms of each projection shape once (seconds at the start) and run the "
             "fastest (ddtree_ext.gemm_tuning): pays off over long or many generations",
    )
    args = parser.parse_args(argv)

    if args.command == "info":
        import torch

        from ddtree_ext import build_info

        info = build_info()
        info["torch"] = torch.__version__
        if info["cuda"] and torch.cuda.is_available():
            from ddtree_ext._loader import load_extension

            core = load_extension()
            info["gpus"] = [
                dict(name=torch.cuda.get_device_name(d),
                     capability=".".join(map(str, torch.cuda.get_device_capability(d))),
                     programmatic_launches=core.programmatic_launches(d))
                for d in range(torch.cuda.device_count())
            ]
        print(json.dumps(info, indent=2))
        return 0
    if args.target is None and args.draft is not None:
        gen.error("--draft needs --target")
    if args.target is not None and (args.tiny is not None or args.trained_draft):
        flag = "--tiny" if args.tiny is not None else "--trained-draft"
        gen.error(f"{flag} sets up the built-in demo's models: not with --target")
    if args.target is None:
        given = [flag for name, flag in DEMO_REFUSES.items() if getattr(args, name) not in (None, False)]
        if given:
            gen.error(f"{', '.join(given)} needs --target: the built-in demo has no tokenizer and runs all three "
                      "methods to compare them")
    args.method = args.method or DEFAULT_METHOD
    args.prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
    if args.target is not None and args.draft is None and args.method != "autoregressive":
        gen.error(f"--method {args.method} needs --draft (only autoregressive runs without)")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        gen.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.device is not None:
        from ddtree_ext.draft import device_problem

        problem = device_problem(args.device)
        if problem:
            gen.error(f"--device {args.device}: {problem}")
    if args.target is not None and not args.prompt:
        gen.error("--prompt must not be empty")
    if args.tune_gemms:
        from ddtree_ext import gemm_tuning

        gemm_tuning.enabled = True
    try:
        if args.target is not None:  # what needs no model is checked before loading one (seconds to minutes)
            from ddtree_ext.generate import _check_numbers

            _check_numbers(args.method, args.budget, args.temperature, args.top_k, args.top_p, args.seed,
                           DEFAULT_NEW_TOKENS if args.max_new_tokens is None else args.max_new_tokens,
                           draft_top_k=8,  # generate()'s default: the command line does not set it
                           min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                           presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)
        return _demo(args) if args.target is None else _generate(args)
    except ValueError as e:  # generate()'s argument checks: a usage error, not a crash
        gen.error(str(e))


def _generate(args) -> int:
    """Load the target, its tokenizer and the draft; stream one generation; print the statistics."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, TextStreamer

    from ddtree_ext import DFlashDraftModel, generate, stack_projections

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    try:  # a path or Hub id that holds no model: a usage error, not a traceback
        config = AutoConfig.from_pretrained(args.target)
    except OSError as e:
        raise ValueError(f"--target {args.target}: {e}") from None
    draft = None
    if args.draft is not None:
        # The draft first (small next to the target): a bad one, or one made for another target, stops the command
        # before the target's weights load. It takes the target's dtype once that is known.
        draft = DFlashDraftModel.from_pretrained(args.draft, dtype=None if dtype == "auto" else dtype, device=device)
        draft.check_target(config.get_text_config())
    # Qwen3.5/3.6 checkpoints saved as the vision-language class load as that class (text prompts only).
    auto_class = (
        AutoModelForImageTextToText
        if any(a.endswith("ForConditionalGeneration") for a in config.architectures or [])
        else AutoModelForCausalLM
    )
    # A device_map loads straight to the device but needs accelerate; without it, load then move.
    device_map = str(device) if importlib.util.find_spec("accelerate") is not None else None
    target = auto_class.from_pretrained(args.target, dtype=dtype, device_map=device_map).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    if draft is not None:
        draft = draft.to(target.dtype).eval()
    # These models are this command's own: their projections that read one input can share a GEMM.
    for model in (target, draft):
        if model is not None:
            stack_projections(model)

    if args.no_chat_template or tokenizer.chat_template is None:
        input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    else:
        input_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    _, stats = generate(
        target,
        draft,
        input_ids.to(device),
        DEFAULT_NEW_TOKENS if args.max_new_tokens is None else args.max_new_tokens,
        method=args.method,
        tree_budget=args.budget,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        streamer=TextStreamer(tokenizer, skip_prompt=True),
        return_stats=True,
    )
    print()
    print(stats.summary())
    return 0


def _demo(args) -> int:
    """A tiny random target of the --tiny family and its draft, all three methods on a fixed prompt (greedily, or
    sampled with one seed): the outputs must agree. Takes --tiny, --trained-draft, --budget, --max-new-tokens,
    --temperature, --top-k, --top-p, --min-p, --repetition-penalty, --presence-penalty, --frequency-penalty, --seed,
    --dtype, --device."""
    import torch

    from ddtree_ext import generate
    from ddtree_ext.tiny import make_agreeing_draft, make_predictable_target, make_tiny_draft, make_tiny_target

    device = torch.device(args.device or "cpu")
    dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
    family = args.tiny or "qwen3_5"
    if args.trained_draft:
        # Training runs in float32 on the CPU; the trained pair then moves to the asked dtype and device.
        print(f"Training a tiny draft to agree with a tiny {DEMO_FAMILIES[family]} target (seconds) ...", flush=True)
        target = make_predictable_target(family)
        draft = make_agreeing_draft(target)
        target, draft = target.to(device, dtype), draft.to(device, dtype)
    else:
        target = make_tiny_target(family, dtype=dtype).to(device)
        draft = make_tiny_draft(target).to(device)
    vocab_size = target.config.get_text_config().vocab_size
    new_tokens = DEMO_NEW_TOKENS if args.max_new_tokens is None else args.max_new_tokens
    sampled = args.temperature > 0
    # One seed gives all three methods the same uniforms, so sampled outputs agree too.
    seed = args.seed if args.seed is not None or not sampled else 0
    prompt = torch.randint(0, vocab_size, (1, DEMO_PROMPT_LEN), generator=torch.Generator().manual_seed(0)).to(device)
    draft_kind = "trained" if args.trained_draft else "random"
    print(
        f"Built-in demo: tiny random {DEMO_FAMILIES[family]} target ({target.config.num_hidden_layers} layers: "
        f"{', '.join(target.config.layer_types)}) and a tiny {draft_kind} DFlash draft "
        f"(block size {draft.block_size}), "
        f"{str(dtype).removeprefix('torch.')} on {device}; no tokenizer, so token ids are shown."
    )
    print(f"prompt: {prompt[0].tolist()}")
    outputs = {}
    # DDTree first: it takes every option the other two take and more (the budget, the tree's reach), so a bad one
    # stops the demo before any generation, not after two.
    for method in ("ddtree", "dflash", "autoregressive"):
        ids, stats = generate(
            target, draft, prompt, new_tokens, method=method, tree_budget=args.budget, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty, seed=seed,
            return_stats=True,
        )
        outputs[method] = ids[0, DEMO_PROMPT_LEN:].tolist()
        print(f"\n{method}: {outputs[method]}")
        print(stats.summary())
    identical = all(out == outputs["autoregressive"] for out in outputs.values())
    how = f"sampled at temperature {args.temperature} with seed {seed}" if sampled else "greedy"
    print()
    if not identical:
        print(f"FAIL: the three methods produced different outputs ({how}"
              + (", in 16-bit, where a verify of many rows can round a near-tie the other way)" if dtype != torch.float32
                 else ")"), file=sys.stderr)
        return 1
    print(f"OK: ddtree, dflash and autoregressive outputs are identical ({new_tokens} tokens, {how}).")
    if args.trained_draft:
        print("The draft was trained to agree with this target, so tau (tokens per round) above is what the tree "
              "and the chain accept; the speeds of models this small mean nothing.")
    else:
        print("Random weights make the draft accept almost nothing (tau near 1), so the speeds above mean nothing; "
              "--trained-draft shows acceptance, and --target and --draft a real measurement.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
