"""The server's own cost per step: a loopback server whose engine does no work, driven hard.
How it measures, what it checks and writes: bench/README.md, Methods, `bench.server_overhead`.
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
from pathlib import Path

import grpc
import torch

from bench.machine import NAME_HELP, check_name, device_name, results_path
from presets.hf_reference import save_spec
from verifier import rpc
from verifier.engine import Engine, StepResult
from verifier.server.testing import LoopbackServer

MODEL = "qwen3_5_text"  # only its config and prefill are used: steps never run the model
SHAPES = ("stream", "unary", "unary_x4", "rounds_x4")
CALLERS = 4


class NoOpEngine(Engine):
    """Steps that return at once: every sequence emits token 0 and moves one position."""

    def step(self, requests):
        results = []
        for req in requests:
            seq = req.sequence
            seq.position += 1
            seq.pending = 0
            seq.emitted += 1
            results.append(StepResult(0, [0], seq.position, None, None))
        return results


async def _drive(address: str, shape: str, sessions: int, steps: int, out) -> float:
    """Open `sessions`, run `steps` steps each in `shape`, close; the wall seconds of the steps.
    Puts "start" on `out` once the sessions are open (the server's prefills stay out of its CPU figure)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rpc.VerifierStub(channel)
        opened = await asyncio.gather(*(stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=[1, 2, 3], max_new_tokens=10**6))
                                        for _ in range(sessions)))
        positions = {o.session_id: o.position for o in opened}
        out.put("start")
        started = time.perf_counter()
        if shape == "stream":
            await asyncio.gather(*(_stream(stub, o.session_id, o.position, steps) for o in opened))
        elif shape == "unary":
            for _ in range(steps):
                _check(positions, await stub.Verify(_round(positions, positions)))
        else:  # unary_x4, rounds_x4: four callers of a quarter of the sessions each, as bench.serve's four drafters
            ids = list(positions)
            quarters = [ids[i::CALLERS] for i in range(CALLERS)]
            if shape == "unary_x4":
                async def caller(mine):
                    for _ in range(steps):
                        _check(positions, await stub.Verify(_round(positions, mine)))
            else:
                async def caller(mine):
                    call = stub.VerifyRounds()
                    for _ in range(steps):
                        await call.write(_round(positions, mine))
                        _check(positions, await call.read())
                    await call.done_writing()
            await asyncio.gather(*(caller(mine) for mine in quarters))
        elapsed = time.perf_counter() - started
        out.put(elapsed)
        await asyncio.gather(*(stub.CloseSession(rpc.CloseSessionRequest(session_id=o.session_id)) for o in opened))
        return elapsed


def _round(positions: dict[str, int], sessions) -> rpc.VerifyRequest:
    """One plain step of each of `sessions`."""
    return rpc.VerifyRequest(steps=[rpc.VerifyStep(session_id=sid, expected_position=positions[sid]) for sid in sessions])


def _check(positions: dict[str, int], response: rpc.VerifyResponse) -> None:
    for result in response.results:
        assert result.status.code == 0 and result.position == positions[result.session_id] + 1, result
        positions[result.session_id] = result.position


async def _stream(stub, session_id: str, position: int, steps: int) -> None:
    call = stub.VerifyStream()
    for _ in range(steps):
        await call.write(rpc.VerifyStep(session_id=session_id, expected_position=position))
        result = await call.read()
        assert result.status.code == 0 and result.position == position + 1, result
        position = result.position
    await call.done_writing()


def _client(address: str, shape: str, sessions: int, steps: int, out) -> None:
    asyncio.run(_drive(address, shape, sessions, steps, out))


def measure(server: LoopbackServer, shape: str, sessions: int, steps: int) -> dict:
    """One run: server CPU and wall microseconds per step."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    client = ctx.Process(target=_client, args=(server.address, shape, sessions, steps, out))
    client.start()
    assert out.get(timeout=600) == "start"
    cpu_before = time.process_time()  # this process is the server's (the client runs in its own)
    wall = out.get(timeout=600)
    cpu = time.process_time() - cpu_before  # the steps only: not the opens' prefills, nor the closes
    client.join()
    n = sessions * steps
    return {"server_cpu_us_per_step": cpu / n * 1e6, "wall_us_per_step": wall / n * 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder of the results JSON")
    parser.add_argument("--label", default="after", help="key of these figures in the results file")
    parser.add_argument("--name", default="", help=NAME_HELP)
    parser.add_argument("--sessions", type=int, default=64, help="sessions stepping at once")
    parser.add_argument("--steps", type=int, default=200, help="steps per session per run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per shape (the median is kept)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    args = parser.parse_args(argv)
    try:
        check_name(args.name)
    except ValueError as exc:
        parser.error(str(exc))
    shapes = [shape for shape in args.shapes.split(",") if shape]
    if not shapes or set(shapes) - set(SHAPES):
        parser.error(f"--shapes: {args.shapes!r} names none or others than {', '.join(SHAPES)}")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_spec(MODEL, Path(tmp) / MODEL)
        with LoopbackServer(model_dir, engine_class=NoOpEngine, n_slots=args.sessions, max_seq_len=args.steps * 2 + 64,
                            max_k=0) as server:
            figures = {}
            for shape in shapes:
                measure(server, shape, args.sessions, max(10, args.steps // 10))  # warm-up
                runs = [measure(server, shape, args.sessions, args.steps) for _ in range(args.repeats)]
                figures[shape] = {key: round(statistics.median(r[key] for r in runs), 1) for key in runs[0]}
    date = datetime.date.today().isoformat()
    path = results_path(args.out, "server_overhead", date, args.name)
    report = json.loads(path.read_text()) if path.exists() else {}
    report.update(device=device_name("cpu"), date=date, python=platform.python_version(), torch=torch.__version__,
                  grpcio=grpc.__version__, sessions=args.sessions, steps_per_session=args.steps)
    report.setdefault("microseconds_per_step", {})[args.label] = figures
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.label}: " + "; ".join(f"{shape} {f['server_cpu_us_per_step']} us CPU, {f['wall_us_per_step']} us wall per step"
                                        for shape, f in figures.items()) + f" -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
