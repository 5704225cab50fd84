"""The row-invariant GEMM against cuBLAS, on weight shapes the engine multiplies.
How it measures, what it checks and writes: bench/README.md, Methods, `bench.gemm`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.runtime.errors import OutOfResources

from bench.machine import device_name
from hybrid_kernels.linear import linear, linear_config, tile_for_rows
from presets.bench_models import DENSE_2B, weight_shapes
from verifier.model.fp8 import BlockFP8Weight, OutFeatureGroups
from verifier.model.graphs import collector_paused

_2B = weight_shapes(DENSE_2B)
# [N, K] as the engine multiplies (the 2B model of presets/bench_models.py): GDN's q|k|v|z|b|a,
# attention's q(+gate)|k|v, the output projections (GDN's and attention's share a shape), the MLP's
# gate|up and down, the LM head
SHAPES = {"gdn_in_proj": _2B["gdn_in"], "attn_qkv": _2B["attn_qkv"], "out_proj": _2B["attn_o"],
          "mlp_gate_up": _2B["mlp_gate_up"], "mlp_down": _2B["mlp_down"], "lm_head": _2B["lm_head"]}
ROWS = (1, 9, 72, 576)
CHECK_ROWS = 1024  # row_invariant's largest product
SWEEP = [(bm, bn, wp, st) for bm in (16, 64, 128) for bn in (64, 128, 256) for wp, st in ((4, 3), (8, 4)) if not (bm == 16 and wp == 8)]

# weights a model multiplies elsewhere than hybrid_kernels.linear (the reasons `linear_weights` gives)
ROUTED_EXPERTS = "routed experts [E, N, K]: kernels/moe.py, grouped by expert (kernels/moe_grouped.py)"
FP8_WEIGHTS = "block-FP8 weights: kernels/linear_fp8.py"
MODEL_GEMM_WHAT = ("hybrid_kernels.linear (its tile for M rows) against torch.matmul (cuBLAS) on each distinct [N, K] weight in the "
                   "model's dtype that the engine multiplies through hybrid_kernels.linear: the model's own weight, the first of that "
                   "shape in forward order, named 'layer i <mixer or mlp> <attribute>' (count: weights of that shape); "
                   "CUDA-graph replays, median; TFLOP/s = 2 M N K / time; row_invariant checked first, no timing when it "
                   "or the model's bitexact gate is red (untimed says why); biases left out. Not here (skipped): routed "
                   "experts, block-FP8 weights and weights in another dtype (Kimi's fp32 router), which other kernels or "
                   "an fp32 GEMM multiply; bench.gemm also sweeps tiles")


@dataclass(frozen=True)
class GemmWeight:
    """A distinct weight shape the engine multiplies through hybrid_kernels.linear: the first weight of that
    shape in forward order, its name, and how many of the model's weights have the shape."""

    name: str
    weight: torch.Tensor  # [N, K], the model's dtype: the tensor the layer hands to hybrid_kernels.linear
    count: int


def _named_weights(model):
    """(name, weight) of every linear weight in forward order: per block its mixer's w_* attributes,
    its MLP's (a MoE's shared expert under 'shared'), then the LM head. Weights of the layers are
    the w_* attributes of verifier/model/layers' classes."""
    cfg = model.config
    for i, block in enumerate(model.blocks):
        parts = [(f"layer {i} {cfg.mixers[i]}", block.mixer), (f"layer {i} {cfg.mlps[i]}", block.mlp)]
        if getattr(block.mlp, "shared", None) is not None:
            parts.append((f"layer {i} {cfg.mlps[i]} shared", block.mlp.shared))
        for prefix, part in parts:
            for attr, value in vars(part).items():
                if attr.startswith("w_"):
                    yield f"{prefix} {attr}", value
    yield "lm_head", model.lm_head


def linear_weights(model) -> tuple[list[GemmWeight], dict[str, int]]:
    """A loaded HybridModel -> (one GemmWeight per distinct [N, K] the engine multiplies through
    hybrid_kernels.linear in the model's dtype, in forward order; {why not: weights} of the others).
    An OutFeatureGroups' plain groups go through hybrid_kernels.linear ('<name> group j'), its FP8 groups not."""
    first: dict[tuple[int, int], tuple[str, torch.Tensor]] = {}
    counts: Counter = Counter()
    skipped: Counter = Counter()
    for name, weight in _named_weights(model):
        groups = enumerate(weight.groups) if isinstance(weight, OutFeatureGroups) else [(None, weight)]
        for j, w in groups:
            if isinstance(w, BlockFP8Weight):
                skipped[ROUTED_EXPERTS if w.data.dim() == 3 else FP8_WEIGHTS] += 1
            elif w.dim() == 3:
                skipped[ROUTED_EXPERTS] += 1
            elif w.dtype != model.dtype:
                dtype = str(w.dtype).removeprefix("torch.")
                skipped[f"{dtype} weights, not the model's dtype (Kimi's router): hybrid_kernels.linear in {dtype}, not timed"] += 1
            else:
                shape = tuple(w.shape)
                first.setdefault(shape, (name if j is None else f"{name} group {j}", w))
                counts[shape] += 1
    return [GemmWeight(name, w, counts[shape]) for shape, (name, w) in first.items()], dict(skipped)


