"""`python -m verifier ...`: command-line entry points."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

from drafter.proposers import NgramProposer, OracleProposer, RandomProposer

from .arguments import at_least, token_ids
from .defaults import default_draft_model_dir, default_model_dir
from .engine import Engine
from .generate import generate
from .model import load_model
from .model.rollback import ROLLBACK_MODES, WOA
from .sampling import SamplingParams
from .tokenizer import TextTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m verifier", description="Bit-exact speculative-decoding verifier for hybrid LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from a prompt with the target model")
    gen.add_argument("--model", type=Path, help="HF checkpoint directory (default: the project's default model)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", type=token_ids, help="comma-separated token ids, e.g. 1,2,3")
    prompt.add_argument("--text", help="prompt text (needs tokenizer.json in the model directory)")
    gen.add_argument("--max-new-tokens", type=at_least(1), required=True)
    gen.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    gen.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    gen.add_argument("--logits-out", type=Path, help="write float32 [N, vocab] .npy: row i holds the logits token i was chosen from")
    spec = gen.add_argument_group("speculative decoding (every token and logit row equals the plain run's)")
    spec.add_argument("--draft", default="none", choices=["none", "ngram", "model", "random", "oracle"],
                      help="ngram: prompt lookup; model: a small checkpoint (--draft-model); random: K uniform ids "
                           "(adversarial); oracle: the true continuation")
    spec.add_argument("--draft-model", type=Path, default=None,
                      help="the model drafter's checkpoint (default: the shipped draft model, models/draft)")
    spec.add_argument("--k", type=at_least(0), default=None, help="drafts per step (default 4 with a drafter)")
    spec.add_argument("--seed-draft", type=int, default=0, help="seed of the random drafter")
    spec.add_argument("--rollback", default=WOA, choices=ROLLBACK_MODES, help="recurrent-state rollback: write-on-accept or snapshots")
    samp = gen.add_argument_group("sampling (default greedy)")
    samp.add_argument("--temperature", type=float, default=0.0)
    samp.add_argument("--top-k", type=at_least(0), default=0)
    samp.add_argument("--top-p", type=float, default=1.0)
    samp.add_argument("--seed", type=at_least(0), default=0)
    gen.add_argument("-v", "--verbose", action="store_true")
    _add_serve(sub)
    return parser


def _add_serve(sub) -> None:
    srv = sub.add_parser("serve", help="serve the verifier over gRPC until SIGTERM / SIGINT")
    srv.add_argument("--model", type=Path, help="HF checkpoint directory (default: the project's default model)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)")
    srv.add_argument("--port", type=at_least(0), required=True, help="port to bind; 0 picks a free one (the log line says which)")
    srv.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    srv.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    srv.add_argument("--n-slots", type=at_least(1), default=8, help="sessions held at once")
    srv.add_argument("--max-seq-len", type=at_least(2), default=2048, help="positions per session (prompt + generated)")
    srv.add_argument("--max-k", type=at_least(0), default=8, help="most drafts per step")
    srv.add_argument("--rollback", default=WOA, choices=ROLLBACK_MODES)
    srv.add_argument("--max-batch-rows", type=at_least(1), default=256, help="most verify rows in one engine batch")
    srv.add_argument("--max-wait-ms", type=float, default=0.0, help="let a batch gather this long (0: run at once)")
    srv.add_argument("--idle-timeout-s", type=float, default=None, help="reap sessions idle this long (default: never)")
    srv.add_argument("--retry-after-ms", type=at_least(0), default=200, help="the retry hint sent when every slot is in use")
    srv.add_argument("--max-message-mb", type=float, default=64.0, help="largest request or response message")
    srv.add_argument("--metrics-port", type=at_least(0), default=None, help="serve Prometheus metrics on this port")
    srv.add_argument("--auth-token", default=None, help="require 'authorization: Bearer TOKEN' (health checks exempt)")
    srv.add_argument("--tls-cert", type=Path, default=None, help="PEM server certificate (with --tls-key)")
    srv.add_argument("--tls-key", type=Path, default=None, help="PEM private key (with --tls-cert)")
    srv.add_argument("--grace-s", type=float, default=5.0, help="shutdown: time in-flight calls get to finish")
    srv.add_argument("--drain-s", type=float, default=0.0, help="shutdown: time health says NOT_SERVING before the port closes")
    srv.add_argument("-v", "--verbose", action="store_true")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        return _serve(args)
    return 2


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _generate(args) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        return _fail("--device cuda, but torch sees no CUDA device")
    model_dir = args.model or default_model_dir()
    try:
        model = load_model(model_dir, args.device, DTYPES[args.dtype])
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    tokenizer = TextTokenizer.from_model_dir(model_dir)
    if args.text is not None:
        if tokenizer is None:
            return _fail(f"--text needs {model_dir}/tokenizer.json; pass --prompt-ids instead")
        prompt = tokenizer.encode(args.text)
        if not prompt:
            return _fail("--text encodes to no tokens")
    else:
        prompt = args.prompt_ids
    vocab = model.config.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        return _fail(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}")
    limit = model.config.max_position_embeddings
    if len(prompt) + args.max_new_tokens > limit:
        return _fail(f"{len(prompt)} prompt tokens + {args.max_new_tokens} new tokens exceed the context length {limit}")

    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as exc:
        return _fail(str(exc))
    k = args.k if args.k is not None else (0 if args.draft == "none" else 4)
    if args.draft == "none" and k:
        return _fail("--k needs a drafter: pass --draft ngram|model|random|oracle")
    engine = Engine(model, n_slots=1, max_seq_len=len(prompt) + args.max_new_tokens + k, max_k=k, rollback_mode=args.rollback)
    proposer = None
    if args.draft == "random":
        proposer = RandomProposer(vocab, args.seed_draft)
    elif args.draft == "ngram":
        proposer = NgramProposer()
    elif args.draft == "model":
        draft_dir = args.draft_model or default_draft_model_dir()
        if draft_dir is None:
            return _fail("--draft model needs --draft-model DIR (no default draft model ships in this checkout)")
        from drafter.messages import Sampling
        from drafter.model_proposer import COUPLED, ModelProposer, load_draft_model

        try:
            # coupled mode: the drafter drafts with the session's own noise, so a sampled stream is the plain one
            proposer = ModelProposer(load_draft_model(draft_dir, args.device), vocab, engine.pool.max_seq_len,
                                     Sampling(args.temperature, args.top_k, args.top_p, args.seed), args.seed_draft, COUPLED)
        except (ValueError, OSError) as exc:
            return _fail(f"--draft-model {draft_dir}: {exc}")
    elif args.draft == "oracle":
        proposer = OracleProposer(len(prompt), generate(engine, prompt, args.max_new_tokens, sampling).tokens)

    start = time.perf_counter()
    result = generate(engine, prompt, args.max_new_tokens, sampling, proposer, k)
    seconds = time.perf_counter() - start
    if args.logits_out:
        np.save(args.logits_out, result.logits.cpu().numpy().astype(np.float32))
    text = tokenizer.decode(result.tokens) if tokenizer else None
    if args.json:
        out = {
            "model": str(model_dir),
            "prompt_tokens": len(prompt),
            "tokens": result.tokens,
            "finish_reason": result.finish_reason,
            "seconds": round(seconds, 4),
            "tokens_per_s": round(len(result.tokens) / seconds, 2) if seconds > 0 else None,
            "draft": args.draft,
            "k": k,
            "rollback": args.rollback,
            "steps": len(result.accepted_per_step),
            "accepted_per_step": result.accepted_per_step,
            "mean_acceptance_length": round(result.mean_acceptance_length, 4),
        }
        if text is not None:
            out["text"] = text
        print(json.dumps(out))
    else:
        print(text if text is not None else ",".join(map(str, result.tokens)))
        spec = f", {len(result.accepted_per_step)} steps, mean acceptance length {result.mean_acceptance_length:.2f}" if k else ""
        print(f"[{len(result.tokens)} tokens, {result.finish_reason}, {len(result.tokens) / seconds:.1f} tokens/s{spec}]", file=sys.stderr)
    return 0


def _serve(args) -> int:
    from .server import ServerConfig, serve

    if args.device == "cuda" and not torch.cuda.is_available():
        return _fail("--device cuda, but torch sees no CUDA device")
    try:
        config = ServerConfig(
            args.model or default_model_dir(), host=args.host, port=args.port, device=args.device, dtype=args.dtype,
            n_slots=args.n_slots, max_seq_len=args.max_seq_len, max_k=args.max_k, rollback=args.rollback,
            max_batch_rows=args.max_batch_rows, max_wait_ms=args.max_wait_ms, idle_timeout_s=args.idle_timeout_s,
            retry_after_ms=args.retry_after_ms,
            max_message_mb=args.max_message_mb, metrics_port=args.metrics_port, auth_token=args.auth_token,
            tls_cert=args.tls_cert, tls_key=args.tls_key, grace_s=args.grace_s, drain_s=args.drain_s,
        )
        return serve(config)
    except (ValueError, OSError) as exc:  # bad options, an unreadable checkpoint, a port in use
        return _fail(str(exc))
