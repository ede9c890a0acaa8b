"""Run a function on N real ranks (gloo on CPU, or NCCL on GPUs) in spawned processes, and
collect what each returned.

Worker functions must live in an importable module (this folder is on pytest's pythonpath),
because spawned children import them by name. A worker puts its tensors on
:func:`rank_device`, so the same worker runs on gloo (CPU) and on NCCL (one GPU per rank).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

DEADLINE_S = 180.0
_BACKEND_VAR = "DIST_HARNESS_BACKEND"


def cuda_count() -> int:
    """Visible CUDA devices (0 on a CPU build), without creating a CUDA context."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def two_rank_backends() -> list[Any]:
    """``(backend, world_size)`` values for a two-rank test or fixture (one parameter each):
    gloo always, and an NCCL variant that skips, saying why, unless 2 GPUs are visible."""
    import pytest

    gpus = cuda_count()
    return [
        pytest.param(("gloo", 2), id="gloo"),
        pytest.param(
            ("nccl", 2),
            id="nccl",
            marks=[
                pytest.mark.nccl,
                pytest.mark.skipif(
                    gpus < 2, reason=f"NCCL variant: needs 2 CUDA devices, {gpus} visible"
                ),
            ],
        ),
    ]


def rank_device() -> Any:
    """This rank's device: ``cuda:<rank>`` under NCCL (one GPU per rank), else CPU."""
    import torch
    import torch.distributed as dist

    if os.environ.get(_BACKEND_VAR) == "nccl":
        return torch.device("cuda", dist.get_rank())
    return torch.device("cpu")


def run_ranks(
    fn: Callable[..., Any], *args: Any, world_size: int = 2, backend: str = "gloo"
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on every rank; return the results by rank.

    Args:
        fn: The rank body, importable by name.
        *args: Further arguments of ``fn``.
        world_size: How many ranks.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (rank r on cuda:r, bound with ``device_id``).

    Raises:
        AssertionError: If a rank raised (with its traceback) or the deadline passed.
    """
    context = mp.get_context("spawn")
    results: queue.Queue[tuple[int, str, Any]] = context.Queue()  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            context.Process(
                target=_entry, args=(fn, rank, world_size, backend, store, results, args)
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        collected: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + DEADLINE_S
        try:
            while len(collected) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"ranks timed out; finished: {sorted(collected)}")
                try:
                    rank, status, value = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [p for p in procs if p.exitcode not in (None, 0)]
                    if dead and len(collected) + len(dead) >= world_size:
                        raise AssertionError(
                            f"a rank died without reporting (exit codes "
                            f"{[p.exitcode for p in procs]})"
                        ) from None
                    continue
                collected[rank] = (status, value)
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
    errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(collected.items()) if s == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [collected[rank][1] for rank in range(world_size)]


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    results: Any,
    args: tuple[Any, ...],
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ[_BACKEND_VAR] = backend
    try:
        extra: dict[str, Any] = {}
        if backend == "nccl":  # set_device first, then a group bound to it (torch's advice)
            torch.cuda.set_device(rank)
            extra["device_id"] = torch.device("cuda", rank)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
            **extra,
        )
        results.put((rank, "ok", fn(rank, world_size, *args)))
        dist.barrier()  # no rank tears the group down while another still uses it
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def single_rank_group() -> None:
    """Initialize a one-rank gloo group in this process (once; later calls reuse it)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def fresh_interpreter(code: str, *, timeout: float = 120, env: dict[str, str] | None = None) -> str:
    """Run ``code`` (dedented) in a new Python process, where no process group exists yet.

    ``env`` adds to (and overrides) this process's environment.

    Returns:
        Its standard output.

    Raises:
        subprocess.CalledProcessError: If it exits non-zero.
    """
    import subprocess
    import sys
    import textwrap

    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        check=True,
        timeout=timeout,
        env=None if env is None else {**os.environ, **env},
    )
    return done.stdout
