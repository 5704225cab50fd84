"""The server's settings: one frozen dataclass, validated on construction (the CLI and
LoopbackServer both build it; nothing is read from the environment)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..model.rollback import ROLLBACK_MODES, WOA

DTYPE_NAMES = ("float32", "bfloat16")


@dataclass(frozen=True)
class ServerConfig:
    model_dir: Path
    host: str = "127.0.0.1"
    port: int = 0  # 0: the OS picks a free port (the log line says which)
    device: str = "cpu"
    dtype: str = "float32"
    n_slots: int = 8
    max_seq_len: int = 2048
    max_k: int = 8
    rollback: str = WOA
    # Scheduler: an engine batch holds at most max_batch_rows verify rows (a single step larger than
    # that still runs alone); max_wait_ms > 0 lets a batch gather before it runs (0: go at once).
    max_batch_rows: int = 256
    max_wait_ms: float = 0.0
    idle_timeout_s: float | None = None  # None: sessions are never reaped
    results_per_session: int = 8  # stored step results per session, for idempotent retries
    retry_after_ms: int = 200  # the hint sent with RESOURCE_EXHAUSTED when the pool is full
    auth_token: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_message_mb: float = 64.0
    metrics_port: int | None = None  # None: no Prometheus endpoint (GetStats still answers)
    grace_s: float = 5.0  # shutdown: how long in-flight calls may take to finish
    drain_s: float = 0.0  # shutdown: how long health says NOT_SERVING before the port closes

    def __post_init__(self):
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        for name in ("n_slots", "max_seq_len", "max_batch_rows", "results_per_session"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_k < 0:
            raise ValueError(f"max_k must be >= 0, got {self.max_k}")
        if self.rollback not in ROLLBACK_MODES:
            raise ValueError(f"rollback must be one of {ROLLBACK_MODES}, got {self.rollback!r}")
        for name in ("max_wait_ms", "grace_s", "drain_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.idle_timeout_s is not None and not (math.isfinite(self.idle_timeout_s) and self.idle_timeout_s > 0):
            raise ValueError(f"idle_timeout_s must be > 0 (or None: never reap), got {self.idle_timeout_s}")
        if self.retry_after_ms < 0:
            raise ValueError(f"retry_after_ms must be >= 0, got {self.retry_after_ms}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: pass both or neither")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token is empty (pass None to turn auth off)")
        if not (math.isfinite(self.max_message_mb) and self.max_message_mb > 0):
            raise ValueError(f"max_message_mb must be > 0, got {self.max_message_mb}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mb * (1 << 20))
