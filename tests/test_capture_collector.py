"""verifier/model/graphs.collector_paused, which every CUDA graph capture (graph buckets, draft chains)
runs under: it needs no GPU."""

import gc

import pytest

from verifier.model.graphs import collector_paused


def test_collector_paused_during_a_capture_and_restored():
    """The cycle collector is off inside a capture (graphs.collector_paused: a collection there may
    destroy an unreachable engine's graph mid-capture) and as it was after, an exception included."""
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="inside"):
        with collector_paused():
            raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled(), "a collector that was off stays off"
    finally:
        gc.enable()
