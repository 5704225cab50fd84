"""Where a round goes on the server: timestamps per engine batch and per answered request, kept
when the server is started with --round-timings FILE and written to FILE when it stops (bench.serve
turns it on; off, nothing here runs).

All times are this process's time.perf_counter(): only intervals within the server are meaningful,
never a comparison with another process's clock (bench/serve_breakdown.py derives the wire time
from the drafter's own round time minus the server's residence).

Per batch (its index is the verifier_engine_steps count once the batch is recorded, so GetStats'
engine_steps before and after a run select its batches): the first and last arrival of its steps'
requests (taken in the handler once gRPC has parsed the request), the engine step's start and end
on the engine thread (the ids on the host), and when the last answer holding one of its steps was
written to gRPC. Per request (a VerifyRounds message, a Verify call, a VerifyStream step): the
batch that answered its last step, its arrival and when its answer was written (a stream: once
gRPC took the message; a Verify call: when the handler returns it).

Storage is bounded (array('d') appends up to MAX_BATCHES and MAX_REQUESTS; later ones are counted
as dropped), so a long-lived server with the switch on grows by at most a known amount.
"""

from __future__ import annotations

import json
import time
from array import array
from pathlib import Path

BATCH_FIELDS = ("first_arrival", "last_arrival", "engine_start", "engine_end", "last_written")
REQUEST_FIELDS = ("batch", "arrival", "written")
LAST_WRITTEN = BATCH_FIELDS.index("last_written")
MAX_BATCHES = 1 << 20
MAX_REQUESTS = 1 << 22


class RoundTimings:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.batches = array("d")  # len(BATCH_FIELDS) values per batch, batch i (1-based) at (i - 1) * 5
        self.requests = array("d")  # len(REQUEST_FIELDS) values per request
        self.recorded = 0  # batches recorded: the index of the last one (engine_steps)
        self.dropped_batches = self.dropped_requests = 0

    def batch(self, steps, engine_start: float, engine_end: float) -> None:
        """An engine batch with OK steps (`steps`: its PendingSteps) ran; call where engine_steps moves."""
        self.recorded += 1
        if self.recorded > MAX_BATCHES:
            self.dropped_batches += 1
            return
        arrivals = [p.arrived for p in steps]
        for p in steps:
            p.batch = self.recorded
        self.batches.extend((min(arrivals), max(arrivals), engine_start, engine_end, engine_end))

    def written(self, answer) -> None:
        """An answer went to gRPC: a PendingStep or a RequestAnswer (its `tickets`)."""
        now = time.perf_counter()
        tickets = getattr(answer, "tickets", None) or (answer,)
        batch = max(t.batch for t in tickets)
        if batch <= 0:  # answered without the engine (a request error, a stored result)
            return
        at = (batch - 1) * len(BATCH_FIELDS) + LAST_WRITTEN
        if now > self.batches[at]:
            self.batches[at] = now
        if len(self.requests) >= MAX_REQUESTS * len(REQUEST_FIELDS):
            self.dropped_requests += 1
            return
        self.requests.extend((batch, min(t.arrived for t in tickets if t.batch > 0), now))

    def to_json(self) -> dict:
        b, r = len(BATCH_FIELDS), len(REQUEST_FIELDS)
        return {"clock": "time.perf_counter() of the server process, seconds",
                "batch_fields": list(BATCH_FIELDS), "request_fields": list(REQUEST_FIELDS),
                "batches": [list(self.batches[i:i + b]) for i in range(0, len(self.batches), b)],  # batch 1 first
                "requests": [[int(self.requests[i]), *self.requests[i + 1:i + r]] for i in range(0, len(self.requests), r)],
                "dropped_batches": self.dropped_batches, "dropped_requests": self.dropped_requests}

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.to_json()) + "\n")
