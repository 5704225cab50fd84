"""Train the shipped target's MTP head: `python -m training mtp --models models`.

The target stays frozen; the head (training/mtp_head.py, the published Qwen3.5 layout) learns to
predict the target's own next-but-one distribution, which is what decides whether its drafts are
accepted: for each unrolled draft step s (mtp_head.py) the loss is the cross-entropy of the head's
distribution against the target's softmax at the same position (a distillation, over the target's
whole vocabulary), averaged over the steps. Windows of the training split, teacher-forced tokens;
bf16 autocast on CUDA. Time-budgeted like the pair's training (training/train.py: warm-up, cosine
over the budget, AdamW); the weights kept are those with the lowest dev loss. The head is then
written into the target checkpoint beside the text model (`mtp.*` tensors, `mtp_num_hidden_layers`
in config.json), where `verifier generate --draft mtp` and `serve --mtp` load it, and its
training record goes to training_metrics.json under "mtp".
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from .card import METRICS_FILE
from .data import DEV, TRAIN, load_corpus, stdlib_root
from .mtp_head import TrainableMTP
from .pipeline import device_name, say
from .tokenizer import encode_stream, load_trained_tokenizer
from .train import TrainResult, learning_rate


@dataclass(frozen=True)
class MTPTrainConfig:
    steps: int = 4  # unrolled draft steps (the K the head is trained for)
    seq_len: int = 512
    batch_size: int = 32
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    log_every: int = 25
    eval_every_s: float = 20.0
    dev_windows: int = 64
    max_steps: int | None = None

    def __post_init__(self):
        for name in ("steps", "seq_len", "batch_size", "log_every", "dev_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"MTPTrainConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.steps + 2 > self.seq_len:
            raise ValueError(f"MTPTrainConfig.steps {self.steps} needs seq_len of at least steps + 2, got {self.seq_len}")
        if self.lr <= 0:
            raise ValueError(f"MTPTrainConfig.lr must be positive, got {self.lr}")


@dataclass
class MTPTrainResult(TrainResult):
    best_dev_agreement: list[float] = field(default_factory=list)  # per draft step: head argmax == target argmax


def load_target(target_dir: Path, device: str):
    """The frozen transformers target, fp32, eval mode."""
    import transformers as tf

    model = tf.Qwen3_5ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def step_losses(head: TrainableMTP, target, tokens: torch.Tensor, steps: int, autocast: bool
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """tokens [B, T]: (mean loss over steps, per-step argmax agreement with the target [scalar each])."""
    T = tokens.shape[1]
    with torch.autocast(device_type=tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
        with torch.no_grad():
            hidden = target.model(input_ids=tokens, use_cache=False).last_hidden_state  # final-normed [B, T, H]
            teacher = target.lm_head(hidden).float()  # row r predicts token r + 1
        outputs = head.unrolled(target, tokens, hidden, steps)
    losses, agreement = [], []
    for s, out in enumerate(outputs):
        n = T - s - 2  # origins q with a target row q + s + 1 < T
        with torch.autocast(device_type=tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = target.lm_head(out[:, :n]).float()
        p = teacher[:, s + 1 : s + 1 + n]
        losses.append(-(p.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean())
        agreement.append((logits.argmax(-1) == p.argmax(-1)).float().mean())
    return torch.stack(losses).mean(), agreement


def _windows(stream: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    return stream[starts[:, None] + torch.arange(seq_len, device=stream.device)]


@torch.no_grad()
def dev_figures(head, target, dev: torch.Tensor, cfg: MTPTrainConfig, autocast: bool) -> tuple[float, list[float]] | None:
    """(mean loss, per-step agreement) over the first dev_windows windows of the dev stream."""
    n = min(cfg.dev_windows, len(dev) // cfg.seq_len)
    if n < 1:
        return None
    head.eval()
    total, agree, count = 0.0, np.zeros(cfg.steps), 0
    for chunk in (torch.arange(n, device=dev.device) * cfg.seq_len).split(cfg.batch_size):
        loss, agreement = step_losses(head, target, _windows(dev, chunk, cfg.seq_len), cfg.steps, autocast)
        total += float(loss) * len(chunk)
        agree += np.array([float(a) for a in agreement]) * len(chunk)
        count += len(chunk)
    head.train()
    return total / count, list(agree / count)


def train_head(target, train: np.ndarray, dev: np.ndarray, cfg: MTPTrainConfig, budget_s: float, device: str,
               seed: int) -> tuple[TrainableMTP, MTPTrainResult]:
    """A head trained for budget_s seconds (or cfg.max_steps), holding its best-dev weights."""
    if len(train) < cfg.seq_len + 1:
        raise ValueError(f"the training stream has {len(train)} tokens, fewer than seq_len {cfg.seq_len} + 1")
    torch.manual_seed(seed)
    autocast = device.startswith("cuda")
    head = TrainableMTP(target.config).to(device)
    head.init_from_target(target)
    head.train()
    train_t = torch.from_numpy(train.astype(np.int64)).to(device)
    dev_t = torch.from_numpy(dev.astype(np.int64)).to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    decay = [p for p in head.parameters() if p.ndim >= 2]
    keep = [p for p in head.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": keep, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95))
    result, best = MTPTrainResult(), None
    t0 = last_eval = time.monotonic()

    def evaluate(step: int) -> None:
        nonlocal best, last_eval
        figures = dev_figures(head, target, dev_t, cfg, autocast)
        last_eval = time.monotonic()
        if figures is None:
            return
        loss, agreement = figures
        result.dev_curve.append({"step": step, "seconds": last_eval - t0, "loss": loss, "agreement": agreement})
        if result.best_dev_loss is None or loss < result.best_dev_loss:
            result.best_dev_loss, result.best_step, result.best_dev_agreement = loss, step, agreement
            best = {k: v.detach().clone() for k, v in head.state_dict().items()}
        say(f"mtp: step {step} dev loss {loss:.4f}, agreement by draft step "
            + " / ".join(f"{a:.3f}" for a in agreement))

    step = 0
    while True:
        progress = (time.monotonic() - t0) / budget_s
        if cfg.max_steps is not None:
            progress = max(progress, step / cfg.max_steps)
        if progress >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step, progress)  # the pair's schedule (train.py)
        starts = torch.randint(0, len(train_t) - cfg.seq_len, (cfg.batch_size,), device=device, generator=gen)
        loss, _ = step_losses(head, target, _windows(train_t, starts, cfg.seq_len), cfg.steps, autocast)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        result.tokens += cfg.batch_size * cfg.seq_len
        if step % cfg.log_every == 0:  # the step's own loss: a sync only here
            now, value = time.monotonic() - t0, float(loss.detach())
            result.train_curve.append({"step": step, "seconds": now, "loss": value})
            say(f"mtp: step {step} loss {value:.4f} {result.tokens / now:,.0f} tok/s {now:.0f} s")
        if time.monotonic() - last_eval >= cfg.eval_every_s:
            evaluate(step)
    if not result.dev_curve or result.dev_curve[-1]["step"] != step:
        evaluate(step)
    result.steps, result.seconds = step, time.monotonic() - t0
    result.final_train_loss = result.train_curve[-1]["loss"] if result.train_curve else float("nan")
    if best is not None:
        head.load_state_dict(best)
    return head.eval(), result


def write_head(target_dir: Path, head: TrainableMTP) -> dict[str, torch.Tensor]:
    """In place: the checkpoint's model.safetensors gains (or replaces) the head's mtp.* tensors,
    stored in the dtype of the checkpoint's own final norm, and config.json records one MTP layer
    (Qwen3.5's mtp_num_hidden_layers). Returns the tensors written."""
    path = Path(target_dir) / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the MTP head is written into a single-file checkpoint")
    kept = {k: v for k, v in load_file(path).items() if not k.startswith("mtp.")}
    tensors = head.published_tensors(kept["model.norm.weight"].dtype)
    save_file({**kept, **tensors}, str(path), metadata={"format": "pt"})
    config_path = Path(target_dir) / "config.json"
    config = json.loads(config_path.read_text())
    config["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return tensors


def run_mtp(models_dir: Path, budget_s: float, device: str, cfg: MTPTrainConfig = MTPTrainConfig(),
            data_root: Path | None = None, seed: int = 0, command: str = "") -> dict:
    """Train the head of models_dir/target, write it into the checkpoint and record it in
    models_dir/training_metrics.json ("mtp"); returns that record."""
    models_dir = Path(models_dir)
    metrics_path = models_dir / METRICS_FILE
    metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
    recorded = metrics.get("data", {})
    if data_root is None:
        data_root = stdlib_root() if recorded.get("source", "stdlib") == "stdlib" else Path(recorded["root"])
    corpus = load_corpus(data_root, recorded.get("val_fraction", 0.05), recorded.get("dev_fraction", 0.03))
    if recorded and corpus.summary()[TRAIN]["sha256"] != recorded[TRAIN]["sha256"]:
        raise ValueError(f"the training split under {data_root} differs from the one the target trained on "
                         f"({recorded.get('root')}): pass the same corpus with --data-root")
    tok = load_trained_tokenizer(models_dir / "target")
    train, dev = (encode_stream(tok, corpus.texts(s)) for s in (TRAIN, DEV))
    target = load_target(models_dir / "target", device)
    say(f"mtp: training the head of {models_dir / 'target'} for {budget_s:.0f} s on {device} "
        f"({len(train):,} training tokens, {cfg.steps} unrolled draft steps)")
    head, result = train_head(target, train, dev, cfg, budget_s, device, seed)
    tensors = write_head(models_dir / "target", head)
    record = {"command": command, "date": datetime.date.today().isoformat(), "device": device,
              "device_name": device_name(device), "torch": torch.__version__, "seed": seed, "time_budget_s": budget_s,
              "parameters": sum(t.numel() for t in tensors.values()),
              "stored_dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch."),
              "hyper": asdict(cfg), "train": asdict(result)}
    metrics["mtp"] = record
    metrics_path.write_text(json.dumps(metrics, indent=1, default=str))
    say(f"mtp: {record['parameters']:,} parameters written into {models_dir / 'target'}; kept step {result.best_step}, "
        f"dev agreement by draft step " + " / ".join(f"{a:.3f}" for a in result.best_dev_agreement))
    return record
