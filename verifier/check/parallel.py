"""`python -m verifier check --tensor-parallel N`: the whole check on N ranks (SPMD).
The design in full: DESIGN.md section 10, "The check on N ranks".
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ..dtypes import DTYPES
from ..model import load_config, load_model
from ..model.parallel import ParallelError, TensorParallel, local_config, run_parallel
from .checks import CheckSettings
from .report import RANK_FAILED, check_report, context_error, fail, publish


class CheckpointUnreadable(Exception):
    """A rank could not load its part of the checkpoint: what a one-process run reports as a bad
    --model (exit status 2), told apart from a failure later in the check (exit status 3)."""


def check_tensor_parallel(args, settings: CheckSettings, model_dir: Path) -> int:
    """The check command over args.tensor_parallel ranks (the other arguments checked by the caller)."""
    size = args.tensor_parallel
    if args.device == "cuda" and torch.cuda.device_count() < size:
        return fail(f"--tensor-parallel {size} with --device cuda needs {size} GPUs; torch sees {torch.cuda.device_count()}")
    try:
        config = load_config(model_dir)
    except (ValueError, OSError) as exc:
        return fail(f"--model {model_dir}: {exc}")
    try:
        local_config(config, size)  # names the field that does not divide, before any rank reads a weight
    except ValueError as exc:
        return fail(f"--tensor-parallel {size}: {exc}")
    error = context_error(settings, config)
    if error:
        return fail(error)
    backend = "nccl" if args.device == "cuda" else "gloo"
    try:
        report = run_parallel(_check_on_rank, size, model_dir, args.device, args.dtype, settings, backend=backend)
    except ParallelError as err:
        return _rank_failed(err, model_dir, size)
    return publish(args, report)


def _rank_failed(err: ParallelError, model_dir: Path, size: int) -> int:
    if isinstance(err.original, CheckpointUnreadable):
        return fail(f"--model {model_dir}: {err.original} (rank {err.rank} of {size})")
    if err.detail:
        print(err.detail, file=sys.stderr)
    print(f"error: --tensor-parallel {size}: {err}", file=sys.stderr)
    return RANK_FAILED


def _check_on_rank(parallel: TensorParallel, model_dir: Path, device: str, dtype: str, settings: CheckSettings) -> dict:
    """One rank's check -> the report (every rank builds it; run_parallel hands back rank 0's)."""
    try:
        model = load_model(model_dir, device, DTYPES[dtype], parallel=parallel)
    except (ValueError, OSError) as exc:
        raise CheckpointUnreadable(str(exc)) from exc
    return check_report(model, model_dir, settings, device, dtype, tensor_parallel=parallel.size,
                        show_progress=parallel.rank == 0)
