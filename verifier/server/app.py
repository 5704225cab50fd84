"""The verifier process: load the model, build the engine, serve gRPC (our service, standard
health checking, reflection), optional auth, TLS and a Prometheus endpoint; drain and stop.

The shutdown's order is `VerifierServer.stop`'s, and only there. In short: health NOT_SERVING and
no new sessions (drain_s); then the grace period (grace_s): the gather window closes, every step
that reaches the service runs, streams end UNAVAILABLE once their accepted requests are answered;
the port stays open until every call has ended (verifier/server/calls.py: a call gRPC's core
holds unseen would otherwise end CANCELLED), and when the grace period runs out everything still
waiting is answered UNAVAILABLE by the service itself, saying how long the server waited. Only
then does gRPC stop and the port close; the worker finishes what it runs and stops.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from .. import rpc
from ..engine import Engine
from ..model import load_model
from ..model.mtp import load_mtp_head
from ..proposers.mtp import MTPDrafter
from ..tokenizer import TextTokenizer
from .auth import BearerTokenAuth
from .calls import CallBook, CallStarts
from .config import ServerConfig
from .malformed import MalformedRequestGuard
from .metrics import Metrics
from .metrics_http import MetricsEndpoint, read_token
from .principals import Principals, load_tokens
from .service import VerifierService

log = logging.getLogger(__name__)

HEALTH_SERVICES = ("", rpc.SERVICE_NAME)  # "" is the whole server
# after a cut, how long the calls get to end (handlers return within a turn of the event loop once
# answered), and gRPC's own grace when it stops: a call it would cancel then arrived after both
CUT_MARGIN_S = 1.0


def build_engine(config: ServerConfig, engine_class: type[Engine] = Engine, parallel=None) -> Engine:
    """The engine over the model config names; parallel: this rank's TensorParallel (its shards),
    None for one process. `engine_class` is called as Engine is (a subclass, or a factory)."""
    import torch

    model = load_model(config.model_dir, config.device, getattr(torch, config.dtype), parallel=parallel,
                       fp8_reals=config.fp8_reals)
    return engine_class(model, config.n_slots, config.max_seq_len, config.max_k, config.rollback,
                        graph_rows=config.graph_rows, prefix_cache_bytes=int(config.prefix_cache_gb * (1 << 30)))


class VerifierServer:
    def __init__(self, config: ServerConfig, engine: Engine | None = None):
        self.config = config
        # first: a bad token source fails before the model loads
        self.principals = Principals(load_tokens(config.auth_token, config.auth_tokens_file),
                                     client_certificates=config.tls_client_ca is not None)
        self._metrics_token = read_token(config.metrics_token_file) if config.metrics_token_file is not None else None
        self.engine = engine if engine is not None else build_engine(config)
        self.tokenizer = TextTokenizer.from_model_dir(config.model_dir)
        # the MTP head, for sessions drafting with server_drafter "mtp"; None: none in the
        # checkpoint, or `--no-mtp`. Its KV pool is made once, here: a slot per engine slot (a
        # session's MTP slot is its engine slot), every position of the engine's. None under tensor
        # parallelism: the head is not split across ranks (load_mtp_head refuses), so "ngram" is
        # the only server drafter then
        sharded = getattr(self.engine.model, "parallel", None) is not None
        self.mtp_head = load_mtp_head(config.model_dir, self.engine.model) if config.mtp and not sharded else None
        if self.mtp_head is not None and self.engine.prefix_cache is not None:
            self.engine.prefix_cache.keep_hidden = True  # cached prefixes keep the hidden rows an MTP session is fed
        self.mtp = MTPDrafter(self.mtp_head, self.engine.n_slots, self.engine.max_seq_len) if self.mtp_head is not None else None
        self.metrics = Metrics(self.engine.max_k)
        self.calls = CallBook()  # the calls in flight: the port closes once they have ended (stop)
        self.service: VerifierService | None = None
        self.address: str | None = None
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._metrics_http: MetricsEndpoint | None = None
        self.request_limit: int | None = None  # bytes, once started (request_limit_bytes)
        self._stopping: asyncio.Task | None = None  # the one shutdown: a second stop waits for it

    async def start(self) -> str:
        """Bind and serve; returns "host:port" (the real port when config.port is 0). A port that
        cannot be bound (gRPC's or the metrics one) is an OSError naming it, and nothing is left
        running."""
        self._start_metrics()  # first: a busy metrics port must fail before anything else runs
        try:
            return await self._start_grpc()
        except BaseException:
            self._stop_metrics()
            raise

    def _start_metrics(self) -> None:
        config = self.config
        if config.metrics_port is None:
            return
        self._metrics_http = MetricsEndpoint(self.metrics.registry, config.metrics_host, config.metrics_port, self._metrics_token)
        self.metrics_port = self._metrics_http.start()

    def _stop_metrics(self) -> None:
        if self._metrics_http is not None:
            self._metrics_http.stop()
            self._metrics_http = None

    async def _start_grpc(self) -> str:
        config = self.config
        interceptors = [CallStarts(self.calls)]  # first: every call's start counts, a stranger's too
        if self.principals.by_token:
            interceptors.append(BearerTokenAuth(self.principals))
        interceptors.append(MalformedRequestGuard())  # after auth: a stranger's bytes are not even parsed
        self.request_limit = request_limit_bytes(config, self.engine, self.tokenizer)
        options = [("grpc.max_receive_message_length", self.request_limit),
                   ("grpc.max_send_message_length", config.max_message_bytes),
                   ("grpc.so_reuseport", 0)]  # a second server on the same port must fail, not share it
        server = grpc.aio.server(interceptors=interceptors, options=options)
        host = f"[{config.host}]" if ":" in config.host and not config.host.startswith("[") else config.host
        target = f"{host}:{config.port}"
        try:
            port = self._bind(server, target)
        except BaseException:
            await server.stop(None)  # an unstarted server left to the garbage collector outlives the loop
            raise
        self.service = VerifierService(config, self.engine, self.tokenizer, self.metrics, self.mtp, self.calls, self.principals)
        server.add_generic_rpc_handlers([rpc.servicer_handler(self.service)])
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        _enable_reflection(server)
        await self.service.start()
        await server.start()
        self._server = server
        for name in HEALTH_SERVICES:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.address = f"{host}:{port}"
        return self.address

    def _bind(self, server: grpc.aio.Server, target: str) -> int:
        config = self.config
        _check_free(config.host, config.port, target)
        try:
            if config.tls_cert is not None:
                client_ca = config.tls_client_ca.read_bytes() if config.tls_client_ca is not None else None
                credentials = grpc.ssl_server_credentials([(config.tls_key.read_bytes(), config.tls_cert.read_bytes())],
                                                          root_certificates=client_ca, require_client_auth=client_ca is not None)
                return server.add_secure_port(target, credentials)
            return server.add_insecure_port(target)
        except RuntimeError as exc:  # grpc's way of saying the address cannot be bound
            raise OSError(f"cannot listen on {target} (--host, --port): {exc}") from None

    async def drain(self) -> None:
        """NOT_SERVING and no new sessions; open sessions keep stepping until stop."""
        if self.service is not None:
            self.service.draining = True
        if self._health is not None:
            for name in HEALTH_SERVICES:
                await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace_s: float | None = None, drain_s: float | None = None) -> None:
        """The shutdown, in this order (the one place it is decided):
        1. drain: health NOT_SERVING, OpenSession UNAVAILABLE; open sessions keep stepping (drain_s).
        2. begin_stop: the gather window closes (queued steps run now) and every step that reaches
           the service still runs; streams end UNAVAILABLE once their accepted requests are answered.
        3. the grace period (grace_s): wait until no call of the service is in flight and none has
           started for calls.QUIET_S, so gRPC's core holds no call the service has not seen.
        4. if the grace period ran out first, cut: every call still waiting is answered UNAVAILABLE,
           saying how long the server waited and why; the calls then end (CUT_MARGIN_S at most).
        5. gRPC stops: the port closes (a call that arrives now is refused by gRPC itself).
        6. the service stops: the batcher runs what is left, sessions close, the worker stops.
        A call received before the stop began is answered with its result, or UNAVAILABLE: never
        CANCELLED, never "the grace period ran out" before it did. A second call waits for the
        first's shutdown."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(grace_s, drain_s))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace_s: float | None, drain_s: float | None) -> None:
        config = self.config
        grace_s = config.grace_s if grace_s is None else grace_s
        began = time.monotonic()
        await self.drain()  # 1
        await asyncio.sleep(config.drain_s if drain_s is None else drain_s)
        if self.service is not None:
            self.service.begin_stop()  # 2
            if not await self.calls.settled(time.monotonic() + grace_s):  # 3
                waited = time.monotonic() - began
                self.service.cut(f"the server began stopping {waited:.1f} s ago and its grace period ({grace_s:g} s, --grace-s) "
                                 f"ran out before this was answered: retry on another replica")  # 4
                await self.calls.settled(time.monotonic() + CUT_MARGIN_S)
        if self._server is not None:
            await self._server.stop(CUT_MARGIN_S)  # 5
        if self.service is not None:
            await self.service.stop()  # 6
        self._stop_metrics()


MIN_REQUEST_BYTES = 1 << 20  # the derived request limit's floor: headroom for ids, metadata and future fields
STEP_FIELD_BYTES = 512  # a VerifyStep's session id, request id, position and framing, generously


def request_limit_bytes(config: ServerConfig, engine: Engine, tokenizer) -> int:
    """The largest request message the server accepts (--max-request-mb, or what its own shape can
    need): a Verify of n_slots steps, each of max_k drafts (5 bytes an id at most) with their
    draft_probs (max_k x vocab float32), or an OpenSession of a prompt filling the context, as ids
    or as text (no token covers more than the tokenizer's longest token, at most 4 UTF-8 bytes a
    character). At least MIN_REQUEST_BYTES, at most --max-message-mb."""
    if config.max_request_mb is not None:
        return int(config.max_request_mb * (1 << 20))
    max_k, positions = engine.max_k, engine.max_seq_len
    verify = engine.n_slots * (STEP_FIELD_BYTES + max_k * 5 + max_k * engine.vocab_size * 4)
    text = positions * tokenizer.longest_token_bytes * 4 if tokenizer is not None else 0
    open_session = STEP_FIELD_BYTES + positions * 5 + text
    return min(config.max_message_bytes, max(MIN_REQUEST_BYTES, verify, open_session))


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _enable_reflection(server: grpc.aio.Server) -> None:
    """Server reflection under both its names: v1 (what current grpcurl, Postman and grpc-js tools
    ask first) and v1alpha (older ones). The two protocols' messages are the same fields under two
    package names, so one servicer answers both. Reflection is a method like the others: with
    tokens configured it needs one."""
    names = (rpc.SERVICE_NAME, health.SERVICE_NAME, REFLECTION_V1, reflection.SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(servicer.ServerReflectionInfo,
                                               request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                                               response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": v1})])


def _check_free(host: str, port: int, target: str) -> None:
    """OSError naming the flags when host:port cannot be bound, asked of the OS before gRPC is:
    gRPC's core logs its own failure to stderr before it raises, which would print a second line
    beside ours. Port 0 (any free port) needs no asking."""
    if port == 0:
        return
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                                                  flags=socket.AI_PASSIVE):
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: a port in TIME_WAIT is free
                probe.bind(address)
    except OSError as exc:
        raise OSError(f"cannot listen on {target} (--host, --port): {exc.strerror or exc}") from None


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def serve_until_signalled(server: VerifierServer, signals: tuple = STOP_SIGNALS) -> None:
    """signals: those that stop the server (a tensor-parallel rank 0 takes SIGINT only, which its
    launching process sends it: SIGTERM is the launcher's way to end a rank at once)."""
    address = await server.start()
    # the handlers before the line that says the server listens: a signal right after it stops it cleanly
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:  # the first signal starts the shutdown; any later one ends the process at once
        _stop_at_once() if stop.is_set() else stop.set()

    for signum in signals:
        loop.add_signal_handler(signum, on_signal)
    extra = f", requests up to {server.request_limit / (1 << 20):.3g} MiB"
    extra += f", metrics on {server.config.metrics_host}:{server.metrics_port}" if server.metrics_port is not None else ""
    scheme = "TLS" if server.config.tls_cert is not None else "plaintext"
    print(f"listening on {address} ({scheme}{extra})", file=sys.stderr, flush=True)
    await stop.wait()
    config = server.config
    print(f"stopping: {config.drain_s:g} s with health NOT_SERVING (--drain-s), then up to {config.grace_s:g} s for calls in "
          f"flight (--grace-s); a second Ctrl-C or SIGTERM stops at once", file=sys.stderr, flush=True)
    await server.stop()
    for signum in signals:  # from here on, as the process exits, a signal ends it at once (130)
        loop.remove_signal_handler(signum)
        signal.signal(signum, lambda *_: _stop_at_once())
    print("stopped", file=sys.stderr, flush=True)


def _stop_at_once() -> None:
    """The second signal: the process ends now, calls in flight with it (exit status 130, as an
    interrupted command's)."""
    print("stopping at once: calls in flight are cut", file=sys.stderr, flush=True)
    os._exit(130)


def serve(config: ServerConfig) -> int:
    """`python -m verifier serve`: serve until SIGTERM or SIGINT, then shut down gracefully, and end
    the process: exit 0 once stopped, 130 for a second signal, even one that comes while the
    process exits (the interpreter's own teardown would set the signals back to their default
    action, and a SIGTERM then would end it 143: so it is skipped, nothing being left to run)."""
    server = VerifierServer(config)
    asyncio.run(serve_until_signalled(server))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
