"""DDP that keeps the model's attributes reachable and refuses silent gradient desync."""

from __future__ import annotations

from ddp_wrap._checks import DeviceLike, check_wrap_preconditions
from ddp_wrap._delegate import DelegatingDistributedDataParallel, mark_forward_method
from ddp_wrap._wrap import unwrap_ddp_module, unwrap_model, wrap_module_ddp

__all__ = [
    "DelegatingDistributedDataParallel",
    "DeviceLike",
    "check_wrap_preconditions",
    "mark_forward_method",
    "unwrap_ddp_module",
    "unwrap_model",
    "wrap_module_ddp",
]
