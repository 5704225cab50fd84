"""The model's GPU as the current CUDA device while its kernels launch.

Triton launches a kernel on the current CUDA device, whichever device its tensors are on, and a CUDA
graph is captured on the current device's stream: an engine or a drafter on cuda:1 in a process
whose current device is cuda:0 (a verifier beside its drafter on a two-GPU host) failed at its first
launch. The entry points that run kernels (Engine's, ModelProposer's) enter their model's device;
on the CPU, or when it is current already, that changes nothing.
"""

from __future__ import annotations

import contextlib
import functools

import torch


def device_scope(device: torch.device | str):
    """A context in which `device` is the current CUDA device: nothing to do for the CPU, for "cuda"
    without an index, or when it is current already (an engine step's usual case: no device switch
    and back on the hot path)."""
    device = torch.device(device)
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def on_model_device(method):
    """A method of an object with a `model` (HybridModel), run under device_scope(model.device)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with device_scope(self.model.device):
            return method(self, *args, **kwargs)

    return run
