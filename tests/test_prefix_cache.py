"""The prefix cache (verifier/model/prefix_cache.py): a prompt that starts with a prefix ingested
before restores the slot's state at the last chunk boundary in it, and everything after (the first
token's logits, every logit row and token of a generation, with drafts or without, greedy or
seeded, the prompt's hidden rows an MTP head is fed, every layer's state) equals a cold start's,
torch.equal; the budget holds, least recently used chunks out first."""

import pytest
import torch

from verifier.engine import Engine
from verifier.generate import generate
from verifier.model.rollback import ROLLBACK_MODES
from verifier.params import SamplingParams
from verifier.proposers.ngram import NgramProposer

CHUNK = 4
SHARED = [5, 9, 2, 7, 11, 3, 8, 6, 4, 10]  # two whole chunks and two tokens
FIRST = SHARED + [12, 13, 1, 14]
SECOND = SHARED + [15, 2, 5, 9, 2]  # repeats: the n-gram drafter proposes
BIG = 1 << 30


def _engine(model, cache_bytes: int, rollback: str = "woa") -> Engine:
    return Engine(model, 2, 64, max_k=4, rollback_mode=rollback, cuda_graphs=False, prefix_cache_bytes=cache_bytes,
                  prefill_chunk=CHUNK)


def _scribble(engine: Engine) -> None:
    """Open and close an unrelated prompt in every slot: a restore that left any KV row or state
    alone would read this one's, not the prefix's (a reused slot keeps its old KV rows)."""
    seqs = [engine.open([30 + i, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47], SamplingParams(), 1)
            for i in range(engine.n_slots)]
    for seq in seqs:
        engine.close(seq)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("rollback", ROLLBACK_MODES)
@pytest.mark.parametrize("name", ["qwen3_5_text", "kimi_linear", "qwen3_next_moe"])
def test_a_cached_start_equals_a_cold_start(load_target, name, rollback):
    model = load_target(name)
    cached, cold = _engine(model, BIG, rollback), _engine(model, 0, rollback)
    assert cold.prefix_cache is None
    generate(cached, FIRST, 6)  # ingests FIRST: its chunks at 4, 8 and 12 are kept
    stats = cached.prefix_cache.stats
    assert (stats.hits, stats.misses) == (0, 1) and stats.bytes > 0
    restored = []  # tokens each open of SECOND restored
    for sampling, k in [(None, 0), (None, 3), (SamplingParams(temperature=0.9, top_k=20, seed=3), 3)]:
        proposer = NgramProposer() if k else None
        _scribble(cached)
        before = stats.cached_tokens
        warm = generate(cached, SECOND, 12, sampling, proposer, k)
        restored.append(stats.cached_tokens - before)
        plain = generate(cold, SECOND, 12, sampling, NgramProposer() if k else None, k)
        assert warm.tokens == plain.tokens and torch.equal(warm.logits, plain.logits), f"{name} {rollback} k={k}"
    # SECOND shares FIRST's first two chunks; its own third one is kept by its first open
    assert restored == [8, 12, 12]


@pytest.mark.parametrize("name", ["qwen3_5_text", "kimi_linear"])
def test_the_restored_slot_is_the_cold_slot(load_target, name):
    """Every layer's state after a cached open, KV rows and recurrent states, equals a cold open's;
    and a prompt whose length is a multiple of the chunk keeps one token to prefill."""
    model = load_target(name)
    cached, cold = _engine(model, BIG), _engine(model, 0)
    cached.close(cached.open(FIRST, SamplingParams(), 4))
    for prompt, restored in ((SECOND, 8), (FIRST[:12], 8)):
        _scribble(cached)
        before = cached.prefix_cache.stats.cached_tokens
        warm, plain = cached.open(prompt, SamplingParams(), 4), cold.open(prompt, SamplingParams(), 4)
        assert cached.prefix_cache.stats.cached_tokens - before == restored
        assert torch.equal(warm.first_logits, plain.first_logits) and warm.pending == plain.pending
        for mine, theirs in zip(cached.slot_tensors(warm.slot, warm.position), cold.slot_tensors(plain.slot, plain.position),
                                strict=True):
            assert _same(mine, theirs)
        cached.close(warm)
        cold.close(plain)
    # FIRST[:12] restores 8 tokens, not 12: its last token is prefilled


def test_the_prompts_hidden_rows_an_mtp_head_reads_are_the_cold_ones(mtp_checkpoint):
    from verifier.model import load_model

    model = load_model(mtp_checkpoint("qwen3_5_text"))
    cached, cold = _engine(model, BIG), _engine(model, 0)
    cached.prefix_cache.keep_hidden = True
    cached.close(cached.open(FIRST, SamplingParams(), 4))  # no hidden rows asked: kept all the same
    _scribble(cached)
    before = cached.prefix_cache.stats.cached_tokens
    warm = cached.open(SECOND, SamplingParams(), 4, want_hidden=True)
    plain = cold.open(SECOND, SamplingParams(), 4, want_hidden=True)
    assert cached.prefix_cache.stats.cached_tokens - before == 8 and torch.equal(warm.prompt_hidden, plain.prompt_hidden)


