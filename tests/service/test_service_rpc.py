"""The RPCs one at a time: model info, sessions, steps, idempotent retries, stale positions."""

import grpc
import numpy as np
import torch

from verifier import rpc
from verifier.engine import Engine, StepRequest
from verifier.model import load_model
from verifier.params import SamplingParams
from verifier.tokenizer import TextTokenizer

from .helpers import code_of, logits_array, open_session, rpc_error, step, verify_one

PROMPT = [5, 17, 33, 2, 60, 41]


def test_model_info(stub, server):
    info = stub.GetModelInfo(rpc.GetModelInfoRequest())
    assert info.protocol_version == rpc.PROTOCOL_VERSION == "verifier.v1"
    assert info.model_type == "qwen3_5_text" and info.model_id == server.config.model_dir.name
    assert info.vocab_size == 90 and info.max_context == 96 and info.max_k == 8 and info.n_slots == 24
    assert list(info.layer_kinds) == ["attention", "gdn", "gdn", "attention"]
    assert info.rollback_mode == "woa" and info.has_tokenizer and info.device == "cpu" and info.dtype == "float32"
    assert list(info.eos_ids) == list(server.server.engine.model.config.eos_token_ids)


def test_open_verify_close_follow_plain_decoding(stub, plain):
    expected = plain(PROMPT, 12)
    opened = open_session(stub, PROMPT, 12, return_logits=True)
    assert opened.position == len(PROMPT) and list(opened.prompt_ids) == PROMPT
    assert opened.first_token == expected.tokens[0] and opened.finish_reason == rpc.FINISH_NONE
    assert np.array_equal(logits_array(opened.logits), expected.logits[:1].numpy())
    # a correct draft of 3 is accepted whole; a wrong one is cut at its first wrong token
    correct = verify_one(stub, opened.session_id, opened.position, expected.tokens[1:4], return_logits=True)
    assert correct.status.code == 0 and correct.accepted == 3 and list(correct.tokens) == expected.tokens[1:5]
    assert correct.position == len(PROMPT) + 4
    assert np.array_equal(logits_array(correct.logits), expected.logits[1:5].numpy())
    wrong = [(expected.tokens[5] + 1) % 90, 7]
    result = verify_one(stub, opened.session_id, correct.position, wrong, return_logits=True)
    assert result.accepted == 0 and list(result.tokens) == expected.tokens[5:6]
    assert np.array_equal(logits_array(result.logits), expected.logits[5:6].numpy())
    assert stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id)).closed
    assert not stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id)).closed  # idempotent
    after = verify_one(stub, opened.session_id, result.position)
    assert code_of(after) == grpc.StatusCode.NOT_FOUND and "closed" in after.status.message


def test_session_runs_to_its_token_budget(stub, plain):
    expected = plain(PROMPT, 7)
    opened = open_session(stub, PROMPT, 7)
    tokens, position = [opened.first_token], opened.position
    while True:
        result = verify_one(stub, opened.session_id, position, expected.tokens[len(tokens):len(tokens) + 8])
        assert result.status.code == 0, result.status.message
        tokens += result.tokens
        position = result.position
        if result.finish_reason:
            break
    assert tokens == expected.tokens and result.finish_reason == rpc.FINISH_LENGTH
    done = verify_one(stub, opened.session_id, position)
    assert code_of(done) == grpc.StatusCode.FAILED_PRECONDITION and "finished" in done.status.message
    stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


def test_text_prompt_is_tokenized(stub, plain, text_checkpoint):
    prompt = TextTokenizer.from_model_dir(text_checkpoint).encode("HELLO, 42")
    opened = stub.OpenSession(rpc.OpenSessionRequest(text="HELLO, 42", max_new_tokens=4))
    assert list(opened.prompt_ids) == prompt and opened.position == len(prompt)
    assert opened.first_token == plain(prompt, 4).tokens[0]
    stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


def test_seeded_sampling_follows_plain_sampling(stub, plain):
    sampling = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=1234)
    expected = plain(PROMPT, 10, sampling)
    opened = open_session(stub, PROMPT, 10, sampling=rpc.Sampling(temperature=0.9, top_k=20, top_p=0.95, seed=1234))
    first = verify_one(stub, opened.session_id, opened.position, expected.tokens[1:3] + [0])
    tokens = [opened.first_token, *first.tokens]
    assert tokens == expected.tokens[: len(tokens)] and first.accepted >= 2
    stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


def test_retried_step_returns_stored_result_and_advances_once(stub, plain):
    expected = plain(PROMPT, 20)
    opened = open_session(stub, PROMPT, 20)
    first = verify_one(stub, opened.session_id, opened.position, expected.tokens[1:3], request_id="step-1")
    again = verify_one(stub, opened.session_id, opened.position, expected.tokens[1:3], request_id="step-1")
    assert first.status.code == 0 and again.SerializeToString() == first.SerializeToString()
    # the session advanced once: a new step at the old position is stale
    stale = verify_one(stub, opened.session_id, opened.position, request_id="step-2")
    assert code_of(stale) == grpc.StatusCode.ABORTED and stale.status.current_position == first.position
    assert "expected_position" in stale.status.message
    nxt = verify_one(stub, opened.session_id, first.position, request_id="step-2")
    assert list(nxt.tokens) == expected.tokens[4:5] and nxt.position == first.position + 1
    stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


