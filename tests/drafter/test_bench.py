"""The acceptance-rate bench: its arithmetic on synthetic streams with known answers, the bench end
to end against a verifier on loopback (results file, plots, streams equal to plain decoding, and the
server's per-position counters telling the same story), and `python -m drafter bench` as a user runs it."""

import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from drafter import bench as bench_module
from drafter import cli
from drafter.bench import ADAPTIVE, load_prompts, results, run_bench, summary_table, write_results
from drafter.bench_plots import LENGTH_PNG, POSITION_PNG, SPEEDUP_PNG, pooled_alpha, write_plots
from drafter.bench_stats import Counts, count, figures, iid_acceptance_length, token_acceptance_probability
from drafter.choose import make_proposer
from verifier.engine import Engine
from verifier.params import SamplingParams

from drafter_setup import client, plain_in_process, served_checkpoint, server, target  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROW_FIELDS = {"drafter", "k", "mean_acceptance_length", "acceptance_rate", "per_position_acceptance", "tokens_per_step",
              "tokens_per_s", "speedup_vs_plain", "streams_match_plain"}
TOP_FIELDS = {"server", "model_id", "date", "max_new_tokens", "sampling", "prompts", "rows"}


# --- the arithmetic -------------------------------------------------------------------------------

def test_figures_of_a_hand_counted_stream():
    # step:      0  1  2  3  4     (step 3 is a plain decode step: no draft)
    accepted = [2, 0, 3, 0, 0]
    drafted = [3, 2, 3, 0, 1]
    step_tokens = sum(a + 1 for a in accepted)  # 10: every step emits its accepted drafts and a bonus
    c = count(accepted, drafted, step_tokens, k=3)
    assert (c.steps, c.step_tokens, c.drafts, c.draft_tokens, c.accepted_tokens, c.rejections) == (5, 10, 4, 9, 5, 3)
    assert c.drafted_at == (4, 3, 2)  # position 1 reached by steps 0,1,2,4; position 2 by 0,1,2; 3 by 0,2
    assert c.accepted_at == (2, 2, 1)  # position 1 accepted by 0,2; 2 by 0,2; 3 by 2
    f = figures(c)
    assert f.mean_acceptance_length == 1 + 5 / 4
    assert f.acceptance_rate == 5 / 9
    assert f.token_acceptance_probability == 5 / 8  # judged: 5 accepted + 3 refused
    assert f.per_position_acceptance == [2 / 4, 2 / 3, 1 / 2]
    assert f.tokens_per_step == 10 / 5


def test_plain_and_all_accepted_streams():
    plain = figures(count([0, 0, 0], [0, 0, 0], 3, k=4))
    assert plain.mean_acceptance_length == 1.0 and plain.tokens_per_step == 1.0
    assert plain.acceptance_rate is None and plain.token_acceptance_probability is None
    assert plain.per_position_acceptance == [None] * 4
    oracle = figures(count([4, 4, 2], [4, 4, 2], 13, k=4))  # the last step was cut to 2 drafts by the budget
    assert oracle.mean_acceptance_length == 1 + 10 / 3 and oracle.acceptance_rate == 1.0
    assert oracle.token_acceptance_probability == 1.0 and oracle.per_position_acceptance == [1.0, 1.0, 1.0, 1.0]
    refused = figures(count([0, 0], [2, 3], 2, k=3))
    assert refused.acceptance_rate == 0.0 and refused.token_acceptance_probability == 0.0
    assert refused.per_position_acceptance == [0.0, 0.0, 0.0] and refused.mean_acceptance_length == 1.0


def test_counts_pool_across_runs_of_different_widths():
    a = count([1, 0], [2, 1], 3, k=2)
    b = count([3], [3], 4, k=3)
    pooled = a + b
    assert pooled.drafted_at == (3, 2, 1) and pooled.accepted_at == (2, 1, 1)
    assert (pooled.steps, pooled.drafts, pooled.draft_tokens, pooled.accepted_tokens, pooled.rejections) == (3, 3, 6, 4, 2)
    assert Counts() + a == a


def test_count_refuses_impossible_steps():
    with pytest.raises(ValueError, match="accepted_per_step has 2 entries but drafted_per_step has 1"):
        count([0, 0], [1], 2, k=2)
    with pytest.raises(ValueError, match="step 1: accepted 3 of 2 drafts"):
        count([0, 3], [1, 2], 2, k=4)
    with pytest.raises(ValueError, match="step 0: accepted 0 of 5 drafts.*k=4"):
        count([0], [5], 1, k=4)


def test_iid_expectation():
    assert iid_acceptance_length(0.5, 2) == 1 + 0.5 + 0.25
    assert iid_acceptance_length(0.0, 8) == 1.0 and iid_acceptance_length(1.0, 8) == 9.0
    assert iid_acceptance_length(0.8, 0) == 1.0
    with pytest.raises(ValueError, match="alpha"):
        iid_acceptance_length(1.5, 2)


