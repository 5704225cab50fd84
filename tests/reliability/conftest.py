"""Fixtures of the reliability tests: the tiny checkpoint, plain in-process decoding to compare
against, and an engine that can be made slow for chosen sessions (so a step is reliably "in the
engine" while a test cancels it, lets its deadline pass or closes its session)."""

import threading
import time

import pytest

from verifier.engine import Engine

CHECKPOINT = "qwen3_5_text"  # vocab 90
VOCAB, MAX_SEQ_LEN, MAX_K = 90, 96, 8


class SlowEngine(Engine):
    """An engine whose step sleeps `delay_s` when the batch holds a sequence in `slow`; `entered`
    is set as such a step starts."""

    def __init__(self, *args, delay_s: float = 0.6, **kwargs):
        super().__init__(*args, **kwargs)
        self.delay_s = delay_s
        self.slow: set[int] = set()  # id() of slowed sequences
        self.entered = threading.Event()

    def step(self, requests):
        if any(id(r.sequence) in self.slow for r in requests):
            self.entered.set()
            time.sleep(self.delay_s)
        return super().step(requests)


@pytest.fixture(scope="session")
def reliability_checkpoint(hf_checkpoint):
    return hf_checkpoint(CHECKPOINT)


@pytest.fixture(scope="session")
def plain_decode(reliability_checkpoint):
    """plain_decode(prompt, n, sampling=None) -> verifier.generate.Generation of plain (K = 0)
    decoding on a separate in-process engine (cached)."""
    from verifier.generate import generate
    from verifier.model import load_model

    engine = Engine(load_model(reliability_checkpoint), n_slots=1, max_seq_len=MAX_SEQ_LEN, max_k=0)
    cache = {}
    lock = threading.Lock()  # witness threads ask concurrently; the engine is not thread-safe

    def run(prompt, n, sampling=None):
        key = (tuple(prompt), n, sampling)
        with lock:
            if key not in cache:
                cache[key] = generate(engine, list(prompt), n, sampling)
            return cache[key]

    return run


@pytest.fixture(scope="module")
def slow_server(reliability_checkpoint):
    """(LoopbackServer, SlowEngine): a server whose engine can be slowed per session, with a small
    message limit (0.05 MiB) so an oversized message is cheap to build."""
    from verifier.server.testing import LoopbackServer

    with LoopbackServer(reliability_checkpoint, n_slots=8, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K, max_message_mb=0.05,
                        engine_class=SlowEngine) as server:
        yield server, server.engine
        server.engine.slow.clear()
