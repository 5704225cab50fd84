"""`python -m verifier generate`, run as a user runs it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from verifier import cli
from verifier.arguments import flags_without_stated_default
from verifier.engine import Engine
from verifier.generate import generate
from verifier.model import load_model
from verifier.tokenizer import byte_level_tokenizer

REPO = Path(__file__).resolve().parent.parent


def _run(*args, env=None):
    """args: str() of each, bytes as they are (an argument that is not UTF-8)."""
    argv = [a if isinstance(a, bytes) else str(a) for a in args]
    return subprocess.run([sys.executable, "-m", "verifier", *argv], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)


def test_generate_json_and_logits_out(hf_checkpoint, tmp_path):
    path = hf_checkpoint("kimi_linear")
    out_file = tmp_path / "logits.npy"
    proc = _run("generate", "--model", path, "--prompt-ids", "5,6,7,8,9", "--max-new-tokens", 12, "--json", "--logits-out", out_file)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    expected = generate(Engine(load_model(path), 1, 64), [5, 6, 7, 8, 9], 12)
    assert result["tokens"] == expected.tokens and result["finish_reason"] == expected.finish_reason
    logits = np.load(out_file)
    assert logits.dtype == np.float32 and logits.shape == (len(expected.tokens), 88)
    assert np.array_equal(logits, expected.logits.numpy())


def test_generate_text_in_and_out(hf_checkpoint, tmp_path):
    path = shutil.copytree(hf_checkpoint("qwen3_5_text"), tmp_path / "m")
    byte_level_tokenizer().save(str(path / "tokenizer.json"))  # ids 0..89 cover ASCII '\0'..'Y'
    proc = _run("generate", "--model", path, "--text", "ABC", "--max-new-tokens", 4, "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["prompt_tokens"] == 3 and len(result["tokens"]) == 4 and isinstance(result["text"], str)


def test_generate_errors_name_the_problem(hf_checkpoint):
    path = hf_checkpoint("qwen3_5_text")
    proc = _run("generate", "--model", path, "--prompt-ids", "1,2,500", "--max-new-tokens", 2)
    assert proc.returncode == 2 and "[500] are outside the vocabulary 0..89" in proc.stderr
    proc = _run("generate", "--model", path, "--text", "hi", "--max-new-tokens", 2)
    assert proc.returncode == 2 and "tokenizer.json" in proc.stderr
    proc = _run("generate", "--model", path, "--prompt-ids", "1,x", "--max-new-tokens", 2)
    assert proc.returncode == 2 and "comma-separated integers" in proc.stderr
    proc = _run("generate", "--model", path.parent / "nowhere", "--prompt-ids", "1", "--max-new-tokens", 2)
    assert proc.returncode == 2 and "no config.json" in proc.stderr


def test_frictions_a_newcomer_met_get_one_line_errors(hf_checkpoint, tmp_path):
    """Text that is not UTF-8, a drafter asked for no drafts, a config.json that is not JSON: each
    exits 2 with one line naming what is wrong, never a traceback."""
    path = hf_checkpoint("qwen3_5_text")
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (broken / "config.json").write_text('{"model_type": "qwen3_5_text",')
    cases = {
        ("--model", path, "--text", b"def \xff():"): "argument --text: is not valid UTF-8 (byte 0xff at character 4)",
        ("--model", path, "--prompt-ids", "1,2", "--draft", "model", "--k", 0): "--k 0 with --draft model drafts nothing",
        ("--model", broken, "--prompt-ids", "1,2"): f"{broken / 'config.json'}: not valid JSON (Expecting property name",
        ("--model", path, "--text", ""): "argument --text: is empty: give the prompt text, or --prompt-ids",
        ("--model", path, "--prompt-ids", "1", "--temperature"): "argument --temperature: expected one argument",
    }
    for args, message in cases.items():
        proc = _run("generate", *args, "--max-new-tokens", 2)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (args, proc.stderr)
        (line,) = proc.stderr.splitlines()  # one line, argparse's errors too (no usage before them)
        assert line.startswith("error: ") and message in line, (args, proc.stderr)


def test_default_model_is_the_shipped_pair():
    """Without --model the CLI serves models/target; --draft model drafts with models/draft, and the
    speculative stream is the plain one."""
    plain = _run("generate", "--text", "def f(x):", "--max-new-tokens", 8, "--json")
    assert plain.returncode == 0, plain.stderr
    assert "no trained default model" not in plain.stderr
    out = json.loads(plain.stdout)
    assert out["model"].endswith("models/target") and isinstance(out["text"], str)
    spec = _run("generate", "--text", "def f(x):", "--max-new-tokens", 8, "--json", "--draft", "model", "--k", 3)
    assert spec.returncode == 0, spec.stderr
    assert json.loads(spec.stdout)["tokens"] == out["tokens"]


def test_random_fallback_is_built_deterministically(tmp_path, monkeypatch):
    """A checkout without models/ falls back to a random checkpoint built once into the user cache."""
    from verifier import defaults

    monkeypatch.setattr(defaults, "SHIPPED_TARGET", tmp_path / "absent")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = defaults.default_model_dir()
    assert first == tmp_path / "cache" / "hybrid-spec-verifier" / defaults.RANDOM_DEFAULT_NAME
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert defaults.default_model_dir() == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert defaults.default_draft_model_dir() is None  # a draft goes only with the shipped target


def test_speculative_runs_print_the_plain_tokens_and_logits(hf_checkpoint, tmp_path):
    path = hf_checkpoint("qwen3_next_odd")
    base = ["generate", "--model", path, "--prompt-ids", "5,6,7,5,6,7,5", "--max-new-tokens", 20, "--json"]
    for sampling in ([], ["--temperature", "0.9", "--seed", "42"]):
        plain_file = tmp_path / "plain.npy"
        plain = _run(*base, *sampling, "--logits-out", plain_file)
        assert plain.returncode == 0, plain.stderr
        for draft, mode in (("random", "woa"), ("ngram", "snapshot"), ("oracle", "woa")):
            spec_file = tmp_path / f"{draft}.npy"
            spec = _run(*base, *sampling, "--draft", draft, "--k", 4, "--seed-draft", 3, "--rollback", mode, "--logits-out", spec_file)
            assert spec.returncode == 0, spec.stderr
            out = json.loads(spec.stdout)
            assert out["tokens"] == json.loads(plain.stdout)["tokens"], f"{draft}/{mode} {sampling}: tokens differ"
            assert np.array_equal(np.load(spec_file), np.load(plain_file)), f"{draft}/{mode} {sampling}: logits differ"
            assert out["steps"] == len(out["accepted_per_step"]) and out["mean_acceptance_length"] >= 1.0
            if draft == "oracle":
                assert out["mean_acceptance_length"] > 3.0


def test_a_k_past_the_default_maximum_says_what_a_step_costs(hf_checkpoint):
    proc = _run("generate", "--model", hf_checkpoint("qwen3_5_text"), "--prompt-ids", "1,2", "--max-new-tokens", 3,
                "--draft", "ngram", "--k", 12, "--max-k", 12)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("note: --k 12: each step drafts up to 12 tokens one by one and verifies 13 rows "
                                  "(on the CPU a verify row costs about a decode step)"), proc.stderr


def test_k_above_max_k_exits_2_naming_the_limit(hf_checkpoint):
    """--k 100000 once ran for over 10 minutes and grew past 5.5 GB: now refused before any work."""
    path = hf_checkpoint("qwen3_5_text")
    proc = _run("generate", "--model", path, "--prompt-ids", "1,2,3", "--max-new-tokens", 4, "--draft", "random", "--k", 100000)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --k 100000 exceeds --max-k 8"), proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    proc = _run("generate", "--model", path, "--prompt-ids", "1,2,3", "--max-new-tokens", 4, "--draft", "ngram",
                "--k", 5, "--max-k", 4)
    assert proc.returncode == 2 and "--k 5 exceeds --max-k 4" in proc.stderr, proc.stderr
    raised = _run("generate", "--model", path, "--prompt-ids", "1,2,3", "--max-new-tokens", 4, "--draft", "ngram",
                  "--k", 20, "--max-k", 20, "--json")
    assert raised.returncode == 0, raised.stderr
    assert json.loads(raised.stdout)["k"] == 20


def test_sampling_errors_name_the_flag(hf_checkpoint):
    path = hf_checkpoint("qwen3_5_text")
    for flag, value in (("--temperature", "-1"), ("--top-p", "1.5"), ("--temperature", "nan")):
        proc = _run("generate", "--model", path, "--prompt-ids", "1,2", "--max-new-tokens", 2, flag, value)
        assert proc.returncode == 2 and proc.stderr.startswith(f"error: {flag}: "), (flag, proc.stderr)


def _subparser(parser, name):
    (choices,) = [a.choices for a in parser._actions if isinstance(a.choices, dict)]
    return choices[name]


def test_every_generate_flag_shows_its_default():
    assert flags_without_stated_default(_subparser(cli.build_parser(), "generate")) == []
    proc = _run("generate", "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    for shown in ("--max-k MAX_K the largest --k accepted: the engine and the slot are sized for it (default: 8)",
                  "(default: 4 with a drafter, 0 without)", "greedy (argmax)", "(default: 0.0)", "(default: cpu)",
                  "--json print one JSON object instead of text (default: off)"):
        assert shown in text, shown


@pytest.mark.parametrize("draft", ["random", "ngram"])
def test_the_json_reports_drafted_per_step(hf_checkpoint, draft):
    path = hf_checkpoint("qwen3_5_text")
    proc = _run("generate", "--model", path, "--prompt-ids", "5,6,7,5,6,7", "--max-new-tokens", 10, "--draft", draft,
                "--k", 3, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["drafted_per_step"]) == len(out["accepted_per_step"]) == out["steps"]
    assert all(0 <= a <= d <= 3 for a, d in zip(out["accepted_per_step"], out["drafted_per_step"]))


def test_generate_streams_each_steps_tokens(hf_checkpoint):
    """`verifier generate` prints tokens as each step emits them: generate's on_tokens gets the
    first token, then every step's tokens, which together are the generation's."""
    model = load_model(hf_checkpoint("qwen3_5_text"))
    engine = Engine(model, n_slots=1, max_seq_len=32, max_k=3)
    calls: list[list[int]] = []
    from verifier.proposers import RandomProposer

    result = generate(engine, [1, 2, 3], 10, proposer=RandomProposer(model.config.vocab_size, 0), k=3, on_tokens=calls.append)
    assert len(calls) == result.steps + 1 and calls[0] == result.tokens[:1]
    assert [t for call in calls for t in call] == result.tokens


@pytest.mark.parametrize("command", ["generate", "check"])
def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys, command):
    """Ctrl-C (KeyboardInterrupt) in generate or check: one line on stderr and exit 130, the status
    a shell gives an interrupted command; no traceback."""

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_generate", interrupted)
    monkeypatch.setattr(cli, "check_command", interrupted)
    args = ["generate", "--prompt-ids", "1", "--max-new-tokens", "2"] if command == "generate" else ["check"]
    assert cli.main(args) == 130
    err = capsys.readouterr().err
    assert err == f"interrupted: {command} stopped (exit 130)\n", err
