"""The bench's PNG plots, drawn from the results.json object alone (so they can be redrawn from a
saved file): acceptance by draft position, and mean acceptance length and speedup by K, each beside
the i.i.d. expectation (1 - alpha^(K+1)) / (1 - alpha); an adaptive-K row, having no single K, is a
level line across the K axis.

alpha is one number per drafter, the per-token acceptance probability pooled over its fixed-K rows
(bench_stats.token_acceptance_probability explains why not the acceptance rate). On the speedup plot
the same expectation is the ceiling a verify step would allow if it cost no more than a decode step.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server

import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)

from .bench_stats import iid_acceptance_length  # noqa: E402

PNG_COLORS = 64
POSITION_PNG, LENGTH_PNG, SPEEDUP_PNG = "acceptance_by_position.png", "acceptance_length_by_k.png", "speedup_by_k.png"


def save_png(fig, path: str | Path, dpi: int) -> None:
    """Write fig as a PNG of at most PNG_COLORS colours, then close it: line plots need no more, and
    the file is several times smaller than matplotlib's full-colour one (the plots are committed
    beside their results)."""
    from io import BytesIO

    from PIL import Image

    buffer = BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(colors=PNG_COLORS, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def write_plots(out_dir: str | Path, data: dict) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    curves = _fixed_k_curves(data["rows"])
    adaptive = {row["drafter"]: row for row in data["rows"] if row["k"] == "adaptive"}
    title = f"{data['model_id']}, {data['prompts']['count']} prompts, {data['max_new_tokens']} new tokens"
    paths = [out / POSITION_PNG, out / LENGTH_PNG, out / SPEEDUP_PNG]
    _by_position(curves, title, paths[0])
    _by_k(curves, adaptive, "mean_acceptance_length", "mean acceptance length (tokens per drafted step)", title, paths[1],
          iid_label="i.i.d.")
    _by_k(curves, adaptive, "speedup_vs_plain", "speedup over plain decoding (tokens/s ratio)", title, paths[2],
          iid_label="i.i.d. ceiling (free verify)", baseline=1.0)
    return paths


def _fixed_k_curves(rows: list[dict]) -> dict[str, list[dict]]:
    """drafter -> its fixed-K rows in order of K (adaptive and plain rows have no place on a K axis)."""
    curves: dict[str, list[dict]] = {}
    for row in rows:
        if isinstance(row["k"], int) and row["k"] > 0:
            curves.setdefault(row["drafter"], []).append(row)
    return {d: sorted(rs, key=lambda r: r["k"]) for d, rs in curves.items()}


def pooled_alpha(rows: list[dict]) -> float | None:
    """Per-token acceptance probability over a drafter's rows: accepted / judged draft tokens, where
    judged = accepted + one per drafted step that refused a draft."""
    accepted = sum(r["accepted_tokens"] for r in rows)
    judged = accepted + sum(r["rejected_steps"] for r in rows)
    return accepted / judged if judged else None


def _by_position(curves: dict[str, list[dict]], title: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for drafter, rows in curves.items():
        row = rows[-1]  # the largest K: the most positions
        points = [(i + 1, rate) for i, rate in enumerate(row["per_position_acceptance"]) if rate is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=f"{drafter} (K={row['k']})")
    ax.set(xlabel="draft position", ylabel="acceptance (of drafts reaching the position)", ylim=(-0.02, 1.02), title=title)
    _finish(fig, ax, path)


def _by_k(curves: dict[str, list[dict]], adaptive: dict[str, dict], field: str, ylabel: str, title: str, path: Path,
          iid_label: str, baseline: float | None = None) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for drafter, rows in curves.items():
        points = [(r["k"], r[field]) for r in rows if r[field] is not None]
        if not points:
            continue
        (line,) = ax.plot(*zip(*points), marker="o", label=f"{drafter} measured")
        alpha = pooled_alpha(rows)
        if alpha is not None:
            ks = list(range(1, rows[-1]["k"] + 1))
            ax.plot(ks, [iid_acceptance_length(alpha, k) for k in ks], linestyle="--", color=line.get_color(),
                    label=f"{drafter} {iid_label}, alpha={alpha:.2f}")
        if drafter in adaptive and adaptive[drafter][field] is not None:  # no single K: a level across the axis
            ax.axhline(adaptive[drafter][field], linestyle="-.", linewidth=1.0, color=line.get_color(),
                       label=f"{drafter} adaptive K")
    if baseline is not None:
        ax.axhline(baseline, color="grey", linewidth=0.8, linestyle=":", label="plain decoding")
    ax.set(xlabel="K (drafts per step)", ylabel=ylabel, title=title)
    _finish(fig, ax, path)


def _finish(fig, ax, path: Path) -> None:
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    save_png(fig, path, dpi=110)
