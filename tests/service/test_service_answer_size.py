"""An answer that cannot be sent is never run: a step whose result (with return_logits: up to K + 1
rows of the vocabulary) would take the answer past the server's message limit (--max-message-mb) is
refused RESOURCE_EXHAUSTED, naming the limit, before the engine sees it; its session does not move,
and the steps of the same call that fit run as usual."""

import grpc
import pytest

from verifier import rpc

from .helpers import code_of, open_session, step

VOCAB = 90
PROMPT = [9, 8, 7, 6, 5]
# 8 KiB: one step's answer of 9 logits rows (9 x 90 x 4 bytes and its fields, about 4.3 KiB) fits,
# two do not
LIMIT_MB = 8 / 1024


@pytest.fixture(scope="module")
def small_stub(text_checkpoint):
    from verifier.server.testing import LoopbackServer

    with LoopbackServer(text_checkpoint, n_slots=4, max_seq_len=96, max_k=8, max_message_mb=LIMIT_MB) as server:
        with grpc.insecure_channel(server.address) as channel:
            yield rpc.VerifierStub(channel)


def test_an_answer_over_the_limit_is_refused_before_it_runs(small_stub, plain):
    expected = plain(PROMPT, 30)
    a, b, c = (open_session(small_stub, PROMPT, 30) for _ in range(3))
    drafts = expected.tokens[1:9]
    steps = [step(s.session_id, s.position, drafts, return_logits=True) for s in (a, b)] + [step(c.session_id, c.position, drafts)]
    results = small_stub.Verify(rpc.VerifyRequest(steps=steps)).results
    assert [code_of(r) for r in results] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2 + [grpc.StatusCode.OK]
    message = results[0].status.message
    assert "--max-message-mb" in message and "nothing ran" in message and "return_logits" in message
    assert list(results[2].tokens) == expected.tokens[1:10]  # the step that fits ran
    # a and b never moved: the same step alone fits, runs, and gives plain decoding's tokens and its logits rows
    for s in (a, b):
        (alone,) = small_stub.Verify(rpc.VerifyRequest(steps=[step(s.session_id, s.position, drafts, return_logits=True)])).results
        assert code_of(alone) == grpc.StatusCode.OK and list(alone.tokens) == expected.tokens[1:10]
        assert alone.logits.rows == 9 and alone.logits.vocab_size == VOCAB
    for s in (a, b, c):
        small_stub.CloseSession(rpc.CloseSessionRequest(session_id=s.session_id))


def test_a_stream_step_over_the_limit_is_refused(text_checkpoint, plain):
    """On a VerifyStream every answer is one message: a step whose logits alone pass the limit."""
    from verifier.server.testing import LoopbackServer

    with LoopbackServer(text_checkpoint, n_slots=2, max_seq_len=96, max_k=8, max_message_mb=2 / 1024) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            expected = plain(PROMPT, 30)
            s = open_session(stub, PROMPT, 30)
            (big,) = list(stub.VerifyStream(iter([step(s.session_id, s.position, expected.tokens[1:9], return_logits=True)])))
            assert code_of(big) == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-message-mb" in big.status.message
            (small,) = list(stub.VerifyStream(iter([step(s.session_id, s.position, expected.tokens[1:2], return_logits=True)])))
            assert code_of(small) == grpc.StatusCode.OK and list(small.tokens) == expected.tokens[1:3]
