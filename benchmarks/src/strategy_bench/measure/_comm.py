"""What one training step sends: bytes by collective, by dtype, by process group and mesh dim."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fsdp_wrap import torch_dtype
from strategy_bench._compat import collective_group
from strategy_config import DTYPE_NAMES

# c10d ops (what DDP's reducer and FSDP2 call) by the collective they are, and which
# argument holds the data that the collective moves per rank: an all-gather's output, a
# reduce-scatter's input, an all-reduce's or broadcast's tensors.
_COLLECTIVES: dict[str, tuple[str, int]] = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0),
    "all_gather_into_tensor": ("all_gather", -1),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "all_reduce": ("all_reduce", 0),
}


class CommBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the bytes each kind of collective moves while active (per rank).

    A dispatch mode sees the c10d ops that DDP's reducer and FSDP2 issue, also from
    backward. ``bytes`` maps ``all_reduce`` / ``all_gather`` / ``reduce_scatter`` /
    ``broadcast`` to bytes; ``calls`` to the number of collectives; ``gathers`` each
    all-gather's bytes in the order issued (FSDP's units: the root's first); ``by_group`` the same
    bytes per process group (HSDP's shard and replicate groups; ``None`` when the op names
    none); ``by_dtype`` the same bytes by the dtype that travelled (:func:`dtype_name`), so
    that a bf16 all-gather that still moves fp32 shows.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.by_group: dict[dist.ProcessGroup | None, dict[str, int]] = {}
        self.by_dtype: dict[str, dict[str, int]] = {}
        self.gathers: list[int] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in ("c10d", "_c10d_functional"):
            kind = _COLLECTIVES.get(func._overloadpacket.__name__)
            if kind is not None:
                name, index = kind
                data = out if index < 0 else args[index]
                size = _nbytes(data)
                self.bytes[name] += size
                self.calls[name] += 1
                if name == "all_gather":
                    self.gathers.append(size)
                group = self.by_group.setdefault(collective_group(func, args), {})
                group[name] = group.get(name, 0) + size
                dtypes = self.by_dtype.setdefault(name, {})
                for dtype, part in _bytes_by_dtype(data).items():
                    dtypes[dtype] = dtypes.get(dtype, 0) + part
        return out


# The knobs' spelling, from the one table of dtype names (strategy-config's, as fsdp-wrap reads it).
_DTYPE_NAMES = {torch_dtype(name): name for name in DTYPE_NAMES}


def dtype_name(dtype: torch.dtype) -> str:
    """``fp32``, ``bf16``, ``fp16`` (the knobs' spelling), else torch's name (``uint8``)."""
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _bytes_by_dtype(data: Any) -> dict[str, int]:
    found: dict[str, int] = {}
    for tensor in tree_leaves(data):
        if isinstance(tensor, torch.Tensor):
            name = dtype_name(tensor.dtype)
            found[name] = found.get(name, 0) + int(tensor.numel() * tensor.element_size())
    return found


def _nbytes(data: Any) -> int:
    if isinstance(data, torch.Tensor):
        return int(data.numel() * data.element_size())
    if isinstance(data, list | tuple):
        return sum(_nbytes(item) for item in data)
    return 0


def mesh_dims(model: nn.Module) -> dict[dist.ProcessGroup, str]:
    """The model's mesh dimensions by process group.

    HSDP's ``replicate`` and ``shard``, FSDP's one dimension as ``shard``; empty for a model
    without ``DTensor`` parameters.
    """
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None:
            names = mesh.mesh_dim_names or (("shard",) if mesh.ndim == 1 else ())
            return {mesh.get_group(i): name for i, name in enumerate(names)}
    return {}


def bytes_by_dim(
    model: nn.Module, by_group: dict[dist.ProcessGroup | None, dict[str, int]]
) -> dict[str, dict[str, int]]:
    """The step's bytes per mesh dimension.

    ``shard``, ``replicate`` (HSDP), and ``world`` for collectives over another group (DDP's
    all-reduce over every rank).
    """
    dims = mesh_dims(model)
    out: dict[str, dict[str, int]] = {}
    for group, kinds in by_group.items():
        name = dims.get(group, "world") if group is not None else "world"
        into = out.setdefault(name, {})
        for kind, size in kinds.items():
            into[kind] = into.get(kind, 0) + size
    return out


def group_ranks(
    model: nn.Module, by_group: dict[dist.ProcessGroup | None, dict[str, int]]
) -> list[dict[str, Any]]:
    """Each collective group of the step: its global ``ranks``, mesh ``dim`` and ``bytes``."""
    dims = mesh_dims(model)
    world = list(range(dist.get_world_size())) if dist.is_initialized() else [0]
    return [
        {
            "ranks": world if group is None else dist.get_process_group_ranks(group),
            "dim": "world" if group is None else dims.get(group, "world"),
            "bytes": sum(kinds.values()),
        }
        for group, kinds in by_group.items()
    ]
