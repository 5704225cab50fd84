"""Dependencies run one way (DESIGN.md section 2): drafter may import what verifier shares, verifier
never imports drafter; and the drafter's promise holds: n-gram drafting needs no torch."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VERIFIER = REPO / "verifier"
# what the drafter side imports from verifier, and the client itself: none may pull torch in
TORCH_FREE = ("verifier.params", "verifier.generation", "verifier.proposers", "verifier.arguments", "drafter.client")


def _package_of(path: Path) -> list[str]:
    """verifier/a/b.py -> ["verifier", "a"]; verifier/a/__init__.py -> ["verifier", "a"]."""
    return list(path.relative_to(REPO).parent.parts)


def _imported_modules(source: str, package: list[str]) -> list[tuple[int, str]]:
    """(line, absolute name) of every import in `source`, a module of `package`; relative imports
    resolved. `from m import x` names both m and m.x (x may be a module)."""
    found = []
    for node in ast.walk(ast.parse(source)):  # every import, a function's lazy ones included
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.append((node.lineno, module))
            found += [(node.lineno, ".".join(filter(None, (module, alias.name)))) for alias in node.names]
    return found


def _drafter_imports(source: str, package: list[str]) -> list[tuple[int, str]]:
    return [(line, name) for line, name in _imported_modules(source, package)
            if name == "drafter" or name.startswith("drafter.")]


def test_verifier_never_imports_drafter():
    offenders = [f"{path.relative_to(REPO)}:{line} imports {name}" for path in sorted(VERIFIER.rglob("*.py"))
                 for line, name in _drafter_imports(path.read_text(), _package_of(path))]
    assert offenders == []


@pytest.mark.parametrize("source", [
    "import drafter.loop",
    "import numpy, drafter",
    "from drafter import loop",
    "from drafter.messages import Step",
    "def lazy():\n    from drafter.choose import make_proposer",
    "from ... import drafter",  # in verifier/a/b.py three dots reach the repository root
    "from ...drafter import cli",
])
def test_the_check_sees_every_form_of_import(source):
    assert _drafter_imports(source, ["verifier", "a"]), source


def test_the_check_lets_verifier_imports_through():
    source = "from ..engine import Engine\nimport verifier.params\nfrom . import ngram\n"
    assert _drafter_imports(source, ["verifier", "proposers"]) == []
    assert [name for _, name in _imported_modules(source, ["verifier", "proposers"])] == [
        "verifier.engine", "verifier.engine.Engine", "verifier.params", "verifier.proposers", "verifier.proposers.ngram"]


def test_the_shared_modules_and_the_client_load_without_torch():
    script = (f"import sys\nfor name in {TORCH_FREE!r}:\n    __import__(name)\n"
              "from verifier.proposers import NgramProposer\nNgramProposer().propose([1, 2, 1], 2)\n"
              "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
              "assert not loaded, loaded[:5]\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_model_drafter_loads_on_first_use():
    script = ("import sys\nimport verifier.proposers as p\nassert 'verifier.proposers.model' not in sys.modules\n"
              "assert p.ModelProposer.__module__ == 'verifier.proposers.model' and p.COUPLED == 'coupled'\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_pyproject_installs_every_package_and_the_kernels_under_their_own_name():
    """pyproject.toml lists its packages by hand (the kernels folder is mapped to `hybrid_kernels`,
    which discovery cannot do): the list must name every folder with an __init__.py, and kernels/
    must have none, or a checkout on sys.path would shadow Hugging Face's `kernels` package."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join(p.parent.relative_to(REPO).parts) for top in ("verifier", "drafter")
               for p in (REPO / top).rglob("__init__.py")}
    assert set(setup["packages"]) == folders | {"hybrid_kernels"}
    assert setup["package-dir"] == {"hybrid_kernels": "kernels"}
    assert not (REPO / "kernels" / "__init__.py").exists()


def test_a_checkout_leaves_the_name_kernels_to_hugging_face():
    """With the repository on sys.path first, `import kernels` must not find our folder as a regular
    package (transformers >= 5.25 imports Hugging Face's `kernels` by that name)."""
    probe = ("import importlib.util, sys; spec = importlib.util.find_spec('kernels'); "
             "print('none' if spec is None else ('namespace' if spec.origin in (None, 'namespace') else spec.origin))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    assert out == "none" or out == "namespace" or "site-packages" in out, out
