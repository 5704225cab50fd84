"""What machine a benchmark ran on, for its results file."""

from __future__ import annotations

import platform

import torch


def device_name(device: str = "cpu") -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + f" ({torch.get_num_threads()} threads)"
    except OSError:
        pass
    return platform.processor() or "cpu"
