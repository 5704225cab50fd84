"""kernels/dependent_launch.py: programmatic dependent launch is on only where it can run (a CUDA
device of compute capability 9.0 or newer, not the interpreter, not switched off by VERIFIER_PDL=0),
within `suspended()` it is off for the launches of that thread only; and on the GPU a CUDA graph
of dependent kernels launched with it gives torch.equal what the same graph gives without it
(each kernel waits for the one before; a kernel two back is covered too)."""

import threading

import pytest
import torch

from hybrid_kernels import dependent_launch
from hybrid_kernels.dependent_launch import launch_options
from hybrid_kernels.linear import linear
from hybrid_kernels.norms import add_rms_norm


@pytest.fixture
def pdl_switch(monkeypatch):
    """Set VERIFIER_PDL for the test's launches (the per-device choice is cached: cleared around)."""
    def switch(on: bool) -> None:
        monkeypatch.setenv("VERIFIER_PDL", "1" if on else "0")
        dependent_launch._options.cache_clear()
    yield switch
    monkeypatch.undo()
    dependent_launch._options.cache_clear()


def test_off_on_the_cpu():
    assert launch_options(torch.device("cpu")) == {"PDL": False}


def test_off_under_the_interpreter_and_when_switched_off(monkeypatch, pdl_switch):
    """A CUDA device (named, not touched) gets PDL off under the interpreter and with VERIFIER_PDL=0:
    neither asks the device anything."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert launch_options(cuda) == {"PDL": False}
    monkeypatch.delenv("TRITON_INTERPRET")
    pdl_switch(False)
    assert launch_options(cuda) == {"PDL": False}


def test_suspended_is_off_for_its_thread_only(monkeypatch):
    """The device's choice stubbed to on (no device is asked): off inside suspended(), nested too,
    on again after it, and on for another thread's launches meanwhile."""
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(dependent_launch, "_options", lambda index: dependent_launch._ON)
    on, off = {"PDL": True, "launch_pdl": True}, {"PDL": False}
    assert launch_options(cuda) == on
    other = []
    with dependent_launch.suspended():
        assert launch_options(cuda) == off
        with dependent_launch.suspended():
            assert launch_options(cuda) == off
        assert launch_options(cuda) == off
        thread = threading.Thread(target=lambda: other.append(launch_options(cuda)))
        thread.start()
        thread.join()
    assert other == [on]
    assert launch_options(cuda) == on
    with pytest.raises(RuntimeError), dependent_launch.suspended():
        raise RuntimeError("left by an exception")
    assert launch_options(cuda) == on


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_switch_and_capability(pdl_switch):
    device = torch.device("cuda", torch.cuda.current_device())
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    pdl_switch(True)
    assert launch_options(device)["PDL"] is hopper
    assert launch_options(device).get("launch_pdl", False) is hopper
    pdl_switch(False)
    assert launch_options(device) == {"PDL": False}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_of_dependent_kernels_equals_without_pdl(pdl_switch):
    """A model's residual stream, every launch a Triton kernel with PDL: add-and-norm (it reads the
    stream, written two kernels back, and the GEMM before it), then a GEMM. The graph's output with
    PDL is the output without it, bit for bit, replay after replay."""
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, layers = 512, 12
    x = torch.randn(3, hidden, device="cuda", generator=g).to(torch.bfloat16)
    weights = [(torch.randn(hidden, hidden, device="cuda", generator=g) / hidden**0.5).to(torch.bfloat16) for _ in range(layers)]
    norm_w = torch.randn(hidden, device="cuda", generator=g).to(torch.bfloat16)

    def body(inp: torch.Tensor) -> torch.Tensor:
        stream, update = inp, torch.zeros_like(inp)
        for w in weights:
            stream, normed = add_rms_norm(update, stream, norm_w, 1e-6, False)
            update = linear(normed, w)
        return stream + update

    outputs = {}
    for on in (False, True):
        pdl_switch(on)
        static = x.clone()
        body(static)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = body(static)
        replays = []
        for _ in range(3):
            graph.replay()
            replays.append(out.clone())
        torch.cuda.synchronize()
        assert all(torch.equal(r, replays[0]) for r in replays), f"PDL {on}: replays differ"
        outputs[on] = replays[0]
    assert torch.equal(outputs[True], outputs[False])
