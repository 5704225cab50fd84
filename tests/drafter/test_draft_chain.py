"""The draft chain (verifier/proposers/draft_chain.py): a proposal of k drafts as one CUDA graph
replay proposes exactly the drafting loop's drafts and leaves exactly its state.

A chained and an unchained drafter follow one long stream whose verifier feedback is random (a
random prefix of each proposal accepted, then a random bonus): every proposal's drafts, every
sync's logits and the slot's state after every sync (each recurrent layer's conv window and
recurrent state, the KV rows up to the position) are compared with torch.equal. On the CPU the
chain's body runs eagerly (its buffers, device-side positions and tokens, and the snapshot views);
on a GPU (skipped without one) through its graphs, which a steady stream never captures anew.

The H200 run: python -m pytest -q tests/drafter/test_draft_chain.py -m gpu -s
"""

import random
from types import SimpleNamespace

import pytest
import torch

from verifier.defaults import SHIPPED_DRAFT, SHIPPED_TARGET
from verifier.engine import Engine
from verifier.generate import generate
from verifier.model import load_model
from verifier.params import SamplingParams
from verifier.proposers import COUPLED, REJECTION, ModelProposer
from verifier.proposers.draft_chain import BONUS, NONE, RESTORE_BONUS, TWO
from verifier.proposers.model import CHAIN_MAX_K, DRAFT_GRAPH_ROWS, _common_prefix

from test_model_proposer import PROMPT, SAMPLED, VOCAB, assert_same_state, small, small_dir  # noqa: F401 (fixtures)

GPU_CONTEXT = 512


def on_gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")(test))


def _follow(chained: ModelProposer, looped: ModelProposer, prompt: list[int], vocab: int, seed: int, max_context: int) -> int:
    """Drive both drafters through one stream with random feedback until the context is nearly
    full; assert equal drafts, logits and state at every step. Returns the proposals made."""
    rng = random.Random(seed)
    context, proposals, accepted, rejected = list(prompt), 0, 0, 0
    while len(context) + CHAIN_MAX_K + 1 < max_context:
        k = rng.randint(1, CHAIN_MAX_K)
        drafts = chained.propose(context, k)
        assert drafts == looped.propose(context, k), f"proposal {proposals} (K={k}): drafts differ"
        keep = rng.randint(0, k)
        accepted, rejected = accepted + keep, rejected + (keep < k)
        context = context + drafts[:keep] + [rng.randrange(vocab)]
        assert torch.equal(chained.sync(context), looped.sync(context)), f"proposal {proposals}: next-token logits"
        assert_same_state(chained, SimpleNamespace(pool=looped.engine.pool, slot=looped.slot), len(context))
        proposals += 1
    assert accepted and rejected, "the stream saw acceptances and rejections"
    assert chained.prefills == looped.prefills == 1 and chained.rows == looped.rows
    return proposals


def _follow_by_proposals(chained: ModelProposer, looped: ModelProposer, prompt: list[int], vocab: int, seed: int,
                         max_context: int) -> set[str]:
    """As _follow, but the chained drafter is never synced from outside: each proposal catches up
    inside its chain (the verifier's answer restored and consumed in the replay). After every
    proposal both drafters hold context + drafts[:-1]: equal drafts, logits and state. Returns the
    catch-ups the chain ran."""
    rng = random.Random(seed)
    catch_ups, propose = [], chained.chain.propose
    chained.chain.propose = lambda logits, start, k, catch_up=NONE, *rest: catch_ups.append(catch_up) or \
        propose(logits, start, k, catch_up, *rest)
    context = list(prompt)
    while len(context) + CHAIN_MAX_K + 1 < max_context:
        k = rng.randint(1, CHAIN_MAX_K)
        drafts = chained.propose(context, k)
        assert drafts == looped.propose(context, k), f"proposal {len(catch_ups)} (K={k}): drafts differ"
        assert torch.equal(chained.logits, looped.logits), f"proposal {len(catch_ups)}: the logits after the drafts"
        assert_same_state(chained, SimpleNamespace(pool=looped.engine.pool, slot=looped.slot), len(context) + k - 1)
        keep = rng.choice([0, rng.randint(0, k), k - 1, k])  # every case of catch-up, often
        context = context + drafts[:keep] + [rng.randrange(vocab)]
    assert chained.prefills == looped.prefills == 1 and chained.rows == looped.rows
    return set(catch_ups)


# -- on the CPU: the chain's body, eagerly -------------------------------------------------------

