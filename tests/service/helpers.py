"""Small helpers shared by the service tests."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from verifier import rpc


def open_session(stub, prompt, max_new_tokens=40, **fields):
    return stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=prompt, max_new_tokens=max_new_tokens, **fields))


def step(session_id, position, drafts=(), request_id="", **fields):
    return rpc.VerifyStep(session_id=session_id, expected_position=position, draft_ids=list(drafts),
                          request_id=request_id, **fields)


def verify_one(stub, *args, **kwargs):
    (result,) = stub.Verify(rpc.VerifyRequest(steps=[step(*args, **kwargs)])).results
    return result


def code_of(result) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == result.status.code)


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value


def logits_array(message) -> np.ndarray:
    """rpc.Logits -> float32 [rows, vocab]."""
    return np.frombuffer(message.float32, dtype="<f4").reshape(message.rows, message.vocab_size)
