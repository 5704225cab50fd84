"""The server's settings: one frozen dataclass, validated on construction, and the one place their
defaults and help live. `python -m verifier serve` derives its flags from these fields
(verifier/server/cli.py) and LoopbackServer its test configs (verifier/server/testing.py);
nothing is read from the environment but the auth tokens of VERIFIER_AUTH_TOKENS, which the
server reads when it starts (verifier/server/principals.py).

Each field's metadata holds its `help`, and for the command line only what a field's type cannot
say: `flag` (a name other than --field-name), `choices`, `fallback` (what a field without a
default takes when its flag is left out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..engine import DEFAULT_MAX_K
from ..model.rollback import ROLLBACK_MODES, WOA

DTYPE_NAMES = ("float32", "bfloat16")
DEVICE_CHOICES = ("cpu", "cuda")


def option(default, help: str, **cli):
    """A ServerConfig field with a default and its help text (and command-line hints, see above)."""
    return field(default=default, metadata={"help": help, **cli})


def required(help: str, **cli):
    """A ServerConfig field without a default."""
    return field(metadata={"help": help, **cli})


@dataclass(frozen=True)
class ServerConfig:
    model_dir: Path = required("HF checkpoint directory", flag="--model", fallback="the project's default model")
    port: int = required("port to bind; 0 picks a free one (the log line says which)")
    host: str = option("127.0.0.1", "address to bind (127.0.0.1: loopback only)")
    device: str = option("cpu", "device the model runs on", choices=DEVICE_CHOICES)
    dtype: str = option("float32", "weight and activation dtype", choices=DTYPE_NAMES)
    n_slots: int = option(8, "sessions held at once")
    max_seq_len: int = option(2048, "positions per session (prompt + generated)")
    max_k: int = option(DEFAULT_MAX_K, "most drafts per step")
    rollback: str = option(WOA, "recurrent-state rollback: write-on-accept or snapshots", choices=ROLLBACK_MODES)
    # An engine batch runs at most max_batch_rows verify rows, and never more than the largest
    # graph bucket (a single step larger than that still runs alone). With goodput on, the rows
    # counted are those the policy keeps: a step it may trim holds one row when the batch is taken
    # (verifier/server/scheduler.py).
    max_batch_rows: int = option(256, "most verify rows in one engine batch")
    # When the engine is free, the next batch waits for the next step of every session of the batch
    # that just ran (the drafters answering its results), so that sessions stepping in lockstep
    # share one batch instead of splitting into a tiny batch of whoever answered first: at least
    # max_wait_ms, and 1.5x the measured time they take to come back when that is longer (up to
    # the last engine step's time: a fragment costs about one step; verifier/server/scheduler.py).
    # The 2 ms default is meant to cover a loopback round trip plus a drafter's Python on a fast host
    # (`python -m bench.rpc_floor` measures that round trip); a lone drafter never waits (its step
    # is all that is awaited), and a session that misses a batch is no longer awaited.
    max_wait_ms: float = option(2.0, "wait at least this long for the sessions of the last batch, longer when they "
                                     "measurably take longer (0: run as soon as the engine is free)")
    # Cohorts (verifier/server/scheduler.py): the sessions split into N groups whose batches take
    # turns on the engine, so that one group's results travel and its drafters draft while another
    # group's step runs; each batch then waits only for its own group. 1: one batch holds every
    # session that is waiting. A step's bits do not depend on its batch (rows are invariant).
    cohorts: int = option(1, "split the sessions into this many groups whose batches take turns on the engine, so "
                             "the engine runs one while the others' results and next steps travel (1: one batch for all)")
    # Per batch, verify only the drafts worth their rows (verifier/server/goodput.py), from the step
    # costs the engine measures at startup; off: every draft is verified.
    # Load the checkpoint's MTP head when it has one, for sessions opened with server_drafter "mtp"
    # (ModelInfo.server_drafters); --no-mtp saves its weights' memory (and each such session's head
    # KV pool and hidden rows), and the model then offers "ngram" only.
    mtp: bool = option(True, "load the checkpoint's MTP head, if it has one, for server-side MTP drafting "
                             "(--no-mtp: skip it)")
    # Block-FP8 checkpoints on the GPU: the dense weights' real values kept beside them for steps of
    # 64 rows or more (HybridModel.keep_fp8_reals): the same bits, one dequantization a GEMM fewer.
    fp8_reals: bool = option(True, "keep the dense block-FP8 weights' real values for steps of 64+ rows (--no-fp8-reals: "
                                   "2 bytes a weight element less GPU memory, a dequantization per such GEMM)")
    # Prompt prefixes already ingested, kept at prefill's chunk boundaries (verifier/model/prefix_cache.py):
    # a prompt that starts with one restores its state, with a cold start's bits.
    prefix_cache_gb: float = option(0.0, "keep ingested prompt prefixes up to this many GiB of device memory, least "
                                         "recently used out first (0: no prefix cache)")
    # Prompts in turns (verifier/server/prefill.py): one job on the engine's worker holds the next
    # chunks of the opens waiting, up to this many rows (at least one chunk): what a running batch
    # waits behind prompts at most, and what lets prompts arriving together share their forwards.
    prefill_rows: int = option(2048, "rows of prompt chunks one prefill job holds, the opens waiting sharing it (at "
                                     "least one chunk)")
    # Prompts inside a step (verifier/server/prefill.py, Engine.step's openings): each batch of the
    # running sessions takes the waiting prompts' next pieces into its step, up to this many rows,
    # so a step's weights are read once for both; a turn of their own runs only while no batch
    # comes. 0: prompts take turns between batches.
    step_prompt_rows: int = option(0, "rows of waiting prompts' pieces each batch's step takes in (at least one piece; "
                                      "0: prompts take turns of their own between batches)")
    goodput: bool = option(True, "goodput-aware K: trim each session's drafts per batch (--no-goodput: verify all)")
    # Tensor parallelism (verifier/server/parallel.py): rank 0 serves, ranks 1 .. N-1 mirror its
    # engine calls on their shards; the MTP head is not split across ranks, so "ngram" is the only
    # server drafter then. The bits are those of N ranks (generate --tensor-parallel N's).
    tensor_parallel: int = option(1, "split the model over N processes (one rank each, torch.distributed: gloo on the "
                                     "CPU, NCCL with --device cuda); server_drafter 'ngram' only when N > 1")
    # None: the engine's own list (verifier.model.graphs.DEFAULT_GRAPH_ROWS) cut to max_seq_len
    graph_rows: tuple[int, ...] | None = option(None, "verify-row buckets the engine captures as CUDA graphs at "
                                                "startup, comma-separated; None: the engine's list up to max_seq_len")
    # Finite by default: an abandoned session, or an OpenSession whose caller left, never holds a
    # slot for longer than this.
    idle_timeout_s: float = option(600.0, "reap sessions unused this long (their slots come back)")
    results_per_session: int = option(8, "step results a session keeps for retries with the same request id")
    # The hint is the expected wait for a slot, from the spacing of recent slot releases, never
    # below this (verifier/server/service.py, _retry_after_ms).
    retry_after_ms: int = option(200, "the least retry hint sent with RESOURCE_EXHAUSTED when an open finds no slot")
    # Principals (verifier/server/principals.py): each token names one; a session is its opener's.
    max_sessions_per_principal: int = option(0, "the cap on sessions one principal (a token's name, a client certificate's) "
                                                "holds at once; 0: no cap but --n-slots")
    auth_tokens_file: Path | None = option(None, "file of name:token lines, one principal each; calls must carry "
                                                 "'authorization: Bearer TOKEN' (health checks exempt). Entries in "
                                                 "$VERIFIER_AUTH_TOKENS count too; None: no token auth")
    auth_token: str | None = option(None, "one token on the command line (principal 'default'): every local user can "
                                          "read it in the process list, so prefer --auth-tokens-file; None: none")
    tls_cert: Path | None = option(None, "PEM server certificate (with --tls-key); None: plaintext")
    tls_key: Path | None = option(None, "PEM private key (with --tls-cert)")
    tls_client_ca: Path | None = option(None, "PEM CA bundle: require client certificates it signed (mutual TLS); "
                                              "without tokens a certificate's common name is its principal")
    max_message_mb: float = option(64.0, "largest response message, and the most a request may be, MiB")
    # Requests larger than this are refused by gRPC from their length prefix, before a byte of them
    # is parsed (a 30 MB request costs the event loop a third of a second to parse on a small CPU).
    # None: the largest request this server's own shape can need (app.request_limit_bytes).
    max_request_mb: float | None = option(None, "largest request message, MiB; None: what this server's calls can need "
                                                "(n_slots steps of max_k drafts with their probabilities, or a prompt of "
                                                "max_seq_len), at least 1 MiB and at most --max-message-mb")
    metrics_port: int | None = option(None, "serve Prometheus metrics on this port; None: no endpoint (GetStats still answers)")
    # Its own address, loopback by default: --host 0.0.0.0 opens gRPC, not the metrics.
    metrics_host: str = option("127.0.0.1", "address the metrics endpoint binds")
    metrics_token_file: Path | None = option(None, "file holding the bearer token a metrics scrape must send; None: none asked")
    grace_s: float = option(5.0, "shutdown: time in-flight calls get to finish")
    drain_s: float = option(0.0, "shutdown: time health says NOT_SERVING before the port closes")
    # A measurement switch (bench.serve): per-batch and per-request timestamps, kept in memory
    # (bounded) and written when the server stops; verifier/server/timings.py.
    round_timings: Path | None = option(None, "keep timestamps of every engine batch and answered request and write "
                                              "them to this JSON file when the server stops; None: none kept")

    def __post_init__(self):
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.device not in DEVICE_CHOICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.tensor_parallel > 1 and self.device.startswith("cuda:"):  # rank r runs on cuda:r
            raise ValueError(f"tensor_parallel {self.tensor_parallel} places rank r on cuda:r: pass device cuda, "
                             f"not {self.device!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        for name in ("n_slots", "max_batch_rows", "results_per_session", "tensor_parallel", "prefill_rows", "cohorts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.step_prompt_rows < 0:
            raise ValueError(f"step_prompt_rows must be >= 0, got {self.step_prompt_rows}")
        if self.graph_rows is not None:  # the engine checks the buckets themselves
            object.__setattr__(self, "graph_rows", tuple(self.graph_rows))
        if self.max_seq_len < 2:  # a prompt token and one generated
            raise ValueError(f"max_seq_len must be at least 2, got {self.max_seq_len}")
        if self.max_k < 0:
            raise ValueError(f"max_k must be >= 0, got {self.max_k}")
        if self.rollback not in ROLLBACK_MODES:
            raise ValueError(f"rollback must be one of {ROLLBACK_MODES}, got {self.rollback!r}")
        for name in ("max_wait_ms", "grace_s", "drain_s", "prefix_cache_gb"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not (math.isfinite(self.idle_timeout_s) and self.idle_timeout_s > 0):
            raise ValueError(f"idle_timeout_s must be a finite number > 0, got {self.idle_timeout_s}")
        if self.retry_after_ms < 0:
            raise ValueError(f"retry_after_ms must be >= 0, got {self.retry_after_ms}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: pass both or neither")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token is empty (pass None to turn auth off)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca asks clients for certificates over TLS: pass tls_cert and tls_key too")
        if self.max_sessions_per_principal < 0:
            raise ValueError(f"max_sessions_per_principal must be >= 0, got {self.max_sessions_per_principal}")
        if not (math.isfinite(self.max_message_mb) and self.max_message_mb > 0):
            raise ValueError(f"max_message_mb must be > 0, got {self.max_message_mb}")
        if self.max_request_mb is not None and not (math.isfinite(self.max_request_mb) and 0 < self.max_request_mb <= self.max_message_mb):
            raise ValueError(f"max_request_mb must be > 0 and at most max_message_mb ({self.max_message_mb:g}), got {self.max_request_mb}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mb * (1 << 20))
