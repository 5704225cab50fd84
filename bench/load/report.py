"""Figures of a load run and its results file."""

from __future__ import annotations

import datetime
import json
import platform
from collections import Counter
from pathlib import Path

import numpy as np

from bench.machine import results_path
from verifier.generation import mean_acceptance_length

# RSS may move by allocator noise (arenas, grpc buffers) without a leak: a leak under this load
# (thousands of steps, hundreds of sessions) grows far past this.
RSS_TOLERANCE_MIB = 16.0


def step_figures(workers: list[dict]) -> dict:
    latencies = np.array([ms for w in workers for ms in w["latencies_ms"]], dtype=np.float64)
    steps = int(latencies.size)
    tokens = sum(w["tokens"] for w in workers)
    wall_s = max(w["ended"] for w in workers) - min(w["started"] for w in workers) if workers else 0.0
    errors: Counter[str] = Counter()
    for w in workers:
        errors.update(w["errors"])
    return {
        "steps": steps,
        "tokens": tokens,
        "generations": sum(len(w["generations"]) for w in workers),
        # fleet: Verify calls, one per round of a process carrying all its sessions' steps; else 0
        "rounds": sum(w.get("rounds", 0) for w in workers),
        "opens": sum(w["opens"] for w in workers),
        "wall_s": round(wall_s, 3),
        "steps_per_s": round(steps / wall_s, 2) if wall_s > 0 else 0.0,
        "tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
        "tokens_per_step": round(tokens / steps, 3) if steps else 0.0,
        "p50_ms": round(float(np.percentile(latencies, 50)), 3) if steps else None,
        "p99_ms": round(float(np.percentile(latencies, 99)), 3) if steps else None,
        "max_ms": round(float(latencies.max()), 3) if steps else None,
        "errors_by_code": dict(errors),
        "errors": sum(errors.values()),
        "sessions_cut_by_deadline": sum(w["cut_by_deadline"] for w in workers),
        "partial": any(w["cut_by_deadline"] for w in workers),  # the time limit ended the run early
    }


def server_figures(before, after) -> dict:
    """From two GetStats snapshots (drafter.messages.Stats): what the run did on the server."""
    batches = after.engine_steps - before.engine_steps
    counts = [b - a for a, b in zip(before.rows_per_batch.counts, after.rows_per_batch.counts)]
    latency, answered = after.step_latency_ms, after.step_latency_ms.count - before.step_latency_ms.count
    return {
        "engine_batches": batches,
        # where a round goes on the server: the engine step on its thread, and a step's time from
        # its request's arrival to its result (gathering, the step, conversions; not gRPC's own)
        "engine_ms_per_batch": round((after.engine_seconds - before.engine_seconds) * 1000 / batches, 3) if batches else None,
        "server_latency_mean_ms": round((latency.sum - before.step_latency_ms.sum) / answered, 3) if answered else None,
        # the totals are what bound each other: every step's latency holds its batch's engine step
        # and every batch has a step, but the means weigh batches and steps differently
        "engine_ms_total": round((after.engine_seconds - before.engine_seconds) * 1000, 3),
        "server_latency_ms_total": round(latency.sum - before.step_latency_ms.sum, 3),
        "server_steps": after.steps - before.steps,
        "server_errors": after.errors - before.errors,
        "rows_per_batch_mean": round((after.rows - before.rows) / batches, 3) if batches else 0.0,
        "rows_per_batch_histogram": {"upper_bounds": list(after.rows_per_batch.upper_bounds), "counts": counts},
        "mean_acceptance_length": round(mean_acceptance_length(after.accepted_tokens - before.accepted_tokens,
                                                               after.drafts - before.drafts), 3),
        "free_slots_before": before.free_slots,
        "free_slots_after": after.free_slots,
        "open_sessions_after": after.open_sessions,
    }


def versions() -> dict:
    import grpc
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "grpcio": grpc.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out


def write(out_dir: Path, result: dict, name: str = "") -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = results_path(out_dir, "load", result["date"], name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    return path


def today() -> str:
    return datetime.date.today().isoformat()


def summary(result: dict) -> str:
    return (f"load: {result['sessions']} sessions x {result['processes']} processes, {result['steps']} steps "
            f"({result['steps_per_s']} steps/s, {result['tokens_per_s']} tokens/s), p50 {result['p50_ms']} ms, "
            f"p99 {result['p99_ms']} ms, rows/batch {result['rows_per_batch_mean']}, errors {result['errors']}, "
            f"mismatches {result['mismatches']}, free slots {result['free_slots_before']}->{result['free_slots_after']}, "
            f"rss {result['rss_before_mib']}->{result['rss_after_mib']} MiB: {'PASS' if result['ok'] else 'FAIL'}")
