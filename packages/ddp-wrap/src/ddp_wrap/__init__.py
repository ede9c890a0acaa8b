"""DDP that keeps the model's attributes reachable and refuses silent gradient desync."""

from __future__ import annotations

from ddp_wrap._delegate import DelegatingDistributedDataParallel, mark_forward_method
from ddp_wrap._wrap import unwrap_ddp_module, wrap_module_ddp
from dist_core import unwrap_model

__all__ = [
    "DelegatingDistributedDataParallel",
    "mark_forward_method",
    "unwrap_ddp_module",
    "unwrap_model",
    "wrap_module_ddp",
]
