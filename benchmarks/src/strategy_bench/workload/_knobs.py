"""The knobs of a point that are not the wrapper's: accumulation, checkpointing, compile.

A point's ``knobs`` mix two kinds: the wrapper's arguments (``bucket_cap_mb``,
``reshard_after_forward``, ...: the ``training.distributed`` section) and how the trainer
runs its step around the wrapped model (:data:`STEP_KNOBS`). This module owns that split and
what the step knobs do to the model before the wrap.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from distributed_strategy import select_shard_targets
from strategy_bench._errors import BenchUsageError, error_summary

STEP_KNOBS = ("grad_accum", "activation_checkpointing", "compile")
"""Knobs of the training step, not of the wrapper (not part of ``training.distributed``)."""


def wrap_knobs(knobs: Mapping[str, Any]) -> dict[str, Any]:
    """The knobs that go to the wrapper (``wrap_module_ddp`` / ``wrap_module_fsdp``)."""
    return {key: value for key, value in knobs.items() if key not in STEP_KNOBS}


def step_knobs(knobs: Mapping[str, Any]) -> dict[str, Any]:
    """The knobs of the training step around the wrapped model."""
    return {key: value for key, value in knobs.items() if key in STEP_KNOBS}


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

    ``activation_checkpointing``: each block's forward runs under non-reentrant
    ``torch.utils.checkpoint`` (its activations are recomputed in backward; what it keeps is
    its input). ``compile``: each block is compiled in place (``nn.Module.compile``), so the
    wrapper's hooks stay outside the compiled regions. Both go on the same modules that
    FSDP shards by default, so a checkpointed or compiled region never spans two units.

    Returns:
        The blocks changed (empty when no block knob is set).

    Raises:
        BenchUsageError: If a block knob is set but the model has no repeated blocks.
    """
    checkpointed = bool(knobs.get("activation_checkpointing", False))
    backend = compile_backend(knobs)
    if not checkpointed and backend is None:
        return []
    blocks = select_shard_targets(model, None)
    if not blocks:
        raise BenchUsageError(
            f"activation_checkpointing / compile apply per block, and {type(model).__name__} "
            "has no repeated blocks (no _no_split_modules, no ModuleList / Sequential of one "
            "block class)"
        )
    for block in blocks:
        if checkpointed:
            # An instance attribute bound to the block: a deepcopy of the model rebinds it
            # to the copy's block.
            block.forward = types.MethodType(_checkpointed_forward, block)
        if backend is not None:
            block.compile(backend=backend)
    return blocks


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(self).forward
    return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)


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
