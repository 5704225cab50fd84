"""The one thread that runs engine work. The engine is blocking and not thread-safe: prefill,
steps and slot releases all go through this single-thread executor, in submission order, and
never run on the event loop."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future, ThreadPoolExecutor

log = logging.getLogger(__name__)


class Worker:
    def __init__(self):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def run(self, fn, *args):
        """Run fn(*args) on the worker thread. The job is queued when this is called; cancelling the
        caller does not stop it (callers that must see its result shield it)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def submit(self, fn, *args) -> Future:
        """Queue fn(*args) without waiting (slot releases); a failure is logged, not lost."""
        future = self._executor.submit(fn, *args)
        future.add_done_callback(_log_failure)
        return future

    def shutdown(self) -> None:
        """Wait for queued jobs, then stop the thread."""
        self._executor.shutdown(wait=True)


def _log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("engine job failed", exc_info=future.exception())