def test_an_iid_drafter_meets_the_expectation():
    """Simulated drafts accepted independently with probability 0.7: the estimated alpha recovers 0.7
    and the i.i.d. formula predicts the measured length, while accepted / draft tokens does not."""
    rng, alpha, k = random.Random(5), 0.7, 4
    accepted = []
    for _ in range(20000):
        a = 0
        while a < k and rng.random() < alpha:
            a += 1
        accepted.append(a)
    c = count(accepted, [k] * len(accepted), sum(a + 1 for a in accepted), k)
    f = figures(c)
    assert abs(f.token_acceptance_probability - alpha) < 0.01
    assert abs(f.mean_acceptance_length - iid_acceptance_length(f.token_acceptance_probability, k)) < 0.01
    assert f.acceptance_rate < alpha - 0.1  # drafts after a refusal are never judged
    assert all(abs(rate - alpha ** (i + 1)) < 0.02 for i, rate in enumerate(f.per_position_acceptance))


def test_pooled_alpha_weights_rows_by_judged_tokens():
    rows = [{"accepted_tokens": 3, "rejected_steps": 1}, {"accepted_tokens": 1, "rejected_steps": 5}]
    assert pooled_alpha(rows) == 4 / 10
    assert pooled_alpha([{"accepted_tokens": 0, "rejected_steps": 0}]) is None
    assert token_acceptance_probability(count([1, 0], [2, 2], 3, 2)) == 1 / 3


def test_prompt_file_errors_name_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    cases = {
        '{"prompt_ids": [1, 2]}\nnot json\n': "line 2: not JSON",
        '{"prompt_ids": [1], "text": "a"}\n': "line 1: needs exactly one of prompt_ids and text",
        '\n{"prompt_ids": [1, "2"]}\n': "line 2: prompt_ids must be a non-empty list of integers",
        '{"text": ""}\n': "line 1: text must be a non-empty string",
        "\n\n": "no prompts",
    }
    for text, message in cases.items():
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_prompts(path)
    path.write_text('{"prompt_ids": [5, 6]}\n\n{"text": "AB"}\n')
    assert [(p.prompt_ids, p.text) for p in load_prompts(path)] == [([5, 6], None), (None, "AB")]


# --- end to end on loopback ----------------------------------------------------------------------

