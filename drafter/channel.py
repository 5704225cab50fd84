"""What the blocking and the asyncio client share below the retry policy (drafter/retry.py): channel
options, credentials, auth metadata, the setup of connection, channel and stub, and the mapping of a
failed call or a broken VerifyStream to VerifierError."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from verifier import rpc

from .messages import VerifierError
from .retry import Call, RetryPolicy

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # logits rows: K+1 rows of a 150k vocabulary pass gRPC's 4 MiB default


@dataclass(frozen=True)
class Connection:
    """How to reach a verifier: address, optional TLS root certificate, client certificate and
    bearer token."""

    address: str
    auth_token: str | None = None
    tls_root_cert: str | Path | None = None  # PEM file of the CA that signed the server's certificate
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    tls_client_cert: str | Path | None = None  # PEM client certificate, for a server that asks for one (mutual TLS)
    tls_client_key: str | Path | None = None  # its private key

    def __post_init__(self):
        if not self.address or ":" not in self.address:
            raise ValueError(f"address must be HOST:PORT, got {self.address!r}")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token is empty")
        if (self.tls_client_cert is None) != (self.tls_client_key is None):
            raise ValueError("tls_client_cert and tls_client_key go together: pass both or neither")
        if self.tls_client_cert is not None and self.tls_root_cert is None:
            raise ValueError("a client certificate is sent over TLS: pass tls_root_cert too")

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.auth_token}"),) if self.auth_token else ()

    def open(self, module):
        """A channel from `module` (grpc for blocking, grpc.aio for asyncio)."""
        options = [("grpc.max_receive_message_length", self.max_message_bytes),
                   ("grpc.max_send_message_length", self.max_message_bytes)]
        if self.tls_root_cert is None:
            return module.insecure_channel(self.address, options=options)
        root, key, chain = (_read(name, path) for name, path in (("tls_root_cert", self.tls_root_cert),
                                                                 ("tls_client_key", self.tls_client_key),
                                                                 ("tls_client_cert", self.tls_client_cert)))
        credentials = grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)
        return module.secure_channel(self.address, credentials, options=options)


def _read(name: str, path: str | Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{name}: cannot read {path}: {exc.strerror}") from None


def call_error(err: grpc.RpcError, address: str) -> VerifierError:
    """A failed call (blocking or asyncio) as a VerifierError, with the retry hint of a full pool."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    retry_after = None
    server_stopping = False
    try:
        trailing = err.trailing_metadata() or ()
    except Exception:  # a call that never started has no metadata to read
        trailing = ()
    for key, value in trailing:
        if key == rpc.RETRY_AFTER_KEY:
            try:
                retry_after = int(value) / 1000.0
            except ValueError:
                pass
        server_stopping |= key == rpc.STOPPING_KEY
    if code == grpc.StatusCode.UNAVAILABLE:  # the server's own word as it stops, or gRPC's: it could not be reached
        details = f"the verifier at {address} is stopping: {details}" if server_stopping else f"cannot reach the verifier at {address}: {details}"
    return VerifierError(code, details, retry_after_s=retry_after)


def stream_silent_error(timeout_s: float) -> VerifierError:
    """No result came back on the VerifyStream within the client's timeout: the stream counts as broken."""
    return VerifierError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no VerifyStream result within {timeout_s} s")


def stream_ended_error() -> VerifierError:
    """The server ended the VerifyStream before answering the step sent on it."""
    return VerifierError(grpc.StatusCode.UNAVAILABLE, "the server ended the VerifyStream")


class ClientChannel:
    """The setup both clients share: a Connection, its channel and the stub. A subclass names the grpc
    module its channel comes from (grpc for blocking calls, grpc.aio for asyncio)."""

    grpc_module = grpc

    def __init__(self, address: str, *, auth_token: str | None = None, tls_root_cert: str | Path | None = None,
                 timeout_s: float = 60.0, retry: RetryPolicy = RetryPolicy(), max_message_bytes: int | None = None,
                 tls_client_cert: str | Path | None = None, tls_client_key: str | Path | None = None):
        self.connection = Connection(address, auth_token, tls_root_cert,
                                     DEFAULT_MAX_MESSAGE_BYTES if max_message_bytes is None else max_message_bytes,
                                     tls_client_cert, tls_client_key)
        self.timeout_s = timeout_s  # the deadline of every unary call, and how long a stream step waits
        self.retry = retry
        self._channel = self.connection.open(self.grpc_module)
        self._stub = rpc.VerifierStub(self._channel)

    def _invoke(self, call: Call):
        """`call` on the stub with the deadline and the bearer token: the reply (grpc) or an awaitable
        of it (grpc.aio)."""
        return getattr(self._stub, call.method)(call.request, timeout=self.timeout_s, metadata=self.connection.metadata)
