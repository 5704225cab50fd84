"""The abuse table: one `python -m verifier serve` with two principals (a witness's and an
abuser's), a witness session stepping beside every attempt, and each way one client could hurt
the others tried in turn.

    PYTHONPATH=. python -m bench.abuse --out bench/results [--model shipped] [--device cpu]

Per attempt: the status the abuser got (a gRPC code name, or the step's, with its message), how
long it took, the longest health-check round trip while it ran, the server's peak resident memory
and thread count, and the witness's longest step. At the end the witness's streams are compared
with plain decoding in this process (same checkpoint, device and dtype). PASS when every attempt
got a clear status (none UNKNOWN, INTERNAL or DEADLINE_EXCEEDED), every health round trip took
under HEALTH_LIMIT_MS, the server's memory stayed within RSS_LIMIT_MIB of idle, and every witness
stream equals plain. Writes DIR/abuse_<date>[_<name>].json.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.load.progress import say
from bench.load.reference import decode_plainly
from bench.load.report import today, versions
from bench.load.server import ServerProcess, rss_mib
from bench.machine import NAME_HELP, check_name, device_name, results_path
from verifier import rpc
from verifier.arguments import OneLineErrors
from verifier.defaults import SHIPPED_TARGET
from verifier.engine import Engine
from verifier.model import load_model
from verifier.params import SamplingParams
from verifier.server.convert import code_name

TAG = "abuse"
HEALTH_LIMIT_MS = 100.0  # the longest health round trip an attempt may cause
RSS_LIMIT_MIB = 512.0  # the most the server may grow over idle during an attempt
UNCLEAR = {"UNKNOWN", "INTERNAL", "DEADLINE_EXCEEDED"}
WITNESS, ABUSER = "witness", "mallory"
WITNESS_PROMPT, WITNESS_NEW, WITNESS_DRAFTS = [5, 17, 33, 2, 9], 48, 3
N_SLOTS, MAX_SEQ_LEN, QUOTA = 8, 512, 4


def metadata(name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {name}-token"),)


class Watch:
    """Health round trips, the server's RSS and threads, sampled every 20 ms (in the observer process)."""

    def __init__(self, address: str, pid: int):
        self.pid = pid
        self._channel = grpc.insecure_channel(address)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self.samples: list[tuple[float, float, float, int]] = []  # (time, health ms, rss MiB, threads)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="abuse-watch")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.perf_counter()
            try:
                self._health.Check(health_pb2.HealthCheckRequest(), timeout=30)
                health_ms = (time.perf_counter() - began) * 1000
            except grpc.RpcError:
                health_ms = float("inf")
            self.samples.append((time.monotonic(), health_ms, rss_mib(self.pid), threads(self.pid)))
            time.sleep(0.02)

    def worst_since(self, began: float) -> dict:
        seen = [s for s in self.samples if s[0] >= began] or self.samples[-1:]
        return {"longest_health_ms": round(max(s[1] for s in seen), 1), "peak_rss_mib": round(max(s[2] for s in seen), 1),
                "peak_threads": max(s[3] for s in seen)}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        self._channel.close()


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


