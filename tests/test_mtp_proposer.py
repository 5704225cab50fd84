"""The MTP drafter in process (verifier/proposers/mtp.py): its streams equal plain decoding bitwise,
the hidden rows the engine hands it are the plain run's, its drafts after rejections are those of a
head that fed the accepted rows from scratch, and `generate --draft mtp` refuses a checkpoint
without a head. The heads are random (presets/mtp.py): their drafts are mostly rejected, which
exercises the rollback; the stream's bits never depend on what is drafted."""

import json

import pytest
import torch

from verifier import cli
from verifier.engine import Engine, StepRequest
from verifier.generate import generate
from verifier.model import load_model
from verifier.model.mtp import load_mtp_head
from verifier.params import SamplingParams
from verifier.proposers import MTPProposer, OracleProposer
from mtp_recording import Recording

# Qwen3.5 dense, Qwen3.5-MoE bare, Qwen3-Next, and the published Qwen3.5-MoE wrapper layout
FAMILIES = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next_moe", "qwen3_5_moe"]
PROMPT = [5, 9, 2, 7, 11, 3]
NEW = 16
K = 3
SAMPLINGS = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=0.8, top_k=20, seed=7)}


def _setup(path, model_device="cpu"):
    model = load_model(path, model_device)
    engine = Engine(model, n_slots=1, max_seq_len=len(PROMPT) + NEW + K, max_k=K)
    return engine, MTPProposer(load_mtp_head(path, model), engine.pool.max_seq_len)


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
@pytest.mark.parametrize("name", FAMILIES)
def test_mtp_stream_equals_plain_decoding(mtp_checkpoint, name, sampling, model_device):
    engine, proposer = _setup(mtp_checkpoint(name), model_device)
    params = SAMPLINGS[sampling]
    plain = generate(engine, PROMPT, NEW, params)
    recording = Recording(proposer)
    spec = generate(engine, PROMPT, NEW, params, recording, K)
    assert spec.tokens == plain.tokens
    assert torch.equal(spec.logits, plain.logits)
    assert sum(spec.drafted_per_step) > 0 and recording.calls  # the head did draft
    assert all(len(drafts) == k for _, k, drafts, _ in recording.calls)


def test_hidden_rows_equal_plain_decoding(mtp_checkpoint):
    """The rows a speculative run hands the proposer (prompt, then each step's consumed rows) equal
    those of plain one-token decode steps at every position, bitwise."""
    engine, proposer = _setup(mtp_checkpoint("qwen3_5_moe_text"))
    recording = Recording(proposer)
    generate(engine, PROMPT, NEW, None, recording, K)
    seq = engine.open(PROMPT, SamplingParams(), NEW, want_hidden=True)
    rows = [seq.prompt_hidden]
    while not seq.finished:
        (result,) = engine.step([StepRequest(seq, [], want_hidden=True)])
        assert result.hidden.shape[0] == len(result.tokens)
        rows.append(result.hidden)
    engine.close(seq)
    plain = torch.cat(rows)
    assert proposer.known == plain.shape[0] == len(PROMPT) + NEW - 1
    assert torch.equal(recording.hidden, plain)


@pytest.mark.parametrize("sent", ["mtp", "oracle"])
def test_drafts_after_rollbacks_equal_a_fresh_heads(mtp_checkpoint, sent):
    """Rollback by cursor: each proposal equals that of a fresh head fed the accepted rows at once
    (row-invariant, so one forward of many rows gives the rows' bits one by one). The random head's
    own drafts are mostly rejected (stale draft KV rows to overwrite); sending the true continuation
    instead accepts every draft, so each catch-up feeds K + 1 rows."""
    path = mtp_checkpoint("qwen3_next_moe")
    engine, proposer = _setup(path)
    instead = None if sent == "mtp" else OracleProposer(len(PROMPT), generate(engine, PROMPT, NEW).tokens)
    recording = Recording(proposer, instead)
    spec = generate(engine, PROMPT, NEW, None, recording, K)
    if sent == "mtp":
        assert sum(spec.accepted_per_step) < sum(spec.drafted_per_step)
    else:
        assert spec.accepted_per_step[0] == K
    fresh = MTPProposer(proposer.head, engine.pool.max_seq_len)
    for context, k, drafts, _ in recording.calls:
        fresh.begin(recording.hidden[: len(context) - 1])
        assert fresh.propose(context, k) == drafts


def test_a_proposer_needs_every_hidden_row(mtp_checkpoint):
    engine, proposer = _setup(mtp_checkpoint("qwen3_5_text"))
    proposer.begin(torch.zeros(len(PROMPT) - 1, engine.model.config.hidden_size))
    with pytest.raises(ValueError, match="hidden rows of 5 positions held"):
        proposer.propose(PROMPT + [1], K)
    with pytest.raises(ValueError, match=r"hidden rows must be \[rows, "):
        proposer.observe(torch.zeros(2, engine.model.config.hidden_size + 1))
    with pytest.raises(ValueError, match="no sequence begun"):
        MTPProposer(proposer.head, engine.pool.max_seq_len).propose(PROMPT, K)
    with pytest.raises(ValueError, match="mode must be"):
        MTPProposer(proposer.head, engine.pool.max_seq_len, mode="both")


def test_cli_draft_mtp_gives_the_plain_tokens(mtp_checkpoint, capsys):
    path = mtp_checkpoint("qwen3_5_moe")
    args = ["generate", "--model", str(path), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(NEW), "--json"]
    assert cli.main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--draft", "mtp", "--k", str(K), "--temperature", "0.7", "--seed", "3"]) == 0
    sampled_spec = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--temperature", "0.7", "--seed", "3"]) == 0
    sampled_plain = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--draft", "mtp", "--k", str(K)]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["tokens"] == plain["tokens"] and spec["draft"] == "mtp" and sum(spec["drafted_per_step"]) > 0
    assert sampled_spec["tokens"] == sampled_plain["tokens"]


def test_cli_draft_mtp_without_a_head_exits_2(hf_checkpoint, capsys):
    path = hf_checkpoint("qwen3_5_text")
    code = cli.main(["generate", "--model", str(path), "--prompt-ids", "1,2", "--max-new-tokens", "4", "--draft", "mtp"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--draft mtp" in err and "no MTP head" in err


def test_padded_steps_hand_out_the_unpadded_hidden_rows(mtp_checkpoint):
    """Steps padded to graph buckets (pad_eagerly: the graphs' padding on the CPU) hand the proposer
    the hidden rows unpadded steps do, bitwise, and so the same drafts."""
    path = mtp_checkpoint("qwen3_5_moe_text")
    runs = []
    for pad in (False, True):
        model = load_model(path)
        engine = Engine(model, n_slots=1, max_seq_len=len(PROMPT) + NEW + K, max_k=K, cuda_graphs=False, graph_rows=(2, 8))
        engine.runner.pad_eagerly = pad
        # the shared buckets only: a one-sequence step has an exact bucket of its own otherwise, so no padding rows
        engine.runner.buckets = engine.runner.shared
        recording = Recording(MTPProposer(load_mtp_head(path, model), engine.pool.max_seq_len))
        spec = generate(engine, PROMPT, NEW, None, recording, K)
        runs.append((spec.tokens, recording.calls, recording.hidden))
    (tokens, calls, hidden), (padded_tokens, padded_calls, padded_hidden) = runs
    assert tokens == padded_tokens and calls == padded_calls
    assert torch.equal(hidden, padded_hidden)
