"""Where a round goes on the server: timestamps per engine batch and per answered request, kept
when the server is started with --round-timings FILE and written to FILE when it stops (bench.serve
turns it on; off, nothing here runs).
The design in full: DESIGN.md section 9, "Round timings".
"""

from __future__ import annotations

import json
import time
from array import array
from hashlib import blake2b
from pathlib import Path

BATCH_FIELDS = ("first_arrival", "last_arrival", "engine_start", "engine_end", "last_written")
REQUEST_FIELDS = ("batch", "arrival", "written", "key")
LAST_WRITTEN = BATCH_FIELDS.index("last_written")
MAX_BATCHES = 1 << 20
MAX_REQUESTS = 1 << 22


def request_key(request_id: str) -> int:
    """A request's key in the timings file: its first step's request id as a signed 64-bit integer
    (the first 8 bytes of its BLAKE2b digest); 0 for no request id. The drafter, which knows the
    ids it sent, finds its requests by it."""
    if not request_id:
        return 0
    return int.from_bytes(blake2b(request_id.encode(), digest_size=8).digest(), "big", signed=True)


class RoundTimings:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.batches = array("d")  # len(BATCH_FIELDS) values per batch, batch i (1-based) at (i - 1) * 5
        self.requests = array("d")  # batch, arrival, written per request
        self.keys = array("q")  # per request: request_key of its first step's request id
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
        if len(self.keys) >= MAX_REQUESTS:
            self.dropped_requests += 1
            return
        self.requests.extend((batch, min(t.arrived for t in tickets if t.batch > 0), now))
        self.keys.append(request_key(tickets[0].request_id))

    def to_json(self) -> dict:
        b, r = len(BATCH_FIELDS), len(REQUEST_FIELDS) - 1  # the key is kept apart
        return {"clock": "time.perf_counter() of the server process, seconds",
                "batch_fields": list(BATCH_FIELDS), "request_fields": list(REQUEST_FIELDS),
                "batches": [list(self.batches[i:i + b]) for i in range(0, len(self.batches), b)],  # batch 1 first
                "requests": [[int(self.requests[i]), *self.requests[i + 1:i + r], key]
                             for i, key in zip(range(0, len(self.requests), r), self.keys)],
                "dropped_batches": self.dropped_batches, "dropped_requests": self.dropped_requests}

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.to_json()) + "\n")
