"""The recipe's block stage: activation checkpointing, then ``torch.compile``, per block.

prepare_model applies a recipe in the order FSDP2 needs (torchtitan's): each block gets its
checkpointing, then is compiled, then the wrap shards it (or DDP wraps the whole model). The
blocks are the FSDP shard policy's units (the same auto-detection), so a checkpointed or
compiled region never spans two units; a model with no repeated block gets the recipe on the
whole model. The bench applies its knobs through the same functions.

The composed import re-exports :func:`apply_block_recipe` (what a trainer that wraps its own
model calls); the rest is importable from here.
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from dist_core import log_rank0
from fsdp_wrap import ShardPolicy, select_shard_targets
from strategy_config import CHECKPOINT_MODES

__all__ = ["KEPT_OPS", "apply_block_recipe", "recipe_blocks", "selective_kept"]

logger = logging.getLogger(__name__)


def recipe_blocks(model: nn.Module, shard: ShardPolicy | None = None) -> list[nn.Module]:
    """The modules a recipe applies to: the shard policy's units, else the whole model.

    Args:
        model: The built model, before the wrap.
        shard: FSDP's shard policy (``None``: the default rule, see ``select_shard_targets``).
    """
    blocks = select_shard_targets(model, shard)
    if blocks:
        return blocks
    log_rank0(
        logger,
        logging.INFO,
        "%s has no repeated block (no _no_split_modules, no ModuleList / Sequential of one "
        "block class): the recipe applies to the whole model",
        type(model).__name__,
    )
    return [model]


def apply_block_recipe(
    blocks: Sequence[nn.Module], *, checkpointing: str = "none", compile: bool | str = False
) -> None:
    """Checkpointing, then compile, on each of ``blocks`` (in place, before the wrap).

    Args:
        blocks: The modules (see :func:`recipe_blocks`).
        checkpointing: ``"none"``, ``"full"`` (the block's forward runs under non-reentrant
            ``torch.utils.checkpoint``: only its input is kept, the rest recomputed in
            backward) or ``"selective"`` (torch's selective checkpoint contexts keep the
            outputs of matmuls and attention, :data:`KEPT_OPS`; the rest is recomputed).
        compile: ``True`` compiles each block in place with inductor
            (``nn.Module.compile``); a string names another backend; ``False`` does not.

    Raises:
        ValueError: For a ``checkpointing`` mode that is not one of ``CHECKPOINT_MODES``.
        TypeError: For a ``compile`` that is neither a bool nor a backend name.
    """
    if checkpointing not in CHECKPOINT_MODES:
        raise ValueError(
            f"checkpointing must be one of {', '.join(CHECKPOINT_MODES)}, got {checkpointing!r}"
        )
    if not isinstance(compile, bool | str) or compile == "":
        raise TypeError(f"compile must be a bool or a backend name, got {compile!r}")
    backend = "inductor" if compile is True else compile or None
    for block in blocks:
        if checkpointing != "none":
            # An instance attribute bound to the block: a deepcopy rebinds it to the copy's
            # block, and FSDP2's class swap keeps the block's own forward underneath.
            forward = _checkpointed_forward if checkpointing == "full" else _selective_forward
            block.forward = types.MethodType(forward, block)
        if backend is not None:
            _compile(block, backend, checkpointed=checkpointing != "none")


def _compile(block: nn.Module, backend: str, *, checkpointed: bool) -> None:
    """Compile ``block`` in place, so that its forward is traced whatever its class.

    ``nn.Module.compile`` compiles ``_call_impl``, which dynamo skips, and traces from the
    forward it calls: a forward defined in ``torch.nn`` (``nn.TransformerEncoderLayer``, an
    ``nn.Sequential`` as the whole model) is in dynamo's skip files too, so such a block
    compiled nothing (pytorch/pytorch 150915). Its bound forward is compiled instead. A user's
    block, or a checkpointed one (its forward is this module's wrapper), uses
    ``nn.Module.compile``, as torchtitan does.
    """
    if not checkpointed and type(block).__module__.startswith("torch."):
        block.forward = torch.compile(block.forward, backend=backend)
    else:
        block.compile(backend=backend)


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(self).forward
    return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)


def _selective_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(self).forward
    return checkpoint(
        forward, self, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs
    )


_COLLECTORS: list[list[Mapping[Any, Any]]] = []


@contextlib.contextmanager
def selective_kept() -> Iterator[list[torch.Tensor]]:
    """The tensors selective checkpointing keeps for backward, of the forwards run while active.

    They live in stores of torch's selective checkpoint contexts, not among autograd's saved
    tensors (the bench's activation count reads them). The yielded list is filled when the
    block exits.
    """
    found: list[Mapping[Any, Any]] = []
    kept: list[torch.Tensor] = []
    _COLLECTORS.append(found)
    try:
        yield kept
    finally:
        _COLLECTORS.remove(found)
        for store in found:
            kept.extend(_tensors(list(store.values())))


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a selective-checkpoint store: per op, per call, the kept outputs.

    Each kept output is wrapped (``_VersionWrapper(val=...)`` in torch 2.11-2.13) and the ops
    that are recomputed hold placeholders; both are walked without naming torch's classes.
    """
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)
    elif isinstance(getattr(value, "val", None), torch.Tensor | tuple | list):
        yield from _tensors(value.val)


def _selective_contexts() -> tuple[Any, Any]:
    """Torch's selective checkpoint contexts: keep :data:`KEPT_OPS`' outputs, recompute the rest."""
    ops = sorted(KEPT_OPS, key=str)
    caching, cached = create_selective_checkpoint_contexts(ops)  # type: ignore[no-untyped-call]
    for found in _COLLECTORS:
        found.append(caching.storage)
    return caching, cached


def _kept_ops() -> frozenset[Any]:
    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    return frozenset(getattr(aten, name).default for name in names if hasattr(aten, name))


KEPT_OPS = _kept_ops()
"""The ops whose outputs selective checkpointing keeps: matmuls and attention kernels (after
torchtitan's policy, which also recomputes every second ``mm``)."""
