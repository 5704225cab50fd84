"""MODEL_CARD.md and loss_curves.png, written from training_metrics.json alone."""

from __future__ import annotations

import json
import math
from pathlib import Path

from drafter.bench_plots import save_png

from . import PROG

METRICS_FILE = "training_metrics.json"
CARD_FILE = "MODEL_CARD.md"
PLOT_FILE = "loss_curves.png"
GOAL_BPB = 1.5  # the target's validation bits per byte, at most
GOAL_AGREEMENT = 0.60  # the draft's greedy choice equals the target's, at least


def plot_curves(metrics: dict, out: Path) -> None:
    """Train (lines) and dev (dots) loss in bits per token against tokens seen, both models."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, color in (("target", "tab:blue"), ("draft", "tab:orange")):
        train = metrics["models"][name]["train"]
        to_bits = 1 / math.log(2)
        if train["train_curve"]:
            ax.plot([p["tokens"] / 1e6 for p in train["train_curve"]], [p["loss"] * to_bits for p in train["train_curve"]],
                    color=color, lw=1.2, label=f"{name} train")
        if train["dev_curve"]:
            ax.plot([p["tokens"] / 1e6 for p in train["dev_curve"]], [p["loss"] * to_bits for p in train["dev_curve"]],
                    "o", color=color, ms=3.5, label=f"{name} dev")
    ax.set_xlabel("training tokens seen (millions)")
    ax.set_ylabel("loss (bits per token)")
    ax.set_title("qwen3_5_text target and draft on the Python standard library")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_png(fig, out, dpi=110)


def _fmt_int(n: int) -> str:
    return f"{n:,}"


def _moved_note(recorded: str) -> str:
    """Where the pipeline lives, after the command a run recorded. A run made before the module
    moved (`python -m bench.train ...`) keeps its command as it was run; the note gives today's."""
    if recorded.startswith(PROG + " "):
        return " (`training/`)"
    args = recorded.split(" ", 3)[-1]  # `python -m <module then> <arguments>`
    return f" (the pipeline has since moved to `training/`: `{PROG} {args}` today)"


def _model_rows(metrics: dict) -> list[str]:
    rows = ["| | target | draft |", "|---|---|---|"]
    t, d = metrics["models"]["target"], metrics["models"]["draft"]

    def row(label, fn):
        rows.append(f"| {label} | {fn(t)} | {fn(d)} |")

    row("parameters (tied embedding counted once)", lambda m: _fmt_int(m["parameters"]))
    row("outside the embedding", lambda m: _fmt_int(m["non_embedding_parameters"]))
    row("layers", lambda m: " ".join("A" if k == "full_attention" else "G" for k in m["config"]["layer_types"]) + " (G: Gated DeltaNet, A: gated attention)")
    row("hidden / MLP", lambda m: f"{m['config']['hidden_size']} / {m['config']['intermediate_size']}")
    row("attention heads (kv) x dim", lambda m: f"{m['config']['num_attention_heads']} ({m['config']['num_key_value_heads']}) x {m['config']['head_dim']}")
    row("GDN key / value heads x dim", lambda m: f"{m['config']['linear_num_key_heads']} / {m['config']['linear_num_value_heads']} x {m['config']['linear_key_head_dim']}")
    row("checkpoint size", lambda m: f"{m['size_bytes'] / 2**20:.1f} MiB ({m['stored_dtype']})")
    row("training steps", lambda m: _fmt_int(m["train"]["steps"]))
    row("training tokens", lambda m: _fmt_int(m["train"]["tokens"]))
    row("training time", lambda m: f"{m['train']['seconds']:.0f} s")
    row("batch x sequence", lambda m: f"{m['hyper']['batch_size']} x {m['hyper']['seq_len']}")
    row("peak lr / dropout", lambda m: f"{m['hyper']['lr']:g} / {m['hyper']['dropout']:g}")
    row("kept step (best dev loss)", lambda m: f"{m['train']['best_step']} ({m['train']['best_dev_loss']:.4f} nats/token)"
        if m["train"]["best_dev_loss"] is not None else "last")
    return rows


