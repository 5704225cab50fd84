"""presets/: the model shapes bench/, tests/ and training/ import stay outside the installed product,
and the GEMM benches' weight shapes, derived from a preset, are the ones the engine multiplies."""

import ast
from pathlib import Path

import torch

from bench import gemm
from presets.bench_models import weight_shapes
from presets.tiny import SPECS
from verifier.model import load_model

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("verifier", "drafter", "kernels")  # the folders pyproject.toml installs
NOT_INSTALLED = ("presets", "bench", "training", "tests")


def _top_level_imports(source: str) -> set[str]:
    """The first name of every absolute import in `source`, a function's lazy ones included."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_product_imports_no_preset_bench_training_or_test_module():
    offenders = [f"{path.relative_to(REPO)} imports {name}" for top in PRODUCT for path in sorted((REPO / top).rglob("*.py"))
                 for name in sorted(_top_level_imports(path.read_text()) & set(NOT_INSTALLED))]
    assert offenders == []


def test_weight_shapes_are_the_engines_gemms(hf_checkpoint):
    """weight_shapes on a Qwen3.5 text model's fields: the distinct [N, K] its loaded model multiplies."""
    model = load_model(hf_checkpoint("qwen3_5_text"), "cpu", torch.bfloat16)
    engine = {tuple(gw.weight.shape) for gw in gemm.linear_weights(model)[0]}
    assert set(weight_shapes(SPECS["qwen3_5_text"][1]).values()) == engine