PROMPTS = [{"prompt_ids": [5, 9, 14, 3, 5, 9, 14, 3, 7]}, {"text": "ABCABCAB"}, {"prompt_ids": [40, 41, 42, 40, 41]}]
NEW = 16


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def _bench(client, prompts_file, sampling, draft_model):
    """ngram, random and the model drafter (the served checkpoint drafting for itself) at K 1 and 3,
    and adaptive K up to 3."""
    info = client.model_info()
    flags = SimpleNamespace(ngram_max=3, ngram_min=1, seed_draft=3, draft_model=draft_model, draft_device="cpu")
    plain, runs = run_bench(client, info, load_prompts(prompts_file), ["ngram", "random", "model"], [1, 3],
                            max_new_tokens=NEW, sampling=sampling, adaptive=True, progress=False,
                            make_proposer=lambda name: make_proposer(name, flags, info, sampling))
    return info, plain, runs


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_k=20, seed=11)], ids=["greedy", "sampled"])
def test_bench_end_to_end(server, client, prompts_file, served_checkpoint, target, sampling, tmp_path):
    before = client.stats()
    info, plain, runs = _bench(client, prompts_file, sampling, served_checkpoint)
    after = client.stats()

    # the reference stream is plain decoding's: the in-process engine with no drafts gives the same tokens
    prompt_ids = [p.get("prompt_ids") or [ord(c) for c in p["text"]] for p in PROMPTS]  # byte-level tokenizer
    assert plain.prompt_tokens == [len(ids) for ids in prompt_ids]
    for ids, tokens in zip(prompt_ids, plain.tokens):
        assert plain_in_process(target, ids, NEW, sampling).tokens == tokens

    data = results(server.address, info, prompts_file, plain, runs, NEW, sampling)
    write_results(tmp_path, data)
    write_plots(tmp_path, data)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert TOP_FIELDS <= saved.keys() and saved["model_id"] == info.model_id and saved["max_new_tokens"] == NEW
    assert saved["sampling"]["temperature"] == sampling.temperature and saved["prompts"]["count"] == len(PROMPTS)
    assert [(r["drafter"], r["k"]) for r in saved["rows"]] == [
        ("ngram", 1), ("ngram", 3), ("random", 1), ("random", 3), ("model", 1), ("model", 3),
        ("ngram", ADAPTIVE), ("random", ADAPTIVE), ("model", ADAPTIVE)]
    rows = {(r["drafter"], r["k"]): r for r in saved["rows"]}
    for row in saved["rows"]:
        assert ROW_FIELDS <= row.keys(), ROW_FIELDS - row.keys()
        if row["drafter"] == "model" and sampling.temperature > 0:
            # the model drafter sends q when sampling: rejection sampling, exact samples but not the plain stream
            assert row["acceptance"] == "rejection"
        else:
            assert row["acceptance"] == "exact"
            assert row["streams_match_plain"] is True and row["mismatched_prompts"] == []
        assert len(row["per_position_acceptance"]) == (3 if row["k"] == ADAPTIVE else row["k"])
        assert row["tokens_per_s"] > 0 and row["speedup_vs_plain"] > 0
        if row["acceptance"] == "exact":
            assert row["tokens"] == sum(map(len, plain.tokens))
        assert row["mean_acceptance_length"] == 1 + row["accepted_tokens"] / row["drafts"]
        assert row["acceptance_rate"] == row["accepted_tokens"] / row["draft_tokens"]
        assert row["tokens_per_step"] == (row["tokens"] - len(PROMPTS)) / row["steps"]  # first tokens come from OpenSession
    if sampling.temperature == 0:  # the target drafting for itself, greedy: every draft is the target's token
        for k in (1, 3, ADAPTIVE):
            model_row = rows[("model", k)]
            assert model_row["acceptance_rate"] == 1.0 and set(model_row["per_position_acceptance"]) == {1.0}, k
    for name in (POSITION_PNG, LENGTH_PNG, SPEEDUP_PNG):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC, name
    table = summary_table(saved)
    assert len(table.splitlines()) == 2 + 1 + len(saved["rows"]) and "none (plain)" in table

    # the server counts per position what the bench counts (plain steps carry no draft: not counted)
    pooled = sum((run.counts for run in runs), Counts())
    width = len(after.drafted_per_position)
    pad = lambda counts: list(counts) + [0] * (width - len(counts))  # noqa: E731
    assert [a - b for a, b in zip(after.drafted_per_position, before.drafted_per_position)] == pad(pooled.drafted_at)
    assert [a - b for a, b in zip(after.accepted_per_position, before.accepted_per_position)] == pad(pooled.accepted_at)
    assert after.drafts - before.drafts == pooled.drafts
    assert after.draft_tokens - before.draft_tokens == pooled.draft_tokens
    assert after.accepted_tokens - before.accepted_tokens == pooled.accepted_tokens


