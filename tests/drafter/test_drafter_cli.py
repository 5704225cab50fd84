"""`python -m drafter generate`, run as a user runs it, against a verifier on loopback: with ngram and
random drafts it prints exactly the tokens `python -m verifier generate --draft none` prints."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from drafter import cli
from verifier.arguments import flags_without_stated_default
from verifier.tokenizer import byte_level_tokenizer

from drafter_setup import MAX_K, MAX_SEQ_LEN, client, served_checkpoint, server  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[2]
PROMPT = "5,9,14,3,5,9,14,3,7"


def _run(module, *args):
    """args: str() of each, bytes as they are (an argument that is not UTF-8)."""
    argv = [a if isinstance(a, bytes) else str(a) for a in args]
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, cwd=REPO, timeout=300)


def _json(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_drafter_cli_prints_the_tokens_of_plain_decoding(server, served_checkpoint):
    sampled = ["--temperature", 0.9, "--top-k", 20, "--seed", 11]
    for sampling in ([], sampled):
        plain = _json(_run("verifier", "generate", "--model", served_checkpoint, "--prompt-ids", PROMPT,
                           "--max-new-tokens", 20, "--draft", "none", "--json", *sampling))
        runs = [["--drafter", "ngram", "--k", 3], ["--drafter", "random", "--k", 5, "--seed-draft", 2, "--transport", "unary"]]
        for drafting in runs:
            got = _json(_run("drafter", "generate", "--server", server.address, "--prompt-ids", PROMPT,
                             "--max-new-tokens", 20, "--json", *drafting, *sampling))
            where = f"{drafting} {sampling}"
            assert got["tokens"] == plain["tokens"], where
            assert got["finish_reason"] == plain["finish_reason"], where
            assert got["steps"] == len(got["accepted_per_step"]) == len(got["drafted_per_step"]) > 0
            assert all(0 <= a <= d <= drafting[3] for a, d in zip(got["accepted_per_step"], got["drafted_per_step"]))
            drafted = [a for a, d in zip(got["accepted_per_step"], got["drafted_per_step"]) if d]
            assert got["mean_acceptance_length"] == round(1 + sum(drafted) / len(drafted), 4)
            assert got["prompt_tokens"] == 9 and got["tokens_per_s"] > 0


def test_logits_out_equals_the_verifier_cli(server, served_checkpoint, tmp_path):
    ours, theirs = tmp_path / "drafter.npy", tmp_path / "verifier.npy"
    plain = _json(_run("verifier", "generate", "--model", served_checkpoint, "--prompt-ids", PROMPT,
                       "--max-new-tokens", 10, "--json", "--logits-out", theirs))
    got = _json(_run("drafter", "generate", "--server", server.address, "--prompt-ids", PROMPT, "--max-new-tokens", 10,
                     "--drafter", "random", "--k", 4, "--json", "--logits-out", ours))
    assert got["tokens"] == plain["tokens"]
    assert np.array_equal(np.load(ours), np.load(theirs))


def test_streams_text_or_ids(server, served_checkpoint):
    proc = _run("drafter", "generate", "--server", server.address, "--text", "ABAB", "--max-new-tokens", 6, "--tokenizer", served_checkpoint)
    assert proc.returncode == 0, proc.stderr
    as_ids = _json(_run("drafter", "generate", "--server", server.address, "--text", "ABAB", "--max-new-tokens", 6, "--json"))
    assert proc.stdout == byte_level_tokenizer().decode(as_ids["tokens"]) + "\n"
    assert "6 tokens" in proc.stderr and as_ids["prompt_tokens"] == 4
    ids = _run("drafter", "generate", "--server", server.address, "--prompt-ids", PROMPT, "--max-new-tokens", 6, "--drafter", "none")
    assert ids.returncode == 0, ids.stderr
    assert [int(t) for t in ids.stdout.strip().split(",")] == _json(_run(
        "drafter", "generate", "--server", server.address, "--prompt-ids", PROMPT, "--max-new-tokens", 6, "--json"))["tokens"]


def test_errors_name_the_problem_and_set_the_exit_status(server):
    bad_args = {
        ("--prompt-ids", "1,2,500"): "[500] are outside the served model's vocabulary 0..89",
        ("--prompt-ids", "1,2", "--drafter", "none", "--k", "2"): "--k needs a drafter",
        ("--prompt-ids", "1,2", "--ngram-min", "3", "--ngram-max", "2"): "--ngram-min 3 is larger than --ngram-max 2",
        ("--prompt-ids", "1,2", "--temperature", "-1"): "temperature",
        ("--prompt-ids", "1,x"): "comma-separated integers",
        ("--prompt-ids", "1,2", "--k", "0"): "--k 0 with --drafter ngram drafts nothing",
        ("--text", b"ab\xffc"): "argument --text: is not valid UTF-8 (byte 0xff at character 2)",
    }
    for args, message in bad_args.items():
        proc = _run("drafter", "generate", "--server", server.address, "--max-new-tokens", 4, *args)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
    # a text prompt longer than the context: the server refuses it at the open (its status, exit 1)
    proc = _run("drafter", "generate", "--server", server.address, "--text", "A" * 120, "--max-new-tokens", 4)
    assert proc.returncode == 1 and proc.stderr.startswith("error: OUT_OF_RANGE") and proc.stderr.count("\n") == 1, proc.stderr
    proc = _run("drafter", "generate", "--server", "127.0.0.1:1", "--prompt-ids", "1", "--max-new-tokens", 4, "--timeout", 2)
    assert proc.returncode == 1 and "cannot reach the verifier at 127.0.0.1:1" in proc.stderr


def test_limits_of_the_server_exit_2_naming_them(server, client):
    """No silent cuts: a --k over the server's max_k, or a budget past its context, is refused."""
    prompt = PROMPT.split(",")  # 9 ids
    cases = {
        ("--prompt-ids", PROMPT, "--k", 100, "--max-new-tokens", 4): f"--k 100 exceeds the server's max_k {MAX_K}",
        ("--prompt-ids", PROMPT, "--max-new-tokens", 3000):
            f"--max-new-tokens 3000: {len(prompt)} prompt tokens + 3000 new tokens exceed the server's max_context {MAX_SEQ_LEN}",
        ("--prompt-ids", PROMPT, "--max-new-tokens", MAX_SEQ_LEN - len(prompt) + 1): f"max_context {MAX_SEQ_LEN}",
        # --text: a budget no prompt fits is refused before the open ...
        ("--text", "ABAB", "--max-new-tokens", MAX_SEQ_LEN): f"at least 1 prompt token + {MAX_SEQ_LEN} new tokens",
        # ... and one this prompt does not fit right after it (the server tokenizes: 4 tokens)
        ("--text", "ABAB", "--max-new-tokens", MAX_SEQ_LEN - 3): f"4 prompt tokens + {MAX_SEQ_LEN - 3} new tokens exceed",
    }
    before = client.stats().open_sessions
    for args, message in cases.items():
        proc = _run("drafter", "generate", "--server", server.address, "--drafter", "ngram", *args)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stdout == "", proc.stdout
    assert client.stats().open_sessions == before, "the session opened for the --text check was closed"
    # at the limits themselves, the runs go through
    fits = _json(_run("drafter", "generate", "--server", server.address, "--prompt-ids", PROMPT, "--json",
                      "--k", MAX_K, "--max-new-tokens", MAX_SEQ_LEN - len(prompt)))
    assert fits["k"] == MAX_K and len(fits["tokens"]) <= MAX_SEQ_LEN - len(prompt)


def test_every_flag_shows_its_default():
    (commands,) = [a.choices for a in cli.build_parser()._actions if isinstance(a.choices, dict)]
    for name in ("generate", "bench"):
        assert flags_without_stated_default(commands[name]) == [], name
    proc = _run("drafter", "bench", "--help")
    assert proc.returncode == 0 and "(default: 60.0)" in proc.stdout, proc.stderr
    text = " ".join(_run("drafter", "generate", "--help").stdout.split())
    for shown in ("(default: 4 with a drafter, or the server's max_k if lower)", "(default: ngram)", "(default: 0.0)",
                  "--adaptive-k adapt K", "greedy, every drafter"):
        assert shown in text, shown
