"""Staging for background saves: host copies of the state, in buffers kept between saves.

A tensor (a ``DTensor``'s local shard) is copied into the previous save's host buffer when its
shape, stride and dtype match, so a steady run allocates once. A device tensor's buffer is
pinned at its exact size and copied without blocking; the save waits once per device. What
DCP gets is on the host (:func:`require_host_only` checks it): a ``DTensor`` is rebuilt over
its host shard with the original's spec.
"""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
import xxhash
from torch import nn
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

_Path = tuple[Any, ...]


_Key = tuple[Any, ...]  # the source's shape, stride, dtype and whether its buffer is pinned


# The previous save's host copies, by position, with what they were made for. Shared by the
# process: one save is in flight at a time (_inflight), so no two saves use them at once.
_BUFFERS: dict[_Path, tuple[torch.Tensor, _Key]] = {}


_DEVICES: set[torch.device] = set()  # the CUDA devices this save copies from, without blocking


def stage(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state`` whose tensors live in host memory and share nothing with it.

    ``DTensor``s stay ``DTensor``s (same mesh, placements, global shape and stride) over a
    host copy of their local shard, so DCP plans the same sharded write.
    """
    kept = dict(_BUFFERS)
    _BUFFERS.clear()
    _DEVICES.clear()
    staged: dict[str, Any] = _copy(state, (), kept)
    for device in _DEVICES:  # every device copied from (an optimizer state on another GPU)
        torch.cuda.synchronize(device)  # its non-blocking device-to-host copies have landed
    require_host_only(staged)
    return staged


def replicated_share(state: dict[str, Any], rank: int, world: int) -> tuple[dict[str, Any], str]:
    """``state`` without the plain tensors that another rank stages; their layout, in words.

    DCP writes one rank's copy of a plain (replicated) tensor; here that choice is made before
    staging, so each rank copies only its share: each tensor held under a key, in order, goes
    to the rank with the fewest bytes so far. The ranks choose alike while their layouts
    (keys, shapes, dtypes, in order) match, which they compare when they agree on the claim.
    Tensors inside lists, values and ``DTensor`` shards stay on every rank.
    """
    if world <= 1:
        return state, ""
    digest = xxhash.xxh3_128()
    load = [0] * world

    def share(value: Any, path: _Path) -> Any:
        if not isinstance(value, dict):
            return value
        kept: dict[Any, Any] = {}
        for key, item in value.items():
            if type(item) in (torch.Tensor, nn.Parameter):
                digest.update(repr(((*path, key), tuple(item.shape), item.dtype)).encode())
                owner = load.index(min(load))
                load[owner] += item.numel() * item.element_size()
                if owner != rank:
                    continue
            kept[key] = share(item, (*path, key))
        return kept

    shared = share(state, ())
    return shared, f"{sum(load)} bytes of plain tensors, layout {digest.hexdigest()}"


def pinned(source: torch.Tensor) -> bool:
    """Whether the host copy of ``source`` goes to pinned memory: a CUDA tensor's does."""
    return source.device.type == "cuda"


def pin_exact(buffer: torch.Tensor) -> bool:
    """Page-lock exactly ``buffer``'s storage for its life; ``False`` (warned): pageable."""
    # NOTE: the bytes pinned are the storage's own, never rounded: sum(nbytes) over the
    # buffers, which the test of this module checks through _REGISTER.
    storage = buffer.untyped_storage()
    address, size = storage.data_ptr(), storage.nbytes()
    if size == 0:
        return True
    try:
        _REGISTER(address, size)
    except RuntimeError as error:
        logger.warning("%s; staging in pageable memory instead", error)
        return False
    weakref.finalize(storage, _UNREGISTER, address, _current_device()).atexit = False
    return True


def _current_device() -> int | None:
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def _cuda_register(address: int, size: int) -> None:
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    # 1: cudaHostRegisterPortable, pinned for every device (a state on two GPUs), as torch's
    # own stager registers it
    code = int(cudart.cudaHostRegister(address, size, 1))
    if code != 0:
        clear = getattr(cudart, "cudaGetLastError", None)
        if clear is not None:  # the error is not left for an unrelated kernel to report
            clear()
        raise RuntimeError(
            f"checkpoint-io could not pin a {size}-byte staging buffer (cudaHostRegister "
            f"error {code}); the host's page-locked memory limit may be too low (ulimit -l)"
        )


def _cuda_unregister(address: int, device: int | None) -> None:
    # in the device the memory was registered from, whatever thread drops the last reference
    with torch.cuda.device(device):
        code = int(torch.cuda.cudart().cudaHostUnregister(address))  # type: ignore[no-untyped-call]
    if code != 0:
        logger.warning("cudaHostUnregister of a staging buffer failed (error %d)", code)


_REGISTER: Callable[[int, int], None] = _cuda_register
_UNREGISTER: Callable[[int, int | None], None] = _cuda_unregister


def require_host_only(state: Any, path: str = "state") -> None:
    """Check that every tensor of ``state`` (a ``DTensor``'s local shard too) is on the host.

    Raises:
        RuntimeError: Naming the first tensor that is not in host memory.
    """
    if isinstance(state, DTensor):
        state = state._local_tensor  # not to_local(): it may wait on a collective
    if isinstance(state, torch.Tensor):
        if state.device.type != "cpu":
            raise RuntimeError(
                f"checkpoint-io staged {path} on {state.device}, not in host memory; a "
                "background save must hold no device memory (please report this as a bug)"
            )
    elif isinstance(state, dict):
        for key, item in state.items():
            require_host_only(item, f"{path}[{key!r}]")
    elif isinstance(state, list | tuple):
        for index, item in enumerate(state):
            require_host_only(item, f"{path}[{index}]")


def _copy(value: Any, path: _Path, kept: dict[_Path, tuple[torch.Tensor, _Key]]) -> Any:
    if isinstance(value, DTensor):
        local = _host_copy(value.to_local(), path, kept)
        # The same spec (mesh, placements, global shape and stride) over the host shard.
        return DTensor(local, value._spec, requires_grad=False)  # type: ignore[no-untyped-call]
    if isinstance(value, torch.Tensor):
        return _host_copy(value, path, kept)
    if isinstance(value, dict):
        return {key: _copy(item, (*path, key), kept) for key, item in value.items()}
    if isinstance(value, list | tuple):
        items = [_copy(item, (*path, index), kept) for index, item in enumerate(value)]
        return items if isinstance(value, list) else type(value)(items)
    return copy.deepcopy(value)


def _host_copy(
    tensor: torch.Tensor, path: _Path, kept: dict[_Path, tuple[torch.Tensor, _Key]]
) -> torch.Tensor:
    source = tensor.detach()
    pin = pinned(source)
    # Compared with the source's layout, not the buffer's: a strided source gets a dense
    # buffer, and an empty pinned one reads back as not pinned (no allocation to pin).
    key = (source.shape, source.stride(), source.dtype, pin)
    buffer, made_for = kept.get(path, (None, None))
    if buffer is None or made_for != key:
        buffer = torch.empty_like(source, device="cpu")
        if pin and not pin_exact(buffer):
            pin = False  # pageable: the copy below blocks, the save still holds
    buffer.copy_(source, non_blocking=pin)  # stage() waits once per device for all of them
    if pin:
        _DEVICES.add(source.device)
    _BUFFERS[path] = (buffer, key)
    return buffer
