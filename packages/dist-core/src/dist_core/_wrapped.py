"""What a model is wrapped in: its strategy, the bare module inside, a tensor's local shard."""

from __future__ import annotations

import itertools
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DataParallel, DistributedDataParallel

from dist_core._compat import fsdp_param_groups

Strategy = Literal["ddp", "fsdp", "hsdp", "none"]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a ``DTensor``'s local shard, any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``'s ``OptimizedModule`` (without importing dynamo)."""
    return type(module).__name__ == "OptimizedModule" and "_orig_mod" in module._modules


def unwrap_compiled(module: nn.Module) -> nn.Module:
    """Peel ``torch.compile``'s ``OptimizedModule`` layers only (a DDP inside stays DDP).

    Args:
        module: A model, compiled or not.

    Returns:
        The module that ``torch.compile`` wrapped, or ``module`` itself.
    """
    while _is_compiled(module):
        module = module._modules["_orig_mod"]  # type: ignore[assignment]
    return module


def _fsdp1_class() -> type[nn.Module] | None:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - builds without distributed support
        return None
    return FullyShardedDataParallel


def unwrap_model(module: nn.Module) -> nn.Module:
    """Peel every layer of DDP, ``DataParallel``, ``torch.compile`` and FSDP1, in any nesting.

    FSDP2 (``fully_shard``) wraps nothing: the sharded model is its own innermost module.

    Args:
        module: A model in any nesting of those wrappers.

    Returns:
        The innermost module.
    """
    fsdp1 = _fsdp1_class()
    while True:
        if isinstance(module, DistributedDataParallel | DataParallel):
            module = module.module
        elif _is_compiled(module):
            module = module._modules["_orig_mod"]  # type: ignore[assignment]
        elif fsdp1 is not None and isinstance(module, fsdp1):
            module = module.module  # type: ignore[assignment]
        else:
            return module


def state_groups(model: nn.Module) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    """The plain model's state-dict tensors, each with every name it goes by, in order.

    A tied weight (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) is one entry
    with both names, first name first; the names are the unwrapped model's ``state_dict()``
    keys (persistent buffers included). Under FSDP2 the tensors are its sharded parameters.
    """
    groups: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in unwrap_model(model).state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    return [(tuple(names), tensors[key]) for key, names in groups.items()]


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """Every FSDP2 module in ``model`` (the root too), outermost first; empty if none."""
    return [m for m in unwrap_model(model).modules() if isinstance(m, FSDPModule)]


def strategy_of(model: nn.Module) -> Strategy:
    """The data-parallel strategy ``model`` runs under.

    Args:
        model: A plain module, a DDP wrapper (any subclass), an FSDP2 model, or any of them
            under ``torch.compile``.

    Returns:
        ``"ddp"``; ``"hsdp"`` (FSDP2 over a 2-D mesh: replicate, shard); ``"fsdp"`` (FSDP2
        ``fully_shard`` anywhere in the model, or FSDP1); or ``"none"``.
    """
    model = unwrap_compiled(model)
    if isinstance(model, DistributedDataParallel):
        return "ddp"
    fsdp1 = _fsdp1_class()
    if fsdp1 is not None and isinstance(model, fsdp1):
        return "fsdp"
    if any(isinstance(module, FSDPModule) for module in model.modules()):
        mesh = fsdp_mesh(model)
        return "hsdp" if mesh is not None and mesh.ndim == 2 else "fsdp"
    return "none"


def fsdp_mesh(model: nn.Module) -> DeviceMesh | None:
    """The mesh FSDP2 shards ``model`` over (2-D under HSDP), or ``None`` without FSDP2.

    NOTE: read from the FSDP state, never from ``model.parameters()``: from a forward to the
    backward the root's parameters are plain gathered tensors (torch keeps the root gathered
    for the backward), and with ``reshard_after_forward=False`` every unit's are. A rule that
    looked for a ``DTensor`` parameter found none there, and a loss normalised between the
    forward and the backward was scaled for one rank instead of the world.
    """
    for module in fsdp_modules(model):  # the outermost first
        for group in fsdp_param_groups(module._get_fsdp_state()):
            mesh = getattr(getattr(group, "mesh_info", None), "mesh", None)
            if isinstance(mesh, DeviceMesh):
                return mesh
    return None


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """This rank's device of ``mesh``'s type: ``cpu``, or the current accelerator index.

    FSDP2 computes on this device (``fully_shard`` takes it from the mesh the same way) and its
    mesh's process groups take tensors there, whatever device the shards live on.
    """
    kind = str(mesh.device_type)
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())


def compute_device(model: nn.Module) -> torch.device:
    """The device ``model`` computes on: its RNG, its collectives and its CUDA state live there.

    - FSDP2 or HSDP (a ``DTensor`` parameter): :func:`mesh_device` of its mesh.
    - DDP with ``device_ids``: that device.
    - Otherwise the first parameter's or buffer's device; ``cpu`` for a model without either.
    """
    # NOTE: not the device of the first parameter: under FSDP2's CPU offload every shard is in
    # host memory while the model computes on the mesh's accelerator (a checkpoint that read
    # the shard's device saved, restored and seeded only the CPU generator).
    inner = unwrap_compiled(model)
    for module in fsdp_modules(inner)[:1]:  # the device fully_shard took (its current device)
        device = getattr(module._get_fsdp_state(), "_device", None)
        if isinstance(device, torch.device):
            return device
    for param in inner.parameters():
        if isinstance(param, DTensor):
            return mesh_device(param.device_mesh)
        break
    if isinstance(inner, DistributedDataParallel) and inner.device_ids:
        return torch.device(inner.device_type, inner.device_ids[0])
    first = next(itertools.chain(inner.parameters(), inner.buffers()), None)
    return torch.device("cpu") if first is None else first.device