def mtp_section(metrics: dict) -> list[str]:
    """The target's MTP head (training_metrics.json "mtp") and the drafters on held-out prompts
    ("acceptance"); nothing when the head was never trained."""
    mtp = metrics.get("mtp")
    if mtp is None:
        return []
    hyper, train = mtp["hyper"], mtp["train"]
    by_step = " / ".join(f"{a:.3f}" for a in train["best_dev_agreement"])
    lines = [
        "", "## The target's MTP head", "",
        "`target/` also carries a multi-token-prediction head in the published Qwen3.5 layout (`mtp.*` tensors beside the",
        "text model, `mtp_num_hidden_layers: 1`): fc over [normed embedding | normed hidden row], one gated-attention layer",
        "with a SwiGLU MLP, a final norm, and the target's own embedding and LM head. `verifier generate --draft mtp` and",
        "`verifier serve` (sessions with `server_drafter` \"mtp\") draft with it.",
        f"{_fmt_int(mtp['parameters'])} parameters ({mtp['parameters'] * 2 / 2**20:.1f} MiB in {mtp['stored_dtype']}).",
        "",
        f"Trained by `{mtp['command']}` with the target frozen: the loss is the cross-entropy of the head's distribution",
        "against the target's own softmax for the token after next (a distillation), averaged over "
        f"{hyper['steps']} draft steps unrolled",
        "as they run when drafting (each fed the previous step's output row; its attention sees the catch-up rows and the",
        "earlier drafts of the same proposal). The layer starts as a copy of the target's last attention layer.",
        f"{_fmt_int(train['steps'])} steps of {hyper['batch_size']} x {hyper['seq_len']} tokens in {train['seconds']:.0f} s on "
        f"{mtp['device_name']} ({mtp['date']}), peak lr {hyper['lr']:g}; kept step {train['best_step']} (dev loss "
        f"{train['best_dev_loss']:.4f} nats/token); dev agreement with the target's argmax by draft step: {by_step}.",
    ]
    acc = metrics.get("acceptance")
    if acc:
        lines += [
            "",
            f"Mean acceptance length (tokens per verify step, the bonus counted) on the {acc['prompt_count']} held-out prompts of",
            f"`{Path(acc['prompts']).name}` ({acc['max_new_tokens']} new tokens each, greedy, in process, {acc['device']}, "
            f"{acc['date']}; `{PROG} acceptance --models models` recomputes it), and the fraction of steps whose drafts were "
            "kept to each position:",
            "",
            "| drafter | K | mean acceptance length | kept to position 1, 2, ... | streams equal plain decoding |",
            "|---|---|---|---|---|",
        ]
        for r in acc["rows"]:
            name = "draft model (`draft/`)" if r["drafter"] == "model" else "MTP head"
            positions = " / ".join("-" if p is None else f"{p:.2f}" for p in r["per_position_acceptance"])
            lines.append(f"| {name} | {r['k']} | {r['mean_acceptance_length']:.2f} | {positions} | "
                         f"{'yes' if r['streams_match_plain'] else 'NO'} |")
    return lines


