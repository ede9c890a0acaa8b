"""The composed import: config to a DDP- or FSDP-wrapped model with verified replicas.

Re-exports every public name of strategy-config, rng-fork, replica-init, ddp-wrap and
fsdp-wrap, including the reference module's ``__all__``.
"""

from __future__ import annotations

from ddp_wrap import (
    DelegatingDistributedDataParallel,
    check_wrap_preconditions,
    mark_forward_method,
    unwrap_ddp_module,
    unwrap_model,
    wrap_module_ddp,
)
from distributed_strategy._prepare import TrainablePolicy, prepare_model, resolve_config
from fsdp_wrap import (
    ShardPolicy,
    mixed_precision_policy,
    select_shard_targets,
    torch_dtype,
    wrap_module_fsdp,
)
from replica_init import (
    BUILD_SOURCES,
    ReplicaMismatchError,
    assert_replicas_identical,
    build_replicated_model,
    build_replicated_model_from_scratch,
    model_fingerprint,
)
from rng_fork import (
    SEED_MAX,
    SEED_MIN,
    DeviceLike,
    DeviceRngState,
    RngState,
    capture_rng_state,
    derive_seed,
    fork_model_rng,
    fork_rng,
    resolve_device,
    restore_rng_state,
)
from strategy_config import (
    DEFAULT_DISTRIBUTED_STRATEGY,
    DTYPE_NAMES,
    SUPPORTED_DISTRIBUTED_STRATEGIES,
    DistributedConfig,
    did_you_mean,
    is_ddp_strategy,
    load_distributed_config,
    normalize_distributed_strategy,
    normalize_dtype_name,
)

__all__ = [
    "BUILD_SOURCES",
    "DEFAULT_DISTRIBUTED_STRATEGY",
    "DTYPE_NAMES",
    "SEED_MAX",
    "SEED_MIN",
    "SUPPORTED_DISTRIBUTED_STRATEGIES",
    "DelegatingDistributedDataParallel",
    "DeviceLike",
    "DeviceRngState",
    "DistributedConfig",
    "ReplicaMismatchError",
    "RngState",
    "ShardPolicy",
    "TrainablePolicy",
    "assert_replicas_identical",
    "build_replicated_model",
    "build_replicated_model_from_scratch",
    "capture_rng_state",
    "check_wrap_preconditions",
    "derive_seed",
    "did_you_mean",
    "fork_model_rng",
    "fork_rng",
    "is_ddp_strategy",
    "load_distributed_config",
    "mark_forward_method",
    "mixed_precision_policy",
    "model_fingerprint",
    "normalize_distributed_strategy",
    "normalize_dtype_name",
    "prepare_model",
    "resolve_config",
    "resolve_device",
    "restore_rng_state",
    "select_shard_targets",
    "torch_dtype",
    "unwrap_ddp_module",
    "unwrap_model",
    "wrap_module_ddp",
    "wrap_module_fsdp",
]
