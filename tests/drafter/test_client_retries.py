"""The client against a scripted server: retries resend the same request id, step statuses become
errors with their code, the retry hint of a full pool and the bearer token reach the caller / server.
The retry decisions (drafter/retry.py) on their own, without I/O; and both clients through one
failure script, making the same tries with the same request ids."""

import asyncio

import grpc
import pytest

from drafter import retry
from drafter.client import AsyncVerifierClient, RetryPolicy, Step, VerifierClient, VerifierError
from drafter.channel import call_error
from drafter.retry import Call, Plan, StreamStep, Wait
from verifier import rpc

from scripted_server import ScriptedServer, ScriptedVerifier

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


def test_a_broken_rounds_stream_is_reopened_and_the_round_resent(server):
    with _client(server) as client:
        a = client.open_session([1], max_new_tokens=16)
        b = client.open_session([1, 2], max_new_tokens=16)
        with client.verify_rounds() as rounds:
            first = rounds.verify([Step(a.id, 1, (3,)), Step(b.id, 2, ())])
            server.verifier.fail_next["VerifyRounds"] = 1  # the second round runs, its reply is lost
            second = rounds.verify([Step(a.id, first[0].position, (4, 5)), Step(b.id, first[1].position, (6,))])
            server.verifier.step_status["retry-me"] = grpc.StatusCode.UNAVAILABLE
            third = rounds.verify([Step(a.id, second[0].position, (), request_id="retry-me")])
    assert [o.position for o in first] == [3, 3] and [o.position for o in second] == [6, 5] and third[0].position == 7
    sent = [[s.request_id for s in r.steps] for r in server.verifier.requests_of("VerifyRounds")]
    # the lost round resent whole with the same ids on a new stream; the retryable step resent alone
    assert len(sent) == 5 and sent[1] == sent[2] and sent[3] == sent[4] == ["retry-me"]
    assert (server.verifier.sessions[a.id], server.verifier.sessions[b.id]) == (7, 5)  # each round advanced once


class NoRoundsVerifier(ScriptedVerifier):
    """A server from before VerifyRounds: the method is refused as a server without it refuses it."""

    def VerifyRounds(self, requests, context):
        self._record("VerifyRounds", None, context)
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        yield  # a generator, as the stream's handler must be


def test_a_fleet_falls_back_to_verify_calls_when_the_server_has_no_rounds_stream():
    from drafter.fleet import Job, run_fleet

    class Two:
        def __init__(self):
            # the scripted model never finishes a session: each job is cut after 3 steps
            self.jobs, self.reports = [Job(8, prompt_ids=[1, 2], max_steps=3), Job(8, prompt_ids=[3], max_steps=3)], []

        def next_job(self, lane):
            return self.jobs.pop() if self.jobs else None

        def ended(self, report):
            self.reports.append(report)

    with ScriptedServer(NoRoundsVerifier()) as server, _client(server) as client:
        workload = Two()
        fleet = run_fleet(client, workload, lanes=2)
    assert len(workload.reports) == 2 and all(r.error is None and r.cut and len(r.generation.tokens) == 4 for r in workload.reports)
    methods = [m for m, _, _ in server.verifier.calls if m.startswith("Verify")]
    assert methods == ["VerifyRounds"] + ["Verify"] * len(fleet.rounds)  # refused once, then every round a call


def test_close_session_is_idempotent_and_stats_convert(server):
    with _client(server) as client:
        session = client.open_session([1], max_new_tokens=2)
        assert client.close_session(session.id) is True
        assert client.close_session(session.id) is False
        stats = client.stats()
    assert stats.drafted_per_position == [3, 2] and stats.rows_per_batch.counts == [2, 1]


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


def _drive(decisions, replies):
    """Carry out retry decisions against scripted replies: the actions taken, and the result or the
    VerifierError raised."""
    plan, replies, actions = Plan(decisions), iter(replies), []
    try:
        for action in plan:
            actions.append(action)
            if not isinstance(action, Wait):
                plan.reply(next(replies))
    except VerifierError as err:
        return actions, err
    return actions, plan.result


def _unavailable(n: int) -> VerifierError:
    return VerifierError(grpc.StatusCode.UNAVAILABLE, f"try {n} lost")


def test_the_backoff_doubles_up_to_its_cap_and_the_last_error_is_raised():
    policy = RetryPolicy(attempts=5, backoff_s=0.1, max_backoff_s=0.3)
    request = rpc.GetModelInfoRequest()
    actions, raised = _drive(retry.unary(policy, "GetModelInfo", request), [_unavailable(n) for n in range(5)])
    call = Call("GetModelInfo", request)
    assert actions == [call, Wait(0.1), call, Wait(0.2), call, Wait(0.3), call, Wait(0.3), call]
    assert isinstance(raised, VerifierError) and raised.message == "try 4 lost"


@pytest.mark.parametrize("code", [c for c in grpc.StatusCode if c != grpc.StatusCode.OK], ids=lambda c: c.name)
def test_only_unavailable_and_deadline_exceeded_are_retried(code):
    failure = VerifierError(code, "scripted")
    actions, got = _drive(retry.unary(FAST, "CloseSession", rpc.CloseSessionRequest()), [failure, "the reply"])
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        assert got == "the reply" and [type(a) for a in actions] == [Call, Wait, Call]
    else:
        assert got is failure and len(actions) == 1


def _result(code: grpc.StatusCode, request_id: str):
    return rpc.StepResult(status=rpc.Status(code=code.value[0], message="scripted"), session_id="s0", request_id=request_id,
                          tokens=[1], position=3)


