"""The fleet driver (drafter/fleet.py) against a real verifier on loopback: many sessions from one
client, one request per round (a VerifyRounds message or a Verify call) carrying every unfinished
session's step; every stream equals plain decoding token for token (and logit row for logit row
where asked); a bad session fails alone."""

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest
import torch

from drafter.client import AsyncVerifierClient, VerifierClient
from drafter.fleet import Ended, Job, arun_fleet, run_fleet
from verifier.params import SamplingParams
from verifier.proposers import NgramProposer, OracleProposer, RandomProposer

from drafter_setup import client, plain_in_process, served_checkpoint, server, target  # noqa: F401 (fixtures)

NEW = 20
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.9, top_k=20, seed=11)


class Jobs:
    """A workload: hands out `jobs` in order to whichever lane is free, and keeps every report."""

    def __init__(self, jobs: list[Job]):
        self.todo = list(enumerate(jobs))
        self.job_of_lane: dict[int, int] = {}
        self.reports: dict[int, Ended] = {}  # job index -> how it ended

    def next_job(self, lane: int) -> Job | None:
        if not self.todo:
            return None
        index, job = self.todo.pop(0)
        self.job_of_lane[lane] = index
        return job

    def ended(self, report: Ended) -> None:
        self.reports[self.job_of_lane[report.lane]] = report