def test_proposals_catch_up_inside_the_chain_as_the_sync_would(small):
    chained = ModelProposer(small, VOCAB, 96, draft_chain=True)
    looped = ModelProposer(small, VOCAB, 96, draft_chain=False)
    assert _follow_by_proposals(chained, looped, PROMPT, VOCAB, seed=0, max_context=96) == {NONE, BONUS, TWO, RESTORE_BONUS}


def test_common_prefix_finds_the_first_difference():
    rng = random.Random(5)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 5))]
        expected = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert _common_prefix(a, b) == expected == _common_prefix(b, a), (a, b)


def test_the_chain_body_matches_the_loop_on_the_cpu(small):
    chained = ModelProposer(small, VOCAB, 96, draft_chain=True)
    looped = ModelProposer(small, VOCAB, 96, draft_chain=False)
    assert chained.chain is not None and not chained.chain.graphed and looped.chain is None
    assert _follow(chained, looped, PROMPT, VOCAB, seed=0, max_context=96) >= 10


def test_a_replay_waits_for_sync_to_settle_the_last_snapshots(small):
    proposer = ModelProposer(small, VOCAB, 96, draft_chain=True)
    drafts = proposer.propose(PROMPT, 4)
    # the snapshots are views of the chain's boundary buffers, which the next proposal overwrites
    snapshot_logits = [logits for _, logits in proposer._snapshots.values()]
    assert sorted(proposer._snapshots) == [len(PROMPT) + i for i in range(3)]
    assert all(logits.data_ptr() == proposer.chain.boundary(i)[1].data_ptr() for i, logits in enumerate(snapshot_logits))
    with pytest.raises(AssertionError, match="snapshots that sync has not settled"):
        proposer._draft_chained(proposer.logits, 2)
    proposer.sync(PROMPT + drafts[:1] + [(drafts[1] + 1) % VOCAB])  # d2 rejected: restores boundary 1, consumes the bonus, settles
    assert not proposer._snapshots
    proposer.propose(PROMPT + drafts[:1] + [(drafts[1] + 1) % VOCAB], 3)


def test_the_cpu_and_rejection_sampling_keep_the_loop(small):
    assert ModelProposer(small, VOCAB, 96).chain is None, "on the CPU nothing changes by default"
    assert ModelProposer(small, VOCAB, 96, SAMPLED, mode=REJECTION, draft_chain=True).chain is None
    assert ModelProposer(small, VOCAB, 96, SAMPLED, mode=COUPLED, draft_chain=True).chain is None, \
        "coupled noise is drawn on the device only on CUDA"
    assert ModelProposer(small, VOCAB, 3, draft_chain=True).chain.max_k == 3, "a chain fits the slot"


# -- on a GPU: the graphs --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shipped_draft():
    if not (SHIPPED_DRAFT / "config.json").exists():
        pytest.skip("no shipped draft model in this checkout")
    return load_model(SHIPPED_DRAFT, "cuda", torch.bfloat16)


def _gpu_prompt(vocab: int) -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(vocab) for _ in range(12)]


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED, SamplingParams(temperature=1.0, seed=3)],
                         ids=["greedy", "coupled-masked", "coupled"])
@pytest.mark.parametrize("seed", [0, 1])
@on_gpu
def test_chained_drafter_equals_the_loop_on_the_gpu(shipped_draft, sampling, seed):
    vocab = shipped_draft.config.vocab_size
    chained = ModelProposer(shipped_draft, vocab, GPU_CONTEXT, sampling, mode=COUPLED)
    looped = ModelProposer(shipped_draft, vocab, GPU_CONTEXT, sampling, mode=COUPLED, draft_chain=False)
    assert chained.chain is not None and chained.chain.graphed, "graphs are on by default on a GPU"
    assert _follow(chained, looped, _gpu_prompt(vocab), vocab, seed, GPU_CONTEXT) >= 50


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "coupled-masked"])
@on_gpu
def test_catch_ups_in_the_graphs_equal_the_loop_on_the_gpu(shipped_draft, sampling):
    vocab = shipped_draft.config.vocab_size
    chained = ModelProposer(shipped_draft, vocab, GPU_CONTEXT, sampling, mode=COUPLED)
    looped = ModelProposer(shipped_draft, vocab, GPU_CONTEXT, sampling, mode=COUPLED, draft_chain=False)
    assert chained.chain.graphed
    assert _follow_by_proposals(chained, looped, _gpu_prompt(vocab), vocab, 4, GPU_CONTEXT) == {NONE, BONUS, TWO, RESTORE_BONUS}


