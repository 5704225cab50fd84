"""The drafter against a real verifier on loopback: every stream, whatever the drafter, K, transport
or sampling, equals plain decoding (verifier.generate.generate with K = 0) token for token, and
its logit rows equal plain decoding's bit for bit."""

import asyncio
import threading

import numpy as np
import pytest
import torch

from drafter.client import AsyncVerifierClient
from drafter.loop import STREAM, UNARY, agenerate, generate, stream
from verifier.params import SamplingParams
from verifier.proposers import NgramProposer, OracleProposer, RandomProposer

from drafter_setup import MAX_K, MAX_SEQ_LEN, NAME, client, plain_in_process, served_checkpoint, server, target  # noqa: F401 (fixtures)

NEW = 24
SAMPLINGS = {
    "greedy": SamplingParams(),
    "t0.9": SamplingParams(temperature=0.9, seed=42),
    "t1.3-topk-topp": SamplingParams(temperature=1.3, top_k=7, top_p=0.8, seed=7),
}


def prompt_for(vocab: int, length: int, seed: int) -> list[int]:
    ids = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    return ids * 2  # a repeat gives the n-gram drafter something to find


def plain(target, prompt, sampling: SamplingParams, new: int = NEW):
    return plain_in_process(target, prompt, new, sampling)


def test_model_info_describes_the_served_checkpoint(client, target):
    info = client.model_info()
    assert info.vocab_size == target.config.vocab_size and info.max_k == MAX_K and info.max_context == MAX_SEQ_LEN
    assert info.protocol_version == "verifier.v1" and info.model_type == NAME


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_every_drafter_streams_the_plain_tokens(client, target, sampling):
    vocab = target.config.vocab_size
    prompt = prompt_for(vocab, 6, seed=1)
    expected = plain(target, prompt, sampling)
    runs = [("none", None, 0, STREAM), ("ngram", NgramProposer(), 2, STREAM), ("ngram", NgramProposer(4, 2), 5, UNARY),
            ("random", RandomProposer(vocab, seed=3), 1, UNARY), ("random", RandomProposer(vocab, seed=4), 8, STREAM),
            ("oracle", OracleProposer(len(prompt), expected.tokens), 4, UNARY)]
    for label, proposer, k, transport in runs:
        chunks = []
        got = generate(client, proposer, prompt_ids=prompt, max_new_tokens=NEW, sampling=sampling, k=k,
                       transport=transport, on_tokens=chunks.append)
        where = f"{label} K={k} over {transport}"
        assert got.tokens == expected.tokens, f"{where}: stream differs"
        assert [t for c in chunks for t in c] == got.tokens, f"{where}: streamed chunks differ from the result"
        assert got.finish_reason == expected.finish_reason and got.prompt_ids == prompt
        assert len(got.accepted_per_step) == len(got.drafted_per_step) == len(chunks) - 1
        assert all(d <= k for d in got.drafted_per_step)
        if label == "oracle":  # the true continuation: every draft accepted, several tokens per step
            assert got.accepted_per_step == got.drafted_per_step and got.mean_acceptance_length > 3
        if k == 0:
            assert got.accepted_per_step == [0] * got.steps and got.steps == len(got.tokens) - 1


def test_logit_rows_equal_plain_decoding(client, target):
    vocab = target.config.vocab_size
    prompt = prompt_for(vocab, 5, seed=2)
    sampling = SAMPLINGS["t0.9"]
    expected = plain(target, prompt, sampling, new=16)
    for proposer, k in ((RandomProposer(vocab, seed=5), 3), (NgramProposer(), 6)):
        got = generate(client, proposer, prompt_ids=prompt, max_new_tokens=16, sampling=sampling, k=k, return_logits=True)
        assert got.tokens == expected.tokens
        assert got.logits.dtype == np.float32 and np.array_equal(got.logits, expected.logits.numpy())


def test_drafts_are_cut_at_the_end_of_the_context(client, target):
    # prompt 80 + 24 new tokens would pass max_seq_len 96: the loop cuts drafts near the end and the
    # server ends the session at the full context; the tokens are still the plain ones
    vocab = target.config.vocab_size
    prompt = prompt_for(vocab, 40, seed=6)
    expected = plain(target, prompt, SamplingParams(), new=MAX_SEQ_LEN - len(prompt) + 1)
    got = generate(client, RandomProposer(vocab, seed=1), prompt_ids=prompt, max_new_tokens=NEW, k=MAX_K)
    # the last token is emitted, never consumed: prompt + tokens may pass the context by one
    assert len(got.tokens) >= MAX_SEQ_LEN - len(prompt) and got.finish_reason == "length"
    assert got.tokens == expected.tokens[: len(got.tokens)]


