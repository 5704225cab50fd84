"""Streams with speculation equal streams without, for greedy and for seeded (coupled) sampling,
with every drafter, and rejection sampling reproduces the target distribution."""

import pytest
import torch

from bitexact.conftest import FAMILIES, prompt_for
from verifier.acceptance import accept_rejection
from verifier.engine import Engine, StepRequest
from verifier.generate import generate
from verifier.params import SamplingParams
from verifier.proposers import NgramProposer, OracleProposer, RandomProposer
from verifier.sampling import target_probs

SAMPLINGS = [
    SamplingParams(),
    SamplingParams(temperature=0.9, seed=42),
    SamplingParams(temperature=1.3, top_k=7, top_p=0.8, seed=7),
]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t0.9", "t1.3-topk-topp"])
@pytest.mark.parametrize("name", FAMILIES)
def test_speculative_stream_equals_plain(model_of, name, sampling):
    model = model_of(name)
    prompt = prompt_for(model, 6, seed=1) * 2  # repeats give the n-gram drafter something to find
    engine = Engine(model, 1, 96, max_k=6)
    plain = generate(engine, prompt, 24, sampling, eos_ids=())
    drafters = {"random": RandomProposer(model.config.vocab_size, seed=3), "ngram": NgramProposer(), "oracle": OracleProposer(len(prompt), plain.tokens)}
    for label, proposer in drafters.items():
        for k in (2, 6):
            spec = generate(engine, prompt, 24, sampling, proposer, k, eos_ids=())
            assert spec.tokens == plain.tokens, f"{label} K={k}: stream differs"
            assert torch.equal(spec.logits, plain.logits), f"{label} K={k}: logit rows differ"
            if label == "oracle":  # the true continuation: every draft sent is accepted
                assert spec.accepted_per_step == spec.drafted_per_step


def test_seed_changes_the_sampled_stream(model_of):
    model = model_of("qwen3_5_text")
    engine = Engine(model, 1, 64)
    prompt = prompt_for(model, 5, seed=3)
    a = generate(engine, prompt, 16, SamplingParams(temperature=1.0, seed=1), eos_ids=())
    b = generate(engine, prompt, 16, SamplingParams(temperature=1.0, seed=2), eos_ids=())
    assert a.tokens != b.tokens


def _empirical(draw, n: int, vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab)
    for seed in range(n):
        counts[draw(seed)] += 1
    return counts / n


@pytest.mark.parametrize("deterministic", [False, True], ids=["drafter-probs", "deterministic-drafts"])
def test_rejection_sampling_reproduces_the_target_distribution(deterministic):
    """First emitted token ~ p(row 0) and bonus after full acceptance ~ p(row K), whatever q is.

    4000 seeds; total variation distance to the exact target within 0.035 (the expected
    sampling noise at this n is ~0.01-0.02 for 6 outcomes)."""
    vocab, n = 6, 4000
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(3, vocab, generator=gen) * 1.5  # K = 2
    params_for = lambda seed: SamplingParams(temperature=1.0, seed=seed)  # noqa: E731
    q = torch.softmax(torch.randn(2, vocab, generator=gen), dim=-1)
    drafts_for = lambda seed: [int(torch.multinomial(q[0], 1, generator=torch.Generator().manual_seed(10_000 + seed))), 2]  # noqa: E731
    probs = None if deterministic else q

    def first_token(seed):
        drafts = drafts_for(seed)
        a, bonus = accept_rejection(rows, drafts, probs, params_for(seed), first_position=5)
        return drafts[0] if a > 0 else bonus

    target = target_probs(rows[0], SamplingParams(temperature=1.0))
    tv = 0.5 * (_empirical(first_token, n, vocab) - target).abs().sum()
    assert tv < 0.035, f"first-token distribution is {tv:.3f} (TV) from the target"

    # With q equal to p every draft is accepted: the bonus is then a sample of row K's distribution.
    p_rows = torch.stack([target_probs(r, SamplingParams(temperature=1.0)) for r in rows])
    bonus = lambda seed: accept_rejection(rows, [0, 0], p_rows[:2], params_for(seed), 5)[1]  # noqa: E731
    accepted = lambda seed: accept_rejection(rows, [0, 0], p_rows[:2], params_for(seed), 5)[0]  # noqa: E731
    assert all(accepted(s) == 2 for s in range(50))
    tv_bonus = 0.5 * (_empirical(bonus, n, vocab) - p_rows[2]).abs().sum()
    assert tv_bonus < 0.035


def test_rejection_through_the_engine_is_deterministic_per_seed(model_of):
    model = model_of("qwen3_next_moe")
    prompt = prompt_for(model, 5, seed=8)
    vocab = model.config.vocab_size

    def run():
        engine = Engine(model, 1, 64, max_k=4)
        seq = engine.open(prompt, SamplingParams(temperature=0.8, seed=9), 12, eos_ids=())
        out = [seq.pending]
        while not seq.finished:
            probs = torch.full((3, vocab), 1.0 / vocab)
            (res,) = engine.step([StepRequest(seq, [1, 2, 3], probs)])
            assert res.error is None
            out += res.tokens
        return out

    assert run() == run()
