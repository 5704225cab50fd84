"""Plain decoding of every generation's prompt on a separate engine, and the comparison.

Each generation is decoded with no drafts, the same sampling, and max_new_tokens set to the
number of tokens the session emitted, so a stream cut short by the step budget or the deadline
is compared on what it emitted; a finished one must also finish the same way (eos at the same
token, or its length). Generations are decoded many at a time in one engine batch: a sequence's
bits do not depend on its batch (DESIGN.md section 5, item 2), and a test of that contract is
part of what this comparison checks.
"""

from __future__ import annotations

from pathlib import Path

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
        seqs = {i: engine.open(generations[i]["prompt"], SamplingParams(**generations[i]["sampling"]),
                               len(generations[i]["tokens"])) for i in chunk}
        tokens = {i: [seq.pending] for i, seq in seqs.items()}
        live = [i for i in chunk if not seqs[i].finished]
        while live:
            results = engine.step([StepRequest(seqs[i], []) for i in live])
            for i, result in zip(live, results):
                if result.error is not None:
                    raise result.error
                tokens[i] += result.tokens
            live = [i for i in live if not seqs[i].finished]
        for i, seq in seqs.items():
            out[i] = (tokens[i], seq.finish_reason)
            engine.close(seq)
        if progress is not None:
            progress(f"plain decoding: {min(start + n_slots, len(todo))}/{len(todo)} generations")
    return [o if o is not None else ([], LENGTH) for o in out]


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
