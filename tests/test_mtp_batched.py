"""Batched MTP drafting (verifier/proposers/mtp.py MTPDrafter): one head pool with a slot per engine
slot, every sequence's catch-up rows in one forward, then one forward of one row per sequence per
further draft position. A sequence's drafts are the same, bitwise (==), whether it proposes alone or
batched with others (other prompts, positions, k and samplings; reused slots), the streams equal
plain decoding, and a failure stays with the sequence it belongs to. Run with --model-device cuda
to check it on the Triton kernels, where a batch's row count could change a kernel's launch."""

import pytest
import torch

from verifier.engine import Engine, StepRequest
from verifier.generate import generate
from verifier.generation import draft_room
from verifier.model import load_model
from verifier.model.mtp import load_mtp_head
from verifier.params import SamplingParams
from verifier.proposers.mtp import MTPAsk, MTPDrafter, MTPProposer, MTPTrack
from mtp_recording import Recording

MAX_SEQ_LEN, MAX_K, NEW = 40, 4, 14
# three sequences: other prompts (so other positions), other k, greedy and coupled sampling
PROMPTS = [[5, 9, 2, 7, 11, 3], [8, 1, 4], [30, 2, 2, 17, 6, 40, 12, 9, 1]]
SAMPLINGS = [SamplingParams(), SamplingParams(temperature=0.9, top_k=20, seed=4),
             SamplingParams(temperature=1.3, top_p=0.9, seed=8)]
KS = [3, 2, 4]


class CountingForwards:
    """head.forward wrapped (an instance attribute): the slots of each forward's batch, and per slot
    the (first position, logits rows [n, vocab]) of each forward it took part in, in order;
    `fail_slot`: a forward whose batch holds that slot raises."""

    def __init__(self, head):
        self.head, self.batches, self.fail_slot = head, [], None
        self.logits: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self.forward = head.forward

    def __enter__(self):
        def forward(tokens, hidden, batch, pool, **kwargs):
            self.batches.append(batch.slots)
            if self.fail_slot in batch.slots:
                raise RuntimeError(f"a forward failed with slot {self.fail_slot} in its batch")
            out, logits = self.forward(tokens, hidden, batch, pool, **kwargs)
            for slot, start, rows in batch.sequences():
                self.logits.setdefault(slot, []).append((start, logits[rows].cpu()))
            return out, logits

        self.head.forward = forward
        return self

    def __exit__(self, *exc):
        del self.head.forward  # the class's again


@pytest.fixture(scope="module")
def setup(mtp_checkpoint, model_device):
    path = mtp_checkpoint("qwen3_next_moe")
    model = load_model(path, model_device)
    return model, load_mtp_head(path, model)


def run_batched(engine: Engine, drafter: MTPDrafter, order: list[int]):
    """The sequences `order` names stepped together, their drafts proposed together each round ->
    (tokens per sequence, drafts of each proposal per sequence, (forwards, largest room) per round,
    the head's logits rows per sequence as CountingForwards records them)."""
    seqs = [engine.open(PROMPTS[i], SAMPLINGS[i], NEW, want_hidden=True) for i in order]
    # the batched forwards (chains off: on a GPU a few sequences would otherwise replay their chains)
    proposers = [drafter.proposer(seq.slot, seq.sampling, chain=False) for seq in seqs]
    for proposer, seq in zip(proposers, seqs):
        proposer.begin(seq.prompt_hidden)
        assert proposer.track.held[0] is seq.prompt_hidden, "the prompt's rows are kept by reference, not copied"
    tokens = [[seq.pending] for seq in seqs]
    drafts = [[] for _ in seqs]
    rounds, logits = [], [[] for _ in seqs]
    while not all(seq.finished for seq in seqs):
        live = [s for s, seq in enumerate(seqs) if not seq.finished]
        rooms = [draft_room(KS[order[s]], engine.max_k, MAX_SEQ_LEN, seqs[s].position, NEW, len(tokens[s])) for s in live]
        asks = [proposers[s].ask(PROMPTS[order[s]] + tokens[s], room) for s, room in zip(live, rooms)]
        with CountingForwards(drafter.head) as counting:
            proposed = drafter.propose(asks)
        rounds.append((len(counting.batches), max(rooms)))
        for s, seq in enumerate(seqs):
            logits[s] += counting.logits.get(seq.slot, [])
        requests = []
        for s, room, (ids, probs) in zip(live, rooms, proposed):
            assert probs is None and len(ids) == room
            if room:
                drafts[s].append(ids)
            requests.append(StepRequest(seqs[s], ids, want_hidden=True))
        for s, result in zip(live, engine.step(requests)):
            assert result.error is None
            proposers[s].observe(result.hidden)
            tokens[s] += result.tokens
    for seq in seqs:
        engine.close(seq)
    return tokens, drafts, rounds, logits


