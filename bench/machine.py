"""What machine a benchmark ran on, for its results file."""

from __future__ import annotations

import argparse
import json
import platform
import re
from pathlib import Path

import torch


def device_name(device: str = "cpu") -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + f" ({torch.get_num_threads()} threads)"
    except OSError:
        pass
    return platform.processor() or "cpu"


NAME_HELP = ("what differs from the default run (model, config, host or variant), appended to the file name: "
             "<bench>_<date>_<name>.json; letters, digits, '.', '_' and '-'")


def check_name(name: str) -> str:
    """name, or ValueError: a results file's suffix names what differs in letters, digits, '.', '_' and '-'."""
    if name and not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise ValueError(f"--name {name!r}: letters, digits, '.', '_' and '-' only")
    return name


def name_arg(text: str) -> str:
    """check_name as an argparse type: a bad --name is the parser's error (exit 2, the rule in its message)."""
    try:
        return check_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def results_path(out: Path, bench: str, date: str, name: str = "") -> Path:
    """out/<bench>_<date>[_<name>].json, the one naming rule of bench/results (bench.report reads it back)."""
    return Path(out) / f"{bench}_{date}{'_' + check_name(name) if name else ''}.json"


def write_results(out: Path, bench: str, result: dict, name: str = "") -> Path:
    """result (with its "date") as JSON at results_path(out, bench, its date, name), folders made -> the path."""
    path = results_path(out, bench, result["date"], name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
