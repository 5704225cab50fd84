"""`python -m training run|evaluate|prompts|mtp|acceptance`: train the default pair, recompute its card's figures,
cut bench prompts, train the target's MTP head, or compare the target's drafters on held-out prompts."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import torch

from presets.training import PRESETS
from verifier.arguments import DefaultsHelpFormatter, at_least

from . import PROG
from .acceptance import DEFAULT_PROMPTS, measure, record_acceptance
from .evaluate import EvalConfig
from .mtp import MTPTrainConfig, run_mtp
from .pipeline import DRAFT_LR, EVAL_RESERVE_S, TARGET_SHARE, RunConfig, evaluate_models, run
from .prompts import write_prompts
from .train import TrainConfig


def build_parser() -> argparse.ArgumentParser:
    defaults = DefaultsHelpFormatter
    device = "cuda" if torch.cuda.is_available() else "cpu"
    positive = at_least(1)
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=defaults)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="data, tokenizer, target, draft, evaluation and card, within a time budget",
                         formatter_class=defaults)
    run.add_argument("--out", type=Path, required=True, help="output directory (target/, draft/, card, metrics, plot)")
    run.add_argument("--time-budget-s", type=float, default=480.0, help="wall-clock budget of the whole run")
    run.add_argument("--device", default=device, help="where to train and evaluate")
    run.add_argument("--seed", type=int, default=0, help="seed of the target's init and batches; the draft's is seed + 1")
    run.add_argument("--preset", default="default", choices=sorted(PRESETS), help="model shapes (tiny: tests)")
    run.add_argument("--vocab-size", type=positive, default=8192, help="BPE vocabulary asked of the tokenizer trainer")
    run.add_argument("--data-root", type=Path, default=None, help="directory of .py files (default: the standard library)")
    run.add_argument("--val-fraction", type=float, default=0.05, help="fraction of files in the validation split")
    run.add_argument("--dev-fraction", type=float, default=0.03, help="fraction of files in the dev split")
    run.add_argument("--seq-len", type=positive, default=TrainConfig.seq_len, help="tokens per training window")
    run.add_argument("--batch-size", type=positive, default=TrainConfig.batch_size, help="windows per step")
    run.add_argument("--target-lr", type=float, default=TrainConfig.lr, help="the target's peak learning rate")
    run.add_argument("--draft-lr", type=float, default=DRAFT_LR, help="the draft's peak learning rate")
    run.add_argument("--dropout", type=float, default=TrainConfig.dropout, help="residual dropout while training")
    run.add_argument("--warmup-steps", type=int, default=TrainConfig.warmup_steps, help="steps of linear learning-rate warm-up")
    run.add_argument("--max-steps", type=positive, default=None, help="stop each model after this many steps (default: the time budget alone)")
    run.add_argument("--log-every", type=positive, default=TrainConfig.log_every, help="steps between loss lines")
    run.add_argument("--eval-every-s", type=float, default=TrainConfig.eval_every_s, help="seconds between dev losses")
    run.add_argument("--dev-windows", type=positive, default=TrainConfig.dev_windows, help="seq-len windows per dev loss")
    run.add_argument("--eval-reserve-s", type=float, default=EVAL_RESERVE_S, help="budget kept for saving, evaluation and the card")
    run.add_argument("--target-share", type=float, default=TARGET_SHARE, help="fraction of the training time the target gets")
    run.add_argument("--stored-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="dtype of the saved weights")
    run.add_argument("--overwrite", action="store_true", help="replace the checkpoints in a non-empty --out")
    run.add_argument("--eval-window", type=positive, default=EvalConfig.window, help="tokens per evaluation window")
    run.add_argument("--eval-max-tokens", type=positive, default=None, help="score at most this many validation tokens (default: all of them)")

    ev = sub.add_parser("evaluate", help="recompute validation bits per byte, agreement and parity; rewrite the card",
                        formatter_class=defaults)
    ev.add_argument("--models", type=Path, required=True, help="directory a run wrote (target/, draft/, training_metrics.json)")
    ev.add_argument("--device", default=device, help="where the engine and the transformers reference run")
    ev.add_argument("--data-root", type=Path, default=None, help="corpus directory (default: the one the run used)")
    ev.add_argument("--force", action="store_true", help="rewrite the metrics and card even if the validation split differs")
    ev.add_argument("--eval-window", type=positive, default=None, help="tokens per window (default: the run's)")
    ev.add_argument("--eval-max-tokens", type=positive, default=None, help="score at most this many validation tokens (default: all of them)")

    pr = sub.add_parser("prompts", help="held-out prompts for the acceptance bench, cut from the validation split",
                        formatter_class=defaults)
    pr.add_argument("--out", type=Path, required=True, help="the .jsonl file to write")
    pr.add_argument("--count", type=positive, default=16, help="prompts to write, at most")
    pr.add_argument("--data-root", type=Path, default=None, help="directory of .py files (default: the standard library)")

    mtp = sub.add_parser("mtp", help="train the target's MTP head (the target frozen) and write it into its checkpoint",
                         formatter_class=defaults)
    mtp.add_argument("--models", type=Path, required=True, help="directory a run wrote (target/, training_metrics.json)")
    mtp.add_argument("--time-budget-s", type=float, default=180.0, help="training time")
    mtp.add_argument("--device", default=device, help="where to train")
    mtp.add_argument("--data-root", type=Path, default=None, help="corpus directory (default: the one the target trained on)")
    mtp.add_argument("--seed", type=int, default=0, help="seed of the head's init and batches")
    mtp.add_argument("--draft-steps", type=positive, default=MTPTrainConfig.steps, help="unrolled draft steps trained")
    mtp.add_argument("--batch-size", type=positive, default=MTPTrainConfig.batch_size, help="windows per step")
    mtp.add_argument("--lr", type=float, default=MTPTrainConfig.lr, help="peak learning rate")
    mtp.add_argument("--max-steps", type=positive, default=None, help="stop after this many steps (default: the budget alone)")

    acc = sub.add_parser("acceptance", help="mean acceptance length of the draft model and the MTP head on held-out prompts",
                         formatter_class=defaults)
    acc.add_argument("--models", type=Path, required=True, help="directory with target/ (its MTP head) and draft/")
    acc.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL of held-out prompts ({\"text\": ...})")
    acc.add_argument("--k", type=lambda s: tuple(int(x) for x in s.split(",")), default=(1, 2, 4), help="comma-separated K values")
    acc.add_argument("--max-new-tokens", type=positive, default=128, help="tokens generated per prompt")
    acc.add_argument("--device", default="cpu", help="where the engine runs")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    if args.command == "mtp":
        cfg = MTPTrainConfig(steps=args.draft_steps, batch_size=args.batch_size, lr=args.lr, max_steps=args.max_steps)
        try:
            run_mtp(args.models, args.time_budget_s, args.device, cfg, args.data_root, args.seed,
                    command=f"{PROG} " + shlex.join(sys.argv[1:] if argv is None else argv))
        except (FileNotFoundError, ValueError) as err:
            print(f"{PROG}: {err}", file=sys.stderr)
            return 2
        return 0
    if args.command == "acceptance":
        try:
            figures = measure(args.models, args.prompts, args.k, args.max_new_tokens, args.device)
        except (FileNotFoundError, ValueError) as err:
            print(f"{PROG}: {err}", file=sys.stderr)
            return 2
        record_acceptance(args.models, figures)
        bad = [f"{r['drafter']} K={r['k']}" for r in figures["rows"] if not r["streams_match_plain"]]
        if bad:
            print(f"{PROG}: streams differ from plain decoding: {', '.join(bad)}", file=sys.stderr)
            return 1
        return 0
    if args.command == "prompts":
        n = write_prompts(args.out, args.count, args.data_root)
        print(f"wrote {n} prompts to {args.out}", file=sys.stderr)
        return 0
    try:
        if args.command == "evaluate":
            metrics = evaluate_models(args.models, args.device, args.eval_window, args.eval_max_tokens, args.data_root, args.force)
            print(json.dumps({k: metrics["evaluation"][k] for k in ("target", "draft", "greedy_agreement", "positions", "complete")}))
        else:
            eval_cfg = EvalConfig(window=args.eval_window, max_tokens=args.eval_max_tokens)
            base = TrainConfig(seq_len=args.seq_len, batch_size=args.batch_size, dropout=args.dropout, warmup_steps=args.warmup_steps,
                               max_steps=args.max_steps, log_every=args.log_every, eval_every_s=args.eval_every_s,
                               dev_windows=args.dev_windows)
            cfg = RunConfig(
                out=args.out, time_budget_s=args.time_budget_s, device=args.device, seed=args.seed, preset=args.preset,
                vocab_size=args.vocab_size, data_root=args.data_root, val_fraction=args.val_fraction, dev_fraction=args.dev_fraction,
                target_train=replace(base, lr=args.target_lr), draft_train=replace(base, lr=args.draft_lr), evaluation=eval_cfg,
                eval_reserve_s=args.eval_reserve_s, target_share=args.target_share, stored_dtype=args.stored_dtype,
                overwrite=args.overwrite, command=f"{PROG} " + shlex.join(sys.argv[1:] if argv is None else argv),
            )
            metrics = run(cfg)
    except (FileNotFoundError, FileExistsError) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    failed = [name for name, p in metrics["evaluation"]["parity"].items() if not p["ok"]]
    if failed:
        print(f"{PROG}: engine/transformers parity FAILED for {', '.join(failed)} (see the card)", file=sys.stderr)
        return 1
    return 0