class CountingClient(VerifierClient):
    """Counts the rounds' requests (Verify calls, VerifyRounds messages) and the steps each carried."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[list[str]] = []  # per request: its steps' session ids
        self.methods: list[str] = []  # per request: how it went

    def verify(self, steps):
        self.calls.append([s.session_id for s in steps])
        self.methods.append("Verify")
        return super().verify(steps)

    def verify_rounds(self):
        rounds = super().verify_rounds()
        send = rounds.verify

        def verify(steps):
            self.calls.append([s.session_id for s in steps])
            self.methods.append("VerifyRounds")
            return send(steps)

        rounds.verify = verify
        return rounds


def prompt_for(vocab: int, length: int, seed: int) -> list[int]:
    ids = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    return ids * 2  # a repeat gives the n-gram drafter something to find


def mixed_jobs(target, n: int) -> tuple[list[Job], list]:
    """n jobs of every drafter and both samplings, and the plain run each must equal."""
    vocab = target.config.vocab_size
    jobs, expected = [], []
    for i in range(n):
        prompt, sampling = prompt_for(vocab, 4 + i % 3, seed=30 + i), (GREEDY, SAMPLED)[i % 2]
        plain = plain_in_process(target, prompt, NEW, sampling)
        proposer, k = [(None, 0), (NgramProposer(), 3), (RandomProposer(vocab, seed=i), 4),
                       (OracleProposer(len(prompt), plain.tokens), 5)][i % 4]
        jobs.append(Job(NEW, prompt_ids=prompt, proposer=proposer, k=k, sampling=sampling, return_logits=i % 3 == 0))
        expected.append(plain)
    return jobs, expected


@pytest.mark.parametrize("rounds_stream", [True, False], ids=["VerifyRounds", "Verify"])
def test_every_session_streams_its_plain_tokens_with_one_request_per_round(server, target, rounds_stream):
    jobs, expected = mixed_jobs(target, 7)
    workload = Jobs(jobs)
    with CountingClient(server.address, timeout_s=60) as client:
        before = client.stats()
        # 7 jobs on 4 lanes: freed lanes open new sessions
        fleet = run_fleet(client, workload, lanes=4, rounds_stream=rounds_stream)
        after = client.stats()
    assert client.methods == ["VerifyRounds" if rounds_stream else "Verify"] * len(fleet.rounds)
    assert sorted(workload.reports) == list(range(7))
    for i, plain in enumerate(expected):
        report = workload.reports[i]
        assert report.error is None and not report.cut, (i, report.error)
        assert report.generation.tokens == plain.tokens, f"job {i}: stream differs from plain decoding"
        assert report.generation.finish_reason == plain.finish_reason
        if jobs[i].return_logits:
            assert np.array_equal(report.generation.logits, plain.logits.numpy()), f"job {i}: logit rows differ"
    # one request per round, each carrying one step of every live session, never a session twice
    assert len(client.calls) == len(fleet.rounds)
    assert [len(c) for c in client.calls] == [r.steps for r in fleet.rounds]
    assert all(len(set(c)) == len(c) for c in client.calls)
    assert max(r.steps for r in fleet.rounds) == 4
    assert sum(r.steps for r in fleet.rounds) == after.steps - before.steps
    assert sum(r.tokens for r in fleet.rounds) == sum(len(p.tokens) - 1 for p in expected)
    assert after.open_sessions == before.open_sessions and not fleet.close_errors and not fleet.open_session_ids()


class Failing:
    def propose(self, context, k):
        raise RuntimeError("this proposer is broken")


def test_a_bad_session_fails_alone(server, target):
    vocab = target.config.vocab_size
    good, expected = mixed_jobs(target, 3)
    prompt = prompt_for(vocab, 5, seed=3)
    bad = [Job(NEW, prompt_ids=prompt, proposer=RandomProposer(vocab, seed=1), k=2),  # then out of the vocabulary:
           Job(NEW, prompt_ids=prompt, proposer=Failing(), k=2),
           Job(NEW, prompt_ids=[vocab + 5, 3])]
    out_of_vocab = bad[0].proposer
    out_of_vocab.propose = lambda context, k: [vocab + 1] * k if len(context) > len(prompt) + 3 else [3] * k
    workload = Jobs([bad[0], good[0], bad[1], good[1], bad[2], good[2]])
    with VerifierClient(server.address, timeout_s=60) as client:
        before = client.stats().open_sessions
        run_fleet(client, workload, lanes=6)
        assert client.stats().open_sessions == before
    reports = workload.reports
    assert reports[0].error.code == grpc.StatusCode.INVALID_ARGUMENT and len(reports[0].generation.tokens) > 1
    assert isinstance(reports[2].error, RuntimeError) and reports[2].generation.tokens == [reports[2].generation.tokens[0]]
    assert reports[4].error.code == grpc.StatusCode.INVALID_ARGUMENT and reports[4].generation is None
    for index, plain in zip((1, 3, 5), expected):
        assert reports[index].error is None and reports[index].generation.tokens == plain.tokens


def test_a_step_budget_and_the_deadline_cut_sessions_and_close_them(server, target):
    vocab = target.config.vocab_size
    prompt = prompt_for(vocab, 4, seed=5)
    plain = plain_in_process(target, prompt, NEW, GREEDY)

    class Slow(NgramProposer):
        def propose(self, context, k):
            time.sleep(0.3)
            return super().propose(context, k)

    workload = Jobs([Job(NEW, prompt_ids=prompt, max_steps=2), Job(NEW, prompt_ids=prompt, proposer=Slow(), k=2)])
    with VerifierClient(server.address, timeout_s=60) as client:
        before = client.stats().open_sessions
        fleet = run_fleet(client, workload, lanes=2, deadline=time.time() + 1.0)
        assert client.stats().open_sessions == before
    budget, slow = workload.reports[0], workload.reports[1]
    assert budget.cut and budget.generation.steps == 2 and budget.generation.tokens == plain.tokens[:3]
    assert slow.cut and slow.error is None and 1 <= slow.generation.steps < NEW - 1
    assert slow.generation.tokens == plain.tokens[: len(slow.generation.tokens)]
    assert len(fleet.rounds) == slow.generation.steps


def test_the_async_driver_gives_the_same_streams(server, target):
    jobs, expected = mixed_jobs(target, 5)
    workload = Jobs(jobs)

    async def run():
        async with AsyncVerifierClient(server.address, timeout_s=60) as client:
            return await arun_fleet(client, workload, lanes=5)

    fleet = asyncio.run(run())
    assert max(r.steps for r in fleet.rounds) == 5
    for i, plain in enumerate(expected):
        assert workload.reports[i].generation.tokens == plain.tokens
        if jobs[i].return_logits:
            assert np.array_equal(workload.reports[i].generation.logits, plain.logits.numpy())


def test_a_job_is_checked_on_construction():
    with pytest.raises(ValueError, match="exactly one"):
        Job(4)
    with pytest.raises(ValueError, match="max_steps"):
        Job(4, prompt_ids=[1], max_steps=0)


class ClosingClient(VerifierClient):
    """Logs each close beside the rounds the fleet reports, and holds the first two closes until both
    have begun: closes made one after another never get past that barrier."""

    def __init__(self, *args, log: list, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = log
        self.both_closing = threading.Barrier(2, timeout=10)

    def close_session(self, session_id):
        self.log.append(("close", session_id))
        if len([event for event in self.log if event[0] == "close"]) <= 2:
            self.both_closing.wait()  # BrokenBarrierError: the second close never began while the first ran
        return super().close_session(session_id)


def test_a_round_is_heard_before_its_ended_sessions_close_and_they_close_at_once(server, target):
    vocab = target.config.vocab_size
    prompts = [prompt_for(vocab, 4, seed=40 + i) for i in range(3)]
    workload = Jobs([Job(NEW, prompt_ids=prompt, max_steps=3) for prompt in prompts])  # all three end in round 2
    log: list = []
    with ClosingClient(server.address, timeout_s=60, log=log) as client:
        before = client.stats().open_sessions
        fleet = run_fleet(client, workload, lanes=3, on_round=lambda done: log.append(("round", done.index)))
        assert client.stats().open_sessions == before
    assert [r.steps for r in fleet.rounds] == [3, 3, 3]
    # the last round is heard first: closing its sessions is not the round's time
    assert log[:3] == [("round", 0), ("round", 1), ("round", 2)]
    assert sorted(event[0] for event in log[3:]) == ["close"] * 3
    assert not fleet.close_errors
    for report, prompt in zip(sorted(workload.reports.items()), prompts):
        assert report[1].cut and report[1].generation.tokens == plain_in_process(target, prompt, NEW, GREEDY).tokens[:4]