@on_gpu
def test_a_steady_stream_captures_nothing_after_construction(shipped_draft):
    vocab = shipped_draft.config.vocab_size
    proposer = ModelProposer(shipped_draft, vocab, GPU_CONTEXT)
    captured = proposer.graph_captures
    assert captured == len(DRAFT_GRAPH_ROWS) + 4 * CHAIN_MAX_K, \
        "the buckets and chains of 1 .. CHAIN_MAX_K after each of the four catch-ups, at construction"
    rng, context = random.Random(2), _gpu_prompt(vocab)
    proposer.propose(context, 4)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    while len(context) + CHAIN_MAX_K + 1 < GPU_CONTEXT:
        drafts = proposer.propose(context, rng.randint(1, CHAIN_MAX_K))
        context = context + drafts[: rng.randint(0, len(drafts))] + [rng.randrange(vocab)]
    proposer.sync(context)
    torch.cuda.synchronize()
    assert proposer.graph_captures == captured, "a proposal captured a graph"
    assert torch.cuda.memory_allocated() <= allocated + 2 * 4 * vocab, "more than the two logits rows a sync may hold"


@on_gpu
def test_the_target_as_its_own_chained_drafter_has_every_draft_accepted():
    if not (SHIPPED_TARGET / "config.json").exists():
        pytest.skip("no shipped target model in this checkout")
    target = load_model(SHIPPED_TARGET, "cuda", torch.bfloat16)
    vocab = target.config.vocab_size
    engine = Engine(target, 1, GPU_CONTEXT, max_k=4)
    engine.warm_up()
    proposer = ModelProposer(target, vocab, GPU_CONTEXT)
    assert proposer.chain is not None
    prompt = _gpu_prompt(vocab)
    got = generate(engine, prompt, 200, proposer=proposer, k=4)
    assert got.accepted_per_step == got.drafted_per_step, "the chain computes the target's own bits"
    assert got.tokens == generate(engine, prompt, 200).tokens


@on_gpu
def test_chained_proposals_run_no_eager_forward(shipped_draft):
    """Proposals take the chain (one replay) rather than k - 1 runner steps; speed is bench/serve.py's."""
    vocab = shipped_draft.config.vocab_size
    for chain, forwards_per_proposal in ((True, 0), (False, 3)):
        proposer = ModelProposer(shipped_draft, vocab, GPU_CONTEXT, draft_chain=chain)
        runner, calls = proposer.engine.runner, []
        runner_step = runner.step
        context = _gpu_prompt(vocab)
        for proposal in range(10):
            proposer.sync(context)
            runner.step = lambda *args, **kwargs: calls.append(1) or runner_step(*args, **kwargs)
            drafts = proposer.propose(context, 4)
            runner.step = runner_step
            assert len(calls) == forwards_per_proposal * (proposal + 1), f"draft_chain={chain}: {len(calls)} forwards"
            context = context + drafts[:2] + [(drafts[2] + 1) % vocab]  # d3 rejected: the next sync restores


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_drafter_on_another_gpu_than_the_current_one():
    """A drafter on cuda:1 while cuda:0 is current (a verifier's GPU beside it; Triton launches on the
    current device, which failed before the proposer made its own current): the drafts and logits of
    the same drafter on cuda:0, bit for bit, through a stream of acceptances and rejections."""
    if not (SHIPPED_DRAFT / "config.json").exists():
        pytest.skip("no shipped draft model in this checkout")
    torch.cuda.set_device(0)
    drafters = [ModelProposer(load_model(SHIPPED_DRAFT, f"cuda:{i}", torch.bfloat16), 8192, GPU_CONTEXT) for i in (0, 1)]
    assert all(d.chain is not None and d.chain.graphed for d in drafters)
    rng = random.Random(5)
    context = _gpu_prompt(8192)
    for proposal in range(40):
        k = rng.randint(1, CHAIN_MAX_K)
        first, second = (d.propose(context, k) for d in drafters)
        assert first == second, f"proposal {proposal}: drafts differ across GPUs"
        context = context + first[: rng.randint(0, k)] + [rng.randrange(8192)]
        assert torch.equal(drafters[0].sync(context).cpu(), drafters[1].sync(context).cpu()), f"proposal {proposal}: logits"
    assert torch.cuda.current_device() == 0, "the proposer left the current device as it found it"
