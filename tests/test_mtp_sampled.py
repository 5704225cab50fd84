"""The MTP drafter for sampled sessions (verifier/proposers/mtp.py), in process.

coupled (the default): each draft is the session's own coupled choice from the head's logits (the
Gumbel noise keyed by (seed, position) that the target uses there), so the stream equals plain
decoding bitwise (tokens and logits) under temperature, top-k and top-p, and a draft is accepted
exactly where it is the plain run's token. The heads are random (presets/mtp.py), but the tiny
models' logits are nearly flat next to the shared noise, so coupled drafts are accepted often:
acceptance > 0 is asserted where the reference says it must be.
rejection: drafts sampled from q = softmax(masked head logits / T), q returned [k, vocab] float32
for the verifier's rejection sampling. With --model-device cuda the coupled noise is the GPU's
(verifier/sampling.py): the same claims hold there."""

import numpy as np
import pytest
import torch

from verifier.engine import Engine
from verifier.generate import generate
from verifier.model import load_model
from verifier.model.mtp import load_mtp_head
from verifier.model.rows import RowBatch
from verifier.params import SamplingParams
from verifier.proposers import COUPLED, REJECTION, HiddenStateProposer, MTPProposer, ProbabilityProposer
from verifier.sampling import choose, masked_logits
from mtp_recording import Recording

PROMPT = [5, 9, 2, 7, 11, 3]
NEW = 20
K = 3
SAMPLINGS = {
    "temperature": SamplingParams(temperature=1.0, seed=7),
    "top_k": SamplingParams(temperature=0.8, top_k=20, seed=3),
    "top_p": SamplingParams(temperature=1.3, top_p=0.9, seed=5),
    "top_k_top_p": SamplingParams(temperature=2.0, top_k=30, top_p=0.8, seed=11),
}


@pytest.fixture(scope="module")
def setup(mtp_checkpoint, model_device):
    path = mtp_checkpoint("qwen3_5_moe_text")
    model = load_model(path, model_device)
    engine = Engine(model, n_slots=1, max_seq_len=len(PROMPT) + NEW + K, max_k=K)
    return engine, load_mtp_head(path, model)


def reference_logits(head, hidden: torch.Tensor, context: list[int], drafts: list[int]) -> list[torch.Tensor]:
    """The head's logits each draft of a proposal was chosen from, computed from scratch on a pool of
    its own: one forward of the rows (hidden q, token q + 1) for q = 0 .. p - 1, then one row per
    further draft (module docstring of proposers/mtp.py, without cursors or batching)."""
    p = len(context) - 1
    pool = head.new_pool(1, p + len(drafts))
    batch = RowBatch(slots=(0,), starts=(0,), counts=(p,))
    out, logits = head.forward(torch.tensor(context[1:]), hidden[:p], batch, pool, row_invariant=True)
    row, rows = out[-1:], [logits[-1]]
    for i, draft in enumerate(drafts[:-1], start=1):
        batch = RowBatch(slots=(0,), starts=(p - 1 + i,), counts=(1,))
        row, logits = head.forward(torch.tensor([draft]), row, batch, pool, row_invariant=True, step=i)
        rows.append(logits[0])
    return rows


def accepted_against(plain: list[int], prompt_len: int, context: list[int], drafts: list[int]) -> int:
    """How many drafts the plain stream agrees with: what coupled verification must accept."""
    ahead = plain[len(context) - prompt_len:]
    n = 0
    while n < len(drafts) and n < len(ahead) and drafts[n] == ahead[n]:
        n += 1
    return n


@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_coupled_mtp_stream_equals_plain_decoding(setup, name):
    engine, head = setup
    params = SAMPLINGS[name]
    plain = generate(engine, PROMPT, NEW, params)
    recording = Recording(MTPProposer(head, engine.pool.max_seq_len, params))  # COUPLED: the default
    spec = generate(engine, PROMPT, NEW, params, recording, K)
    assert spec.tokens == plain.tokens
    assert torch.equal(spec.logits, plain.logits)
    assert all(probs is None for _, _, _, probs in recording.calls), "coupled drafts send no q"
    # a draft is accepted exactly where it is the plain run's token; the shared noise makes that happen
    expected = [accepted_against(plain.tokens, len(PROMPT), context, drafts) for context, _, drafts, _ in recording.calls]
    assert [a for a, d in zip(spec.accepted_per_step, spec.drafted_per_step) if d] == expected
    assert sum(expected) > 0


