"""`python -m drafter generate`: generate through a verifier server, drafting on this side.

Output: with `--json`, one JSON object once the session ends. Otherwise the tokens stream to stdout
as each step returns them: as text when `--tokenizer` names the model's tokenizer.json (the server
sends ids only, so the drafter needs the tokenizer to print text), else as comma-separated ids;
a one-line summary goes to stderr. Exit status: 0 done, 2 bad arguments (including ids the served
model cannot take), 1 the server refused or could not be reached, 130 interrupted (the session is
closed first).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from verifier.arguments import at_least, token_ids

from .adaptive import AdaptiveK
from .choose import DEFAULT_K, add_drafter_arguments, check_drafter_arguments, make_proposer
from .client import VerifierClient
from .loop import STREAM, UNARY, generate
from .messages import Sampling, VerifierError


def _add_sampling_and_connection(parser: argparse.ArgumentParser):
    """The sampling and connection flags generate and bench share; returns the connection group."""
    samp = parser.add_argument_group("sampling (default greedy)")
    samp.add_argument("--temperature", type=float, default=0.0)
    samp.add_argument("--top-k", type=at_least(0), default=0)
    samp.add_argument("--top-p", type=float, default=1.0)
    samp.add_argument("--seed", type=at_least(0), default=0)
    conn = parser.add_argument_group("connection")
    conn.add_argument("--auth-token", help="bearer token the server expects")
    conn.add_argument("--tls-root-cert", type=Path, help="PEM root certificate: connect with TLS")
    conn.add_argument("--timeout", type=float, default=60.0, help="seconds per call before it is retried")
    return conn


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m drafter", description="Drafter: propose tokens, let a verifier server check them.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from a prompt through a verifier server")
    gen.add_argument("--server", required=True, metavar="HOST:PORT", help="the verifier's address")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", type=token_ids, help="comma-separated token ids, e.g. 1,2,3")
    prompt.add_argument("--text", help="prompt text, tokenized by the server (its model needs a tokenizer)")
    gen.add_argument("--max-new-tokens", type=at_least(1), required=True)
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming tokens")
    gen.add_argument("--tokenizer", type=Path, help="tokenizer.json (or its model directory): stream text instead of ids")
    gen.add_argument("--logits-out", type=Path, help="write float32 [N, vocab] .npy: row i holds the logits token i was chosen from")
    draft = gen.add_argument_group("drafting (greedy and coupled sampling: the tokens equal plain decoding whatever the "
                                   "drafter; a sampling model drafter's probabilities make each token an exact sample)")
    add_drafter_arguments(draft)
    conn = _add_sampling_and_connection(gen)
    conn.add_argument("--transport", default=STREAM, choices=[STREAM, UNARY], help="VerifyStream, or one Verify call per step")
    gen.add_argument("-v", "--verbose", action="store_true")
    _add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        return _generate(args)
    if args.command == "bench":
        return _bench(args)
    return 2


def _fail(message: str, status: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return status


def _generate(args) -> int:
    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
        check_drafter_arguments(args, [args.drafter])
        if args.drafter == "none" and args.k:
            raise ValueError("--k needs a drafter: pass --drafter ngram|model|random")
        if args.tls_root_cert is not None and not args.tls_root_cert.is_file():
            raise ValueError(f"--tls-root-cert: no file at {args.tls_root_cert}")
        if args.timeout <= 0:
            raise ValueError(f"--timeout must be > 0, got {args.timeout}")
        text_stream = None
        if args.tokenizer is not None:
            from .text import TextStream, load_tokenizer  # tokenizers only when text is wanted

            text_stream = TextStream(load_tokenizer(args.tokenizer))
        client = VerifierClient(args.server, auth_token=args.auth_token, tls_root_cert=args.tls_root_cert, timeout_s=args.timeout)
    except ValueError as exc:
        return _fail(str(exc), 2)
    with client:
        try:
            info = client.model_info()
        except VerifierError as err:
            return _fail(str(err), 1)
        if args.prompt_ids is not None:
            bad = [t for t in args.prompt_ids if not 0 <= t < info.vocab_size]
            if bad:
                return _fail(f"--prompt-ids {bad[:5]} are outside the served model's vocabulary 0..{info.vocab_size - 1}", 2)
        elif not info.has_tokenizer:
            return _fail(f"--text: the served model {info.model_id!r} has no tokenizer; pass --prompt-ids", 2)
        try:
            proposer = make_proposer(args.drafter, args, info, sampling)
        except ValueError as exc:  # a draft model that cannot serve this target (vocabulary, config, weights)
            return _fail(str(exc), 2)
        k = min(info.max_k, args.k if args.k is not None else (0 if args.drafter == "none" else DEFAULT_K))
        adaptive = AdaptiveK(k) if args.adaptive_k and k > 0 else None

        printer = _Printer(text_stream, quiet=args.json)
        start = time.perf_counter()
        try:
            result = generate(client, proposer, prompt_ids=args.prompt_ids, text=args.text, max_new_tokens=args.max_new_tokens,
                              sampling=sampling, k=k, return_logits=args.logits_out is not None, transport=args.transport,
                              info=info, on_tokens=printer.push, adaptive=adaptive)
        except VerifierError as err:
            printer.end()
            return _fail(str(err), 1)
        except KeyboardInterrupt:
            printer.end()
            return _fail("interrupted (the session was closed)", 130)
        seconds = time.perf_counter() - start
        printer.end()
    if args.logits_out is not None:
        np.save(args.logits_out, result.logits)
    rate = round(len(result.tokens) / seconds, 2) if seconds > 0 else None
    if args.json:
        out = {
            "server": args.server,
            "model_id": info.model_id,
            "prompt_tokens": len(result.prompt_ids),
            "tokens": result.tokens,
            "finish_reason": result.finish_reason,
            "seconds": round(seconds, 4),
            "tokens_per_s": rate,
            "drafter": args.drafter,
            "k": k,
            "adaptive_k": adaptive is not None,
            "steps": result.steps,
            "accepted_per_step": result.accepted_per_step,
            "drafts_per_step": result.drafts_per_step,
            "mean_acceptance_length": round(result.mean_acceptance_length, 4),
        }
        if text_stream is not None:
            out["text"] = text_stream.text
        print(json.dumps(out))
    else:
        spec = f", {result.steps} steps, mean acceptance length {result.mean_acceptance_length:.2f}" if k else ""
        print(f"[{len(result.tokens)} tokens, {result.finish_reason}, {rate} tokens/s{spec}]", file=sys.stderr)
    return 0


class _Printer:
    """Streams each step's tokens to stdout: text through the tokenizer, else comma-separated ids."""

    def __init__(self, text_stream, quiet: bool):
        self.text_stream, self.quiet = text_stream, quiet
        self.started = False

    def push(self, ids: list[int]) -> None:
        if self.text_stream is not None:
            chunk = self.text_stream.push(ids)  # fed even when quiet: --json reports the text
        else:
            chunk = ("," if self.started else "") + ",".join(map(str, ids))
        self.started = True
        if not self.quiet and chunk:
            sys.stdout.write(chunk)
            sys.stdout.flush()

    def end(self) -> None:
        if self.quiet or not self.started:
            return
        if self.text_stream is not None:
            sys.stdout.write(self.text_stream.flush())
        sys.stdout.write("\n")
        sys.stdout.flush()


