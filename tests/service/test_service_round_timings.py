"""--round-timings: the server's timestamps of each engine batch and answered request (verifier/server/
timings.py), off by default, written when the server stops, in the order a round takes."""

from __future__ import annotations

import json

import grpc

from verifier import rpc
from verifier.server.testing import LoopbackServer
from verifier.server.timings import request_key

from .helpers import open_session, step


def test_timings_are_off_by_default(text_checkpoint):
    with LoopbackServer(text_checkpoint) as server:
        service = server.server.service
        assert service.timings is None and service.scheduler.timings is None


def test_each_batch_and_request_is_timed_in_order_and_written_at_stop(text_checkpoint, tmp_path):
    path = tmp_path / "timings.json"
    with LoopbackServer(text_checkpoint, round_timings=path) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            opened = [open_session(stub, [5, 6, 7], max_new_tokens=8) for _ in range(2)]
            # one batch; each request is keyed by its first step's request id (none: key 0)
            stub.Verify(rpc.VerifyRequest(steps=[step(o.session_id, o.position, request_id=f"v-{i}") for i, o in enumerate(opened)]))
            rounds = iter([rpc.VerifyRequest(steps=[step(o.session_id, o.position + 1, request_id=f"r-{i}") for i, o in enumerate(opened)]),
                           rpc.VerifyRequest(steps=[step(opened[0].session_id, opened[0].position + 2)])])
            sent_ids = ["v-0", "r-0", ""]
            assert all(r.status.code == 0 for response in stub.VerifyRounds(rounds) for r in response.results)
            stub.Verify(rpc.VerifyRequest(steps=[step("no-such-session", 0)]))  # answered without the engine: not timed
            batches = stub.GetStats(rpc.GetStatsRequest()).engine_steps
        assert not path.exists()  # written when the server stops
    timings = json.loads(path.read_text())
    assert len(timings["batches"]) == batches >= 2 and timings["dropped_batches"] == timings["dropped_requests"] == 0
    for first, last, start, end, written in timings["batches"]:
        assert first <= last <= start <= end <= written
    assert len(timings["requests"]) == 3  # the Verify call and the two VerifyRounds messages
    assert timings["request_fields"] == ["batch", "arrival", "written", "key"]
    for batch, arrival, written, _ in timings["requests"]:
        first, _, start, end, last_written = timings["batches"][batch - 1]
        assert first <= arrival <= start and end <= written <= last_written
    # each request by its first step's request id, as the drafter that sent it can name it
    assert [key for *_, key in timings["requests"]] == [request_key(r) for r in sent_ids]
    assert request_key("") == 0 and request_key("v-0") != 0
