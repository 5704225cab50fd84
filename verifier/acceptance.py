"""Acceptance: how many drafts the target agrees with, and the bonus token (DESIGN.md section 7).

Verify rows [pending, d1 .. dK] sit at positions p .. p+K; row r's logits judge d(r+1), and the
token they choose sits at position p + r + 1.

greedy / coupled: d(r+1) is accepted while it equals the token a plain run would choose there
    (sampling.choose); the bonus is the plain run's own token at row a. The stream is therefore
    the plain stream, token for token.
rejection (Leviathan et al.), for drafters that send their probabilities q: accept d with
    probability min(1, p(d) / q(d)); on the first rejection emit a sample of norm(max(0, p - q));
    if all K are accepted the bonus is a sample of p at row K. A deterministic drafter has q
    one-hot at d. Each emitted token is an exact sample of the target distribution p.
"""

from __future__ import annotations

import torch

from .sampling import STREAM_ACCEPT, STREAM_RESIDUAL, SamplingParams, choose, sample_from, target_probs, uniform


def accept_greedy(choices: list[int], drafts: list[int]) -> tuple[int, int]:
    """choices: the argmax of each of the K+1 rows -> (accepted count a, bonus token)."""
    for r, draft in enumerate(drafts):
        if choices[r] != draft:
            return r, choices[r]
    return len(drafts), choices[len(drafts)]


def accept_matching(rows: torch.Tensor, drafts: list[int], params: SamplingParams, first_position: int) -> tuple[int, int]:
    """rows [K+1, vocab] -> (accepted count a, bonus token): greedy or coupled sampling."""
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

