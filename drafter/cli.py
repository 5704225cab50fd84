"""`python -m drafter generate`: generate through a verifier server, drafting on this side, or
letting the server draft (--server-draft NAME: one of the model's ModelInfo.server_drafters, "ngram"
or "mtp"; the steps then carry no drafts, and the figures count the drafts the server verified).

Output: with `--json`, one JSON object once the session ends. Otherwise the tokens stream to stdout
as each step returns them: as text when `--tokenizer` names the model's tokenizer.json (the server
sends ids only, so the drafter needs the tokenizer to print text), else as comma-separated ids;
a one-line summary goes to stderr. Exit status: 0 done, 2 bad arguments (including ids the served
model cannot take, a --k above the server's max_k and a prompt plus --max-new-tokens past its
max_context: no silent cuts), 1 the server refused or could not be reached, 130 interrupted (the
session is closed first).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

from verifier.arguments import DefaultsHelpFormatter, OneLineErrors, add_sampling_arguments, at_least, sampling_from_args, token_ids, utf8_text
from verifier.printing import TokenPrinter

from .adaptive import AdaptiveK
from .choose import DEFAULT_K, add_drafter_arguments, bench_name, check_drafter_arguments, check_server_offers, make_proposer
from .client import VerifierClient
from .limits import OverLimit, check_budget, check_k
from .loop import STREAM, UNARY, generate
from .messages import ModelInfo, VerifierError

# which streams equal plain decoding: the README's section "The command line" says the same
STREAMS_NOTE = ("Which streams equal plain decoding token for token: greedy, every drafter; seeded sampling, ngram, "
                "random, the model drafter with --coupled-drafts and every --server-draft (its drafts carry no q). A "
                "sampled session whose model drafter sends its probabilities (the default mode) is verified by "
                "rejection sampling: exact samples of the target, but another stream.")
# the flags of a drafter in this process: none applies when the server drafts (--server-draft)
CLIENT_DRAFTER_FLAGS = ("--drafter", "--draft-model", "--draft-device", "--seed-draft", "--ngram-min", "--ngram-max",
                        "--coupled-drafts", "--adaptive-k")


TOKEN_ENV = "VERIFIER_AUTH_TOKEN"  # the client's bearer token, kept out of the process list


def auth_token(args: argparse.Namespace) -> str | None:
    """The token to send: --auth-token (with a warning: it shows in the process list),
    --auth-token-file's first line, or $VERIFIER_AUTH_TOKEN; ValueError for an unreadable or empty file."""
    if args.auth_token is not None:
        if args.auth_token_file is not None:
            raise ValueError("pass --auth-token or --auth-token-file, not both")
        print(f"warning: --auth-token shows in the process list to every local user; use --auth-token-file or ${TOKEN_ENV}",
              file=sys.stderr)
        return args.auth_token
    if args.auth_token_file is not None:
        try:
            lines = args.auth_token_file.read_text().strip().splitlines()
        except OSError as exc:
            raise ValueError(f"--auth-token-file {args.auth_token_file}: {exc.strerror or exc}") from None
        if not lines or not lines[0].strip():
            raise ValueError(f"--auth-token-file {args.auth_token_file} is empty")
        return lines[0].strip()
    return os.environ.get(TOKEN_ENV) or None