def test_a_stream_step_is_resent_with_one_request_id_after_a_broken_stream_or_a_retryable_status():
    replies = [_unavailable(0), _result(grpc.StatusCode.DEADLINE_EXCEEDED, ""), _result(grpc.StatusCode.OK, "")]
    actions, outcome = _drive(retry.stream_step(FAST, Step("s0", 2, (5,))), replies)
    assert [type(a) for a in actions] == [StreamStep, Wait, StreamStep, Wait, StreamStep]
    sent = [a.request for a in actions if isinstance(a, StreamStep)]
    assert sent[0].request_id and sent[0] == sent[1] == sent[2]  # one request id, assigned before the first try
    assert outcome.ok and outcome.position == 3


def test_verify_gives_up_on_a_step_whose_status_stays_retryable_and_returns_it():
    policy = RetryPolicy(attempts=2, backoff_s=0.0)
    steps = [Step("s0", 1, request_id="ra"), Step("s1", 1, request_id="rb")]
    first = rpc.VerifyResponse(results=[_result(grpc.StatusCode.OK, "ra"), _result(grpc.StatusCode.UNAVAILABLE, "rb")])
    second = rpc.VerifyResponse(results=[_result(grpc.StatusCode.UNAVAILABLE, "rb")])
    actions, outcomes = _drive(retry.verify(policy, steps), [first, second])
    assert [[s.request_id for s in a.request.steps] for a in actions if isinstance(a, Call)] == [["ra", "rb"], ["rb"]]
    assert [o.code for o in outcomes] == [grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE]


class _Awaitable:
    """The blocking client (or its stream) with coroutine methods, so that one script drives both clients."""

    def __init__(self, target):
        self._target = target

    def verify_stream(self):
        return _Awaitable(self._target.verify_stream())

    def __getattr__(self, name):
        method = getattr(self._target, name)

        async def call(*args, **kwargs):
            return method(*args, **kwargs)
        return call


async def _failure_script(client, verifier, address: str) -> list:
    """Every failure the client retries or raises, in one run; what each call returned or raised."""
    verifier.fail_next.update(OpenSession=1, Verify=1, VerifyStream=1, GetModelInfo=FAST.attempts)
    verifier.step_status["v3"] = grpc.StatusCode.UNAVAILABLE
    seen = []

    async def record(call):
        try:
            got = await call
        except VerifierError as err:
            got = (err.code, str(err).replace(address, "ADDRESS"), err.current_position)
        seen.append(got)
        return got

    a = await record(client.open_session([3, 4], max_new_tokens=16, request_id="open-a"))
    b = await record(client.open_session([3], max_new_tokens=16, request_id="open-b"))
    one = await record(client.step(Step(a.id, a.position, (5,), request_id="v1")))
    await record(client.verify([Step(a.id, one.position, (6, 7), request_id="v2"), Step(b.id, 1, (), request_id="v3")]))
    stream = client.verify_stream()
    streamed = await record(stream.step(Step(a.id, one.position + 3, (8,), request_id="s1")))
    await record(stream.step(Step(a.id, streamed.position, (), request_id="s2")))
    await stream.close()
    await record(client.model_info())
    await record(client.step(Step(a.id, 0, (), request_id="stale")))
    await record(client.close_session(a.id))
    return seen


def test_both_clients_make_the_same_tries_with_the_same_request_ids():
    with ScriptedServer() as server:
        with _client(server) as client:
            blocking = asyncio.run(_failure_script(_Awaitable(client), server.verifier, server.address))
        blocking_attempts = server.verifier.attempts()

    async def run_async(server):
        async with AsyncVerifierClient(server.address, retry=FAST, timeout_s=5) as client:
            return await _failure_script(client, server.verifier, server.address)

    with ScriptedServer() as server:
        asynchronous = asyncio.run(run_async(server))
        async_attempts = server.verifier.attempts()

    assert async_attempts == blocking_attempts
    assert blocking_attempts == [
        ("OpenSession", ("open-a",)), ("OpenSession", ("open-a",)), ("OpenSession", ("open-b",)),
        ("Verify", ("v1",)), ("Verify", ("v1",)), ("Verify", ("v2", "v3")), ("Verify", ("v3",)),
        ("VerifyStream", ("s1",)), ("VerifyStream", ("s1",)), ("VerifyStream", ("s2",)),
        *[("GetModelInfo", ())] * FAST.attempts, ("Verify", ("stale",)), ("CloseSession", ())]
    assert asynchronous == blocking  # same outcomes, and the same errors with the same messages
    unavailable, stale = blocking[-3], blocking[-2]
    dropped = "UNAVAILABLE: cannot reach the verifier at ADDRESS: scripted: GetModelInfo reply dropped"
    assert unavailable == (grpc.StatusCode.UNAVAILABLE, dropped, None)
    assert stale == (grpc.StatusCode.ABORTED, "ABORTED (session s0): stale expected_position", 10) and blocking[-1] is True


class _Failed(grpc.RpcError):
    def __init__(self, code, details, trailing=()):
        self._code, self._details, self._trailing = code, details, trailing

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


def test_an_unavailable_the_server_said_is_passed_on_as_its_own():
    """UNAVAILABLE from a server that drains or stops carries its reason (trailing "verifier-stopping"):
    the client says the verifier is stopping and passes the reason on; gRPC's own UNAVAILABLE (no
    server reached) stays "cannot reach"."""
    said = call_error(_Failed(grpc.StatusCode.UNAVAILABLE, "the server is stopping: resend on a new call",
                              ((rpc.STOPPING_KEY, "1"),)), "h:1")
    assert str(said).endswith("the verifier at h:1 is stopping: the server is stopping: resend on a new call"), str(said)
    unreached = call_error(_Failed(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"), "h:1")
    assert "cannot reach the verifier at h:1: failed to connect to all addresses" in str(unreached)
