"""The whole run in one call, inside a wall-clock budget: data, tokenizer, target, draft, evaluation, card.

Time plan: the data and tokenizer take what they take; from what is left, `eval_reserve_s` is
kept for saving, evaluation and the card, the target trains for `target_share` of the rest and
the draft for whatever remains after the target. Each checkpoint is saved as soon as it is
trained, so a failure later still leaves it on disk.
"""

from __future__ import annotations

import datetime
import json
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from presets.training import PRESETS

from . import PROG
from .card import METRICS_FILE, write_card
from .configs import SIZE_LIMIT_BYTES, build_model, count_parameters, shape_parameters
from .data import DEV, SPLITS, TRAIN, VALIDATION, load_corpus, stdlib_root
from .evaluate import EvalConfig, evaluate_pair
from .tokenizer import EOT_ID, encode_stream, load_trained_tokenizer, token_byte_lengths, train_tokenizer
from .train import TrainConfig, train_model

STORED_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DRAFT_LR = 2e-3  # the smaller model takes a higher peak
# Saving, two engine loads (Triton compiles on CUDA), the parity references and scoring ~300k tokens twice.
EVAL_RESERVE_S = 120.0
TARGET_SHARE = 0.62


@dataclass(frozen=True)
class RunConfig:
    out: Path
    time_budget_s: float = 480.0
    device: str = "cuda"
    seed: int = 0
    preset: str = "default"
    vocab_size: int = 8192
    data_root: Path | None = None  # None: the running interpreter's standard library
    val_fraction: float = 0.05
    dev_fraction: float = 0.03
    target_train: TrainConfig = field(default_factory=TrainConfig)
    draft_train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=DRAFT_LR))
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    eval_reserve_s: float = EVAL_RESERVE_S
    target_share: float = TARGET_SHARE
    stored_dtype: str = "bfloat16"
    overwrite: bool = False
    command: str = f"{PROG} run"

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"RunConfig.preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        if self.time_budget_s <= 0 or self.eval_reserve_s < 0:
            raise ValueError(f"RunConfig.time_budget_s must be positive and eval_reserve_s non-negative, "
                             f"got {self.time_budget_s}, {self.eval_reserve_s}")
        if not 0 < self.target_share < 1:
            raise ValueError(f"RunConfig.target_share must be in (0, 1), got {self.target_share}")
        if self.stored_dtype not in STORED_DTYPES:
            raise ValueError(f"RunConfig.stored_dtype must be one of {sorted(STORED_DTYPES)}, got {self.stored_dtype!r}")


def say(msg: str) -> None:
    print(f"[training] {msg}", file=sys.stderr, flush=True)


def gdn_kernels() -> str:
    try:
        import fla

        return f"flash-linear-attention {getattr(fla, '__version__', '?')}"
    except ImportError:
        return "transformers' torch reference (flash-linear-attention not installed)"


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"


def save_checkpoint(model, tok, out_dir: Path, dtype: torch.dtype) -> int:
    """config.json, model.safetensors, tokenizer.json, generation_config.json; returns the bytes written."""
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(out_dir)
    tok.save(str(out_dir / "tokenizer.json"), pretty=False)  # the same tokenizer, without indentation (~40% of the bytes)
    GenerationConfig(eos_token_id=EOT_ID, pad_token_id=EOT_ID).save_pretrained(out_dir)
    return sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())


def _check_size(cfg: RunConfig, vocab: int, tokenizer_bytes: int) -> None:
    """Refuse before training a pair that could not ship (stored weights + two tokenizers over the limit)."""
    bytes_per = torch.finfo(STORED_DTYPES[cfg.stored_dtype]).bits // 8
    params = sum(shape_parameters(shape, vocab) for shape in PRESETS[cfg.preset])
    planned = params * bytes_per + 2 * tokenizer_bytes
    if planned > SIZE_LIMIT_BYTES:
        raise ValueError(f"preset {cfg.preset!r} at vocabulary {vocab} stores {planned / 2**20:.1f} MiB in {cfg.stored_dtype}, "
                         f"over the {SIZE_LIMIT_BYTES >> 20} MiB limit")


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"--out {out} is not empty (pass --overwrite to replace it)")
        for name in ("target", "draft"):
            shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)