def _add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="acceptance and speed of drafters and K through a verifier server",
                           description="For every prompt: plain decoding, then each drafter at each K; writes "
                                       "DIR/results.json and PNG plots, prints a table. Exit 1 if any stream differs from plain "
                                       "decoding (rows verified by rejection sampling excepted: see drafter/bench.py).")
    bench.add_argument("--server", required=True, metavar="HOST:PORT", help="the verifier's address")
    bench.add_argument("--prompts", type=Path, required=True, metavar="FILE.jsonl",
                       help='one prompt a line: {"prompt_ids": [1, 2, 3]} or {"text": "..."}')
    bench.add_argument("--max-new-tokens", type=at_least(1), required=True)
    bench.add_argument("--out", type=Path, required=True, metavar="DIR", help="where results.json and the plots go")
    add_drafter_arguments(bench.add_argument_group("drafting"), many=True)
    _add_sampling_and_connection(bench)
    bench.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    bench.add_argument("-v", "--verbose", action="store_true")


def _bench(args) -> int:
    # matplotlib and tqdm load only for the bench
    from .bench import REJECTION, load_prompts, results, run_bench, summary_table, write_results
    from .bench_plots import write_plots

    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
        check_drafter_arguments(args, args.drafter)
        ks = args.k or [DEFAULT_K]
        if 0 in ks:
            raise ValueError("--k values must be >= 1 (plain decoding is measured anyway)")
        prompts = load_prompts(args.prompts)
        if args.tls_root_cert is not None and not args.tls_root_cert.is_file():
            raise ValueError(f"--tls-root-cert: no file at {args.tls_root_cert}")
        if args.timeout <= 0:
            raise ValueError(f"--timeout must be > 0, got {args.timeout}")
        client = VerifierClient(args.server, auth_token=args.auth_token, tls_root_cert=args.tls_root_cert, timeout_s=args.timeout)
    except (ValueError, OSError) as exc:
        return _fail(str(exc), 2)
    with client:
        try:
            info = client.model_info()
            plain, runs = run_bench(client, info, prompts, args.drafter, ks, max_new_tokens=args.max_new_tokens,
                                    sampling=sampling, make_proposer=lambda name: make_proposer(name, args, info, sampling),
                                    adaptive=args.adaptive_k, progress=not args.no_progress)
        except ValueError as exc:
            return _fail(str(exc), 2)
        except VerifierError as err:
            return _fail(str(err), 1)
        except KeyboardInterrupt:
            return _fail("interrupted (no results written)", 130)
    data = results(args.server, info, args.prompts, plain, runs, args.max_new_tokens, sampling)
    path = write_results(args.out, data)
    write_plots(args.out, data)
    print(summary_table(data))
    print(f"wrote {path} and the plots beside it", file=sys.stderr)
    differ = [f"{run.drafter} k={run.k}" for run in runs if run.failed]
    if differ:
        return _fail(f"streams differ from plain decoding for {', '.join(differ)} (mismatched_prompts in {path})", 1)
    if any(run.acceptance == REJECTION for run in runs):
        print("note: rows marked (rejection) sent draft probabilities, so the verifier used rejection sampling: "
              "their tokens are exact samples of the target, not the plain run's stream", file=sys.stderr)
    return 0
