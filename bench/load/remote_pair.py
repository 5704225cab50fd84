"""A remote drafter against the in-process pair (bench.serve).
How it measures, what it checks and writes: bench/README.md, Methods, `bench.load.remote_pair`.
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
from verifier.model.mtp import load_mtp_head
from verifier.proposers import MTPProposer, ModelProposer
from verifier.server.config import ServerConfig
from verifier.tokenizer import TextTokenizer

from .report import server_figures
from .server import ServerProcess

MTP = "mtp"  # the server drafter of the checkpoint's MTP head (ModelInfo.server_drafters)
MODES = ("remote_plain", "remote_model", "inprocess_plain", "inprocess_model")  # always run; remote_mtp, inprocess_mtp when offered


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


class TimedHiddenProposer:
    """TimedProposer for a proposer that drafts from the target's hidden rows (the MTP head): the
    in-process loop hands it those rows (begin, observe), so it keeps their methods; proposing
    and taking the rows in are both timed as drafting."""

    def __init__(self, proposer):
        self.proposer, self.seconds = proposer, 0.0

    def _timed(self, method, *args):
        start = time.perf_counter()
        try:
            return method(*args)
        finally:
            self.seconds += time.perf_counter() - start

    def begin(self, prompt_hidden) -> None:
        self._timed(self.proposer.begin, prompt_hidden)

    def observe(self, hidden) -> None:
        self._timed(self.proposer.observe, hidden)

    def propose(self, context: list[int], k: int) -> list[int]:
        return self._timed(self.proposer.propose, context, k)


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
    # --mtp spelled out: the MTP rows must not hang on the server's default
    server = ServerProcess(target, device=device, dtype=dtype, max_k=max(k, defaults.max_k),
                           max_seq_len=max(longest, defaults.max_seq_len), extra_args=("--mtp",))
    runs: dict[str, Timed] = {}
    try:
        with VerifierClient(server.address, timeout_s=120.0) as client:
            info = client.model_info()
            proposer = TimedProposer(ModelProposer.from_dir(draft, info.vocab_size, info.max_context, device=draft_device))
            progress(f"remote drafter: {len(prompts)} prompts x {new_tokens} tokens, plain over the server")
            runs["remote_plain"] = Timed(lambda p: remote_generate(client, None, prompt_ids=p, max_new_tokens=new_tokens, k=0,
                                                                   info=info), prompts, server_stats=client.stats)
            progress(f"remote drafter: the model drafter at K={k} on {draft_device}")
            runs["remote_model"] = Timed(lambda p: remote_generate(client, proposer, prompt_ids=p, max_new_tokens=new_tokens,
                                                                   k=k, info=info), prompts, proposer, server_stats=client.stats)
            mtp_skipped = _mtp_skipped(info.server_drafters, target)
            if mtp_skipped is None:
                progress(f"remote drafter: MTP self-drafting through the service at K={k} (the server drafts)")
                runs["remote_mtp"] = Timed(lambda p: remote_generate(client, None, prompt_ids=p, max_new_tokens=new_tokens,
                                                                     k=k, info=info, server_drafter=MTP),
                                           prompts, server_stats=client.stats)
    finally:
        server.stop()
    progress("remote drafter: the same pair in process")
    engine = Engine(load_model(target, device, getattr(torch, dtype)), 1, longest, max_k=k)
    local_proposer = TimedProposer(ModelProposer.from_dir(draft, engine.vocab_size, engine.max_seq_len,
                                                          device=draft_device))
    runs["inprocess_plain"] = Timed(lambda p: local_generate(engine, p, new_tokens), prompts)
    runs["inprocess_model"] = Timed(lambda p: local_generate(engine, p, new_tokens, proposer=local_proposer, k=k), prompts,
                                    local_proposer)
    if mtp_skipped is None:
        progress(f"remote drafter: MTP in process at K={k}")
        mtp_proposer = TimedHiddenProposer(MTPProposer(load_mtp_head(target, engine.model), engine.max_seq_len))
        runs["inprocess_mtp"] = Timed(lambda p: local_generate(engine, p, new_tokens, proposer=mtp_proposer, k=k), prompts,
                                      mtp_proposer)
    return _figures(runs, target, draft, draft_device, k, len(prompts), new_tokens, mtp_skipped)


def _mtp_skipped(server_drafters: tuple[str, ...], target: Path) -> str | None:
    """Why the MTP modes do not run (None: they do): the served target does not offer MTP drafting."""
    if MTP in server_drafters:
        return None
    return (f"the served target {target} offers no {MTP!r} server drafter (ModelInfo.server_drafters: "
            f"{list(server_drafters)}): its checkpoint has no MTP head (mtp.* tensors)")


def _figures(runs: dict[str, Timed], target: Path, draft: Path, draft_device: str, k: int, prompts: int, new_tokens: int,
             mtp_skipped: str | None) -> dict:
    """The remote_drafter object of bench.serve's results. The keys of the first four modes stay as
    they were (bench/report.py reads them); the MTP keys are None when the MTP modes were skipped."""
    plain, model, local_plain, local_model = (runs[mode] for mode in MODES)
    # every stream against the first mode's: a mode that differs is named
    reference = [g.tokens for g in plain.generations]
    equal = {name: [g.tokens for g in run.generations] == reference for name, run in runs.items()}
    remote_speedup = round(model.tokens_per_s / plain.tokens_per_s, 3)
    local_speedup = round(local_model.tokens_per_s / local_plain.tokens_per_s, 3)
    drafted = [name for name in runs if name.endswith("model") or name == "inprocess_mtp"]  # drafting in this process
    return {
        "k": k, "prompts": prompts, "max_new_tokens": new_tokens, "target": str(target), "draft": str(draft),
        "draft_device": draft_device,
        "plain_tokens_per_s": plain.tokens_per_s, "remote_model_tokens_per_s": model.tokens_per_s,
        "remote_model_speedup": remote_speedup,
        "inprocess_plain_tokens_per_s": local_plain.tokens_per_s, "inprocess_model_tokens_per_s": local_model.tokens_per_s,
        "inprocess_model_speedup": local_speedup, "remote_over_inprocess_speedup": round(remote_speedup / local_speedup, 3),
        "remote_mean_acceptance_length": acceptance(model.generations),
        "inprocess_mean_acceptance_length": acceptance(local_model.generations),
        # where a round goes: its wall ms, and of it the ms drafting in this process (the rest is the
        # step and the loop; the remote MTP mode drafts on the server, inside its step)
        "ms_per_round": {name: run.ms_per_round for name, run in runs.items()},
        "drafting_ms_per_round": {name: runs[name].drafting_ms_per_round for name in drafted},
        # the served modes' rounds on the server: its engine step (one per round: one session) and a
        # step from its request's arrival to its result; the rest of a round is gRPC and the client
        "server_engine_ms_per_round": {name: run.server["engine_ms_per_batch"] for name, run in runs.items() if run.server},
        "server_latency_ms_per_round": {name: run.server["server_latency_mean_ms"] for name, run in runs.items() if run.server},
        "streams_equal": all(equal.values()),
        "streams_equal_by_mode": equal,  # each mode's streams against remote_plain's
        # MTP self-drafting (the target's own head): through the service (the server drafts) and in
        # process, beside plain and the model drafter; speedups over the plain mode of the same side
        "mtp_skipped": mtp_skipped,
        **_mtp_figures(runs),
    }


def _mtp_figures(runs: dict[str, Timed]) -> dict:
    """remote_mtp_* and inprocess_mtp_*: tokens/s, speedup over the plain mode of the same side,
    mean acceptance length; None for a mode that did not run."""
    out = {}
    for side in ("remote", "inprocess"):
        run = runs.get(f"{side}_mtp")
        out[f"{side}_mtp_tokens_per_s"] = run.tokens_per_s if run else None
        out[f"{side}_mtp_speedup"] = round(run.tokens_per_s / runs[f"{side}_plain"].tokens_per_s, 3) if run else None
        out[f"{side}_mtp_mean_acceptance_length"] = acceptance(run.generations) if run else None
    return out
