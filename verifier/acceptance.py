"""Acceptance: how many drafts the target agrees with, and the bonus token.
The design in full: DESIGN.md section 7, "Acceptance".
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from hybrid_kernels.runtime import pick
from hybrid_kernels.sampling import argmax_rows, argmax_rows_ref

from .model.rows import RowBatch
from .params import STREAM_ACCEPT, STREAM_RESIDUAL, SamplingParams
from .sampling import choose, choose_rows, sample_from, target_probs, uniform


def accept(logits: torch.Tensor, batch: RowBatch, drafts: Sequence[list[int]], sampling: Sequence[SamplingParams],
           draft_probs: Sequence[torch.Tensor | None], greedy_ids: Callable[[int], list[int]] | None = None) -> list[tuple[int, int]]:
    """logits [rows, vocab] of one verify over `batch` (sequence s: its pending token then drafts[s]),
    each sequence's sampling and draft probabilities ([K, vocab], or None) -> per sequence
    (accepted count a, bonus token). greedy_ids: rows -> the argmax of the first `rows` rows as
    host ints, when the verify computed them (a graphed step); taken when every sequence is greedy.

    greedy: each row's argmax; coupled (sampled, no draft_probs): each row's coupled choice, on the
    device for CUDA logits, row by row on the host otherwise; rejection (sampled, draft_probs given):
    on the host."""
    on_device = logits.is_cuda
    if all(params.greedy for params in sampling):  # every row's argmax: the common case, in few operations a sequence
        choices = _row_choices(logits, []) if greedy_ids is None else greedy_ids(batch.n_rows)
        return [_accept_from(choices, first, ids) for first, ids in zip(batch.offsets, drafts)]
    by_choice = [params.greedy or (on_device and probs is None) for params, probs in zip(sampling, draft_probs)]
    spans = [(span, start) for _, start, span in batch.sequences()]
    coupled_on_device = [(span, params, start) for (span, start), params, choice in zip(spans, sampling, by_choice)
                         if choice and not params.greedy]
    choices = _row_choices(logits, coupled_on_device) if any(by_choice) else []
    host_rows = _host_rows(logits, [span for (span, _), choice in zip(spans, by_choice) if not choice])
    verdicts = []
    for (span, start), ids, params, probs, choice in zip(spans, drafts, sampling, draft_probs, by_choice):
        if choice:
            verdicts.append(_accept_from(choices, span.start, ids))
        elif probs is None:
            verdicts.append(_accept_coupled_on_host(host_rows[span.start], ids, params, start))
        else:
            verdicts.append(accept_rejection(host_rows[span.start], ids, probs, params, start))
    return verdicts


def _host_rows(logits: torch.Tensor, spans: list[slice]) -> dict[int, torch.Tensor]:
    """The rows of each span on the host, keyed by the span's first row: one gather and one
    device-to-host copy for all of them (the logits themselves when already on the host)."""
    if not spans:
        return {}
    if not logits.is_cuda:
        return {span.start: logits[span] for span in spans}
    index = torch.cat([torch.arange(span.start, span.stop) for span in spans]).to(logits.device)
    rows = logits.index_select(0, index).cpu()
    out, at = {}, 0
    for span in spans:
        n = span.stop - span.start
        out[span.start] = rows[at : at + n]
        at += n
    return out


def _accept_from(choices: list[int], first: int, drafts: list[int]) -> tuple[int, int]:
    """choices: the token each row of a step chooses (greedy or coupled); the sequence's K+1 rows
    start at row `first` (read in place, no slice) -> (accepted count a, bonus token)."""
    for r, draft in enumerate(drafts):
        if choices[first + r] != draft:
            return r, choices[first + r]
    return len(drafts), choices[first + len(drafts)]


def _row_choices(logits: torch.Tensor, sampled: list[tuple[slice, SamplingParams, int]]) -> list[int]:
    """logits [R, vocab] of a step -> the token each row chooses, as host ints: each row's argmax,
    except the rows of each (row slice, params, first position) in `sampled` (CUDA logits only),
    which get coupled sampling's choice. Computed where the logits are: a step copies R ids to the
    host, not R x vocab floats."""
    choices = pick(argmax_rows, argmax_rows_ref, logits)(logits)
    if sampled:
        rows = [i for span, _, _ in sampled for i in range(span.start, span.stop)]
        params = [p for span, p, _ in sampled for _ in range(span.start, span.stop)]
        positions = [first + r + 1 for span, _, first in sampled for r in range(span.stop - span.start)]
        index = torch.tensor(rows, dtype=torch.int64).to(logits.device)
        choices.index_copy_(0, index, choose_rows(logits.index_select(0, index), params, positions))
    return choices.tolist()


def _accept_coupled_on_host(rows: torch.Tensor, drafts: list[int], params: SamplingParams, first_position: int) -> tuple[int, int]:
    """rows [K+1, vocab] on the host -> (accepted count a, bonus token): coupled sampling, one row at a
    time, stopping at the first miss."""
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

