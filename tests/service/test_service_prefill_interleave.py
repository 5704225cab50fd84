"""Prompts are prefilled in turns, a turn one engine-thread job of the waiting opens' next chunks
(verifier/server/prefill.py): the batches of sessions already stepping run between turns (they wait
for a turn, not for a whole prompt), prompts arriving together share turns up to the row budget,
and the opened sessions' tokens are plain decoding's."""

import threading
import time

import grpc
import pytest
from prometheus_client import generate_latest

from verifier import rpc
from verifier.engine import Engine, Opening
from verifier.server.testing import LoopbackServer

CHUNK = 4
PROMPTS = [[(7 * i) % 80 + 3 for i in range(40)], [(5 * i) % 80 + 3 for i in range(36)]]  # two long prompts opening at once


class SmallChunks(Engine):
    """The test's engine: 4-token prefill chunks, so a 40-token prompt is ten of them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, prefill_chunk=CHUNK, **kwargs)


def _record(monkeypatch) -> list:
    """The engine thread's order of work: ("chunk", its prompt's length) for each chunk of a long
    prompt in a prefill forward of its own (slowed, so that steps queue behind it), ("step", rows)
    for each step and ("step+chunk", its prompt's length) for each such chunk a step takes in."""
    events = []
    ingest, step = SmallChunks._ingest, SmallChunks.step

    def slow_ingest(self, live, chunks):
        for opening in live:  # one a forward on the CPU reference
            if len(opening.prompt) > CHUNK:  # a long prompt's opening
                time.sleep(0.05)  # a chunk that takes a while: steps queue behind it
                events.append(("chunk", len(opening.prompt)))
        return ingest(self, live, chunks)

    def logged_step(self, requests, openings=(), piece=None):
        events.append(("step", len(requests)))
        events.extend(("step+chunk", len(o.prompt)) for o in openings if isinstance(o, Opening) and o.logits is None)
        return step(self, requests, openings, piece)

    monkeypatch.setattr(SmallChunks, "_ingest", slow_ingest)
    monkeypatch.setattr(SmallChunks, "step", logged_step)
    return events


def _keep_stepping(stub, stop: threading.Event, tokens: list | None = None) -> threading.Thread:
    """A session opened now and stepped by a thread until `stop` is set (or it finishes) -> the
    thread, started. tokens: where its tokens go (the first included)."""
    runner = stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=[9, 8, 7], max_new_tokens=80))
    if tokens is not None:
        tokens.append(runner.first_token)

    def keep_stepping():
        position = runner.position
        while not stop.is_set():
            (result,) = stub.Verify(rpc.VerifyRequest(steps=[rpc.VerifyStep(session_id=runner.session_id,
                                                                           expected_position=position)])).results
            assert result.status.code == 0, result.status.message
            if tokens is not None:
                tokens.extend(result.tokens)
            position = result.position
            if result.finish_reason != rpc.FINISH_NONE:
                return

    thread = threading.Thread(target=keep_stepping)
    thread.start()
    return thread


def test_steps_run_between_a_long_prompts_chunks(text_checkpoint, plain, monkeypatch):
    events = _record(monkeypatch)
    prompt = [(7 * i) % 80 + 3 for i in range(40)]
    with LoopbackServer(text_checkpoint, engine_class=SmallChunks, n_slots=2, max_seq_len=96, max_wait_ms=0) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            stop = threading.Event()
            thread = _keep_stepping(stub, stop)
            time.sleep(0.1)
            opened = stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=prompt, max_new_tokens=6))
            stop.set()
            thread.join(timeout=30)
            tokens, position = [opened.first_token], opened.position
            while True:
                (result,) = stub.Verify(rpc.VerifyRequest(steps=[rpc.VerifyStep(session_id=opened.session_id,
                                                                               expected_position=position)])).results
                tokens += result.tokens
                position = result.position
                if result.finish_reason != rpc.FINISH_NONE:
                    break
    assert tokens == list(plain(prompt, 6).tokens)
    chunks = [i for i, (kind, _) in enumerate(events) if kind == "chunk"]
    assert len(chunks) == len(prompt) // CHUNK
    between = [kind for kind, _ in events[chunks[0] : chunks[-1]] if kind == "step"]
    assert len(between) >= len(chunks) // 3, f"steps between the chunks: {len(between)} ({events})"


