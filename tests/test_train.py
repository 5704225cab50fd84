"""training (the default pair's pipeline): the corpus split, the tokenizer, and a tiny end-to-end run on the CPU whose
checkpoints the engine loads and generates from."""

from __future__ import annotations

import ast
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
# training/ is not an installed package: `python -m pytest` finds it from the repository root, a bare `pytest` would not.
sys.path.insert(0, str(REPO))

from drafter.text import load_tokenizer as drafter_load_tokenizer  # noqa: E402
from training import PROG  # noqa: E402
from training.card import CARD_FILE, METRICS_FILE, PLOT_FILE, write_card  # noqa: E402
from training.cli import main as train_main  # noqa: E402
from training.data import DEV, EOT, TRAIN, VALIDATION, list_sources, load_corpus, split_of, stdlib_root  # noqa: E402
from training.evaluate import windows  # noqa: E402
from training.tokenizer import EOT_ID, encode_stream, load_trained_tokenizer, token_byte_lengths, train_tokenizer  # noqa: E402
from training.train import TrainConfig, learning_rate  # noqa: E402
from verifier import defaults  # noqa: E402
from verifier.engine import Engine  # noqa: E402
from verifier.generate import generate  # noqa: E402
from verifier.model import load_model  # noqa: E402
from verifier.tokenizer import TextTokenizer, byte_level_tokenizer, load_tokenizer  # noqa: E402

# Small modules present in every supported Python's standard library.
_STDLIB_FILES = ["abc.py", "bisect.py", "colorsys.py", "copy.py", "fnmatch.py", "getopt.py", "glob.py", "heapq.py",
                 "keyword.py", "shlex.py", "string.py", "textwrap.py", "json/__init__.py", "json/decoder.py",
                 "json/encoder.py", "json/scanner.py", "json/tool.py", "html/__init__.py", "html/entities.py"]
VAL_FRACTION, DEV_FRACTION = 0.25, 0.2


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """A few real stdlib files, plus directories the corpus must skip."""
    root = tmp_path_factory.mktemp("corpus")
    for rel in _STDLIB_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(stdlib_root() / rel, root / rel)
    for skipped in ("test/test_x.py", "json/tests/test_y.py", "idlelib/idle_test/test_z.py", "site-packages/pkg/m.py"):
        (root / skipped).parent.mkdir(parents=True, exist_ok=True)
        (root / skipped).write_text("SKIPPED = True\n")
    (root / "latin1.py").write_bytes(b"# caf\xe9\nx = 1\n")  # not UTF-8: skipped and reported
    return root


def test_split_is_deterministic_disjoint_and_skips_tests(corpus_dir):
    names = list_sources(corpus_dir)
    assert names == sorted(names)
    assert not [n for n in names if "test" in n.split("/")[:-1] or "site-packages" in n or "idle_test" in n]
    a = load_corpus(corpus_dir, VAL_FRACTION, DEV_FRACTION)
    b = load_corpus(corpus_dir, VAL_FRACTION, DEV_FRACTION)
    paths = {s: [f.path for f in a.splits[s]] for s in (TRAIN, DEV, VALIDATION)}
    assert paths == {s: [f.path for f in b.splits[s]] for s in (TRAIN, DEV, VALIDATION)}
    assert all(paths[s] for s in (TRAIN, DEV, VALIDATION))
    assert set(paths[TRAIN]).isdisjoint(paths[DEV]) and set(paths[TRAIN]).isdisjoint(paths[VALIDATION])
    assert set(paths[DEV]).isdisjoint(paths[VALIDATION])
    assert sorted(paths[TRAIN] + paths[DEV] + paths[VALIDATION] + a.undecodable) == names
    assert a.undecodable == ["latin1.py"]
    # The validation split depends on each file's own path only: not on dev_fraction, nor on other files.
    c = load_corpus(corpus_dir, VAL_FRACTION, 0.0)
    assert [f.path for f in c.splits[VALIDATION]] == paths[VALIDATION]
    assert all(split_of(p, VAL_FRACTION, DEV_FRACTION) == VALIDATION for p in paths[VALIDATION])
    summary = a.summary()
    assert summary[VALIDATION]["bytes"] == sum(len(f.text.encode()) for f in a.splits[VALIDATION])


def test_tokenizer_round_trips_and_counts_bytes(corpus_dir, tmp_path):
    corpus = load_corpus(corpus_dir, VAL_FRACTION, DEV_FRACTION)
    tok = train_tokenizer(corpus.texts(TRAIN), 512)
    assert tok.get_vocab_size() == 512 and tok.token_to_id(EOT) == EOT_ID == 0
    tok.save(str(tmp_path / "tokenizer.json"))
    text_tok = TextTokenizer.from_model_dir(tmp_path)
    samples = corpus.texts(VALIDATION) + ["def f(x):\n\treturn x  \r\n", "café — naïve 漢字 🐍\n", "  \n\n   x=1"]
    lengths = token_byte_lengths(tok)
    for text in samples:
        ids = text_tok.encode(text)
        assert text_tok.decode(ids) == text
        assert int(lengths[ids].sum()) == len(text.encode("utf-8"))
    stream = encode_stream(tok, corpus.texts(VALIDATION))
    assert stream[0] == EOT_ID and int((stream == EOT_ID).sum()) == len(corpus.splits[VALIDATION])
    assert int(lengths[stream].sum()) == corpus.summary()[VALIDATION]["bytes"]


