"""`python -m verifier serve --tensor-parallel N`: the served model split over N ranks (SPMD).

This process checks the config against config.json (no weights read here), then starts N ranks
(verifier/model/parallel/launch.py). Every rank loads its shards. Rank 0 runs the whole service
(gRPC, scheduler, worker) over a MirroredEngine; ranks 1 .. N-1 follow its engine calls
(verifier/server/mirror.py). When the service has stopped, rank 0 tells the followers to stop
and every rank returns.

Signals: the ranks leave this process's process group, so a Ctrl-C at the terminal reaches this
process alone; it sends rank 0 a SIGINT for every SIGTERM or SIGINT it gets, and rank 0 stops as
a one-process server does (drain, grace; a second signal stops at once). SIGTERM is left to the
launcher, which ends a rank with it at once. A rank that fails or dies ends every rank
(run_parallel) and this process reports it, naming the rank; the ranks also die with this process
should it be killed outright (Linux: the parent-death signal), so no rank outlives the server.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import os
import signal
import sys

from ..model import load_config
from ..model.parallel import ParallelError, TensorParallel, local_config, run_parallel
from .app import STOP_SIGNALS, VerifierServer, serve_until_signalled, build_engine
from .config import ServerConfig
from .mirror import Channel, MirroredEngine, follow

_RANK_0 = "tensor-parallel rank 0"  # the name run_parallel gives rank 0's process
_PR_SET_PDEATHSIG = 1


def serve_tensor_parallel(config: ServerConfig) -> int:
    """Serve over config.tensor_parallel ranks until SIGTERM / SIGINT: 0 after a clean shutdown,
    2 for a config the checkpoint cannot split or a port in use (the ValueError / OSError a
    one-process server reports), 1 when a rank fails; 130 after a second signal."""
    size = config.tensor_parallel
    local_config(load_config(config.model_dir), size)  # heads that do not divide by N: named before any rank starts
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    signalled: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, _: _forward(signalled, signum)) for signum in STOP_SIGNALS}
    try:
        return run_parallel(_serve_on_rank, size, config, backend=backend)
    except ParallelError as err:
        if len(signalled) >= 2:  # rank 0 stopped at once, as asked (it said so)
            return 130
        if isinstance(err.original, (ValueError, OSError)):  # what a one-process server reports with exit status 2
            kind = OSError if isinstance(err.original, OSError) else ValueError
            raise kind(f"{err.original} (rank {err.rank} of {size})") from None
        if err.detail:
            print(err.detail, file=sys.stderr)
        print(f"error: the server stopped: {err}", file=sys.stderr, flush=True)
        return 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _forward(signalled: list[int], signum: int) -> None:
    """A stop signal for the server: rank 0 gets a SIGINT (see the module docstring)."""
    signalled.append(signum)
    for child in multiprocessing.active_children():
        if child.name == _RANK_0 and child.pid is not None:
            os.kill(child.pid, signal.SIGINT)


def _serve_on_rank(parallel: TensorParallel, config: ServerConfig) -> int:
    """One rank: rank 0 serves until its SIGINT, the others follow it until it stops them."""
    _detach()
    if parallel.rank != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 alone decides when the ranks stop
    channel = Channel(parallel)  # collective: every rank makes it here, before the engines
    if parallel.rank != 0:
        follow(channel, build_engine(config, parallel=parallel))
        return 0
    engine = build_engine(config, lambda *args, **kwargs: MirroredEngine(channel, *args, **kwargs), parallel)
    asyncio.run(serve_until_signalled(VerifierServer(config, engine), signals=(signal.SIGINT,)))
    engine.stop_followers()  # the worker has stopped: no engine call comes after this
    return 0


def _detach() -> None:
    """Out of the launching process's process group (a terminal's Ctrl-C is for it to pass on),
    and, on Linux, killed should the launching process die without ending this one."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the launcher still ends every rank when one fails
        return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the signal was asked for
        os._exit(1)
