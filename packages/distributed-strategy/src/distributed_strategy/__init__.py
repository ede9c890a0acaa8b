"""The composed import: what a trainer calls, from config to a wrapped, checkpointed model.

``distributed_strategy.__all__`` is the pipeline (``prepare_model`` and its config), the train
step's helpers (``no_sync``, ``clip_grad_norm``, ``global_count`` / ``count_mean``,
``SampleOrder``, the RNG forks, the replica checks), checkpoints, pretrained weights, the
launch, and their errors and result types; plus the reference module's seven names
(``DelegatingDistributedDataParallel``, ``SUPPORTED_DISTRIBUTED_STRATEGIES``,
``build_replicated_model_from_scratch``, ``is_ddp_strategy``,
``normalize_distributed_strategy``, ``unwrap_ddp_module``, ``wrap_module_ddp``). Every other
public name (devices, process groups, files, policies, buffer sizes) stays in the package that
owns it: ``from dist_core import compute_device``, ``from fsdp_wrap import offload_policy``,
``from distributed_strategy.recipe import selective_kept``.
"""

from __future__ import annotations

from checkpoint_io import (
    CheckpointError,
    CheckpointInfo,
    CheckpointManager,
    PendingCheckpoint,
    async_save_checkpoint,
    consolidate_checkpoint,
    full_state_dict,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from ddp_wrap import DelegatingDistributedDataParallel, unwrap_ddp_module, wrap_module_ddp
from dist_core import Strategy, init_distributed, strategy_of, unwrap_model
from distributed_strategy._prepare import prepare_model
from distributed_strategy._trainable import TrainablePolicy
from distributed_strategy.recipe import apply_block_recipe
from fsdp_wrap import wrap_module_fsdp
from grad_sync import clip_grad_norm, count_mean, data_parallel_size, global_count, no_sync
from hf_io import PretrainedInfo, load_pretrained, save_pretrained
from replica_init import (
    DriftReport,
    ReplicaMismatchError,
    assert_replicas_identical,
    build_replicated_model,
    build_replicated_model_from_scratch,
    replica_drift,
    state_fingerprint,
)
from rng_fork import derive_seed, fork_rng, seed_rng
from sample_order import SampleOrder
from strategy_config import (
    SUPPORTED_DISTRIBUTED_STRATEGIES,
    DistributedConfig,
    is_ddp_strategy,
    load_distributed_config,
    normalize_distributed_strategy,
)

__all__ = [
    "SUPPORTED_DISTRIBUTED_STRATEGIES",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "DelegatingDistributedDataParallel",
    "DistributedConfig",
    "DriftReport",
    "PendingCheckpoint",
    "PretrainedInfo",
    "ReplicaMismatchError",
    "SampleOrder",
    "Strategy",
    "TrainablePolicy",
    "apply_block_recipe",
    "assert_replicas_identical",
    "async_save_checkpoint",
    "build_replicated_model",
    "build_replicated_model_from_scratch",
    "clip_grad_norm",
    "consolidate_checkpoint",
    "count_mean",
    "data_parallel_size",
    "derive_seed",
    "fork_rng",
    "full_state_dict",
    "global_count",
    "init_distributed",
    "is_ddp_strategy",
    "latest_checkpoint",
    "load_checkpoint",
    "load_distributed_config",
    "load_pretrained",
    "no_sync",
    "normalize_distributed_strategy",
    "prepare_model",
    "replica_drift",
    "save_checkpoint",
    "save_pretrained",
    "seed_rng",
    "state_fingerprint",
    "strategy_of",
    "unwrap_ddp_module",
    "unwrap_model",
    "wrap_module_ddp",
    "wrap_module_fsdp",
]
