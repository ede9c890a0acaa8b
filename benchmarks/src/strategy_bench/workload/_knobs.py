"""The knobs of a point that are not the wrapper's: accumulation, checkpointing, compile.

A point's ``knobs`` mix two kinds: the wrapper's arguments (``bucket_cap_mb``,
``reshard_after_forward``, ...: the ``training.distributed`` section) and how the trainer
runs its step around the wrapped model (:data:`STEP_KNOBS`). This module owns that split and
what the step knobs do to the model before the wrap.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from distributed_strategy import apply_block_recipe
from fsdp_wrap import select_shard_targets
from strategy_bench._errors import BenchUsageError, error_summary
from strategy_config import CHECKPOINT_MODES, normalize_checkpointing, normalize_offload

STEP_KNOBS = ("grad_accum", "grad_accum_sync", "activation_checkpointing", "compile")
"""Knobs of the training step, not of the wrapper (not part of ``training.distributed``)."""


def wrap_knobs(knobs: Mapping[str, Any]) -> dict[str, Any]:
    """The knobs that go to the wrapper (``wrap_module_ddp`` / ``wrap_module_fsdp``)."""
    return {key: value for key, value in knobs.items() if key not in STEP_KNOBS}


def step_knobs(knobs: Mapping[str, Any]) -> dict[str, Any]:
    """The knobs of the training step around the wrapped model."""
    return {key: value for key, value in knobs.items() if key in STEP_KNOBS}


def checkpoint_mode(knobs: Mapping[str, Any]) -> str | None:
    """``"full"``, ``"selective"``, or ``None`` (no checkpointing) for a point's knobs.

    Raises:
        BenchUsageError: For a value that is none of :data:`CHECKPOINT_MODES` (or a bool).
    """
    value = knobs.get("activation_checkpointing")
    try:  # strategy-config owns the values and their spellings
        mode = normalize_checkpointing(value, path="activation_checkpointing")
    except (TypeError, ValueError):
        raise BenchUsageError(
            f"activation_checkpointing must be one of {', '.join(CHECKPOINT_MODES)}, got {value!r}"
        ) from None
    return None if mode == "none" else mode


def offloads(strategy: str, knobs: Mapping[str, Any]) -> bool:
    """Whether a point keeps its sharded state in host memory (``offload: cpu``).

    Raises:
        BenchUsageError: For a value that is not ``none`` or ``cpu``, or ``cpu`` under DDP
            (strategy-config's rule and message).
    """
    try:
        mode = normalize_offload(knobs.get("offload"), path="offload", strategy=strategy)
    except (TypeError, ValueError) as error:
        raise BenchUsageError(str(error)) from None
    return mode == "cpu"


def knob_key(knobs: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A point's knobs as a key that matches across spellings.

    Sorted, with ``activation_checkpointing=True`` (older results) read as ``"full"``.
    """
    canonical = dict(knobs)
    if "activation_checkpointing" in canonical:
        mode = checkpoint_mode(canonical)
        if mode is None:
            del canonical["activation_checkpointing"]
        else:
            canonical["activation_checkpointing"] = mode
    return tuple(sorted(canonical.items()))


def compute_dtype(strategy: str | None, knobs: Mapping[str, Any], dtype: str) -> str:
    """The autocast dtype a point's step runs under: ``dtype``, or bf16 for a bf16 recipe.

    FSDP and HSDP take ``param_dtype`` in their mixed-precision policy (the gathered
    parameters are bf16, so the compute is). DDP has no such policy: its bf16 recipe is bf16
    autocast over fp32 parameters, what DDP trainers run. So is the unwrapped copy that
    ``compute_ms`` times (``strategy=None``): the point's compute in the point's dtype.
    """
    if strategy not in ("fsdp", "hsdp") and knobs.get("param_dtype") == "bf16":
        return "bf16"
    return dtype


_FSDP_ONLY = ("param_dtype", "reduce_dtype", "offload")
"""FSDP's mixed-precision policy and offload: DDP has none (its bf16 recipe is autocast, see
:func:`compute_dtype`; its gradients are all-reduced in the parameters' dtype; a whole
replica per device has nothing to offload)."""


def recipe_for(strategy: str, recipe: Mapping[str, Any]) -> dict[str, Any]:
    """The knobs a recipe gives ``strategy``'s point.

    FSDP and HSDP take every knob. DDP takes ``param_dtype`` (bf16: autocast, see
    :func:`compute_dtype`) and the step's knobs, not ``reduce_dtype`` (DDP all-reduces its
    fp32 gradients in fp32) nor ``offload`` (a whole replica per device: nothing to offload).
    """
    knobs = dict(recipe)
    if strategy == "ddp":
        knobs.pop("reduce_dtype", None)
        knobs.pop("offload", None)
    return knobs


def ddp_wrap_knobs(knobs: Mapping[str, Any]) -> dict[str, Any]:
    """The wrapper's knobs for DDP: FSDP's mixed-precision policy and offload left out.

    Raises:
        BenchUsageError: For ``offload: cpu`` (named by strategy-config's rule).
    """
    offloads("ddp", knobs)
    return {key: value for key, value in wrap_knobs(knobs).items() if key not in _FSDP_ONLY}


def fsdp_wrap_knobs(strategy: str, knobs: Mapping[str, Any]) -> dict[str, Any]:
    """The wrapper's knobs for FSDP and HSDP: ``offload`` as ``wrap_module_fsdp`` takes it."""
    wrapped = wrap_knobs(knobs)
    wrapped.pop("offload", None)
    return {**wrapped, "offload": offloads(strategy, knobs)}


ACCUM_SYNC = ("last", "every")
"""``grad_accum_sync``: reduce the gradients on the ``last`` micro-batch only (grad-sync's
``no_sync`` on the others: unsharded gradients held until then), or on ``every`` one (what
Composer and torchtitan do under FSDP: a reduce-scatter per micro-batch, sharded gradients
held)."""


def syncs_every_micro_step(knobs: Mapping[str, Any]) -> bool:
    """Whether a point reduces its gradients on every micro-batch (``grad_accum_sync``).

    Raises:
        BenchUsageError: For a value that is not one of :data:`ACCUM_SYNC`.
    """
    value = knobs.get("grad_accum_sync", "last")
    if value not in ACCUM_SYNC:
        raise BenchUsageError(
            f"grad_accum_sync must be one of {', '.join(ACCUM_SYNC)}, got {value!r}"
        )
    return bool(value == "every")


def micro_steps(knobs: Mapping[str, Any]) -> int:
    """Micro-batches per optimizer step (``grad_accum``; 1 without accumulation)."""
    value = knobs.get("grad_accum", 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BenchUsageError(f"grad_accum must be an integer >= 1, got {value!r}")
    return value


def compile_backend(knobs: Mapping[str, Any]) -> str | None:
    """The ``torch.compile`` backend of a point: ``compile=True`` is inductor; ``None``: off."""
    value = knobs.get("compile", False)
    if value is True:
        return "inductor"
    if value is False or value is None:
        return None
    if isinstance(value, str) and value:
        return value
    raise BenchUsageError(f"compile must be true, false or a backend name, got {value!r}")


def needs_compiler(knobs: Mapping[str, Any]) -> bool:
    """Whether a point compiles with inductor, the compiler that may be missing (probed)."""
    return compile_backend(knobs) == "inductor"


def prepare_blocks(model: nn.Module, knobs: Mapping[str, Any]) -> list[nn.Module]:
    """Apply the block knobs before the wrap, to each block (FSDP's default shard units).

    ``activation_checkpointing`` and ``compile`` go through distributed-strategy's recipe
    (``apply_block_recipe``: checkpointing, then compile, per block), what ``prepare_model``
    applies for the same keys of ``training.distributed``.

    Returns:
        The blocks changed (empty when no block knob is set).

    Raises:
        BenchUsageError: If a block knob is set but the model has no repeated blocks.
    """
    mode = checkpoint_mode(knobs)
    backend = compile_backend(knobs)
    if mode is None and backend is None:
        return []
    blocks = select_shard_targets(model, None)
    if not blocks:
        raise BenchUsageError(
            f"activation_checkpointing / compile apply per block, and {type(model).__name__} "
            "has no repeated blocks (no _no_split_modules, no ModuleList / Sequential of one "
            "block class)"
        )
    apply_block_recipe(blocks, checkpointing=mode or "none", compile=backend or False)
    return blocks


def compile_unavailable(device: str) -> str | None:
    """Why ``torch.compile`` (inductor) cannot run here, or ``None`` when it can.

    Compiles and runs a two-op function on ``device`` once; the error's first line is the
    reason (no C++ compiler for CPU code, no Triton for GPU code, ...). Costs seconds: call
    it only when a compile point is about to run.
    """

    def probe(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sin()

    try:
        compiled = torch.compile(probe, backend="inductor")
        compiled(torch.ones(4, device=device))
    except Exception as error:  # whatever the compiler stack raised: that is the reason
        return f"torch.compile does not work on {device}: {error_summary(error)}"
    finally:
        torch.compiler.reset()
    return None
