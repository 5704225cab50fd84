"""The report of `python -m verifier check`: one dict (what --json writes) and the human summary
printed from it, so both always say the same."""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from collections import Counter
from dataclasses import asdict

import torch

from .checks import CheckSettings, run_checks
from .results import CheckResult, Counts, Difference


def environment(device: str, dtype: str) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    return {"device": device, "gpu": gpu, "dtype": dtype, "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version()}


def _number(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)  # JSON has no inf / nan


def _difference(diff: Difference | None) -> dict | None:
    return None if diff is None else {**asdict(diff), "max_abs_diff": _number(diff.max_abs_diff)}


def _counts(counts: Counts) -> dict:
    return {"checked": counts.checked, "equal": counts.equal}


def build_report(model_dir, model, settings: CheckSettings, env: dict, results: list[CheckResult], seconds: float,
                 tensor_parallel: int = 1) -> dict:
    """tensor_parallel: the ranks the model ran on, whose bits were compared. model.config may be
    one rank's (its heads divided); the layer kinds and counts the report names are the whole model's."""
    config = model.config
    first = next((r.first_difference for r in results if r.first_difference is not None), None)
    rows_checked = sum(r.rows.checked for r in results)
    rows_equal = sum(r.rows.equal for r in results)
    return {
        "passed": all(r.passed for r in results) and rows_checked > 0,
        "rows_checked": rows_checked,
        "rows_equal": rows_equal,
        "states_checked": sum(r.states.checked for r in results),
        "states_equal": sum(r.states.equal for r in results),
        "first_difference": _difference(first),
        "seconds": round(seconds, 3),
        "tensor_parallel": tensor_parallel,
        "model": {"dir": str(model_dir), "model_type": config.model_type, "layers": config.n_layers,
                  "mixers": dict(Counter(config.mixers)), "mlps": dict(Counter(config.mlps))},
        "environment": env,
        "settings": asdict(settings),
        "checks": [{
            "name": r.name,
            "title": r.title,
            "path": r.path,
            "passed": r.passed,
            "rows_checked": r.rows.checked,
            "rows_equal": r.rows.equal,
            "states_checked": r.states.checked,
            "states_equal": r.states.equal,
            "per_layer_kind": {kind: _counts(c) for kind, c in r.per_layer_kind.items()},
            "first_difference": _difference(r.first_difference),
            "seconds": round(r.seconds, 3),
            **({"batch_rows": r.batch_rows} if r.batch_rows else {}),
        } for r in results],
    }


def _kinds(counts: dict) -> str:
    return " + ".join(f"{n} {kind}" for kind, n in counts.items())


def summary(report: dict) -> str:
    model, env, s = report["model"], report["environment"], report["settings"]
    # one process says nothing (its line as it always was); N ranks say whose bits were compared
    ranks = report.get("tensor_parallel", 1)
    parallel = f", {ranks} tensor-parallel ranks" if ranks > 1 else ""
    lines = [
        f"verifier check: {model['dir']} ({model['model_type']}, {model['layers']} layers: "
        f"{_kinds(model['mixers'])} mixers, {_kinds(model['mlps'])} MLPs)",
        f"{env['device']}{' (' + env['gpu'] + ')' if env['gpu'] else ''}, {env['dtype']}{parallel}, torch {env['torch']}, "
        f"triton {env['triton'] or 'absent'}; K = 1..{s['max_k']}, prompts of {s['prompt_len']} tokens, "
        f"{s['new_tokens']} new tokens, {s['sequences']} sequences, seed {s['seed']}",
    ]
    for check in report["checks"]:
        states = f", {check['states_equal']}/{check['states_checked']} layer states" if check["states_checked"] else ""
        lines.append(f"  {'ok  ' if check['passed'] else 'FAIL'} {check['name']:<21} {check['rows_equal']}/{check['rows_checked']} rows"
                     f"{states} equal  [{check['path']}, {check['seconds']:.1f} s]  {check['title']}")
        if check.get("batch_rows"):
            rows = check["batch_rows"]
            lines.append(f"       {len(rows)} batched steps of {min(rows)}..{max(rows)} rows ({sum(rows)} rows in all)")
        if check["per_layer_kind"]:
            per_kind = ", ".join(f"{kind} {c['equal']}/{c['checked']}" for kind, c in check["per_layer_kind"].items())
            lines.append(f"       per layer kind: {per_kind}")
    totals = f"{report['rows_equal']}/{report['rows_checked']} rows and {report['states_equal']}/{report['states_checked']} layer states"
    if report["passed"]:
        lines.append(f"PASS: {totals} bitwise equal in {report['seconds']:.1f} s")
    else:
        first = report["first_difference"]
        where = (Difference(first["check"], first["where"], float(first["max_abs_diff"])).describe()
                 if first else "no rows were checked")
        lines.append(f"FAIL: {totals} equal in {report['seconds']:.1f} s; first difference in {where}")
    return "\n".join(lines)


RANK_FAILED = 3  # exit status when a tensor-parallel rank failed or died: neither a difference nor bad arguments


def fail(message: str) -> int:
    """A bad argument: one line on stderr -> exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def context_error(settings: CheckSettings, config) -> str | None:
    """Why the settings do not fit the model's context (None: they do)."""
    limit = config.max_position_embeddings
    if settings.max_seq_len <= limit:
        return None
    return (f"--prompt-len, --new-tokens, --max-k and --sequences need {settings.max_seq_len} positions, "
            f"past the model's context length {limit}")


def check_report(model, model_dir, settings: CheckSettings, device: str, dtype: str, tensor_parallel: int = 1,
                 show_progress: bool = True) -> dict:
    """Every check on `model` -> the report; progress on stderr (show_progress: one rank of N says it)."""
    start = time.perf_counter()

    def progress(message: str) -> None:
        if show_progress:
            print(f"[{time.perf_counter() - start:7.1f} s] {message}", file=sys.stderr, flush=True)

    results = run_checks(model, settings, progress)
    return build_report(model_dir, model, settings, environment(device, dtype), results, time.perf_counter() - start,
                        tensor_parallel)


def publish(args, report: dict) -> int:
    """The summary on stdout, the JSON where --json says -> the exit status (0 passed, 1 a difference)."""
    print(summary(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["passed"] else 1