def _open_two_while_stepping(text_checkpoint, **config) -> dict:
    """Two long prompts opening at once while a session steps -> {i: OpenSessionResponse}."""
    opened = {}
    with LoopbackServer(text_checkpoint, engine_class=SmallChunks, n_slots=3, max_seq_len=96, max_wait_ms=0, **config) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            done = threading.Event()

            def open_one(i):
                opened[i] = stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=PROMPTS[i], max_new_tokens=1))

            stepping = _keep_stepping(stub, done)
            time.sleep(0.1)
            openers = [threading.Thread(target=open_one, args=(i,)) for i in range(2)]
            for thread in openers:
                thread.start()
            for thread in openers:
                thread.join(timeout=60)
            done.set()
            stepping.join(timeout=30)
    return opened


def test_a_turn_of_one_chunk_lets_the_opens_take_turns_a_chunk_at_a_time(text_checkpoint, plain, monkeypatch):
    """With a turn of one chunk's rows, one chunk runs between two of the stepping session's steps
    (the opens take turns), not one chunk of each, and both first tokens are plain decoding's."""
    events = _record(monkeypatch)
    opened = _open_two_while_stepping(text_checkpoint, prefill_rows=CHUNK)
    for i, prompt in enumerate(PROMPTS):
        assert opened[i].first_token == plain(prompt, 1).tokens[0]
    kinds = [kind for kind, _ in events]
    first, last = kinds.index("chunk"), len(kinds) - 1 - kinds[::-1].index("chunk")
    window = kinds[first : last + 1]
    assert window.count("chunk") == 40 // CHUNK + 36 // CHUNK
    back_to_back = sum(1 for a, b in zip(window, window[1:]) if a == b == "chunk")
    assert back_to_back <= 4, f"chunks with no step between them: {back_to_back} ({window})"


def test_prompts_arriving_together_share_their_turns(text_checkpoint, plain, monkeypatch):
    """With the default budget (many chunks' rows) the two opens' chunks share jobs: one job holds
    the next chunk of each while both are waiting (one forward on the Triton backend), steps still
    run between the jobs, and both first tokens are plain decoding's."""
    events = _record(monkeypatch)
    jobs = []
    advance_openings = SmallChunks.advance_openings

    def logged(self, openings):
        jobs.append(sum(1 for o in openings if o.logits is None))
        return advance_openings(self, openings)

    monkeypatch.setattr(SmallChunks, "advance_openings", logged)
    opened = _open_two_while_stepping(text_checkpoint)
    for i, prompt in enumerate(PROMPTS):
        assert opened[i].first_token == plain(prompt, 1).tokens[0]
    long_jobs = [n for n in jobs if n == 2]
    assert len(long_jobs) >= 36 // CHUNK - 2, f"jobs holding both prompts' chunks: {jobs}"
    kinds = [kind for kind, _ in events]
    first, last = kinds.index("chunk"), len(kinds) - 1 - kinds[::-1].index("chunk")
    assert "step" in kinds[first : last + 1], f"no step between the turns: {kinds}"


