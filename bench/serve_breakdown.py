"""Where a round of bench.serve goes, from timestamps, not inferred: the server's per-batch and
per-request timestamps (`python -m verifier serve --round-timings FILE`, verifier/server/timings.py)
and each drafter process's own record of its timed rounds (bench/load/drafters.py: the sums of
request = send to answer, proposing, and the timed part's whole time; and each round's request,
by its first step's request id, with its request time).
How it measures, what it checks and writes: bench/README.md, Methods, `bench.serve_breakdown`.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

from verifier.server.timings import request_key

PARTS = ("engine", "server_in", "server_out", "wire", "drafter", "unexplained")


def load(path: Path) -> dict | None:
    """A server's --round-timings file; None when the server did not write one (it did not stop cleanly)."""
    return json.loads(path.read_text()) if path.is_file() else None


def window(timings: dict, first: int, last: int) -> tuple[dict[int, dict], list[dict]]:
    """The batches first..last (1-based engine_steps indices, both ends included) and the requests
    they answered, as dicts by field name."""
    fields, request_fields = timings["batch_fields"], timings["request_fields"]
    rows = timings["batches"]
    batches = {i: dict(zip(fields, rows[i - 1])) for i in range(max(first, 1), min(last, len(rows)) + 1)}
    requests = [r for r in (dict(zip(request_fields, row)) for row in timings["requests"]) if r["batch"] in batches]
    return batches, requests


def drafter_sums(workers: list[dict]) -> dict:
    """The drafter processes' timed rounds, summed: rounds, request, proposing and timed seconds, and
    over the timed parts the processes' CPU seconds and collector pauses (None where a process did
    not record them)."""
    sums = {"rounds": 0, "request": 0.0, "proposing": 0.0, "timed": 0.0, "cpu": 0.0, "gc": 0.0}
    for w in workers:
        seconds = w.get("round_seconds")
        if not w.get("rounds") or seconds is None:
            continue
        sums["rounds"] += w["rounds"]
        for key in ("request", "proposing", "timed"):
            sums[key] += seconds[key]
        for key in ("cpu", "gc"):
            sums[key] = None if sums[key] is None or key not in seconds else sums[key] + seconds[key]
    return sums


def drafter_requests(workers: list[dict]) -> dict[int, float]:
    """The drafter processes' timed rounds' requests: their key (the server's, request_key of the
    first step's request id) -> the request's seconds, send to answer on the drafter's clock."""
    return {request_key(request_id): seconds for w in workers for request_id, seconds in w.get("round_requests") or ()}


def paired(requests: list[dict], drafted: dict[int, float]) -> list[tuple[float, float]]:
    """(the drafter's request seconds, the server's residence seconds) of each request on both sides.
    A key the server wrote more than once in the window (a request resent under its ids) is left out:
    which of its records the drafter's time holds is not known."""
    keys = [r.get("key", 0) for r in requests]
    once = {key for key, n in Counter(keys).items() if n == 1}
    return [(drafted[key], r["written"] - r["arrival"]) for key, r in zip(keys, requests)
            if key and key in once and key in drafted]


def breakdown(round_ms: float | None, batches: dict[int, dict], requests: list[dict], drafters: dict,
              drafted: dict[int, float]) -> dict:
    """The run's figures from its batches and requests (window), its drafters' sums (drafter_sums)
    and their requests by key (drafter_requests).
    -> {"added_ms_per_round", "added_ms_per_round_p50", "round_breakdown_ms", "round_detail_ms"};
    each None when a part is missing (no timings, no fleet rounds, no request found on both sides)."""
    none = {"added_ms_per_round": None, "added_ms_per_round_p50": None, "round_breakdown_ms": None, "round_detail_ms": None}
    if round_ms is None or not batches or not requests or not drafters["rounds"]:
        return none
    pairs = paired(requests, drafted)
    if not pairs:
        return none
    ms = 1000.0
    steps = {i: b["engine_end"] - b["engine_start"] for i, b in batches.items()}
    engine = statistics.fmean(steps.values()) * ms
    cycles = [batches[i + 1]["engine_start"] - b["engine_start"] - steps[i] for i, b in batches.items() if i + 1 in batches]
    into = [batches[r["batch"]]["engine_start"] - r["arrival"] for r in requests]
    out = [r["written"] - batches[r["batch"]]["engine_end"] for r in requests]
    # the wire's two sides, over the same requests: each drafter request holds its residence
    request = statistics.fmean(seconds for seconds, _ in pairs) * ms
    residence = statistics.fmean(seconds for _, seconds in pairs) * ms
    wire = statistics.fmean(seconds - resident for seconds, resident in pairs) * ms
    rounds = drafters["rounds"]
    own = (drafters["timed"] - drafters["request"]) * ms / rounds
    proposing = drafters["proposing"] * ms / rounds
    parts = {"engine": _ms(engine), "server_in": _ms(statistics.fmean(into) * ms),
             "server_out": _ms(statistics.fmean(out) * ms), "wire": _ms(wire), "drafter": _ms(own)}
    parts["unexplained"] = _ms(round_ms - sum(parts.values()))
    detail = {
        "drafter_round": _ms(drafters["timed"] * ms / rounds),  # the parts before `unexplained` add up to this
        # over the paired requests: the drafter's request time and the server's residence of it
        "drafter_request": _ms(request), "server_residence": _ms(residence), "paired_requests": len(pairs),
        "proposing": _ms(proposing), "fleet_python": _ms(own - proposing),
        # per drafter round, the process's CPU time (all its threads) and its collector's pauses:
        # a drafter part well above its CPU time was spent waiting, not computing
        "drafter_cpu": None if drafters.get("cpu") is None else _ms(drafters["cpu"] * ms / rounds),
        "drafter_gc": None if drafters.get("gc") is None else _ms(drafters["gc"] * ms / rounds),
        # per batch: its first step's arrival to the engine start (of which the spread of its
        # requests' arrivals: waiting for the last process), and its engine end to its last answer written
        "batch_first_arrival_to_engine": _ms(statistics.fmean(b["engine_start"] - b["first_arrival"] for b in batches.values()) * ms),
        "batch_arrival_spread": _ms(statistics.fmean(b["last_arrival"] - b["first_arrival"] for b in batches.values()) * ms),
        "batch_engine_end_to_last_written": _ms(statistics.fmean(b["last_written"] - b["engine_end"] for b in batches.values()) * ms),
        "batches": len(batches), "requests": len(requests), "drafter_rounds": rounds,
    }
    return {"added_ms_per_round": _ms(round_ms - parts["engine"]),
            "added_ms_per_round_p50": _ms(statistics.median(cycles) * ms) if cycles else None,
            "round_breakdown_ms": {"round": round_ms, **parts}, "round_detail_ms": detail}


def _ms(value: float) -> float:
    return round(value, 3)


def table(runs: dict[str, dict]) -> str:
    """A short table of the runs that have a breakdown: the round and its parts, ms."""
    head = ("run", "round", "added", "added p50", *PARTS[:-1], "unexpl.")
    rows = [head]
    for name, run in runs.items():
        parts = run.get("round_breakdown_ms")
        if parts:
            rows.append((name, parts["round"], run["added_ms_per_round"], run["added_ms_per_round_p50"],
                         *(parts[p] for p in PARTS)))
    if len(rows) == 1:
        return ""
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(str(v).rjust(w) for v, w in zip(row, widths)) for row in rows)
