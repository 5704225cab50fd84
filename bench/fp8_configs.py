"""Candidate launch configs of the grouped FP8 experts and of the few-rows FP8 GEMM at a published
MoE's shapes, timed against the pinned ones as the engine runs them.
How it measures, what it checks and writes: bench/README.md, Methods, `bench.fp8_configs`.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch

from bench.kernel_candidates import ROWS_FIELDS
from bench.machine import device_name, name_arg, results_path
from bench.row_invariance import FP8_BLOCK, dense_weight, model_weights
from hybrid_kernels.linear import linear
from hybrid_kernels.linear_fp8 import BlockScales, linear_fp8, standard_scale_row
import hybrid_kernels.moe_grouped as mg
from hybrid_kernels.moe_grouped import GroupedConfig, group_pairs, grouped_config, grouped_experts
from presets.published import PUBLISHED
from verifier.arguments import DefaultsHelpFormatter

LAYERS = 8  # distinct weight stacks per timed graph: more bytes than the L2 holds, as in a step


def graph_ms(body, reps: int = 10) -> float:
    """body() captured once in a CUDA graph and replayed: ms per replay (median of 5 timings of
    `reps` replays), so launches cost what they cost in the engine's graphed steps."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()
    times = []
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / reps)
    return sorted(times)[2]


def expert_candidates(pinned: GroupedConfig) -> list[GroupedConfig]:
    """Stage 1's tile and K step varied with stage 2 pinned (4 and 8 warps), then stage 2's with
    stage 1 pinned."""
    out = [pinned._replace(BLOCK_N=n, BLOCK_K=k, num_warps=w)
           for n, k, w in itertools.product((64, 32), (128, 256, 64), (4, 8))]
    out += [pinned._replace(BLOCK_N2=n, BLOCK_K2=k) for n, k in itertools.product((64, 128, 32), (128, 256, 64))]
    return [c for i, c in enumerate(out) if c not in out[:i]]


def few_rows_candidates() -> list[dict[str, int]]:
    """Launch fields only (kernels/moe_grouped.py's LAUNCH_FIELDS) for up to FEW_ROWS rows: stage 1's
    feature tile, warps and stages with the rest pinned, then stage 2's, then the combine's. Warps
    lie along the features at 16 rows a block; more warps than n8 tiles repeat MMAs but share the
    tile's dequantization, which at one row has one program an SM to hide its latencies."""
    out = [dict(BLOCK_N=n, num_warps=w, num_stages=st) for n, w in ((16, 1), (16, 2), (16, 4), (32, 1), (32, 2), (32, 4), (32, 8),
                                                                      (64, 2), (64, 4), (64, 8))
           for st in (3, 4)]
    out += [dict(BLOCK_N=32, num_warps=8, num_stages=5)]
    out += [dict(BLOCK_N2=n, num_warps2=w) for n, w in ((32, 1), (32, 2), (32, 4), (64, 2), (64, 4), (64, 8), (128, 4), (128, 8))]
    out += [dict(BLOCK_H=b) for b in (64, 128, 512)]
    return out


def many_rows_candidates() -> list[dict[str, int]]:
    """From MANY_ROWS rows on (kernels/moe_grouped.py's MANY_ROWS_LAUNCH): blocks of 32 pairs, whose
    expert tiles are dequantized once per 32 pairs (two 16-row mma.sync tiles), with their warps and
    feature tiles; and the 16-pair block's feature tiles and stages. One launch is chosen whole:
    BLOCK_M is both stages'."""
    out = [dict(BLOCK_M=32, num_warps=w, num_warps2=w2) for w, w2 in ((4, 4), (8, 4), (8, 8))]
    out += [dict(BLOCK_M=32, BLOCK_N=n, BLOCK_N2=n2, num_warps=8, num_warps2=8) for n, n2 in ((32, 128), (64, 64), (128, 128))]
    out += [dict(BLOCK_N=32), dict(BLOCK_N=128, num_warps=8), dict(num_stages=4, num_stages2=4)]
    return out


def launch_key(launch: dict[str, int]) -> str:
    return ",".join(f"{f}={v}" for f, v in launch.items())


