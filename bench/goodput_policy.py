"""The goodput policy's host cost per batch: trim and observe_batch, by sessions per batch and K.

    python -m bench.goodput_policy [--out DIR] [--calls 5000]

Both run once per engine batch on the server's hot path (verifier/server/goodput.py), one path
for every batch size. A policy is warmed with 50 rounds, then `--calls` trims and as many
observations are timed (best of 5 runs: the figures are per-call floors of a host-bound loop).
Writes DIR/goodput_policy_<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import time
from pathlib import Path

import numpy as np
import torch

from bench.machine import device_name
from verifier.server.goodput import GoodputPolicy, StepCost

RESULTS = Path(__file__).resolve().parent / "results"
COST = StepCost({1: 4e-4, 2: 4.1e-4, 4: 4.3e-4, 8: 4.6e-4, 16: 5e-4, 64: 1.2e-3, 576: 6e-3})
SHAPES = [(1, 4), (1, 8), (2, 4), (2, 8), (3, 8), (4, 8), (64, 4)]  # (sessions per batch, K)
MAX_K = 8


def per_call_us(sessions: int, k: int, calls: int) -> dict[str, float]:
    """Per-call microseconds of trim and observe_batch for batches of `sessions` sessions asking K drafts."""
    rng = random.Random(0)
    policy = GoodputPolicy(MAX_K, COST)
    policy.observe_turnaround(1e-3)
    ids, requested = [f"s{i}" for i in range(sessions)], [k] * sessions
    accepted = [min(k, rng.randint(0, k)) for _ in range(sessions)]
    for _ in range(50):
        verified = policy.trim(ids, requested)
        policy.observe_batch(ids, requested, verified, [min(a, v) for a, v in zip(accepted, verified)])
    best_trim = best_observe = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            verified = policy.trim(ids, requested)
        middle = time.perf_counter()
        kept = [min(a, v) for a, v in zip(accepted, verified)]
        for _ in range(calls):
            policy.observe_batch(ids, requested, verified, kept)
        end = time.perf_counter()
        best_trim, best_observe = min(best_trim, middle - start), min(best_observe, end - middle)
    return {"trim_us": round(best_trim / calls * 1e6, 2), "observe_us": round(best_observe / calls * 1e6, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--calls", type=int, default=5000, help="timed calls of each per run")
    args = parser.parse_args(argv)
    figures = {}
    for sessions, k in SHAPES:
        figures[f"{sessions}_sessions_k{k}"] = row = per_call_us(sessions, k, args.calls)
        print(f"{sessions} sessions, K = {k}: {row}", flush=True)
    date = datetime.date.today().isoformat()
    report = {"device": device_name("cpu"), "date": date, "python": platform.python_version(), "numpy": np.__version__,
              "torch": torch.__version__, "max_k": MAX_K, "calls": args.calls,
              "microseconds_per_call": figures}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"goodput_policy_{date}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
