"""A remote drafter against the in-process pair (bench.serve).

Held-out prompts, greedy, one session at a time as `python -m drafter generate` runs them
(drafter.loop.generate over a VerifyStream to a `python -m verifier serve` subprocess with the
server's defaults): plain decoding, then the model drafter at K in this process (on draft_device).
Then the same pair in this process (verifier.generate on one engine), plain and speculative. Each
mode first runs every prompt once untimed, so start-up, Triton compilation and graph capture stay
out of the timed part. (Every prompt, not the first alone: a prompt of a new length compiles
kernels for the prefill, on the server and in the drafter: warmed on the first prompt alone, the
plain mode, which runs first, would pay the server's compilations for the model mode and the model
drafter's speedup would read high.) Greedy streams of all four modes must be
equal, token for token.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from drafter.bench import load_prompts
from drafter.client import VerifierClient
from drafter.loop import generate as remote_generate
from drafter.messages import Stats
from verifier.engine import Engine
from verifier.generate import generate as local_generate
from verifier.generation import Generation, mean_acceptance_length
from verifier.model import load_model
from verifier.proposers import ModelProposer
from verifier.server.config import ServerConfig
from verifier.tokenizer import TextTokenizer

from .report import server_figures
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


class TimedProposer:
    """A proposer's proposals, timed (wall seconds, the proposer's own device sync included): the
    part of a round spent drafting. Passes every call through unchanged."""

    def __init__(self, proposer):
        self.proposer, self.seconds = proposer, 0.0

    def propose(self, context: list[int], k: int) -> list[int]:
        return self.propose_with_probs(context, k)[0]

    def propose_with_probs(self, context: list[int], k: int):
        start = time.perf_counter()
        try:
            return self.proposer.propose_with_probs(context, k)
        finally:
            self.seconds += time.perf_counter() - start


class Timed:
    """One mode's timed generations: tokens/s, and per round (step) its wall ms and the ms spent
    drafting (the rest: the step itself, through the service or the engine, and the loop). With
    `server_stats` (a served mode: the client's GetStats), also the server's side of a round: the
    engine step on its thread, and a step's time from its request's arrival to its result."""

    def __init__(self, generate_one: Callable[[list[int]], Generation], prompts: list[list[int]],
                 proposer: TimedProposer | None = None, server_stats: Callable[[], Stats] | None = None):
        for prompt in prompts:  # untimed: start-up, captures, and every prompt's own compilations
            generate_one(prompt)
        drafted_before = proposer.seconds if proposer is not None else 0.0
        stats_before = server_stats() if server_stats is not None else None
        self.generations, seconds = [], 0.0
        for prompt in prompts:
            start = time.perf_counter()
            self.generations.append(generate_one(prompt))
            seconds += time.perf_counter() - start
        rounds = sum(len(g.accepted_per_step) for g in self.generations)
        drafting = proposer.seconds - drafted_before if proposer is not None else 0.0
        self.tokens_per_s = round(sum(len(g.tokens) for g in self.generations) / seconds, 2)
        self.ms_per_round = round(seconds / rounds * 1e3, 3)
        self.drafting_ms_per_round = round(drafting / rounds * 1e3, 3)
        self.server = server_figures(stats_before, server_stats()) if server_stats is not None else None


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
            proposer = TimedProposer(ModelProposer.from_dir(draft, info.vocab_size, info.max_context, device=draft_device))
            progress(f"remote drafter: {len(prompts)} prompts x {new_tokens} tokens, plain over the server")
            plain = Timed(lambda p: remote_generate(client, None, prompt_ids=p, max_new_tokens=new_tokens, k=0, info=info),
                          prompts, server_stats=client.stats)
            progress(f"remote drafter: the model drafter at K={k} on {draft_device}")
            model = Timed(lambda p: remote_generate(client, proposer, prompt_ids=p, max_new_tokens=new_tokens, k=k, info=info),
                          prompts, proposer, server_stats=client.stats)
    finally:
        server.stop()
    progress("remote drafter: the same pair in process")
    engine = Engine(load_model(target, device, getattr(torch, dtype)), 1, longest, max_k=k)
    local_proposer = TimedProposer(ModelProposer.from_dir(draft, engine.vocab_size, engine.pool.max_seq_len,
                                                          device=draft_device))
    local_plain = Timed(lambda p: local_generate(engine, p, new_tokens), prompts)
    local_model = Timed(lambda p: local_generate(engine, p, new_tokens, proposer=local_proposer, k=k), prompts, local_proposer)
    runs = {"remote_plain": plain, "remote_model": model, "inprocess_plain": local_plain, "inprocess_model": local_model}
    streams = [[g.tokens for g in run.generations] for run in runs.values()]
    remote_speedup = round(model.tokens_per_s / plain.tokens_per_s, 3)
    local_speedup = round(local_model.tokens_per_s / local_plain.tokens_per_s, 3)
    return {
        "k": k, "prompts": len(prompts), "max_new_tokens": new_tokens, "target": str(target), "draft": str(draft),
        "draft_device": draft_device,
        "plain_tokens_per_s": plain.tokens_per_s, "remote_model_tokens_per_s": model.tokens_per_s,
        "remote_model_speedup": remote_speedup,
        "inprocess_plain_tokens_per_s": local_plain.tokens_per_s, "inprocess_model_tokens_per_s": local_model.tokens_per_s,
        "inprocess_model_speedup": local_speedup, "remote_over_inprocess_speedup": round(remote_speedup / local_speedup, 3),
        "remote_mean_acceptance_length": acceptance(model.generations),
        "inprocess_mean_acceptance_length": acceptance(local_model.generations),
        # where a round goes: its wall ms, and of it the ms drafting (the rest is the step and the loop)
        "ms_per_round": {name: run.ms_per_round for name, run in runs.items()},
        "drafting_ms_per_round": {name: run.drafting_ms_per_round for name, run in runs.items() if name.endswith("model")},
        # the served modes' rounds on the server: its engine step (one per round: one session) and a
        # step from its request's arrival to its result; the rest of a round is gRPC and the client
        "server_engine_ms_per_round": {name: run.server["engine_ms_per_batch"] for name, run in runs.items() if run.server},
        "server_latency_ms_per_round": {name: run.server["server_latency_mean_ms"] for name, run in runs.items() if run.server},
        "streams_equal": all(s == streams[0] for s in streams),
    }
