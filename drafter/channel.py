"""What the blocking and the asyncio client share: channel options, credentials, auth metadata, the
retry policy and the mapping of a failed call to VerifierError."""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc

from verifier import rpc

from .messages import Step, VerifierError

# A failed call with one of these codes may not have reached the engine, or its answer was lost on
# the way back; resending the same request id is safe because the server stores each step's result
# under its request id and never advances a session twice.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # logits rows: K+1 rows of a 150k vocabulary pass gRPC's 4 MiB default


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential backoff for UNAVAILABLE / DEADLINE_EXCEEDED."""

    attempts: int = 5  # tries in all, the first included
    backoff_s: float = 0.1  # wait before the second try; doubles each time
    max_backoff_s: float = 2.0

    def __post_init__(self):
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be at least 1, got {self.attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("RetryPolicy.backoff_s and max_backoff_s must be >= 0")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed try number `attempt` (0-based)."""
        return min(self.max_backoff_s, self.backoff_s * (2 ** attempt))


@dataclass(frozen=True)
class Connection:
    """How to reach a verifier: address, optional TLS root certificate and bearer token."""

    address: str
    auth_token: str | None = None
    tls_root_cert: str | Path | None = None  # PEM file of the CA that signed the server's certificate
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def __post_init__(self):
        if not self.address or ":" not in self.address:
            raise ValueError(f"address must be HOST:PORT, got {self.address!r}")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token is empty")

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.auth_token}"),) if self.auth_token else ()

    def open(self, module):
        """A channel from `module` (grpc for blocking, grpc.aio for asyncio)."""
        options = [("grpc.max_receive_message_length", self.max_message_bytes),
                   ("grpc.max_send_message_length", self.max_message_bytes)]
        if self.tls_root_cert is None:
            return module.insecure_channel(self.address, options=options)
        try:
            root = Path(self.tls_root_cert).read_bytes()
        except OSError as exc:
            raise ValueError(f"tls_root_cert: cannot read {self.tls_root_cert}: {exc.strerror}") from None
        return module.secure_channel(self.address, grpc.ssl_channel_credentials(root_certificates=root), options=options)


def new_request_id() -> str:
    return uuid.uuid4().hex


def with_request_id(step: Step) -> Step:
    """The step with a request id of its own, fixed before the first try so that every retry reuses it."""
    return step if step.request_id else dataclasses.replace(step, request_id=new_request_id())


def call_error(err: grpc.RpcError, address: str) -> VerifierError:
    """A failed call (blocking or asyncio) as a VerifierError, with the retry hint of a full pool."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    retry_after = None
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
    if code == grpc.StatusCode.UNAVAILABLE:
        details = f"cannot reach the verifier at {address}: {details}"
    return VerifierError(code, details, retry_after_s=retry_after)


def check_result_count(got: int, sent: int) -> None:
    if got != sent:
        raise VerifierError(grpc.StatusCode.INTERNAL, f"VerifyResponse.results has {got} results for {sent} steps")
