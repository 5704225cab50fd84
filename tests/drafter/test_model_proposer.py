"""The model drafter: its slot stays in step with the accepted stream through rejections (its state
equals serial decoding of the accepted context, torch.equal), it refuses a foreign vocabulary, it
sends its probabilities when sampling, and through a verifier on loopback its streams equal plain
decoding (greedy, coupled sampling) or are the target's own rows (rejection sampling)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from drafter.loop import UNARY, generate
from presets.hf_reference import build_hf_model
from presets.tiny import QWEN35_TEXT
from verifier.model import load_model
from verifier.model.state import RecurrentState
from verifier.model.step import decode
from verifier.params import SamplingParams
from verifier.proposers import COUPLED, REJECTION, ModelProposer, ProbabilityProposer
from verifier.sampling import masked_logits

from drafter_setup import MAX_SEQ_LEN, client, plain_in_process, served_checkpoint, server, target  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[2]
VOCAB = QWEN35_TEXT["vocab_size"]
NEW = 24
PROMPT = [5, 9, 14, 3, 5, 9, 14, 3, 7, 22, 40]
SAMPLED = SamplingParams(temperature=0.9, top_k=30, top_p=0.95, seed=42)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    """A different, smaller model over the served model's vocabulary: it agrees with the target
    now and then, so streams through it see both acceptances and rejections."""
    fields = dict(QWEN35_TEXT, hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    path = tmp_path_factory.mktemp("small_draft")
    build_hf_model("qwen3_5_text", fields, seed=3).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def small(small_dir):
    return load_model(small_dir)


class _Recording:
    """A client that keeps every step it sends (use with transport=UNARY)."""

    def __init__(self, client):
        self.client, self.steps = client, []

    def __getattr__(self, name):
        return getattr(self.client, name)

    def step(self, step):
        self.steps.append(step)
        return self.client.step(step)


def _plain(model, prompt, sampling):
    return plain_in_process(model, prompt, NEW, sampling)


class SerialDecode:
    """The reference: prefill all but the first context's last token, then decode every later
    token one by one (the decode path the bit-exactness contract is about)."""

    def __init__(self, model, first_context):
        self.model, self.pool = model, model.new_pool(1, MAX_SEQ_LEN)
        self.slot = self.pool.admit()
        model.prefill(self.pool, self.slot, first_context[:-1])
        self.tokens = list(first_context[:-1])

    def advance(self, context):
        assert context[: len(self.tokens)] == self.tokens, "the reference only follows an accepted stream"
        for token in context[len(self.tokens):]:
            self.logits = decode(self.model, self.pool, [self.slot], [len(self.tokens)], [token])[0]
            self.tokens.append(token)
        return self.logits


def assert_same_state(proposer, reference, length):
    for i, (ours, theirs) in enumerate(zip(proposer.engine.pool.layers, reference.pool.layers)):
        if isinstance(ours, RecurrentState):
            assert torch.equal(ours.conv[proposer.slot], theirs.conv[reference.slot]), f"layer {i} conv window"
            assert torch.equal(ours.recurrent[proposer.slot], theirs.recurrent[reference.slot]), f"layer {i} recurrent state"
        else:
            assert torch.equal(ours.keys[proposer.slot, :length], theirs.keys[reference.slot, :length]), f"layer {i} keys"
            assert torch.equal(ours.values[proposer.slot, :length], theirs.values[reference.slot, :length]), f"layer {i} values"


# chain: the draft chain's body run eagerly on the CPU (its buffers, device-side positions and
# snapshot views; its graphs are tested on a GPU in test_draft_chain.py)
@pytest.mark.parametrize("draft_chain", [False, True], ids=["loop", "chain"])
def test_rollback_keeps_the_drafter_in_step_with_serial_decoding(small, draft_chain):
    proposer = ModelProposer(small, VOCAB, MAX_SEQ_LEN, draft_chain=draft_chain)
    assert (proposer.chain is not None) == draft_chain
    context = list(PROMPT)
    reference = SerialDecode(small, context)
    # every accepted count from none to all, K from 1 to 5, bonus tokens that differ from the draft they replace
    plan = [(4, 0), (4, 4), (3, 2), (1, 0), (1, 1), (5, 3), (2, 1), (4, 4), (5, 0), (3, 3)]
    for i, (k, accepted) in enumerate(plan):
        drafts = proposer.propose(context, k)
        assert len(drafts) == k
        assert drafts[0] == int(torch.argmax(reference.advance(context))), f"step {i}: greedy d1"
        bonus = (drafts[accepted] + 1) % VOCAB if accepted < k else (7 * i) % VOCAB
        context = context + drafts[:accepted] + [bonus]
        logits = proposer.sync(context)
        assert torch.equal(logits, reference.advance(context)), f"step {i} (K={k}, {accepted} accepted): next-token logits"
        assert_same_state(proposer, reference, len(context))
    assert proposer.prefills == 1, "the context is prefilled once, at the start"
    # a step consumes at most K - 1 drafts plus the bonus and the last draft: no replay of the context
    assert proposer.rows <= 1 + sum(k + 1 for k, _ in plan)
    # a context that extends nothing it consumed is a new sequence: one fresh prefill
    other = [11, 12, 13, 14]
    proposer.propose(other, 3)
    fresh = SerialDecode(small, other)
    assert torch.equal(proposer.sync(other + [15]), fresh.advance(other + [15])) and proposer.prefills == 2
    assert_same_state(proposer, fresh, len(other) + 1)


def test_sampled_drafts_come_with_their_distribution(small):
    sampling = SamplingParams(temperature=0.8, top_k=5, seed=1)
    proposer = ModelProposer(small, VOCAB, MAX_SEQ_LEN, sampling, seed=9)
    assert isinstance(proposer, ProbabilityProposer)
    drafts, probs = proposer.propose_with_probs(PROMPT, 4)
    assert probs.dtype == np.float32 and probs.shape == (4, VOCAB)
    reference = SerialDecode(small, PROMPT)
    context = list(PROMPT)
    for r, draft in enumerate(drafts):
        q = torch.softmax(masked_logits(reference.advance(context), sampling), dim=-1).numpy()
        assert np.array_equal(probs[r], q), f"q row {r} is the draft model's masked softmax"
        assert probs[r, draft] > 0 and np.count_nonzero(probs[r]) <= 5  # drawn inside the top-k set
        context.append(draft)
    again = ModelProposer(small, VOCAB, MAX_SEQ_LEN, sampling, seed=9).propose_with_probs(PROMPT, 4)
    assert again[0] == drafts and np.array_equal(again[1], probs), "the same seed draws the same drafts"
    others = [ModelProposer(small, VOCAB, MAX_SEQ_LEN, sampling, seed=s).propose(PROMPT, 4) for s in (10, 11, 12)]
    assert any(o != drafts for o in others), "the seed changes the draws"
    # greedy sessions and coupled mode: deterministic drafts, no distribution
    assert ModelProposer(small, VOCAB, MAX_SEQ_LEN).propose_with_probs(PROMPT, 3)[1] is None
    assert ModelProposer(small, VOCAB, MAX_SEQ_LEN, sampling, mode=COUPLED).propose_with_probs(PROMPT, 3)[1] is None


def test_a_foreign_vocabulary_is_refused(small):
    with pytest.raises(ValueError, match="vocab_size 90 differs from the served model's 96"):
        ModelProposer(small, 96, MAX_SEQ_LEN)
    with pytest.raises(ValueError, match="mode"):
        ModelProposer(small, VOCAB, MAX_SEQ_LEN, mode="both")


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_the_target_as_its_own_drafter_has_every_draft_accepted(client, served_checkpoint, target, sampling):
    proposer = ModelProposer(load_model(served_checkpoint), VOCAB, MAX_SEQ_LEN, sampling, seed=5)
    spy = _Recording(client)
    got = generate(spy, proposer, prompt_ids=PROMPT, max_new_tokens=NEW, sampling=sampling, k=4, transport=UNARY)
    # the drafter computes the target's bits (q == p when sampling), so nothing is ever rejected
    assert got.accepted_per_step == got.drafted_per_step
    assert got.steps == -(-(NEW - 1) // 5), "5 tokens a step after the first token: 4 drafts and the bonus"
    if sampling.temperature == 0:
        assert got.tokens == _plain(target, PROMPT, sampling).tokens
        assert all(s.draft_probs is None for s in spy.steps), "a greedy step never carries probabilities"
    else:
        assert all(s.draft_probs is not None and s.draft_probs.shape == (len(s.draft_ids), VOCAB) for s in spy.steps if s.draft_ids)


def test_a_smaller_drafter_streams_the_plain_tokens(client, small, target):
    for sampling, mode in ((SamplingParams(), REJECTION), (SAMPLED, COUPLED)):
        proposer = ModelProposer(small, VOCAB, MAX_SEQ_LEN, sampling, mode=mode)
        spy = _Recording(client)
        got = generate(spy, proposer, prompt_ids=PROMPT, max_new_tokens=NEW, sampling=sampling, k=3, transport=UNARY)
        assert got.tokens == _plain(target, PROMPT, sampling).tokens, f"{mode} {sampling}"
        assert all(s.draft_probs is None for s in spy.steps)
        assert 0 < sum(got.accepted_per_step) < sum(got.drafted_per_step), "both acceptances and rejections"
        assert proposer.prefills == 1


def test_rejection_sampling_streams_rows_of_the_target(client, small, target):
    proposer = ModelProposer(small, VOCAB, MAX_SEQ_LEN, SAMPLED, seed=2)
    spy = _Recording(client)
    got = generate(spy, proposer, prompt_ids=PROMPT, max_new_tokens=NEW, sampling=SAMPLED, k=3, transport=UNARY,
                   return_logits=True)
    assert any(s.draft_probs is not None for s in spy.steps)
    assert 0 < sum(got.drafted_per_step) and proposer.prefills == 1
    # each token was chosen from the target's own row for the stream so far, bit for bit
    reference = SerialDecode(target, PROMPT + got.tokens[:1])
    rows = [target.prefill(target.new_pool(1, MAX_SEQ_LEN), 0, PROMPT)]
    rows += [reference.advance(PROMPT + got.tokens[: i + 1]) for i in range(len(got.tokens) - 1)]
    assert np.array_equal(got.logits, torch.stack(rows).numpy())
    # the same seeds give the same stream
    again = generate(client, ModelProposer(small, VOCAB, MAX_SEQ_LEN, SAMPLED, seed=2), prompt_ids=PROMPT,
                     max_new_tokens=NEW, sampling=SAMPLED, k=3)
    assert again.tokens == got.tokens and again.accepted_per_step == got.accepted_per_step


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "drafter", "generate", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def test_cli_drafts_with_a_model(server, small_dir, target, tmp_path):
    ids = ",".join(map(str, PROMPT))
    proc = _cli("--server", server.address, "--prompt-ids", ids, "--max-new-tokens", NEW, "--json",
                "--drafter", "model", "--draft-model", small_dir, "--k", 3, "--adaptive-k")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["tokens"] == _plain(target, PROMPT, SamplingParams()).tokens
    assert got["drafter"] == "model" and got["k"] == 3 and got["adaptive_k"] is True
    assert all(1 <= d <= 3 for d in got["drafted_per_step"][:-1]) and 0 < sum(got["accepted_per_step"])
    # a draft model over another vocabulary is refused before any weight is read
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    config = json.loads((small_dir / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps(dict(config, vocab_size=VOCAB + 6)))
    for drafting, message in (((), "a drafter must share the target's vocabulary"),  # the shipped draft model is the default
                              (("--draft-model", foreign), "vocab_size 96 differs from the served model's 90")):
        proc = _cli("--server", server.address, "--prompt-ids", ids, "--max-new-tokens", 4, "--drafter", "model", *drafting)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