def test_stream_retry_is_idempotent_too(stub, plain):
    expected = plain(PROMPT, 20)
    opened = open_session(stub, PROMPT, 20)
    steps = [step(opened.session_id, opened.position, expected.tokens[1:2], request_id="s1"),
             step(opened.session_id, opened.position, expected.tokens[1:2], request_id="s1"),  # a retry
             step(opened.session_id, opened.position + 2, [], request_id="s2")]
    results = list(stub.VerifyStream(iter(steps)))
    assert [r.status.code for r in results] == [0, 0, 0]
    assert results[0].SerializeToString() == results[1].SerializeToString()
    assert [t for r in (results[0], results[2]) for t in r.tokens] == expected.tokens[1:4]
    stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


def test_verify_rounds_answers_each_request_as_verify_does_in_order(stub, plain):
    expected = plain(PROMPT, 20)
    a, b = open_session(stub, PROMPT, 20), open_session(stub, PROMPT, 20)
    rounds = [rpc.VerifyRequest(steps=[step(a.session_id, a.position, expected.tokens[1:3], request_id="a1"),
                                       step(b.session_id, b.position, [], request_id="b1")]),
              # the second round is sent before the first is answered: a's step runs from where a1 leaves it
              rpc.VerifyRequest(steps=[step(a.session_id, a.position + 3, [], request_id="a2")]),
              # one step per session in a request, as Verify: b's second step is refused, its first runs
              rpc.VerifyRequest(steps=[step(b.session_id, b.position + 1, []), step(b.session_id, b.position + 1, [])]),
              # a retry of a1 (same id, same content): its stored result, and the session does not move
              rpc.VerifyRequest(steps=[step(a.session_id, a.position, expected.tokens[1:3], request_id="a1")])]
    before = stub.GetStats(rpc.GetStatsRequest())
    responses = list(stub.VerifyRounds(iter(rounds), timeout=30))
    assert [[r.session_id for r in response.results] for response in responses] == [[a.session_id, b.session_id],
                                                                                     [a.session_id], [b.session_id] * 2, [a.session_id]]
    first, second, repeated, retried = responses
    assert [list(r.tokens) for r in first.results] == [expected.tokens[1:4], expected.tokens[1:2]]
    assert list(second.results[0].tokens) == expected.tokens[4:5] and second.results[0].position == a.position + 4
    assert [code_of(r) for r in repeated.results] == [grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT]
    assert list(repeated.results[0].tokens) == expected.tokens[2:3]
    assert retried.results[0].SerializeToString() == first.results[0].SerializeToString()
    assert stub.GetStats(rpc.GetStatsRequest()).steps - before.steps == 4  # a1, b1, a2, b2: the retry ran nothing
    for opened in (a, b):
        stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


def test_open_session_retry_returns_the_same_session(stub):
    before = stub.GetStats(rpc.GetStatsRequest())
    first = open_session(stub, PROMPT, 5, request_id="open-once")
    again = open_session(stub, PROMPT, 5, request_id="open-once")
    assert again.SerializeToString() == first.SerializeToString()
    stats = stub.GetStats(rpc.GetStatsRequest())
    assert stats.open_sessions == before.open_sessions + 1 and stats.free_slots == before.free_slots - 1
    stub.CloseSession(rpc.CloseSessionRequest(session_id=first.session_id))
    assert stub.GetStats(rpc.GetStatsRequest()).free_slots == before.free_slots


def test_stats_count_steps_drafts_and_acceptance(stub, plain):
    expected = plain(PROMPT, 20)
    opened = open_session(stub, PROMPT, 20)
    before = stub.GetStats(rpc.GetStatsRequest())
    # 3 drafts, the first 2 right: accepted 2 at positions 1 and 2, drafted at 1, 2 and 3
    drafts = expected.tokens[1:3] + [(expected.tokens[3] + 1) % 90]
    result = verify_one(stub, opened.session_id, opened.position, drafts)
    assert result.accepted == 2
    after = stub.GetStats(rpc.GetStatsRequest())
    assert after.steps == before.steps + 1 and after.engine_steps == before.engine_steps + 1
    assert after.rows == before.rows + 4 and after.drafts == before.drafts + 1
    assert after.draft_tokens == before.draft_tokens + 3 and after.accepted_tokens == before.accepted_tokens + 2
    drafted = np.array(after.drafted_per_position) - np.array(before.drafted_per_position)
    accepted = np.array(after.accepted_per_position) - np.array(before.accepted_per_position)
    assert drafted.tolist() == [1, 1, 1, 0, 0, 0, 0, 0] and accepted.tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert after.rows_per_batch.count == before.rows_per_batch.count + 1
    assert after.step_latency_ms.count == before.step_latency_ms.count + 1
    assert len(after.rows_per_batch.counts) == len(after.rows_per_batch.upper_bounds) + 1
    assert after.mean_acceptance_length == 1 + after.accepted_tokens / after.drafts
    stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