def sweep_experts(e: int, i: int, h: int, top_k: int, rows: list[int], gen: torch.Generator, screen: str = "all") -> dict:
    """The grouped experts of one MoE layer as the engine runs them (the shared expert folded in:
    the stack's last expert, in one more slot of every row), LAYERS distinct layers in one CUDA graph, each with its
    own routing launch: ms per layer for every candidate at every row count. Candidates that change
    one stage's config leave the other's pinned, so differences are that stage's."""
    top_k += 1  # the shared expert's slot (e counts it: bench.row_invariance's shapes)
    layers = []
    for _ in range(LAYERS):
        stacks = []
        for n, k in ((i, h), (i, h), (h, i)):
            values, scales = dense_weight(e * n, k, "fp8", gen)
            stacks.append((values.view(e, n, k), BlockScales(scales.scale_inv.view(e, -(-n // FP8_BLOCK), -1),
                                                              standard_scale_row(n, FP8_BLOCK, "cuda"), FP8_BLOCK)))
        layers.append(stacks)
    x = torch.randn(max(rows), h, generator=gen, device="cuda").bfloat16()
    routes = []
    for _ in range(LAYERS):
        ids = torch.rand(max(rows), e - 1, generator=gen, device="cuda").argsort(dim=1)[:, :top_k - 1]
        ids = torch.cat([ids, torch.full_like(ids[:, :1], e - 1)], dim=1).contiguous()
        routes.append((ids, torch.rand(max(rows), top_k, generator=gen, device="cuda")))
    pinned = grouped_config(h, i, torch.bfloat16, e, top_k, fp8=True)
    out = torch.empty_like(x)

    def layer(m: int, j: int, config) -> torch.Tensor:
        (wg, sg), (wu, su), (wd, sd) = layers[j]
        ids, weights = routes[j]
        return grouped_experts(x[:m], group_pairs(ids[:m], weights[:m], e), wg, wu, wd, out[:m], (sg, su, sd), config)

    def timed(config, rows=rows) -> dict[str, float] | str:
        try:
            alone = layer(1, 0, config).clone()
            for m in rows:
                if not torch.equal(layer(m, 0, config)[:1], alone):
                    return f"row 0 differs among {m} rows"
            return {str(m): round(graph_ms(lambda m=m: [layer(m, j, config) for j in range(LAYERS)]) / LAYERS, 4) for m in rows}
        except Exception as exc:  # a candidate the compiler or launcher refuses (registers, shared memory)
            return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"

    routing_ms = {str(m): round(graph_ms(lambda m=m: [group_pairs(routes[j][0][:m], routes[j][1][:m], e) for j in range(LAYERS)])
                                / LAYERS, 4) for m in rows}
    tiers = {"few_rows": sweep_launches(pinned, [m for m in rows if m <= mg.FEW_ROWS], few_rows_candidates(), layer, timed,
                                        by_stage=True),
             "many_rows": sweep_launches(pinned, [m for m in rows if m >= mg.MANY_ROWS], many_rows_candidates(), layer, timed,
                                         by_stage=False)}
    if screen == "rows":
        return {"routing_ms": routing_ms, **tiers}
    times = {}
    for config in expert_candidates(pinned):
        times[",".join(map(str, config))] = timed(config)
        print(f"    {','.join(map(str, config))}: {times[','.join(map(str, config))]}", file=sys.stderr, flush=True)
    expert_bytes = 3 * i * h + (3 * -(-i // FP8_BLOCK) * -(-h // FP8_BLOCK)) * 4  # one expert's values and scales
    summary = _summary(times, ",".join(map(str, pinned)), timed(pinned), expert_bytes, top_k - 1, e - 1, shared=True)
    return {"routing_ms": routing_ms, **summary, **tiers}


def sweep_launches(pinned: GroupedConfig, rows: list[int], candidates: list[dict[str, int]], layer, timed, by_stage: bool) -> dict:
    """A launch that follows the row count (kernels/moe_grouped.py's `launch_for_rows`), at the row
    counts of its tier: each candidate's outputs must equal the pinned launch's at every timed row
    count (torch.equal: a launch field that changed a pair's bits would break the rows' invariance
    across the tier's edge), then it is timed. by_stage: the fastest per stage, relative to the
    pinned launch summed over the row counts, make the launch, checked and timed as a whole; else
    the fastest candidate is the launch. -> {rows, pinned_ms, candidates, launch, launch_ms}"""
    if not rows:
        return {}
    expected = {m: layer(m, 0, pinned).clone() for m in rows}
    pinned_ms = timed(pinned, rows)

    def checked(launch: dict[str, int]) -> dict[str, float] | str:
        config = pinned._replace(**launch)
        try:
            bad = [m for m in rows if not torch.equal(layer(m, 0, config), expected[m])]
        except Exception as exc:
            return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return f"other bits than the pinned launch at {bad} rows" if bad else timed(config, rows)

    times, best = {}, {}
    for launch in candidates:
        key = launch_key(launch)
        times[key] = checked(launch)
        print(f"    rows {rows} {key}: {times[key]}", file=sys.stderr, flush=True)
        if isinstance(times[key], dict) and isinstance(pinned_ms, dict):
            stage = "whole" if not by_stage else "1" if "BLOCK_N" in launch else "2" if "BLOCK_N2" in launch else "combine"
            cost = sum(t / pinned_ms[r] for r, t in times[key].items()) / len(rows)
            if cost < best.get(stage, (1.0, None))[0]:  # faster than the pinned launch, on average
                best[stage] = (cost, launch)
    launch = {f: v for _, chosen in best.values() for f, v in chosen.items()}
    launch_ms = (checked(launch) if by_stage else times[launch_key(launch)]) if launch else pinned_ms
    return {"rows": rows, "pinned_ms": pinned_ms, "candidates": times, "launch": launch, "launch_ms": launch_ms}


def rows_candidates() -> list[tuple[int, int, int]]:
    """The few-rows FP8 kernel's launch (weight features a tile, warps, stages): none of them changes
    its K walk, which is the pinned config's. Tiles of 16 or 32 features (the MMA's M) would spread a
    weight over more programs, but give other bits than the bf16 GEMM at every published dense shape
    (bench/results/fp8_configs_2026-12-06_Qwen3.6-35B-A3B_dense-h100.json), so they are not screened."""
    return [(n, w, st) for n, w in ((64, 4), (64, 8), (128, 4), (128, 8)) for st in (3, 4, 6)]


def sweep_rows_kernel(n: int, k: int, rows: list[int], gen: torch.Generator) -> dict:
    """The few-rows path of an FP8 weight [n, k] (below DEQUANTIZED_ROWS), LAYERS distinct weights
    in one CUDA graph: ms per call for each launch candidate, each first checked to give the bf16
    GEMM's bits over the dequantized weight at DEQUANTIZED_ROWS rows (the path it must equal)."""
    import hybrid_kernels.linear_fp8 as lf

    weights = [dense_weight(n, k, "fp8", gen) for _ in range(LAYERS)]
    x = torch.randn(lf.DEQUANTIZED_ROWS, k, generator=gen, device="cuda").bfloat16()
    few = [m for m in rows if m < lf.DEQUANTIZED_ROWS]
    reference = linear(x, lf.dequantize(*weights[0], torch.bfloat16))
    saved = (lf.ROWS_TILE_FEATURES, lf.ROWS_WARPS, lf.ROWS_STAGES)
    pinned = ",".join(map(str, saved))
    times = {}
    try:
        for cand in rows_candidates():
            lf.ROWS_TILE_FEATURES, lf.ROWS_WARPS, lf.ROWS_STAGES = cand
            key = ",".join(map(str, cand))
            try:
                bad = [m for m in few if not torch.equal(linear_fp8(x[:m], *weights[0]), reference[:m])]
                times[key] = (f"differs from the bf16 GEMM at {bad} rows" if bad else
                              {str(m): round(graph_ms(lambda m=m: [linear_fp8(x[:m], *w) for w in weights]) / LAYERS, 4) for m in few})
            except Exception as exc:
                times[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            print(f"    {key}: {times[key]}", file=sys.stderr, flush=True)
    finally:
        lf.ROWS_TILE_FEATURES, lf.ROWS_WARPS, lf.ROWS_STAGES = saved
    return _summary(times, pinned, times.get(pinned, {}), values_bytes(n, k))


def values_bytes(n: int, k: int) -> int:
    return n * k + -(-n // FP8_BLOCK) * -(-k // FP8_BLOCK) * 4


def _summary(times: dict, pinned_key: str, pinned: dict | str, nbytes: int, top_k: int = 0, experts: int = 0,
             shared: bool = False) -> dict:
    """The candidates' times, the pinned config's, and per row count the fastest candidate with its
    speed-up over the pinned config and the bandwidth of the weight bytes it must read."""
    valid = {key: t for key, t in times.items() if isinstance(t, dict)}
    best = {}
    for rows in (pinned.keys() if isinstance(pinned, dict) else []):
        key = min(valid, key=lambda c: valid[c][rows])
        # the experts random ids of `rows` rows route to, expected: E (1 - (1 - top_k / E) ^ rows)
        read = nbytes * ((experts * (1 - (1 - top_k / experts) ** int(rows)) + shared) if experts else 1)
        best[rows] = {"config": key, "ms": valid[key][rows], "x_pinned": round(pinned[rows] / valid[key][rows], 3),
                      "pinned_ms": pinned[rows], "pinned_gb_s": round(read / pinned[rows] / 1e6, 1),
                      "best_gb_s": round(read / valid[key][rows] / 1e6, 1)}
    # overall: the least time relative to the pinned config's, summed over the row counts (each row
    # count weighs the same, so the many-row times do not drown the one-row ones)
    scale = pinned if isinstance(pinned, dict) else {}
    overall = min(valid, key=lambda c: sum(t / scale.get(r, 1.0) for r, t in valid[c].items())) if valid else None
    return {"pinned": pinned_key, "pinned_ms": pinned, "best_by_rows": best, "best_overall": overall,
            "best_overall_ms": valid.get(overall), "candidates": times}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fp8_configs", description=__doc__.splitlines()[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder of the results JSON")
    parser.add_argument("--config", default="Qwen3.6-35B-A3B", choices=sorted(PUBLISHED), help="published config whose shapes are swept")
    parser.add_argument("--rows", default="1,9,64,576",
                        help="row counts timed (decode and K = 8 verify at batch 1 and 64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    parser.add_argument("--name", default="", type=name_arg,
                        help="what differs, appended to the file name after the config (e.g. the screen or the device)")
    parser.add_argument("--screen", choices=("all", "rows", "dense"), default="all",
                        help="all: every candidate; rows: only the experts' launches that follow the row count, up to "
                             "FEW_ROWS rows and from MANY_ROWS on (kernels/moe_grouped.py's launch_for_rows); dense: only "
                             "the few-rows FP8 GEMM's launches (kernels/linear_fp8.py), at the row counts below DEQUANTIZED_ROWS")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device: the candidates are timed on it")
    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    shapes = {}
    # the experts first: most of a MoE step's time at every batch size
    for (kind, dtype, shape), where in sorted(model_weights(PUBLISHED[args.config], fp8=True).items(), key=lambda kv: (kv[0][0] != "experts", kv[0])):
        if dtype != "fp8" or all(".shared." in w for w in where):  # the engine folds the shared expert into the experts
            continue
        if (args.screen, kind) in (("rows", "dense"), ("dense", "experts")):
            continue
        name = f"{kind} {'x'.join(map(str, shape))}"
        print(f"[fp8_configs] {name} ({len(where)} weights)", file=sys.stderr, flush=True)
        shapes[name] = {"where": where[:3] + ([f"... {len(where)} in all"] if len(where) > 3 else []),
                        **(sweep_rows_kernel(*shape, rows, gen) if kind == "dense" else sweep_experts(*shape, rows, gen, args.screen))}
        for tier in ("few_rows", "many_rows"):
            got = shapes[name].get(tier) or {}
            if got:
                print(f"  {tier}: pinned launch {got['pinned_ms']}, chosen {got['launch']}: {got['launch_ms']}", file=sys.stderr, flush=True)
        for r, b in shapes[name].get("best_by_rows", {}).items():
            print(f"  {r} rows: pinned {b['pinned_ms']} ms ({b['pinned_gb_s']} GB/s), best {b['ms']} ms ({b['x_pinned']}x) {b['config']}",
                  file=sys.stderr, flush=True)
        path = write(args, rows, shapes)  # after every shape: a run cut short keeps what it timed
    print(f"[fp8_configs] wrote {path}", file=sys.stderr)
    return 0


def write(args: argparse.Namespace, rows: list[int], shapes: dict) -> Path:
    import triton

    today = datetime.date.today().isoformat()
    result = {"device": device_name("cuda"), "date": today, "torch": torch.__version__, "triton": triton.__version__,
              "config": args.config, "rows": rows, "layers_per_graph": LAYERS,
              "dense_fields": list(ROWS_FIELDS),
              "expert_fields": list(GroupedConfig._fields), "shapes": shapes}
    args.out.mkdir(parents=True, exist_ok=True)
    path = results_path(args.out, "fp8_configs", today, f"{args.config}_{args.name}" if args.name else args.config)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


if __name__ == "__main__":
    sys.exit(main())
