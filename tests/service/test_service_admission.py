"""Slot admission: a full pool answers RESOURCE_EXHAUSTED with a retry hint, a closed or reaped
session's slot is reused, and a reused slot behaves like a fresh one."""

import time

import grpc
import numpy as np
import pytest

from verifier import rpc
from verifier.server.testing import LoopbackServer

from .helpers import code_of, logits_array, open_session, rpc_error, verify_one


@pytest.fixture(scope="module")
def small_pool(text_checkpoint):
    with LoopbackServer(text_checkpoint, n_slots=2, max_seq_len=64, max_k=4, retry_after_ms=150) as server:
        with grpc.insecure_channel(server.address) as channel:
            yield rpc.VerifierStub(channel)


@pytest.fixture(scope="module")
def reaping(text_checkpoint):
    with LoopbackServer(text_checkpoint, n_slots=2, max_seq_len=64, max_k=4, idle_timeout_s=0.4) as server:
        with grpc.insecure_channel(server.address) as channel:
            yield rpc.VerifierStub(channel)


def _decode(stub, opened, n):
    tokens, rows, position = [opened.first_token], [logits_array(opened.logits)], opened.position
    for _ in range(n):
        result = verify_one(stub, opened.session_id, position, return_logits=True)
        tokens += result.tokens
        rows.append(logits_array(result.logits))
        position = result.position
    return tokens, np.concatenate(rows)


def test_full_pool_is_resource_exhausted_with_a_retry_hint(small_pool):
    a = open_session(small_pool, [1, 2, 3], 20)
    b = open_session(small_pool, [4, 5, 6], 20)
    error = rpc_error(small_pool.OpenSession, rpc.OpenSessionRequest(prompt_ids=[7], max_new_tokens=5))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "slots" in error.details()
    assert dict(error.trailing_metadata())[rpc.RETRY_AFTER_KEY] == "150"
    assert small_pool.GetStats(rpc.GetStatsRequest()).free_slots == 0
    # closing one frees its slot for the next OpenSession
    assert small_pool.CloseSession(rpc.CloseSessionRequest(session_id=a.session_id)).closed
    c = open_session(small_pool, [7], 5)
    assert c.position == 1 and code_of_open(small_pool) == grpc.StatusCode.RESOURCE_EXHAUSTED
    for s in (b, c):
        small_pool.CloseSession(rpc.CloseSessionRequest(session_id=s.session_id))
    assert small_pool.GetStats(rpc.GetStatsRequest()).free_slots == 2


def test_reused_slot_behaves_like_a_fresh_one(small_pool, plain):
    first = open_session(small_pool, [9, 9, 2], 20, return_logits=True)
    tokens, logits = _decode(small_pool, first, 6)  # the slot's recurrent state now holds this sequence
    blocker = open_session(small_pool, [1], 20)
    assert code_of_open(small_pool) == grpc.StatusCode.RESOURCE_EXHAUSTED
    small_pool.CloseSession(rpc.CloseSessionRequest(session_id=first.session_id))
    again = open_session(small_pool, [9, 9, 2], 20, return_logits=True)  # lands in the freed slot
    tokens_again, logits_again = _decode(small_pool, again, 6)
    expected = plain([9, 9, 2], 20)
    assert tokens == tokens_again == expected.tokens[:7]
    assert logits.tobytes() == logits_again.tobytes() == expected.logits[:7].numpy().tobytes()
    for s in (again, blocker):
        small_pool.CloseSession(rpc.CloseSessionRequest(session_id=s.session_id))


def code_of_open(stub):
    try:
        stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=[2], max_new_tokens=3))
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_idle_sessions_are_reaped(reaping):
    idle = open_session(reaping, [1, 2, 3], 40)
    busy = open_session(reaping, [4, 5, 6], 40)
    assert code_of_open(reaping) == grpc.StatusCode.RESOURCE_EXHAUSTED
    position, deadline = busy.position, time.monotonic() + 1.2
    while time.monotonic() < deadline:  # keep one session in use past the timeout
        result = verify_one(reaping, busy.session_id, position)
        assert result.status.code == 0, result.status.message
        position = result.position
        time.sleep(0.1)
    gone = verify_one(reaping, idle.session_id, idle.position)
    assert code_of(gone) == grpc.StatusCode.NOT_FOUND and "reaped" in gone.status.message
    assert not reaping.CloseSession(rpc.CloseSessionRequest(session_id=idle.session_id)).closed
    stats = reaping.GetStats(rpc.GetStatsRequest())
    assert stats.open_sessions == 1 and stats.free_slots == 1
    reopened = open_session(reaping, [1, 2, 3], 40)  # its slot is free again
    assert reopened.first_token == idle.first_token
    for s in (busy, reopened):
        reaping.CloseSession(rpc.CloseSessionRequest(session_id=s.session_id))
