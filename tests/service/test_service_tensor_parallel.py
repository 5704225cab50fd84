"""`python -m verifier serve --tensor-parallel 2`, run as a user runs it (CPU, gloo): every stream
it serves equals `python -m verifier generate --tensor-parallel 2`'s plain stream bitwise (tokens
and logits), plain, client-drafted, seeded-sampled and server-drafted ("ngram"), several sessions
at once; "mtp" is not offered even where the checkpoint has a head; a signal ends every rank
process; a follower that dies ends the server with an error naming it, not a hang.

Each server and each reference run starts processes that import torch, so the module starts two
servers and two generate runs in all and checks everything on them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from drafter.client import VerifierClient
from drafter.loop import STREAM, UNARY, generate
from verifier.params import SamplingParams
from verifier.proposers import OracleProposer, RandomProposer

REPO = Path(__file__).resolve().parents[2]
SIZE = 2
PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # repeats, so the n-gram drafter finds something to propose
SAMPLED_PROMPT = [9, 3, 71, 22, 14]
SAMPLING = SamplingParams(temperature=0.8, top_k=20, seed=11)
NEW_TOKENS = 14


class Server:
    """A `serve --tensor-parallel 2` process, its stderr collected, its rank processes known."""

    def __init__(self, checkpoint: Path):
        self.proc = subprocess.Popen([sys.executable, "-m", "verifier", "serve", "--model", str(checkpoint), "--port", "0",
                                      "--tensor-parallel", str(SIZE), "--n-slots", "6", "--max-seq-len", "64",
                                      "--max-k", "4", "--grace-s", "2"],
                                     cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.lines: list[str] = []
        self._listening = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if "listening on" in line:
                self._listening.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def address(self) -> str:
        assert self._listening.wait(120), self.log
        return re.search(r"listening on (127\.0\.0\.1:\d+)", self.log).group(1)

    def ranks(self) -> list[int]:
        """The rank processes' ids, rank 0 first (run_parallel starts them in rank order)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        ranks = sorted(int(pid) for pid in children if "spawn_main" in _cmdline(int(pid)))
        assert len(ranks) == SIZE, f"expected {SIZE} rank processes, found {ranks}"
        return ranks

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def _running(pid: int) -> bool:
    """Whether the process exists and is not a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def _assert_gone(pids: list[int], log: str) -> None:
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if _running(pid)], f"rank processes outlived the server\n{log}"


def _reference(checkpoint: Path, tmp_path: Path, prompt: list[int], sampling: SamplingParams, name: str):
    """`generate --tensor-parallel 2`'s plain stream: (tokens, logits [tokens, vocab])."""
    out = tmp_path / f"{name}.npy"
    flags = []
    if sampling.temperature > 0:
        flags = ["--temperature", str(sampling.temperature), "--top-k", str(sampling.top_k), "--seed", str(sampling.seed)]
    proc = subprocess.run([sys.executable, "-m", "verifier", "generate", "--model", str(checkpoint), "--prompt-ids",
                           ",".join(map(str, prompt)), "--max-new-tokens", str(NEW_TOKENS), "--tensor-parallel", str(SIZE),
                           "--json", "--logits-out", str(out), *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["tokens"], np.load(out)


@pytest.fixture(scope="module")
def checkpoint(mtp_checkpoint) -> Path:
    """qwen3_5_moe_tp (heads divisible by 2) with an MTP head, which the ranks cannot split."""
    return mtp_checkpoint("qwen3_5_moe_tp")


def _session(address: str, prompt: list[int], sampling: SamplingParams, **kwargs):
    with VerifierClient(address) as client:
        return generate(client, kwargs.pop("proposer", None), prompt_ids=prompt, max_new_tokens=NEW_TOKENS,
                        sampling=sampling, return_logits=True, **kwargs)


def test_served_streams_equal_generate_on_the_same_ranks_and_a_signal_ends_every_rank(checkpoint, tmp_path):
    server = Server(checkpoint)
    try:
        plain = _reference(checkpoint, tmp_path, PROMPT, SamplingParams(), "plain")
        sampled = _reference(checkpoint, tmp_path, SAMPLED_PROMPT, SAMPLING, "sampled")
        address = server.address()
        ranks = server.ranks()
        with VerifierClient(address) as client:
            info = client.model_info()
        assert info.server_drafters == ("ngram",), info.server_drafters
        greedy = SamplingParams()
        sessions = {  # name -> (its reference, the session's arguments); run at once, so they share batches
            "plain": (plain, dict(prompt=PROMPT, sampling=greedy, k=0)),
            "oracle drafts": (plain, dict(prompt=PROMPT, sampling=greedy, k=3, transport=UNARY, verify_all_drafts=True,
                                          proposer=OracleProposer(len(PROMPT), plain[0]))),
            "random drafts": (plain, dict(prompt=PROMPT, sampling=greedy, k=4, verify_all_drafts=True,
                                          proposer=RandomProposer(info.vocab_size, 5))),
            "sampled, random drafts": (sampled, dict(prompt=SAMPLED_PROMPT, sampling=SAMPLING, k=2, transport=STREAM,
                                                     verify_all_drafts=True, proposer=RandomProposer(info.vocab_size, 7))),
            "server ngram": (plain, dict(prompt=PROMPT, sampling=greedy, k=3, server_drafter="ngram", verify_all_drafts=True)),
        }
        with ThreadPoolExecutor(len(sessions)) as pool:
            futures = {name: pool.submit(lambda kw: _session(address, kw.pop("prompt"), kw.pop("sampling"), **kw), dict(kw))
                       for name, (_, kw) in sessions.items()}
            results = {name: future.result(timeout=120) for name, future in futures.items()}
        for name, (reference, _) in sessions.items():
            tokens, logits = reference
            got = results[name]
            assert got.tokens == tokens, f"{name}: {got.tokens} != {tokens}"
            assert got.logits.shape == logits.shape and np.array_equal(got.logits, logits), f"{name}: the logits differ"
        assert sum(results["oracle drafts"].accepted_per_step) > 0, "the oracle's drafts were never accepted"
        assert sum(results["server ngram"].drafted_per_step) > 0, "the server's n-gram drafter proposed nothing"
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0, server.log
        assert "stopped" in server.log
        _assert_gone(ranks, server.log)
    finally:
        server.kill()


def test_a_follower_that_dies_ends_the_server_with_an_error_naming_it(checkpoint):
    server = Server(checkpoint)
    try:
        address = server.address()
        ranks = server.ranks()
        with VerifierClient(address) as client:
            session = client.open_session(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS)
            assert session.position == len(PROMPT)
        os.kill(ranks[1], signal.SIGKILL)
        code = server.proc.wait(timeout=60)
        assert code not in (0, None), server.log
        assert "rank 1 of 2" in server.log, server.log
        _assert_gone(ranks, server.log)
    finally:
        server.kill()
