"""What one training step holds (memory by kind) and the untimed step that accounts it all.

:func:`account` runs one optimizer step and reports its memory and its communication; the
collectives' bytes are counted by :class:`~strategy_bench.measure._comm.CommBytes`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves

from dist_core import local_tensor
from distributed_strategy import no_sync
from strategy_bench._compat import fsdp_gather_outputs, storage_key
from strategy_bench.measure._comm import CommBytes, bytes_by_dim, group_ranks
from strategy_bench.measure._tracker import LiveTensors
from strategy_bench.workload import selective_kept


def local_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes this rank stores for ``tensors`` (a ``DTensor``'s local shard, not its whole)."""
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        local = local_tensor(tensor)
        total += local.numel() * local.element_size()
    return int(total)


def ddp_bucket_bytes(model: nn.Module, *, as_view: bool | None = None) -> int:
    """DDP's reducer buckets: a flat copy of every trainable gradient, all-reduced in place.

    With ``gradient_as_bucket_view`` the gradients are views into the buckets (counted once,
    as ``grad_bytes``), so the buckets add nothing. ``0`` for anything but DDP.

    Args:
        model: A DDP wrapper; or, with ``as_view`` given, the bare model DDP would wrap (the
            estimate's case).
        as_view: DDP's ``gradient_as_bucket_view``; ``None`` reads it from the wrapper.
    """
    if as_view is None:
        if not isinstance(model, DistributedDataParallel):
            return 0
        as_view = bool(model.gradient_as_bucket_view)
    if as_view:
        return 0
    return local_bytes(p for p in model.parameters() if p.requires_grad)


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """``params`` and ``trainable_params``: elements of all and of the trainable parameters."""
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors on this rank (AdamW: two moments, a step)."""
    return local_bytes(optimizer_state_tensors(optimizer))


def host_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state in host memory.

    What ``offload: cpu`` keeps there (pinned on CUDA); on a CPU run, all of it. A trainable
    parameter's gradient is counted at the parameter's size whether or not it is held now
    (the step frees it), on the parameter's side.
    """
    params = [p for p in model.parameters() if local_tensor(p).device.type == "cpu"]
    grads = [p for p in params if p.requires_grad]
    state = [t for t in optimizer_state_tensors(optimizer) if local_tensor(t).device.type == "cpu"]
    return local_bytes(params) + local_bytes(grads) + local_bytes(state)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors (AdamW: two moments and a step per parameter)."""
    return [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]


@contextmanager
def saved_activation_bytes(model: nn.Module) -> Iterator[list[int]]:
    """Sum the bytes that autograd saves for backward while the block runs (the forward).

    Each storage counts once; the parameters themselves (and views of them, such as a
    transposed weight) are not activations and do not count. The total, in ``[0]`` of the
    yielded list, is what the forward holds for backward at its end: the activation peak of
    a step, independent of device and allocator. Fake tensors (``strategy-bench estimate``)
    count the same way: their storages have sizes but no data.
    """
    params = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    total = [0]

    def is_parameter(tensor: torch.Tensor) -> bool:
        base = tensor._base if tensor._base is not None else tensor
        return isinstance(base, nn.Parameter) or id(base) in params

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not is_parameter(tensor):
            key = storage_key(tensor)  # the storage object: real, meta and fake tensors alike
            if key not in seen:
                seen.add(key)
                total[0] += tensor.untyped_storage().nbytes()
        return tensor

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
    with selective_kept() as kept, hooks:
        yield total
    for tensor in kept:  # selective checkpointing's kept matmul and attention outputs
        pack(tensor)


def autocast(dtype: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The step's compute dtype: ``"bf16"`` is bf16 autocast (fp32 master weights).

    Without autocast's weight cache: with it, the bf16 cast of every fp32 leaf weight (FSDP2's
    gathered parameters included) lives until the context exits, so at the end of the
    forward every rank held the whole model in bf16, checkpointed or not (Llama 2 70B on 64
    ranks with full checkpointing: 170 GiB against 51 GiB). Each forward casts again instead.
    """
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False)
    return contextlib.nullcontext()


def accumulate(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batches: Sequence[Any],
    autocast: contextlib.AbstractContextManager[Any],
    saved: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    phase: Callable[[str], None] | None = None,
    *,
    sync_every: bool = False,
) -> None:
    """Forward and backward of one optimizer step: ``len(batches)`` micro-batches.

    Every micro-step but the last runs under grad-sync's ``no_sync`` (no gradient
    reduction), unless ``sync_every`` (each micro-step reduces: ``grad_accum_sync=every``);
    each loss is scaled by ``1 / len(batches)``, so the accumulated gradient is the mean
    over the micro-batches. ``saved`` wraps each forward (the activation count); ``phase``
    is told ``"forward"`` and ``"backward"`` as each begins (the memory timeline).
    """
    for index, batch in enumerate(batches):
        last = index == len(batches) - 1 or sync_every
        with contextlib.nullcontext() if last else no_sync(model):
            if phase is not None:
                phase("forward")
            with saved(), autocast:
                loss = loss_fn(model, batch)
            if phase is not None:
                phase("backward")
            (loss / len(batches)).backward()  # type: ignore[no-untyped-call]


