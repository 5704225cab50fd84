"""run_parallel: start N processes, one rank each, run the same function in all of them (SPMD),
and hand back rank 0's result; a rank that fails becomes an error in the caller, never a hang.
The design in full: DESIGN.md section 10, "Launching ranks".
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from typing import Any, Callable

from .group import TensorParallel

_DONE, _FAILED = "done", "failed"
_POLL_S = 0.05
_SETTLE_S = 1.0  # how long the other ranks get to report once one has failed or gone
_GRACE_S = 10.0  # how long a rank that reported may take to exit before it is ended


class ParallelError(RuntimeError):
    """A rank of run_parallel failed (or the run timed out). rank: the rank (None: the run as a
    whole); original: the rank's exception where it could be brought back (None otherwise);
    detail: the rank's traceback."""

    def __init__(self, message: str, rank: int | None = None, original: BaseException | None = None, detail: str = ""):
        super().__init__(message)
        self.rank, self.original, self.detail = rank, original, detail


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_parallel(fn: Callable[..., Any], size: int, *args, backend: str = "gloo", timeout_s: float | None = None,
                 collective_timeout_s: float = 300.0, threads: int | None = None) -> Any:
    """fn(TensorParallel(rank, size, group), *args) in `size` spawned processes -> rank 0's return
    value. backend: "gloo" (CPU tensors) or "nccl" (CUDA: rank r on cuda:r). threads: torch's CPU
    threads per rank (None: as OMP_NUM_THREADS says, else the cores shared out among the ranks).
    Raises ParallelError when a rank fails, dies, or the run passes timeout_s."""
    if size < 1:
        raise ValueError(f"run_parallel: size must be at least 1, got {size}")
    if threads is None and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // size)
    context = multiprocessing.get_context("spawn")
    reports = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank_main, name=f"tensor-parallel rank {rank}", daemon=True,
                                 args=(fn, args, rank, size, port, backend, collective_timeout_s, threads, reports))
                 for rank in range(size)]
    for process in processes:
        process.start()
    try:
        value = _collect(processes, reports, timeout_s)
    except BaseException:
        _end(processes, grace_s=0.0)  # the others may wait in a collective for the rank that failed
        raise
    _end(processes, grace_s=_GRACE_S)
    return value


def _collect(processes: list, reports, timeout_s: float | None) -> Any:
    """Rank 0's value once every rank has reported done; ParallelError at the first failure."""
    size = len(processes)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    done: dict[int, Any] = {}
    failed: dict[int, tuple] = {}  # rank -> its failure report, in the order they came
    while len(done) < size:
        _drain(reports, done, failed, _POLL_S)
        if not failed and _silent_exits(processes, done, failed):
            _drain(reports, done, failed, _POLL_S)  # a report written just before its process ended
        if failed or _silent_exits(processes, done, failed):
            error = _cause(processes, reports, done, failed)
            if error is not None:
                raise error
        if deadline is not None and time.monotonic() > deadline:
            waiting = [r for r in range(size) if r not in done]
            raise ParallelError(f"tensor-parallel run of {size} ranks passed its {timeout_s:g} s limit; ranks {waiting} "
                                "had not finished")
    return pickle.loads(done[0])


def _drain(reports, done: dict, failed: dict, wait_s: float) -> None:
    """Every report in the queue now (waiting up to wait_s for the first) into done / failed."""
    timeout = wait_s
    while True:
        try:
            rank, status, payload = reports.get(timeout=timeout)
        except queue_module.Empty:
            return
        (failed if status == _FAILED else done)[rank] = payload
        timeout = 0.001


def _silent_exits(processes: list, done: dict, failed: dict) -> list[int]:
    """Ranks whose process has ended without a report (killed, crashed)."""
    return [rank for rank, process in enumerate(processes)
            if process.exitcode is not None and rank not in done and rank not in failed]


def _cause(processes: list, reports, done: dict, failed: dict) -> ParallelError | None:
    """The error to raise once a rank has failed or gone. One failure brings on others (a peer's
    collective breaks when a rank leaves), so the ranks get a moment to settle, then the cause is
    named: a rank that ended without a report (a crash its peers' errors follow), else the first
    failure reported; None when the settling found every report (nothing failed)."""
    size = len(processes)
    settle = time.monotonic() + _SETTLE_S
    while time.monotonic() < settle:  # a report sent just before its process ended is read too
        _drain(reports, done, failed, _POLL_S)
    others = "".join(f"\nrank {rank}: {payload[1]}" for rank, payload in failed.items())
    silent = _silent_exits(processes, done, failed)
    if silent:
        rank = silent[0]
        return ParallelError(f"rank {rank} of {size} exited (code {processes[rank].exitcode}) without reporting a result",
                             rank, detail=f"other ranks' failures:{others}" if others else "")
    if not failed:
        return None
    rank = next(iter(failed))
    return _failure(rank, size, failed[rank])


def _failure(rank: int, size: int, payload: tuple[bytes | None, str, str]) -> ParallelError:
    pickled, summary, detail = payload
    original = None
    if pickled is not None:
        try:
            original = pickle.loads(pickled)
        except Exception:  # an exception type the caller cannot rebuild: the summary says it
            original = None
    return ParallelError(f"rank {rank} of {size} failed: {summary}", rank, original, detail)


def _end(processes: list, grace_s: float) -> None:
    """Every rank's process gone: those still running after grace_s are terminated, then killed."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5.0)
        if process.is_alive():
            process.kill()
            process.join(timeout=5.0)


def _rank_main(fn, args, rank: int, size: int, port: int, backend: str, collective_timeout_s: float, threads: int | None,
               reports) -> None:
    """One rank's process: join the group, run fn, report (rank 0's value pickled by value)."""
    import torch
    import torch.distributed as dist

    try:
        if threads is not None:
            torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        value = fn(TensorParallel(rank, size, dist.group.WORLD), *args)
        reports.put((rank, _DONE, pickle.dumps(value) if rank == 0 else None))
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the caller
        try:
            pickled = pickle.dumps(exc)
        except Exception:
            pickled = None
        summary = f"{type(exc).__name__}: {exc}"
        reports.put((rank, _FAILED, (pickled, summary, "".join(traceback.format_exception(exc)))))
        # the report in the pipe before the group closes: a peer that then fails in a collective
        # reports after it, so the caller names this rank's failure, the cause
        reports.close()
        reports.join_thread()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
