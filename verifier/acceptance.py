"""Acceptance: how many drafts the target agrees with, and the bonus token (DESIGN.md section 7).

Verify rows [pending, d1 .. dK] sit at positions p .. p+K; row r's logits judge d(r+1), and the
token they choose sits at position p + r + 1.

greedy / coupled: d(r+1) is accepted while it equals the token a plain run would choose there
    (sampling.choose); the bonus is the plain run's own token at row a. The stream is therefore
    the plain stream, token for token. On the GPU the choices of all rows come from one device
    launch (argmax_rows for greedy, sampling.choose_rows for coupled sampling) and only the ids
    reach the host; on the CPU coupled rows are chosen one at a time, stopping at the first miss.
rejection (Leviathan et al.), for drafters that send their probabilities q: accept d with
    probability min(1, p(d) / q(d)); on the first rejection emit a sample of norm(max(0, p - q));
    if all K are accepted the bonus is a sample of p at row K. A deterministic drafter has q
    one-hot at d. Each emitted token is an exact sample of the target distribution p.
"""

from __future__ import annotations

import torch

from kernels.runtime import pick
from kernels.sampling import argmax_rows, argmax_rows_ref

from .sampling import STREAM_ACCEPT, STREAM_RESIDUAL, SamplingParams, choose, choose_rows, sample_from, target_probs, uniform


def accept_choices(choices: list[int], drafts: list[int]) -> tuple[int, int]:
    """choices: the token each of the K+1 rows chooses (greedy or coupled) -> (accepted count a, bonus token)."""
    for r, draft in enumerate(drafts):
        if choices[r] != draft:
            return r, choices[r]
    return len(drafts), choices[len(drafts)]


def step_choices(logits: torch.Tensor, sampled: list[tuple[slice, SamplingParams, int]]) -> list[int]:
    """logits [R, vocab] of a step -> the token each row chooses, as host ints: each row's argmax,
    except the rows of each (row slice, params, first position) in `sampled`, which get coupled
    sampling's choice. Computed where the logits are: a step copies R ids to the host, not R x
    vocab floats. `sampled` is for CUDA logits only (the CPU backend chooses row by row)."""
    choices = pick(argmax_rows, argmax_rows_ref, logits)(logits)
    if sampled:
        if not logits.is_cuda:
            raise ValueError(f"step_choices: coupled rows on the device path need CUDA logits, got {logits.device}")
        rows = [i for span, _, _ in sampled for i in range(span.start, span.stop)]
        params = [p for span, p, _ in sampled for _ in range(span.start, span.stop)]
        positions = [first + r + 1 for span, _, first in sampled for r in range(span.stop - span.start)]
        index = torch.tensor(rows, dtype=torch.int64).to(logits.device)
        choices.index_copy_(0, index, choose_rows(logits.index_select(0, index), params, positions))
    return choices.tolist()


def accept_matching(rows: torch.Tensor, drafts: list[int], params: SamplingParams, first_position: int) -> tuple[int, int]:
    """rows [K+1, vocab] -> (accepted count a, bonus token): greedy or coupled sampling."""
    if rows.is_cuda and not params.greedy:
        positions = [first_position + r + 1 for r in range(len(drafts) + 1)]
        return accept_choices(choose_rows(rows, [params] * len(positions), positions).tolist(), drafts)
    for r in range(len(drafts) + 1):
        token = choose(rows[r], params, first_position + r + 1)
        if r == len(drafts) or token != drafts[r]:
            return r, token
    raise AssertionError("unreachable")


def accept_rejection(rows: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                     params: SamplingParams, first_position: int) -> tuple[int, int]:
    """rows [K+1, vocab]; draft_probs [K, vocab] (None: deterministic drafts) -> (a, bonus)."""
    vocab = rows.shape[-1]
    for r, draft in enumerate(drafts):
        position = first_position + r + 1
        p = target_probs(rows[r], params)
        q = torch.nn.functional.one_hot(torch.tensor(draft), vocab).float() if draft_probs is None else draft_probs[r].float().cpu()
        ratio = float(p[draft]) / float(q[draft])
        if uniform(params.seed, position, STREAM_ACCEPT) < min(1.0, ratio):
            continue
        residual = torch.clamp(p - q, min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q: the residual is empty; p itself is then exact
            residual = p
        return r, sample_from(residual / residual.sum(), params.seed, position, STREAM_RESIDUAL)
    position = first_position + len(drafts) + 1
    return len(drafts), sample_from(target_probs(rows[-1], params), params.seed, position, STREAM_RESIDUAL)

