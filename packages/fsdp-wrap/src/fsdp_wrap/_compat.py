"""Torch-version differences for fsdp-wrap, kept in one place.

FSDP2 is public as ``torch.distributed.fsdp.fully_shard`` from torch 2.6, the oldest torch
this package supports; every FSDP2 name the package uses is imported here, so a future move
is a one-file change.
"""

from __future__ import annotations

from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

__all__ = ["FSDPModule", "MixedPrecisionPolicy", "fully_shard", "register_fsdp_forward_method"]
