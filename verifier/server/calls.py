"""The calls the server holds, for its shutdown: when it may close its port without cutting one.

gRPC's core hands a call to the server's event loop only when the loop asks for the next one; a
call that arrives while the loop is busy waits in the core, unseen. If the server stops then, the
core ends each such call CANCELLED (grpc/grpc#41785), though its client sent it before the stop
and it was never refused. So the port stays open until the service's calls have ended and no call
has started for QUIET_S: a loop that has been idle that long has taken every call the core held.
A call that starts meanwhile is served (or answered UNAVAILABLE once the grace period is over).
"""

from __future__ import annotations

import asyncio
import time

import grpc

QUIET_S = 0.05  # no call started for this long: the core holds none unseen


class CallBook:
    """Calls of the service in flight (`enter` / `leave` around a handler that can wait) and when
    the last call of any service started (`started`, from CallStarts)."""

    def __init__(self):
        self.active = 0
        self.last_start = time.monotonic()

    def started(self) -> None:
        self.last_start = time.monotonic()

    def enter(self) -> None:
        self.active += 1

    def leave(self) -> None:
        self.active -= 1

    async def settled(self, deadline: float) -> bool:
        """Wait until no call is in flight and none started during QUIET_S of a running event loop
        (a loop that was busy has not seen the calls the core holds: the time must pass while it
        polls), or until time.monotonic() reaches deadline; whether it got quiet."""
        while True:
            mark = time.monotonic()
            left = deadline - mark
            if left <= 0:
                return False
            await asyncio.sleep(min(QUIET_S, left))
            if self.active == 0 and self.last_start < mark and time.monotonic() - mark >= QUIET_S:
                return True


class CallStarts(grpc.aio.ServerInterceptor):
    """The first interceptor: every call's start (health, reflection and unauthenticated ones
    included) goes into the book."""

    def __init__(self, book: CallBook):
        self.book = book

    async def intercept_service(self, continuation, handler_call_details):
        self.book.started()
        return await continuation(handler_call_details)
