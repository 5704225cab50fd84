"""What makes a call a retry (AIP-155): the same request id AND the same content. A retry gets the
stored result (or joins the step still in flight) and never advances a session twice; the same id
with other content is a client bug, answered INVALID_ARGUMENT naming the id, never with the first
request's result.

A step of a session with a server-side drafter carries no drafts: its fingerprint is its position
and return_logits, and its drafts are proposed once, when the step first runs; a retry gets that
step's stored result (or joins it in flight) and is never proposed for again.

A fingerprint is the content a retry must repeat. draft_probs enter as a digest: a session keeps up
to results_per_session fingerprints, and a [K, vocab] float32 block is megabytes at a real vocabulary.
"""

from __future__ import annotations

import hashlib

import grpc

from .. import rpc
from .validate import Invalid

Fingerprint = tuple


def step_fingerprint(step: rpc.VerifyStep, drafts: list[int] | None = None) -> Fingerprint:
    """`drafts`: the step's draft_ids when the caller has them as a list already."""
    probs = hashlib.blake2b(step.draft_probs, digest_size=16).digest() if step.draft_probs else b""
    return step.expected_position, tuple(step.draft_ids if drafts is None else drafts), probs, step.return_logits


def open_fingerprint(request: rpc.OpenSessionRequest) -> Fingerprint:
    s = request.sampling
    return (tuple(request.prompt_ids), request.text, (s.temperature, s.top_k, s.top_p, s.seed),
            request.max_new_tokens, request.return_logits, request.verify_all_drafts, request.server_drafter,
            request.server_draft_k)


def reused_step_id(request_id: str) -> Invalid:
    return Invalid(grpc.StatusCode.INVALID_ARGUMENT,
                   f"request_id {request_id!r} was used by another step of this session (other expected_position, "
                   f"draft_ids, draft_probs or return_logits): a new step needs a new request_id")


def reused_open_id(request_id: str) -> Invalid:
    return Invalid(grpc.StatusCode.INVALID_ARGUMENT,
                   f"request_id {request_id!r} was used by another OpenSession (other prompt, sampling, "
                   f"max_new_tokens, return_logits, verify_all_drafts, server_drafter or server_draft_k): a new session needs a new request_id")
