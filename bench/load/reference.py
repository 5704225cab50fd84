"""Plain decoding of every generation's prompt on a separate engine, and the comparison.

Each generation is decoded with no drafts, the same sampling, and max_new_tokens set to the
number of tokens the session emitted, so a stream cut short by the step budget or the deadline
is compared on what it emitted; a finished one must also finish the same way (eos at the same
token, or its length). Generations are decoded many at a time in one engine batch: a sequence's
bits do not depend on its batch (DESIGN.md section 5, item 2), and a test of that contract is
part of what this comparison checks. bench.serve times the same decoding (the engine alone) and
takes its streams as the reference and as the oracle's drafts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from verifier.engine import LENGTH, Engine, StepRequest
from verifier.model import load_model
from verifier.params import SamplingParams


def plain_streams(model_dir: Path, device: str, dtype: str, generations: list[dict], n_slots: int, max_seq_len: int,
                  max_k: int, progress=None) -> list[tuple[list[int], str]]:
    """(tokens, finish reason) of plain decoding for each generation, in order; `progress(line)`, if
    given, hears after each batch of generations."""
    model = load_model(model_dir, device, getattr(torch, dtype))
    engine = Engine(model, n_slots, max_seq_len, max_k)
    out: list[tuple[list[int], str] | None] = [None] * len(generations)
    todo = [i for i, g in enumerate(generations) if g["tokens"]]
    for start in range(0, len(todo), n_slots):
        chunk = todo[start : start + n_slots]
        streams = decode_plainly(engine, [(generations[i]["prompt"], SamplingParams(**generations[i]["sampling"]),
                                           len(generations[i]["tokens"])) for i in chunk])
        for i, stream in zip(chunk, streams):
            out[i] = stream
        if progress is not None:
            progress(f"plain decoding: {min(start + n_slots, len(todo))}/{len(todo)} generations")
    return [o if o is not None else ([], LENGTH) for o in out]


def decode_plainly(engine: Engine, requests: list[tuple[list[int], SamplingParams, int]],
                   on_step: Callable[[int], None] | None = None) -> list[tuple[list[int], str]]:
    """Plain decoding of every (prompt, sampling, max_new_tokens), all in one engine batch per step (at
    most the engine's n_slots requests): (tokens, finish reason) each. `on_step(tokens emitted)` hears
    after every step."""
    seqs = []
    try:
        for prompt, sampling, max_new_tokens in requests:
            seqs.append(engine.open(prompt, sampling, max_new_tokens))
        tokens = [[seq.pending] for seq in seqs]
        live = [i for i, seq in enumerate(seqs) if not seq.finished]
        while live:
            results = engine.step([StepRequest(seqs[i], []) for i in live])
            for i, result in zip(live, results):
                if result.error is not None:
                    raise result.error
                tokens[i] += result.tokens
            if on_step is not None:
                on_step(sum(len(result.tokens) for result in results))
            live = [i for i in live if not seqs[i].finished]
        return [(stream, seq.finish_reason) for stream, seq in zip(tokens, seqs)]
    finally:
        for seq in seqs:
            engine.close(seq)


def timed_plain_decoding(engine: Engine, prompts: list[list[int]], max_new_tokens: int, warmup_steps: int,
                         timed_steps: int) -> tuple[dict, list[tuple[list[int], str]]]:
    """The engine alone: greedy plain decoding of every prompt in one batch per step, timed over steps
    warmup_steps + 1 .. warmup_steps + timed_steps (the warm-up compiles and captures outside the timed
    part); decoding then runs on, untimed, to max_new_tokens. Returns the figures and every stream."""
    if warmup_steps < 1 or timed_steps < 1 or warmup_steps + timed_steps >= max_new_tokens:
        raise ValueError(f"need 1 <= warmup_steps, 1 <= timed_steps and warmup + timed steps < max_new_tokens, got "
                         f"{warmup_steps}, {timed_steps}, {max_new_tokens}")
    cuda = engine.model.device.type == "cuda"
    ends: list[tuple[float, int]] = []  # per step: when it ended, tokens it emitted

    def clock(emitted: int) -> None:
        if cuda:
            torch.cuda.synchronize()
        ends.append((time.perf_counter(), emitted))

    streams = decode_plainly(engine, [(p, SamplingParams(), max_new_tokens) for p in prompts], clock)
    start = ends[warmup_steps - 1][0]
    window = ends[warmup_steps : warmup_steps + timed_steps]
    step_ms = np.diff([start] + [t for t, _ in window]) * 1e3
    seconds, tokens = window[-1][0] - start, sum(n for _, n in window)
    return {"sequences": len(prompts), "warmup_steps": warmup_steps, "timed_steps": len(window), "tokens": tokens,
            "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 2),
            "step_p50_ms": round(float(np.percentile(step_ms, 50)), 3),
            "step_p99_ms": round(float(np.percentile(step_ms, 99)), 3)}, streams


def mismatches(generations: list[dict], plain: list[tuple[list[int], str]]) -> list[dict]:
    """Generations whose stream differs from plain decoding: the first differing index and both tokens."""
    found = []
    for g, (tokens, finish) in zip(generations, plain):
        expected_finish = g["finish_reason"] or LENGTH  # a cut stream ends where plain decoding was told to stop
        if g["tokens"] == tokens and (not g["tokens"] or finish == expected_finish):
            continue
        at = next((j for j, (a, b) in enumerate(zip(g["tokens"], tokens)) if a != b), min(len(g["tokens"]), len(tokens)))
        found.append({"session": g["session"], "generation": g["generation"], "index": at,
                      "speculative": g["tokens"][at : at + 4], "plain": tokens[at : at + 4],
                      "finish_reason": g["finish_reason"], "plain_finish_reason": finish})
    return found
