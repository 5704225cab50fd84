"""Row invariance swept on the device: every GEMM and routed-experts shape of the published configs.
How it measures, what it checks and writes: bench/README.md, Methods, `bench.row_invariance`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

import torch

from bench import fp8_real_size
from bench.machine import device_name, name_arg, results_path
from hybrid_kernels import moe
from hybrid_kernels.linear import linear
from hybrid_kernels.linear_fp8 import FP8, BlockScales, linear_fp8, standard_scale_row
from presets.bench_models import MODELS
from presets.published import PUBLISHED, PUBLISHED_SIZES
from verifier.model.fp8 import BlockFP8Format, BlockFP8Weight, OutFeatureGroups, kept_real
from verifier.model.fp8_checkpoint import ALWAYS_KEPT, is_quantized
from verifier.model.hf_config import config_from_dict
from verifier.model.hybrid import HybridModel
from verifier.model.layers.mlp import MoE

FP8_BLOCK = 128
# what a block-FP8 checkpoint keeps in bf16: every writer's modules (the embedding, the head, the
# routers), those of the published files (bench/fp8_real_size.py: GDN's b and a inputs) and
# Qwen3-Next's b | a input, kept as Qwen3.5's are
FP8_FORMAT = BlockFP8Format(FP8_BLOCK, FP8_BLOCK, ALWAYS_KEPT + fp8_real_size.KEPT_MODULES + ("linear_attn.in_proj_ba",))


def sweep_configs() -> dict[str, dict]:
    """{name: config.json}: the published configs, and the bench models of presets/bench_models.py."""
    configs = {**PUBLISHED, **PUBLISHED_SIZES}
    configs.update({name: {"model_type": family, **fields} for name, (family, fields) in MODELS.items()})
    return configs


class MetaSource:
    """Stands in for verifier.model.checkpoint.TensorSource: hands out empty meta tensors of the
    shapes the layers ask for (FP8 where a published FP8 checkpoint stores the weight so, with
    fp8=True), so the layers join their weights as they do at load, with no bytes."""

    def __init__(self, dtype: torch.dtype, fp8: bool):
        self.device, self.dtype, self.fp8 = torch.device("meta"), dtype, fp8

    def has(self, name: str) -> bool:
        return name == "lm_head.weight"

    def take(self, name: str, shape: tuple[int, ...], *, fp32: bool = False):
        dtype = torch.float32 if fp32 else self.dtype
        empty = torch.empty(shape, dtype=dtype, device=self.device)
        if not self.fp8 or fp32 or not is_quantized(name, empty, FP8_FORMAT):
            return empty
        *lead, n, k = shape
        scales = BlockScales(torch.empty(*lead, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK), device=self.device),
                             standard_scale_row(n, FP8_BLOCK), FP8_BLOCK)
        return BlockFP8Weight(torch.empty(shape, dtype=FP8, device=self.device), scales, dtype)

    def take_flat(self, name: str, numel: int, *, fp32: bool = False) -> torch.Tensor:
        return torch.empty(numel, dtype=torch.float32 if fp32 else self.dtype, device=self.device)

    def leftovers(self) -> list[str]:
        return []


def model_weights(config: dict, fp8: bool) -> dict[tuple, list[str]]:
    """{(kind, dtype, shape): [where]} of every weight a step multiplies: kind "dense" with shape
    (N, K), or "experts" with (E, I, H, top_k); dtype "bf16", "fp32" or "fp8"."""
    parsed = config_from_dict(config)
    model = HybridModel(parsed, MetaSource(torch.bfloat16, fp8))
    found: dict[tuple, list[str]] = {}

    def add(weight, where: str, top_k: int = 0) -> None:
        if isinstance(weight, OutFeatureGroups):
            for i, group in enumerate(weight.groups):
                add(group, f"{where}[group {i}]")
            return
        dtype = "fp8" if isinstance(weight, BlockFP8Weight) else {torch.bfloat16: "bf16", torch.float32: "fp32"}[weight.dtype]
        if len(weight.shape) == 3:
            key = ("experts", dtype, (*weight.shape, top_k))
        else:
            key = ("dense", dtype, tuple(weight.shape))
        found.setdefault(key, []).append(where)

    for i, block in enumerate(model.blocks):
        for part_name, part in (("mixer", block.mixer), ("mlp", block.mlp)):
            owners = [(part_name, part)] + ([(f"{part_name}.shared", part.shared)] if getattr(part, "shared", None) else [])
            for owner_name, owner in owners:
                for attr, weight in vars(owner).items():
                    expert_stack = isinstance(owner, MoE) and attr in ("w_gate", "w_up", "w_down")  # added once, below
                    if not attr.startswith("w_") or expert_stack:
                        continue
                    add(weight, f"layer {i} {owner_name}.{attr}")
            if isinstance(part, MoE):
                add(part.w_gate, f"layer {i} mlp.experts", part.cfg.top_k)
    add(model.lm_head, "lm_head")
    return found


def dense_weight(n: int, k: int, dtype: str, gen: torch.Generator):
    if dtype != "fp8":
        return (torch.randn(n, k, generator=gen, device="cuda") / math.sqrt(k)).to(getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dtype]))
    values = (torch.randn(n, k, generator=gen, device="cuda") * 112).clamp_(-448, 448).to(FP8)
    scale = torch.empty(-(-n // FP8_BLOCK), -(-k // FP8_BLOCK), device="cuda").uniform_(-1, 1, generator=gen).exp2_() / (112 * math.sqrt(k))
    return values, BlockScales(scale, standard_scale_row(n, FP8_BLOCK, "cuda"), FP8_BLOCK)


def sweep_dense(n: int, k: int, dtype: str, max_rows: int, seed: int) -> dict:
    """Every row alone vs in the first M rows, M = 1 .. max_rows -> {M: rows differing} (empty: invariant)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    weight = dense_weight(n, k, dtype, gen)
    x_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    x = torch.randn(max_rows, k, generator=gen, device="cuda").to(x_dtype)
    if dtype == "fp8":  # as the engine runs it on CUDA: from DEQUANTIZED_ROWS on, what HybridModel.keep_fp8_reals keeps
        kept = kept_real(BlockFP8Weight(*weight, torch.bfloat16))
        op = lambda rows: linear_fp8(rows, *weight, real=kept.real, raw=kept.raw)  # noqa: E731
    else:
        op = lambda rows: linear(rows, weight)  # noqa: E731
    alone = torch.cat([op(x[r : r + 1]) for r in range(max_rows)])
    return _differing([(op(x[:m]) != alone[:m]).any(dim=1).sum() for m in range(1, max_rows + 1)])


