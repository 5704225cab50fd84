"""Prompt turns: the opens waiting for their next chunk share one prefill job on the engine's worker
(Engine.advance_openings), within a budget of rows, and the running sessions' batches take their
turns on the worker between two such jobs. DESIGN.md section 9, "Prompt turns".
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ..engine import Engine, Opened, Opening
from .worker import Worker


def chunk_rows(opening: Opening | Opened) -> int:
    """Rows the opening's next chunk takes in a forward (0: nothing left to prefill)."""
    if not isinstance(opening, Opening) or opening.logits is not None:
        return 0
    begin, end = opening.next_chunk()
    return end - begin


def take_turn(waiting: list, rows: int, key=lambda w: w) -> list:
    """The front of `waiting` (first come, first served) whose next chunks fit `rows` together;
    at least the first, whatever its chunk. key: the opening of an entry."""
    turn, used = [], 0
    for entry in waiting:
        need = chunk_rows(key(entry))
        if turn and used + need > rows:
            break
        turn.append(entry)
        used += need
    return turn


@dataclass(eq=False)
class _Waiting:
    opening: Opening | Opened
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class PromptTurns:
    """Every open's prompt, prefilled in turns on the worker: a turn is one job of the waiting opens'
    next chunks (take_turn), after which an open not yet all in goes to the back of the line."""

    def __init__(self, worker: Worker, engine: Engine, rows: int):
        """rows: the chunks' rows a job holds (at least one chunk whatever its size; ServerConfig.prefill_rows)."""
        if rows < 1:
            raise ValueError(f"a prefill turn needs at least one row, got {rows}")
        self.worker, self.engine, self.rows = worker, engine, rows
        self._waiting: list[_Waiting] = []
        self._turns: asyncio.Task | None = None

    async def ingest(self, opening: Opening | Opened) -> None:
        """Return once the opening's prompt is all in; raise what its turn's job raised (which
        released its slot: Engine.advance_openings)."""
        waiting = _Waiting(opening)
        self._waiting.append(waiting)
        if self._turns is None or self._turns.done():
            self._turns = asyncio.get_running_loop().create_task(self._run())
        await waiting.done

    async def _run(self) -> None:
        while self._waiting:
            turn = take_turn(self._waiting, self.rows, key=lambda w: w.opening)
            for waiting in turn:
                self._waiting.remove(waiting)
            try:
                done = await self.worker.run(self.engine.advance_openings, [w.opening for w in turn])
            except asyncio.CancelledError as exc:  # the server stops: every open still waiting fails, its slot released
                self._waiting[:0] = turn
                self._fail_waiting(exc)
                raise
            except BaseException as exc:  # the job failed: every open in it fails (advance_openings released their slots)
                for waiting in turn:
                    waiting.done.set_exception(exc)
                continue
            for waiting, finished in zip(turn, done):
                if finished:
                    waiting.done.set_result(None)
                else:
                    self._waiting.append(waiting)  # round robin: behind the opens that waited this turn

    def _fail_waiting(self, exc: BaseException) -> None:
        for waiting in self._waiting:
            self.worker.submit(waiting.opening.abort)  # behind the job in flight, on the worker
            if not waiting.done.done():
                waiting.done.set_exception(exc)
        self._waiting.clear()
