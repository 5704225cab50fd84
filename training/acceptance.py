"""The default target's drafters side by side on held-out prompts: the shipped draft model and the
target's own MTP head, greedy, in process, at each K.

    python -m training acceptance --models models [--prompts bench/prompts/stdlib_validation.jsonl]

Each prompt generates --max-new-tokens tokens plainly, then once per (drafter, K); every
speculative stream must equal the plain one (the contract: a mismatch fails the run). The figure
is the mean acceptance length (verifier/generation.py: tokens emitted per step that carried
drafts, the bonus counted) over all prompts' steps together, and per drafted position the
fraction of steps whose drafts were accepted that far: the acceptance bench's own counts and
figures (drafter/bench_stats.py). Written into training_metrics.json
("acceptance") and the model card.
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import torch

from drafter.bench_stats import Counts, count, figures
from verifier.engine import Engine
from verifier.generate import generate
from verifier.model import load_model
from verifier.model.mtp import load_mtp_head
from verifier.proposers import COUPLED, ModelProposer, MTPProposer, load_draft_model
from verifier.tokenizer import TextTokenizer

from .card import METRICS_FILE
from .pipeline import device_name, say

MODEL, MTP = "model", "mtp"
DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "bench" / "prompts" / "stdlib_validation.jsonl"


def read_prompts(path: Path, tokenizer: TextTokenizer) -> list[list[int]]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return [tokenizer.encode(row["text"]) for row in rows]


def _proposers(models_dir: Path, engine: Engine, device: str) -> dict:
    """drafter name -> a factory of a fresh proposer (each prompt starts one)."""
    head = load_mtp_head(models_dir / "target", engine.model)
    if head is None:
        raise ValueError(f"{models_dir / 'target'} has no MTP head: train one with `python -m training mtp` first")
    draft = load_draft_model(models_dir / "draft", device)
    return {MODEL: lambda: ModelProposer(draft, engine.vocab_size, engine.pool.max_seq_len, mode=COUPLED),
            MTP: lambda: MTPProposer(head, engine.pool.max_seq_len)}


def measure(models_dir: Path, prompts_file: Path, ks: tuple[int, ...], max_new_tokens: int, device: str) -> dict:
    models_dir = Path(models_dir)
    tokenizer = TextTokenizer.from_model_dir(models_dir / "target")
    if tokenizer is None:
        raise FileNotFoundError(f"{models_dir / 'target'}/tokenizer.json: the prompts are text")
    prompts = read_prompts(prompts_file, tokenizer)
    model = load_model(models_dir / "target", device, torch.float32 if device == "cpu" else torch.bfloat16)
    engine = Engine(model, n_slots=1, max_seq_len=max(map(len, prompts)) + max_new_tokens + max(ks), max_k=max(ks))
    plain = [generate(engine, p, max_new_tokens).tokens for p in prompts]
    rows = []
    for name, make in _proposers(models_dir, engine, device).items():
        for k in ks:
            counts, mismatched, t0 = Counts(), [], time.perf_counter()
            for i, prompt in enumerate(prompts):
                result = generate(engine, prompt, max_new_tokens, proposer=make(), k=k)
                if result.tokens != plain[i]:
                    mismatched.append(i)
                counts += count(result.accepted_per_step, result.drafted_per_step, len(result.tokens) - 1, k)
            pooled = figures(counts)  # the acceptance bench's figures (drafter/bench_stats.py)
            row = {"drafter": name, "k": k, "mean_acceptance_length": pooled.mean_acceptance_length,
                   "per_position_acceptance": pooled.per_position_acceptance, "steps": counts.steps,
                   "seconds": time.perf_counter() - t0, "streams_match_plain": not mismatched, "mismatched_prompts": mismatched}
            say(f"acceptance: {name} K={k}: mean acceptance length {row['mean_acceptance_length']:.2f}")
            rows.append(row)
    return {"date": datetime.date.today().isoformat(), "device": device_name(device), "prompts": str(prompts_file),
            "prompt_count": len(prompts), "max_new_tokens": max_new_tokens, "sampling": "greedy", "rows": rows}


def record_acceptance(models_dir: Path, acceptance: dict) -> None:
    """Into training_metrics.json ("acceptance"), then the card is rewritten."""
    from .card import write_card

    path = Path(models_dir) / METRICS_FILE
    metrics = json.loads(path.read_text())
    metrics["acceptance"] = acceptance
    path.write_text(json.dumps(metrics, indent=1, default=str))
    write_card(Path(models_dir))
