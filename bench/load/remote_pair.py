"""A remote drafter against the in-process pair (bench.serve; issue 13, item 3).

Held-out prompts, greedy, one session at a time as `python -m drafter generate` runs them
(drafter.loop.generate over a VerifyStream to a `python -m verifier serve` subprocess with the
server's defaults): plain decoding, then the model drafter at K in this process (on draft_device).
Then the same pair in this process (verifier.generate on one engine), plain and speculative. Each
mode first runs the first prompt untimed, so start-up, Triton compilation and graph capture stay
out of the timed part. Greedy streams of all four modes must be equal, token for token.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from drafter.bench import load_prompts
from drafter.client import VerifierClient
from drafter.loop import generate as remote_generate
from verifier.engine import Engine
from verifier.generate import generate as local_generate
from verifier.generation import Generation, mean_acceptance_length
from verifier.model import load_model
from verifier.proposers import ModelProposer
from verifier.server.config import ServerConfig
from verifier.tokenizer import TextTokenizer

from .server import ServerProcess


def prompt_ids(path: Path, count: int, target_dir: Path) -> list[list[int]]:
    """The first `count` prompts of a JSONL file ({"prompt_ids"} or {"text"}, the latter tokenized
    by the target's tokenizer)."""
    tokenizer = TextTokenizer.from_model_dir(target_dir)
    out = []
    for prompt in load_prompts(path)[:count]:
        if prompt.prompt_ids is not None:
            out.append(list(prompt.prompt_ids))
        elif tokenizer is None:
            raise ValueError(f"{path}: a text prompt, but {target_dir} ships no tokenizer.json")
        else:
            out.append(tokenizer.encode(prompt.text))
    return out


def timed(generate_one: Callable[[list[int]], Generation], prompts: list[list[int]]) -> tuple[float, list[Generation]]:
    """Tokens per second over every prompt after an untimed run of the first, and the generations."""
    generate_one(prompts[0])
    generations, seconds = [], 0.0
    for prompt in prompts:
        start = time.perf_counter()
        generations.append(generate_one(prompt))
        seconds += time.perf_counter() - start
    return round(sum(len(g.tokens) for g in generations) / seconds, 2), generations


def acceptance(generations: list[Generation]) -> float:
    drafted = [(a, d) for g in generations for a, d in zip(g.accepted_per_step, g.drafted_per_step) if d]
    return round(mean_acceptance_length(sum(a for a, _ in drafted), len(drafted)), 3)


def remote_drafter(target: Path, draft: Path, prompts_path: Path, count: int, new_tokens: int, k: int, device: str,
                   dtype: str, draft_device: str, progress: Callable[[str], None] = lambda line: None) -> dict:
    prompts = prompt_ids(prompts_path, count, target)
    longest = max(len(p) for p in prompts) + new_tokens + k + 1
    defaults = ServerConfig(target, port=0)
    server = ServerProcess(target, device=device, dtype=dtype, max_k=max(k, defaults.max_k),
                           max_seq_len=max(longest, defaults.max_seq_len))
    try:
        with VerifierClient(server.address, timeout_s=120.0) as client:
            info = client.model_info()
            proposer = ModelProposer.from_dir(draft, info.vocab_size, info.max_context, device=draft_device)
            progress(f"remote drafter: {len(prompts)} prompts x {new_tokens} tokens, plain over the server")
            plain_rate, plain = timed(lambda p: remote_generate(client, None, prompt_ids=p, max_new_tokens=new_tokens,
                                                                k=0, info=info), prompts)
            progress(f"remote drafter: the model drafter at K={k} on {draft_device}")
            model_rate, model = timed(lambda p: remote_generate(client, proposer, prompt_ids=p, max_new_tokens=new_tokens,
                                                                k=k, info=info), prompts)
    finally:
        server.stop()
    progress("remote drafter: the same pair in process")
    engine = Engine(load_model(target, device, getattr(torch, dtype)), 1, longest, max_k=k)
    local_proposer = ModelProposer.from_dir(draft, engine.vocab_size, engine.pool.max_seq_len, device=draft_device)
    local_plain_rate, local_plain = timed(lambda p: local_generate(engine, p, new_tokens), prompts)
    local_model_rate, local_model = timed(lambda p: local_generate(engine, p, new_tokens, proposer=local_proposer, k=k),
                                          prompts)
    streams = [[g.tokens for g in run] for run in (plain, model, local_plain, local_model)]
    remote_speedup, local_speedup = round(model_rate / plain_rate, 3), round(local_model_rate / local_plain_rate, 3)
    return {
        "k": k, "prompts": len(prompts), "max_new_tokens": new_tokens, "target": str(target), "draft": str(draft),
        "draft_device": draft_device,
        "plain_tokens_per_s": plain_rate, "remote_model_tokens_per_s": model_rate, "remote_model_speedup": remote_speedup,
        "inprocess_plain_tokens_per_s": local_plain_rate, "inprocess_model_tokens_per_s": local_model_rate,
        "inprocess_model_speedup": local_speedup, "remote_over_inprocess_speedup": round(remote_speedup / local_speedup, 3),
        "remote_mean_acceptance_length": acceptance(model), "inprocess_mean_acceptance_length": acceptance(local_model),
        "streams_equal": all(s == streams[0] for s in streams),
    }
