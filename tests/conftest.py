import logging
import os
import sys
from pathlib import Path

# Tiny models: one thread per test process (xdist runs one process per core, and the CLI tests'
# subprocesses inherit this), so workers do not oversubscribe the cores.
os.environ["OMP_NUM_THREADS"] = "1"
# Without a GPU the Triton kernels run on the CPU through Triton's interpreter (set before any
# import of triton). Kernel tests then use tiny shapes.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).parent))

from hf_models import SPECS, save_spec  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(name) -> directory of a transformers-saved tiny checkpoint (built once per session)."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = save_spec(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


ALL_SPECS = sorted(SPECS)
