"""Generate: a session the server drafts for, run to its end with no round trip per step. Its
tokens equal plain decoding, every step says what it proposed, verified and accepted, the session
is closed when the call ends (finished, refused, or cancelled by its caller), and a session the
client drafts for is refused."""

import threading
import time

import grpc

from verifier import rpc
from verifier.params import SamplingParams

from .helpers import rpc_error

PROMPT = [5, 17, 33, 2, 5, 17, 33, 2, 5, 17]  # repeats: the n-gram drafter has something to propose


def _free(stub) -> int:
    return stub.GetStats(rpc.GetStatsRequest()).free_slots


def test_generate_equals_plain_and_reports_each_step(server, stub, plain):
    free = _free(stub)
    for sampling in (None, SamplingParams(temperature=0.9, top_k=40, seed=7)):
        wire = rpc.Sampling(temperature=sampling.temperature, top_k=sampling.top_k, seed=sampling.seed) if sampling else None
        events = list(stub.Generate(rpc.GenerateRequest(open=rpc.OpenSessionRequest(
            prompt_ids=PROMPT, max_new_tokens=30, sampling=wire, server_drafter="ngram", server_draft_k=4)), timeout=60))
        opened, steps = events[0].opened, [e.step for e in events[1:]]
        assert opened.session_id and not events[0].HasField("step") and all(not e.HasField("opened") for e in events[1:])
        tokens = [opened.first_token] + [t for step in steps for t in step.tokens]
        assert tokens == list(plain(PROMPT, 30, sampling).tokens)
        assert steps[-1].finish_reason != rpc.FINISH_NONE
        for step in steps:
            assert step.status.code == 0 and step.HasField("proposed_drafts") and step.HasField("verified_drafts")
            assert step.accepted <= step.verified_drafts <= step.proposed_drafts <= 4
        assert any(step.proposed_drafts for step in steps)  # the server drafter proposed, and its drafts were judged
    assert _free(stub) == free  # each session was closed with its call


