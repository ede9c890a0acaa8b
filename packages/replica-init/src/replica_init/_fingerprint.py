"""Digests of a module's tensors: equal exactly when the replicas are equal."""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

# Device tensors are hashed in slices of this many bytes, so at most one slice of one tensor
# is on the host at a time (never a full host copy of the model).
CHUNK_BYTES = 64 * 2**20


def named_state_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer (non-persistent ones too), keyed ``param:``/``buffer:``.

    The order is sorted by name, so it is the same in every process for the same structure.
    """
    entries: list[tuple[str, torch.Tensor]] = [
        (f"param:{n}", p) for n, p in module.named_parameters()
    ]
    entries += [(f"buffer:{n}", b) for n, b in module.named_buffers()]
    yield from sorted(entries, key=lambda entry: entry[0])


def tensor_digests(module: nn.Module) -> list[tuple[str, str]]:
    """``(key, digest)`` for every parameter and buffer; the key holds name, dtype and shape."""
    return [digest_entry(name, tensor) for name, tensor in named_state_tensors(module)]


def digest_entry(name: str, tensor: torch.Tensor) -> tuple[str, str]:
    """``(key, digest)`` of one tensor: the key holds its name, dtype and shape."""
    return f"{name}|{tensor.dtype}|{tuple(tensor.shape)}", _tensor_digest(name, tensor)


def combine(digests: list[tuple[str, str]]) -> str:
    """The fingerprint of a list of per-tensor digests."""
    total = hashlib.sha256(b"replica_init.fingerprint/1")
    for key, digest in digests:
        total.update(key.encode())
        total.update(b"\0")
        total.update(digest.encode())
        total.update(b"\n")
    return total.hexdigest()


def model_fingerprint(module: nn.Module) -> str:
    """A digest of every parameter's and buffer's name, dtype, shape and bytes.

    Non-persistent buffers are included. Tensors on an accelerator are hashed slice by slice,
    so the host never holds a full copy of the model.

    Args:
        module: The model (an unwrapped module or a wrapper; names include any prefix).

    Returns:
        A hex string, equal across processes exactly when the replicas are equal.

    Raises:
        ValueError: If a tensor is on the meta device (it has no bytes to compare).
    """
    return combine(tensor_digests(module))


def state_fingerprint(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A digest of named tensors (a state dict's items): names, dtypes, shapes and bytes.

    The same per-tensor digests as :func:`model_fingerprint`, over the items in the order
    given (pass them sorted by name to compare across processes). checkpoint-io computes it
    for a checkpoint's full model state offline (``python -m checkpoint_io inspect PATH
    --fingerprint``).

    Args:
        tensors: ``(name, tensor)`` pairs; may be a generator, so that only one (gathered)
            tensor needs to be held at a time.

    Returns:
        A hex string.

    Raises:
        ValueError: If a tensor is on the meta device.
    """
    return combine([digest_entry(name, tensor) for name, tensor in tensors])


def _tensor_digest(name: str, tensor: torch.Tensor) -> str:
    if tensor.is_meta:
        raise ValueError(
            f"{name} is on the meta device and has no data to fingerprint; materialise the "
            "model (e.g. build it with source='rank0' or move it with to_empty and load weights)"
        )
    digest = hashlib.sha256()
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    for start in range(0, flat.numel(), CHUNK_BYTES):
        chunk = flat[start : start + CHUNK_BYTES]
        host = chunk.cpu() if chunk.device.type != "cpu" else chunk
        # A ctypes array over the tensor's memory: hashed in place, without a bytes copy.
        digest.update((ctypes.c_ubyte * host.numel()).from_address(host.data_ptr()))
    return digest.hexdigest()