def account(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batches: Sequence[Any],
    autocast: contextlib.AbstractContextManager[Any],
    *,
    optimizer_step: Callable[[], Any] | None = None,
    stand_ins: Iterable[torch.Tensor] = (),
    count_comm: bool = True,
    sync_every: bool = False,
) -> dict[str, Any]:
    """One more (untimed) optimizer step: memory and communication.

    Parameters, gradients and optimizer state are this rank's local storage (an FSDP rank
    holds about 1/N of each); activations are what one micro-batch's forward saves for
    backward; the collectives are counted over every micro-batch of the step. The live
    tensors of the whole step (forward, backward, optimizer) are tracked
    (:class:`LiveTensors`). The same function measures a real step (``run``) and a step on
    fake tensors (``estimate``).

    Args:
        model: The wrapped model.
        optimizer: Its optimizer (stepped once), with its state from an earlier step.
        loss_fn: The workload's loss.
        batches: The step's micro-batches.
        autocast: The compute dtype's context.
        optimizer_step: Steps the optimizer (default ``optimizer.step``).
        stand_ins: Tensors that stand in for the model's while the optimizer steps (the
            estimate's: its optimizer holds meta twins of the fake parameters): known to the
            tracker, not counted.
        count_comm: ``False``: no :class:`CommBytes` mode (the ``comm_*`` entries are empty);
            the memory figures are the same (a peak-only probe: ``estimate --largest``).
        sync_every: Reduce on every micro-batch (``grad_accum_sync=every``).

    Returns:
        ``param_bytes``, ``grad_bytes``, ``optimizer_bytes``, ``ddp_bucket_bytes``,
        ``activation_peak_bytes``, ``comm_bytes_per_step``, ``comm_calls_per_step``,
        ``comm_bytes_by_dtype`` (per collective, the bytes of each dtype that travelled), and
        the tracked step's ``tracked_peak_bytes`` (``tracked_entry_bytes``: what it started
        from), ``peak_phase``, ``peak_parts_bytes``
        (``model``: parameters, buffers and inputs; ``optimizer``; ``fsdp_gathered``;
        ``step_tensors``: activations, gradients and temporaries; ``ddp_buckets``: DDP's
        reducer buckets, held all along) and ``memory_timeline`` (``[phase, bytes]``
        samples, without the buckets).
    """
    optimizer.zero_grad(set_to_none=True)
    peak = [0]

    @contextmanager
    def saved() -> Iterator[None]:
        with saved_activation_bytes(model) as total:
            yield
        peak[0] = max(peak[0], total[0])

    state = optimizer_state_tensors(optimizer)
    held = [*model.parameters(), *model.buffers(), *state, *tree_leaves(list(batches))]
    tracker = LiveTensors(held, fsdp_gather_outputs(model), ignored=stand_ins)
    entry = tracker.peak  # what the step starts from: the held tensors, FSDP's gathered ones

    def phase(name: str) -> None:
        tracker.phase = name

    comm = CommBytes()
    with comm if count_comm else contextlib.nullcontext(), tracker:
        accumulate(model, loss_fn, batches, autocast, saved, phase, sync_every=sync_every)
        phase("optimizer")
        (optimizer_step or optimizer.step)()
    state_bytes = optimizer_bytes(optimizer)
    parts = tracker.peak_parts
    buckets = ddp_bucket_bytes(model)
    out = {
        "tracked_peak_bytes": tracker.peak + buckets,
        "tracked_entry_bytes": entry + buckets,
        "peak_phase": tracker.peak_phase,
        "peak_parts_bytes": {
            "model": parts["held"] - state_bytes,
            "optimizer": state_bytes,
            "fsdp_gathered": parts["gathered"],
            "step_tensors": parts["step"],
            "ddp_buckets": buckets,
        },
        "memory_timeline": [list(sample) for sample in tracker.timeline()],
        "param_bytes": local_bytes(model.parameters()),
        "optimizer_bytes": optimizer_bytes(optimizer),
        "activation_peak_bytes": peak[0],
        "grad_bytes": local_bytes(p.grad for p in model.parameters()),
        "ddp_bucket_bytes": buckets,
        "comm_bytes_per_step": dict(comm.bytes),
        "comm_calls_per_step": dict(comm.calls),
        "all_gather_bytes_by_call": list(comm.gathers),
        "comm_bytes_by_dim": bytes_by_dim(model, comm.by_group),
        "comm_bytes_by_dtype": {kind: dict(sizes) for kind, sizes in comm.by_dtype.items()},
        "comm_groups": group_ranks(model, comm.by_group),
    }
    optimizer.zero_grad(set_to_none=True)
    return out
