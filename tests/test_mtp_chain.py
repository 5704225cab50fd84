"""The MTP chain (verifier/proposers/mtp_chain.py): a proposal through it, one CUDA graph replay on
a GPU or the same body eagerly on the CPU, drafts what the eager MTPDrafter drafts, proposal by
proposal (==), for catch-ups of one row (drafts rejected) and of K + 1 rows (every draft kept: an
oracle's drafts are sent while the head proposes), and the streams stay plain decoding's."""

import pytest
import torch

from verifier.engine import Engine
from verifier.generate import generate
from verifier.model import load_model
from verifier.model.mtp import load_mtp_head
from verifier.params import SamplingParams
from verifier.proposers import MTPProposer, OracleProposer
from mtp_recording import Recording

FAMILIES = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next_moe"]
PROMPT = [5, 9, 2, 7, 11, 3]
NEW = 20
K = 4


def _run(engine, head, params, chain: bool, oracle: bool):
    proposer = MTPProposer(head, engine.pool.max_seq_len, params, chain=chain)
    assert (proposer.chain is not None) == chain
    instead = OracleProposer(len(PROMPT), generate(engine, PROMPT, NEW, params).tokens) if oracle else None
    recording = Recording(proposer, instead)
    result = generate(engine, PROMPT, NEW, params, recording, K)
    return result, recording.calls, proposer


def _samplings(device):
    out = {"greedy": SamplingParams()}
    if device == "cuda":  # a coupled draft is chosen on the device only on CUDA
        out["sampled"] = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    return out


@pytest.mark.parametrize("oracle", [False, True], ids=["rejected", "all-kept"])
@pytest.mark.parametrize("name", FAMILIES)
def test_chain_drafts_equal_the_eager_drafters(mtp_checkpoint, name, oracle, model_device):
    path = mtp_checkpoint(name)
    model = load_model(path, model_device)
    head = load_mtp_head(path, model)
    engine = Engine(model, n_slots=1, max_seq_len=len(PROMPT) + NEW + K, max_k=K)
    for label, params in _samplings(model_device).items():
        plain = generate(engine, PROMPT, NEW, params)
        chained, chain_calls, proposer = _run(engine, head, params, chain=True, oracle=oracle)
        eager, eager_calls, _ = _run(engine, head, params, chain=False, oracle=oracle)
        assert chain_calls == eager_calls, label
        assert chained.tokens == eager.tokens == plain.tokens, label
        assert torch.equal(chained.logits, plain.logits), label
        if oracle:  # every draft kept: catch-ups of K + 1 rows went through the chain
            assert max(chained.accepted_per_step) == K
        if model_device == "cuda":
            assert 0 < proposer.chain.captures <= len({(c, k) for _, k, _, _ in chain_calls for c in range(1, K + 2)})


def test_a_chain_with_sampling_needs_cuda(mtp_checkpoint):
    path = mtp_checkpoint("qwen3_5_text")
    model = load_model(path, "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        MTPProposer(load_mtp_head(path, model), 64, SamplingParams(temperature=0.7, seed=1), chain=True)


def test_a_shared_drafter_proposes_few_sequences_through_their_chains(mtp_checkpoint, model_device):
    """The server's MTPDrafter: three sequences proposing together, each through its own chain
    (at most MTP_CHAIN_MAX_SEQUENCES of them), draft what the batched forwards draft, round by round."""
    from verifier.engine import StepRequest
    from verifier.generation import draft_room
    from verifier.proposers.mtp import MTP_CHAIN_MAX_SEQUENCES, MTPDrafter

    prompts = [PROMPT, [8, 1, 4], [30, 2, 2, 17, 6, 40, 12, 9, 1]]
    assert len(prompts) <= MTP_CHAIN_MAX_SEQUENCES
    path = mtp_checkpoint("qwen3_5_moe_text")
    model = load_model(path, model_device)
    head = load_mtp_head(path, model)
    max_seq_len = max(map(len, prompts)) + NEW + K
    engine = Engine(model, n_slots=len(prompts), max_seq_len=max_seq_len, max_k=K)
    rounds = {}
    for chain in (True, False):
        drafter = MTPDrafter(head, len(prompts), max_seq_len)
        seqs = [engine.open(p, SamplingParams(), NEW, want_hidden=True) for p in prompts]
        proposers = [drafter.proposer(s.slot, s.sampling, chain=chain) for s in seqs]
        assert all((p.chain is not None) == chain for p in proposers)
        for proposer, seq in zip(proposers, seqs):
            proposer.begin(seq.prompt_hidden)
        contexts = [list(p) + [s.pending] for p, s in zip(prompts, seqs)]
        log = []
        while live := [i for i, s in enumerate(seqs) if not s.finished]:
            rooms = {i: draft_room(K, K, max_seq_len, seqs[i].position, NEW, seqs[i].emitted) for i in live}
            proposed = drafter.propose([proposers[i].ask(contexts[i], rooms[i]) for i in live])
            drafts = [list(result[0]) for result in proposed]
            log.append(drafts)
            results = engine.step([StepRequest(seqs[i], d, want_hidden=True) for i, d in zip(live, drafts)])
            for i, result in zip(live, results):
                contexts[i] += result.tokens
                proposers[i].observe(result.hidden)
        for seq in seqs:
            engine.close(seq)
        rounds[chain] = log
    assert rounds[True] == rounds[False]
    assert any(len(d) > 1 for drafts in rounds[True] for d in drafts)


def test_a_slot_keeps_its_chain_for_the_next_session_that_chooses_alike(mtp_checkpoint, model_device):
    """A new sequence in a slot reuses the slot's chain (its captured graphs) when it chooses as the
    last one did, and drafts what the eager drafter drafts; one that chooses otherwise gets a new chain."""
    from verifier.proposers.mtp import MTPDrafter

    path = mtp_checkpoint("qwen3_5_text")
    model = load_model(path, model_device)
    head = load_mtp_head(path, model)
    engine = Engine(model, n_slots=1, max_seq_len=len(PROMPT) + NEW + K, max_k=K)
    drafter = MTPDrafter(head, 1, engine.pool.max_seq_len)
    first = drafter.proposer(0, SamplingParams(), chain=True)
    second = drafter.proposer(0, SamplingParams(), chain=True)
    assert second.chain is first.chain
    eager = MTPProposer(head, engine.pool.max_seq_len, chain=False)
    for proposer in (first, second):
        with_chain, without = Recording(proposer), Recording(eager)
        generate(engine, PROMPT, NEW, SamplingParams(), with_chain, K)
        generate(engine, PROMPT, NEW, SamplingParams(), without, K)
        assert with_chain.calls == without.calls
    if model_device == "cuda":  # a coupled choice: another chain for the slot
        sampled = drafter.proposer(0, SamplingParams(temperature=0.8, seed=2))
        assert sampled.chain is not first.chain and drafter.proposer(0, SamplingParams()).chain is not first.chain
