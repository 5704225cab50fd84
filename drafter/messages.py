"""The drafter's wire layer: what the client returns (plain dataclasses; the server's counters as their
wire message) and the conversions to and from the wire messages. Sampling parameters are verifier.params.SamplingParams, the one home of
the concept; `sampling_to_proto` puts them on the wire.

Wire conventions (proto/verifier/v1/verifier.proto): logits travel as little-endian float32 bytes
with their shape beside them; here they become numpy float32 [rows, vocab]. Finish reasons become
the strings the engine uses ("eos", "length") or None while a session is still generating.
No torch here: a drafter that proposes n-grams or random ids should not need it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import grpc
import numpy as np

from verifier import rpc
from verifier.params import SamplingParams

_FINISH = {rpc.FINISH_NONE: None, rpc.FINISH_EOS: "eos", rpc.FINISH_LENGTH: "length"}
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The grpc.StatusCode a result's numeric status stands for (UNKNOWN for a number we do not know)."""
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)


class VerifierError(Exception):
    """The verifier refused a call or a step. `code` is a grpc.StatusCode; `message` names the field.

    `current_position` is set for ABORTED (a stale expected_position: where the session really is);
    `retry_after_s` for RESOURCE_EXHAUSTED from OpenSession (when a slot may be free again)."""

    def __init__(self, code: grpc.StatusCode, message: str, *, current_position: int | None = None,
                 retry_after_s: float | None = None, session_id: str | None = None):
        where = f" (session {session_id})" if session_id else ""
        super().__init__(f"{code.name}{where}: {message}")
        self.code = code
        self.message = message
        self.current_position = current_position
        self.retry_after_s = retry_after_s
        self.session_id = session_id


@dataclass(frozen=True)
class ModelInfo:
    protocol_version: str
    model_id: str
    model_type: str
    vocab_size: int
    eos_ids: tuple[int, ...]
    max_context: int  # prompt + generated tokens a session may hold
    max_k: int  # most drafts per step
    layer_kinds: tuple[str, ...]
    rollback_mode: str
    has_tokenizer: bool
    n_slots: int
    device: str
    dtype: str
    trims_drafts: bool = False  # the server's goodput-aware K may verify fewer drafts than a step sends
    # drafters the server runs for a session (OpenSessionRequest.server_drafter): "ngram", and "mtp"
    # when the checkpoint's MTP head is loaded; empty from a server without server-side drafting
    server_drafters: tuple[str, ...] = ()

    @classmethod
    def from_proto(cls, m) -> "ModelInfo":
        return cls(m.protocol_version, m.model_id, m.model_type, m.vocab_size, tuple(m.eos_ids), m.max_context,
                   m.max_k, tuple(m.layer_kinds), m.rollback_mode, m.has_tokenizer, m.n_slots, m.device, m.dtype,
                   m.trims_drafts, tuple(m.server_drafters))


@dataclass
class Session:
    id: str
    position: int  # committed position: the prompt length right after opening
    pending: int  # the first token, chosen from the prompt; not yet consumed
    finish_reason: str | None  # set when the first token already ends the session
    prompt_ids: list[int]  # the prompt as the model sees it (the tokenized text)
    logits: np.ndarray | None = field(default=None, repr=False)  # [1, vocab] float32 when asked

    @classmethod
    def from_proto(cls, m) -> "Session":
        return cls(m.session_id, m.position, m.first_token, _FINISH.get(m.finish_reason), list(m.prompt_ids),
                   logits_array(m.logits) if m.HasField("logits") else None)


@dataclass(frozen=True)
class Step:
    """One session's verify step: the drafts that follow its pending token."""

    session_id: str
    expected_position: int  # the session's position as the drafter knows it
    draft_ids: tuple[int, ...] = ()
    draft_probs: np.ndarray | None = None  # [len(draft_ids), vocab] float32: rejection sampling
    request_id: str = ""  # empty: the client assigns one (a retry reuses it)
    return_logits: bool = False

    def to_proto(self):
        probs = b""
        if self.draft_probs is not None:
            probs = np.ascontiguousarray(self.draft_probs, dtype="<f4").tobytes()
        return rpc.VerifyStep(session_id=self.session_id, expected_position=self.expected_position,
                              draft_ids=list(self.draft_ids), draft_probs=probs, request_id=self.request_id,
                              return_logits=self.return_logits)


