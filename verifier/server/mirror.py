"""The engine calls of a tensor-parallel server, mirrored on every rank.
The design in full: DESIGN.md section 10, "The mirrored engine".
"""

from __future__ import annotations

import datetime
import logging
import statistics
import time

import torch

from ..engine import Engine, Opened, Sequence, StepRequest, StepResult
from ..model.device_scope import device_scope
from ..model.parallel import TensorParallel

log = logging.getLogger(__name__)

# An idle server's followers wait for the next command this long at most (a gloo timeout must be finite)
CONTROL_TIMEOUT = datetime.timedelta(days=3650)
# Eager step-cost timing, as StepRunner.step_costs does it without graphs (every rank is eager
# under tensor parallelism: graphs.graphs_supported): 3 timed steps a bucket after an untimed one,
# smallest buckets first, until this budget has passed
EAGER_REPEATS = 3
COST_BUDGET_S = 0.5

OPEN, STEP, CLOSE, WARM_UP, BUCKET_COST, STOP = "open", "step", "close", "warm_up", "bucket_cost", "stop"


class Diverged(RuntimeError):
    """A follower's state is not rank 0's: running the command would meet rank 0 in another forward."""


class Channel:
    """Rank 0's commands to the other ranks: broadcast_object_list on a gloo group of its own
    (made collectively: every rank constructs its Channel at the same point)."""

    def __init__(self, parallel: TensorParallel):
        import torch.distributed as dist

        self.parallel = parallel
        self.group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    def send(self, command: tuple) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([command], src=0, group=self.group)

    def receive(self) -> tuple:
        import torch.distributed as dist

        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def step_command(requests: list[StepRequest]) -> tuple:
    """A step's requests by slot: the drafts as the engine runs them (draft probabilities on the
    host: the pickle must not name rank 0's device), and rank 0's view of each sequence."""
    return STEP, [(r.sequence.slot, r.sequence.position, r.sequence.finish_reason, r.sequence.lost, list(r.drafts),
                   None if r.draft_probs is None else r.draft_probs.cpu(), r.want_logits, r.want_hidden)
                  for r in requests]


class MirroredEngine(Engine):
    """Rank 0's engine: each call that runs a forward or moves a slot is sent to the followers,
    then run here. Everything else (check, the pool, the sizes) is the plain Engine's."""

    def __init__(self, channel: Channel, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.channel = channel

    def warm_up(self) -> None:
        self.channel.send((WARM_UP,))
        super().warm_up()

    def open(self, prompt: list[int], sampling, max_new_tokens: int, eos_ids: tuple[int, ...] | None = None,
             want_hidden: bool = False) -> Sequence:
        self.channel.send((OPEN, list(prompt), sampling, max_new_tokens, eos_ids, want_hidden))
        return super().open(prompt, sampling, max_new_tokens, eos_ids, want_hidden)

    def opening(self, prompt: list[int], sampling, max_new_tokens: int, eos_ids: tuple[int, ...] | None = None,
                want_hidden: bool = False) -> Opened:
        """A whole open, one command for the followers (they replay opens, not chunks)."""
        return Opened(self, self.open(prompt, sampling, max_new_tokens, eos_ids, want_hidden), prompt)

    def close(self, seq: Sequence) -> None:
        self.channel.send((CLOSE, seq.slot))
        super().close(seq)

    def step(self, requests: list[StepRequest]) -> list[StepResult]:
        self.channel.send(step_command(requests))
        return super().step(requests)

    def step_costs(self) -> dict[int, float]:
        """Engine.step_costs' table, rank 0 deciding which buckets are timed: each bucket is one
        command, so every rank runs the same padding steps whatever its own clock says."""
        costs: dict[int, float] = {}
        began = time.perf_counter()
        for index, rows in enumerate(self.cost_buckets):
            if costs and time.perf_counter() - began > COST_BUDGET_S:
                break
            self.channel.send((BUCKET_COST, index))
            costs[rows] = bucket_cost(self, index)
        return costs

    def stop_followers(self) -> None:
        """The followers return from `follow` (after every engine call of this rank's worker)."""
        self.channel.send((STOP,))


def bucket_cost(engine: Engine, index: int) -> float:
    """Seconds per padding step of shared bucket `index` (StepRunner.step_costs' inner loop)."""
    times = []
    with device_scope(engine.model.device):
        for _ in range(EAGER_REPEATS + 1):
            _sync(engine)
            start = time.perf_counter()
            engine.padding_step(index)
            _sync(engine)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _sync(engine: Engine) -> None:
    if torch.device(engine.model.device).type == "cuda":
        torch.cuda.synchronize()


def follow(channel: Channel, engine: Engine) -> None:
    """A follower rank: run rank 0's engine calls on `engine`, in order, until STOP."""
    sequences: dict[int, Sequence] = {}  # slot -> this rank's sequence in it
    while True:
        command = channel.receive()
        if command[0] == STOP:
            return
        try:
            _apply(engine, sequences, command)
        except Diverged:
            raise
        except Exception:  # noqa: BLE001 - rank 0 raised on the same call and answered it: go on as it does
            log.exception("mirrored engine call %r failed", command[0])


def _apply(engine: Engine, sequences: dict[int, Sequence], command: tuple) -> None:
    kind, *args = command
    if kind == STEP:
        engine.step([_request(sequences, *request) for request in args[0]])
    elif kind == OPEN:
        seq = engine.open(*args)
        sequences[seq.slot] = seq
    elif kind == CLOSE:
        (slot,) = args
        engine.close(_sequence(sequences, slot))
        del sequences[slot]
    elif kind == WARM_UP:
        engine.warm_up()
    elif kind == BUCKET_COST:
        bucket_cost(engine, *args)
    else:
        raise Diverged(f"unknown mirrored command {kind!r}")


def _sequence(sequences: dict[int, Sequence], slot: int) -> Sequence:
    if slot not in sequences:
        raise Diverged(f"rank 0 names slot {slot}, which holds no sequence on this rank")
    return sequences[slot]


def _request(sequences: dict[int, Sequence], slot: int, position: int, finish_reason: str | None, lost: bool,
             drafts: list[int], draft_probs, want_logits: bool, want_hidden: bool) -> StepRequest:
    """This rank's StepRequest for rank 0's: its own sequence, told what rank 0's scheduler set
    outside the engine (a finish at a full context), checked to stand where rank 0's stands."""
    seq = _sequence(sequences, slot)
    if seq.position != position:
        raise Diverged(f"slot {slot} is at position {seq.position} on this rank, {position} on rank 0")
    seq.finish_reason, seq.lost = finish_reason, lost
    return StepRequest(seq, drafts, draft_probs, want_logits, want_hidden)
