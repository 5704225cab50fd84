"""Triton kernels for the GPU path, each beside its torch reference (issue 4 builds them)."""
