"""The generate command's arguments turned into what a run needs, shared by the one-process run
(verifier/cli.py) and the tensor-parallel one (verifier/parallel_generate.py): the prompt's ids,
the drafter, the report, and the one-line refusal of a bad argument."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from .defaults import default_draft_model_dir, default_model_dir
from .engine import Engine
from .generate import generate
from .proposers import NgramProposer, OracleProposer, Proposer, RandomProposer
from .tokenizer import TextTokenizer


def fail(message: str) -> int:
    """A bad argument: one line on stderr -> exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def prompt_ids(args, model_dir: Path, tokenizer: TextTokenizer | None, config) -> list[int]:
    """The prompt's ids (--text encoded, or --prompt-ids) checked against the model's config;
    ValueError naming the problem."""
    if args.text is not None:
        if tokenizer is None:
            raise ValueError(f"--text needs {model_dir}/tokenizer.json; pass --prompt-ids instead")
        prompt = tokenizer.encode(args.text)
        if not prompt:
            raise ValueError("--text encodes to no tokens")
    else:
        prompt = args.prompt_ids
    vocab = config.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}")
    limit = config.max_position_embeddings
    if len(prompt) + args.max_new_tokens > limit:
        raise ValueError(f"{len(prompt)} prompt tokens + {args.max_new_tokens} new tokens exceed the context length {limit}")
    return prompt


def report(args, model_dir: Path, prompt: list[int], k: int, result, seconds: float, tokenizer: TextTokenizer | None) -> None:
    """After the streamed tokens: --logits-out's file, then the JSON object or the summary line."""
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
            **result.step_figures(),
        }
        if text is not None:
            out["text"] = text
        print(json.dumps(out))
    else:
        spec = f", {result.steps} steps, mean acceptance length {result.mean_acceptance_length:.2f}" if k else ""
        print(f"[{len(result.tokens)} tokens, {result.finish_reason}, {len(result.tokens) / seconds:.1f} tokens/s{spec}]", file=sys.stderr)


def make_proposer(args, engine: Engine, prompt: list[int], sampling) -> Proposer | None:
    """The drafter --draft names; ValueError / OSError naming the flag when it cannot be built."""
    vocab = engine.vocab_size
    if args.draft == "random":
        return RandomProposer(vocab, args.seed_draft)
    if args.draft == "ngram":
        return NgramProposer()
    if args.draft == "oracle":
        return OracleProposer(len(prompt), generate(engine, prompt, args.max_new_tokens, sampling).tokens)
    if args.draft == "mtp":
        return mtp_proposer(args, engine, sampling)
    if args.draft == "model":
        draft_dir = args.draft_model or default_draft_model_dir()
        if draft_dir is None:
            raise ValueError("--draft model needs --draft-model DIR (no default draft model ships in this checkout)")
        from .proposers import COUPLED, ModelProposer, load_draft_model

        try:
            # coupled mode: the drafter drafts with the session's own noise, so a sampled stream is the plain one
            return ModelProposer(load_draft_model(draft_dir, args.device), vocab, engine.max_seq_len, sampling,
                                 args.seed_draft, COUPLED)
        except (ValueError, OSError) as exc:
            raise ValueError(f"--draft-model {draft_dir}: {exc}") from None
    return None


def mtp_proposer(args, engine: Engine, sampling) -> Proposer:
    """The checkpoint's own MTP head drafting from the target's hidden rows; ValueError naming
    --draft mtp when the checkpoint has none (or a broken one)."""
    from .model.mtp import load_mtp_head
    from .proposers import MTPProposer

    model_dir = args.model or default_model_dir()
    try:
        head = load_mtp_head(model_dir, engine.model)
    except (ValueError, OSError) as exc:
        raise ValueError(f"--draft mtp: the MTP head of {model_dir}: {exc}") from None
    if head is None:
        raise ValueError(f"--draft mtp: the checkpoint {model_dir} has no MTP head (no mtp.* tensors); "
                         "pick another --draft")
    # coupled drafts (the default): a sampled stream is the plain one
    return MTPProposer(head, engine.max_seq_len, sampling)
