"""A verifier server on loopback for tests: its own event loop in a background thread.

    with LoopbackServer(model_dir, n_slots=4) as server:
        stub = rpc.VerifierStub(grpc.insecure_channel(server.address))

Keyword options are ServerConfig fields: a test names what it needs, ServerConfig supplies every
other default, and LOOPBACK_OVERRIDES is the one place tests differ from a real server's defaults.
"""

from __future__ import annotations

import asyncio
import threading

from ..engine import Engine
from .app import VerifierServer, build_engine
from .config import ServerConfig

# A test server listens on loopback on a free port and holds a small pool of short contexts. It
# verifies every draft: trimming changes how many tokens each step emits (never the stream), so
# tests that count a step's tokens stay exact; the goodput tests turn it on.
LOOPBACK_OVERRIDES = {"host": "127.0.0.1", "port": 0, "n_slots": 4, "max_seq_len": 256, "goodput": False}


def loopback_config(model_dir, **overrides) -> ServerConfig:
    """ServerConfig for a test: ServerConfig's defaults, LOOPBACK_OVERRIDES, then `overrides`."""
    return ServerConfig(model_dir, **{**LOOPBACK_OVERRIDES, **overrides})


class LoopbackServer:
    def __init__(self, model_dir, *, engine_class: type[Engine] = Engine, **overrides):
        """`engine_class`: an Engine subclass to build from the config (tests that slow or gate steps)."""
        config = loopback_config(model_dir, **overrides)
        self.config = config
        self.server = VerifierServer(config, build_engine(config, engine_class))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="loopback-verifier", daemon=True)
        self._thread.start()
        self._stopped = False
        try:
            self.address: str = self._call(self.server.start())
        except BaseException:
            self._close_loop()
            raise

    @property
    def engine(self) -> Engine:
        return self.server.engine

    @property
    def metrics_port(self) -> int | None:
        return self.server.metrics_port

    def _call(self, coroutine, timeout: float | None = 60.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def run_on_loop(self, fn, *args):
        """Run fn(*args) on the server's event loop and return its result (tests that inspect state)."""

        async def run():
            return fn(*args)

        return self._call(run())

    def drain(self) -> None:
        """Health NOT_SERVING and new sessions refused, as at the start of a shutdown."""
        self._call(self.server.drain())

    def stop(self, grace_s: float = 1.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            self._call(self.server.stop(grace_s=grace_s, drain_s=0.0), timeout=grace_s + 60.0)
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> "LoopbackServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
