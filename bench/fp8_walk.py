"""The FP8 projections' K walk, screened: into how many ranges K is split (kernels/linear_fp8.py's
FP8_TARGET_PROGRAMS), at a published MoE's dense FP8 shapes, timed as the engine runs them.
How it measures, what it checks and writes: bench/README.md, Methods, `bench.fp8_walk`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton

from bench.fp8_configs import LAYERS, graph_ms
from bench.machine import device_name, name_arg, results_path
from bench.row_invariance import dense_weight, model_weights
from hybrid_kernels.linear import linear
import hybrid_kernels.linear_fp8 as lf
from presets.published import PUBLISHED
from verifier.arguments import DefaultsHelpFormatter

# name: FP8_TARGET_PROGRAMS (None: the bf16 GEMM's walk of the shape); the pinned walk first and last
CANDIDATES = {"pinned": None, "programs_512": 512, "pinned_again": None}
CHECKED_ROWS, FEW_ROWS, MANY_ROWS = (1, 4, 9, 16, 33), (1, 4), (64, 576)
MANY_ROWS_SLACK = 1.05


def dense_shape(n: int, k: int, gen: torch.Generator) -> dict:
    weights = [dense_weight(n, k, "fp8", gen) for _ in range(LAYERS)]
    x = torch.randn(max(MANY_ROWS), k, generator=gen, device="cuda").bfloat16()
    out = {}
    for name, target in CANDIDATES.items():
        lf.FP8_TARGET_PROGRAMS = target
        walk = lf.fp8_config(n, k, torch.bfloat16)
        try:
            reference = linear(x[:max(CHECKED_ROWS)], lf.dequantize(*weights[0], torch.bfloat16), pinned=walk)
            bad = [m for m in CHECKED_ROWS if not torch.equal(lf.linear_fp8(x[:m], *weights[0]), reference[:m])]
            out[name] = ({"split_k": walk.SPLIT_K, "error": f"differs from the bf16 GEMM at {bad} rows"} if bad else
                         {"split_k": walk.SPLIT_K, "programs": triton.cdiv(n, lf.ROWS_TILE_FEATURES) * walk.SPLIT_K,
                          **{str(m): round(graph_ms(lambda m=m: [lf.linear_fp8(x[:m], *w) for w in weights]) / LAYERS * 1e3, 2)
                             for m in FEW_ROWS + MANY_ROWS}})
        except Exception as exc:  # a candidate the compiler or launcher refuses
            out[name] = {"split_k": walk.SPLIT_K, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
        print(f"    {name}: {out[name]}", file=sys.stderr, flush=True)
    # many rows as the engine runs them on CUDA: the bf16 GEMM of the real weight the model keeps
    # (HybridModel.keep_fp8_reals), no dequantization per call; the pinned walk
    lf.FP8_TARGET_PROGRAMS = None
    reals = [lf.dequantize(*w, torch.bfloat16) for w in weights]
    out["kept_real"] = {str(m): round(graph_ms(lambda m=m: [lf.linear_fp8(x[:m], *w, real=r) for w, r in zip(weights, reals)])
                                      / LAYERS * 1e3, 2) for m in MANY_ROWS}
    print(f"    kept_real: {out['kept_real']}", file=sys.stderr, flush=True)
    return out


def best(shapes: dict, weights: dict[str, int]) -> str | None:
    """The candidate valid at every shape with the least weighted time at FEW_ROWS whose weighted time
    at MANY_ROWS is within MANY_ROWS_SLACK of the pinned walk's."""
    def total(name: str, rows: tuple[int, ...]) -> float:
        return sum(weights[s] * sum(shapes[s][name][str(m)] for m in rows) for s in shapes)

    valid = [n for n in next(iter(shapes.values())) if n != "kept_real" and all("error" not in s[n] for s in shapes.values())]
    if "pinned" not in valid:
        return None
    allowed = [n for n in valid if total(n, MANY_ROWS) <= MANY_ROWS_SLACK * total("pinned", MANY_ROWS)]
    return min(allowed, key=lambda n: total(n, FEW_ROWS), default=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fp8_walk", description=__doc__.splitlines()[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder of the results JSON")
    parser.add_argument("--config", default="Qwen3.6-35B-A3B", choices=sorted(PUBLISHED), help="published config whose shapes are timed")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    parser.add_argument("--name", default="", type=name_arg, help="what differs, appended to the file name (e.g. the device)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device: the candidates are timed on it")
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    date = datetime.date.today().isoformat()
    results = {"device": device_name("cuda"), "date": date, "torch": torch.__version__, "triton": triton.__version__,
               "config": args.config, "checked_rows": list(CHECKED_ROWS), "timed_rows": list(FEW_ROWS + MANY_ROWS), "unit": "us",
               "many_rows_slack": MANY_ROWS_SLACK, "dense": {}}
    saved = lf.FP8_TARGET_PROGRAMS
    path = results_path(args.out, "fp8_walk", date, args.name)
    counts = {}
    try:
        for (kind, dtype, shape), where in sorted(model_weights(PUBLISHED[args.config], fp8=True).items()):
            if kind != "dense" or dtype != "fp8" or all(".shared." in w for w in where):  # the shared expert runs with the experts
                continue
            name = "x".join(map(str, shape))
            print(f"[fp8_walk] {name} ({len(where)} weights)", file=sys.stderr, flush=True)
            counts[name] = len(where)
            results["dense"][name] = dense_shape(*shape, gen)
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(results, indent=1) + "\n")
    finally:
        lf.FP8_TARGET_PROGRAMS = saved
    results["weights_per_step"] = counts
    results["best"] = best(results["dense"], counts) if results["dense"] else None
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"best: {results['best']}; {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