def test_learning_rate_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    warm = [learning_rate(cfg, s, 0.0) for s in range(10)]
    assert warm == sorted(warm) and warm[-1] == pytest.approx(1e-3)
    assert learning_rate(cfg, 50, 0.0) == pytest.approx(1e-3)
    assert learning_rate(cfg, 50, 0.5) == pytest.approx(0.55e-3)
    assert learning_rate(cfg, 50, 1.0) == pytest.approx(1e-4)


def test_evaluation_windows_score_every_token_once():
    for n, w in ((10, 4), (9, 4), (2, 512), (1025, 512)):
        spans = windows(n, w)
        targets = [t for s, length in spans for t in range(s + 1, s + 1 + length)]
        assert targets == list(range(1, n)) and all(1 <= length <= w for _, length in spans)
    assert sum(length for _, length in windows(1025, 512, max_tokens=700)) == 700


@pytest.fixture(scope="module")
def trained(corpus_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("models")
    args = ["run", "--out", str(out), "--overwrite", "--device", "cpu", "--preset", "tiny", "--vocab-size", "512",
            "--data-root", str(corpus_dir), "--val-fraction", str(VAL_FRACTION), "--dev-fraction", str(DEV_FRACTION),
            "--time-budget-s", "60", "--eval-reserve-s", "15", "--seq-len", "64", "--batch-size", "4", "--max-steps", "12",
            "--warmup-steps", "3", "--log-every", "4", "--eval-every-s", "1000", "--eval-window", "128"]
    assert train_main(args) == 0
    return out


def test_run_writes_a_loadable_pair_a_card_and_metrics(trained):
    for name in ("target", "draft"):
        for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
            assert (trained / name / f).is_file(), f"{name}/{f}"
        with open(trained / name / "config.json") as f:
            config = json.load(f)
        assert config["model_type"] == "qwen3_5_text" and config["eos_token_id"] == EOT_ID
        assert config["tie_word_embeddings"] is True and config["max_position_embeddings"] >= 4096
    with open(trained / METRICS_FILE) as f:
        metrics = json.load(f)
    for name in ("target", "draft"):
        train = metrics["models"][name]["train"]
        assert train["steps"] == 12 and train["tokens"] == 12 * 4 * 64
        curve = [p["loss"] for p in train["train_curve"]]
        assert len(curve) == 3 and curve[-1] < curve[0]  # it learns
        assert train["best_dev_loss"] is not None
    ev = metrics["evaluation"]
    assert ev["complete"] and ev["positions"] == metrics["data"][VALIDATION]["tokens"] - 1
    assert ev["bytes"] == metrics["data"][VALIDATION]["bytes"]
    for name in ("target", "draft"):
        bpb = ev[name]["bits_per_byte"]
        assert math.isfinite(bpb) and 0 < bpb < 16
        assert ev["parity"][name]["ok"] and ev["parity"][name]["max_rel_diff"] < 1e-4
    assert 0 <= ev["greedy_agreement"] <= 1
    card = (trained / CARD_FILE).read_text()
    assert f"{ev['target']['bits_per_byte']:.3f}" in card and f"{ev['greedy_agreement']:.3f}" in card
    assert (trained / PLOT_FILE).read_bytes()[:4] == b"\x89PNG"


def test_engine_generates_from_both_checkpoints(trained):
    tok = TextTokenizer.from_model_dir(trained / "target")
    prompt = tok.encode("def f(x):")
    for name in ("target", "draft"):
        model = load_model(trained / name, "cpu", torch.float32)
        engine = Engine(model, n_slots=1, max_seq_len=64, max_k=4)
        out = generate(engine, prompt, 8)
        assert 1 <= len(out.tokens) <= 8 and all(0 <= t < model.config.vocab_size for t in out.tokens)
        assert isinstance(tok.decode(out.tokens), str)


def test_evaluate_alone_reproduces_the_figures(trained):
    with open(trained / METRICS_FILE) as f:
        before = json.load(f)["evaluation"]
    assert train_main(["evaluate", "--models", str(trained), "--device", "cpu"]) == 0  # the run's window, 128
    with open(trained / METRICS_FILE) as f:
        after = json.load(f)["evaluation"]
    assert after["validation_matches_training"] is True
    for key in ("positions", "bytes", "greedy_agreement"):
        assert after[key] == before[key]
    for name in ("target", "draft"):
        assert after[name] == before[name]


def test_evaluate_on_other_data_leaves_the_card_alone(trained, corpus_dir, tmp_path):
    other = tmp_path / "corpus"
    shutil.copytree(corpus_dir, other)
    victim = load_corpus(corpus_dir, VAL_FRACTION, DEV_FRACTION).splits[VALIDATION][0].path
    with open(other / victim, "a") as f:
        f.write("\nEXTRA = 1\n")
    card, metrics = (trained / CARD_FILE).read_text(), (trained / METRICS_FILE).read_text()
    assert train_main(["evaluate", "--models", str(trained), "--device", "cpu", "--data-root", str(other)]) == 0
    assert (trained / CARD_FILE).read_text() == card and (trained / METRICS_FILE).read_text() == metrics


def test_shipped_pair_becomes_the_default_only_when_present(trained, tmp_path, monkeypatch):
    monkeypatch.setattr(defaults, "SHIPPED_TARGET", tmp_path / "models" / "target")
    monkeypatch.setattr(defaults, "SHIPPED_DRAFT", tmp_path / "models" / "draft")
    assert defaults.default_draft_model_dir() is None
    shutil.copytree(trained / "draft", tmp_path / "models" / "draft")
    assert defaults.default_draft_model_dir() is None  # a draft without its target is no default
    shutil.copytree(trained / "target", tmp_path / "models" / "target")
    assert defaults.default_model_dir() == tmp_path / "models" / "target"
    assert defaults.default_draft_model_dir() == tmp_path / "models" / "draft"


def test_card_of_a_run_made_before_the_move_keeps_its_command_and_gives_todays(trained, tmp_path):
    card = (trained / CARD_FILE).read_text()
    assert f"`{PROG} run --out {trained} " in card and f"` (`training/`); `{PROG} evaluate --models" in card
    old = tmp_path / "old"
    shutil.copytree(trained, old)
    with open(old / METRICS_FILE) as f:
        metrics = json.load(f)
    metrics["run"]["command"] = "python -m bench.train run --out /tmp/models --seed 0"
    (old / METRICS_FILE).write_text(json.dumps(metrics))
    card = write_card(old).read_text()
    assert "`python -m bench.train run --out /tmp/models --seed 0` (the pipeline has since moved to `training/`: " \
           f"`{PROG} run --out /tmp/models --seed 0` today)" in card
    assert f"`{PROG} evaluate --models old`" in card


def test_one_tokenizer_loader_serves_verifier_drafter_and_training(tmp_path):
    tok = train_tokenizer(["def f(x):\n    return x\n"] * 4, 300)
    tok.save(str(tmp_path / "tokenizer.json"))
    for where in (tmp_path, tmp_path / "tokenizer.json"):  # the directory or the file
        assert load_tokenizer(where).to_str() == tok.to_str()
        assert load_trained_tokenizer(where).to_str() == tok.to_str()
    assert TextTokenizer.from_model_dir(tmp_path).encode("def f") == tok.encode("def f", add_special_tokens=False).ids
    missing, broken = tmp_path / "missing", tmp_path / "broken"
    missing.mkdir()
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    assert TextTokenizer.from_model_dir(missing) is None
    with pytest.raises(FileNotFoundError, match="missing"):
        load_tokenizer(missing)
    with pytest.raises(ValueError, match="cannot read .*broken"):
        load_tokenizer(broken)
    with pytest.raises(ValueError, match="cannot read .*broken"):
        TextTokenizer.from_model_dir(broken)
    for where, why in ((missing, "no tokenizer.json at .*missing"), (broken, "cannot read .*broken")):
        with pytest.raises(ValueError, match=f"^--tokenizer: {why}"):  # the drafter's flag, exit 2 in its CLI
            drafter_load_tokenizer(where)
    other = tmp_path / "other"
    other.mkdir()
    byte_level_tokenizer("<|other|>").save(str(other / "tokenizer.json"))  # <|endoftext|> absent: not one of ours
    with pytest.raises(ValueError, match=f"{EOT} has id None, expected {EOT_ID}"):
        load_trained_tokenizer(other)


def test_bench_holds_benchmarks_only():
    """Issue 12: the training pipeline left bench/; bench modules import the project as packages
    (no sys.path patching, nothing from tests/) and run as modules from the repository root."""
    bench = REPO / "bench"
    assert not (bench / "train").exists() and (REPO / "training" / "__main__.py").is_file()
    for path in sorted(bench.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
                pytest.fail(f"{path.relative_to(REPO)}:{node.lineno} touches sys.path")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                top = {name.split(".")[0] for name in names}
                assert not top & {"tests", "hf_models", "conftest"}, f"{path.relative_to(REPO)}:{node.lineno} imports from tests/"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-m", "bench.rollback", "--help"], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and "--repeats" in proc.stdout, proc.stderr
