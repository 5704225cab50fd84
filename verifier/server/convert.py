"""Wire messages <-> engine values: sampling, float32 tensors as bytes, finish reasons, status codes.
Pure functions; the only place that knows both the proto and the engine's types."""

from __future__ import annotations

import grpc
import numpy as np
import torch

from .. import rpc
from ..engine import EOS, LENGTH
from ..params import SamplingParams

# engine StepError.code -> the status a result carries
STEP_ERROR_CODES = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "out_of_range": grpc.StatusCode.OUT_OF_RANGE,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
}
FINISH_REASONS = {None: rpc.FINISH_NONE, EOS: rpc.FINISH_EOS, LENGTH: rpc.FINISH_LENGTH}


_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def code_number(code: grpc.StatusCode) -> int:
    return code.value[0]


def code_name(number: int) -> str:
    return _NAMES.get(number, str(number))


def sampling_params(sampling: rpc.Sampling) -> SamplingParams:
    """rpc.Sampling -> SamplingParams; top_p 0 means off (proto3's default). ValueError names the field."""
    top_p = sampling.top_p if sampling.top_p != 0 else 1.0
    return SamplingParams(sampling.temperature, sampling.top_k, top_p, sampling.seed)


def logits_message(rows: torch.Tensor) -> rpc.Logits:
    """[rows, vocab] -> rpc.Logits of little-endian float32 bytes, row-major."""
    array = np.ascontiguousarray(rows.detach().float().cpu().numpy(), dtype="<f4")
    return rpc.Logits(rows=array.shape[0], vocab_size=array.shape[1], float32=array.tobytes())


def draft_probs_tensor(data: bytes, k: int, vocab: int) -> torch.Tensor:
    """float32 [k, vocab] bytes -> tensor; ValueError (naming draft_probs) on a wrong length."""
    expected = k * vocab * 4
    if len(data) != expected:
        raise ValueError(f"draft_probs has {len(data)} bytes, expected {expected} (float32 [{k}, {vocab}] for {k} draft_ids)")
    return torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32).reshape(k, vocab))


def error_result(step: rpc.VerifyStep, code: grpc.StatusCode, message: str, position: int) -> rpc.StepResult:
    """A failed step's result. `position`: the session's current position, 0 when the server holds
    no such session (unknown, closed, reaped, or no session_id); ABORTED repeats it in the status."""
    status = rpc.Status(code=code_number(code), message=message)
    if code == grpc.StatusCode.ABORTED:
        status.current_position = position
    return rpc.StepResult(status=status, session_id=step.session_id, request_id=step.request_id, position=position)


def ok_result(session_id: str, request_id: str, result, verified_drafts: int, proposed_drafts: int,
              logits: rpc.Logits | None = None) -> rpc.StepResult:
    """engine.StepResult of a step that ran with `proposed_drafts` drafts, its first `verified_drafts` verified (and
    its rpc.Logits, when asked) -> rpc.StepResult of the step's session and request ids. Fields at
    proto3's default (status: OK, no request id, no finish reason) are left unset: they read back,
    and go on the wire, the same; setting them is host work on every step for nothing
    (`python -m bench.server_overhead` measures the server's cost per step)."""
    out = rpc.StepResult(session_id=session_id, accepted=result.accepted, tokens=result.tokens, position=result.position,
                         verified_drafts=verified_drafts, proposed_drafts=proposed_drafts)  # optional: set even at 0
    if request_id:
        out.request_id = request_id
    if result.finish_reason is not None:
        out.finish_reason = FINISH_REASONS[result.finish_reason]
    if logits is not None:
        out.logits.CopyFrom(logits)
    return out
