"""The training loop: plain PyTorch AdamW over random windows of the training token stream.

The run has a wall-clock budget rather than a step count, so the learning-rate schedule is a
function of the budget's elapsed fraction: linear warm-up over the first steps, then a cosine to
`min_lr_ratio` of the peak at the budget's end (or at `max_steps`, whichever comes first).
The stdlib is small (a few million tokens), so a run sees it many times over: residual dropout
regularises, and the weights kept are those of the best loss on the dev split (files the
weights never train on, disjoint from validation), measured every `eval_every_s` seconds.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 512
    batch_size: int = 64  # windows per step
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta2: float = 0.95
    grad_clip: float = 1.0
    dropout: float = 0.1  # on the embedding and on every mixer / MLP output added to the residual
    log_every: int = 25  # steps between loss lines (each one syncs the device)
    eval_every_s: float = 20.0
    dev_windows: int = 128  # dev loss over at most this many seq_len windows from the dev stream's start
    max_steps: int | None = None

    def __post_init__(self):
        for name in ("seq_len", "batch_size", "log_every", "dev_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainConfig.lr must be positive and min_lr_ratio in [0, 1], got {self.lr}, {self.min_lr_ratio}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"TrainConfig.dropout must be in [0, 1), got {self.dropout}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"TrainConfig.max_steps must be at least 1, got {self.max_steps}")


@dataclass
class TrainResult:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    final_train_loss: float = float("nan")
    best_dev_loss: float | None = None  # nats per token; None without a dev split
    best_step: int | None = None
    train_curve: list[dict] = field(default_factory=list)  # {step, tokens, seconds, loss}: mean loss since the last point
    dev_curve: list[dict] = field(default_factory=list)  # {step, tokens, seconds, loss}

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def learning_rate(cfg: TrainConfig, step: int, progress: float) -> float:
    """Peak lr after a linear warm-up, then a cosine in `progress` (0..1) down to min_lr_ratio (cfg:
    any config with lr, warmup_steps and min_lr_ratio: the MTP head's trainer uses it too)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def add_residual_dropout(model, p: float) -> list:
    """Dropout on what each block adds to the residual stream, and on the embedding, while training.
    Forward hooks leave the module tree (and so the saved checkpoint) exactly transformers' own."""
    if p == 0:
        return []

    def hook(module, args, output):
        if not module.training:
            return None
        if isinstance(output, tuple):  # attention returns (output, weights)
            return (F.dropout(output[0], p, True),) + tuple(output[1:])
        return F.dropout(output, p, True)

    handles = [model.get_input_embeddings().register_forward_hook(hook)]
    for layer in model.model.layers:
        for name in ("linear_attn", "self_attn", "mlp"):
            if hasattr(layer, name):
                handles.append(getattr(layer, name).register_forward_hook(hook))
    return handles


def _param_groups(model, weight_decay: float) -> list[dict]:
    """Decay matrices only: norm weights, gate biases and decay rates (1-D) keep their scale."""
    decay, keep = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else keep).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


def _windows(stream: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets [batch, seq_len] of the windows starting at `starts`."""
    idx = starts[:, None] + torch.arange(seq_len + 1, device=stream.device)
    chunk = stream[idx]
    return chunk[:, :-1], chunk[:, 1:]


def _loss(model, x: torch.Tensor, y: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def dev_loss(model, dev: torch.Tensor, cfg: TrainConfig, autocast: bool) -> float | None:
    """Mean next-token loss (nats) over the first dev_windows non-overlapping windows of `dev`."""
    n = min(cfg.dev_windows, (len(dev) - 1) // cfg.seq_len)
    if n < 1:
        return None
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    starts = torch.arange(n, device=dev.device) * cfg.seq_len
    for chunk in starts.split(max(1, cfg.batch_size)):
        x, y = _windows(dev, chunk, cfg.seq_len)
        total += float(_loss(model, x, y, autocast)) * y.numel()
        count += y.numel()
    model.train(was_training)
    return total / count


def train_model(model, train: np.ndarray, dev: np.ndarray, cfg: TrainConfig, budget_s: float, device: str,
                seed: int, name: str) -> TrainResult:
    """Train `model` in place for `budget_s` seconds (or cfg.max_steps); it ends holding the best-dev weights."""
    if len(train) < cfg.seq_len + 2:
        raise ValueError(f"the training stream has {len(train)} tokens, fewer than seq_len {cfg.seq_len} + 2")
    if budget_s <= 0:
        raise ValueError(f"{name}: no training time left (budget {budget_s:.1f} s)")
    autocast = device.startswith("cuda")
    model.to(device).train()
    train_t = torch.from_numpy(train.astype(np.int64)).to(device)
    dev_t = torch.from_numpy(dev.astype(np.int64)).to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, cfg.beta2),
                            **({"fused": True} if autocast else {}))
    hooks = add_residual_dropout(model, cfg.dropout)
    result = TrainResult()
    best_state = None
    running = torch.zeros((), device=device)
    since_log = 0
    t0 = time.monotonic()
    last_eval = t0

    def evaluate_dev(step: int):
        nonlocal best_state, last_eval
        loss = dev_loss(model, dev_t, cfg, autocast)
        last_eval = time.monotonic()
        if loss is None:
            return
        result.dev_curve.append({"step": step, "tokens": result.tokens, "seconds": last_eval - t0, "loss": loss})
        if result.best_dev_loss is None or loss < result.best_dev_loss:
            result.best_dev_loss, result.best_step = loss, step
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        print(f"[{name}] step {step} dev loss {loss:.4f} (best {result.best_dev_loss:.4f} at step {result.best_step})", flush=True)

    try:
        step = 0
        while True:
            elapsed = time.monotonic() - t0
            progress = elapsed / budget_s
            if cfg.max_steps is not None:
                progress = max(progress, step / cfg.max_steps)
            if progress >= 1.0:
                break
            lr = learning_rate(cfg, step, progress)
            for group in opt.param_groups:
                group["lr"] = lr
            starts = torch.randint(0, len(train_t) - cfg.seq_len, (cfg.batch_size,), device=device, generator=gen)
            x, y = _windows(train_t, starts, cfg.seq_len)
            loss = _loss(model, x, y, autocast)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            result.tokens += y.numel()
            running += loss.detach()
            since_log += 1
            if step % cfg.log_every == 0:
                mean = float(running) / since_log
                now = time.monotonic() - t0
                result.train_curve.append({"step": step, "tokens": result.tokens, "seconds": now, "loss": mean})
                print(f"[{name}] step {step} loss {mean:.4f} lr {lr:.2e} {result.tokens / now:,.0f} tok/s {now:.0f}s", flush=True)
                running.zero_()
                since_log = 0
            if time.monotonic() - last_eval >= cfg.eval_every_s:
                evaluate_dev(step)
        if since_log:
            now = time.monotonic() - t0
            result.train_curve.append({"step": step, "tokens": result.tokens, "seconds": now, "loss": float(running) / since_log})
        if not result.dev_curve or result.dev_curve[-1]["step"] != step:
            evaluate_dev(step)
    finally:
        for h in hooks:
            h.remove()
    result.steps = step
    result.seconds = time.monotonic() - t0
    result.final_train_loss = result.train_curve[-1]["loss"] if result.train_curve else float("nan")
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    print(f"[{name}] done: {step} steps, {result.tokens:,} tokens in {result.seconds:.0f} s; kept step {result.best_step}",
          file=sys.stderr, flush=True)
    return result
