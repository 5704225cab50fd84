"""`python -m verifier generate --tensor-parallel N`: the target split over N ranks (SPMD).

This process checks the arguments and the prompt against config.json (no weights read here), then
starts N ranks (verifier/model/parallel/launch.py). Every rank loads its part of the model, builds
the same engine and drafter, and runs the same generate loop on the same inputs: the logits are
whole on every rank (gathered), so every rank chooses the same tokens and proposes the same drafts.
Rank 0 streams the tokens to stdout as they come and hands its Generation back; this process then
prints the JSON object or the summary line as a one-process run does. A rank that fails (a bad
checkpoint, a size that does not divide the heads) is reported here, naming the rank.
"""

from __future__ import annotations

import sys
import time

import torch

from .defaults import default_model_dir
from .dtypes import DTYPES
from .engine import Engine
from .generate import generate
from .generate_args import fail, make_proposer, prompt_ids, report
from .model import load_config, load_model
from .model.parallel import ParallelError, TensorParallel, local_config, run_parallel
from .params import SamplingParams
from .printing import TokenPrinter
from .tokenizer import TextTokenizer


def generate_tensor_parallel(args, k: int, sampling: SamplingParams) -> int:
    """The generate command over args.tensor_parallel ranks (k and sampling checked by the caller)."""
    size = args.tensor_parallel
    if args.draft == "mtp":
        return fail("--draft mtp is not available with --tensor-parallel: the MTP head is not split across ranks yet; "
                     "pick another --draft")
    if args.device == "cuda" and torch.cuda.device_count() < size:
        return fail(f"--tensor-parallel {size} with --device cuda needs {size} GPUs; torch sees {torch.cuda.device_count()}")
    model_dir = args.model or default_model_dir()
    try:
        config = load_config(model_dir)
        local_config(config, size)  # heads and sizes that do not divide by N: named here, before any rank starts
        tokenizer = TextTokenizer.from_model_dir(model_dir)
        prompt = prompt_ids(args, model_dir, tokenizer, config)
    except (ValueError, OSError) as exc:
        return fail(str(exc))
    backend = "nccl" if args.device == "cuda" else "gloo"
    try:
        result, seconds = run_parallel(_generate_on_rank, size, args, model_dir, prompt, k, sampling, backend=backend)
    except ParallelError as err:
        if isinstance(err.original, (ValueError, OSError)):  # what a one-process run reports with exit status 2
            return fail(f"{err.original} (rank {err.rank} of {size})")
        print(err.detail, file=sys.stderr)
        return fail(str(err))
    report(args, model_dir, prompt, k, result, seconds, tokenizer)
    return 0


def _generate_on_rank(parallel: TensorParallel, args, model_dir, prompt: list[int], k: int, sampling: SamplingParams):
    """One rank's run -> (its Generation, seconds). Rank 0 streams the tokens; the others print nothing."""
    model = load_model(model_dir, args.device, DTYPES[args.dtype], parallel=parallel)
    engine = Engine(model, n_slots=1, max_seq_len=len(prompt) + args.max_new_tokens + k, max_k=k, rollback_mode=args.rollback)
    proposer = make_proposer(args, engine, prompt, sampling)
    tokenizer = TextTokenizer.from_model_dir(model_dir) if parallel.rank == 0 else None
    printer = TokenPrinter(tokenizer.stream() if tokenizer else None, quiet=args.json or parallel.rank != 0)
    start = time.perf_counter()
    result = generate(engine, prompt, args.max_new_tokens, sampling, proposer, k, on_tokens=printer.push)
    seconds = time.perf_counter() - start
    printer.end()
    result.logits = result.logits.cpu() if args.logits_out else None  # only what the report writes comes back
    return result, seconds
