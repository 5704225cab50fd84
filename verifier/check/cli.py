"""`python -m verifier check`: its flags and the command.

    add_check_parser(subparsers)   # in the program's parser (verifier/cli.py)
    check_command(args) -> int     # 0 every row equal, 1 a difference, 2 bad arguments, 3 a rank failed

--tensor-parallel N runs the whole check on N ranks (verifier/check/parallel.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..arguments import DefaultsHelpFormatter, at_least
from ..dtypes import DTYPES
from ..engine import DEFAULT_MAX_K
from .checks import CheckSettings
from .report import check_report, context_error, fail, publish


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


def check_command(args) -> int:
    from ..defaults import default_model_dir
    from ..model import load_model

    settings = CheckSettings(args.max_k, args.prompt_len, args.new_tokens, args.sequences, args.seed)
    if args.device == "cuda" and not torch.cuda.is_available():
        return fail("--device cuda, but torch sees no CUDA device")
    if args.json is not None and not args.json.parent.is_dir():
        return fail(f"--json {args.json}: no directory {args.json.parent}")
    model_dir = args.model or default_model_dir()
    if args.tensor_parallel > 1:
        from .parallel import check_tensor_parallel

        return check_tensor_parallel(args, settings, model_dir)
    try:
        model = load_model(model_dir, args.device, DTYPES[args.dtype])
    except (ValueError, OSError) as exc:
        return fail(f"--model {model_dir}: {exc}")
    error = context_error(settings, model.config)
    if error:
        return fail(error)
    return publish(args, check_report(model, model_dir, settings, args.device, args.dtype))
