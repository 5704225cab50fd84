import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

# Tiny models: one thread per test process (xdist runs one process per core, and the CLI tests'
# subprocesses inherit this), so workers do not oversubscribe the cores.
os.environ["OMP_NUM_THREADS"] = "1"
# Without a GPU the Triton kernels run on the CPU through Triton's interpreter (set before any
# import of triton). Kernel tests then use tiny shapes.
import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).parent))

from presets.hf_reference import save_spec  # noqa: E402
from presets.mtp import add_mtp_tensors  # noqa: E402
from presets.tiny import SPECS  # noqa: E402

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


@pytest.fixture(scope="session")
def mtp_checkpoint(hf_checkpoint, tmp_path_factory):
    """mtp_checkpoint(name) -> a copy of hf_checkpoint(name) with a random published-layout MTP head
    (presets/mtp.py), built once per session."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            path = tmp_path_factory.mktemp(f"{name}_mtp") / "m"
            shutil.copytree(hf_checkpoint(name), path)
            cache[name] = add_mtp_tensors(path)
        return cache[name]

    return get


ALL_SPECS = sorted(SPECS)


def pytest_addoption(parser):
    parser.addoption("--model-device", default="cpu", choices=["cpu", "cuda"],
                     help="device the engine and bit-exactness tests load models on (cuda: the Triton backend)")


@pytest.fixture(scope="session")
def model_device(request):
    device = request.config.getoption("--model-device")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("--model-device cuda, but there is no GPU")
    return device


@pytest.fixture(scope="session")
def load_target(hf_checkpoint, model_device):
    """load_target(name) -> our model of checkpoint `name` on --model-device (cached per session)."""
    from verifier.model import load_model

    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_model(hf_checkpoint(name), model_device)
        return cache[name]

    return get


@pytest.fixture
def self_signed(tmp_path):
    """(cert, key): a self-signed PEM certificate for localhost and 127.0.0.1, made with the openssl
    command line (the TLS tests skip without it)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", key, "-out", cert],
                   check=True, capture_output=True, timeout=60)
    return cert, key
