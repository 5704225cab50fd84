"""Witness sessions: the bystanders of every reliability test. Background threads step a few
sessions (greedy and seeded sampling, different prompt lengths, K varying per step, drafts
partly right) through the server while a test does something bad next door; at the end every
witness's tokens and logits bytes must equal plain in-process decoding.

    with Witnesses(stub, plain_decode):
        ...  # the fault

Entering waits until every witness has stepped a few times (so they sit at different positions
when the fault comes); leaving waits for a few more steps each, then stops and compares.
"""

from __future__ import annotations

import random
import threading
import time

import grpc
import numpy as np

from verifier import rpc
from verifier.params import SamplingParams

from .conftest import MAX_SEQ_LEN, VOCAB

# (prompt, sampling): three greedy witnesses and one seeded-sampling witness
SPECS = (
    ([5, 17, 33], None),
    ([60, 2, 41, 8, 8, 19, 70, 3], None),
    ([12] * 15, None),
    ([44, 45, 46, 1, 7], SamplingParams(temperature=0.8, top_k=30, seed=99)),
)
MAX_NEW = 40
MAX_DRAFTS = 4


class Witness:
    def __init__(self, index: int, stub, plain, metadata, recycle: bool, pause_s: float = 0.0):
        self.prompt, self.sampling = SPECS[index % len(SPECS)]
        self.stub, self.plain, self.metadata, self.recycle, self.pause_s = stub, plain, metadata, recycle, pause_s
        self.rng = random.Random(1000 + index)
        self.steps = 0
        self.runs: list[tuple[list[int], list[np.ndarray]]] = []  # per session: tokens, logits rows
        self.failures: list[tuple] = []  # (grpc status code or None, what happened)
        self.holding = False

    def _open(self, stop: threading.Event):
        s = self.sampling
        sampling = rpc.Sampling(temperature=s.temperature, top_k=s.top_k, seed=s.seed) if s else None
        request = rpc.OpenSessionRequest(prompt_ids=self.prompt, max_new_tokens=MAX_NEW, sampling=sampling, return_logits=True)
        while not stop.is_set():
            try:
                return self.stub.OpenSession(request, metadata=self.metadata, timeout=30)
            except grpc.RpcError as exc:  # a test may hold every slot for a moment
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                time.sleep(0.02)
        return None

    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                if not self._session(stop) or not self.recycle:
                    return
        except grpc.RpcError as exc:  # reported by the main thread
            self.failures.append((exc.code(), f"witness {self.prompt}: {exc!r}"))
        except Exception as exc:
            self.failures.append((None, f"witness {self.prompt}: {exc!r}"))

    def _session(self, stop: threading.Event) -> bool:
        expected = self.plain(self.prompt, MAX_NEW, self.sampling)
        opened = self._open(stop)
        if opened is None:
            return False
        tokens, rows = [opened.first_token], [_rows(opened.logits)]
        self.runs.append((tokens, rows))
        position, finish = opened.position, opened.finish_reason
        while not finish and not stop.is_set():
            k = min(self.rng.randint(0, MAX_DRAFTS), MAX_SEQ_LEN - position - 1)
            drafts = expected.tokens[len(tokens):len(tokens) + k]
            drafts += [self.rng.randrange(VOCAB) for _ in range(k - len(drafts))]
            if drafts and self.rng.random() < 0.5:  # a wrong draft somewhere: a partial accept
                at = self.rng.randrange(len(drafts))
                drafts[at] = (drafts[at] + 1) % VOCAB
            step = rpc.VerifyStep(session_id=opened.session_id, expected_position=position, draft_ids=drafts,
                                  request_id=f"w{self.steps}", return_logits=True)
            (result,) = self.stub.Verify(rpc.VerifyRequest(steps=[step]), metadata=self.metadata, timeout=30).results
            if result.status.code != 0:
                raise AssertionError(f"step at {position} failed: {result.status.code} {result.status.message}")
            tokens += result.tokens
            rows.append(_rows(result.logits))
            position, finish = result.position, result.finish_reason
            self.steps += 1
            time.sleep(self.pause_s)
        if not self.recycle:  # hold the slot until the test ends, so the pool's use stays fixed
            self.holding = True
            stop.wait()
        self.stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id), metadata=self.metadata, timeout=30)
        return True

    def check(self, allowed=()) -> None:
        """Every session's tokens and logits bytes equal plain decoding's prefix; no failure but
        the `allowed` status codes."""
        assert all(code in allowed for code, _ in self.failures), self.failures
        assert self.runs, f"witness {self.prompt} never opened a session"
        expected = self.plain(self.prompt, MAX_NEW, self.sampling)
        for tokens, rows in self.runs:
            n = len(tokens)
            assert tokens == expected.tokens[:n], (self.prompt, tokens, expected.tokens)
            logits = np.concatenate(rows)
            assert logits.tobytes() == expected.logits[:n].numpy().astype("<f4").tobytes(), self.prompt


def _rows(message) -> np.ndarray:
    return np.frombuffer(message.float32, dtype="<f4").reshape(message.rows, message.vocab_size)


class Witnesses:
    def __init__(self, stub, plain, n: int = 4, metadata=None, recycle: bool = True, steps_around: int = 2,
                 timeout_s: float = 60.0):
        self.witnesses = [Witness(i, stub, plain, metadata, recycle) for i in range(n)]
        self.n = n
        self.steps_around, self.timeout_s = steps_around, timeout_s
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=w.run, args=(self._stop,), daemon=True) for w in self.witnesses]

    def _wait_steps(self, targets: list[int]) -> None:
        deadline = time.monotonic() + self.timeout_s
        for w, target, thread in zip(self.witnesses, targets, self._threads):
            while w.steps < target and thread.is_alive() and not w.holding:
                assert time.monotonic() < deadline, f"witness {w.prompt} stalled at {w.steps} steps: {w.failures}"
                time.sleep(0.005)

    def __enter__(self) -> "Witnesses":
        for w in self.witnesses:  # plain decoding first, so the threads only step
            w.plain(w.prompt, MAX_NEW, w.sampling)
        for thread in self._threads:
            thread.start()
        self._wait_steps([self.steps_around] * len(self.witnesses))
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self._wait_steps([w.steps + self.steps_around for w in self.witnesses])
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.timeout_s)
        if exc_type is None:
            for w in self.witnesses:
                w.check()
