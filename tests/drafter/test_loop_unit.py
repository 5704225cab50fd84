"""DraftLoop without a server: how drafts are cut, how replies are taken in, and when a reply that
does not fit its step is refused; and the text stream of the CLI."""

import grpc
import numpy as np
import pytest

from drafter.loop import DraftLoop
from drafter.messages import ModelInfo, Session, StepOutcome, VerifierError
from verifier.tokenizer import TextStream
from verifier.generation import Generation, draft_room, mean_acceptance_length
from verifier.tokenizer import byte_level_tokenizer

OK = grpc.StatusCode.OK


def _info(max_context=100, max_k=8, vocab=50):
    return ModelInfo("verifier.v1", "m", "qwen3_5_text", vocab, (0,), max_context, max_k, ("gdn", "attention"),
                     "woa", False, 2, "cpu", "float32")


class _Fixed:
    """Proposes the same tokens every time, and records the contexts and k it was asked for."""

    def __init__(self, tokens):
        self.tokens, self.calls = tokens, []

    def propose(self, context, k):
        self.calls.append((list(context), k))
        return self.tokens[:k]


def _loop(proposer, k=4, max_new_tokens=20, position=3, **info):
    session = Session("s", position, 9, None, [1, 2, 3][:position] or [1])
    return DraftLoop(session, _info(**info), proposer, k, max_new_tokens)


def _outcome(step, accepted, tokens, finish=None, verified=None):
    return StepOutcome(OK, "", step.session_id, step.request_id, accepted, tokens, step.expected_position + len(tokens), finish,
                       verified_drafts=verified)


def test_drafts_are_cut_to_k_max_k_context_and_budget():
    many = _Fixed(list(range(10, 30)))
    assert len(_loop(many, k=6).next_step().draft_ids) == 6
    assert len(_loop(many, k=6, max_k=2).next_step().draft_ids) == 2
    # position 3 in a context of 6: rows at 3, 4, 5 -> pending + 2 drafts
    assert len(_loop(many, k=6, max_context=6).next_step().draft_ids) == 2
    # budget 3 with the first token emitted: the step may emit 2 more -> 1 draft
    assert len(_loop(many, k=6, max_new_tokens=3).next_step().draft_ids) == 1
    assert _loop(many, k=6, max_new_tokens=2).next_step().draft_ids == ()
    assert _loop(None, k=6).next_step().draft_ids == ()


def test_proposer_sees_prompt_plus_emitted_tokens_and_overlong_proposals_are_cut():
    class Greedy:  # ignores k: the loop must still cut
        def propose(self, context, k):
            self.seen = list(context)
            return [7] * 20

    proposer = Greedy()
    loop = _loop(proposer, k=3)
    step = loop.next_step()
    assert proposer.seen == [1, 2, 3, 9] and step.draft_ids == (7, 7, 7)
    assert loop.advance(step, _outcome(step, 1, [7, 4])) == [7, 4]
    step = loop.next_step()
    assert proposer.seen == [1, 2, 3, 9, 7, 4] and step.expected_position == 5


def test_advance_records_steps_and_finishes():
    loop = _loop(_Fixed([5, 6, 7]), k=3)
    step = loop.next_step()
    loop.advance(step, _outcome(step, 3, [5, 6, 7, 8]))
    step = loop.next_step()
    loop.advance(step, _outcome(step, 0, [2], finish="eos"))
    result = loop.result()
    assert loop.finished and result.finish_reason == "eos"
    assert result.tokens == [9, 5, 6, 7, 8, 2]
    assert result.accepted_per_step == [3, 0] and result.drafted_per_step == [3, 3]
    assert result.mean_acceptance_length == 1 + 3 / 2


def test_a_step_counts_the_drafts_the_server_verified():
    """Goodput-aware K verified 1 of 3 drafts: the step drafted 1 (the mean acceptance length counts
    what the target saw) and adaptive K learns from the one judged draft."""
    from drafter.adaptive import AdaptiveK

    rule = AdaptiveK(3)
    loop = DraftLoop(Session("s", 3, 9, None, [1, 2, 3]), _info(), _Fixed([5, 6, 7]), 3, 20, adaptive=rule)
    step = loop.next_step()
    loop.advance(step, _outcome(step, 1, [5, 4], verified=1))
    step = loop.next_step()
    loop.advance(step, _outcome(step, 0, [2], verified=0))  # all trimmed: a plain step
    result = loop.result()
    assert result.drafted_per_step == [1, 0] and result.accepted_per_step == [1, 0]
    assert result.mean_acceptance_length == 2.0
    assert rule.successes == 1 and rule.trials == 1  # 1 of 1 judged, nothing learnt from the trimmed step