def test_without_kept_hidden_rows_a_session_that_wants_them_starts_cold(load_target):
    model = load_target("qwen3_5_text")
    cached, cold = _engine(model, BIG), _engine(model, 0)
    cached.close(cached.open(FIRST, SamplingParams(), 4))
    warm = cached.open(SECOND, SamplingParams(), 4, want_hidden=True)
    plain = cold.open(SECOND, SamplingParams(), 4, want_hidden=True)
    assert cached.prefix_cache.stats.misses == 2 and torch.equal(warm.prompt_hidden, plain.prompt_hidden)


def test_the_budget_evicts_least_recently_used_chunks_first(load_target):
    model = load_target("qwen3_5_text")
    probe = _engine(model, BIG)
    probe.close(probe.open(FIRST[:5], SamplingParams(), 2))
    one_chunk = probe.prefix_cache.stats.bytes  # FIRST[:5]: one whole chunk
    cached, cold = _engine(model, 3 * one_chunk), _engine(model, 0)
    stats = cached.prefix_cache.stats
    others = [[20 + i, 21, 22, 23, 24, 25, 26, 27, 28] for i in range(2)]  # two chunks each, other first tokens
    cached.close(cached.open(FIRST, SamplingParams(), 2))  # 3 chunks: the budget
    assert stats.bytes == 3 * one_chunk and stats.evictions == 0
    for prompt in others:
        cached.close(cached.open(prompt, SamplingParams(), 2))
    assert stats.bytes <= 3 * one_chunk and stats.evictions == 4  # FIRST's chunks went, the deepest first
    misses = stats.misses
    for prompt in [FIRST, others[1], others[0]]:
        warm, plain = cached.open(prompt, SamplingParams(), 2), cold.open(prompt, SamplingParams(), 2)
        assert torch.equal(warm.first_logits, plain.first_logits)
        cached.close(warm)
        cold.close(plain)
        assert stats.bytes <= 3 * one_chunk
    assert stats.misses > misses  # FIRST had been evicted


def test_opens_ingesting_side_by_side_share_the_budget(load_target):
    """Prompts arriving together ingest a chunk each in turn: one's store may evict a chunk of the
    path another is still extending. That one keeps no chunk after it, the budget holds once they
    are in, and every open equals its cold one."""
    model = load_target("qwen3_5_text")
    probe = _engine(model, BIG)
    probe.close(probe.open(FIRST[:5], SamplingParams(), 2))
    one_chunk = probe.prefix_cache.stats.bytes
    cached, cold = _engine(model, 2 * one_chunk), _engine(model, 0)
    stats = cached.prefix_cache.stats
    prompts = [FIRST, [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]]  # 3 whole chunks each
    waiting = [cached.opening(ids, SamplingParams(), 2, eos_ids=()) for ids in prompts]
    openings = list(waiting)
    while waiting:  # a chunk of each in turn, as prompt turns run them
        waiting = [o for o, done in zip(waiting, cached.advance_openings(waiting)) if not done]
    assert stats.bytes <= 2 * one_chunk and stats.evictions > 0  # (an open's own path stays until it is in)
    for ids, opening in zip(prompts, openings):
        warm, plain = opening.sequence(), cold.open(ids, SamplingParams(), 2)
        assert torch.equal(warm.first_logits, plain.first_logits)
        cached.close(warm)
        cold.close(plain)
    for ids in prompts:  # what the cache kept still restores the cold bits
        warm, plain = cached.open(ids, SamplingParams(), 2), cold.open(ids, SamplingParams(), 2)
        assert torch.equal(warm.first_logits, plain.first_logits)
        cached.close(warm)
        cold.close(plain)


def test_the_server_serves_cached_prefixes_and_reports_them(hf_checkpoint):
    """--prefix-cache-gb: a second prompt sharing a prefix streams plain decoding's tokens and the
    metrics count the hit; a negative budget is refused by name."""
    import grpc
    from prometheus_client import generate_latest

    from verifier import rpc
    from verifier.model import load_model
    from verifier.server.config import ServerConfig
    from verifier.server.testing import LoopbackServer

    with pytest.raises(ValueError, match="prefix_cache_gb"):
        ServerConfig(hf_checkpoint("qwen3_5_text"), port=0, prefix_cache_gb=-1.0)
    prompt = list(range(5, 5 + 600))  # past one 512-token chunk
    streams = []
    with LoopbackServer(hf_checkpoint("qwen3_5_text"), n_slots=2, max_seq_len=700, prefix_cache_gb=0.01) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            for tail in ([1, 2, 3], [4, 5]):
                events = list(stub.Generate(rpc.GenerateRequest(open=rpc.OpenSessionRequest(
                    prompt_ids=[t % 80 + 3 for t in prompt] + tail, max_new_tokens=8, server_drafter="ngram")), timeout=60))
                streams.append([events[0].opened.first_token] + [t for e in events[1:] for t in e.step.tokens])
        stats = server.engine.prefix_cache.stats
        assert (stats.hits, stats.misses, stats.cached_tokens) == (1, 1, 512)
        text = server.run_on_loop(lambda: generate_latest(server.server.metrics.registry).decode())
    assert "verifier_prefix_cache_hits 1.0" in text and "verifier_prefix_cache_cached_tokens 512.0" in text
    cold = Engine(load_model(hf_checkpoint("qwen3_5_text")), 1, 700)
    for tail, stream in zip(([1, 2, 3], [4, 5]), streams):
        assert generate(cold, [t % 80 + 3 for t in prompt] + tail, 8).tokens == stream
