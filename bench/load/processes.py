"""The drafter processes of a run (drafters.py): started over contiguous shares of the sessions (so
each process holds every drafter and sampling kind of workload.py), their timed parts started
together when there is a warm-up, and what each did collected."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from . import workload
from .server import REPO

# a session stops at the deadline after its step in flight; past that plus this margin, it hangs
HANG_MARGIN_S = 180.0


def shares(sessions: int, processes: int) -> list[list[int]]:
    return [list(range(p * sessions // processes, (p + 1) * sessions // processes)) for p in range(processes)]


def run_drafters(address: str, plan: workload.Plan, session_shares: list[list[int]], transport: str, deadline: float,
                 scratch: Path, *, references: dict[int, list[int]] | None = None, warmup_rounds: int = 0,
                 at_start: Callable[[], None] | None = None) -> list[dict]:
    """One drafter process per share, until done or the deadline. With `warmup_rounds` (fleet only),
    every process runs that many rounds and waits; `at_start()` then runs (a stats snapshot) and
    every process's timed part starts at once."""
    procs = []
    for p, share in enumerate(session_shares):
        cfg, out, err = (scratch / f"drafter{p}.{suffix}" for suffix in ("json", "out.json", "err.txt"))
        cfg.write_text(json.dumps({"address": address, "plan": plan.to_json(), "sessions": share, "deadline": deadline,
                                   "transport": transport, "warmup_rounds": warmup_rounds,
                                   "references": {str(s): references[s] for s in share} if references else {}}))
        pipe = subprocess.PIPE if warmup_rounds else None
        # stderr to a file: a chatty process can never block on a full pipe while we wait for its line
        with open(err, "w") as stderr:
            procs.append((subprocess.Popen([sys.executable, "-m", "bench.load.drafters", str(cfg), str(out)], cwd=REPO,
                                           stdin=pipe, stdout=pipe, stderr=stderr, text=True), out, err, share))
    if warmup_rounds:
        for proc, *_ in procs:
            proc.stdout.readline()  # "ready", or "" from a process that died: it is reported below
        if at_start is not None:
            at_start()
        for proc, *_ in procs:
            try:
                proc.stdin.write("go\n")
                proc.stdin.flush()
            except BrokenPipeError:
                pass
    return [_collect(proc, out, err, share, deadline) for proc, out, err, share in procs]


def _collect(proc: subprocess.Popen, out: Path, err: Path, share: list[int], deadline: float) -> dict:
    try:
        proc.communicate(timeout=max(1.0, deadline - time.time()) + HANG_MARGIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
    if proc.returncode == 0 and out.is_file():
        return json.loads(out.read_text())
    # the process died: its sessions count as errors, and its stderr says why
    print(f"drafter process {proc.pid} exited {proc.returncode}:\n{err.read_text()[-2000:]}", file=sys.stderr)
    now = time.time()
    return {"sessions": share, "started": now, "ended": now, "steps": 0, "tokens": 0, "opens": 0, "rounds": 0,
            "latencies_ms": [], "errors": {"drafter_process_died": len(share)}, "cut_by_deadline": 0, "generations": []}