@pytest.mark.parametrize("bad", ["position", "accepted-not-drafts", "accepted-over-k", "empty", "not-ok",
                                 "accepted-over-verified", "verified-over-sent"])
def test_advance_refuses_a_reply_that_does_not_fit_the_step(bad):
    loop = _loop(_Fixed([5, 6]), k=2)
    step = loop.next_step()
    outcome = {
        "position": StepOutcome(OK, "", "s", "", 1, [5, 1], step.expected_position + 3, None),
        "accepted-not-drafts": _outcome(step, 2, [5, 4, 1]),
        "accepted-over-k": _outcome(step, 3, [5, 6, 1]),
        "empty": _outcome(step, 0, []),
        "not-ok": StepOutcome(grpc.StatusCode.ABORTED, "stale expected_position", "s", "", 0, [], 0, None, current_position=8),
        "accepted-over-verified": _outcome(step, 2, [5, 6, 1], verified=1),
        "verified-over-sent": _outcome(step, 1, [5, 1], verified=3),
    }[bad]
    with pytest.raises(VerifierError) as info:
        loop.advance(step, outcome)
    if bad == "not-ok":
        assert info.value.code == grpc.StatusCode.ABORTED and info.value.current_position == 8
    else:
        assert info.value.code == grpc.StatusCode.INTERNAL
    assert loop.tokens == [9] and loop.position == 3  # nothing taken in


def test_mean_acceptance_length_counts_only_drafted_steps():
    gen = Generation([1, 2, 3], "length", accepted_per_step=[2, 0, 1], drafted_per_step=[4, 0, 2])
    assert gen.steps == 3 and gen.mean_acceptance_length == 1 + 3 / 2 == mean_acceptance_length(3, 2)
    assert Generation([1], "length", [0], [0]).mean_acceptance_length == 1.0 == mean_acceptance_length(0, 0)
    assert gen.step_figures() == {"steps": 3, "accepted_per_step": [2, 0, 1], "drafted_per_step": [4, 0, 2],
                                  "mean_acceptance_length": 2.5}


def test_draft_room_is_the_tightest_of_k_max_k_context_and_budget():
    # k, max_k, max_context, position, max_new_tokens, emitted
    assert draft_room(4, 8, 100, 10, 50, 1) == 4
    assert draft_room(9, 8, 100, 10, 50, 1) == 8
    assert draft_room(8, 8, 14, 10, 50, 1) == 3  # rows at 10..13: the pending token and 3 drafts
    assert draft_room(8, 8, 100, 10, 5, 3) == 1  # 2 tokens left: one draft and the bonus
    assert draft_room(8, 8, 11, 10, 50, 1) == 0 and draft_room(8, 8, 100, 10, 5, 5) == 0


def test_text_stream_holds_back_a_split_character():
    tok = byte_level_tokenizer()
    ids = tok.encode("aé€b", add_special_tokens=False).ids  # é: 2 bytes, €: 3 bytes
    assert len(ids) == 1 + 2 + 3 + 1
    stream = TextStream(tok)
    pieces = [stream.push([i]) for i in ids]
    assert pieces == ["a", "", "é", "", "", "€", "b"]
    assert stream.text == "aé€b" and stream.flush() == ""
    cut = TextStream(tok)
    assert cut.push(ids[:2]) == "a" and cut.flush() == "\ufffd"  # an incomplete end is shown at the end


def test_logits_are_stacked_in_token_order():
    session = Session("s", 1, 9, None, [1], logits=np.zeros((1, 4), np.float32))
    loop = DraftLoop(session, _info(vocab=4), _Fixed([3]), 1, 10, return_logits=True)
    step = loop.next_step()
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    outcome = _outcome(step, 1, [3, 2])
    outcome.logits = rows
    loop.advance(step, outcome)
    assert np.array_equal(loop.result().logits, np.concatenate([np.zeros((1, 4), np.float32), rows]))
    step = loop.next_step()
    with pytest.raises(VerifierError, match="logits"):
        loop.advance(step, _outcome(step, 0, [1]))  # asked for logits, got none
