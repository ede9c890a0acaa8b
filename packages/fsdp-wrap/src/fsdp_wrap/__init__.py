"""Shard a model with torch's ``fully_shard`` (FSDP2; HSDP on a 2-D mesh) by a simple policy."""

from __future__ import annotations

from fsdp_wrap._policy import ShardPolicy, select_shard_targets
from fsdp_wrap._precision import mixed_precision_policy, torch_dtype
from fsdp_wrap._wrap import hsdp_mesh, offload_policy, wrap_module_fsdp

__all__ = [
    "ShardPolicy",
    "hsdp_mesh",
    "mixed_precision_policy",
    "offload_policy",
    "select_shard_targets",
    "torch_dtype",
    "wrap_module_fsdp",
]
