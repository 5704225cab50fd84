"""The test suite's GPU run, recorded: pytest on this machine's CUDA device, its outcome as a results file.

    PYTHONPATH=. python -m bench.gpu_tests --out DIR [--name WHAT_DIFFERS] -- [pytest arguments]

Runs `python -m pytest -q -p no:cacheprovider <pytest arguments>` (default: DEFAULT_TESTS, the kernel
tests, the bit-exactness suite and the step's GPU paths on the CUDA model device) and writes
DIR/gpu_tests_<date>[_<name>].json: device, date, versions, the arguments, pytest's exit status,
its counts (passed, failed, skipped, errors), every failed test and its last lines. Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.machine import NAME_HELP, check_name, device_name, results_path

# the kernels, the contract (bit-exactness suite, real widths, FP8) and the step's GPU paths (graphs,
# fused rollback, padded buckets, the draft chain's graph, verifier check), on the CUDA model device
DEFAULT_TESTS = ["tests/kernel_tests", "tests/test_real_width.py", "tests/bitexact", "tests/test_fp8_checkpoints.py",
                 "tests/test_graphs.py", "tests/test_rollback_plan.py", "tests/test_padded_steps.py", "tests/test_engine.py",
                 "tests/test_step_host_path.py", "tests/drafter/test_draft_chain.py", "tests/test_check.py", "--model-device", "cuda"]
TAIL_LINES = 15
SUMMARY = re.compile(r"\d+ (passed|failed|errors?)\b.* in [\d.]+s")  # pytest's last line, before any warnings after it


def counts(summary: str) -> dict[str, int]:
    """pytest's last line ("3 failed, 250 passed, 2 skipped in 61.2s") -> {"failed": 3, "passed": 250, ...}."""
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", summary)}


def failed_tests(lines: list[str]) -> list[str]:
    """Every test pytest's short summary names as failed or in error (its "FAILED id - why" lines,
    which -ra, the project's default, prints), in its order: all of them, where the tail keeps a few."""
    return [line for line in lines if line.startswith(("FAILED ", "ERROR "))]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, pytest_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder of the results JSON")
    parser.add_argument("--name", default="", help=NAME_HELP)
    parser.add_argument("--log", type=Path, default=None, help="also write pytest's whole output to this file (tracebacks)")
    args = parser.parse_args(ours)
    try:
        check_name(args.name)
    except ValueError as exc:
        parser.error(str(exc))
    if not torch.cuda.is_available():
        parser.error("no CUDA device: the GPU tests would only skip")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(pytest_args or DEFAULT_TESTS)]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    lines = proc.stdout.rstrip().splitlines()
    if args.log is not None:
        args.log.parent.mkdir(parents=True, exist_ok=True)
        args.log.write_text(proc.stdout + proc.stderr)
    failures = failed_tests(lines)
    print("\n".join(failures + lines[-TAIL_LINES:]))
    import triton

    today = datetime.date.today().isoformat()
    result = {"device": device_name("cuda"), "date": today, "torch": torch.__version__, "triton": triton.__version__,
              "pytest_args": pytest_args or DEFAULT_TESTS, "exit_status": proc.returncode,
              "counts": counts(next((line for line in reversed(lines) if SUMMARY.search(line)), "")), "seconds": round(time.perf_counter() - start, 1),
              "failures": failures, "tail": lines[-TAIL_LINES:]}
    args.out.mkdir(parents=True, exist_ok=True)
    path = results_path(args.out, "gpu_tests", today, args.name)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
