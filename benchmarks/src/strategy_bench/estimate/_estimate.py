"""``strategy-bench estimate``: per-rank memory and communication at world sizes not at hand.

Each point is one rank of a world that does not exist: torch's fake process group of that
size, the model built on the meta device, wrapped for real by our wrapper (FSDP's local
shards are the true ones, padding included), then materialized as fake tensors (shapes
without storage) and stepped once: the same accounting as ``run`` (:func:`account`) reads
the local parameter, gradient and optimizer bytes, what the forward saves for backward, and
the bytes each collective moves. Nothing of the full model is ever allocated.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from dist_core import local_tensor
from replica_init import materialize
from strategy_bench._compat import FakeTensorMode, fake_process_group, unset_fake_temporarily
from strategy_bench._errors import BenchUsageError, error_summary
from strategy_bench.estimate._agreement import comm_total
from strategy_bench.estimate._init_peak import ModelSizes, init_peaks
from strategy_bench.estimate._offload import offload_fields
from strategy_bench.estimate._points import EstimateOptions, EstimatePoint
from strategy_bench.measure import (
    _wrappers,
    account,
    autocast,
    ddp_bucket_bytes,
    dtype_name,
    local_bytes,
    parameter_counts,
)
from strategy_bench.results import FAILED, MEMORY_KINDS, OK, host_environment
from strategy_bench.workload import (
    Workload,
    WorkloadSpec,
    compute_dtype,
    micro_steps,
    prepare_blocks,
    syncs_every_micro_step,
    training_optimizer,
)

logger = logging.getLogger(__name__)

SCHEMA = 1
"""Version of ``estimate.json``."""
_CPU = torch.device("cpu")


def estimate_point(
    spec: WorkloadSpec, point: EstimatePoint, options: EstimateOptions, *, comm: bool = True
) -> dict[str, Any]:
    """One rank's memory and communication for ``point``, in this process.

    ``comm=False`` leaves the collectives uncounted (``--largest``'s probes read the peak).

    Returns:
        The row: ``model``, ``strategy``, ``knobs``, ``world_size``, ``status``, the
        per-rank ``param_bytes``, ``grad_bytes``, ``optimizer_bytes``,
        ``activation_peak_bytes`` and ``comm_bytes_per_step`` / ``comm_calls_per_step``,
        and the seconds it took. A model that cannot be stepped on fake tensors (its
        forward reads tensor values: ``.item()``, data-dependent shapes) gets a row with
        ``status: "failed"`` and the error instead; the other points go on.
    """
    begin = time.monotonic()
    workload = spec.build()
    head = {
        "model": workload.name,
        "strategy": point.strategy,
        "knobs": dict(point.knobs),
        "world_size": point.world_size,
        "batch_size": options.batch_size * micro_steps(point.knobs),
        "dtype": options.dtype,
        "tokens_per_sample": workload.tokens_per_sample,
    }
    try:
        row = _step(workload, point, options, comm=comm)
    except BenchUsageError:
        raise
    except Exception as error:  # whatever the model raised on fake tensors: that is the row
        logger.debug("estimate of %s failed", head, exc_info=True)
        failed = {"status": FAILED, "error": error_summary(error, 400)}
        return {**head, **failed, "seconds": time.monotonic() - begin}
    return {**head, "status": OK, **row, "seconds": time.monotonic() - begin}


def _step(
    workload: Workload, point: EstimatePoint, options: EstimateOptions, *, comm: bool = True
) -> dict[str, Any]:
    """Wrap and step the model as one rank of ``point.world_size`` ranks; read what it held."""
    with fake_process_group(point.world_size):
        model = workload.meta_model()
        counts = parameter_counts(model)
        sizes = ModelSizes.of(model)  # before the wrap shards it
        prepare_blocks(model, point.knobs)
        if point.strategy in _wrappers.SHARDED:
            nodes = point.world_size // options.gpus_per_node
            shape = (nodes, options.gpus_per_node) if point.strategy == "hsdp" else None
            model = _wrappers.ours(point.strategy, model, _CPU, point.knobs, hsdp=shape)
        shards = local_bytes([*model.parameters(), *model.buffers()])
        twins = _LocalOptimizer(model.parameters())
        with FakeTensorMode(allow_non_fake_inputs=True):
            if point.strategy == "ddp":  # the bare model: to_empty alone would untie weights
                materialize(model, _CPU)
            else:
                model.to_empty(device=_CPU)
            _gather_once(model)
            generator = torch.Generator()
            batches = [
                workload.make_batch(options.batch_size, _CPU, generator)
                for _ in range(micro_steps(point.knobs))
            ]
            compute = autocast(compute_dtype(point.strategy, point.knobs, options.dtype), _CPU)
            out = account(
                model,
                twins.optimizer,
                workload.loss,
                batches,
                compute,
                optimizer_step=twins.step,
                stand_ins=twins.stand_ins,
                count_comm=comm,
                sync_every=syncs_every_micro_step(point.knobs),
            )
    if point.strategy == "ddp":
        out.update(_ddp_communication(model))
        as_view = bool(point.knobs.get("gradient_as_bucket_view", False))
        out["ddp_bucket_bytes"] = ddp_bucket_bytes(model, as_view=as_view)
    static = sum(out[f"{kind}_bytes"] for kind in MEMORY_KINDS if kind != "activation_peak")
    # The bare model stands in for DDP's: its reducer's buckets, as DDP would build them.
    out["peak_parts_bytes"]["ddp_buckets"] = out["ddp_bucket_bytes"]
    out["tracked_peak_bytes"] += out["ddp_bucket_bytes"]
    return {
        **counts,
        **out,
        **offload_fields(point.strategy, point.knobs, out),
        "init_peak_bytes": init_peaks(sizes, point.strategy, shards, point.world_size),
        "static_bytes": static,
        "total_bytes": static + out["activation_peak_bytes"],
        "peak_bytes": out["tracked_peak_bytes"],
    }


class _LocalOptimizer:
    """The training optimizer over meta twins of this rank's local tensors, stepped once.

    Its state (AdamW: two moments per tensor and a step) is created the way a real step
    creates it, for tensors of the local shapes and dtypes, without storage. :meth:`step`
    steps it again (the tracked step's optimizer phase: its temporaries are what counts);
    the twins and their gradients are ``stand_ins`` for the model's own.
    """

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self._grads: list[tuple[torch.Tensor, torch.Tensor]] = []
        local = []
        for param in parameters:
            tensor = local_tensor(param)
            twin = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
            twin.requires_grad_(param.requires_grad)
            if param.requires_grad:
                twin.grad = torch.empty_like(twin)
                self._grads.append((twin, twin.grad))
            local.append(twin)
        self.stand_ins = [*local, *(grad for _, grad in self._grads)]
        self.optimizer = training_optimizer(local)
        self.optimizer.step()

    def step(self) -> None:
        """Step again with the twins' gradients (``account`` set them to ``None`` first).

        Outside fake mode (the twins are meta tensors; AdamW reads its step count), still
        inside the tracker.
        """
        for twin, grad in self._grads:
            twin.grad = grad
        with unset_fake_temporarily():
            self.optimizer.step()


def _gather_once(model: nn.Module) -> None:
    """Let FSDP initialize its all-gather outputs before the tracked step.

    As in ``run``, where the tracked step follows the timed ones.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.unshard()
            module.reshard()


def _ddp_communication(model: nn.Module) -> dict[str, Any]:
    """What DDP's reducer moves per step: one all-reduce of every trainable gradient.

    Every rank holds the whole model, so nothing here depends on the world size; the
    number of all-reduce calls depends on the buckets DDP builds at run time and is left
    out (``None``).
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    by_dtype: dict[str, int] = {}
    for param in trainable:  # DDP all-reduces each gradient in its parameter's dtype
        name = dtype_name(param.dtype)
        by_dtype[name] = by_dtype.get(name, 0) + local_bytes([param])
    return {
        "comm_bytes_per_step": {"all_reduce": local_bytes(trainable)},
        "comm_calls_per_step": None,
        "comm_bytes_by_dtype": {"all_reduce": by_dtype},
    }


def run_estimate(
    specs: Sequence[WorkloadSpec],
    points: Sequence[EstimatePoint],
    options: EstimateOptions,
    *,
    jobs: int = 1,
    progress: Callable[[int, int, dict[str, Any]], None] | None = None,
    pool: Executor | None = None,
) -> list[dict[str, Any]]:
    """Estimate every point, ``jobs`` at a time, in order.

    DDP's per-rank figures do not depend on the world size (every rank holds the whole
    model and all-reduces every gradient): each DDP variant is stepped once and its row is
    repeated for the other world sizes. FSDP points are stepped at each world size.
    ``jobs > 1`` spreads them over spawned processes (each has its own fake group); so
    does a process that already has a process group of its own, which is left alone.
    ``pool``: spawned workers to use (and leave open) instead of a pool of its own.
    """
    unique: dict[tuple[Any, ...], EstimatePoint] = {}
    for point in points:
        unique.setdefault(_step_key(point), point)
    todo = list(unique.values())
    done: dict[tuple[Any, ...], dict[str, Any]] = {}
    if pool is None and (jobs <= 1 or len(todo) <= 1) and not dist.is_initialized():
        for count, point in enumerate(todo, 1):
            done[_step_key(point)] = row = estimate_point(specs[point.workload], point, options)
            if progress is not None:
                progress(count, len(todo), row)
    else:
        with contextlib.ExitStack() as stack:
            if pool is None:
                workers = max(1, min(jobs, len(todo)))
                pool = stack.enter_context(spawn_pool(workers))
            futures = {
                pool.submit(estimate_point, specs[point.workload], point, options): point
                for point in todo
            }
            for count, (future, point) in enumerate(futures.items(), 1):
                done[_step_key(point)] = row = future.result()
                if progress is not None:
                    progress(count, len(todo), row)
    rows = []
    for point in points:
        row = dict(done[_step_key(point)])
        row["world_size"] = point.world_size
        if row["status"] == OK:
            row["comm_bytes_by_scope"] = _by_scope(row, point.world_size, options.gpus_per_node)
            row.pop("comm_groups", None)  # every rank's number, at 512 ranks: not kept
        rows.append(row)
    return rows


def spawn_pool(workers: int) -> ProcessPoolExecutor:
    """``workers`` spawned processes (each sets up its own fake process group per step)."""
    return ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"))


def _by_scope(row: Mapping[str, Any], world: int, gpus_per_node: int) -> dict[str, int]:
    """The bytes this rank sends per step ``intra_node`` and ``inter_node``.

    A collective stays inside a node when its group's ranks all share one (rank //
    ``gpus_per_node``); DDP's all-reduce is over every rank.
    """
    groups = row.get("comm_groups")
    if row["strategy"] == "ddp" or not groups:
        groups = [{"ranks": list(range(world)), "bytes": comm_total(row)}]
    out = {"intra_node": 0, "inter_node": 0}
    for group in groups:
        nodes = {rank // gpus_per_node for rank in group["ranks"]}
        out["intra_node" if len(nodes) <= 1 else "inter_node"] += int(group["bytes"])
    return out


def _step_key(point: EstimatePoint) -> tuple[Any, ...]:
    world = None if point.strategy == "ddp" else point.world_size
    return point.workload, point.strategy, tuple(sorted(point.knobs.items())), world


def peak_rss_bytes(jobs: int) -> int:
    """An upper bound of the estimate's resident memory, in bytes.

    This process's peak plus ``jobs`` times the largest peak of its finished worker
    processes (they ran at the same time).
    """
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, else KiB
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale if jobs > 1 else 0
    return int(own + jobs * workers)


def estimate_environment(options: EstimateOptions, jobs: int) -> dict[str, Any]:
    """What the estimate ran on and with (the estimate itself does not depend on it)."""
    return {
        "kind": "estimate",
        **host_environment(),
        "cpus": os.cpu_count(),
        "jobs": jobs,
        "options": {"batch_size": options.batch_size, "dtype": options.dtype},
    }
