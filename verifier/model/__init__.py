"""The hybrid model: configuration, checkpoint loading, layers, slot state, and the reference forward."""

from .checkpoint import CheckpointError
from .config import ModelConfig
from .hf_config import ConfigError, load_config
from .hybrid import HybridModel, load_model
from .mtp import MTPHead, load_mtp_head
from .rows import RowBatch
from .state import PoolFullError, SlotPool

__all__ = ["CheckpointError", "ConfigError", "HybridModel", "MTPHead", "ModelConfig", "PoolFullError", "RowBatch", "SlotPool", "load_config", "load_model", "load_mtp_head"]
