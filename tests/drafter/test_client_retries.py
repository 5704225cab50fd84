"""The client against a scripted server: retries resend the same request id, step statuses become
errors with their code, the retry hint of a full pool and the bearer token reach the caller / server."""

import asyncio

import grpc
import pytest

from drafter.client import AsyncVerifierClient, RetryPolicy, Step, VerifierClient, VerifierError

from scripted_server import ScriptedServer

FAST = RetryPolicy(attempts=3, backoff_s=0.01)


@pytest.fixture
def server():
    with ScriptedServer() as s:
        yield s


def _client(server, **kw):
    return VerifierClient(server.address, retry=FAST, timeout_s=5, **kw)


def test_a_dropped_open_reply_is_resent_with_the_same_request_id(server):
    server.verifier.fail_next["OpenSession"] = 1
    with _client(server) as client:
        session = client.open_session([3, 4, 5], max_new_tokens=8)
    ids = [r.request_id for r in server.verifier.requests_of("OpenSession")]
    assert len(ids) == 2 and ids[0] == ids[1] and ids[0]
    assert len(server.verifier.sessions) == 1 and session.position == 3 and session.pending == 1


def test_a_dropped_verify_reply_is_resent_and_never_advances_twice(server):
    server.verifier.fail_next["Verify"] = 1
    with _client(server) as client:
        session = client.open_session([3, 4], max_new_tokens=8)
        outcome = client.step(Step(session.id, session.position, (5, 6)))
    sent = server.verifier.requests_of("Verify")
    assert len(sent) == 2 and sent[0].steps[0].request_id == sent[1].steps[0].request_id
    assert outcome.tokens == [5, 6, 1] and outcome.position == 5
    assert server.verifier.sessions[session.id] == 5  # advanced once


def test_only_the_steps_whose_status_is_retryable_are_resent(server):
    with _client(server) as client:
        a = client.open_session([1], max_new_tokens=8)
        b = client.open_session([1, 2], max_new_tokens=8)
        server.verifier.step_status["rb"] = grpc.StatusCode.UNAVAILABLE
        outcomes = client.verify([Step(a.id, 1, (4,), request_id="ra"), Step(b.id, 2, (), request_id="rb")])
    assert [o.ok for o in outcomes] == [True, True] and outcomes[1].tokens == [1]
    sent = server.verifier.requests_of("Verify")
    assert [[s.request_id for s in r.steps] for r in sent] == [["ra", "rb"], ["rb"]]


def test_the_retries_are_bounded(server):
    server.verifier.fail_next["GetModelInfo"] = 10
    with _client(server) as client, pytest.raises(VerifierError) as info:
        client.model_info()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and len(server.verifier.requests_of("GetModelInfo")) == FAST.attempts


def test_a_bad_step_status_raises_with_code_and_current_position(server):
    with _client(server) as client:
        session = client.open_session([1, 2], max_new_tokens=8)
        (stale,) = client.verify([Step(session.id, 9, ())])
        assert not stale.ok and stale.code == grpc.StatusCode.ABORTED and stale.current_position == 2
        with pytest.raises(VerifierError) as info:
            client.step(Step(session.id, 9, ()))
        assert info.value.code == grpc.StatusCode.ABORTED and info.value.current_position == 2
        assert "stale expected_position" in str(info.value) and session.id in str(info.value)


def test_a_full_pool_raises_with_the_retry_hint(server):
    server.verifier.pool_full = True
    with _client(server) as client, pytest.raises(VerifierError) as info:
        client.open_session([1], max_new_tokens=4)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.retry_after_s == 0.25
    assert len(server.verifier.requests_of("OpenSession")) == 1  # not a retryable code


def test_the_bearer_token_goes_with_every_call(server):
    with _client(server, auth_token="s3cret") as client:
        client.model_info()
        client.close_session("nobody")
    assert [meta.get("authorization") for _, meta, _ in server.verifier.calls] == ["Bearer s3cret"] * 2
    with _client(server) as client:
        client.model_info()
    assert "authorization" not in server.verifier.calls[-1][1]


def test_a_broken_stream_is_reopened_and_the_step_resent(server):
    with _client(server) as client:
        session = client.open_session([1, 2], max_new_tokens=16)
        with client.verify_stream() as stream:
            first = stream.step(Step(session.id, 2, (3,)))
            server.verifier.fail_next["VerifyStream"] = 1
            second = stream.step(Step(session.id, first.position, (4, 5)))
            third = stream.step(Step(session.id, second.position, ()))
    assert (first.position, second.position, third.position) == (4, 7, 8)
    ids = [s.request_id for s in server.verifier.requests_of("VerifyStream")]
    assert len(ids) == 4 and ids[1] == ids[2] and len(set(ids)) == 3
    assert server.verifier.sessions[session.id] == 8


def test_close_session_is_idempotent_and_stats_convert(server):
    with _client(server) as client:
        session = client.open_session([1], max_new_tokens=2)
        assert client.close_session(session.id) is True
        assert client.close_session(session.id) is False
        stats = client.stats()
    assert stats.drafted_per_position == (3, 2) and stats.rows_per_batch.counts == (2, 1)


def test_the_async_client_retries_the_same_way(server):
    async def run():
        async with AsyncVerifierClient(server.address, retry=FAST, timeout_s=5) as client:
            server.verifier.fail_next["Verify"] = 1
            session = await client.open_session([3], max_new_tokens=8)
            outcome = await client.step(Step(session.id, 1, (2,)))
            server.verifier.fail_next["VerifyStream"] = 1
            async with client.verify_stream() as stream:
                streamed = await stream.step(Step(session.id, outcome.position, (6,)))
            with pytest.raises(VerifierError) as info:
                await client.step(Step(session.id, 0, ()))
            return outcome, streamed, info.value

    outcome, streamed, error = asyncio.run(run())
    assert outcome.tokens == [2, 1] and streamed.tokens == [6, 1] and streamed.position == 5
    assert error.code == grpc.StatusCode.ABORTED and error.current_position == 5
    verify_ids = [r.steps[0].request_id for r in server.verifier.requests_of("Verify")]
    stream_ids = [s.request_id for s in server.verifier.requests_of("VerifyStream")]
    assert verify_ids[0] == verify_ids[1] and stream_ids[0] == stream_ids[1]
