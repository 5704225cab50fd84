"""`python -m verifier ...`: command-line entry points (`generate` here; `serve` in verifier/server/cli.py)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

from .arguments import DefaultsHelpFormatter, OneLineErrors, add_sampling_arguments, at_least, sampling_from_args, token_ids, utf8_text
from .check import add_check_parser, check_command
from .defaults import default_model_dir
from .dtypes import DTYPES
from .engine import DEFAULT_MAX_K, Engine
from .generate import generate
from .generate_args import fail, make_proposer, prompt_ids, report
from .model import load_model
from .model.rollback import ROLLBACK_MODES, WOA
from .printing import TokenPrinter
from .tokenizer import TextTokenizer

DRAFTS = ("none", "ngram", "model", "mtp", "random", "oracle")
DEFAULT_K = 4  # drafts per step with a drafter, when --k is not given
# In process the engine is sized for K: a K-row verify holds K+1 rows of activations and the slot
# K positions of headroom, so --k is bounded by --max-k, whose default is the engine's and the
# server's (engine.DEFAULT_MAX_K).


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="python -m verifier", description="Bit-exact speculative-decoding verifier for hybrid LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    add_check_parser(sub)
    return parser


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="generate from a prompt with the target model", formatter_class=DefaultsHelpFormatter,
                         description="Generate in this process, plainly or speculatively with a local drafter: every token "
                                     "and logit row equals the plain run's. Exit status: 0 done, 2 bad arguments.")
    gen.add_argument("--model", type=Path, help="HF checkpoint directory (default: the project's default model, models/target)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", type=token_ids, help="comma-separated token ids, e.g. 1,2,3")
    prompt.add_argument("--text", type=utf8_text, help="prompt text (needs tokenizer.json in the model directory)")
    gen.add_argument("--max-new-tokens", type=at_least(1), required=True, help="tokens to generate, the first one included")
    gen.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                     help="where the model runs: cpu (the torch reference ops) or cuda (the Triton kernels)")
    gen.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weights and activations (recurrent state is fp32 always)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    gen.add_argument("--logits-out", type=Path,
                     help="write float32 [N, vocab] .npy: row i holds the logits token i was chosen from (default: not written)")
    spec = gen.add_argument_group("speculative decoding (every token and logit row equals the plain run's)")
    spec.add_argument("--draft", default="none", choices=DRAFTS,
                      help="ngram: prompt lookup; model: a small checkpoint (--draft-model); mtp: the checkpoint's own "
                           "MTP head (mtp.* tensors); random: K uniform ids (adversarial); oracle: the true continuation")
    spec.add_argument("--draft-model", type=Path, default=None,
                      help="the model drafter's checkpoint (default: the shipped draft model, models/draft)")
    spec.add_argument("--k", type=at_least(0), default=None,
                      help=f"drafts per step, at most --max-k (default: {DEFAULT_K} with a drafter, 0 without)")
    spec.add_argument("--max-k", type=at_least(0), default=DEFAULT_MAX_K,
                      help="the largest --k accepted: the engine and the slot are sized for it")
    spec.add_argument("--seed-draft", type=int, default=0, help="seed of the random drafter and of the model drafter")
    spec.add_argument("--rollback", default=WOA, choices=ROLLBACK_MODES, help="recurrent-state rollback: write-on-accept or snapshots")
    gen.add_argument("--tensor-parallel", type=at_least(1), default=1, metavar="N",
                     help="split the target model over N processes (one rank each, torch.distributed: gloo on the CPU, "
                          "NCCL with --device cuda); the bits are those of N ranks, the same on every run of N")
    add_sampling_arguments(gen)
    gen.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")


def _add_serve(sub) -> None:
    from .server.cli import add_serve_parser  # the server's flags derive from its ServerConfig

    add_serve_parser(sub)


INTERRUPTED = 130  # exit status of a command stopped by Ctrl-C (SIGINT), as a shell reports it


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.INFO if getattr(args, "verbose", False) else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _run_command(args)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback
        print(f"interrupted: {args.command} stopped (exit {INTERRUPTED})", file=sys.stderr)
        return INTERRUPTED


def _run_command(args) -> int:
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        from .server.cli import serve_command

        return serve_command(args)
    if args.command == "check":
        return check_command(args)
    return 2


def _drafts_per_step(args) -> int:
    """--k checked against --max-k and --draft; ValueError naming the limit."""
    if args.k is None:
        return 0 if args.draft == "none" else min(DEFAULT_K, args.max_k)
    if args.draft == "none" and args.k:
        raise ValueError("--k needs a drafter: pass --draft ngram|model|mtp|random|oracle")
    if args.draft != "none" and args.k == 0:
        raise ValueError(f"--k 0 with --draft {args.draft} drafts nothing: pass --k 1 or more, or --draft none to decode plainly")
    if args.k > args.max_k:
        raise ValueError(f"--k {args.k} exceeds --max-k {args.max_k}, the most drafts a step may carry "
                         f"(raise --max-k to allow more)")
    return args.k


def _generate(args) -> int:
    try:
        k = _drafts_per_step(args)
        sampling = sampling_from_args(args)
    except ValueError as exc:
        return fail(str(exc))
    if args.device == "cuda" and not torch.cuda.is_available():
        return fail("--device cuda, but torch sees no CUDA device")
    if k > DEFAULT_MAX_K:  # allowed (--max-k raised), but a user should know why a step is slow
        print(f"note: --k {k}: each step drafts up to {k} tokens one by one and verifies {k + 1} rows"
              + (" (on the CPU a verify row costs about a decode step)" if args.device == "cpu" else "")
              + f"; the engine's default most is {DEFAULT_MAX_K}", file=sys.stderr)
    if args.tensor_parallel > 1:
        from .parallel_generate import generate_tensor_parallel

        return generate_tensor_parallel(args, k, sampling)
    model_dir = args.model or default_model_dir()
    try:
        model = load_model(model_dir, args.device, DTYPES[args.dtype])
    except (ValueError, OSError) as exc:
        return fail(str(exc))
    tokenizer = TextTokenizer.from_model_dir(model_dir)
    try:
        prompt = prompt_ids(args, model_dir, tokenizer, model.config)
    except ValueError as exc:
        return fail(str(exc))

    engine = Engine(model, n_slots=1, max_seq_len=len(prompt) + args.max_new_tokens + k, max_k=k, rollback_mode=args.rollback)
    try:
        proposer = make_proposer(args, engine, prompt, sampling)
    except (ValueError, OSError) as exc:
        return fail(str(exc))

    # the tokens go to stdout as each step emits them (text where the model has a tokenizer)
    printer = TokenPrinter(tokenizer.stream() if tokenizer else None, quiet=args.json)
    start = time.perf_counter()
    result = generate(engine, prompt, args.max_new_tokens, sampling, proposer, k, on_tokens=printer.push)
    seconds = time.perf_counter() - start
    printer.end()
    report(args, model_dir, prompt, k, result, seconds, tokenizer)
    return 0