def test_unknown_session_and_close_of_unknown(stub):
    result = verify_one(stub, "no-such-session", 3)
    assert code_of(result) == grpc.StatusCode.NOT_FOUND and "session_id" in result.status.message
    assert not stub.CloseSession(rpc.CloseSessionRequest(session_id="no-such-session")).closed


def test_open_session_argument_errors(stub):
    cases = [
        (rpc.OpenSessionRequest(prompt_ids=[1], text="A", max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids and text"),
        (rpc.OpenSessionRequest(max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids and text"),
        (rpc.OpenSessionRequest(prompt_ids=[1, 90], max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids"),
        (rpc.OpenSessionRequest(prompt_ids=[1, -3], max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids"),
        (rpc.OpenSessionRequest(text="lower case is past id 89", max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "text"),
        (rpc.OpenSessionRequest(prompt_ids=[1], max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
        (rpc.OpenSessionRequest(prompt_ids=[1], max_new_tokens=4, sampling=rpc.Sampling(temperature=-1)),
         grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (rpc.OpenSessionRequest(prompt_ids=[1], max_new_tokens=4, sampling=rpc.Sampling(temperature=1, top_p=1.5)),
         grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (rpc.OpenSessionRequest(prompt_ids=[1] * 96, max_new_tokens=4), grpc.StatusCode.OUT_OF_RANGE, "prompt_ids"),
    ]
    free = stub.GetStats(rpc.GetStatsRequest()).free_slots
    for request, code, field in cases:
        error = rpc_error(stub.OpenSession, request)
        assert error.code() == code, (request, error.details())
        assert field in error.details(), error.details()
    assert stub.GetStats(rpc.GetStatsRequest()).free_slots == free  # no slot leaked


def test_oversized_prompts_and_drafts_are_refused_by_their_length_alone(stub):
    """Prompt ids, text and draft ids by the hundred thousand (as many as the server's request limit
    lets in; larger requests are refused unread, test_service_ops.py): each refused from its length
    before it is copied, scanned or tokenized (the server stays responsive), naming the field."""
    import time

    info = stub.GetModelInfo(rpc.GetModelInfoRequest())
    cases = [(rpc.OpenSessionRequest(prompt_ids=[1] * 1_000_000, max_new_tokens=4), "prompt_ids: a prompt of 1000000 tokens"),
             (rpc.OpenSessionRequest(text="A" * 1_000_000, max_new_tokens=4), "text: 1000000 characters (at least")]
    for request, message in cases:
        started = time.monotonic()
        error = rpc_error(stub.OpenSession, request, timeout=60)
        assert error.code() == grpc.StatusCode.OUT_OF_RANGE and message in error.details(), error.details()
        assert f"context of {info.max_context} positions" in error.details()
    opened = stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=[1, 2], max_new_tokens=4))
    huge = stub.Verify(rpc.VerifyRequest(steps=[rpc.VerifyStep(session_id=opened.session_id, expected_position=opened.position,
                                                               draft_ids=[3] * 1_000_000)]), timeout=60).results[0]
    assert huge.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "1000000 ids, more than max_k" in huge.status.message
    assert time.monotonic() - started < 30
    stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


def test_draft_probs_reach_rejection_sampling(stub, text_checkpoint):
    """draft_probs travel as float32 bytes: the server's step equals the same step in process."""
    rng = np.random.default_rng(0)
    probs = rng.random((3, 90), dtype=np.float32) ** 4
    probs /= probs.sum(axis=1, keepdims=True)
    drafts = [int(np.argmax(row)) for row in probs]
    sampling = SamplingParams(temperature=1.0, seed=77)
    engine = Engine(load_model(text_checkpoint), n_slots=1, max_seq_len=96, max_k=8)
    seq = engine.open(PROMPT, sampling, 20)
    first = seq.pending
    (local,) = engine.step([StepRequest(seq, drafts, torch.from_numpy(probs))])
    opened = open_session(stub, PROMPT, 20, sampling=rpc.Sampling(temperature=1.0, seed=77))
    assert opened.first_token == first
    result = verify_one(stub, opened.session_id, opened.position, drafts, draft_probs=probs.astype("<f4").tobytes(),
                        return_logits=True)
    assert result.status.code == 0 and result.accepted == local.accepted and list(result.tokens) == local.tokens
    assert np.array_equal(logits_array(result.logits), local.logits.numpy())
    stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))