def test_a_stream_that_differs_is_reported_and_fails_the_command(server, prompts_file, tmp_path, monkeypatch, capsys):
    real = bench_module.generate

    def corrupting(client, proposer, **kwargs):  # a drafted run whose last token is wrong
        gen = real(client, proposer, **kwargs)
        if proposer is not None and kwargs["prompt_ids"] == PROMPTS[2]["prompt_ids"]:
            gen.tokens[-1] = (gen.tokens[-1] + 1) % 90
        return gen

    monkeypatch.setattr(bench_module, "generate", corrupting)
    status = cli.main(["bench", "--server", server.address, "--prompts", str(prompts_file), "--drafter", "ngram",
                       "--k", "2", "--max-new-tokens", "6", "--out", str(tmp_path), "--no-progress"])
    assert status == 1
    assert "streams differ from plain decoding for ngram k=2" in capsys.readouterr().err
    (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert row["streams_match_plain"] is False and row["mismatched_prompts"] == [2]


# --- the command ---------------------------------------------------------------------------------

def _run(*args):
    return subprocess.run([sys.executable, "-m", "drafter", "bench", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def test_cli_writes_results_plots_and_a_table(server, served_checkpoint, prompts_file, tmp_path):
    out = tmp_path / "out"
    proc = _run("--server", server.address, "--prompts", prompts_file, "--drafter", "ngram,random,model", "--k", "2,4",
                "--draft-model", served_checkpoint, "--adaptive-k", "--max-new-tokens", 8, "--temperature", 0.8,
                "--seed", 3, "--out", out)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((out / "results.json").read_text())
    assert TOP_FIELDS <= data.keys() and data["server"] == server.address and data["sampling"]["seed"] == 3
    assert [(r["drafter"], r["k"]) for r in data["rows"]] == [
        ("ngram", 2), ("ngram", 4), ("random", 2), ("random", 4), ("model", 2), ("model", 4),
        ("ngram", ADAPTIVE), ("random", ADAPTIVE), ("model", ADAPTIVE)]
    for row in data["rows"]:
        assert row["acceptance"] == ("rejection" if row["drafter"] == "model" else "exact")
        assert row["streams_match_plain"] or row["acceptance"] == "rejection"
    assert all((out / name).read_bytes()[:8] == PNG_MAGIC for name in (POSITION_PNG, LENGTH_PNG, SPEEDUP_PNG))
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:2] == ["drafter", "k"] and len(lines) == 2 + 1 + 9 + 1
    assert lines[-1] == "draft trimming: off: every draft verified (the server does not trim drafts)"
    assert data["trimming"] == {"on": False, "server_trims_drafts": False, "verify_all_drafts": True, "trimmed_drafts": 0}
    assert "bench:" in proc.stderr and "100%" in proc.stderr  # the progress bar
    assert "note: rows marked (rejection)" in proc.stderr


def test_cli_errors_name_the_problem(server, prompts_file, tmp_path):
    bad_prompts = tmp_path / "bad.jsonl"
    bad_prompts.write_text('{"prompt_ids": [1, 500]}\n')
    text_only = tmp_path / "text.jsonl"
    text_only.write_text(json.dumps(PROMPTS[1]) + "\n")
    cases = [
        (["--prompts", bad_prompts], 2, "prompt 0: prompt_ids [500] are outside the served model's vocabulary 0..89"),
        (["--prompts", tmp_path / "missing.jsonl"], 2, "missing.jsonl"),
        (["--prompts", prompts_file, "--drafter", "model"], 2, "a drafter must share the target's vocabulary"),  # the shipped draft is the default
        (["--prompts", prompts_file, "--drafter", "ngram,bogus"], 2, "--drafter takes"),
        (["--prompts", prompts_file, "--k", "0,2"], 2, "--k values must be >= 1"),
        (["--prompts", prompts_file, "--temperature", "-1"], 2, "--temperature: temperature"),
        (["--prompts", prompts_file, "--k", "2,9"], 2, "--k 9 exceeds the server's max_k 8"),
        (["--prompts", prompts_file, "--max-new-tokens", "90"], 2,
         "prompt 0: --max-new-tokens 90: 9 prompt tokens + 90 new tokens exceed the server's max_context 96"),
        (["--prompts", text_only, "--max-new-tokens", "90"], 2,  # known once the server tokenizes it: 8 tokens
         "'ABCABCAB': --max-new-tokens 90: 8 prompt tokens + 90 new tokens exceed the server's max_context 96"),
    ]
    for args, status, message in cases:
        budget = [] if "--max-new-tokens" in args else ["--max-new-tokens", 4]
        proc = _run("--server", server.address, *budget, "--out", tmp_path / "o", "--no-progress", *args)
        assert proc.returncode == status and message in proc.stderr, (args, proc.returncode, proc.stderr)
    assert not (tmp_path / "o" / "results.json").exists()


# --- trimming: the bench measures the drafter, not the server's goodput policy -----------------------

class _NoDraftPays(Engine):
    """Every verify row past the first costs a thousand one-row steps: the goodput policy trims every
    draft it may trim (decided by the test, not this machine's timing)."""

    def step_costs(self):
        return {rows: 1.0 + 1000.0 * (rows - 1) for rows in range(1, 65)}


def test_bench_verifies_every_draft_by_default_and_says_whether_trimming_was_on(served_checkpoint, prompts_file, tmp_path,
                                                                                capsys):
    from verifier.server.testing import LoopbackServer

    with LoopbackServer(served_checkpoint, n_slots=2, max_seq_len=96, max_k=8, engine_class=_NoDraftPays, goodput=True) as trimming:
        args = ["bench", "--server", trimming.address, "--prompts", str(prompts_file), "--drafter", "random", "--k", "2",
                "--max-new-tokens", "6", "--no-progress"]
        assert cli.main([*args, "--out", str(tmp_path / "default")]) == 0
        default_out = capsys.readouterr().out
        assert cli.main([*args, "--out", str(tmp_path / "allowed"), "--allow-trimming"]) == 0
        allowed_out = capsys.readouterr().out
    default = json.loads((tmp_path / "default" / "results.json").read_text())
    (row,) = default["rows"]
    # the policy trims every draft it may, and these sessions' drafts were all verified (the figures count them)
    assert row["trimmed_drafts"] == 0 and row["drafts"] > 0 and row["drafted_per_position"][0] == row["drafts"]
    assert default["trimming"] == {"on": False, "server_trims_drafts": True, "verify_all_drafts": True, "trimmed_drafts": 0}
    assert "draft trimming: off: every draft verified (sessions opened with verify_all_drafts" in default_out
    allowed = json.loads((tmp_path / "allowed" / "results.json").read_text())
    (row,) = allowed["rows"]
    # the policy trimmed every draft: nothing was judged, so nothing counts as drafted
    assert row["drafts"] == row["draft_tokens"] == 0 and row["trimmed_drafts"] > 0
    assert row["per_position_acceptance"] == [None, None]
    assert allowed["trimming"]["on"] is True and "draft trimming: ON (--allow-trimming)" in allowed_out
