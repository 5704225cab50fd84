"""One drafter process: many sessions over one channel, each running the one generation loop
(drafter.loop.DraftLoop), until its step budget or the shared deadline is reached; then every
session is closed. A failure ends that session only, never the others.
How it measures, what it checks and writes: bench/README.md, Methods, `bench.load.drafters`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time
from collections import Counter
from dataclasses import asdict

from drafter.client import AsyncVerifierClient, RetryPolicy, VerifierClient
from drafter.fleet import Ended, Job, Round, run_fleet
from drafter.loop import STREAM, DraftLoop
from drafter.messages import VerifierError

from . import workload

FLEET = "fleet"
FLEET_VERIFY = "fleet-verify"
FLEETS = (FLEET, FLEET_VERIFY)
# No retries: every non-OK status counts as an error. A generous deadline: under load on a small
# CPU a step may wait behind many others.
NO_RETRIES, CALL_TIMEOUT_S = RetryPolicy(attempts=1), 120.0


class Tally:
    def __init__(self):
        self.latencies_ms: list[float] = []
        self.tokens = 0  # emitted by verify steps (the first token of each generation not counted)
        self.opens = 0
        self.errors: Counter[str] = Counter()
        self.generations: list[dict] = []
        self.cut_by_deadline = 0  # sessions stopped by the deadline before their step budget
        self.rounds = 0  # fleet: timed Verify calls
        self.started = self.ended = time.time()
        # fleet, this process's perf_counter: the timed rounds' requests (send to answer) and
        # proposals, and the time from the start of the timed part to the end of its last round;
        # over that same part, the process's CPU time (every thread's: gRPC's too) and the
        # collector's pauses, which say whether the time outside the requests was work or waiting
        self.round_seconds = {"request": 0.0, "proposing": 0.0, "timed": 0.0, "cpu": 0.0, "gc": 0.0}
        self.round_requests: list[list] = []  # fleet: per timed round, [request id, request seconds]
        self.clock_started = time.perf_counter()
        self.cpu_started = time.process_time()
        self.pauses = CollectorPauses()
        self.gc_started = 0.0

    def failed(self, record: dict, err: Exception) -> None:
        """Counted and reported, never hidden: the run then fails."""
        record["error"] = err.code.name if isinstance(err, VerifierError) else f"{type(err).__name__}: {err}"
        self.errors[err.code.name if isinstance(err, VerifierError) else type(err).__name__] += 1

    def result(self, sessions: list[int]) -> dict:
        return {"sessions": sessions, "started": self.started, "ended": self.ended, "steps": len(self.latencies_ms),
                "tokens": self.tokens, "opens": self.opens, "latencies_ms": self.latencies_ms, "rounds": self.rounds,
                "round_seconds": self.round_seconds, "round_requests": self.round_requests,
                "errors": dict(self.errors), "cut_by_deadline": self.cut_by_deadline, "generations": self.generations}


class CollectorPauses:
    """The cyclic garbage collector's pauses in this process, summed (gc.callbacks: start to stop)."""

    def __init__(self):
        self.seconds, self._began = 0.0, None
        gc.callbacks.append(self._heard)

    def _heard(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self._began = None


def new_record(plan: workload.Plan, index: int, generation: int) -> dict:
    return {"session": index, "generation": generation, "prompt": workload.prompt(plan, index, generation),
            "sampling": asdict(workload.sampling(plan, index)), "max_new_tokens": plan.max_new_tokens, "tokens": [],
            "finish_reason": None, "error": None}


# -- fleet: one request per round for every session of the process ----------------------------


class PlanSessions:
    """The plan's sessions as fleet lanes (drafter.fleet.Workload): lane i runs session sessions[i]'s
    generations back to back until its steps are done, the plan's generations are opened, or one fails."""

    def __init__(self, plan: workload.Plan, sessions: list[int], references: dict[int, list[int]] | None, tally: Tally):
        self.plan, self.sessions, self.references, self.tally = plan, sessions, references, tally
        self.steps_done = [0] * len(sessions)
        self.generation = [0] * len(sessions)
        self.failed = [False] * len(sessions)

    def next_job(self, lane: int) -> Job | None:
        plan, index, generation = self.plan, self.sessions[lane], self.generation[lane]
        if self.failed[lane] or not plan.opens_another(self.steps_done[lane], generation):
            return None
        return Job(plan.max_new_tokens, prompt_ids=workload.prompt(plan, index, generation),
                   proposer=workload.proposer(plan, index, generation, self.references), k=plan.k,
                   sampling=workload.sampling(plan, index), max_steps=plan.steps - self.steps_done[lane])

    def ended(self, report: Ended) -> None:
        lane = report.lane
        record = new_record(self.plan, self.sessions[lane], self.generation[lane])
        self.tally.generations.append(record)
        self.generation[lane] += 1
        if report.generation is not None:  # what was emitted before a deadline or an error is compared too
            self.tally.opens += 1
            self.steps_done[lane] += report.generation.steps
            record.update(prompt=report.generation.prompt_ids, tokens=list(report.generation.tokens),
                          finish_reason=report.generation.finish_reason)
        if report.error is not None:
            self.failed[lane] = True
            self.tally.failed(record, report.error)

    def cut_by_deadline(self) -> int:
        """Sessions that would have gone on (steps and generations left, no error) when the deadline came,
        those it stopped before their first open included."""
        return sum(not self.failed[lane] and self.plan.opens_another(self.steps_done[lane], self.generation[lane])
                   for lane in range(len(self.sessions)))


class StartLine:
    """Where the timed part starts: after `warmup_rounds` rounds, "ready" goes to the parent and the
    process waits for its line on stdin (with no warm-up, at once and without asking)."""

    def __init__(self, warmup_rounds: int, tally: Tally):
        self.warmup_rounds, self.tally = warmup_rounds, tally
        self.crossed = warmup_rounds == 0

    def cross(self) -> None:
        if not self.crossed:
            self.crossed = True
            print("ready", flush=True)
            sys.stdin.readline()
            self.tally.started = self.tally.ended = time.time()
            self.tally.clock_started = time.perf_counter()
            self.tally.cpu_started = time.process_time()
            self.tally.gc_started = self.tally.pauses.seconds

    def on_round(self, done: Round) -> None:
        if done.index < self.warmup_rounds:
            if done.index + 1 == self.warmup_rounds:
                self.cross()
            return
        self.tally.rounds += 1
        self.tally.latencies_ms += [done.seconds * 1e3] * done.steps  # every step of a round waits for the call
        self.tally.tokens += done.tokens
        self.tally.ended = time.time()
        seconds = self.tally.round_seconds
        seconds["request"] += done.seconds
        if done.request_id:
            self.tally.round_requests.append([done.request_id, done.seconds])
        seconds["proposing"] += done.proposing
        seconds["timed"] = time.perf_counter() - self.tally.clock_started
        seconds["cpu"] = time.process_time() - self.tally.cpu_started
        seconds["gc"] = self.tally.pauses.seconds - self.tally.gc_started


def run_as_fleet(config: dict, plan: workload.Plan, references: dict[int, list[int]] | None, tally: Tally) -> None:
    start = StartLine(config.get("warmup_rounds", 0), tally)
    sessions = PlanSessions(plan, config["sessions"], references, tally)
    with VerifierClient(config["address"], timeout_s=CALL_TIMEOUT_S, retry=NO_RETRIES) as client:
        run_fleet(client, sessions, len(config["sessions"]), deadline=config["deadline"], on_round=start.on_round,
                  rounds_stream=config["transport"] == FLEET)
    tally.cut_by_deadline = sessions.cut_by_deadline()
    start.cross()  # sessions that ended before the warm-up did: the parent still waits for this line


# -- per session: its own task, over a VerifyStream or unary Verify calls -------------------------


async def run_session(client, info, plan: workload.Plan, index: int, deadline: float, transport: str, tally: Tally) -> None:
    done, generation = 0, 0
    sampling = workload.sampling(plan, index)
    while plan.opens_another(done, generation) and time.time() < deadline:
        record = new_record(plan, index, generation)
        tally.generations.append(record)
        session = loop = None
        try:
            session = await client.open_session(record["prompt"], sampling=sampling, max_new_tokens=plan.max_new_tokens)
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
        except Exception as err:
            tally.failed(record, err)
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
    if done < plan.steps and time.time() >= deadline:
        tally.cut_by_deadline += 1


async def run_per_session(config: dict, plan: workload.Plan, tally: Tally) -> None:
    async with AsyncVerifierClient(config["address"], timeout_s=CALL_TIMEOUT_S, retry=NO_RETRIES) as client:
        info = await client.model_info()
        await asyncio.gather(*(run_session(client, info, plan, i, config["deadline"], config["transport"], tally)
                               for i in config["sessions"]))
    tally.ended = time.time()


def run(config: dict) -> dict:
    plan = workload.Plan.from_json(config["plan"])
    references = {int(s): tokens for s, tokens in config.get("references", {}).items()} or None
    tally = Tally()
    if config["transport"] in FLEETS:
        run_as_fleet(config, plan, references, tally)
    elif config.get("warmup_rounds") or references:
        raise ValueError("warmup_rounds and references are for the fleet transport")
    else:
        asyncio.run(run_per_session(config, plan, tally))
    return tally.result(config["sessions"])


def main(argv: list[str]) -> int:
    config_path, out_path = argv
    with open(config_path) as f:
        config = json.load(f)
    result = run(config)
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
