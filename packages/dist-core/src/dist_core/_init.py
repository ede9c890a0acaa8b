"""``init_distributed``: the process group from the launcher's environment, started right."""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store
from torch.distributed.rendezvous import rendezvous

from dist_core._group import is_distributed, names_nccl
from dist_core._launch import Launch, detect_launch

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
"""The collective timeout when none is given: long enough for a first compile or a slow
checkpoint, short enough that a rank whose peer died fails (and torchrun restarts the job)
instead of waiting torch's default 30 minutes (gloo)."""


def init_distributed(
    *, backend: str | None = None, timeout: datetime.timedelta | float | None = None
) -> torch.device:
    """Initialize the default process group from the environment and return this rank's device.

    For torchrun and any ``env://`` launcher (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``), and for ``srun`` without torchrun (SLURM's
    ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_JOB_NODELIST``,
    ``SLURM_JOB_ID``: the rendezvous on the node list's first host, at a port derived from the
    job id; ``MASTER_ADDR`` / ``MASTER_PORT`` override; torchrun's variables win when both are
    there; the ``env://`` variables are then set for the trainer):

    - NCCL with ``device_id`` bound where CUDA is available (after ``set_device(LOCAL_RANK)``,
      torch's recommended order), gloo elsewhere; ``backend`` overrides, and any backend string
      that names NCCL (``"cpu:gloo,cuda:nccl"``) binds this rank's GPU too. The ranks on a node
      are checked against its visible GPUs.
    - Every rendezvous round gets its own store prefix, counted in the store by its ranks:
      torchrun keeps its store across restarts and membership changes, and a rank could
      otherwise read a key a rank of an earlier round left (and fail: "Gloo connectFullMesh
      failed ... Connect timeout").
    - ``timeout`` (a ``timedelta`` or seconds; default :data:`DEFAULT_TIMEOUT`) for every
      collective.

    Under fault tolerance (torchft's replica groups) each group is its own job and calls this
    in its own processes: one ``torchrun`` per group, or one ``srun`` step per group with its
    own ``MASTER_PORT`` (``srun --export ALL,MASTER_PORT=29401 ...``; steps of one allocation
    otherwise derive the same port from the job id). The default process group is then the
    group's, and its store is the one torchft's ``Manager`` uses.

    Args:
        backend: ``"nccl"``, ``"gloo"`` or another backend name; ``None`` picks as above.
        timeout: The collective timeout.

    Returns:
        This rank's device: ``cuda:LOCAL_RANK`` under NCCL (the current device), else CPU.
        Under ``srun --gpus-per-task=1`` (one visible GPU per task) it is ``cuda:0``.

    Raises:
        RuntimeError: If the default process group is already initialized.
        TypeError: A backend that is not a string, a timeout that is not a timedelta or a
            number.
        ValueError: A missing launcher variable, a non-positive timeout, NCCL without CUDA,
            more ranks on the node than GPUs, or a ``LOCAL_RANK`` with no such GPU.
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
    launch = detect_launch()
    if launch.launcher == "slurm":
        launch.export()  # env:// below, and LOCAL_RANK for the trainer, from SLURM's variables
    local = launch.local_rank
    if local < 0:
        if launch.world_size > 1 and torch.cuda.is_available() and backend != "gloo":
            raise ValueError(
                "init_distributed: LOCAL_RANK is not set, so this rank's GPU is unknown; start "
                "the processes with torchrun (or set LOCAL_RANK), or pass backend='gloo'"
            )
        local = 0
    cuda = torch.cuda.is_available()
    chosen = backend or ("nccl" if cuda else "gloo")
    device = torch.device("cpu")
    if names_nccl(chosen):  # "nccl" or torch's "cpu:gloo,cuda:nccl": this rank's GPU is bound
        device = _bind_gpu(chosen, local, launch)
    store, rank, world = next(rendezvous("env://", timeout=limit))
    dist.init_process_group(
        chosen,
        store=dist.PrefixStore(_round_prefix(store, world), store),  # type: ignore[attr-defined]
        rank=rank,
        world_size=world,
        timeout=limit,
        device_id=device if device.type == "cuda" else None,
    )
    logger.debug(
        "initialized rank %d of %d (%s, %s) on %s", rank, world, launch.launcher, chosen, device
    )
    return device


def _bind_gpu(backend: str, local: int, launch: Launch) -> torch.device:
    """Check this node's ranks against its GPUs; make this rank's GPU current."""
    if not torch.cuda.is_available():
        raise ValueError(
            f"init_distributed: backend={backend!r} needs CUDA, and none is available; use "
            "backend='gloo' (or leave backend=None)"
        )
    device = torch.device("cuda", gpu_index(launch, local, torch.cuda.device_count()))
    torch.cuda.set_device(device)
    return device


def gpu_index(launch: Launch, local: int, count: int) -> int:
    """This rank's GPU among the ``count`` visible ones (the rule, without CUDA).

    ``local`` (its local rank), except under ``srun --gpus-per-task=1``, where each task sees
    its own one GPU: 0, for every local rank (local rank 0 included: it is not checked against
    the node's task count, which would refuse it, and without global rank 0 no rank's
    rendezvous starts).

    Raises:
        ValueError: More ranks on the node than GPUs, or a local rank with no such GPU.
    """
    tasks = launch.tasks_on_node
    # NOTE: under SLURM with one GPU per task (--gpus-per-task, SLURM_GPUS_PER_TASK set), each
    # task's CUDA_VISIBLE_DEVICES names its own GPU: it is cuda:0 for every local rank.
    # Several tasks seeing one shared GPU (--gres=gpu:1) stay refused below.
    alone = launch.tasks_on_node in (None, 1)
    if launch.launcher == "slurm" and count == 1 and (launch.gpu_per_task or alone):
        return 0
    if tasks is not None and tasks > count:
        raise ValueError(
            f"init_distributed: {tasks} ranks run on this node but {count} GPU(s) are visible; "
            f"start at most one rank per GPU ({launch.launcher}: e.g. --ntasks-per-node={count} "
            f"or --nproc-per-node={count}, or srun --gpus-per-task=1)"
        )
    if local >= count:
        raise ValueError(
            f"LOCAL_RANK={local} but {count} GPU(s) are visible; start at most one rank per GPU"
        )
    return local


def _round_prefix(store: Store, world: int) -> str:
    """A store prefix of this rendezvous round alone, the same on every rank of it.

    torchrun keeps its store across restarts and across membership changes (a node joining or
    leaving restarts the workers without bumping ``TORCHELASTIC_RESTART_COUNT``), and a rank
    could read a key a rank of an earlier round left (and fail: "Gloo connectFullMesh failed ...
    Connect timeout"). The restart count cannot tell rounds apart either: each agent keeps its
    own, and a node that joins later starts at 0. So every rank counts itself in, under the
    world size, in the store itself; the ``world`` arrivals of one round share its number.
    (A round in which a rank died before reaching here would shift the count: the next
    round's ranks then fail their rendezvous at the timeout, and torchrun restarts them.)
    """
    arrivals = store.add(f"dist_core/arrivals/world-{world}", 1)
    return f"world-{world}-round-{(arrivals - 1) // world}"


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
