"""The rules every distributed-strategy stage shares, each defined once.

What a device argument means; who launched the process (torchrun's or SLURM's variables,
``detect_launch``) and how its process group is started (``init_distributed``); whether a
process group is initialized, this rank and rank-0 logging; how every rank reaches the same
verdict on a failure (``agree``, ``agreed_error``, ``all_reduce_agreed``); the checks before a
data-parallel wrap; what a model is wrapped in; how an untrusted file is opened
(``open_regular``, ``read_regular``) and how a written one is made durable (``fsync_file``,
``fsync_dir``, ``fsync_tree``, ``make_dirs``); how much memory a stretch of work took
(``current_rss``, ``MemoryPeak``); the replica groups a model's sums span beyond its process
group (``replica_reduce``, set by fault tolerance).
"""

from __future__ import annotations

from dist_core._agree import agree, agreed_error, all_reduce_agreed
from dist_core._checks import check_forward_methods, check_wrap_preconditions
from dist_core._devices import (
    DeviceLike,
    accelerator_type,
    on_device,
    require_current_device,
    require_device_index,
    resolve_device,
)
from dist_core._durable import fsync_dir, fsync_file, fsync_tree, make_dirs
from dist_core._files import open_regular, read_regular
from dist_core._group import (
    bound_device,
    collective_device,
    is_distributed,
    log_rank0,
    names_nccl,
    rank,
    require_process_group,
    world_size,
)
from dist_core._init import DEFAULT_TIMEOUT, init_distributed
from dist_core._launch import Launch, detect_launch, expand_nodelist, slurm_job_id, slurm_port
from dist_core._memory import MemoryPeak, current_rss
from dist_core._replicas import ReplicaReduce, replica_reduce, set_replica_reduce
from dist_core._wrapped import (
    Strategy,
    compute_device,
    fsdp_mesh,
    fsdp_modules,
    local_tensor,
    mesh_device,
    state_groups,
    strategy_of,
    unwrap_compiled,
    unwrap_model,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "DeviceLike",
    "Launch",
    "MemoryPeak",
    "ReplicaReduce",
    "Strategy",
    "accelerator_type",
    "agree",
    "agreed_error",
    "all_reduce_agreed",
    "bound_device",
    "check_forward_methods",
    "check_wrap_preconditions",
    "collective_device",
    "compute_device",
    "current_rss",
    "detect_launch",
    "expand_nodelist",
    "fsdp_mesh",
    "fsdp_modules",
    "fsync_dir",
    "fsync_file",
    "fsync_tree",
    "init_distributed",
    "is_distributed",
    "local_tensor",
    "log_rank0",
    "make_dirs",
    "mesh_device",
    "names_nccl",
    "on_device",
    "open_regular",
    "rank",
    "read_regular",
    "replica_reduce",
    "require_current_device",
    "require_device_index",
    "require_process_group",
    "resolve_device",
    "set_replica_reduce",
    "slurm_job_id",
    "slurm_port",
    "state_groups",
    "strategy_of",
    "unwrap_compiled",
    "unwrap_model",
    "world_size",
]