def _add_connection(parser: argparse.ArgumentParser):
    """The connection flags generate and bench share; returns their group."""
    conn = parser.add_argument_group("connection")
    conn.add_argument("--auth-token-file", type=Path,
                      help=f"file whose first line is the bearer token to send (default: ${TOKEN_ENV} if set, else none sent)")
    conn.add_argument("--auth-token", help="the bearer token on the command line: every local user can read it in the process "
                                           "list, so prefer --auth-token-file or $" + TOKEN_ENV + " (default: none)")
    conn.add_argument("--tls-client-cert", type=Path, help="PEM client certificate for a server that asks for one (with --tls-client-key; default: none)")
    conn.add_argument("--tls-client-key", type=Path, help="PEM private key of --tls-client-cert (default: none)")
    conn.add_argument("--tls-root-cert", type=Path, help="PEM root certificate: connect with TLS (default: plaintext)")
    conn.add_argument("--timeout", type=float, default=60.0, help="seconds per call before it is retried")
    return conn


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="python -m drafter", description="Drafter: propose tokens, let a verifier server check them.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from a prompt through a verifier server", formatter_class=DefaultsHelpFormatter,
                         description=f"{__doc__.split(chr(10) * 2, 1)[1]} {STREAMS_NOTE}")
    gen.add_argument("--server", required=True, metavar="HOST:PORT", help="the verifier's address")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", type=token_ids, help="comma-separated token ids, e.g. 1,2,3")
    prompt.add_argument("--text", type=utf8_text, help="prompt text, tokenized by the server (its model needs a tokenizer)")
    gen.add_argument("--max-new-tokens", type=at_least(1), required=True,
                     help="tokens to generate, the first one included; prompt + these must fit the server's max_context")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming tokens")
    gen.add_argument("--tokenizer", type=Path,
                     help="tokenizer.json (or its model directory): stream text instead of ids (default: stream ids)")
    gen.add_argument("--logits-out", type=Path,
                     help="write float32 [N, vocab] .npy: row i holds the logits token i was chosen from (default: not written)")
    drafting = gen.add_argument_group("drafting")
    add_drafter_arguments(drafting)
    drafting.add_argument("--server-draft", metavar="NAME",
                          help="let the server draft instead of this process: ngram (its prompt lookup) or mtp (the "
                               "checkpoint's MTP head), one of the served model's ModelInfo.server_drafters; the server "
                               "proposes --k drafts a step and the steps send none; no other drafting flag applies "
                               "(default: this process drafts, with --drafter)")
    add_sampling_arguments(gen)
    conn = _add_connection(gen)
    conn.add_argument("--transport", default=STREAM, choices=[STREAM, UNARY], help="VerifyStream, or one Verify call per step")
    gen.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    _add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate" and args.server_draft is not None:
        _refuse_client_drafting(_subcommand(parser, "generate"), argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        return _generate(args)
    if args.command == "bench":
        return _bench(args)
    return 2


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    # argparse offers no public walk over a parser's subcommands
    (commands,) = [a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    return _subcommands(parser)[name]


def _given_flags(argv: list[str] | None) -> set[str]:
    """The dests that argv sets explicitly: argv parsed again with every default suppressed, so
    only what the command line gave lands in the namespace. (A flag given at its default value is
    given all the same: the person meant it.)"""
    quiet = build_parser()
    for p in (quiet, *_subcommands(quiet).values()):
        for action in p._actions:
            action.default = argparse.SUPPRESS
    return set(vars(quiet.parse_args(argv)))


def _refuse_client_drafting(gen: argparse.ArgumentParser, argv: list[str] | None) -> None:
    """--server-draft with a flag of this process's drafter: an argparse error (exit 2), since the
    server drafts and the flag would be ignored silently."""
    given = _given_flags(argv)
    dests = {a.dest: a.option_strings[0] for a in gen._actions if a.option_strings}
    clash = [flag for dest, flag in dests.items() if flag in CLIENT_DRAFTER_FLAGS and dest in given]
    if clash:
        gen.error(f"argument --server-draft: not allowed with {', '.join(clash)} (the server drafts; "
                  f"{', '.join(clash)} configure{'s' if len(clash) == 1 else ''} a drafter of this process)")


def _fail(message: str, status: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return status


def _generate(args) -> int:
    try:
        sampling = sampling_from_args(args)
        check_drafter_arguments(args, [] if args.server_draft is not None else [args.drafter])
        if args.server_draft == "":
            raise ValueError("--server-draft is empty: name a server drafter (ngram or mtp)")
        if args.drafter == "none" and args.k and args.server_draft is None:
            raise ValueError("--k needs a drafter: pass --drafter ngram|model|random")
        _check_connection_arguments(args)
        text_stream = None
        if args.tokenizer is not None:
            from verifier.tokenizer import TextStream  # tokenizers only when text is wanted

            from .text import load_tokenizer

            text_stream = TextStream(load_tokenizer(args.tokenizer))
        client = VerifierClient(args.server, auth_token=auth_token(args), tls_root_cert=args.tls_root_cert, timeout_s=args.timeout,
                                tls_client_cert=args.tls_client_cert, tls_client_key=args.tls_client_key)
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
            if args.server_draft is not None:  # before any session: a drafter the model lacks is a bad argument
                check_server_offers(args.server_draft, info, f"--server-draft {args.server_draft}")
            k = _drafts_per_step(args, info)
            # a --text prompt's length is known once the server has tokenized it: checked again at the open
            check_budget(args.max_new_tokens, info, None if args.prompt_ids is None else len(args.prompt_ids))
            proposer = None if args.server_draft is not None else make_proposer(args.drafter, args, info, sampling)
        except ValueError as exc:  # a server limit, or a draft model that cannot serve this target
            return _fail(str(exc), 2)
        adaptive = AdaptiveK(k) if args.adaptive_k and k > 0 else None

        printer = TokenPrinter(text_stream, quiet=args.json)
        start = time.perf_counter()
        try:
            result = generate(client, proposer, prompt_ids=args.prompt_ids, text=args.text, max_new_tokens=args.max_new_tokens,
                              sampling=sampling, k=k, return_logits=args.logits_out is not None, transport=args.transport,
                              info=info, on_tokens=printer.push, adaptive=adaptive, server_drafter=args.server_draft or "",
                              on_open=lambda session: check_budget(args.max_new_tokens, info, len(session.prompt_ids)))
        except OverLimit as exc:  # raised at the open, before any token: the session is closed
            return _fail(str(exc), 2)
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
            # a server drafter under the bench's name for it (mtp, server-ngram): one name per drafter
            "drafter": args.drafter if args.server_draft is None else bench_name(args.server_draft),
            "server_drafter": args.server_draft,
            "k": k,
            "adaptive_k": adaptive is not None,
            **result.step_figures(),
        }
        if text_stream is not None:
            out["text"] = text_stream.text
        print(json.dumps(out))
    else:
        spec = f", {result.steps} steps, mean acceptance length {result.mean_acceptance_length:.2f}" if k else ""
        print(f"[{len(result.tokens)} tokens, {result.finish_reason}, {rate} tokens/s{spec}]", file=sys.stderr)
    return 0


def _drafts_per_step(args, info: ModelInfo) -> int:
    """--k checked against the server's max_k; without --k, DEFAULT_K or the server's max_k if lower
    (whoever drafts: this process or the server)."""
    server = args.server_draft is not None
    drafting = server or args.drafter != "none"
    if args.k is None:
        return min(DEFAULT_K, info.max_k) if drafting else 0
    if drafting and args.k == 0:
        named, plainly = (f"--server-draft {args.server_draft}", "leave out --server-draft") if server else \
            (f"--drafter {args.drafter}", "--drafter none")
        raise ValueError(f"--k 0 with {named} drafts nothing: pass --k 1 or more, or {plainly} to decode plainly")
    check_k(args.k, info)
    return args.k


def _check_connection_arguments(args) -> None:
    if args.tls_root_cert is not None and not args.tls_root_cert.is_file():
        raise ValueError(f"--tls-root-cert: no file at {args.tls_root_cert}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")



def _add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="acceptance and speed of drafters and K through a verifier server",
                           formatter_class=DefaultsHelpFormatter,
                           description="For every prompt: plain decoding, then each drafter at each K; writes DIR/results.json "
                                       "and PNG plots, prints a table. Exit 1 if any stream differs from plain decoding (rows "
                                       "verified by rejection sampling excepted: see drafter/bench.py); exit 2 for bad "
                                       "arguments, a --k above the server's max_k or a prompt past its max_context.")
    bench.add_argument("--server", required=True, metavar="HOST:PORT", help="the verifier's address")
    bench.add_argument("--prompts", type=Path, required=True, metavar="FILE.jsonl",
                       help='one prompt a line: {"prompt_ids": [1, 2, 3]} or {"text": "..."}')
    bench.add_argument("--max-new-tokens", type=at_least(1), required=True,
                       help="tokens per generation; every prompt + these must fit the server's max_context")
    bench.add_argument("--out", type=Path, required=True, metavar="DIR", help="where results.json and the plots go")
    add_drafter_arguments(bench.add_argument_group("drafting"), many=True)
    add_sampling_arguments(bench)
    _add_connection(bench)
    bench.add_argument("--allow-trimming", action="store_true",
                       help="let the server's goodput policy trim the bench's drafts (default: every draft is verified, "
                            "so the figures measure the drafter, not the policy)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    bench.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")


def _bench(args) -> int:
    # matplotlib and tqdm load only for the bench
    from .bench import REJECTION, load_prompts, results, run_bench, summary_table, trimming_line, write_results
    from .bench_plots import write_plots

    try:
        sampling = sampling_from_args(args)
        check_drafter_arguments(args, args.drafter)
        ks = args.k or [DEFAULT_K]
        if 0 in ks:
            raise ValueError("--k values must be >= 1 (plain decoding is measured anyway)")
        prompts = load_prompts(args.prompts)
        _check_connection_arguments(args)
        client = VerifierClient(args.server, auth_token=auth_token(args), tls_root_cert=args.tls_root_cert, timeout_s=args.timeout,
                                tls_client_cert=args.tls_client_cert, tls_client_key=args.tls_client_key)
    except (ValueError, OSError) as exc:
        return _fail(str(exc), 2)
    with client:
        try:
            info = client.model_info()
            plain, runs = run_bench(client, info, prompts, args.drafter, ks, max_new_tokens=args.max_new_tokens,
                                    sampling=sampling, make_proposer=lambda name: make_proposer(name, args, info, sampling),
                                    adaptive=args.adaptive_k, progress=not args.no_progress,
                                    allow_trimming=args.allow_trimming)
        except ValueError as exc:
            return _fail(str(exc), 2)
        except VerifierError as err:
            return _fail(str(err), 1)
        except KeyboardInterrupt:
            return _fail("interrupted (no results written)", 130)
    data = results(args.server, info, args.prompts, plain, runs, args.max_new_tokens, sampling, args.allow_trimming)
    path = write_results(args.out, data)
    write_plots(args.out, data)
    print(summary_table(data))
    print(trimming_line(data))
    print(f"wrote {path} and the plots beside it", file=sys.stderr)
    differ = [f"{run.drafter} k={run.k}" for run in runs if run.failed]
    if differ:
        return _fail(f"streams differ from plain decoding for {', '.join(differ)} (mismatched_prompts in {path})", 1)
    if any(run.acceptance == REJECTION for run in runs):
        print("note: rows marked (rejection) sent draft probabilities, so the verifier used rejection sampling: "
              "their tokens are exact samples of the target, not the plain run's stream", file=sys.stderr)
    return 0
