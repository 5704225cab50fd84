"""A verifier server on loopback for tests: its own event loop in a background thread.

    with LoopbackServer(model_dir, n_slots=4) as server:
        stub = rpc.VerifierStub(grpc.insecure_channel(server.address))

Keyword options beyond the named ones are ServerConfig fields (max_batch_rows, retry_after_ms,
tls_cert, tls_key, metrics_port, max_message_mb, results_per_session, grace_s, dtype, ...).
"""

from __future__ import annotations

import asyncio
import threading

from .app import VerifierServer
from .config import ServerConfig


class LoopbackServer:
    def __init__(self, model_dir, *, device: str = "cpu", n_slots: int = 4, max_seq_len: int = 256, max_k: int = 8,
                 rollback: str = "woa", auth_token: str | None = None, idle_timeout_s: float | None = None,
                 max_wait_ms: float = 0.0, engine=None, **more):
        """`engine`: serve an Engine built by the caller (it must match the other options) instead
        of loading model_dir again."""
        config = ServerConfig(model_dir, host="127.0.0.1", port=0, device=device, n_slots=n_slots,
                              max_seq_len=max_seq_len, max_k=max_k, rollback=rollback, auth_token=auth_token,
                              idle_timeout_s=idle_timeout_s, max_wait_ms=max_wait_ms, **more)
        self.config = config
        self.server = VerifierServer(config, engine)
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
