"""The drafter's side of self-drafting sessions: `python -m drafter generate --server-draft NAME` and
`python -m drafter bench --drafter mtp,server-ngram` against a loopback server whose tiny checkpoint
carries an MTP head. The streams (tokens and logits) are plain decoding's bit for bit, greedy and
seeded, over both transports; the figures count the drafts the server verified and match, step for
step, the same proposer run in process; a drafter the model does not offer, or a flag of a local
drafter beside --server-draft, exits 2 naming it."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from drafter import cli
from drafter.adaptive import AdaptiveK
from drafter.client import VerifierClient
from drafter.loop import DraftLoop, check_server_drafting
from drafter.messages import ModelInfo, Session, StepOutcome, VerifierError
from verifier.engine import Engine
from verifier.generate import generate
from verifier.model import load_model
from verifier.model.mtp import load_mtp_head
from verifier.params import SamplingParams
from verifier.proposers import MTPProposer, NgramProposer
from verifier.server.testing import LoopbackServer

NAME = "qwen3_5_text"
PROMPT = [21, 4, 58, 9, 33, 21, 4, 58]
MAX_SEQ_LEN, MAX_K, K, N = 96, 6, 3, 40
SEEDED = SamplingParams(temperature=0.8, seed=11)
BENCH_NAMES = {"mtp": "mtp", "ngram": "server-ngram"}  # the server drafter -> its name in rows and --json


@pytest.fixture(scope="module")
def mtp_dir(mtp_checkpoint):
    return mtp_checkpoint(NAME)  # the tiny checkpoint with a random MTP head in the published layout


@pytest.fixture(scope="module")
def server(mtp_dir):
    with LoopbackServer(mtp_dir, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K) as s:
        yield s


@pytest.fixture(scope="module")
def no_mtp_server(mtp_dir):
    with LoopbackServer(mtp_dir, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K, mtp=False) as s:  # serve --no-mtp
        yield s


@pytest.fixture(scope="module")
def in_process(mtp_dir):
    """in_process(prompt, n, sampling, drafter, k) -> verifier.generate's Generation: plain without a
    drafter, else the server drafter's proposer ("mtp" or "ngram") run in this process at k, as the
    server runs it (the MTP head drafts with the session's sampling: coupled drafts)."""
    model = load_model(mtp_dir)
    engine = Engine(model, 1, MAX_SEQ_LEN, max_k=MAX_K)
    head = load_mtp_head(mtp_dir, model)

    def proposer(drafter, sampling):
        if drafter == "mtp":
            return MTPProposer(head, MAX_SEQ_LEN, sampling or SamplingParams())
        return None if drafter is None else NgramProposer()

    def run(prompt, n, sampling=None, drafter=None, k=0):
        return generate(engine, list(prompt), n, sampling, proposer(drafter, sampling), k)

    return run


def _main(capsys, *argv) -> tuple[int, str, str]:
    """python -m drafter in this process: (exit status, stdout, stderr)."""
    try:
        status = cli.main([str(a) for a in argv])
    except SystemExit as exc:  # argparse errors
        status = exc.code
    out = capsys.readouterr()
    return status, out.out, out.err


def _sampling_flags(sampling: SamplingParams | None) -> list:
    return [] if sampling is None else ["--temperature", sampling.temperature, "--seed", sampling.seed]


# --- generate --server-draft --------------------------------------------------------------------------


@pytest.mark.parametrize("drafter, sampling, transport", [
    ("mtp", None, "stream"), ("mtp", SEEDED, "unary"), ("ngram", None, "unary"), ("ngram", SEEDED, "stream"),
], ids=["mtp-greedy-stream", "mtp-seeded-unary", "ngram-greedy-unary", "ngram-seeded-stream"])
def test_server_drafted_generation_is_plain_decoding_bit_for_bit(server, in_process, capsys, tmp_path, drafter, sampling,
                                                                 transport):
    logits = tmp_path / "logits.npy"
    status, out, err = _main(capsys, "generate", "--server", server.address, "--prompt-ids", ",".join(map(str, PROMPT)),
                             "--max-new-tokens", N, "--server-draft", drafter, "--k", K, "--transport", transport, "--json",
                             "--logits-out", logits, *_sampling_flags(sampling))
    assert status == 0, err
    got = json.loads(out)
    plain = in_process(PROMPT, N, sampling)
    assert got["tokens"] == plain.tokens and got["finish_reason"] == plain.finish_reason
    # bitwise: the float32 rows compared as their bit patterns
    assert np.array_equal(np.load(logits).view(np.uint32), plain.logits.numpy().view(np.uint32))
    # the figures are the server's verified and accepted drafts: the steps the proposer takes in process
    local = in_process(PROMPT, N, sampling, drafter, K)
    assert got["accepted_per_step"] == local.accepted_per_step and got["drafted_per_step"] == local.drafted_per_step
    assert sum(got["drafted_per_step"]) > 0  # the server did draft
    assert got["mean_acceptance_length"] == round(local.mean_acceptance_length, 4)
    assert (got["drafter"], got["server_drafter"], got["k"]) == (BENCH_NAMES[drafter], drafter, K)


def test_the_asyncio_loop_drafts_on_the_server_too(server, in_process):
    import asyncio

    from drafter.aio_client import AsyncVerifierClient
    from drafter.loop import agenerate

    async def run():
        async with AsyncVerifierClient(server.address) as client:
            return await agenerate(client, None, prompt_ids=PROMPT, max_new_tokens=N, sampling=SEEDED, k=K,
                                   server_drafter="mtp")

    got, local = asyncio.run(run()), in_process(PROMPT, N, SEEDED, "mtp", K)
    assert got.tokens == local.tokens == in_process(PROMPT, N, SEEDED).tokens
    assert got.accepted_per_step == local.accepted_per_step and got.drafted_per_step == local.drafted_per_step


def test_server_drafted_output_is_what_plain_decoding_prints(server, capsys):
    args = ["generate", "--server", server.address, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", 12]
    status, plain, _ = _main(capsys, *args, "--drafter", "none")
    assert status == 0
    status, drafted, err = _main(capsys, *args, "--server-draft", "ngram")  # --k: its default, as for any drafter
    assert status == 0, err
    assert drafted == plain and plain.count(",") == 11
    assert "mean acceptance length" in err


def test_the_default_k_is_the_clis(server, capsys):
    status, out, err = _main(capsys, "generate", "--server", server.address, "--prompt-ids", "1,2,3", "--max-new-tokens", 30,
                             "--server-draft", "mtp", "--json")
    assert status == 0, err
    got = json.loads(out)
    assert got["k"] == min(cli.DEFAULT_K, MAX_K) and max(got["drafted_per_step"]) <= got["k"]


def test_a_server_drafter_the_model_does_not_offer_exits_2_before_any_session(server, no_mtp_server, capsys, monkeypatch):
    opened = []
    monkeypatch.setattr(VerifierClient, "open_session", lambda self, *a, **kw: opened.append(1))
    cases = [(no_mtp_server, "mtp", "['ngram']"), (server, "eagle", "['ngram', 'mtp']")]
    for s, name, listed in cases:
        status, out, err = _main(capsys, "generate", "--server", s.address, "--prompt-ids", "1,2,3", "--max-new-tokens", 4,
                                 "--server-draft", name)
        assert status == 2 and out == "", err
        assert err.startswith(f"error: --server-draft {name}: ") and err.count("\n") == 1, err
        assert f"ModelInfo.server_drafters lists {listed}" in err, err
    assert "MTP head" in _main(capsys, "generate", "--server", no_mtp_server.address, "--prompt-ids", "1", "--max-new-tokens",
                               4, "--server-draft", "mtp")[2]
    assert opened == []


@pytest.mark.parametrize("flags", [["--drafter", "model"], ["--drafter", "ngram"], ["--adaptive-k"], ["--coupled-drafts"],
                                   ["--ngram-max", "3"], ["--ngram-min", "1"], ["--seed-draft", "1"], ["--draft-device", "cpu"],
                                   ["--draft-model", "models/draft"]])
def test_a_local_drafter_flag_beside_server_draft_is_an_argparse_error(capsys, flags):
    """Refused whatever its value, its default included: the server drafts, so the flag would be ignored."""
    status, out, err = _main(capsys, "generate", "--server", "127.0.0.1:1", "--prompt-ids", "1", "--max-new-tokens", 4,
                             "--server-draft", "mtp", *flags)
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: python -m drafter generate: argument --server-draft: not allowed with "
                                                     f"{flags[0]}"), err


def test_bad_k_with_server_draft_exits_2_naming_it(server, capsys):
    base = ["generate", "--server", server.address, "--prompt-ids", "1,2", "--max-new-tokens", 4, "--server-draft", "ngram"]
    for k, message in ((0, "--k 0 with --server-draft ngram drafts nothing"), (MAX_K + 1, f"exceeds the server's max_k {MAX_K}")):
        status, _, err = _main(capsys, *base, "--k", k)
        assert status == 2 and message in err, err
    status, _, err = _main(capsys, *base[:-1], "")
    assert status == 2 and "--server-draft is empty" in err, err


# --- the loop's checks of a server-drafted step --------------------------------------------------------

INFO = ModelInfo("verifier.v1", "m", NAME, 90, (0,), MAX_SEQ_LEN, MAX_K, ("attention",), "woa", False, 1, "cpu",
                 "float32", False, ("ngram", "mtp"))


def _outcome(accepted: int, tokens: list[int], verified: int | None) -> StepOutcome:
    return StepOutcome(grpc.StatusCode.OK, "", "s", "r", accepted, tokens, 3 + len(tokens), None, verified_drafts=verified)


def test_a_server_drafted_step_sends_no_drafts_and_its_reply_is_checked():
    def loop(max_new_tokens=100):
        return DraftLoop(Session("s", 3, 9, None, [1, 2, 3]), INFO, None, K, max_new_tokens, server_drafter="mtp")

    step = loop().next_step()
    assert step.draft_ids == () and step.draft_probs is None
    ok = loop()
    assert ok.advance(step, _outcome(2, [4, 5, 6], 3)) == [4, 5, 6] and (ok.accepted, ok.drafted) == ([2], [3])
    for outcome, named in ((_outcome(0, [4], None), "verified_drafts unset"),  # the server must say
                           (_outcome(0, [4], K + 1), f"room for {K}"),  # more than it was asked for
                           (_outcome(2, [4, 5, 6], 1), "accepted 2 and verified 1")):
        with pytest.raises(VerifierError, match=named) as err:
            loop().advance(step, outcome)
        assert err.value.code == grpc.StatusCode.INTERNAL
    # the room is the shared rule's: 4 tokens of budget, 1 emitted, so at most 2 drafts
    with pytest.raises(VerifierError, match="room for 2"):
        loop(max_new_tokens=4).advance(step, _outcome(0, [4], 3))


def test_server_drafting_takes_no_proposer_nor_adaptive_k():
    for args, message in (((NgramProposer(), K, None), "pass no proposer"), ((None, K, AdaptiveK(K)), "adaptive K"),
                          ((None, 0, None), "k >= 1")):
        with pytest.raises(ValueError, match=message):
            check_server_drafting("mtp", *args)
    check_server_drafting("", NgramProposer(), 0, None)  # the client drafts: nothing to check


# --- bench --drafter mtp,server-ngram ----------------------------------------------------------------

BENCH_PROMPTS = [[21, 4, 58, 9, 33, 21, 4, 58], [7, 8, 9, 7, 8, 9, 7]]
BENCH_NEW = 16


def test_bench_rows_of_server_drafters_count_what_the_server_verified(server, in_process, capsys, tmp_path):
    from drafter.bench_plots import LENGTH_PNG, POSITION_PNG, SPEEDUP_PNG

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in BENCH_PROMPTS))
    out = tmp_path / "bench"
    status, table, err = _main(capsys, "bench", "--server", server.address, "--prompts", prompts, "--max-new-tokens",
                               BENCH_NEW, "--drafter", "mtp,server-ngram", "--k", "1,3", "--adaptive-k", "--out", out,
                               "--no-progress")
    assert status == 0, err
    data = json.loads((out / "results.json").read_text())
    # adaptive K has no row for a server drafter: its K is fixed when the session opens
    assert [(r["drafter"], r["k"]) for r in data["rows"]] == [("mtp", 1), ("mtp", 3), ("server-ngram", 1), ("server-ngram", 3)]
    for row in data["rows"]:
        wire = {v: k for k, v in BENCH_NAMES.items()}[row["drafter"]]
        local = [in_process(p, BENCH_NEW, None, wire, row["k"]) for p in BENCH_PROMPTS]
        # position i drafted when verified_drafts >= i, accepted when accepted >= i
        drafted_at = [sum(d > i for g in local for d in g.drafted_per_step) for i in range(row["k"])]
        accepted_at = [sum(a > i for g in local for a in g.accepted_per_step) for i in range(row["k"])]
        where = (row["drafter"], row["k"])
        assert row["drafted_per_position"] == drafted_at and row["accepted_per_position"] == accepted_at, where
        assert drafted_at[0] > 0, where
        assert row["per_position_acceptance"] == [a / d if d else None for a, d in zip(accepted_at, drafted_at)], where
        assert row["streams_match_plain"] and row["acceptance"] == "exact", where
        assert row["accepted_tokens"] == sum(sum(g.accepted_per_step) for g in local), where
    for png in (POSITION_PNG, LENGTH_PNG, SPEEDUP_PNG):
        assert (out / png).stat().st_size > 0
    assert "server-ngram" in table and "mtp" in table


def test_bench_of_a_server_drafter_the_model_does_not_offer_exits_2(no_mtp_server, capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [1, 2, 3]}) + "\n")
    status, _, err = _main(capsys, "bench", "--server", no_mtp_server.address, "--prompts", prompts, "--max-new-tokens", 4,
                           "--drafter", "ngram,mtp", "--out", tmp_path / "out", "--no-progress")
    assert status == 2 and "--drafter mtp: " in err and "ModelInfo.server_drafters lists ['ngram']" in err, err
    assert not (tmp_path / "out").exists()