def test_steps_take_the_waiting_prompts_in(text_checkpoint, plain, monkeypatch):
    """With step_prompt_rows, the stepping session's batches take the long prompt's chunks into
    their steps (DESIGN.md section 9, "Prompts inside a step"): a chunk a step here (one chunk's
    rows), and both streams are plain decoding's."""
    events = _record(monkeypatch)
    prompt, running = PROMPTS[0], []
    with LoopbackServer(text_checkpoint, engine_class=SmallChunks, n_slots=2, max_seq_len=96, max_wait_ms=200,
                        step_prompt_rows=CHUNK) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            stop = threading.Event()
            thread = _keep_stepping(stub, stop, running)
            time.sleep(0.1)
            opened = stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=prompt, max_new_tokens=1))
            stop.set()
            thread.join(timeout=30)
        text = server.run_on_loop(lambda: generate_latest(server.server.metrics.registry).decode())
    assert opened.first_token == plain(prompt, 1).tokens[0]
    assert running == list(plain([9, 8, 7], len(running)).tokens)
    inside = [n for kind, n in events if kind == "step+chunk"]
    alone = [n for kind, n in events if kind == "chunk"]
    assert len(inside) + len(alone) == len(prompt) // CHUNK
    # the metrics count where the prompts' rows ran (the stepping session's 3-token open: a turn, no batch running)
    assert f'verifier_prompt_rows_total{{where="step"}} {CHUNK * len(inside)}.0' in text
    assert f'verifier_prompt_rows_total{{where="turn"}} {3 + CHUNK * len(alone)}.0' in text
    assert len(inside) >= len(prompt) // CHUNK - 2, f"chunks inside steps: {len(inside)} ({events})"
    per_step = [0]  # chunks each step took in: its budget holds one
    for kind, _ in events:
        if kind == "step":
            per_step.append(0)
        elif kind == "step+chunk":
            per_step[-1] += 1
    assert max(per_step) == 1, f"a step took more chunks than its budget holds: {events}"


class FailsWithPrompts(SmallChunks):
    """An engine whose first step that takes prompts in fails in its verify (a device fault): the
    engine's own handling then aborts the openings (their slots released) and loses the sequences."""

    failed = False

    def _verify_accept_rollback(self, requests, sequences, step):
        if step.prompts is not None and not FailsWithPrompts.failed:
            FailsWithPrompts.failed = True
            raise RuntimeError("the device fell over")
        return super()._verify_accept_rollback(requests, sequences, step)


def test_a_failed_step_with_prompts_fails_its_open_and_the_server_goes_on(text_checkpoint, plain):
    """The step that took a prompt in fails: the open fails (not hangs), the stepping session's
    step is answered INTERNAL, and the server serves the next open (the slots came back), whose
    tokens are plain decoding's."""
    FailsWithPrompts.failed = False
    prompt = PROMPTS[1]
    with LoopbackServer(text_checkpoint, engine_class=FailsWithPrompts, n_slots=2, max_seq_len=96, max_wait_ms=200,
                        step_prompt_rows=CHUNK) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            runner = stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=[9, 8, 7], max_new_tokens=80))
            codes = []

            def keep_stepping():
                position = runner.position
                while True:
                    (result,) = stub.Verify(rpc.VerifyRequest(steps=[rpc.VerifyStep(session_id=runner.session_id,
                                                                                   expected_position=position)])).results
                    codes.append(result.status.code)
                    if result.status.code != 0:
                        return
                    position = result.position

            thread = threading.Thread(target=keep_stepping)
            thread.start()
            time.sleep(0.1)
            with pytest.raises(grpc.RpcError) as failed:
                stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=prompt, max_new_tokens=1), timeout=60)
            thread.join(timeout=30)
            assert FailsWithPrompts.failed and failed.value.code() != grpc.StatusCode.OK
            assert codes[-1] == grpc.StatusCode.INTERNAL.value[0]
            stub.CloseSession(rpc.CloseSessionRequest(session_id=runner.session_id))
            again = stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=prompt, max_new_tokens=1), timeout=60)
    assert again.first_token == plain(prompt, 1).tokens[0]


def test_a_negative_step_prompt_budget_is_refused_by_name(text_checkpoint):
    from verifier.server.config import ServerConfig

    with pytest.raises(ValueError, match="step_prompt_rows must be >= 0, got -1"):
        ServerConfig(text_checkpoint, port=0, step_prompt_rows=-1)


def test_a_turn_of_no_rows_is_refused_by_name(text_checkpoint):
    from verifier.server.config import ServerConfig

    with pytest.raises(ValueError, match="prefill_rows must be at least 1, got 0"):
        ServerConfig(text_checkpoint, port=0, prefill_rows=0)
