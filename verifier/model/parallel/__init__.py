"""Tensor parallelism over N processes (DESIGN.md section 10): each rank holds its part of every
layer's weights (sharding.py), runs the same engine calls on the same inputs as every other rank
(SPMD), and the ranks meet in three collectives whose bits do not depend on the rows (group.py).
Bits are contractual within one parallel size: verify rows equal serial decode bitwise for that N.

    value = run_parallel(fn, N, *args)      # launch.py: fn(parallel, *args) on each rank
    model = load_model(dir, device, dtype, parallel=parallel)
"""

from .group import TensorParallel, split_evenly
from .launch import ParallelError, free_port, run_parallel
from .sharding import ShardedSource, ShardPlan, local_config

__all__ = ["ParallelError", "ShardPlan", "ShardedSource", "TensorParallel", "free_port", "local_config", "run_parallel", "split_evenly"]
