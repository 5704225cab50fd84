"""The compute dtypes the command lines offer (`--dtype NAME`), by name."""

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