def write_card(models_dir: Path) -> Path:
    models_dir = Path(models_dir)
    with open(models_dir / METRICS_FILE) as f:
        metrics = json.load(f)
    plot_curves(metrics, models_dir / PLOT_FILE)
    data, tok, ev, run = metrics["data"], metrics["tokenizer"], metrics.get("evaluation"), metrics["run"]
    lines = [
        "# Default model pair: a hybrid target and its draft, trained on Python source",
        "",
        "Two `qwen3_5_text` checkpoints (Gated DeltaNet + gated attention, the family the verifier serves) in HF format:",
        "`target/` is the verifier's default model, `draft/` the default draft model. Same tokenizer. Trained from scratch by",
        f"`{run['command']}`{_moved_note(run['command'])}; `{PROG} evaluate --models {models_dir.name}` recomputes the figures below.",
        "",
        "## Data",
        "",
        (f"The `.py` files of the Python {data['python_version']} standard library (`{data['root']}`),"
         if data["source"] == "stdlib" else f"The `.py` files under `{data['root']}`,"),
        "skipping test directories (`test`, `tests`, `idlelib/idle_test`), site-packages and `pydoc_data` (one",
        "generated module of English documentation text). Each file goes to one split by the SHA-256 of its relative",
        "path: validation (never seen by the tokenizer or the weights), dev (used only to choose which checkpoint to",
        "keep) and train. Files are joined with `<|endoftext|>` between them.",
        "",
        "| split | files | bytes | tokens |",
        "|---|---|---|---|",
    ]
    for name in ("train", "dev", "validation"):
        lines.append(f"| {name} | {_fmt_int(data[name]['files'])} | {_fmt_int(data[name]['bytes'])} | {_fmt_int(data[name]['tokens'])} |")
    if data.get("undecodable_skipped"):
        lines += ["", f"Skipped as not UTF-8: {', '.join(data['undecodable_skipped'])}."]
    lines += [
        "",
        "## Tokenizer",
        "",
        f"Byte-level BPE (HF `tokenizers`), vocabulary {_fmt_int(tok['vocab_size'])}, trained on the train split only;",
        f"`<|endoftext|>` is id {tok['eot_id']} (the models' eos). {tok['train_bytes_per_token']:.2f} bytes per token on the train split.",
        "",
        "## Models and training",
        "",
        *_model_rows(metrics),
        "",
        f"AdamW (betas 0.9 / {metrics['models']['target']['hyper']['beta2']}, weight decay "
        f"{metrics['models']['target']['hyper']['weight_decay']} on matrices), linear warm-up then a cosine over the time budget,",
        "random windows of the train stream, residual dropout, bf16 autocast on CUDA. The weights kept are those with the",
        "lowest dev loss. The target trained first, then the draft.",
        "",
        f"Device: {run['device_name']}; torch {run['torch']}, transformers {run['transformers']}, Gated DeltaNet kernels: "
        f"{run['gdn_kernels']}. Date: {run['date']}. Whole run: {run['wall_s']:.0f} s of a {run['time_budget_s']:.0f} s budget, seed {run['seed']}.",
        f"Both checkpoints together: {run['pair_size_bytes'] / 2**20:.1f} MiB.",
        "",
        f"![loss curves]({PLOT_FILE})",
        "",
        "## Validation",
        "",
    ]
    if ev is None:
        lines.append(f"Not evaluated yet: run `{PROG} evaluate`.")
    else:
        t_bpb, agree = ev["target"]["bits_per_byte"], ev["greedy_agreement"]
        coverage = ("the whole validation stream" if ev["complete"] else
                    f"**only the first {_fmt_int(ev['positions'])} of its {_fmt_int(ev['stream_tokens'] - 1)} scorable tokens** "
                    "(a token cap or the time limit cut it)")
        lines += [
            f"Computed with the verifier's engine (fp32, {ev['device']}) over {coverage}:",
            f"the validation stream cut into windows of {ev['window']} tokens, {_fmt_int(ev['positions'])} scored tokens,",
            f"{_fmt_int(ev['bytes'])} bytes. Each window starts from a fresh state, so a token's context is the tokens before",
            f"it in its window (0 to {ev['window'] - 1}). Bits per byte: summed -log2 p(token) / the UTF-8 bytes of the scored",
            "tokens (`<|endoftext|>` separators are scored and count no bytes).",
            "",
            "| | target | draft | goal |",
            "|---|---|---|---|",
            f"| bits per byte | {t_bpb:.3f} | {ev['draft']['bits_per_byte']:.3f} | target <= {GOAL_BPB} ({'met' if t_bpb <= GOAL_BPB else 'NOT met'}) |",
            f"| next-token top-1 accuracy | {ev['target']['top1_accuracy']:.3f} | {ev['draft']['top1_accuracy']:.3f} | |",
            f"| greedy agreement (draft argmax = target argmax) | | {agree:.3f} | >= {GOAL_AGREEMENT} ({'met' if agree >= GOAL_AGREEMENT else 'NOT met'}) |",
            "",
        ]
        if not ev.get("validation_matches_training", True):
            lines += ["**These figures are on a different validation set than the training run's** (another Python version's",
                      "standard library): compare them with care.", ""]
        for name in ("target", "draft"):
            p = ev["parity"][name]
            if "error" in p:
                lines.append(f"- {name}: the transformers reference could not run: `{p['error']}`")
            else:
                lines.append(f"- {name}: engine vs transformers logits (fp32, {p['rows']} rows): largest difference "
                             f"{p['max_rel_diff']:.2e} of the largest logit (bound {p['tolerance']:g}), argmax equal on "
                             f"{p['argmax_match']:.1%} of rows: {'ok' if p['ok'] else 'FAILED'}")
    lines += mtp_section(metrics)
    if metrics.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {note}" for note in metrics["notes"]]
    lines.append("")
    path = models_dir / CARD_FILE
    path.write_text("\n".join(lines))
    return path
