"""Validate the ``training.distributed`` section of a trainer config.

Pure Python: importing this package never imports torch.
"""

from __future__ import annotations

from strategy_config._config import (
    BUILD_SOURCES,
    DTYPE_NAMES,
    DistributedConfig,
    load_distributed_config,
    normalize_dtype_name,
)
from strategy_config._fault_tolerance import FaultToleranceConfig
from strategy_config._hints import did_you_mean
from strategy_config._recipe import (
    CHECKPOINT_MODES,
    OFFLOAD_MODES,
    normalize_checkpointing,
    normalize_offload,
)
from strategy_config._strategy import (
    DEFAULT_DISTRIBUTED_STRATEGY,
    SUPPORTED_DISTRIBUTED_STRATEGIES,
    is_ddp_strategy,
    normalize_distributed_strategy,
)

__all__ = [
    "BUILD_SOURCES",
    "CHECKPOINT_MODES",
    "DEFAULT_DISTRIBUTED_STRATEGY",
    "DTYPE_NAMES",
    "OFFLOAD_MODES",
    "SUPPORTED_DISTRIBUTED_STRATEGIES",
    "DistributedConfig",
    "FaultToleranceConfig",
    "did_you_mean",
    "is_ddp_strategy",
    "load_distributed_config",
    "normalize_checkpointing",
    "normalize_distributed_strategy",
    "normalize_dtype_name",
    "normalize_offload",
]