@dataclass
class StepOutcome:
    code: grpc.StatusCode
    message: str
    session_id: str
    request_id: str
    accepted: int  # drafts the target agreed with
    tokens: list[int]  # accepted drafts then the bonus (cut at eos or the budget)
    position: int  # the new committed position
    finish_reason: str | None
    logits: np.ndarray | None = field(default=None, repr=False)  # [len(tokens), vocab] float32 when asked
    current_position: int | None = None  # ABORTED: where the session really is
    # drafts the verifier verified (the first ones; goodput-aware K may verify fewer than were sent);
    # None: the reply does not say (a server from before the field), every draft was verified
    verified_drafts: int | None = None

    def verified(self, sent: int) -> int:
        """Drafts verified of the `sent` the step carried."""
        return sent if self.verified_drafts is None else self.verified_drafts

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK

    def check(self) -> "StepOutcome":
        """Self when OK; else raise VerifierError with the step's status."""
        if not self.ok:
            raise VerifierError(self.code, self.message, current_position=self.current_position, session_id=self.session_id)
        return self

    @classmethod
    def from_proto(cls, m) -> "StepOutcome":
        code = status_code(m.status.code)
        current = m.status.current_position if code == grpc.StatusCode.ABORTED else None
        return cls(code, m.status.message, m.session_id, m.request_id, m.accepted, list(m.tokens), m.position,
                   _FINISH.get(m.finish_reason), logits_array(m.logits) if m.HasField("logits") else None, current,
                   m.verified_drafts if m.HasField("verified_drafts") else None)


# What `stats()` returns: the server's GetStats message itself, rpc.Stats (the proto documents each counter
# and verifier_pb2.pyi types it; repeated fields are sequences, histograms rpc.Histogram). Counters only,
# nothing to convert, so no copy of its field list is kept here.
Stats = rpc.Stats


def logits_array(m) -> np.ndarray:
    """A wire Logits message as float32 [rows, vocab] (a copy: the message's bytes are immutable)."""
    expected = m.rows * m.vocab_size * 4
    if len(m.float32) != expected:
        raise VerifierError(grpc.StatusCode.INTERNAL,
                            f"logits.float32 holds {len(m.float32)} bytes, expected rows*vocab_size*4 = {expected}")
    return np.frombuffer(m.float32, dtype="<f4").astype(np.float32).reshape(m.rows, m.vocab_size)


def sampling_to_proto(sampling: SamplingParams):
    """SamplingParams -> rpc.Sampling (validated already: SamplingParams checks itself on construction)."""
    return rpc.Sampling(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed)


def open_request(prompt_ids: list[int] | None, text: str | None, sampling: SamplingParams, max_new_tokens: int,
                 request_id: str | None, return_logits: bool, verify_all_drafts: bool = False,
                 server_drafter: str = "", server_draft_k: int = 0):
    """An OpenSessionRequest; its request id is fixed here, before the first try, so that a retried
    OpenSession returns the same session. `verify_all_drafts`: the server never trims the session's
    drafts (proto: OpenSessionRequest.verify_all_drafts). `server_drafter` (one of
    ModelInfo.server_drafters; "": the client drafts): the server proposes `server_draft_k` drafts
    per step (0: its max_k) and the session's steps carry none."""
    if (prompt_ids is None) == (text is None):
        raise ValueError("pass exactly one of prompt_ids and text")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if server_draft_k < 0:
        raise ValueError(f"server_draft_k must be >= 0, got {server_draft_k}")
    if server_draft_k and not server_drafter:
        raise ValueError(f"server_draft_k {server_draft_k} needs a server_drafter (the server drafts only for one)")
    return rpc.OpenSessionRequest(prompt_ids=list(prompt_ids or ()), text=text or "", sampling=sampling_to_proto(sampling),
                                  max_new_tokens=max_new_tokens, request_id=request_id or uuid.uuid4().hex,
                                  return_logits=return_logits, verify_all_drafts=verify_all_drafts,
                                  server_drafter=server_drafter, server_draft_k=server_draft_k)
