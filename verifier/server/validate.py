"""Checks of a request's wire fields, before anything touches a session or the engine: the one
home of these checks (the engine checks state, and asserts what is checked here). Each failure is
an `Invalid` carrying the status code and a message that names the field."""

from __future__ import annotations

import grpc
import torch

from .. import rpc
from ..params import SamplingParams
from .convert import draft_probs_tensor, sampling_params

# draft_probs rows must sum to 1 within this (float32 sums of a large vocabulary drift)
PROBS_SUM_TOLERANCE = 1e-3


class Invalid(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _bad_ids(ids, vocab: int) -> list[int]:
    return [t for t in ids if not 0 <= t < vocab]


def prompt_source(request: rpc.OpenSessionRequest, tokenizer, max_seq_len: int) -> tuple[list[int] | None, str | None]:
    """(prompt_ids, None) or (None, text to tokenize): exactly one of prompt_ids and text, with
    room for at least one step in the context. A prompt too long for the context is refused before
    it is copied or tokenized (its length alone says so), so an oversized request costs the server
    a length check, not seconds of its event loop."""
    n_ids = len(request.prompt_ids)
    text = request.text  # read once: each read of a wire string makes a new str
    if n_ids and text:
        raise Invalid(grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids and text are both set: send exactly one")
    if not n_ids and not text:
        raise Invalid(grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids and text are both empty: send exactly one")
    if n_ids + 1 > max_seq_len:
        raise _too_long("prompt_ids", f"a prompt of {n_ids} tokens", max_seq_len)
    if not text:
        return request.prompt_ids[:], None
    if tokenizer is None:
        raise Invalid(grpc.StatusCode.INVALID_ARGUMENT, "text needs a tokenizer and this model has none "
                      "(ModelInfo.has_tokenizer is false): send prompt_ids")
    if len(text) > (max_seq_len - 1) * tokenizer.longest_token_bytes:  # too long whatever it encodes to
        raise _too_long("text", f"{len(text)} characters (at least {-(-len(text) // tokenizer.longest_token_bytes)} "
                        f"tokens: no token covers more than {tokenizer.longest_token_bytes} bytes)", max_seq_len)
    return None, text


def checked_prompt(prompt: list[int], field: str, vocab: int, max_seq_len: int) -> list[int]:
    """A prompt's ids (from `field`) in the vocabulary and with room for one step."""
    if not prompt:
        raise Invalid(grpc.StatusCode.INVALID_ARGUMENT, "text encodes to no tokens")
    bad = _bad_ids(prompt, vocab)
    if bad:
        raise Invalid(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}")
    if len(prompt) + 1 > max_seq_len:
        raise _too_long(field, f"a prompt of {len(prompt)} tokens", max_seq_len)
    return prompt


def request_steps(n_steps: int, n_slots: int) -> None:
    """A VerifyRequest's size, checked before its steps are read: each step names a distinct
    session, so more steps than the server has slots cannot all be live."""
    if n_steps > n_slots:
        raise Invalid(grpc.StatusCode.INVALID_ARGUMENT, f"steps: {n_steps} steps in one request, more than the server's "
                      f"{n_slots} slots (ModelInfo.n_slots): each step names a distinct open session")


def _too_long(field: str, what: str, max_seq_len: int) -> Invalid:
    return Invalid(grpc.StatusCode.OUT_OF_RANGE, f"{field}: {what} leaves no room in the context of {max_seq_len} "
                   f"positions (ModelInfo.max_context)")


def open_limits(request: rpc.OpenSessionRequest) -> tuple[SamplingParams, int]:
    """(sampling, max_new_tokens) of an OpenSessionRequest."""
    if request.max_new_tokens < 1:
        raise Invalid(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens must be at least 1 (the first token counts)")
    try:
        sampling = sampling_params(request.sampling)
    except ValueError as exc:
        raise Invalid(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {exc}") from None
    return sampling, request.max_new_tokens


def open_drafter(request: rpc.OpenSessionRequest, offered: tuple[str, ...], max_k: int) -> tuple[str, int] | None:
    """(server_drafter, drafts per step) of an OpenSessionRequest, None when the client drafts.
    `offered`: ModelInfo.server_drafters."""
    name, k = request.server_drafter, request.server_draft_k
    if not name:
        if k:
            raise Invalid(grpc.StatusCode.INVALID_ARGUMENT, f"server_draft_k is {k} but server_drafter is empty: "
                          f"set a server_drafter (one of {list(offered)}) or leave server_draft_k at 0")
        return None
    if name not in offered:
        raise Invalid(grpc.StatusCode.INVALID_ARGUMENT, f"server_drafter {name!r} is not offered by this model: "
                      f"ModelInfo.server_drafters lists {list(offered)}")
    if k > max_k:
        raise Invalid(grpc.StatusCode.INVALID_ARGUMENT, f"server_draft_k {k} is more than max_k {max_k}")
    return name, k if k else max_k


def step_drafts(step: rpc.VerifyStep, session_id: str, max_k: int, vocab: int) -> tuple[list[int], torch.Tensor | None]:
    """(draft ids, draft probabilities [K, vocab] or None) of a VerifyStep whose session_id the
    caller has read already (each read of a wire field makes a new Python object)."""
    if not session_id:
        raise Invalid(grpc.StatusCode.INVALID_ARGUMENT, "session_id is empty")
    wire = step.draft_ids
    if len(wire) > max_k:  # before the copy: a step of millions of ids costs a length check
        raise Invalid(grpc.StatusCode.INVALID_ARGUMENT, f"draft_ids has {len(wire)} ids, more than max_k {max_k}")
    drafts = wire[:]  # a list; half the cost of list() on the wire's container
    if drafts:
        if min(drafts) < 0 or max(drafts) >= vocab:
            bad = _bad_ids(drafts, vocab)
            raise Invalid(grpc.StatusCode.INVALID_ARGUMENT, f"draft_ids: token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}")
    data = step.draft_probs
    if not data:
        return drafts, None
    if not drafts:
        raise Invalid(grpc.StatusCode.INVALID_ARGUMENT, "draft_probs is set but draft_ids is empty")
    try:
        probs = draft_probs_tensor(data, len(drafts), vocab)
    except ValueError as exc:
        raise Invalid(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    _check_probs(probs, drafts)
    return drafts, probs


def _check_probs(probs: torch.Tensor, drafts: list[int]) -> None:
    """probs [K, vocab] float32: a distribution per row that gives its own draft a chance."""
    if not torch.isfinite(probs).all() or (probs < 0).any():
        raise Invalid(grpc.StatusCode.INVALID_ARGUMENT, "draft_probs must be finite and non-negative")
    sums = probs.sum(dim=-1)
    if ((sums - 1).abs() > PROBS_SUM_TOLERANCE).any():
        raise Invalid(grpc.StatusCode.INVALID_ARGUMENT,
                      f"each draft_probs row must sum to 1 (got sums {[round(float(s), 4) for s in sums][:4]})")
    own = probs[torch.arange(len(drafts)), torch.tensor(drafts)]
    if (own <= 0).any():
        r = int((own <= 0).nonzero()[0])
        raise Invalid(grpc.StatusCode.INVALID_ARGUMENT, f"draft_probs[{r}] gives its own draft {drafts[r]} probability 0")


def repeated_sessions(session_ids: list[str]) -> dict[int, str]:
    """Steps of one Verify request (given by their session ids, in order) that name a session an
    earlier step named: index -> message. A session appears once per Verify request (its steps
    depend on each other's positions)."""
    if len(set(session_ids)) == len(session_ids):  # the usual case, in one pass
        return {}
    first_at: dict[str, int] = {}
    repeated = {}
    for i, session_id in enumerate(session_ids):
        if session_id in first_at:
            repeated[i] = (f"steps[{i}].session_id duplicates steps[{first_at[session_id]}]: "
                           f"a session may appear once per Verify request")
        elif session_id:
            first_at[session_id] = i
    return repeated
