"""The floor under one served step's latency, without a model: what a single session pays per step
before any engine work (the remote drafter's round trip, the served round's turnaround).
How it measures, what it checks and writes: bench/README.md, Methods, `bench.rpc_floor`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch

from bench.machine import NAME_HELP, check_name, device_name, results_path
from verifier import rpc

RESULTS = Path(__file__).resolve().parent / "results"


class _BareServicer:
    """Answers GetStats with an empty Stats; every other RPC UNIMPLEMENTED."""

    async def GetStats(self, request, context):
        return rpc.Stats()

    async def _unimplemented(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")

    GetModelInfo = OpenSession = Verify = VerifyStream = VerifyRounds = CloseSession = Generate = _unimplemented


def _bare_server(port_out, stop) -> None:
    async def main():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([rpc.servicer_handler(_BareServicer())])
        port_out.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await server.stop(0)

    asyncio.run(main())


def _noop_server(address_out, stop) -> None:
    from bench.server_overhead import MODEL, NoOpEngine
    from presets.hf_reference import save_spec
    from verifier.server.testing import LoopbackServer

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        with LoopbackServer(save_spec(MODEL, Path(tmp) / MODEL), engine_class=NoOpEngine, n_slots=1,
                            max_seq_len=10**6, max_k=0) as server:
            address_out.put(server.address)
            stop.wait()


def _in_process(target, timed) -> float:
    """Start `target(queue, stop)` in a spawned process, time `timed(its address)`, stop it."""
    ctx = multiprocessing.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    process = ctx.Process(target=target, args=(out, stop))
    process.start()
    try:
        return timed(out.get(timeout=120))
    finally:
        stop.set()
        process.join(timeout=30)


def _median_us(call, calls: int, repeats: int) -> float:
    for _ in range(max(10, calls // 10)):
        call()  # warm-up
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        runs.append((time.perf_counter() - started) / calls * 1e6)
    return round(statistics.median(runs), 1)


def grpc_empty_unary_us(calls: int, repeats: int) -> float:
    def timed(port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rpc.VerifierStub(channel)
            return _median_us(lambda: stub.GetStats(rpc.GetStatsRequest()), calls, repeats)

    return _in_process(_bare_server, timed)


def thread_handoff_us(calls: int, repeats: int) -> float:
    async def main():
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(max_workers=1) as executor:
            runs = []
            for _ in range(repeats + 1):
                started = time.perf_counter()
                for _ in range(calls):
                    await loop.run_in_executor(executor, int)
                runs.append((time.perf_counter() - started) / calls * 1e6)
        return round(statistics.median(runs[1:]), 1)

    return asyncio.run(main())


def verify_one_step_us(calls: int, repeats: int) -> float:
    def timed(address):
        with grpc.insecure_channel(address) as channel:
            stub = rpc.VerifierStub(channel)
            opened = stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=[1, 2, 3], max_new_tokens=10**6))
            position = [opened.position]

            def step():
                (result,) = stub.Verify(rpc.VerifyRequest(steps=[
                    rpc.VerifyStep(session_id=opened.session_id, expected_position=position[0])])).results
                assert result.status.code == 0 and result.position == position[0] + 1, result
                position[0] = result.position

            return _median_us(step, calls, repeats)

    return _in_process(_noop_server, timed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="round trips per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure (the median is kept)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for rpc_floor_<date>[_<name>].json")
    parser.add_argument("--name", default="", help=NAME_HELP)
    args = parser.parse_args(argv)
    try:
        check_name(args.name)
    except ValueError as exc:
        parser.error(str(exc))
    if args.calls < 1 or args.repeats < 1:
        parser.error("--calls and --repeats must be >= 1")
    figures = {
        "grpc_empty_unary_us": grpc_empty_unary_us(args.calls, args.repeats),
        "thread_handoff_us": thread_handoff_us(args.calls, args.repeats),
        "verify_one_step_us": verify_one_step_us(args.calls, args.repeats),
    }
    date = datetime.date.today().isoformat()
    report = {"device": device_name("cpu"), "date": date, "python": platform.python_version(), "torch": torch.__version__,
              "grpcio": grpc.__version__, "calls": args.calls, "repeats": args.repeats, "figures": figures}
    args.out.mkdir(parents=True, exist_ok=True)
    path = results_path(args.out, "rpc_floor", date, args.name)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print("; ".join(f"{k} {v}" for k, v in figures.items()) + f" -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