class Witness:
    """One session after another of the witness principal, stepped with drafts from the plain
    continuation (every other step's last draft wrong), each step's latency kept (in the
    observer process)."""

    def __init__(self, address: str, plain: list[int]):
        self.plain = plain
        self._channel = grpc.insecure_channel(address)
        self.stub = rpc.VerifierStub(self._channel)
        self.vocab = self.stub.GetModelInfo(rpc.GetModelInfoRequest(), metadata=metadata(WITNESS), timeout=60).vocab_size
        self.streams: list[list[int]] = []
        self.steps: list[tuple[float, float]] = []  # (time it ended, ms)
        self.errors: list[str] = []
        self.session_id = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="abuse-witness")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.streams.append(self._one())
            except grpc.RpcError as exc:
                self.errors.append(f"{exc.code().name}: {exc.details()}")
                time.sleep(0.05)

    def _one(self) -> list[int]:
        opened = self.stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=WITNESS_PROMPT, max_new_tokens=WITNESS_NEW),
                                       metadata=metadata(WITNESS), timeout=60)
        self.session_id = opened.session_id
        tokens, position, finished, step = [opened.first_token], opened.position, opened.finish_reason != 0, 0
        while not finished:
            drafts = list(self.plain[len(tokens):len(tokens) + WITNESS_DRAFTS])
            if step % 2 and drafts:  # a wrong last draft: a rollback every other step
                drafts[-1] = (drafts[-1] + 1) % self.vocab
            began = time.perf_counter()
            (result,) = self.stub.Verify(rpc.VerifyRequest(steps=[rpc.VerifyStep(session_id=opened.session_id,
                                                                                  expected_position=position, draft_ids=drafts)]),
                                         metadata=metadata(WITNESS), timeout=60).results
            self.steps.append((time.monotonic(), (time.perf_counter() - began) * 1000))
            if result.status.code:
                raise RuntimeError(f"a witness step failed: {result.status.code} {result.status.message}")
            tokens += result.tokens
            position, finished, step = result.position, result.finish_reason != 0, step + 1
        self.stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id), metadata=metadata(WITNESS), timeout=60)
        return tokens

    def longest_step_ms(self, since: float) -> float:
        return round(max((ms for t, ms in self.steps if t >= since), default=0.0), 1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        self._channel.close()


def observe(address: str, pid: int, plain: list[int], commands) -> None:
    """The observer process: a Watch and a Witness, answering the bench's commands over a pipe
    ("mark", "since", "session", "stop"), so the abuser's own work in the bench process never
    delays what is measured."""
    watch, witness = Watch(address, pid), Witness(address, plain)
    began = time.monotonic()
    while True:
        command = commands.recv()
        if command == "mark":
            began = time.monotonic()
            commands.send(None)
        elif command == "since":
            time.sleep(0.1)  # a sample after the attempt: memory it left held shows
            commands.send({**watch.worst_since(began), "witness_longest_step_ms": witness.longest_step_ms(began)})
        elif command == "session":
            commands.send(witness.session_id)
        elif command == "stop":
            witness.stop()
            watch.stop()
            commands.send({"streams": witness.streams, "errors": witness.errors[:10]})
            return


# -- the attempts: each prepares its request (outside the measured window: serializing 30M ids
# costs the bench, not the server) and returns what sends it -> (status, detail) -------------------

def _outcome(call) -> tuple[str, str]:
    try:
        reply = call()
    except grpc.RpcError as exc:
        return exc.code().name, (exc.details() or "")[:200]
    results = getattr(reply, "results", None)
    if results:
        worst = next((r for r in results if r.status.code), results[0])
        return code_name(worst.status.code) if worst.status.code else "OK", worst.status.message[:200]
    return "OK", ""


def _sending(ctx, method: str, request, reply_type, token: str | None = ABUSER):
    """A prepared unary call: the request serialized now, sent by the returned callable."""
    payload = request if isinstance(request, bytes) else request.SerializeToString()
    call = ctx["channel"].unary_unary(f"/{rpc.SERVICE_NAME}/{method}", request_serializer=lambda b: b,
                                      response_deserializer=reply_type.FromString)
    return lambda: _outcome(lambda: call(payload, metadata=metadata(token) if token else None, timeout=60))


def huge_text(ctx):
    return _sending(ctx, "OpenSession", rpc.OpenSessionRequest(text="a" * (48 << 20), max_new_tokens=4), rpc.OpenSessionResponse)


def huge_prompt_ids(ctx):
    return _sending(ctx, "OpenSession", rpc.OpenSessionRequest(prompt_ids=[5] * 30_000_000, max_new_tokens=4), rpc.OpenSessionResponse)


def huge_draft_ids(ctx):
    step = rpc.VerifyStep(session_id="f" * 32, expected_position=1, draft_ids=[5] * 25_000_000)
    return _sending(ctx, "Verify", rpc.VerifyRequest(steps=[step]), rpc.VerifyResponse)


def unauthenticated(ctx):
    return _sending(ctx, "OpenSession", rpc.OpenSessionRequest(text="a" * (60 << 20), max_new_tokens=4), rpc.OpenSessionResponse,
                    token=None)


def stranger(ctx):
    return _sending(ctx, "OpenSession", rpc.OpenSessionRequest(prompt_ids=[1, 2], max_new_tokens=4), rpc.OpenSessionResponse,
                    token=None)


def ids_under_the_limit(ctx):
    """As many prompt ids as the request limit lets in (1-byte ids): refused by their count, unread."""
    n = ctx["request_limit"] - 64
    return _sending(ctx, "OpenSession", rpc.OpenSessionRequest(prompt_ids=[5] * n, max_new_tokens=4), rpc.OpenSessionResponse)


def many_steps(ctx):
    return _sending(ctx, "Verify", rpc.VerifyRequest(steps=[rpc.VerifyStep(session_id="x") for _ in range(1_000_000)]),
                    rpc.VerifyResponse)


def unread_stream(ctx):
    """Send steps and never read the answers for 10 s: the server stops reading past its window."""
    def fire():
        sent = [0]

        def requests():
            while True:
                sent[0] += 1
                yield rpc.VerifyStep(session_id="f" * 32, expected_position=1)

        call = ctx["stub"].VerifyStream(requests(), metadata=metadata(ABUSER), timeout=60)
        time.sleep(10)
        call.cancel()
        return "CANCELLED", f"cancelled by the client after 10 s unread; its generator yielded {sent[0]} steps"
    return fire


def anothers_session(ctx):
    sid = ctx["witness_session"]()
    step = _sending(ctx, "Verify", rpc.VerifyRequest(steps=[rpc.VerifyStep(session_id=sid, expected_position=5)]), rpc.VerifyResponse)

    def fire():
        code, detail = step()
        closed = ctx["stub"].CloseSession(rpc.CloseSessionRequest(session_id=sid), metadata=metadata(ABUSER), timeout=60).closed
        return code, f"{detail}; CloseSession closed={closed}"
    return fire


def every_slot(ctx):
    def fire():
        stub, held, outcome = ctx["stub"], [], ("OK", "never refused")
        for _ in range(N_SLOTS + 1):
            try:
                held.append(stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=[1, 2], max_new_tokens=4),
                                             metadata=metadata(ABUSER), timeout=60))
            except grpc.RpcError as exc:
                trailer = dict(exc.trailing_metadata() or ())
                outcome = (exc.code().name, f"after {len(held)} opens: {exc.details()[:150]} (retry-after-ms "
                                            f"{trailer.get(rpc.RETRY_AFTER_KEY)})")
                break
        for opened in held:
            stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id), metadata=metadata(ABUSER), timeout=60)
        return outcome
    return fire


