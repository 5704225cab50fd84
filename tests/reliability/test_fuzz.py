"""Fuzzing: hypothesis-generated OpenSession / Verify / CloseSession sequences
(random fields and sizes, ids negative and huge, random request ids with repeats) against ONE
live server. No crash, no hang (every call has a deadline), only documented status codes,
health stays SERVING, and every slot comes back once everything is closed."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verifier import rpc

from .conftest import MAX_K, VOCAB

N_SLOTS, MAX_SEQ_LEN = 4, 48
DEADLINE_S = 20
OK = grpc.StatusCode.OK
# DESIGN.md section 8, plus FAILED_PRECONDITION (a finished session) and ABORTED (stale position)
DOCUMENTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE,
              grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED}
CODES = {c.value[0]: c for c in grpc.StatusCode}

token_ids = st.one_of(st.integers(0, VOCAB - 1), st.integers(-(2 ** 31), 2 ** 31 - 1))
request_ids = st.sampled_from(["", "a", "b", "c", "\u00e9"])
positions = st.one_of(st.integers(0, MAX_SEQ_LEN + 2), st.integers(0, 2 ** 64 - 1))
sampling = st.builds(rpc.Sampling, temperature=st.one_of(st.just(0.0), st.floats(-1, 3), st.sampled_from([float("nan"), float("inf")])),
                     top_k=st.integers(0, 2 ** 32 - 1), top_p=st.one_of(st.just(0.0), st.floats(-0.5, 1.5), st.just(float("nan"))),
                     seed=st.integers(0, 2 ** 64 - 1))
open_op = st.builds(lambda ids, s, n, rid, logits: ("open", rpc.OpenSessionRequest(
    prompt_ids=ids, sampling=s, max_new_tokens=n, request_id=rid, return_logits=logits)),
    st.lists(token_ids, max_size=60), sampling, st.integers(0, 2 ** 32 - 1), request_ids, st.booleans())
step = st.fixed_dictionaries({"session": st.integers(0, 5), "position": positions, "drafts": st.lists(token_ids, max_size=MAX_K + 3),
                              "rid": request_ids, "logits": st.booleans(), "probs": st.one_of(st.just(b""), st.binary(max_size=64))})
verify_op = st.tuples(st.just("verify"), st.lists(step, min_size=0, max_size=4))
close_op = st.tuples(st.just("close"), st.integers(0, 5))
ops = st.lists(st.one_of(open_op, verify_op, close_op), min_size=1, max_size=12)


@pytest.fixture(scope="module")
def fuzzed(reliability_checkpoint):
    from verifier.server.testing import LoopbackServer

    with LoopbackServer(reliability_checkpoint, n_slots=N_SLOTS, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K) as server:
        with grpc.insecure_channel(server.address) as channel:
            yield rpc.VerifierStub(channel), channel


def _session_id(opened, i):
    """The i-th session opened so far (and its position), or a made-up id when there are fewer."""
    if i < len(opened):
        return opened[i].session_id, opened[i].position
    return ("f" * 32, 0) if i % 2 else (str(i), 0)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                                  HealthCheck.too_slow])
@given(ops=ops)
def test_fuzzed_calls(fuzzed, ops):
    stub, channel = fuzzed
    opened = []
    for kind, arg in ops:
        if kind == "open":
            try:
                opened.append(stub.OpenSession(arg, timeout=DEADLINE_S))
            except grpc.RpcError as exc:
                assert exc.code() in DOCUMENTED, (exc.code(), exc.details())
        elif kind == "verify":
            steps = []
            for s in arg:
                sid, position = _session_id(opened, s["session"])
                steps.append(rpc.VerifyStep(session_id=sid, expected_position=position if s["position"] % 3 else s["position"],
                                            draft_ids=s["drafts"], request_id=s["rid"], return_logits=s["logits"],
                                            draft_probs=s["probs"]))
            results = stub.Verify(rpc.VerifyRequest(steps=steps), timeout=DEADLINE_S).results
            assert len(results) == len(steps)
            for result, sent in zip(results, steps):
                code = CODES[result.status.code]
                assert code == OK or code in DOCUMENTED, (code, result.status.message)
                assert result.session_id == sent.session_id
                if code == OK:
                    assert len(result.tokens) == result.accepted + 1 or result.finish_reason
        else:
            sid, _ = _session_id(opened, arg)
            stub.CloseSession(rpc.CloseSessionRequest(session_id=sid), timeout=DEADLINE_S)
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    for o in opened:
        stub.CloseSession(rpc.CloseSessionRequest(session_id=o.session_id), timeout=DEADLINE_S)
    stats = stub.GetStats(rpc.GetStatsRequest(), timeout=DEADLINE_S)
    assert stats.free_slots == N_SLOTS and stats.open_sessions == 0
