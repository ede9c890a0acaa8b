"""``wrap_module_fsdp``: FSDP2's ``fully_shard`` over a policy's submodules, then the root."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from dist_core import (
    DeviceLike,
    check_forward_methods,
    check_wrap_preconditions,
    log_rank0,
    require_current_device,
    require_process_group,
    resolve_device,
)
from fsdp_wrap._policy import ShardPolicy, describe_units, select_with_rule
from fsdp_wrap._precision import mixed_precision_policy
from fsdp_wrap._sentinel import parameters_of, remember_offloaded, remember_replaced

logger = logging.getLogger(__name__)


def wrap_module_fsdp(
    module: nn.Module,
    *,
    device: DeviceLike,
    shard: ShardPolicy | None = None,
    reshard_after_forward: bool = True,
    param_dtype: str | torch.dtype | None = None,
    reduce_dtype: str | torch.dtype | None = None,
    mesh: DeviceMesh | None = None,
    forward_methods: Iterable[str] = (),
    offload: bool = False,
) -> nn.Module:
    """Shard ``module`` in place with ``fully_shard`` (FSDP2) and return it.

    Applies ``fully_shard`` to each submodule that ``shard`` selects, children before parents,
    then to the root. The same precondition checks, in the same order and with the same
    errors, as ddp-wrap's ``wrap_module_ddp``: initialized process group, at least one
    trainable parameter, a concrete CUDA index, every parameter on ``device``, except that
    unlike DDP it also takes parameters

    - on the CPU when ``device`` is an accelerator: each unit is moved to the device as it is
      sharded (children before parents), so the device never holds more than this rank's
      shards plus the one unit in transit, never the whole model;
    - on the meta device: FSDP2's deferred initialization (shard first, then
      ``to_empty(device=...)`` and fill the local shards, e.g. with replica-init's
      ``build_sharded_model``).

    The returned module is the model itself (FSDP2 swaps its class for an ``FSDPModule``
    subclass): attributes and methods stay reachable. Its parameters become new ``DTensor``
    shards; build the optimizer after this call. An optimizer built before it holds the
    replaced parameters, which get no gradient: it raises ``RuntimeError`` at its first
    ``step()``, before any weight changes (checked once per optimizer and wrap).

    Args:
        module: The model, on ``device``, on the CPU or on the meta device, with its
            trainable policy applied.
        device: This rank's device (``torch.device``, string, or CUDA index). For CUDA it
            must be the current device (``torch.cuda.set_device(local_rank)`` first).
        shard: Which submodules get their own FSDP unit: ``None`` for the default rule
            (the model's ``_no_split_modules``, else the repeated blocks of every
            ``nn.ModuleList`` / ``nn.Sequential``; see :func:`select_shard_targets`); a
            callable ``(submodule) -> bool``; or classes / class names.
        reshard_after_forward: Free each unit's unsharded parameters after forward
            (re-gathered in backward): less memory, one more all-gather per unit. The root's
            are kept either way, as raw ``fully_shard`` keeps them (the backward needs them
            first); after a forward with no backward (evaluation) they stay gathered until
            the next backward, ``state_dict()`` or ``model.reshard()``: call
            ``model.reshard()`` before an optimizer step or a weight change that follows an
            evaluation forward.
        param_dtype: Mixed precision compute dtype: ``"bf16"``, ``"fp16"``, ``"fp32"`` (or a
            torch dtype); ``None`` keeps the parameters' dtype.
        reduce_dtype: Dtype of the gradient reduce-scatter; ``None`` uses ``param_dtype``.
        mesh: A 1-D ``DeviceMesh`` to shard over, or a 2-D one for HSDP (replicate, shard:
            see :func:`hsdp_mesh`); ``None`` builds a 1-D one over the default group on
            ``device``'s type.
        forward_methods: Methods of ``module`` other than ``forward`` that the trainer calls
            directly (e.g. ``"ode_wrapper"``). FSDP2 runs its root hooks only around
            ``forward``; these are registered with ``register_fsdp_forward_method`` so
            they gather the root's parameters too.
        offload: Keep the sharded parameters, their gradients and the optimizer state in host
            memory (FSDP2's ``CPUOffloadPolicy``): each unit's shards are copied to the
            device for its all-gather, gradients come back after the reduce-scatter, and
            the optimizer steps on the host. Pinned host memory on CUDA (:func:`offload_policy`).

    Returns:
        ``module``, sharded.

    Raises:
        TypeError: If ``module`` is not a module or an argument has the wrong type.
        RuntimeError: If the process group is not initialized.
        ValueError: See the checks above; an unknown dtype name (the valid names are listed);
            a CUDA ``device`` that is not the current device; a mesh on another device type.
        AttributeError: If a forward method name is not a method of ``module``.
    """
    target = check_wrap_preconditions(
        module, device, wrapper="wrap_module_fsdp", allow_meta=True, allow_host=True
    )
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
    if not isinstance(offload, bool):
        raise TypeError(f"offload must be a bool, got {type(offload).__name__} ({offload!r})")
    policy = mixed_precision_policy(param_dtype, reduce_dtype)
    host = offload_policy(target, offload)
    names = check_forward_methods(module, forward_methods, wrapper="FSDP")
    mesh = _resolve_mesh(mesh, target)
    targets, rule = select_with_rule(module, shard)
    model_name = type(module).__name__  # before fully_shard swaps the classes
    units = describe_units(targets)
    if not targets:
        log_rank0(
            logger,
            logging.WARNING,
            "the shard policy (%s) selected no submodule of %s: FSDP will hold the whole model "
            "as one unit, gathered in full for every forward and backward, which saves no "
            "memory over DDP. Name the blocks to shard, e.g. wrap_module_fsdp(..., "
            "shard=['Block']) or shard=lambda m: isinstance(m, Block) (prepare_model takes "
            "the same shard=)",
            rule,
            model_name,
        )
    before = parameters_of(module)
    for unit in targets:  # children before parents
        fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=policy,
            offload_policy=host,
        )
    # NOTE: the root keeps torch's own rule unless resharding is off: its parameters are not
    # freed after the forward, since the backward needs them at once. An explicit
    # reshard_after_forward=True on the root would free them and gather them again in the
    # backward (one more all-gather of the root's parameters every step, as raw fully_shard
    # does not do).
    if reshard_after_forward:
        fully_shard(module, mesh=mesh, mp_policy=policy, offload_policy=host)
    else:
        fully_shard(
            module, mesh=mesh, reshard_after_forward=False, mp_policy=policy, offload_policy=host
        )
    held = remember_replaced(before, module)  # an optimizer holding these is refused at its step
    del before
    if offload:  # an optimizer with device-resident state for these is refused at its step
        remember_offloaded(module)
    if held:
        log_rank0(
            logger,
            logging.WARNING,
            "%d parameter(s) of %s that the wrap replaced are still held elsewhere (an optimizer "
            "created before the wrap?): they get no gradient, and fully_shard left each one's "
            "whole tensor on the device. An optimizer holding them is refused at its first "
            "step(); create it after the wrap, from model.parameters()",
            held,
            model_name,
        )
    for name in names:
        register_fsdp_forward_method(module, name)
    log_rank0(
        logger,
        logging.INFO,
        "sharded %s with %s on %s: %d unit(s) (%s; %s) plus the root, "
        "reshard_after_forward=%s, param_dtype=%s, reduce_dtype=%s, offload=%s, forward "
        "methods %s",
        model_name,
        "HSDP (FSDP2)" if mesh.ndim == 2 else "FSDP2",
        _mesh_text(mesh, target),
        len(targets),
        units,
        rule,
        reshard_after_forward,
        policy.param_dtype,
        policy.reduce_dtype,
        type(host).__name__ if offload else "none",
        list(names),
    )
    return module


def offload_policy(device: torch.device, offload: bool) -> OffloadPolicy:
    """FSDP2's offload policy for ``device``: none, or the host with pinned memory on CUDA.

    Pinned memory is what lets the host-to-device copies of the shards overlap compute; it
    exists only next to an accelerator, so a CPU run offloads to pageable memory (its shards
    are on the host already: the policy then changes where nothing moves).
    """
    if not offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def hsdp_mesh(device: DeviceLike, *, replicate: int, shard: int) -> DeviceMesh:
    """HSDP's 2-D mesh over the default group: ``replicate`` groups of ``shard`` ranks.

    Ranks ``0..shard-1`` form the first shard group (one node under torchrun's rank order),
    and so on; a parameter is sharded within its group and replicated across the groups
    (``fully_shard`` reads a 2-D mesh as replicate, then shard).

    Args:
        device: This rank's device; the mesh is built on its type.
        replicate: The number of replicas.
        shard: The ranks each replica is sharded over.

    Returns:
        A ``DeviceMesh`` of shape ``(replicate, shard)`` named ``("replicate", "shard")``.

    Raises:
        RuntimeError: If the default process group is not initialized.
        ValueError: If ``replicate * shard`` is not the world size.
    """
    target = resolve_device(device)
    require_process_group("hsdp_mesh", instead="before building the mesh")
    world = dist.get_world_size()
    if replicate < 1 or shard < 1 or replicate * shard != world:
        raise ValueError(
            f"hsdp_mesh: replicate * shard must equal the world size {world}, got {replicate} "
            f"* {shard}; e.g. replicate={max(1, world // 2)}, shard={min(2, world)}"
        )
    return init_device_mesh(target.type, (replicate, shard), mesh_dim_names=("replicate", "shard"))


def _mesh_text(mesh: DeviceMesh, target: torch.device) -> str:
    """``cpu x 4 rank(s)``, or for HSDP ``cpu, mesh 2 (replicate) x 2 (shard)``."""
    if mesh.ndim == 1:
        return f"{target.type} x {mesh.size()} rank(s)"
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    sizes = " x ".join(f"{size} ({name})" for size, name in zip(mesh.shape, names, strict=True))
    return f"{target.type}, mesh {sizes}"


# The default 1-D mesh per device type, with the default group it was built on. Built once per
# default group: where CUDA is available and the default group is gloo (CPU runs on a GPU
# host), torch's init_device_mesh makes a new group for every mesh (device_mesh.py,
# _init_one_process_group), and one per wrap would pile up, never destroyed.
_DEFAULT_MESHES: dict[str, tuple[object, DeviceMesh]] = {}


def _default_mesh(device_type: str) -> DeviceMesh:
    default = dist.distributed_c10d._get_default_group()
    made = _DEFAULT_MESHES.get(device_type)
    if made is None or made[0] is not default or made[1].size() != dist.get_world_size():
        made = (default, init_device_mesh(device_type, (dist.get_world_size(),)))
        _DEFAULT_MESHES[device_type] = made
    return made[1]


def _resolve_mesh(mesh: DeviceMesh | None, target: torch.device) -> DeviceMesh:
    require_current_device(target, caller="wrap_module_fsdp")
    if mesh is None:
        return _default_mesh(target.type)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"mesh must be 1-D (FSDP) or 2-D (HSDP: replicate, shard), got shape "
            f"{tuple(mesh.shape)}"
        )
    if mesh.device_type != target.type:
        raise ValueError(
            f"mesh is on device type {mesh.device_type!r} but device={str(target)!r}; build the "
            f"mesh with init_device_mesh({target.type!r}, ...)"
        )
    return mesh