def half_open_metrics(ctx):
    def fire():
        sockets = []
        for _ in range(300):
            try:
                sockets.append(socket.create_connection(("127.0.0.1", ctx["metrics_port"]), timeout=5))
            except OSError:
                break
        time.sleep(3)
        for sock in sockets:
            sock.close()
        return "OK", f"{len(sockets)} silent connections held 3 s"
    return fire


def tiny_sampling(ctx):
    sampling = rpc.Sampling(temperature=1e-310, top_p=1e-300)
    return _sending(ctx, "OpenSession", rpc.OpenSessionRequest(prompt_ids=[1, 2], max_new_tokens=4, sampling=sampling),
                    rpc.OpenSessionResponse)


def malformed_bytes(ctx):
    return _sending(ctx, "OpenSession", b"\xff" * 4096, rpc.OpenSessionResponse)


ATTEMPTS = {
    "OpenSession text of 48 MiB": huge_text,
    "OpenSession prompt_ids of 30M": huge_prompt_ids,
    "Verify draft_ids of 25M": huge_draft_ids,
    "OpenSession of 60 MiB without a token": unauthenticated,
    "OpenSession without a token": stranger,
    "OpenSession prompt_ids filling the request limit": ids_under_the_limit,
    "Verify of 1M steps": many_steps,
    "VerifyStream never read": unread_stream,
    "another principal's session": anothers_session,
    "every slot by one principal": every_slot,
    "300 silent metrics connections": half_open_metrics,
    "sampling below float32": tiny_sampling,
    "malformed request bytes": malformed_bytes,
}