def test_coupled_drafts_are_accepted_more_often_than_the_heads_argmax(setup):
    """The coupling at work: over the samplings, drafts drawn with the target's own noise are
    accepted more often than the head's argmax sent to the same sampled sessions (seeded: fixed)."""
    engine, head = setup
    def accepted(params, drafting):
        proposer = MTPProposer(head, engine.pool.max_seq_len, drafting)
        return sum(generate(engine, PROMPT, NEW, params, proposer, K).accepted_per_step)

    coupled = sum(accepted(params, params) for params in SAMPLINGS.values())
    argmax = sum(accepted(params, SamplingParams()) for params in SAMPLINGS.values())  # greedy drafts
    assert coupled > argmax


@pytest.mark.parametrize("name", ["top_k", "top_k_top_p"])
def test_coupled_drafts_are_the_sessions_own_choice_from_the_heads_logits(setup, name):
    """Each draft i of a proposal at context length p + 1 is choose(head logits, params, p + 1 + i):
    the token the session's coupled sampler puts there, keyed by the position the target keys it by."""
    engine, head = setup
    params = SAMPLINGS[name]
    recording = Recording(MTPProposer(head, engine.pool.max_seq_len, params))
    generate(engine, PROMPT, NEW, params, recording, K)
    hidden = torch.cat(recording.rows)
    for context, _, drafts, _ in recording.calls:
        for i, logits in enumerate(reference_logits(head, hidden, context, drafts)):
            assert drafts[i] == choose(logits, params, len(context) + i), f"context {len(context)}, draft {i}"


def test_rejection_mode_returns_q(setup):
    engine, head = setup
    params = SAMPLINGS["top_k"]
    seq = engine.open(PROMPT, params, NEW, want_hidden=True)
    context = PROMPT + [seq.pending]
    hidden = seq.prompt_hidden.clone()
    engine.close(seq)
    proposer = MTPProposer(head, engine.pool.max_seq_len, params, seed=9, mode=REJECTION)
    assert isinstance(proposer, ProbabilityProposer) and isinstance(proposer, HiddenStateProposer)
    proposer.begin(hidden)
    drafts, probs = proposer.propose_with_probs(context, K)
    assert len(drafts) == K and probs.dtype == np.float32 and probs.shape == (K, engine.vocab_size)
    for r, (draft, q) in enumerate(zip(drafts, probs)):
        assert abs(float(q.sum(dtype=np.float64)) - 1.0) < 1e-5, f"q row {r} sums to {q.sum()}"
        assert q[draft] > 0 and np.count_nonzero(q) <= params.top_k, f"q row {r}: drawn inside the top-k set"
    for r, logits in enumerate(reference_logits(head, hidden, context, drafts)):
        q = torch.softmax(masked_logits(logits, params), dim=-1).numpy()
        assert np.array_equal(probs[r], q), f"q row {r} is the head's masked softmax"
    # the draws are the proposer's seed's (a repeated proposal re-feeds the same rows: the same draws)
    again = proposer.propose_with_probs(context, K)
    assert again[0] == drafts and np.array_equal(again[1], probs)
    others = []
    for seed in (10, 11, 12):
        other = MTPProposer(head, engine.pool.max_seq_len, params, seed=seed, mode=REJECTION)
        other.begin(hidden)
        others.append(other.propose(context, K))
    assert any(o != drafts for o in others), "the seed changes the draws"
    # greedy sessions and coupled mode: deterministic drafts, no q
    for sampling, mode in ((SamplingParams(), REJECTION), (params, COUPLED)):
        deterministic = MTPProposer(head, engine.pool.max_seq_len, sampling, mode=mode)
        deterministic.begin(hidden)
        assert deterministic.propose_with_probs(context, K)[1] is None


def test_rejection_mode_in_process_sends_q(setup):
    """generate() hands the q a proposer returns to the engine, which verifies by rejection
    sampling: every step that drafted carries q [drafts, vocab], and the run completes."""
    engine, head = setup
    params = SAMPLINGS["top_p"]
    recording = Recording(MTPProposer(head, engine.pool.max_seq_len, params, seed=4, mode=REJECTION))
    sent = []
    step = engine.step

    def spy(requests):
        sent.extend((len(r.drafts), r.draft_probs) for r in requests)
        return step(requests)

    engine.step = spy
    try:
        spec = generate(engine, PROMPT, NEW, params, recording, K)
    finally:
        del engine.step
    assert len(spec.tokens) == NEW and all(0 <= t < engine.vocab_size for t in spec.tokens)
    drafted = [(n, probs) for n, probs in sent if n]
    assert drafted and all(probs is not None and tuple(probs.shape) == (n, engine.vocab_size) for n, probs in drafted)
