"""The Prometheus endpoint (`--metrics-port`): GET /metrics on its own address (`--metrics-host`,
loopback by default, so `--host 0.0.0.0` publishes gRPC and not this), with an optional bearer
token (`--metrics-token-file`), and bounded: at most MAX_HANDLERS connections are served at once
(one more is closed at once, unanswered) and a connection that sends nothing for TIMEOUT_S is
dropped, so idle or half-open connections cannot pile up threads.
"""

from __future__ import annotations

import hmac
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

MAX_HANDLERS = 4  # connections served at once
TIMEOUT_S = 5.0  # a connection silent this long is dropped


def read_token(path: Path) -> str:
    """The token in a --metrics-token-file (its first line, stripped); ValueError if unreadable or empty."""
    try:
        token = Path(path).read_text().strip().splitlines()
    except OSError as exc:
        raise ValueError(f"--metrics-token-file {path}: {exc.strerror or exc}") from None
    if not token or not token[0].strip():
        raise ValueError(f"--metrics-token-file {path} is empty")
    return token[0].strip()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, registry: CollectorRegistry, token: str | None):
        self.registry = registry
        self.expected = f"Bearer {token}".encode() if token else None
        self.slots = threading.BoundedSemaphore(MAX_HANDLERS)
        super().__init__(address, _Handler)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):  # every handler busy: this connection is closed unanswered
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _Handler(BaseHTTPRequestHandler):
    timeout = TIMEOUT_S  # the socket's: a silent connection ends here
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.split("?")[0] not in ("/metrics", "/"):
            return self._send(404, b"not found: GET /metrics\n", "text/plain")
        if self.server.expected is not None:
            given = (self.headers.get("Authorization") or "").encode()
            if not hmac.compare_digest(given, self.server.expected):
                return self._send(401, b"send 'Authorization: Bearer <token>' (--metrics-token-file)\n", "text/plain")
        self._send(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:  # scrapes are not logged line by line
        pass


class MetricsEndpoint:
    """start() -> the bound port; stop(). An address that cannot be bound is an OSError naming the flags."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, token: str | None = None):
        self.registry, self.host, self.port, self.token = registry, host, port, token
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        try:
            self._server = _Server((self.host, self.port), self.registry, self.token)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {self.host}:{self.port} (--metrics-host, --metrics-port): "
                          f"{exc.strerror or exc}") from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="verifier-metrics", daemon=True)
        self._thread.start()
        return self._server.server_port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
