"""The FP8 kernels' inner loop, screened: how an fp8 weight becomes fp32 (the conversion instructions
or the integer decode, kernels/linear_fp8.py's `fp8_values`) and how many K steps an iteration takes
(one, or two: ROWS_PAIRED for the few-rows GEMM, HIDDEN_PAIRED for the experts' stage 1), at a
published MoE's shapes, timed as the engine runs them.

    PYTHONPATH=. python -m bench.fp8_decode --out DIR [--config Qwen3.6-35B-A3B] [--name h100]

At one row these kernels read each weight once and do little else, yet they stream it at a fraction
of the copy bandwidth: a program (64 weight features) walks K one step at a time, and every step
dequantizes its tile, multiplies and waits for the MMA before the next. The candidates attack the
two suspects: the number of conversion instructions a weight byte costs (the integer decode has
none until the final rounding to bf16), and the per-step waits (two steps an iteration halve the
loop's barriers and waits). Neither changes a bit: the same values reach the same MMAs in the same
K order. That is checked, not assumed: each dense candidate's outputs must equal the bf16 GEMM
over the dequantized weight (the many-rows path, kernels/linear_fp8.py) at 1, 4, 9, 16 and 33
rows, and each experts candidate's must equal the pinned kernels' at 1, 4 and 9 rows (torch.equal).

Timing as bench.fp8_configs times: LAYERS distinct weights in one CUDA graph, replayed; us per call
(dense) or per layer (experts: routing, both stages and the combine, the shared expert folded in).
Each dense shape weighs by how many of it a step runs; `best` is the candidate with the least
summed time at 1 and 4 rows. The pinned run goes first and last (`pinned_again`), so drift on the
device shows. Writes DIR/fp8_decode_<date>[_<name>].json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton

from bench.fp8_configs import LAYERS, expert_stacks, graph_ms
from bench.machine import device_name, name_arg, results_path
from bench.row_invariance import dense_weight, model_weights
from hybrid_kernels.linear import linear
import hybrid_kernels.linear_fp8 as lf
import hybrid_kernels.moe_grouped as mg
from hybrid_kernels.moe_grouped import group_pairs, grouped_experts
from presets.published import PUBLISHED
from verifier.arguments import DefaultsHelpFormatter

# name: (ROWS_PAIRED or HIDDEN_PAIRED, FP8_INT_DECODE, ROWS_STAGES); the pinned launch first and last
DENSE = {"pinned": (False, False, 4), "paired": (True, False, 4), "paired_3_stages": (True, False, 3),
         "int_decode": (False, True, 4), "int_decode_paired": (True, True, 4), "int_decode_paired_3_stages": (True, True, 3),
         "pinned_again": (False, False, 4)}
EXPERTS = {"pinned": (False, False), "paired": (True, False), "int_decode": (False, True), "int_decode_paired": (True, True),
           "pinned_again": (False, False)}
CHECKED_ROWS, TIMED_ROWS = (1, 4, 9, 16, 33), (1, 4)


def _set(paired: bool, int_decode: bool, stages: int | None = None) -> None:
    lf.ROWS_PAIRED = mg.HIDDEN_PAIRED = paired
    lf.FP8_INT_DECODE = int_decode
    if stages is not None:
        lf.ROWS_STAGES = stages


def dense_shape(n: int, k: int, gen: torch.Generator) -> dict:
    weights = [dense_weight(n, k, "fp8", gen) for _ in range(LAYERS)]
    x = torch.randn(max(CHECKED_ROWS), k, generator=gen, device="cuda").bfloat16()
    reference = linear(x, lf.dequantize(*weights[0], torch.bfloat16))
    out = {}
    for name, variant in DENSE.items():
        _set(*variant)
        try:
            bad = [m for m in CHECKED_ROWS if not torch.equal(lf.linear_fp8(x[:m], *weights[0]), reference[:m])]
            out[name] = (f"differs from the bf16 GEMM at {bad} rows" if bad else
                         {str(m): round(graph_ms(lambda m=m: [lf.linear_fp8(x[:m], *w) for w in weights]) / LAYERS * 1e3, 2)
                          for m in TIMED_ROWS})
        except Exception as exc:  # a candidate the compiler or launcher refuses
            out[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        print(f"    {name}: {out[name]}", file=sys.stderr, flush=True)
    return out


def experts_shape(e: int, i: int, h: int, top_k: int, gen: torch.Generator) -> dict:
    """The experts of one layer as bench.fp8_configs builds them (the shared expert the stack's last,
    in one more slot of every row)."""
    top_k += 1
    rows = max(CHECKED_ROWS[:3])
    layers = []
    for _ in range(LAYERS):
        stacks = expert_stacks(e, i, h, gen)
        ids = torch.rand(rows, e - 1, generator=gen, device="cuda").argsort(dim=1)[:, :top_k - 1]
        ids = torch.cat([ids, torch.full_like(ids[:, :1], e - 1)], dim=1).contiguous()
        layers.append((stacks, ids, torch.rand(rows, top_k, generator=gen, device="cuda")))
    x = torch.randn(rows, h, generator=gen, device="cuda").bfloat16()
    buffer = torch.empty_like(x)

    def layer(m: int, j: int) -> torch.Tensor:
        ((wg, sg), (wu, su), (wd, sd)), ids, weights = layers[j]
        return grouped_experts(x[:m], group_pairs(ids[:m], weights[:m], e), wg, wu, wd, buffer[:m], (sg, su, sd))

    _set(False, False)
    expected = {m: layer(m, 0).clone() for m in CHECKED_ROWS[:3]}
    out = {}
    for name, variant in EXPERTS.items():
        _set(*variant)
        try:
            bad = [m for m in expected if not torch.equal(layer(m, 0), expected[m])]
            out[name] = (f"differs from the pinned kernels at {bad} rows" if bad else
                         {str(m): round(graph_ms(lambda m=m: [layer(m, j) for j in range(LAYERS)]) / LAYERS * 1e3, 2)
                          for m in TIMED_ROWS})
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        print(f"    {name}: {out[name]}", file=sys.stderr, flush=True)
    return out


def best(shapes: dict, weights: dict[str, int]) -> str | None:
    """The candidate valid at every shape with the least time at TIMED_ROWS, each shape weighted."""
    names = [n for n in next(iter(shapes.values())) if all(isinstance(s.get(n), dict) for s in shapes.values())]
    return min(names, key=lambda n: sum(weights[s] * sum(shapes[s][n].values()) for s in shapes), default=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fp8_decode", description=__doc__.splitlines()[0],
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
               "config": args.config, "checked_rows": list(CHECKED_ROWS), "timed_rows": list(TIMED_ROWS), "unit": "us",
               "dense": {}, "experts": {}}
    saved = (lf.ROWS_PAIRED, lf.FP8_INT_DECODE, lf.ROWS_STAGES, mg.HIDDEN_PAIRED)
    path = results_path(args.out, "fp8_decode", date, args.name)
    counts = {}
    try:
        for (kind, dtype, shape), where in sorted(model_weights(PUBLISHED[args.config], fp8=True).items()):
            if dtype != "fp8" or all(".shared." in w for w in where):  # the shared expert is folded into the experts
                continue
            name = f"{kind} {'x'.join(map(str, shape))}"
            print(f"[fp8_decode] {name} ({len(where)} weights)", file=sys.stderr, flush=True)
            counts[name] = len(where)
            results[kind][name] = dense_shape(*shape, gen) if kind == "dense" else experts_shape(*shape, gen)
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(results, indent=1) + "\n")
    finally:
        lf.ROWS_PAIRED, lf.FP8_INT_DECODE, lf.ROWS_STAGES, mg.HIDDEN_PAIRED = saved
    for kind in ("dense", "experts"):
        if results[kind]:
            results[f"best_{kind}"] = best(results[kind], {s: counts[s] for s in results[kind]})
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"best: dense {results.get('best_dense')}, experts {results.get('best_experts')}; {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
