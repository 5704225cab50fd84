"""Prompts at real size: time to first token against its compute floor, a cached prefix against a
cold start, and what prompts arriving cost the sessions already stepping.
How it measures, what it checks and writes: bench/README.md, Methods, `bench.prefill`.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.fp8_real_size import checkpoint_config, params, published_configs, write_checkpoint
from bench.gpu import kernel_table
from bench.machine import NAME_HELP, device_name, name_arg, write_results
from hybrid_kernels import delta_rule_chunked, gdn_heads
from verifier.engine import Engine, StepRequest
from verifier.model import load_model
from verifier.model.config import ATTENTION
from verifier.model.hf_config import config_from_dict
from verifier.model.layers import attend, linear_attention, mlp
from verifier.params import SamplingParams
from verifier.server.config import ServerConfig
from verifier.server.prefill import take_turn

def log(message: str) -> None:
    print(f"[prefill] {message}", file=sys.stderr, flush=True)


TAIL = 100  # tokens that differ after a shared prefix (at most a quarter of the prompt): the cached start prefills them


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matrix_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul in `dtype` on `device`, measured now (the floor's rate)."""
    n = 8192 if device.type == "cuda" else 512
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    torch.mm(a, b)
    _sync(device)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)


def prefill_floor_s(config, active: int, tokens: int, rate: float) -> float:
    """2 x active parameters x tokens, plus causal attention's score and value products over the
    full-attention layers, at `rate` FLOP/s."""
    a = config.attention
    attention_layers = sum(1 for kind in config.mixers if kind == ATTENTION)
    attention = attention_layers * 2 * 2 * (tokens * (tokens + 1) // 2) * a.n_heads * a.head_dim
    return (2 * active * tokens + attention) / rate


def prompt(vocab: int, length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


def time_open(engine: Engine, ids: list[int], device: torch.device):
    """(seconds to the first token, the sequence): an open on a free slot, synchronised."""
    _sync(device)
    start = time.perf_counter()
    seq = engine.open(ids, SamplingParams(), 4, eos_ids=())
    _sync(device)
    return time.perf_counter() - start, seq


def prompt_turn(engine: Engine, waiting: list, rows: int) -> None:
    """One turn of the prompts still arriving, as the server runs it (verifier/server/prefill.py):
    the next chunks of the first openings whose chunks fit `rows`, in one job; an opening not yet
    all in goes to the back of `waiting`."""
    turn = take_turn(waiting, rows)
    del waiting[: len(turn)]
    waiting.extend(o for o, done in zip(turn, engine.advance_openings(turn)) if not done)


def running_intervals(engine: Engine, seqs: list, steps: int, device: torch.device, openings: list, rows: int,
                      step_rows: int = 0) -> list[float]:
    """Seconds between the starts of consecutive decode steps of the running sequences, while
    `openings` (Engine.opening) advance as the server interleaves them: after each step one turn
    of the prompts still arriving (prompt_turn), or (step_rows) inside each step the next pieces
    of the first prompts waiting whose pieces fit step_rows (verifier serve --step-prompt-rows);
    at most `steps` steps, fewer once every prompt is in."""
    starts, waiting = [], list(openings)
    limit = engine.piece_limit(step_rows) if step_rows else None
    for _ in range(steps):
        if openings and not waiting:
            break
        _sync(device)
        starts.append(time.perf_counter())
        requests = [StepRequest(seq, []) for seq in seqs]
        if step_rows and waiting:
            turn = take_turn(waiting, step_rows, limit=limit)
            del waiting[: len(turn)]
            results = engine.step(requests, turn, step_rows)
            waiting.extend(o for o in turn if o.logits is None)  # round robin, as the server's turns
        else:
            results = engine.step(requests)
            if waiting:
                prompt_turn(engine, waiting, rows)
        assert all(r.error is None for r in results), "a running sequence's decode step was refused"
        _sync(device)
    starts.append(time.perf_counter())
    return [b - a for a, b in zip(starts, starts[1:])]


def time_together(engine: Engine, prompts: list[list[int]], rows: int, device: torch.device) -> tuple[float, list[torch.Tensor]]:
    """(seconds until every one of `prompts`, opened at once, has its first token, their first
    logits rows): turns back to back."""
    _sync(device)
    start = time.perf_counter()
    waiting = [engine.opening(ids, SamplingParams(), 4, eos_ids=()) for ids in prompts]
    openings = list(waiting)
    while waiting:
        prompt_turn(engine, waiting, rows)
    seqs = [o.sequence() for o in openings]
    _sync(device)
    seconds = time.perf_counter() - start
    for seq in seqs:
        engine.close(seq)
    return seconds, [seq.first_logits for seq in seqs]


def p99(values: list[float]) -> float:
    """As the load and serve benches take theirs (numpy's linear interpolation)."""
    return float(np.percentile(values, 99))


# Prefill's optional forms: (the flag's and the results file's key, the module, the constant it sets)
FORMS = (("chunked_delta_rule", linear_attention, "CHUNKED_PREFILL"), ("chunked_precision", delta_rule_chunked, "DOT_PRECISION"),
         ("conv_run_rows", linear_attention, "PREFILL_CONV_RUN_ROWS"), ("heads_rows", gdn_heads, "HEADS_ROWS_PER_PROGRAM"),
         ("tiled_attention", attend, "TILED_PREFILL"), ("expert_tiles", mlp, "PREFILL_EXPERT_TILES"))


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = checkpoint_config(args.config, args.scale)
    parsed = config_from_dict(config)
    today = datetime.date.today().isoformat()
    result = {"device": device_name(device.type), "date": today, "torch": torch.__version__, "config": args.config,
              "scale": args.scale, "dtype": str(dtype).removeprefix("torch."), "prompt_tokens": args.prompt_tokens,
              "running": args.running, "arriving": args.arriving, "prefill_chunk": args.chunk,
              "prefill_rows": args.prefill_rows, "step_prompt_rows": args.step_prompt_rows}
    for key, module, name in FORMS:  # the forms the flags name; a flag left out keeps the code's default
        if getattr(args, key) is not None:
            setattr(module, name, getattr(args, key))
        result[key] = getattr(module, name)
    from bench.kernel_candidates import apply_walk, current_walk

    if args.expert_walk is not None:
        apply_walk("expert", args.expert_walk)
    result["expert_walk"] = current_walk("expert")
    workdir = Path(tempfile.mkdtemp(prefix="prefill_", dir=args.workdir))
    try:
        path = workdir / f"{args.config}-fp8"
        plan = write_checkpoint(path, config, "per-expert", args.seed, device, int(4e9), mtp=False)
        total, active = params(plan, parsed)
        result.update(params_total=total, params_active=active)
        model = load_model(path, device, dtype)
        shutil.rmtree(path)  # loaded: the disk is the next run's
        rate = matrix_rate(device, dtype)
        n, vocab = args.prompt_tokens, parsed.vocab_size
        floor = prefill_floor_s(parsed, active, n, rate)
        result.update(matrix_tflops=round(rate / 1e12, 1), ttft_floor_ms=round(floor * 1e3, 2))
        slots = args.running + args.arriving
        engine = Engine(model, slots, n + 64, max_k=0, prefix_cache_bytes=int(args.cache_gb * (1 << 30)), prefill_chunk=args.chunk)
        cold_engine = Engine(model, 1, n + 64, max_k=0, prefill_chunk=args.chunk)
        engine.warm_up()
        cold_engine.warm_up()

        # time to first token, cold: prompts that share nothing (other first tokens)
        log(f"time to first token: {n} tokens, floor {floor * 1e3:.1f} ms at {rate / 1e12:.0f} TFLOP/s")
        cold = []
        for i in range(args.repeats):
            seconds, seq = time_open(engine, prompt(vocab, n, args.seed + 10 + i), device)
            engine.close(seq)
            cold.append(seconds)
        ttft = statistics.median(cold[1:] if len(cold) > 1 else cold)
        result.update(ttft_cold_ms=round(ttft * 1e3, 2), ttft_x_floor=round(ttft / floor, 2))
        if device.type == "cuda":  # where a cold open's GPU time goes, by kernel (one more open, profiled)
            result["ttft_kernel_breakdown"] = kernel_table(lambda: engine.close(time_open(engine, prompt(vocab, n, args.seed + 9), device)[1]))

        # a cached prefix: the last cold prompt's first n - TAIL tokens, then another tail
        tail = min(TAIL, n // 4)
        shared = prompt(vocab, n, args.seed + 10 + args.repeats - 1)[: n - tail] + prompt(vocab, tail, args.seed + 99)
        before = engine.prefix_cache.stats.cached_tokens
        seconds, warm = time_open(engine, shared, device)
        restored = engine.prefix_cache.stats.cached_tokens - before
        plain = cold_engine.open(shared, SamplingParams(), 4, eos_ids=())
        result.update(ttft_cached_ms=round(seconds * 1e3, 2), cached_tokens=restored,
                      cached_equals_cold=bool(torch.equal(warm.first_logits, plain.first_logits)))
        engine.close(warm)
        cold_engine.close(plain)
        log(f"cold {ttft * 1e3:.1f} ms ({ttft / floor:.2f}x its floor), cached ({restored} of {n} tokens restored) "
            f"{seconds * 1e3:.1f} ms, equal to a cold start: {result['cached_equals_cold']}")

        # prompts arriving together with nothing else running: their turns back to back, on an
        # engine without a cache (cold), each prompt's first logits then against its own open alone
        arriving = [prompt(vocab, n, args.seed + 400 + i) for i in range(args.arriving)]
        together_engine = Engine(model, args.arriving, n + 64, max_k=0, prefill_chunk=args.chunk)
        together_engine.warm_up()
        time_together(together_engine, [ids[: args.chunk * 2] for ids in arriving], args.prefill_rows, device)  # warm-up
        together, firsts = time_together(together_engine, arriving, args.prefill_rows, device)
        del together_engine
        equal = []
        for ids, first in zip(arriving, firsts):
            alone = cold_engine.open(ids, SamplingParams(), 4, eos_ids=())
            equal.append(bool(torch.equal(alone.first_logits, first)))
            cold_engine.close(alone)
        result.update(together_ms=round(together * 1e3, 2), together_x_floor=round(together / (floor * args.arriving), 2),
                      together_x_one_by_one=round(together / (ttft * args.arriving), 2), together_equals_alone=all(equal))
        log(f"{args.arriving} prompts of {n} together: {together * 1e3:.1f} ms, {together / (ttft * args.arriving):.2f}x "
            f"one by one, {together / (floor * args.arriving):.2f}x their floor; each equal to its open alone: {all(equal)}")

        # the running batch: decode steps of `running` sequences, alone, then while prompts arrive
        seqs = [engine.open(prompt(vocab, 16, args.seed + 200 + i), SamplingParams(), 10**6, eos_ids=()) for i in range(args.running)]
        alone = running_intervals(engine, seqs, args.steps, device, [], args.prefill_rows)
        late = [prompt(vocab, n, args.seed + 300 + i) for i in range(args.arriving)]
        openings = [engine.opening(ids, SamplingParams(), 4, eos_ids=()) for ids in late]
        # at most a step before each chunk (each piece of a chunk, inside steps) of every arriving prompt
        piece = (engine.piece_limit(args.step_prompt_rows) if args.step_prompt_rows else None) or args.chunk
        pieces = args.arriving * -(-n // args.chunk) * -(-args.chunk // piece)
        busy = running_intervals(engine, seqs, pieces, device, openings, args.prefill_rows, args.step_prompt_rows)
        for opening in openings:
            while not opening.advance():
                pass
        equal = []  # each arriving prompt, taken in by the steps or their turns, against its open alone
        for ids, opening in zip(late, openings):
            seq = opening.sequence()
            solo = cold_engine.open(ids, SamplingParams(), 4, eos_ids=())
            equal.append(bool(torch.equal(solo.first_logits, seq.first_logits)))
            cold_engine.close(solo)
            engine.close(seq)
        result.update(step_p99_alone_ms=round(p99(alone) * 1e3, 2), step_p99_arriving_ms=round(p99(busy) * 1e3, 2),
                      step_p99_ratio=round(p99(busy) / p99(alone), 2), steps_alone=len(alone), steps_arriving=len(busy),
                      arriving_equal_alone=all(equal))
        log(f"{args.running} running: p99 between steps {p99(alone) * 1e3:.1f} ms alone, {p99(busy) * 1e3:.1f} ms while "
            f"{args.arriving} prompts of {n} arrive ({result['step_p99_ratio']}x)")
        for seq in seqs:
            engine.close(seq)
        result["cache"] = vars(engine.prefix_cache.stats).copy()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder of the results JSON")
    parser.add_argument("--config", default="qwen3.6-35b-a3b", choices=sorted(published_configs()), help="published config.json")
    parser.add_argument("--scale", choices=("full", "tiny"), default="full", help="published sizes, or shrunk for a CPU test")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workdir", type=Path, default=None, help="the checkpoint is written in a new folder here")
    parser.add_argument("--prompt-tokens", type=int, default=8192, help="tokens of each long prompt")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (the prefix cache's boundaries)")
    parser.add_argument("--prefill-rows", type=int, default=ServerConfig.prefill_rows,
                        help="rows of prompt chunks a turn holds, as `verifier serve --prefill-rows`")
    parser.add_argument("--step-prompt-rows", type=int, default=ServerConfig.step_prompt_rows,
                        help="rows of the arriving prompts' pieces each running step takes in, as `verifier serve "
                             "--step-prompt-rows` (0: turns of their own between the steps)")
    parser.add_argument("--running", type=int, default=56, help="sessions decoding while prompts arrive")
    parser.add_argument("--arriving", type=int, default=8, help="long prompts arriving together")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed with no prompt arriving")
    parser.add_argument("--repeats", type=int, default=3, help="cold opens timed (the first is a warm-up)")
    parser.add_argument("--cache-gb", type=float, default=8.0, help="the prefix cache's budget")
    parser.add_argument("--chunked-delta-rule", action="store_true", default=None,
                        help="GDN's prefill in chunked form (verifier/model/layers/linear_attention.py's CHUNKED_PREFILL); "
                             "recorded as chunked_delta_rule")
    parser.add_argument("--chunked-precision", choices=("ieee", "tf32x3"), default=None,
                        help="the chunked delta rule's products (kernels/delta_rule_chunked.py's DOT_PRECISION; None: its "
                             "default); recorded as chunked_precision")
    parser.add_argument("--conv-run-rows", type=int, default=None,
                        help="prefill's short conv in runs of about this many rows a program (verifier/model/layers/"
                             "linear_attention.py's PREFILL_CONV_RUN_ROWS; 0: a step's few runs; None: its default); "
                             "recorded as conv_run_rows")
    parser.add_argument("--heads-rows", type=int, default=None,
                        help="rows a program of GDN's head split takes in launches of many rows (kernels/gdn_heads.py's "
                             "HEADS_ROWS_PER_PROGRAM; None: its default); recorded as heads_rows")
    parser.add_argument("--tiled-attention", action=argparse.BooleanOptionalAction, default=None,
                        help="prefill's attention in tiles of rows, or a program per row (verifier/model/layers/attend.py's "
                             "TILED_PREFILL; None: its default); recorded as tiled_attention")
    parser.add_argument("--expert-tiles", action=argparse.BooleanOptionalAction, default=None,
                        help="prefill's block-FP8 experts in blocks of 64 pairs, or decode's 16 (verifier/model/layers/mlp.py's "
                             "PREFILL_EXPERT_TILES; None: its default); recorded as expert_tiles")
    parser.add_argument("--expert-walk", choices=("scale-after", "dequantize"), default=None,
                        help="the grouped FP8 experts' K walk (bench/kernel_candidates.py's WALKS) instead of the code's "
                             "default, for the prompts and the running steps alike; recorded as expert_walk")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="", type=name_arg, help=NAME_HELP)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    out = write_results(args.out, "prefill", result, args.name)
    log(f"wrote {out}")
    return 0 if result["cached_equals_cold"] and result["together_equals_alone"] and result["arriving_equal_alone"] else 1


if __name__ == "__main__":
    sys.exit(main())
