"""Faults around a step in the engine: a client that cancels mid-step, a
deadline shorter than a step, a session closed while its step runs and under load, reopening
after close, a full pool freed and reused. The engine is slowed for the faulty session only, so
its step is reliably inside the engine when the fault comes; witness sessions must not notice."""

import threading

import grpc
import pytest

from verifier import rpc
from verifier.server.principals import ANONYMOUS
from service.helpers import code_of, open_session, rpc_error, step, verify_one

from .conftest import VOCAB
from .witness import Witnesses

PROMPT = [3, 14, 15, 92 % VOCAB, 65]


@pytest.fixture(scope="module")
def stub(slow_server):
    server, _ = slow_server
    with grpc.insecure_channel(server.address) as channel:
        yield rpc.VerifierStub(channel)


@pytest.fixture
def slowed(slow_server):
    """slowed(session_id): make that session's steps slow; cleared after the test."""
    server, engine = slow_server
    engine.entered.clear()

    def slow(session_id):
        seq = server.run_on_loop(lambda: server.server.service.sessions.get(session_id, ANONYMOUS).sequence)
        engine.slow.add(id(seq))

    yield slow
    engine.slow.clear()


def _free_slots(stub):
    return stub.GetStats(rpc.GetStatsRequest()).free_slots


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_client_leaves_mid_step_result_kept_for_the_retry(slow_server, stub, slowed, plain_decode, how):
    _, engine = slow_server
    expected = plain_decode(PROMPT, 30)
    with Witnesses(stub, plain_decode):
        opened = open_session(stub, PROMPT, 30)
        slowed(opened.session_id)
        request = rpc.VerifyRequest(steps=[step(opened.session_id, opened.position, expected.tokens[1:3], request_id="mid")])
        if how == "cancel":
            future = stub.Verify.future(request)
            assert engine.entered.wait(10)  # the step is inside the engine
            assert future.cancel()
            assert future.cancelled()
            with pytest.raises(grpc.FutureCancelledError):
                future.result()
        else:
            error = rpc_error(stub.Verify, request, timeout=engine.delay_s / 4)  # shorter than the step
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert engine.entered.is_set()
        (retry,) = stub.Verify(request).results  # waits for the step in flight, or gets its stored result
        assert retry.status.code == 0 and list(retry.tokens) == expected.tokens[1:4]
        assert retry.position == opened.position + 3  # advanced once
        engine.slow.clear()
        stale = verify_one(stub, opened.session_id, opened.position, request_id="next")
        assert code_of(stale) == grpc.StatusCode.ABORTED and stale.status.current_position == retry.position
        nxt = verify_one(stub, opened.session_id, retry.position)
        assert list(nxt.tokens) == expected.tokens[4:5]
        stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


def test_close_while_its_step_runs(slow_server, stub, slowed, plain_decode):
    _, engine = slow_server
    expected = plain_decode(PROMPT, 30)
    with Witnesses(stub, plain_decode, recycle=False):  # fixed pool use: free slots compare
        free = _free_slots(stub)
        opened = open_session(stub, PROMPT, 30)
        slowed(opened.session_id)
        future = stub.Verify.future(rpc.VerifyRequest(steps=[step(opened.session_id, opened.position, expected.tokens[1:3])]))
        assert engine.entered.wait(10)
        assert stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id)).closed
        (result,) = future.result(timeout=30).results  # the step handed to the engine completes
        assert result.status.code == 0 and list(result.tokens) == expected.tokens[1:4]
        after = verify_one(stub, opened.session_id, result.position)
        assert code_of(after) == grpc.StatusCode.NOT_FOUND and "closed" in after.status.message
        assert _free_slots(stub) == free
        # the slot's release ran after the step: the same prompt reopened is a fresh session
        again = open_session(stub, PROMPT, 30)
        got = verify_one(stub, again.session_id, again.position, expected.tokens[1:5])
        assert [again.first_token, *got.tokens] == expected.tokens[:6]
        stub.CloseSession(rpc.CloseSessionRequest(session_id=again.session_id))


