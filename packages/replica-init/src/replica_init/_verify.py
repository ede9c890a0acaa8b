"""Prove that every rank holds the same replica."""

from __future__ import annotations

import itertools

import torch.distributed as dist
from torch import nn

from dist_core import agree, require_current_device, require_process_group
from replica_init._fingerprint import combine, tensor_digests


class ReplicaMismatchError(RuntimeError):
    """The ranks' replicas differ.

    Attributes:
        ranks: The ranks whose fingerprint differs from rank 0's.
        tensor: The first differing parameter or buffer key (``param:name``), or ``None``.
        fingerprints: Each rank's fingerprint, indexed by rank in the group.
    """

    def __init__(
        self, message: str, *, ranks: list[int], tensor: str | None, fingerprints: list[str]
    ) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.tensor = tensor
        self.fingerprints = fingerprints


def assert_replicas_identical(module: nn.Module, *, group: dist.ProcessGroup | None = None) -> str:
    """Check that every rank of ``group`` holds bit-identical parameters and buffers.

    Each rank fingerprints its replica and the fingerprints are all-gathered; only on a
    mismatch are the per-tensor digests gathered, to name the first differing tensor. Every
    rank raises the same error, so no rank is left waiting in a later collective.

    Args:
        module: This rank's replica.
        group: The process group; ``None`` is the default group.

    Returns:
        The common fingerprint.

    Raises:
        RuntimeError: If the default process group is not initialized.
        ValueError: If the module is on an accelerator device other than the current one
            (object collectives stage there).
        ReplicaMismatchError: If any rank's replica differs; the message names the ranks that
            differ from rank 0 and the first differing tensor, with the ranks on each side.
    """
    require_process_group("assert_replicas_identical")
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    failure: Exception | None = None
    digests: list[tuple[str, str]] = []
    fingerprint = ""
    try:  # a failure is reported to every rank, never raised alone before the gather
        if first is not None:
            require_current_device(
                first.device, caller="assert_replicas_identical", argument="the module's device"
            )
        digests = tensor_digests(module)
        fingerprint = combine(digests)
    except Exception as error:
        failure = error
    fingerprints: list[str] = agree(
        failure, "fingerprinting the replicas", group, share=fingerprint
    )
    if len(set(fingerprints)) == 1:
        return fingerprint
    everyone: list[list[tuple[str, str]]] = [[] for _ in fingerprints]
    dist.all_gather_object(everyone, digests, group=group)
    differing = [rank for rank, fp in enumerate(fingerprints) if fp != fingerprints[0]]
    tensor, detail = _first_difference(everyone)
    message = (
        f"model replicas differ: ranks {differing} differ from rank 0 "
        f"({len(set(fingerprints))} distinct fingerprints in {len(fingerprints)} ranks); "
        f"first differing tensor: {detail}. Build every rank from the same seed, init_params "
        "and default dtype (or use source='rank0')"
    )
    raise ReplicaMismatchError(message, ranks=differing, tensor=tensor, fingerprints=fingerprints)


def _first_difference(everyone: list[list[tuple[str, str]]]) -> tuple[str | None, str]:
    tables = [{key.split("|", 1)[0]: (key, digest) for key, digest in d} for d in everyone]
    names = sorted(set().union(*tables))
    for name in names:
        values = [table.get(name) for table in tables]
        if len(set(values)) > 1:
            sides: dict[str, list[int]] = {}
            for rank, value in enumerate(values):
                label = "missing" if value is None else _short(value)
                sides.setdefault(label, []).append(rank)
            listed = "; ".join(f"ranks {ranks}: {label}" for label, ranks in sides.items())
            return name, f"'{name}' ({listed})"
    return None, "none found (the tensors agree, the structure differs)"


def _short(value: tuple[str, str]) -> str:
    key, digest = value
    _, dtype, shape = key.split("|")
    return f"{dtype} {shape} sha256 {digest[:12]}"
