"""Regenerate the committed wire code from proto/: the one build step of the protocol.

    python -m verifier.rpc.build          # rewrites verifier/v1/verifier_pb2.py and verifier_pb2.pyi
    python -m verifier.rpc.build --check  # exit 1 if a committed file differs from what proto/ generates

The generator is pinned (GRPCIO_TOOLS): generated code depends on the release that wrote it, and newer
releases write code that refuses older runtimes (protobuf gencode from 5.27, e.g. grpcio-tools 1.66's, imports
`google.protobuf.runtime_version`, absent from 4.25, and refuses runtimes older than itself). 1.59.0 is the oldest
release with wheels for CPython 3.10-3.12, and its output loads on every protobuf (4.25 through 7.x) and grpcio
(1.60 on) that pyproject.toml allows: proto/README.md says how that was checked. It is installed on first
use, wheel only and without dependencies, into a cache folder of its own (never into the environment) and
run in a subprocess, so whichever grpcio-tools the environment has does not matter. No service code is
generated: `verifier.rpc` builds the stub and the servicer handler from the service's descriptor.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

GRPCIO_TOOLS = "1.59.0"  # bundles protoc 24.3
ROOT = Path(__file__).resolve().parents[2]
PROTO_FILE = "verifier/v1/verifier.proto"  # below proto/; also the file name registered in the descriptor pool
GENERATED = ("verifier/v1/verifier_pb2.py", "verifier/v1/verifier_pb2.pyi")
DEFAULT_CACHE = Path.home() / ".cache" / "hybrid-spec-verifier"

# What `python -m grpc_tools.protoc` runs. Its module is not used: in 1.59 it imports pkg_resources,
# which recent setuptools no longer ships.
_RUN_PROTOC = "import sys; from grpc_tools import _protoc_compiler; " \
              "sys.exit(_protoc_compiler.run_main([a.encode() for a in sys.argv[1:]]))"


def grpcio_tools(cache: Path = DEFAULT_CACHE) -> Path:
    """The folder holding the pinned grpcio-tools for this interpreter; installs it there on first use."""
    target = cache / f"grpcio-tools-{GRPCIO_TOOLS}-{sys.implementation.cache_tag}"  # protoc is a C extension
    if (target / "grpc_tools").is_dir():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # installed beside the target and renamed into place: a concurrent run never sees half an install
    staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=cache))
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--only-binary", ":all:", "--target", str(staging), f"grpcio-tools=={GRPCIO_TOOLS}"]
    done = subprocess.run(pip, capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"cannot install grpcio-tools=={GRPCIO_TOOLS} into {target} "
                           f"(pip exit {done.returncode}):\n{done.stderr.strip()}")
    try:
        staging.rename(target)
    except OSError:  # another run put it there first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def generate(out: Path, cache: Path = DEFAULT_CACHE) -> None:
    """Run the pinned protoc on proto/, writing GENERATED below `out` (the repo root, or a folder to compare)."""
    tools = grpcio_tools(cache)
    protoc = ["protoc", "-Iproto", f"-I{tools / 'grpc_tools' / '_proto'}",  # the same includes grpc_tools.protoc adds
              f"--python_out={out}", f"--pyi_out={out}", f"proto/{PROTO_FILE}"]
    # relative paths from the repo root: the generated files name the proto as PROTO_FILE, nothing of this machine
    done = subprocess.run([sys.executable, "-c", _RUN_PROTOC, *protoc], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tools)})
    if done.returncode != 0:
        raise RuntimeError(f"protoc (grpcio-tools {GRPCIO_TOOLS}) failed on proto/{PROTO_FILE} "
                           f"(exit {done.returncode}):\n{done.stderr.strip()}")


def stale_files(cache: Path = DEFAULT_CACHE) -> list[str]:
    """The generated files (paths from the repo root) whose committed bytes differ from what proto/ generates
    now, missing or unexpected ones included; empty when the committed code is current."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp), cache)
        produced = {path.relative_to(tmp).as_posix() for path in Path(tmp).rglob("*") if path.is_file()}
        names = sorted(produced | set(GENERATED))
        return [name for name in names if not _same_bytes(ROOT / name, Path(tmp) / name)]


def _same_bytes(a: Path, b: Path) -> bool:
    return a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verifier.rpc.build", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a committed generated file differs from what proto/ generates")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                        help=f"folder the pinned grpcio-tools {GRPCIO_TOOLS} is installed into on first use")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files(args.cache)
        if stale:
            print(f"stale: {', '.join(stale)}: run python -m verifier.rpc.build", file=sys.stderr)
            return 1
        print(f"{', '.join(GENERATED)} are current")
        return 0
    generate(ROOT, args.cache)
    print(f"wrote {', '.join(GENERATED)} from proto/{PROTO_FILE} with grpcio-tools {GRPCIO_TOOLS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
