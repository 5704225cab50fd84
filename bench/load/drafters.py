"""One drafter process: many concurrent sessions over one grpc.aio channel, each running the one
generation loop (drafter.loop.DraftLoop) over a VerifyStream (or unary Verify) until its step
budget or the shared deadline is reached; then every session is closed.

    python -m bench.load.drafters CONFIG.json OUT.json

CONFIG: {"address", "plan" (workload.Plan), "sessions": [indices], "deadline" (time.time()), "transport"}.
OUT: per-step client latencies, counts, errors by code, and every generation's prompt and tokens
(the parent compares them with plain decoding). A failure ends that session only, never the others.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import asdict

from drafter.client import AsyncVerifierClient, RetryPolicy
from drafter.loop import STREAM, DraftLoop
from drafter.messages import VerifierError

from . import workload


class Tally:
    def __init__(self):
        self.latencies_ms: list[float] = []
        self.tokens = 0  # emitted by verify steps (the first token of each generation not counted)
        self.opens = 0
        self.errors: Counter[str] = Counter()
        self.generations: list[dict] = []
        self.cut_by_deadline = 0  # sessions stopped by the deadline before their step budget


async def run_session(client, info, plan: workload.Plan, index: int, deadline: float, transport: str, tally: Tally) -> None:
    done, generation = 0, 0
    sampling = workload.sampling(plan, index)
    while done < plan.steps and time.time() < deadline:
        prompt = workload.prompt(plan, index, generation)
        record = {"session": index, "generation": generation, "prompt": prompt, "sampling": asdict(sampling),
                  "max_new_tokens": plan.max_new_tokens, "tokens": [], "finish_reason": None, "error": None}
        tally.generations.append(record)
        session = loop = None
        try:
            session = await client.open_session(prompt, sampling=sampling, max_new_tokens=plan.max_new_tokens)
            tally.opens += 1
            record["prompt"] = session.prompt_ids
            loop = DraftLoop(session, info, workload.proposer(plan, index, generation), plan.k, plan.max_new_tokens,
                             sampling=sampling)
            steps = client.verify_stream() if transport == STREAM else client
            try:
                while not loop.finished and done < plan.steps and time.time() < deadline:
                    step = loop.next_step()
                    start = time.perf_counter()
                    outcome = await steps.step(step)
                    tally.latencies_ms.append((time.perf_counter() - start) * 1e3)
                    tally.tokens += len(loop.advance(step, outcome))
                    done += 1
            finally:
                if steps is not client:
                    await steps.close()
            record["finish_reason"] = loop.finish_reason
        except VerifierError as err:
            record["error"] = err.code.name
            tally.errors[err.code.name] += 1
            return
        except Exception as err:  # counted and reported, never hidden: the run then fails
            record["error"] = f"{type(err).__name__}: {err}"
            tally.errors[type(err).__name__] += 1
            return
        finally:
            if loop is not None:  # what was emitted before a deadline or an error is compared too
                record["tokens"] = list(loop.tokens)
            if session is not None:
                try:
                    await client.close_session(session.id)
                except VerifierError as err:
                    tally.errors[f"close:{err.code.name}"] += 1
        generation += 1
    if done < plan.steps:
        tally.cut_by_deadline += 1


async def run(config: dict) -> dict:
    plan = workload.Plan.from_json(config["plan"])
    tally = Tally()
    started = time.time()
    # No retries: every non-OK status counts as an error. A generous deadline: under load on a
    # small CPU a step may wait behind many others.
    async with AsyncVerifierClient(config["address"], timeout_s=120.0, retry=RetryPolicy(attempts=1)) as client:
        info = await client.model_info()
        await asyncio.gather(*(run_session(client, info, plan, i, config["deadline"], config["transport"], tally)
                               for i in config["sessions"]))
    return {"sessions": config["sessions"], "started": started, "ended": time.time(), "steps": len(tally.latencies_ms),
            "tokens": tally.tokens, "opens": tally.opens, "latencies_ms": tally.latencies_ms,
            "errors": dict(tally.errors), "cut_by_deadline": tally.cut_by_deadline, "generations": tally.generations}


def main(argv: list[str]) -> int:
    config_path, out_path = argv
    with open(config_path) as f:
        config = json.load(f)
    result = asyncio.run(run(config))
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
