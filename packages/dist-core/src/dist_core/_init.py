"""``init_distributed``: the process group from the launcher's environment, started right."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from dist_core._group import is_distributed

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
"""The collective timeout when none is given: long enough for a first compile or a slow
checkpoint, short enough that a rank whose peer died fails (and torchrun restarts the job)
instead of waiting torch's default 30 minutes (gloo)."""

_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def init_distributed(
    *, backend: str | None = None, timeout: datetime.timedelta | float | None = None
) -> torch.device:
    """Initialize the default process group from the environment and return this rank's device.

    For torchrun and any ``env://`` launcher (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``):

    - NCCL with ``device_id`` bound where CUDA is available (after ``set_device(LOCAL_RANK)``,
      torch's recommended order), gloo elsewhere; ``backend`` overrides.
    - Every torchrun attempt rendezvouses under its own store prefix
      (``TORCHELASTIC_RESTART_COUNT``): torchrun keeps its store across restarts, and a
      restarted rank could otherwise read a key a dead rank of the previous attempt left
      (seen here: "Gloo connectFullMesh failed ... Connect timeout").
    - ``timeout`` (a ``timedelta`` or seconds; default :data:`DEFAULT_TIMEOUT`) for every
      collective.

    Args:
        backend: ``"nccl"``, ``"gloo"`` or another backend name; ``None`` picks as above.
        timeout: The collective timeout.

    Returns:
        This rank's device: ``cuda:LOCAL_RANK`` under NCCL (the current device), else CPU.

    Raises:
        RuntimeError: If the default process group is already initialized.
        TypeError: A backend that is not a string, a timeout that is not a timedelta or a
            number.
        ValueError: A missing launcher variable, a non-positive timeout, NCCL without CUDA,
            or a ``LOCAL_RANK`` with no such GPU.
    """
    if is_distributed():
        raise RuntimeError(
            "init_distributed: the default process group is already initialized (backend "
            f"{dist.get_backend()!r}, {dist.get_world_size()} ranks); call it once per process, "
            "at the start, and use that group"
        )
    limit = _timeout(timeout)
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a string or None, got {type(backend).__name__}")
    missing = [name for name in _ENV if not os.environ.get(name)]
    if missing:
        raise ValueError(
            f"init_distributed: the environment lacks {', '.join(missing)}; start the "
            "processes with torchrun (or set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE)"
        )
    local = os.environ.get("LOCAL_RANK")
    if local is None:
        if int(os.environ["WORLD_SIZE"]) > 1 and torch.cuda.is_available() and backend != "gloo":
            raise ValueError(
                "init_distributed: LOCAL_RANK is not set, so this rank's GPU is unknown; start "
                "the processes with torchrun (or set LOCAL_RANK), or pass backend='gloo'"
            )
        local = "0"
    if not local.isdigit():
        raise ValueError(f"LOCAL_RANK must be a non-negative integer, got {local!r}")
    cuda = torch.cuda.is_available()
    chosen = backend or ("nccl" if cuda else "gloo")
    device = torch.device("cpu")
    if chosen == "nccl":
        if not cuda:
            raise ValueError(
                "init_distributed: backend='nccl' needs CUDA, and none is available; use "
                "backend='gloo' (or leave backend=None)"
            )
        if int(local) >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={local} but {torch.cuda.device_count()} GPU(s) are visible; start "
                "at most one rank per GPU"
            )
        device = torch.device("cuda", int(local))
        torch.cuda.set_device(device)
    store, rank, world = next(rendezvous("env://", timeout=limit))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        chosen,
        store=dist.PrefixStore(f"attempt-{attempt}", store),  # type: ignore[attr-defined]
        rank=rank,
        world_size=world,
        timeout=limit,
        device_id=device if device.type == "cuda" else None,
    )
    return device


def _timeout(timeout: datetime.timedelta | float | None) -> datetime.timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, bool) or not isinstance(timeout, datetime.timedelta | int | float):
        raise TypeError(
            f"timeout must be a datetime.timedelta or seconds, got {type(timeout).__name__}"
        )
    limit = (
        timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
    )
    if limit.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {limit.total_seconds():g} s")
    return limit
