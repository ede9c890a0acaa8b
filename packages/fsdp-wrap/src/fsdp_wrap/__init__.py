"""Shard a model with torch's ``fully_shard`` (FSDP2) from a simple policy."""

from __future__ import annotations

from fsdp_wrap._policy import ShardPolicy, select_shard_targets
from fsdp_wrap._precision import mixed_precision_policy, torch_dtype
from fsdp_wrap._wrap import wrap_module_fsdp

__all__ = [
    "ShardPolicy",
    "mixed_precision_policy",
    "select_shard_targets",
    "torch_dtype",
    "wrap_module_fsdp",
]
