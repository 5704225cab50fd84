"""In-process generation through the engine: plain (K = 0) or speculative with a local proposer.

Each step's drafts are cut by verifier.generation.draft_room, the rule the drafter's loop over gRPC
uses too, so the same proposer on the same prompt takes the same steps in process and through a
server (the same accepted_per_step, drafted_per_step and mean acceptance length). A proposer that
drafts from the target's hidden rows (proposers.HiddenStateProposer: the MTP head) is handed the
prompt's rows and each step's consumed rows. A proposer that may return its draft distributions
(proposers.ProbabilityProposer) is asked for them, and a step whose drafts come with q is verified
by rejection sampling (exact samples of the target, another stream than the plain run's); one that
returns none (greedy, or coupled drafts) is verified by exact match, so the stream is the plain one.
"""

from __future__ import annotations

from typing import Callable

import torch

from .engine import Engine, StepRequest
from .generation import Generation, draft_room
from .params import SamplingParams
from .proposers import HiddenStateProposer, ProbabilityProposer, Proposer


def generate(engine: Engine, prompt: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
             proposer: Proposer | None = None, k: int = 0, eos_ids: tuple[int, ...] | None = None,
             on_tokens: Callable[[list[int]], None] | None = None) -> Generation:
    """Generation.logits is a torch tensor [len(tokens), vocab] fp32 on the model's device.
    on_tokens: called with the first token, then with each step's emitted tokens, as they come."""
    sampling = sampling or SamplingParams()
    # a proposer that drafts from the target's hidden rows (MTP) gets the prompt's, then each step's
    hidden = proposer is not None and k > 0 and isinstance(proposer, HiddenStateProposer)
    seq = engine.open(prompt, sampling, max_new_tokens, eos_ids, want_hidden=hidden)
    try:
        if hidden:
            proposer.begin(seq.prompt_hidden)
        tokens, rows = [seq.pending], [seq.first_logits]
        if on_tokens is not None:
            on_tokens(tokens[:])
        accepted, drafted = [], []
        while not seq.finished:
            drafts, probs = [], None
            if proposer is not None and k > 0:
                room = draft_room(k, engine.max_k, engine.max_seq_len, seq.position, max_new_tokens, len(tokens))
                if room > 0:  # a proposer is asked only for drafts that can be sent (a random one draws no more)
                    drafts, probs = _propose(proposer, prompt + tokens, room, engine.vocab_size)
            (result,) = engine.step([StepRequest(seq, drafts, probs, want_hidden=hidden)])
            if result.error is not None:
                raise result.error
            if hidden:
                proposer.observe(result.hidden)
            tokens += result.tokens
            if on_tokens is not None:
                on_tokens(result.tokens)
            rows.append(result.logits)
            accepted.append(result.accepted)
            drafted.append(len(drafts))
        logits = torch.cat([rows[0][None], *rows[1:]])
        return Generation(tokens, seq.finish_reason, accepted, drafted, logits, prompt_ids=list(prompt))
    finally:
        engine.close(seq)


def _propose(proposer: Proposer, context: list[int], room: int, vocab: int) -> tuple[list[int], torch.Tensor | None]:
    """At most `room` drafts after `context`, and their q [len(drafts), vocab] float32 when the
    proposer returns one (rejection sampling), else None; ValueError naming a q of the wrong shape."""
    if not isinstance(proposer, ProbabilityProposer):
        return list(proposer.propose(context, room))[:room], None
    drafts, probs = proposer.propose_with_probs(context, room)
    drafts = list(drafts)[:room]
    if probs is None or not drafts:
        return drafts, None
    probs = torch.as_tensor(probs, dtype=torch.float32)
    if probs.dim() != 2 or probs.shape[0] < len(drafts) or probs.shape[1] != vocab:
        raise ValueError(f"the proposer's draft probabilities have shape {list(probs.shape)}, expected "
                         f"[{len(drafts)}, {vocab}] (one row per draft, the target's vocabulary)")
    return drafts, probs[: len(drafts)]