def run(cfg: RunConfig) -> dict:
    t0 = time.monotonic()
    _prepare_out(cfg.out, cfg.overwrite)
    corpus = load_corpus(cfg.data_root, cfg.val_fraction, cfg.dev_fraction)
    data = corpus.summary()
    say(f"corpus {corpus.root}: " + ", ".join(f"{s} {data[s]['files']} files / {data[s]['bytes']:,} bytes" for s in SPLITS))

    tok = train_tokenizer(corpus.texts(TRAIN), cfg.vocab_size)
    vocab = tok.get_vocab_size()
    streams = {s: encode_stream(tok, corpus.texts(s)) for s in SPLITS}
    for s in SPLITS:
        data[s]["tokens"] = int(len(streams[s]))
    tok_bytes = len(tok.to_str().encode())
    _check_size(cfg, vocab, tok_bytes)
    say(f"tokenizer: vocabulary {vocab}; tokens " + ", ".join(f"{s} {len(streams[s]):,}" for s in SPLITS)
        + f" ({time.monotonic() - t0:.0f} s so far)")

    metrics = {
        "run": {"command": cfg.command, "date": datetime.date.today().isoformat(), "device": cfg.device,
                "device_name": device_name(cfg.device), "torch": torch.__version__, "transformers": _transformers_version(),
                "gdn_kernels": gdn_kernels(), "seed": cfg.seed, "time_budget_s": cfg.time_budget_s, "preset": cfg.preset},
        "data": {"source": "stdlib" if cfg.data_root is None else "directory", "python_version": platform.python_version(),
                 "val_fraction": cfg.val_fraction, "dev_fraction": cfg.dev_fraction,
                 "validation_files": [f.path for f in corpus.splits[VALIDATION]], **data},
        "tokenizer": {"vocab_size": vocab, "eot_id": EOT_ID, "requested_vocab_size": cfg.vocab_size,
                      "train_bytes_per_token": data[TRAIN]["bytes"] / max(1, len(streams[TRAIN]))},
        "models": {},
    }
    target_shape, draft_shape = PRESETS[cfg.preset]
    plan = [("target", target_shape, cfg.target_train, cfg.seed), ("draft", draft_shape, cfg.draft_train, cfg.seed + 1)]
    training_s = cfg.time_budget_s - (time.monotonic() - t0) - cfg.eval_reserve_s
    if training_s <= 0:
        raise ValueError(f"--time-budget-s {cfg.time_budget_s:g} leaves no training time after the data "
                         f"({time.monotonic() - t0:.0f} s) and --eval-reserve-s {cfg.eval_reserve_s:g}")
    for i, (name, shape, train_cfg, seed) in enumerate(plan):
        left = cfg.time_budget_s - (time.monotonic() - t0) - cfg.eval_reserve_s
        # The draft gets what the target left, but never under half its planned share: an overrun of
        # the target costs the evaluation reserve some seconds rather than the draft its training.
        budget = training_s * cfg.target_share if i == 0 else max(left, 0.5 * training_s * (1 - cfg.target_share))
        say(f"{name}: training for {budget:.0f} s on {cfg.device}")
        model = build_model(shape, vocab, EOT_ID, seed)
        sizes = count_parameters(model)
        result = train_model(model, streams[TRAIN], streams[DEV], train_cfg, budget, cfg.device, seed, name)
        size = save_checkpoint(model, tok, cfg.out / name, STORED_DTYPES[cfg.stored_dtype])
        metrics["models"][name] = {**sizes, "config": shape.hf_fields(vocab, EOT_ID), "hyper": asdict(train_cfg),
                                   "train": result.as_dict(), "size_bytes": size, "stored_dtype": cfg.stored_dtype}
        say(f"{name}: {sizes['parameters']:,} parameters, saved {size / 2**20:.1f} MiB to {cfg.out / name}")
        del model
        if cfg.device.startswith("cuda"):
            torch.cuda.empty_cache()
    metrics["run"]["pair_size_bytes"] = total = sum(m["size_bytes"] for m in metrics["models"].values())
    if total > SIZE_LIMIT_BYTES:  # _check_size should have prevented it; the card shows it either way
        say(f"warning: the pair takes {total / 2**20:.1f} MiB, over the {SIZE_LIMIT_BYTES >> 20} MiB limit")
    metrics["run"]["wall_s"] = time.monotonic() - t0
    _write_metrics(cfg.out, metrics)
    write_card(cfg.out)  # "not evaluated yet", until the evaluation below replaces it

    # Whatever the budget has left (less a little for the card) bounds the evaluation; a cut one says so.
    eval_left = cfg.time_budget_s - (time.monotonic() - t0) - 10.0
    eval_cfg = cfg.evaluation if cfg.evaluation.time_limit_s is not None else replace(cfg.evaluation, time_limit_s=max(eval_left, 5.0))
    _evaluate_into(metrics, cfg.out, streams[VALIDATION], tok, eval_cfg, cfg.device, matches=True)
    metrics["run"]["wall_s"] = time.monotonic() - t0
    _write_metrics(cfg.out, metrics)
    write_card(cfg.out)
    say(f"done in {metrics['run']['wall_s']:.0f} s of {cfg.time_budget_s:.0f}: {cfg.out}")
    return metrics