def test_a_client_drafted_session_is_refused(stub):
    error = rpc_error(lambda: list(stub.Generate(rpc.GenerateRequest(open=rpc.OpenSessionRequest(prompt_ids=PROMPT, max_new_tokens=5)),
                                                 timeout=10)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "server_drafter" in error.details()
    error = rpc_error(lambda: list(stub.Generate(rpc.GenerateRequest(open=rpc.OpenSessionRequest(
        prompt_ids=PROMPT, max_new_tokens=5, server_drafter="nope")), timeout=10)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "server_drafter 'nope'" in error.details()


def test_cancelling_the_call_closes_the_session(server, stub):
    free = _free(stub)
    call = stub.Generate(rpc.GenerateRequest(open=rpc.OpenSessionRequest(prompt_ids=PROMPT, max_new_tokens=60,
                                                                          server_drafter="ngram", server_draft_k=2)), timeout=60)
    first = next(call)
    assert first.opened.session_id
    call.cancel()
    deadline = time.monotonic() + 10
    while _free(stub) != free and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _free(stub) == free
    closed = stub.CloseSession(rpc.CloseSessionRequest(session_id=first.opened.session_id))
    assert not closed.closed  # already closed by the server when the call ended


def test_generate_beside_stepping_sessions(server, stub, plain):
    """Two Generate calls and a client-drafted session at once: every stream plain decoding's."""
    outcomes = {}

    def run(name, prompt):
        events = list(stub.Generate(rpc.GenerateRequest(open=rpc.OpenSessionRequest(
            prompt_ids=prompt, max_new_tokens=24, server_drafter="ngram")), timeout=60))
        outcomes[name] = [events[0].opened.first_token] + [t for e in events[1:] for t in e.step.tokens]

    threads = [threading.Thread(target=run, args=(f"g{i}", PROMPT[i:] + [3])) for i in range(2)]
    for thread in threads:
        thread.start()
    opened = stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=[9, 8, 7], max_new_tokens=12))
    tokens, position = [opened.first_token], opened.position
    while True:
        (result,) = stub.Verify(rpc.VerifyRequest(steps=[rpc.VerifyStep(session_id=opened.session_id, expected_position=position)])).results
        tokens += result.tokens
        position = result.position
        if result.finish_reason != rpc.FINISH_NONE:
            break
    for thread in threads:
        thread.join(timeout=60)
    assert tokens == list(plain([9, 8, 7], 12).tokens)
    for i in range(2):
        assert outcomes[f"g{i}"] == list(plain(PROMPT[i:] + [3], 24).tokens)
    stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


def test_the_drafter_runs_a_server_drafted_session_in_one_generate_call(server, plain, monkeypatch):
    """drafter.loop over the stream transport: one Generate call, no step sent from this side."""
    from drafter.client import VerifierClient
    from drafter.loop import STREAM, generate

    def no_steps(*args, **kwargs):
        raise AssertionError("a server-drafted session over the stream transport sent a step")

    monkeypatch.setattr(VerifierClient, "verify_stream", no_steps)
    monkeypatch.setattr(VerifierClient, "verify", no_steps)
    seen = []
    with VerifierClient(server.address) as client:
        result = generate(client, None, prompt_ids=PROMPT, max_new_tokens=20, k=3, transport=STREAM, server_drafter="ngram",
                          on_tokens=seen.append)
        assert client.stats().open_sessions == 0  # closed with its call
    assert result.tokens == list(plain(PROMPT, 20).tokens) == [t for chunk in seen for t in chunk]
    assert len(result.accepted_per_step) == len(result.drafted_per_step) == len(seen) - 1 and result.finish_reason is not None


def test_each_next_step_is_queued_before_its_batch_ends(server, stub, plain, monkeypatch):
    """Generate chains its steps: when a batch that ran a Generate step ends, the session's next
    step is already queued (submitted where the scheduler answered it), so the next batch needs
    neither gRPC's write of the result nor the handler's turn on the event loop."""
    scheduler = server.server.service.scheduler
    run = scheduler._run
    seen = []  # per batch of the Generate session: whether its next step was queued as the batch ended

    async def watched(batch):
        await run(batch)
        mine = [p for p in batch if p.session.drafter is not None]
        for pending in mine:
            if pending.result is not None and pending.result.finish_reason == rpc.FINISH_NONE and not pending.result.status.code:
                seen.append(any(q.session is pending.session for q in scheduler._queue))

    monkeypatch.setattr(scheduler, "_run", watched)
    events = list(stub.Generate(rpc.GenerateRequest(open=rpc.OpenSessionRequest(
        prompt_ids=PROMPT, max_new_tokens=24, server_drafter="ngram", server_draft_k=3)), timeout=60))
    tokens = [events[0].opened.first_token] + [t for e in events[1:] for t in e.step.tokens]
    assert tokens == list(plain(PROMPT, 24).tokens)
    assert len(seen) == len(events) - 2 and seen and all(seen)  # every step but the last had its successor queued


def test_drafts_are_proposed_ahead_not_on_a_batch_of_their_own(server, stub, plain, monkeypatch):
    """After a server-drafted step runs, its session's next drafts are proposed on the worker right
    behind it: the batch that takes the next step proposes nothing itself (one worker call a step:
    the step). Only the first step, with nothing before it, has its drafts proposed by its batch."""
    from verifier.server import scheduler as scheduling

    service = server.server.service
    run = service.worker.run
    proposals = []

    async def counting(fn, *args):
        if fn is scheduling._propose:
            proposals.append(len(args[1]))
        return await run(fn, *args)

    monkeypatch.setattr(service.worker, "run", counting)
    events = list(stub.Generate(rpc.GenerateRequest(open=rpc.OpenSessionRequest(
        prompt_ids=PROMPT, max_new_tokens=30, server_drafter="ngram", server_draft_k=2)), timeout=60))
    tokens = [events[0].opened.first_token] + [t for e in events[1:] for t in e.step.tokens]
    assert tokens == list(plain(PROMPT, 30).tokens)
    assert len(events) > 4 and proposals == [1]


def test_a_stopping_server_ends_a_generate_call_unavailable_with_final_tokens(text_checkpoint, plain):
    """A Generate call running when the server stops: no step is chained past the stop, the call
    ends UNAVAILABLE with the stopping trailer (never CANCELLED), and every token it streamed is
    plain decoding's."""
    from verifier.engine import Engine
    from verifier.server.testing import LoopbackServer

    gate, reached = threading.Event(), threading.Event()

    class Paused(Engine):
        """Steps wait at the fourth until the test lets them on."""

        steps = 0

        def step(self, requests):
            Paused.steps += 1
            if Paused.steps == 4:
                reached.set()
                assert gate.wait(30), "the test never let the steps on"
            return super().step(requests)

    server = LoopbackServer(text_checkpoint, engine_class=Paused, n_slots=2, max_seq_len=96)
    tokens, code, trailer = [], None, {}
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            call = stub.Generate(rpc.GenerateRequest(open=rpc.OpenSessionRequest(
                prompt_ids=PROMPT, max_new_tokens=60, server_drafter="ngram", server_draft_k=2)), timeout=60)

            def read():
                nonlocal code
                try:
                    for event in call:
                        tokens.extend([event.opened.first_token] if event.HasField("opened") else event.step.tokens)
                    code = grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    code = exc.code()
                    trailer.update(dict(exc.trailing_metadata() or ()))

            reader = threading.Thread(target=read)
            reader.start()
            assert reached.wait(30)
            stopper = threading.Thread(target=server.stop, kwargs={"grace_s": 5.0})
            stopper.start()
            time.sleep(0.2)  # the stop has begun: no step may be chained from here
            gate.set()
            reader.join(timeout=30)
            stopper.join(timeout=30)
    finally:
        gate.set()
        server.stop()
    assert code == grpc.StatusCode.UNAVAILABLE and trailer.get(rpc.STOPPING_KEY) == "1", (code, trailer)
    assert 4 <= len(tokens) < 60 and tokens == list(plain(PROMPT, 60).tokens)[: len(tokens)]


def test_a_proposal_made_ahead_that_fails_fails_that_step_alone(server, stub, plain, monkeypatch):
    """The worker job that proposes ahead raising as a whole: the step its drafts were for is
    INTERNAL at the position it expected, the session steps on (its next drafts proposed by their
    batch), and its tokens are plain decoding's."""
    from verifier.server import scheduler as scheduling

    propose, calls = scheduling._propose, []

    def failing_ahead(engine, sessions):
        calls.append(len(sessions))
        if len(calls) == 2:  # the first proposal made ahead: still running when its step's batch takes it
            time.sleep(0.3)
            raise RuntimeError("a proposal that fails as a whole")
        return propose(engine, sessions)

    monkeypatch.setattr(scheduling, "_propose", failing_ahead)
    opened = stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=PROMPT, max_new_tokens=20, server_drafter="ngram",
                                                     server_draft_k=2))
    beside = stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=[9, 8, 7], max_new_tokens=40))  # client-drafted, same batches
    tokens, position, codes, other = [opened.first_token], opened.position, [], beside.position
    while True:
        result, mate = stub.Verify(rpc.VerifyRequest(steps=[
            rpc.VerifyStep(session_id=opened.session_id, expected_position=position),
            rpc.VerifyStep(session_id=beside.session_id, expected_position=other)])).results
        assert mate.status.code == 0, mate.status.message  # the failed proposal is its step's alone
        other = mate.position
        codes.append(result.status.code)
        if result.status.code:
            assert result.position == position  # nothing ran
            continue
        tokens += result.tokens
        position = result.position
        if result.finish_reason != rpc.FINISH_NONE:
            break
    assert codes[1] == grpc.StatusCode.INTERNAL.value[0] and codes.count(codes[1]) == 1 and codes[0] == 0
    assert tokens == list(plain(PROMPT, 20).tokens)
    for session in (opened, beside):
        stub.CloseSession(rpc.CloseSessionRequest(session_id=session.session_id))
