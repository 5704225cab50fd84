"""Kernel configs from a `python -m bench.fp8_configs` results file, put in place of the pinned ones
in this process, so that the engine (`python -m bench.fp8_real_size --candidates FILE`) and the
row-invariance sweep (`python -m bench.row_invariance --candidates FILE`) judge them before they
are pinned in the code; and the grouped FP8 experts' other K walks (`--expert-walk`), judged the
same way before one becomes the default.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ROWS_FIELDS = ("ROWS_TILE_FEATURES", "ROWS_WARPS", "ROWS_STAGES")  # kernels/linear_fp8.py's few-rows launch


def _value(text: str):
    return text == "True" if text in ("True", "False") else int(text)


def _fields(names: list[str], text: str) -> dict:
    return dict(zip(names, map(_value, text.split(","))))


def apply_winners(path: Path) -> dict[str, str]:
    """Each expert shape's best_overall config for grouped_config at that shape (FP8 weights, bf16
    activations), the experts' launches up to FEW_ROWS rows and from MANY_ROWS (few_rows.launch,
    many_rows.launch), and the few-rows FP8 launch with the least time relative to the pinned one
    summed over every dense shape (one launch serves them all). Fields a config names that the
    kernels no longer take are dropped. -> {what: the config applied}."""
    import hybrid_kernels.linear_fp8 as lf
    import hybrid_kernels.moe_grouped as mg

    results = json.loads(Path(path).read_text())
    shapes = results["shapes"]
    expert_fields = results.get("expert_fields", list(mg.GroupedConfig._fields))
    applied = {}
    for name, shape in shapes.items():
        if name.startswith("experts") and shape.get("best_overall"):
            _, i, h, _ = map(int, name.split()[1].split("x"))
            fields = _fields(expert_fields, shape["best_overall"])
            config = mg.GroupedConfig(**{f: v for f, v in fields.items() if f in mg.GroupedConfig._fields})
            pinned = mg.grouped_config

            def chosen(h_, i_, dtype, n_experts=0, top_k=0, fp8=False, config=config, h=h, i=i, pinned=pinned):
                if (h_, i_, fp8, dtype) == (h, i, True, torch.bfloat16):
                    return config
                return pinned(h_, i_, dtype, n_experts, top_k, fp8)

            mg.grouped_config = chosen
            applied[name] = shape["best_overall"]
    for tier, attr, what in (("few_rows", "FEW_ROWS_LAUNCH", "experts up to FEW_ROWS rows"),
                             ("many_rows", "MANY_ROWS_LAUNCH", "experts from MANY_ROWS rows")):
        launches = [shape[tier]["launch"] for name, shape in shapes.items()
                    if name.startswith("experts") and (shape.get(tier) or {}).get("launch")]
        if launches:  # one launch serves every shape (fitted to each): the first config's, as the sweep ran it
            setattr(mg, attr, dict(launches[0]))
            applied[what] = ",".join(f"{f}={v}" for f, v in launches[0].items())
    dense = [shape for name, shape in shapes.items() if name.startswith("dense") and isinstance(shape.get("pinned_ms"), dict)]
    valid = set.intersection(*({k for k, t in shape["candidates"].items() if isinstance(t, dict)} for shape in dense)) if dense else set()
    totals = {key: sum(t / shape["pinned_ms"][r] for shape in dense for r, t in shape["candidates"][key].items()) for key in valid}
    if totals:
        best = min(totals, key=totals.get)
        for field, value in _fields(results.get("dense_fields", list(ROWS_FIELDS)), best).items():
            if field in ROWS_FIELDS:
                setattr(lf, field, value)
        applied["rows kernel"] = best
    return applied


# The K walks of block-FP8 weights, name -> SCALE_AFTER_ON: the grouped experts'
# (kernels/moe_grouped.py) and the dense GEMMs' (kernels/linear_fp8.py), each set on its own
WALKS = {"scale-after": True, "dequantize": False}
WALK_MODULES = {"expert": "hybrid_kernels.moe_grouped", "dense": "hybrid_kernels.linear_fp8"}


def apply_walk(kind: str, name: str) -> None:
    """Put K walk `name` (WALKS) in place for this process's `kind` of weights (WALK_MODULES)."""
    import importlib

    importlib.import_module(WALK_MODULES[kind]).SCALE_AFTER_ON = WALKS[name]


def apply_k_parts(parts: int | None) -> int:
    """Put stage 1 of the experts' scale-after walk in `parts` K parts (None: the code's default) for
    this process -> the parts it takes now (kernels/moe_grouped.py, SCALE_AFTER_PARTS)."""
    import hybrid_kernels.moe_grouped as mg

    if parts is not None:
        mg.SCALE_AFTER_PARTS = parts
    return mg.SCALE_AFTER_PARTS


def current_walk(kind: str) -> str:
    """The name of the K walk `kind` of weights take now (the code's default, or what apply_walk set)."""
    import importlib

    now = importlib.import_module(WALK_MODULES[kind]).SCALE_AFTER_ON
    return next(name for name, on in WALKS.items() if on == now)
