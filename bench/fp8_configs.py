"""Candidate launch configs of the block-FP8 GEMM and the grouped FP8 experts at a published MoE's
shapes, timed against the pinned ones (one H200).

    PYTHONPATH=. python -m bench.fp8_configs --out DIR [--config qwen3.6-35b-a3b] [--rows 1,9,64,576]

Row invariance holds for any one config that runs every row count (kernels/linear_fp8.py,
kernels/moe_grouped.py), so a config may be picked for speed alone; each candidate is still
checked (row 0 alone equals row 0 among M rows, torch.equal) before it is timed. For every FP8
weight shape and the routed experts of `--config` (bench.row_invariance's list of the shapes a
step multiplies), every candidate's median time at each row count in `--rows`, with the pinned
config's beside it, the weight bytes each call reads at least once and the bandwidth that makes.
Each call is timed alone, its split-K reduce included and no neighbour overlapping it (PDL), so a
candidate that wins here is confirmed in the engine (`python -m bench.fp8_real_size`'s
kernel_breakdowns) before it is pinned. Writes DIR/fp8_configs_<date>[_<config>].json.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch

from bench.machine import device_name, results_path
from bench.row_invariance import FP8_BLOCK, dense_weight, model_weights
from hybrid_kernels.linear import LinearConfig
from hybrid_kernels.linear_fp8 import BlockScales, FP8_BLOCK_M, fp8_config, linear_fp8, standard_scale_row
from hybrid_kernels.moe_grouped import GroupedConfig, grouped_config, grouped_experts
from presets.published import PUBLISHED
from verifier.arguments import DefaultsHelpFormatter

# BLOCK_M is FP8_BLOCK_M in every dense candidate: the 64-row wgmma tile the contract needs
# (8 warps only for the widest tile: narrower ones give each warp too little of a 64-row tile)
DENSE_CANDIDATES = [LinearConfig(n, k, w, s, split, FP8_BLOCK_M)
                    for n, k, w, s, split in itertools.product((32, 64, 128), (64, 128), (4, 8), (3, 4), (1, 2, 4)) if w == 4 or n == 128]
EXPERT_CANDIDATES = [(m, n, k, 3) for m, n, k in itertools.product((16, 32, 64), (32, 64), (64, 128))]


def time_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=3, rep=15, return_mode="median")


def _timed(op, xs: dict[int, tuple]) -> dict[str, float] | str:
    """{rows: ms} of op over each input, after checking row 0 alone == row 0 among the rows; a
    config the kernel refuses or that breaks invariance -> why, as a string."""
    try:
        alone = op(*(t[:1] for t in xs[max(xs)]))
        for rows, args in xs.items():
            if not torch.equal(op(*args)[:1], alone):
                return f"row 0 differs among {rows} rows"
        return {str(rows): round(time_ms(lambda args=args: op(*args)), 4) for rows, args in xs.items()}
    except Exception as exc:  # a candidate the launcher or the compiler refuses (shared memory, shapes)
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def sweep_dense(n: int, k: int, rows: list[int], gen: torch.Generator) -> dict:
    values, scales = dense_weight(n, k, "fp8", gen)
    x = torch.randn(max(rows), k, generator=gen, device="cuda").bfloat16()
    xs = {m: (x[:m],) for m in rows}
    pinned = fp8_config(n, k, torch.bfloat16)
    times = {",".join(map(str, c)): _timed(lambda a, c=c: linear_fp8(a, values, scales, config=c), xs) for c in DENSE_CANDIDATES}
    return _summary(times, ",".join(map(str, pinned)), _timed(lambda a: linear_fp8(a, values, scales), xs),
                    values.numel() + scales.scale_inv.numel() * 4)


def sweep_experts(e: int, i: int, h: int, top_k: int, rows: list[int], gen: torch.Generator) -> dict:
    stacks = []
    for n, k in ((i, h), (i, h), (h, i)):
        values, scales = dense_weight(e * n, k, "fp8", gen)
        stacks.append((values.view(e, n, k), BlockScales(scales.scale_inv.view(e, -(-n // FP8_BLOCK), -1),
                                                          standard_scale_row(n, FP8_BLOCK, "cuda"), FP8_BLOCK)))
    (wg, sg), (wu, su), (wd, sd) = stacks
    x = torch.randn(max(rows), h, generator=gen, device="cuda").bfloat16()
    ids = torch.rand(max(rows), e, generator=gen, device="cuda").argsort(dim=1)[:, :top_k].contiguous()
    weights = torch.rand(max(rows), top_k, generator=gen, device="cuda")
    xs = {m: (x[:m], ids[:m], weights[:m]) for m in rows}
    pinned = grouped_config(h, i, torch.bfloat16, e, top_k, fp8=True)

    def op(config):
        return lambda a, d, w: grouped_experts(a, d, w, wg, wu, wd, torch.empty_like(a), (sg, su, sd), config)

    times = {}
    for block_m, block_n, block_k, stages in EXPERT_CANDIDATES:
        config = pinned._replace(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_N2=block_n, BLOCK_K2=block_k, num_stages=stages)
        times[",".join(map(str, config))] = _timed(op(config), xs)
    expert_bytes = 3 * i * h + (wg.numel() // e // FP8_BLOCK ** 2) * 12  # one expert's values and scales, about
    return _summary(times, ",".join(map(str, pinned)), _timed(op(None), xs), expert_bytes, top_k, e)


def _summary(times: dict, pinned_key: str, pinned: dict | str, nbytes: int, top_k: int = 0, experts: int = 0) -> dict:
    """The candidates' times, the pinned config's, and per row count the fastest candidate with its
    speed-up over the pinned config and the bandwidth of the weight bytes it must read."""
    valid = {key: t for key, t in times.items() if isinstance(t, dict)}
    best = {}
    for rows in (pinned.keys() if isinstance(pinned, dict) else []):
        key = min(valid, key=lambda c: valid[c][rows])
        # the experts random ids of `rows` rows route to, expected: E (1 - (1 - top_k / E) ^ rows)
        read = nbytes * (experts * (1 - (1 - top_k / experts) ** int(rows)) if experts else 1)
        best[rows] = {"config": key, "ms": valid[key][rows], "x_pinned": round(pinned[rows] / valid[key][rows], 3),
                      "pinned_ms": pinned[rows], "pinned_gb_s": round(read / pinned[rows] / 1e6, 1),
                      "best_gb_s": round(read / valid[key][rows] / 1e6, 1)}
    overall = min(valid, key=lambda c: sum(valid[c].values())) if valid else None
    return {"pinned": pinned_key, "pinned_ms": pinned, "best_by_rows": best, "best_overall": overall,
            "best_overall_ms": valid.get(overall), "candidates": times}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fp8_configs", description=__doc__.splitlines()[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder of the results JSON")
    parser.add_argument("--config", default="Qwen3.6-35B-A3B", choices=sorted(PUBLISHED), help="published config whose shapes are swept")
    parser.add_argument("--rows", default="1,9,64,576", help="row counts timed (decode and K = 8 verify at batch 1 and 64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device: the candidates are timed on it")
    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    shapes = {}
    # the experts first: most of a MoE step's time at every batch size
    for (kind, dtype, shape), where in sorted(model_weights(PUBLISHED[args.config], fp8=True).items(), key=lambda kv: (kv[0][0] != "experts", kv[0])):
        if dtype != "fp8":
            continue
        name = f"{kind} {'x'.join(map(str, shape))}"
        print(f"[fp8_configs] {name} ({len(where)} weights)", file=sys.stderr, flush=True)
        shapes[name] = {"where": where[:3] + ([f"... {len(where)} in all"] if len(where) > 3 else []),
                        **(sweep_dense(*shape, rows, gen) if kind == "dense" else sweep_experts(*shape, rows, gen))}
        for r, b in shapes[name]["best_by_rows"].items():
            print(f"  {r} rows: pinned {b['pinned_ms']} ms ({b['pinned_gb_s']} GB/s), best {b['ms']} ms ({b['x_pinned']}x) {b['config']}",
                  file=sys.stderr, flush=True)
        path = write(args, rows, shapes)  # after every shape: a run cut short keeps what it timed
    print(f"[fp8_configs] wrote {path}", file=sys.stderr)
    return 0


def write(args: argparse.Namespace, rows: list[int], shapes: dict) -> Path:
    import triton

    today = datetime.date.today().isoformat()
    result = {"device": device_name("cuda"), "date": today, "torch": torch.__version__, "triton": triton.__version__,
              "config": args.config, "rows": rows, "dense_fields": list(LinearConfig._fields),
              "expert_fields": list(GroupedConfig._fields), "shapes": shapes}
    args.out.mkdir(parents=True, exist_ok=True)
    path = results_path(args.out, "fp8_configs", today, args.config)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


if __name__ == "__main__":
    sys.exit(main())
