import logging
import sys
from pathlib import Path

import pytest

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
