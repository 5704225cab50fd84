"""Prompt turns: the opens waiting for their next chunk share one prefill job on the engine's worker
(Engine.advance_openings), within a budget of rows, and the running sessions' batches take their
turns on the worker between two such jobs; or (step_rows) the batches take the waiting prompts'
next pieces into their steps (Engine.step's openings), and a turn of their own runs only while no
batch comes. DESIGN.md section 9, "Prompt turns" and "Prompts inside a step".
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ..engine import Engine, Opened, Opening
from .metrics import Metrics
from .worker import Worker


def chunk_rows(opening: Opening | Opened, limit: int | None = None) -> int:
    """Rows the opening's next chunk (or piece of at most `limit` rows) takes in a forward (0:
    nothing left to prefill)."""
    if not isinstance(opening, Opening) or opening.logits is not None:
        return 0
    begin, end = opening.next_chunk(limit)
    return end - begin


def take_turn(waiting: list, rows: int, key=lambda w: w, limit: int | None = None) -> list:
    """The front of `waiting` (first come, first served) whose next chunks (pieces of at most
    `limit` rows) fit `rows` together; at least the first, whatever its chunk. key: the opening of an entry."""
    turn, used = [], 0
    for entry in waiting:
        need = chunk_rows(key(entry), limit)
        if turn and used + need > rows:
            break
        turn.append(entry)
        used += need
    return turn


@dataclass(eq=False)
class _Waiting:
    opening: Opening
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    taken_at: int = 0  # the opening's position when a job took it (the rows it prefilled: metrics)


class PromptTurns:
    """Every open's prompt, prefilled in turns on the worker: a turn is one job of the waiting opens'
    next chunks (take_turn), after which an open not yet all in goes to the back of the line.
    With step_rows, the scheduler's batches take the waiting opens in (`take`, `settle`) and a turn
    of their own runs only when the scheduler finds no batch to run (it calls `turn`)."""

    def __init__(self, worker: Worker, engine: Engine, rows: int, step_rows: int = 0, metrics: Metrics | None = None):
        """rows: the chunks' rows a job holds (at least one chunk whatever its size; ServerConfig.prefill_rows).
        step_rows: the rows of prompt pieces a batch's step takes in (ServerConfig.step_prompt_rows;
        0: none, the turns run on their own). metrics: where the prompt rows each job prefilled are counted."""
        if rows < 1:
            raise ValueError(f"a prefill turn needs at least one row, got {rows}")
        if step_rows < 0:
            raise ValueError(f"step_prompt_rows must be >= 0, got {step_rows}")
        self.worker, self.engine, self.rows, self.step_rows, self.metrics = worker, engine, rows, step_rows, metrics
        self._waiting: list[_Waiting] = []
        self._turns: asyncio.Task | None = None
        self.on_waiting = None  # with step_rows: called (no argument) when an open starts waiting (the scheduler's wake-up)

    @property
    def waiting(self) -> bool:
        """Whether an open waits for its next chunk."""
        return bool(self._waiting)

    async def ingest(self, opening: Opening | Opened) -> None:
        """Return once the opening's prompt is all in; raise what its turn's job raised (which
        released its slot: Engine.advance_openings)."""
        if chunk_rows(opening) == 0:  # all in already (an Opened: a whole open ran at once)
            return
        waiting = _Waiting(opening)
        self._waiting.append(waiting)
        if self.step_rows:
            if self.on_waiting is not None:
                self.on_waiting()
        elif self._turns is None or self._turns.done():
            self._turns = asyncio.get_running_loop().create_task(self._run())
        await waiting.done

    def take(self) -> list[_Waiting]:
        """The waiting opens a step takes in, off the line: the front whose next pieces (of the
        rows Engine.piece_limit allows) fit step_rows together, at least one. The caller runs them
        and hands them to `settle`."""
        return self._pop(self.step_rows, self.engine.piece_limit(self.step_rows))

    def _pop(self, rows: int, limit: int | None = None) -> list[_Waiting]:
        """take_turn's front of the line within `rows` (pieces of at most `limit` rows), off the line."""
        turn = take_turn(self._waiting, rows, key=lambda w: w.opening, limit=limit)
        del self._waiting[: len(turn)]
        for waiting in turn:
            waiting.taken_at = waiting.opening.position
        return turn

    def settle(self, turn: list[_Waiting], failure: BaseException | None = None, where: str = "step") -> None:
        """After the job that ran `turn` (`where`: "step", inside a step, or "turn", one of their
        own): an open all in is done, one not yet goes to the back of the line; with `failure` (the
        job raised, its opens' slots released) every one fails."""
        if failure is None and self.metrics is not None:
            self.metrics.record_prompt_rows(where, sum(w.opening.position - w.taken_at for w in turn))
        for waiting in turn:
            if failure is not None:
                waiting.done.set_exception(failure)
            elif chunk_rows(waiting.opening) == 0:
                waiting.done.set_result(None)
            else:
                self._waiting.append(waiting)  # round robin: behind the opens that waited this turn

    def cancel(self, turn: list[_Waiting], exc: BaseException) -> None:
        """The task that ran `turn`'s job was cancelled (the server stops; the job may still run on
        the worker): every open waiting fails, `turn`'s with them, each slot released behind the job."""
        self._waiting[:0] = turn
        self.fail_waiting(exc)

    async def turn(self) -> None:
        """One turn of the waiting opens on the worker (its job's failure fails its opens and is
        not raised; a cancellation fails every open waiting and is)."""
        turn = self._pop(self.rows)
        try:
            await self.worker.run(self.engine.advance_openings, [w.opening for w in turn])
        except asyncio.CancelledError as exc:  # the server stops: every open still waiting fails, its slot released
            self.cancel(turn, exc)
            raise
        except BaseException as exc:  # the job failed: every open in it fails (advance_openings released their slots)
            self.settle(turn, exc, "turn")
            return
        self.settle(turn, where="turn")

    async def _run(self) -> None:
        while self._waiting:
            await self.turn()

    def fail_waiting(self, exc: BaseException) -> None:
        """Every open waiting fails with `exc`, its slot released on the worker (the server stops)."""
        for waiting in self._waiting:
            self.worker.submit(waiting.opening.abort)  # behind the job in flight, on the worker
            if not waiting.done.done():
                waiting.done.set_exception(exc)
        self._waiting.clear()
