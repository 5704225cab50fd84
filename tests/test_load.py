"""The load benchmark (bench/load) in CI size: 8 sessions over 2 drafter processes against one
`python -m verifier serve` subprocess, 20 steps each, through the same code as the full run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.load import reference  # noqa: E402
from bench.load.cli import LoadConfig, main, run_load  # noqa: E402
from drafter.loop import STREAM  # noqa: E402


def test_short_load_run_has_no_errors_no_mismatches_and_gives_slots_back(tmp_path):
    # goodput off: every draft is verified, so accepted prefixes of every length roll back under load
    result = run_load(LoadConfig(out=tmp_path, sessions=8, processes=2, steps=20, k=4, drafter="mixed",
                                 max_new_tokens=32, time_limit_s=120, goodput=False))
    assert result["transport"] == "fleet" and result["mean_acceptance_length"] > 1.0
    assert result["errors"] == 0, result["errors_by_code"]
    assert result["mismatches"] == 0, result["mismatch_examples"]
    assert result["steps"] == 8 * 20  # every session ran its whole budget
    assert result["server_steps"] == result["steps"]
    assert result["free_slots_before"] == result["free_slots_after"] == 8
    assert result["open_sessions_after"] == 0
    assert result["rss_back_to_baseline"], (result["rss_before_mib"], result["rss_after_mib"])
    assert result["ok"] and result["server_exit_code"] == 0
    # budgets of 32 tokens over 20 steps: sessions finish generations and reopen in freed slots
    assert result["generations"] > 8
    assert result["compared_tokens"] >= result["tokens"]
    assert result["engine_batches"] < result["steps"]  # the server batched steps of several sessions
    # one request per round per process, each carrying a step of every session of that process
    # (a finished generation reopens between rounds, so every session steps every round)
    assert result["rounds"] == 2 * 20
    written = json.loads(Path(result["path"]).read_text())
    for field in ("sessions", "steps", "errors", "mismatches", "p50_ms", "p99_ms", "steps_per_s", "tokens_per_s",
                  "rows_per_batch_mean", "processes", "model", "device", "date", "torch", "machine",
                  "rss_before_mib", "rss_after_mib", "free_slots_before", "free_slots_after"):
        assert field in written, field
    assert 0 < written["p50_ms"] <= written["p99_ms"]


def test_per_session_streams_still_run(tmp_path):
    result = run_load(LoadConfig(out=tmp_path, sessions=4, processes=2, steps=10, k=3, drafter="mixed",
                                 max_new_tokens=8, time_limit_s=120, transport=STREAM))
    assert result["transport"] == STREAM and result["rounds"] == 0
    assert result["errors"] == 0 and result["mismatches"] == 0 and result["steps"] == 4 * 10
    assert result["generations"] > 4 and result["ok"]


@pytest.mark.parametrize("transport", ["fleet", STREAM])
def test_the_time_limit_stops_sessions_cleanly_and_reports_partial(tmp_path, transport):
    result = run_load(LoadConfig(out=tmp_path, sessions=4, processes=2, steps=100_000, k=2, drafter="ngram",
                                 max_new_tokens=16, time_limit_s=1.0, transport=transport))
    assert result["partial"] and result["sessions_cut_by_deadline"] == 4
    assert 0 < result["steps"] < 4 * 100_000
    assert result["errors"] == 0 and result["mismatches"] == 0
    assert result["free_slots_after"] == result["free_slots_before"] and result["open_sessions_after"] == 0
    assert result["ok"]


def test_the_comparison_catches_a_changed_token_and_a_wrong_finish():
    generation = {"session": 3, "generation": 1, "tokens": [5, 6, 7], "finish_reason": "eos"}
    assert reference.mismatches([generation], [([5, 6, 7], "eos")]) == []
    (changed,) = reference.mismatches([generation], [([5, 9, 7], "eos")])
    assert changed["index"] == 1 and changed["speculative"] == [6, 7] and changed["plain"] == [9, 7]
    assert len(reference.mismatches([generation], [([5, 6, 7], "length")])) == 1
    cut = dict(generation, finish_reason=None)  # stopped by its step budget: plain decoding stops by length there
    assert reference.mismatches([cut], [([5, 6, 7], "length")]) == []


def test_bad_options_exit_2(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--sessions", "2", "--processes", "3"]) == 2
    assert "processes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # the oracle needs plain streams first: bench.serve's
        main(["--out", str(tmp_path), "--drafter", "oracle"])
    assert exited.value.code == 2