def _differing(counts: list[torch.Tensor]) -> dict[int, int]:
    """Per row count M = 1.., the device scalar of its differing rows (read once at the end: no
    sync per launch) -> {M: rows differing} for the Ms with any."""
    return {m: n for m, n in enumerate(torch.stack(counts).tolist(), start=1) if n}


def sweep_experts(e: int, i: int, h: int, top_k: int, dtype: str, max_rows: int, seed: int) -> dict:
    """moe_experts(_fp8): every row alone vs in the first M rows, M = 1 .. max_rows."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if dtype == "fp8":
        stacks = []
        for n, k in ((i, h), (i, h), (h, i)):
            values, scales = dense_weight(e * n, k, "fp8", gen)
            stacks.append((values.view(e, n, k), BlockScales(scales.scale_inv.view(e, -(-n // FP8_BLOCK), -1), standard_scale_row(n, FP8_BLOCK, "cuda"),
                                                            FP8_BLOCK)))
        (wg, sg), (wu, su), (wd, sd) = stacks
        op = lambda x, ids, w: moe.moe_experts_fp8(x, ids, w, wg, wu, wd, (sg, su, sd))  # noqa: E731
    else:
        wg, wu = (dense_weight(e * i, h, "bf16", gen).view(e, i, h) for _ in range(2))
        wd = dense_weight(e * h, i, "bf16", gen).view(e, h, i)
        op = lambda x, ids, w: moe.moe_experts(x, ids, w, wg, wu, wd)  # noqa: E731
    x = torch.randn(max_rows, h, generator=gen, device="cuda").bfloat16()
    ids = torch.rand(max_rows, e, generator=gen, device="cuda").argsort(dim=1)[:, :top_k].contiguous()
    weights = torch.rand(max_rows, top_k, generator=gen, device="cuda")
    alone = torch.cat([op(x[r : r + 1], ids[r : r + 1], weights[r : r + 1]) for r in range(max_rows)])
    return _differing([(op(x[:m], ids[:m], weights[:m]) != alone[:m]).any(dim=1).sum() for m in range(1, max_rows + 1)])


def run(configs: dict[str, dict], max_rows: int, seed: int, log=print) -> dict:
    """The sweep of every distinct (kind, dtype, shape) of `configs` -> the results dict."""
    shapes: dict[tuple, list[str]] = {}
    per_config = {}
    for name, config in configs.items():
        found = {}
        for fp8 in (False, True):
            for key, where in model_weights(config, fp8).items():
                found.setdefault(key, where)
        per_config[name] = sorted(f"{kind} {dtype} {list(shape)}" for kind, dtype, shape in found)
        for key in found:
            shapes.setdefault(key, []).append(name)
    results = []
    for index, ((kind, dtype, shape), names) in enumerate(sorted(shapes.items())):
        start = time.perf_counter()
        if kind == "dense":
            differing = sweep_dense(*shape, dtype, max_rows, seed + index)
        else:
            differing = sweep_experts(*shape, dtype, max_rows, seed + index)
        torch.cuda.empty_cache()
        results.append({"kind": kind, "dtype": dtype, "shape": list(shape), "configs": names, "rows_swept": f"1..{max_rows}",
                        "row_counts_with_differing_rows": len(differing), "differing": {str(m): n for m, n in differing.items()},
                        "seconds": round(time.perf_counter() - start, 2)})
        log(f"[row_invariance] {kind} {dtype} {list(shape)}: {'invariant' if not differing else f'{len(differing)} row counts differ'} "
            f"({results[-1]['seconds']:.1f} s)")
    return {"configs": per_config, "shapes": results, "invariant": all(not r["differing"] for r in results)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder of the results JSON")
    parser.add_argument("--configs", default="all", help=f"comma-separated names, or all: {', '.join(sweep_configs())}")
    parser.add_argument("--max-rows", type=int, default=1024, help="row counts 1 .. this are swept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--expert-walk", choices=("scale-after", "dequantize"), default=None,
                        help="sweep the grouped FP8 experts with this K walk (bench/kernel_candidates.py's WALKS) "
                             "instead of the code's default; recorded as expert_walk")
    parser.add_argument("--expert-k-parts", type=int, choices=(1, 2), default=None,
                        help="sweep stage 1 of the experts' scale-after walk with H summed in this many parts "
                             "(kernels/moe_grouped.py, SCALE_AFTER_PARTS) instead of the code's default; recorded as "
                             "expert_k_parts")
    parser.add_argument("--dense-walk", choices=("scale-after", "dequantize"), default=None,
                        help="run the dense block-FP8 GEMMs with this K walk (bench/kernel_candidates.py's WALKS; "
                             "kernels/linear_fp8.py) instead of the code's default; recorded as dense_walk")
    parser.add_argument("--name", default="", type=name_arg, help="appended to the file name: what differs (e.g. the device)")
    parser.add_argument("--candidates", type=Path, default=None,
                        help="a bench.fp8_configs results file: sweep its winning kernel configs instead of the pinned ones "
                             "(recorded as kernel_candidates), as a change to them must be swept before it lands")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the sweep runs on a CUDA device (the interpreter's dot never mixes rows)", file=sys.stderr)
        return 2
    known = sweep_configs()
    names = list(known) if args.configs == "all" else args.configs.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"error: --configs: unknown {unknown}; known: {list(known)}", file=sys.stderr)
        return 2
    import triton

    candidates = {}
    if args.candidates is not None:
        from bench.kernel_candidates import apply_winners

        candidates = {"kernel_candidates": apply_winners(args.candidates)}
    from bench.kernel_candidates import apply_k_parts, apply_walk, current_walk

    for kind, walk in (("expert", args.expert_walk), ("dense", args.dense_walk)):
        if walk is not None:
            apply_walk(kind, walk)
        candidates[f"{kind}_walk"] = current_walk(kind)
    candidates["expert_k_parts"] = apply_k_parts(args.expert_k_parts)
    today = datetime.date.today().isoformat()
    out = {"device": device_name("cuda"), "date": today, "torch": torch.__version__, "triton": triton.__version__,
           "max_rows": args.max_rows, "seed": args.seed, **candidates,
           **run({n: known[n] for n in names}, args.max_rows, args.seed, lambda m: print(m, file=sys.stderr, flush=True))}
    args.out.mkdir(parents=True, exist_ok=True)
    path = results_path(args.out, "row_invariance", today, args.name)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"[row_invariance] {'every shape invariant' if out['invariant'] else 'DIFFERENCES'}: wrote {path}", file=sys.stderr)
    return 0 if out["invariant"] else 1


if __name__ == "__main__":
    sys.exit(main())
