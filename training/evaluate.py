"""The model card's figures, computed with the verifier's own engine (what serves the models).

Windows: the validation stream `[eot] file1 [eot] file2 ...` is cut into consecutive windows of
`window` tokens; each window is prefilled into a fresh slot and scores its next tokens, so every
token after the stream's first is scored exactly once, with the preceding tokens of its window
as context (0 .. window-1 of them, (window-1)/2 on average), never across a window edge.

- bits per byte: sum over scored tokens of -log2 p(token) / UTF-8 bytes those tokens stand for
  (the end-of-text separators are scored and stand for no bytes, which can only raise the figure);
- greedy agreement: the fraction of scored positions where the draft's argmax equals the target's;
- parity: our engine's logits against transformers' on a few windows, both fp32, as a check that
  the checkpoint means the same thing to both.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from presets.hf_reference import load_hf
from verifier.model import load_model

PARITY_TOLERANCE = 1e-2  # of the reference's largest |logit|: a sanity bound (GPU kernels may use TF32), not the parity tests' 1e-4


@dataclass(frozen=True)
class EvalConfig:
    window: int = 512
    max_tokens: int | None = None  # score at most this many tokens (None: the whole validation stream)
    parity_windows: int = 2
    parity_len: int = 128
    time_limit_s: float | None = None  # stop scoring this long after the evaluation began; the result says how much it covered

    def __post_init__(self):
        if self.window < 2:
            raise ValueError(f"EvalConfig.window must be at least 2, got {self.window}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"EvalConfig.max_tokens must be at least 1, got {self.max_tokens}")


def windows(n_tokens: int, window: int, max_tokens: int | None = None) -> list[tuple[int, int]]:
    """(start, length) of each window: inputs stream[start : start+length] predict stream[start+1 : start+1+length]."""
    last = n_tokens - 1  # the final token is a target only
    if max_tokens is not None:
        last = min(last, max_tokens)
    return [(s, min(window, last - s)) for s in range(0, last, window)]


def _engine_logits(model, pool, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] fp32: prefill `ids` into a fresh slot and keep every row's logits."""
    slot = pool.admit()
    try:
        return model.prefill(pool, slot, ids, all_logits=True)
    finally:
        pool.release(slot)


def score(target_dir: Path, draft_dir: Path, stream: np.ndarray, byte_lengths: np.ndarray, cfg: EvalConfig,
          device: str, deadline: float | None = None) -> dict:
    """Bits per byte of both models and their greedy agreement over the windows of `stream`."""
    models = {"target": load_model(target_dir, device, torch.float32), "draft": load_model(draft_dir, device, torch.float32)}
    vocab = {name: m.config.vocab_size for name, m in models.items()}
    if vocab["target"] != vocab["draft"]:
        raise ValueError(f"target vocab_size {vocab['target']} != draft vocab_size {vocab['draft']}: they must share a tokenizer")
    if int(stream.max()) >= vocab["target"]:
        raise ValueError(f"validation token id {int(stream.max())} is outside the vocabulary {vocab['target']}")
    pools = {name: m.new_pool(1, cfg.window) for name, m in models.items()}
    nll = {name: 0.0 for name in models}  # nats, summed in float64
    correct = {name: 0 for name in models}
    agree = positions = n_bytes = 0
    spans = windows(len(stream), cfg.window, cfg.max_tokens)
    t0 = time.monotonic()
    done = 0
    for i, (start, length) in enumerate(spans):
        if deadline is not None and time.monotonic() > deadline:
            print(f"[evaluate] time limit reached after {i}/{len(spans)} windows", file=sys.stderr, flush=True)
            break
        ids = stream[start : start + length].astype(np.int64).tolist()
        targets_np = stream[start + 1 : start + 1 + length].astype(np.int64)
        targets = torch.from_numpy(targets_np).to(device)
        argmax = {}
        for name, model in models.items():
            logits = _engine_logits(model, pools[name], ids)  # [length, vocab] fp32
            picked = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])
            nll[name] -= float(picked.double().sum())
            argmax[name] = logits.argmax(dim=-1)
            correct[name] += int((argmax[name] == targets).sum())
        agree += int((argmax["target"] == argmax["draft"]).sum())
        positions += length
        n_bytes += int(byte_lengths[targets_np].sum())
        done = i + 1
        if (i + 1) % 50 == 0:
            print(f"[evaluate] {i + 1}/{len(spans)} windows, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    if positions == 0:
        raise ValueError(f"no validation position scored (stream of {len(stream)} tokens, time_limit_s {cfg.time_limit_s})")
    out = {"window": cfg.window, "windows": done, "windows_total": len(spans), "complete": positions == len(stream) - 1,
           "stream_tokens": int(len(stream)), "positions": positions, "bytes": n_bytes,
           "seconds": time.monotonic() - t0, "greedy_agreement": agree / positions}
    for name in models:
        out[name] = {"bits_per_byte": nll[name] / math.log(2) / n_bytes, "nats_per_token": nll[name] / positions,
                     "top1_accuracy": correct[name] / positions}
    return out


def parity(model_dir: Path, stream: np.ndarray, cfg: EvalConfig, device: str) -> dict:
    """Largest |engine - transformers| logit difference over a few windows, relative to the reference's
    largest |logit|, and the fraction of rows whose argmax agrees. Both fp32 on `device`."""
    ref_model = load_hf(model_dir).to(device)
    ours = load_model(model_dir, device, torch.float32)
    pool = ours.new_pool(1, cfg.parity_len)
    worst, argmax_equal, rows = 0.0, 0, 0
    step = max(1, (len(stream) - cfg.parity_len) // max(1, cfg.parity_windows))
    for w in range(cfg.parity_windows):
        ids = stream[w * step : w * step + cfg.parity_len].astype(np.int64)
        if len(ids) < 2:
            break
        with torch.no_grad():
            ref = ref_model(input_ids=torch.from_numpy(ids)[None].to(device), use_cache=False).logits[0].float().cpu()
        got = _engine_logits(ours, pool, ids.tolist()).cpu()
        worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
        argmax_equal += int((got.argmax(-1) == ref.argmax(-1)).sum())
        rows += len(ids)
    del ref_model
    return {"max_rel_diff": worst, "argmax_match": argmax_equal / max(1, rows), "rows": rows,
            "tolerance": PARITY_TOLERANCE, "ok": rows > 0 and worst <= PARITY_TOLERANCE}


def evaluate_pair(models_dir: Path, stream: np.ndarray, byte_lengths: np.ndarray, cfg: EvalConfig, device: str) -> dict:
    """Everything the card reports about the pair in `models_dir` (target/ and draft/)."""
    start = time.monotonic()
    deadline = None if cfg.time_limit_s is None else start + cfg.time_limit_s
    models_dir = Path(models_dir)
    target_dir, draft_dir = models_dir / "target", models_dir / "draft"
    checks = {}
    for name, path in (("target", target_dir), ("draft", draft_dir)):
        try:
            checks[name] = parity(path, stream, cfg, device)
        except Exception as err:  # a reference that cannot run is reported, not allowed to cost the figures below
            checks[name] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        print(f"[evaluate] parity {name}: {checks[name]}", file=sys.stderr, flush=True)
    print(f"[evaluate] scoring {len(stream):,} validation tokens with the engine on {device}", file=sys.stderr, flush=True)
    out = score(target_dir, draft_dir, stream, byte_lengths, cfg, device, deadline)
    out["parity"] = checks
    return out