def run(model_dir: Path, device: str, dtype: str, only: list[str] | None = None) -> dict:
    import multiprocessing

    say(f"plain decoding of the witness prompt ({WITNESS_NEW} tokens)", TAG)
    engine = Engine(load_model(model_dir, device, getattr(torch, dtype)), 1, MAX_SEQ_LEN, 0)
    ((plain, _),) = decode_plainly(engine, [(WITNESS_PROMPT, SamplingParams(), WITNESS_NEW)])
    del engine
    with tempfile.TemporaryDirectory() as scratch:
        tokens = Path(scratch) / "tokens"
        tokens.write_text(f"{WITNESS}:{WITNESS}-token\n{ABUSER}:{ABUSER}-token\n")
        server = ServerProcess(model_dir, device=device, dtype=dtype, n_slots=N_SLOTS, max_seq_len=MAX_SEQ_LEN,
                               extra_args=("--auth-tokens-file", str(tokens), "--max-sessions-per-principal", str(QUOTA),
                                           "--metrics-port", "0", "--idle-timeout-s", "60"))
    listening = next(line for line in server.lines if "listening on" in line)
    metrics_port = int(re.search(r"metrics on \S+:(\d+)", listening).group(1))
    request_limit = int(float(re.search(r"requests up to (\S+) MiB", listening).group(1)) * (1 << 20))
    channel = grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 100 << 20),
                                                             ("grpc.max_receive_message_length", 100 << 20)])
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    observer = multiprocessing.get_context("spawn").Process(target=observe, args=(server.address, server.pid, list(plain), theirs),
                                                            daemon=True)
    rows, seen = [], {"streams": [], "errors": ["the observer did not report"]}

    def ask(command):
        ours.send(command)
        return ours.recv()

    try:
        observer.start()
        time.sleep(5)  # the witness steps; memory settles after the first batches
        idle = {"rss_mib": round(server.rss_mib(), 1), "threads": threads(server.pid)}
        ctx = {"channel": channel, "stub": rpc.VerifierStub(channel), "metrics_port": metrics_port, "request_limit": request_limit,
               "witness_session": lambda: ask("session")}
        for name, attempt in ATTEMPTS.items():
            if only and name not in only:
                continue
            fire = attempt(ctx)
            ask("mark")
            row = {"attempt": name}
            began = time.monotonic()
            row["status"], row["detail"] = fire()
            row["seconds"] = round(time.monotonic() - began, 3)
            row.update(ask("since"))
            rows.append(row)
            say(f"{name}: {row['status']} ({row['detail'][:80]}); health {row['longest_health_ms']} ms, RSS {row['peak_rss_mib']} MiB, "
                f"witness step {row['witness_longest_step_ms']} ms", TAG)
        time.sleep(2)
        seen = ask("stop")
    finally:
        channel.close()
        server.stop()
        observer.join(timeout=60)
    equal = [stream == list(plain) for stream in seen["streams"]]
    result = {
        "idle": idle, "request_limit_bytes": request_limit, "attempts": rows, "witness_streams": len(equal), "witness_equal": sum(equal),
        "witness_errors": seen["errors"],
        "limits": {"health_ms": HEALTH_LIMIT_MS, "rss_over_idle_mib": RSS_LIMIT_MIB},
    }
    result["pass"] = bool(
        rows and equal and all(equal) and not seen["errors"]
        and all(r["status"] not in UNCLEAR for r in rows)
        and all(r["longest_health_ms"] < HEALTH_LIMIT_MS for r in rows)
        and all(r["peak_rss_mib"] - idle["rss_mib"] <= RSS_LIMIT_MIB for r in rows))
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="python -m bench.abuse", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder of the results JSON")
    parser.add_argument("--model", type=Path, default=SHIPPED_TARGET, help="checkpoint the server serves")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--attempts", default=None, help="comma-separated attempt names to run (default: all): " + "; ".join(ATTEMPTS))
    parser.add_argument("--name", type=check_name, default=None, help=NAME_HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    only = [a.strip() for a in args.attempts.split(",")] if args.attempts else None
    unknown = [a for a in only or () if a not in ATTEMPTS]
    if unknown:
        build_parser().error(f"argument --attempts: unknown {unknown}")
    result = {"device": device_name(args.device), "date": today(), **versions(), "model": args.model.name,
              **run(args.model, args.device, args.dtype, only)}
    args.out.mkdir(parents=True, exist_ok=True)
    path = results_path(args.out, "abuse", today(), args.name)
    path.write_text(json.dumps(result, indent=1) + "\n")
    say(f"{'PASS' if result['pass'] else 'FAIL'}: wrote {path}", TAG)
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
