"""`python -m verifier check`: its flags and the command.

    add_check_parser(subparsers)   # in the program's parser (verifier/cli.py)
    check_command(args) -> int     # 0 every row equal, 1 a difference, 2 bad arguments, 3 a rank failed

--tensor-parallel N runs the whole check on N ranks (verifier/check/parallel.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from ..arguments import DefaultsHelpFormatter, at_least
from ..dtypes import DTYPES
from ..engine import DEFAULT_MAX_K
from .checks import CheckSettings, run_checks
from .report import build_report, environment, summary

RANK_FAILED = 3  # exit status when a tensor-parallel rank failed or died: neither a difference nor bad arguments

# K = 1..max-k streams of three draft kinds, and full batches of max-k + 1 rows a sequence: past
# this the check runs for hours, and no served max_k is near it
MAX_CHECK_K = 64
FULL_BATCH = 64  # the full-batch check's default sequences: a serving batch (bench.serve's 64 sessions)


def add_check_parser(sub):
    parser = sub.add_parser(
        "check", help="prove bit-exact verification on your checkpoint and device", formatter_class=DefaultsHelpFormatter,
        description="Run on your checkpoint and device what the project's bit-exactness tests prove on theirs: verify rows "
                    "== serial decode rows (K = 1..--max-k; wrong, right and random drafts; per layer), the state after "
                    "rollback in both modes, a full batch of sequences == each sequence alone, speculative streams == plain (greedy "
                    "and seeded sampling). Every comparison is bitwise. Run it after upgrading torch, triton or a "
                    "checkpoint, before serving. Exit status: 0 every row equal, 1 a difference (the report names the "
                    "first), 2 bad arguments, 3 a tensor-parallel rank failed.")
    parser.add_argument("--model", type=Path, help="HF checkpoint directory (default: the project's default model, models/target)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the model runs: cpu (the torch reference ops) or cuda (the Triton kernels)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                        help="weights and activations (recurrent state is fp32 always)")
    parser.add_argument("--max-k", type=at_least(1, MAX_CHECK_K, "K = 1 .. --max-k each run three streams; a served max_k is "
                                                                   "rarely above 16"), default=DEFAULT_MAX_K,
                        help=f"verify K = 1 .. this many drafts (default: {DEFAULT_MAX_K}, the engine's and the server's max_k)")
    parser.add_argument("--prompt-len", type=at_least(1), default=8, help="tokens per prompt (random ids, seeded)")
    parser.add_argument("--new-tokens", type=at_least(2), default=8, help="tokens each stream emits, the first one included")
    parser.add_argument("--sequences", type=at_least(2), default=FULL_BATCH,
                        help="sequences stepped together in the full-batch check (as many as a serving engine batches)")
    parser.add_argument("--seed", type=at_least(0), default=0, help="seed of the prompts, the random drafts and the seeded sampling")
    parser.add_argument("--tensor-parallel", type=at_least(1), default=1, metavar="N",
                        help="run the whole check with the model split over N processes (one rank each, torch.distributed: "
                             "gloo on the CPU, NCCL with --device cuda): every comparison is of the bits of N ranks, "
                             "which differ from one process's (another summation order) but must agree with themselves")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help="also write the report as JSON to FILE (default: not written)")
    return parser


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def check_command(args) -> int:
    from ..defaults import default_model_dir
    from ..model import load_model

    settings = CheckSettings(args.max_k, args.prompt_len, args.new_tokens, args.sequences, args.seed)
    if args.device == "cuda" and not torch.cuda.is_available():
        return _fail("--device cuda, but torch sees no CUDA device")
    if args.json is not None and not args.json.parent.is_dir():
        return _fail(f"--json {args.json}: no directory {args.json.parent}")
    model_dir = args.model or default_model_dir()
    if args.tensor_parallel > 1:
        from .parallel import check_tensor_parallel

        return check_tensor_parallel(args, settings, model_dir)
    try:
        model = load_model(model_dir, args.device, DTYPES[args.dtype])
    except (ValueError, OSError) as exc:
        return _fail(f"--model {model_dir}: {exc}")
    error = context_error(settings, model.config)
    if error:
        return _fail(error)
    return publish(args, check_report(model, model_dir, settings, args.device, args.dtype))


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