FRONT_ENDS = {  # (drafter, sampling, prompt length before its repeat, k): the token budget cuts the last drafts
    "ngram-greedy": ("ngram", "greedy", 6, 4),
    "random-sampled": ("random", "t0.9", 5, MAX_K),
    "oracle-budget": ("oracle", "t1.3-topk-topp", 4, 5),
    "random-full-context": ("random", "greedy", (MAX_SEQ_LEN - NEW) // 2, MAX_K),  # prompt + budget = the whole context
}


@pytest.mark.parametrize("case", FRONT_ENDS.values(), ids=FRONT_ENDS.keys())
def test_both_front_ends_take_the_same_steps(client, target, case):
    """The same proposer on the same prompt: in process (verifier.generate) and through the server
    (drafter.loop) cut drafts by one rule, so they report the same steps and acceptance figures."""
    drafter, sampling_name, length, k = case
    sampling, vocab = SAMPLINGS[sampling_name], target.config.vocab_size
    prompt = prompt_for(vocab, length, seed=20 + length)
    expected = plain(target, prompt, sampling)

    def proposer():  # a fresh one per front end: the random drafter's draws depend on its history
        return {"ngram": lambda: NgramProposer(), "random": lambda: RandomProposer(vocab, seed=6),
                "oracle": lambda: OracleProposer(len(prompt), expected.tokens)}[drafter]()

    local = plain_in_process(target, prompt, NEW, sampling, max_k=MAX_K, proposer=proposer(), k=k)
    remote = generate(client, proposer(), prompt_ids=prompt, max_new_tokens=NEW, sampling=sampling, k=k)
    assert local.tokens == remote.tokens == expected.tokens
    assert local.drafted_per_step == remote.drafted_per_step
    assert local.accepted_per_step == remote.accepted_per_step
    assert local.mean_acceptance_length == remote.mean_acceptance_length
    assert local.step_figures() == remote.step_figures()
    assert sum(remote.drafted_per_step) > 0


def test_concurrent_drafters_each_stream_their_plain_tokens(client, target):
    vocab = target.config.vocab_size
    jobs = [(prompt_for(vocab, 4 + i, seed=10 + i), list(SAMPLINGS.values())[i % 3], i % 2, 1 + 2 * i) for i in range(5)]
    expected = [plain(target, p, s).tokens for p, s, _, _ in jobs]
    got, errors = [None] * len(jobs), []

    def run(i, prompt, sampling, drafter, k):
        try:
            proposer = NgramProposer() if drafter else RandomProposer(vocab, seed=i)
            got[i] = generate(client, proposer, prompt_ids=prompt, max_new_tokens=NEW, sampling=sampling, k=k,
                              transport=(STREAM, UNARY)[i % 2]).tokens
        except Exception as exc:  # reported below, with the drafter it came from
            errors.append((i, exc))

    threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert got == expected


def test_the_async_client_streams_the_plain_tokens(server, target):
    vocab = target.config.vocab_size
    prompt = prompt_for(vocab, 5, seed=8)
    sampling = SAMPLINGS["t1.3-topk-topp"]
    expected = plain(target, prompt, sampling).tokens

    async def run():
        async with AsyncVerifierClient(server.address) as client:
            both = [agenerate(client, RandomProposer(vocab, seed=2), prompt_ids=prompt, max_new_tokens=NEW,
                              sampling=sampling, k=4, transport=transport) for transport in (STREAM, UNARY)]
            return await asyncio.gather(*both)

    for result in asyncio.run(run()):
        assert result.tokens == expected


def test_sessions_are_closed_after_each_generation_even_when_stopped_early(client, target):
    before = client.stats().open_sessions
    tokens = stream(client, NgramProposer(), prompt_ids=prompt_for(target.config.vocab_size, 4, seed=9), max_new_tokens=NEW)
    next(tokens)
    assert client.stats().open_sessions == before + 1
    tokens.close()  # the caller stops reading: the loop closes its session
    assert client.stats().open_sessions == before