def evaluate_models(models_dir: Path, device: str, window: int | None = None, max_tokens: int | None = None,
                    data_root: Path | None = None, force: bool = False) -> dict:
    """Recompute the evaluation of a trained pair from its training_metrics.json and rewrite the card.

    The corpus is the run's (the running interpreter's stdlib when the run used the stdlib). When its
    validation split differs from the run's (another Python version), the figures are returned but
    the metrics and card are left alone unless `force`: they would describe other data."""
    models_dir = Path(models_dir)
    path = models_dir / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no training metrics (train with `{PROG} run` first)")
    with open(path) as f:
        metrics = json.load(f)
    recorded = metrics["data"]
    if data_root is None:
        data_root = stdlib_root() if recorded["source"] == "stdlib" else Path(recorded["root"])
    corpus = load_corpus(data_root, recorded["val_fraction"], recorded["dev_fraction"])
    matches = corpus.summary()[VALIDATION]["sha256"] == recorded[VALIDATION]["sha256"]
    if not matches:
        say(f"warning: the validation split under {data_root} differs from the training run's "
            f"(Python {recorded['python_version']} there, {platform.python_version()} here): the figures will differ"
            + ("" if force else f"; {models_dir} is left as it is (--force writes them)"))
    if window is None:
        window = (metrics.get("evaluation") or {}).get("window", EvalConfig.window)
    tok = load_trained_tokenizer(models_dir / "target")
    stream = encode_stream(tok, corpus.texts(VALIDATION))
    _evaluate_into(metrics, models_dir, stream, tok, EvalConfig(window=window, max_tokens=max_tokens), device, matches)
    if matches or force:
        _write_metrics(models_dir, metrics)
        write_card(models_dir)
    return metrics


def _evaluate_into(metrics: dict, models_dir: Path, stream: np.ndarray, tok, eval_cfg: EvalConfig, device: str,
                   matches: bool) -> None:
    ev = evaluate_pair(models_dir, stream, token_byte_lengths(tok), eval_cfg, device)
    ev.update({"device": device_name(device), "validation_matches_training": matches,
               "date": datetime.date.today().isoformat()})
    metrics["evaluation"] = ev
    say(f"validation: target {ev['target']['bits_per_byte']:.3f} bits/byte, draft {ev['draft']['bits_per_byte']:.3f}, "
        f"greedy agreement {ev['greedy_agreement']:.3f} ({ev['positions']:,} positions, {ev['seconds']:.0f} s)")


def _write_metrics(out: Path, metrics: dict) -> None:
    with open(Path(out) / METRICS_FILE, "w") as f:
        json.dump(metrics, f, indent=1, default=str)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