def test_close_under_load(stub, plain_decode):
    """Sessions closed while threads step them: each thread sees only OK results equal to plain
    decoding, then NOT_FOUND; the slots all come back."""
    prompts = [[20 + i, 7, 7 + i] for i in range(4)]
    with Witnesses(stub, plain_decode, recycle=False):  # fixed pool use: free slots compare
        free = _free_slots(stub)
        opened = [open_session(stub, p, 40) for p in prompts]
        outcomes = [[] for _ in opened]
        started = [threading.Event() for _ in opened]

        def drive(i):
            o, expected = opened[i], plain_decode(prompts[i], 40)
            tokens, position = [o.first_token], o.position
            while True:
                result = verify_one(stub, o.session_id, position, expected.tokens[len(tokens):len(tokens) + 2])
                outcomes[i].append(code_of(result))
                started[i].set()
                if result.status.code != 0:
                    return
                tokens += result.tokens
                if tokens != expected.tokens[:len(tokens)]:
                    outcomes[i].append("tokens differ from plain decoding")
                    return
                position = result.position
                if result.finish_reason:
                    return

        threads = [threading.Thread(target=drive, args=(i,)) for i in range(len(opened))]
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(30)
        for o in opened:
            assert stub.CloseSession(rpc.CloseSessionRequest(session_id=o.session_id)).closed
        for t in threads:
            t.join(30)
        for codes in outcomes:
            ok = [c for c in codes if c == grpc.StatusCode.OK]
            assert codes[: len(ok)] == ok  # OKs first, then at most one failure
            assert codes[len(ok):] in ([], [grpc.StatusCode.NOT_FOUND])
        assert _free_slots(stub) == free


def test_reopening_after_close(stub, plain_decode):
    expected = plain_decode(PROMPT, 30)
    with Witnesses(stub, plain_decode):
        first = open_session(stub, PROMPT, 30)
        verify_one(stub, first.session_id, first.position, expected.tokens[1:4])
        assert stub.CloseSession(rpc.CloseSessionRequest(session_id=first.session_id)).closed
        assert not stub.CloseSession(rpc.CloseSessionRequest(session_id=first.session_id)).closed
        gone = verify_one(stub, first.session_id, first.position + 4)
        assert code_of(gone) == grpc.StatusCode.NOT_FOUND and "closed" in gone.status.message
        again = open_session(stub, PROMPT, 30, return_logits=True)
        assert again.session_id != first.session_id and again.position == len(PROMPT)
        assert again.logits.float32 == expected.logits[:1].numpy().astype("<f4").tobytes()
        got = verify_one(stub, again.session_id, again.position, expected.tokens[1:6])
        assert [again.first_token, *got.tokens] == expected.tokens[:7]
        stub.CloseSession(rpc.CloseSessionRequest(session_id=again.session_id))


def test_pool_full_then_freed_and_reused(slow_server, stub, plain_decode):
    server, _ = slow_server
    n_slots = server.config.n_slots
    expected = plain_decode(PROMPT, 30)
    with Witnesses(stub, plain_decode, n=3, recycle=False):  # witnesses hold 3 slots throughout
        fillers = [open_session(stub, [i + 1, i + 2], 20) for i in range(n_slots - 3)]
        assert _free_slots(stub) == 0
        error = rpc_error(stub.OpenSession, rpc.OpenSessionRequest(prompt_ids=PROMPT, max_new_tokens=30))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "slots" in error.details()
        assert int(dict(error.trailing_metadata())[rpc.RETRY_AFTER_KEY]) == server.config.retry_after_ms
        for f in fillers[:2]:
            assert stub.CloseSession(rpc.CloseSessionRequest(session_id=f.session_id)).closed
        assert _free_slots(stub) == 2
        reused = open_session(stub, PROMPT, 30)  # lands in a freed slot, and behaves like a fresh one
        got = verify_one(stub, reused.session_id, reused.position, expected.tokens[1:5])
        assert [reused.first_token, *got.tokens] == expected.tokens[:6]
        for s in [reused, *fillers[2:]]:
            stub.CloseSession(rpc.CloseSessionRequest(session_id=s.session_id))
    assert _free_slots(stub) == n_slots