def graph_ms(fn, repeats: int, launches: int = 20) -> float:
    """Median ms of one fn() replayed from a CUDA graph of `launches` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with collector_paused(), torch.cuda.graph(graph):  # a collection mid-capture can break it (verifier/model/graphs.py)
        for _ in range(launches):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / launches)
    return statistics.median(times)


def row_invariant(x: torch.Tensor, w: torch.Tensor) -> bool:
    """x [CHECK_ROWS, K]: rows of every M-row product equal those of the 1024-row product and of each row alone."""
    full = linear(x, w)
    for m in ROWS:
        if not torch.equal(linear(x[:m], w), full[:m]):
            return False
    return all(torch.equal(linear(x[i : i + 1].clone(), w), full[i : i + 1]) for i in (0, 7, 100, 575, 1023))


def tiles_equal(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int]:
    """(tiles giving the pinned tile's bits, tiles tried), on the pinned K walk (BLOCK_K kept). A
    tile whose pipeline does not fit in shared memory is not counted as tried."""
    n, k = w.shape
    pinned = linear_config(n, k, w.dtype)
    want = linear(x, w, config=pinned)
    equal = tried = 0
    for bm, bn, wp, st in SWEEP:
        try:
            got = linear(x, w, config=pinned._replace(BLOCK_M=bm, BLOCK_N=bn, num_warps=wp, num_stages=st))
        except OutOfResources:
            continue
        tried += 1
        equal += torch.equal(got, want)
    return equal, tried


def _sig(value: float) -> float:
    """Four significant digits: a few-microsecond launch keeps its digits, as a 0.7 ms one does."""
    return float(f"{value:.4g}")


def time_rows(x: torch.Tensor, w: torch.Tensor, m: int, repeats: int) -> dict:
    """Ours and cuBLAS on the first m rows of x against w [N, K] (CUDA)."""
    n, k = w.shape
    xm = x[:m].contiguous()
    out = torch.empty(m, n, device=w.device, dtype=w.dtype)
    ours = graph_ms(lambda: linear(xm, w, out=out), repeats)
    cublas = graph_ms(lambda: torch.matmul(xm, w.t(), out=out), repeats)
    flop = 2 * m * n * k
    tile = tile_for_rows(linear_config(n, k, w.dtype), n, m, w.dtype)
    return {"ours_ms": _sig(ours), "cublas_ms": _sig(cublas), "ours_tflops": _sig(flop / ours / 1e9),
            "cublas_tflops": _sig(flop / cublas / 1e9), "ours_over_cublas": round(cublas / ours, 3),
            "tile": [tile.BLOCK_M, tile.BLOCK_N, tile.BLOCK_K, tile.num_warps, tile.num_stages], "tma": tile.TMA}


def measure(name: str, w: torch.Tensor, repeats: int, *, sweep: bool = False, untimed: str | None = None) -> dict:
    """One weight w [N, K] (bf16 on CUDA to be timed): its checks, then, when they are green and
    untimed (a reason not to time, such as a red gate elsewhere) is None, its timing per M in ROWS.
    -> N, K, split_k, row_invariant, [tiles_equal with sweep], ok, rows ({M: figures} or None),
    [untimed: why rows is None]."""
    n, k = w.shape
    gen = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(CHECK_ROWS, k, device=w.device, generator=gen).to(w.dtype)
    figures = {"N": n, "K": k, "split_k": linear_config(n, k, w.dtype).SPLIT_K, "row_invariant": row_invariant(x, w)}
    ok = figures["row_invariant"]
    if sweep:
        equal, tried = tiles_equal(x[: max(ROWS)], w)
        figures["tiles_equal"] = f"{equal}/{tried}"
        ok = ok and equal == tried
    figures["ok"] = ok
    if not ok:  # no timing reported when a gate is red
        untimed = "row_invariant is False" if not figures["row_invariant"] else f"tiles_equal is {figures['tiles_equal']}"
    figures["rows"] = None if untimed else {str(m): time_rows(x, w, m, repeats) for m in ROWS}
    if untimed:
        figures["untimed"] = untimed
    timing = (f"untimed: {untimed}" if untimed else
              "; ".join(f"M {m}: {r['ours_tflops']} vs {r['cublas_tflops']} TF/s ({r['ours_over_cublas']:.2f})" for m, r in figures["rows"].items()))
    print(f"[gemm] {name} [{n}, {k}] split {figures['split_k']}: row-invariant {figures['row_invariant']}"
          + (f", tiles equal {figures['tiles_equal']}" if sweep else "") + f"; {timing}", file=sys.stderr, flush=True)
    return figures


def model_gemm(model, repeats: int = 10, untimed: str | None = None) -> dict:
    """bench.gpu's `gemm` section: `measure` (no tile sweep) on each distinct weight of a loaded
    model (`linear_weights`). untimed: the model's red gate, if any (then no shape is timed)."""
    weights, skipped = linear_weights(model)
    shapes = {gw.name: {"count": gw.count, **measure(gw.name, gw.weight, repeats, untimed=untimed)} for gw in weights}
    return {"what": MODEL_GEMM_WHAT, "rows": list(ROWS), "repeats": repeats,
            "all_row_invariant": all(s["row_invariant"] for s in shapes.values()), "skipped": skipped, "shapes": shapes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gemm", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory for gemm_<date>.json")
    parser.add_argument("--repeats", type=int, default=20, help="timed graph replays per figure (the median is kept)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gemm needs a CUDA device", file=sys.stderr)
        return 2
    shapes = {}
    for name, (n, k) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16()
        shapes[name] = measure(name, w, args.repeats, sweep=True)
    date = datetime.date.today().isoformat()
    result = {"device": device_name("cuda"), "date": date, "torch": torch.__version__, "triton": triton.__version__,
              "rows": list(ROWS), "shapes": shapes}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gemm_{date}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"[gemm] wrote {path}", file=sys.stderr)
    return 0 if all(s["ok"] for s in shapes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