def test_drafts_batched_equal_drafts_alone(setup):
    model, head = setup
    engine = Engine(model, n_slots=3, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K)
    drafter = MTPDrafter(head, 3, MAX_SEQ_LEN)
    alone_engine = Engine(model, n_slots=1, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K)
    alone = []
    for prompt, sampling, k in zip(PROMPTS, SAMPLINGS, KS):
        # the eager drafter alone (on a GPU the default would be the graphed chain, whose forwards
        # CountingForwards cannot see: tests/test_mtp_chain.py holds the chain to the eager drafts)
        recording = Recording(MTPProposer(head, MAX_SEQ_LEN, sampling, chain=False))
        with CountingForwards(head) as counting:
            spec = generate(alone_engine, prompt, NEW, sampling, recording, k)
        assert spec.tokens == generate(alone_engine, prompt, NEW, sampling).tokens
        alone.append((spec.tokens, recording.drafts, counting.logits[0]))
    # twice, the second time in other slots: a reused slot drafts as a fresh one
    for order in ([0, 1, 2], [2, 0, 1]):
        tokens, drafts, rounds, logits = run_batched(engine, drafter, order)
        for s, i in enumerate(order):
            assert tokens[s] == alone[i][0], f"sequence {i}: the stream"
            assert drafts[s] == alone[i][1], f"sequence {i}: the drafts, alone and batched"
            # and the head's logits behind them, every row of every forward, bitwise
            assert len(logits[s]) == len(alone[i][2])
            for (start, rows), (alone_start, alone_rows) in zip(logits[s], alone[i][2]):
                assert start == alone_start and torch.equal(rows, alone_rows), f"sequence {i}: logits from position {start}"
        # one catch-up forward for all, then one per further draft position: never one per sequence
        assert all(forwards == (room if room else 0) for forwards, room in rounds), rounds
        assert any(room > 1 for _, room in rounds)


def _opened(model, head, n):
    """An engine and a drafter of n slots, n sequences opened with their proposers begun."""
    engine = Engine(model, n_slots=n, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K)
    drafter = MTPDrafter(head, n, MAX_SEQ_LEN)
    seqs = [engine.open(PROMPTS[i], SAMPLINGS[i], NEW, want_hidden=True) for i in range(n)]
    proposers = [drafter.proposer(seq.slot, seq.sampling, chain=False) for seq in seqs]
    for proposer, seq in zip(proposers, seqs):
        proposer.begin(seq.prompt_hidden)
    return engine, drafter, seqs, proposers


def _asks(proposers, seqs):
    return [p.ask(PROMPTS[i] + [seq.pending], MAX_K) for i, (p, seq) in enumerate(zip(proposers, seqs))]


def test_a_wrong_ask_fails_alone(setup):
    model, head = setup
    engine, drafter, seqs, proposers = _opened(model, head, 3)
    asks = _asks(proposers, seqs)
    wrong = MTPAsk(asks[1].track, asks[1].context + [3], MAX_K)  # a token the hidden rows do not cover
    outside = MTPAsk(MTPTrack(slot=7), [1, 2], 1)
    results = drafter.propose([asks[0], wrong, asks[2], outside])
    assert isinstance(results[1], ValueError) and "hidden rows of" in str(results[1])
    assert isinstance(results[3], ValueError) and "slot 7 is outside its pool of 3 slots" in str(results[3])
    # the others drafted, as each alone (a repeated proposal re-feeds the same rows: the same drafts)
    for i in (0, 2):
        assert results[i] == drafter.propose([asks[i]])[0] and len(results[i][0]) == MAX_K
    twice = drafter.propose([asks[0], MTPAsk(asks[0].track, asks[0].context, 1)])
    assert twice[0] == results[0] and isinstance(twice[1], ValueError) and "slot 0 asked for twice" in str(twice[1])
    (too_long,) = drafter.propose([MTPAsk(asks[0].track, list(range(MAX_SEQ_LEN + 1)), 1)])
    assert isinstance(too_long, ValueError) and "passes max_seq_len" in str(too_long)
    with pytest.raises(ValueError, match=r"hidden rows must be \[rows, "):
        drafter.observe(asks[0].track, torch.zeros(3))
    with pytest.raises(ValueError, match="slot 3 is outside"):
        drafter.proposer(3)
    for seq in seqs:
        engine.close(seq)


def test_a_failed_forward_fails_its_own_sequence_alone(setup):
    """A batched forward that raises is retried for each sequence alone: the sequence it fails for
    gets the exception, the others their drafts (the same as alone), and the failed one drafts
    again on its next proposal, as a head fed from scratch would."""
    model, head = setup
    engine, drafter, seqs, proposers = _opened(model, head, 3)
    asks = _asks(proposers, seqs)
    _, fresh_drafter, fresh_seqs, fresh = _opened(model, head, 3)  # a reference that never failed
    expected = fresh_drafter.propose(_asks(fresh, fresh_seqs))
    with CountingForwards(head) as counting:
        counting.fail_slot = seqs[1].slot
        results = drafter.propose(asks)
    assert isinstance(results[1], RuntimeError)
    assert results[0] == expected[0] and results[2] == expected[2]
    assert drafter.propose([asks[1]])[0] == expected[1]
    for seq in seqs:
        engine.close(seq)
