"""Mixed precision for FSDP from dtype names (``"bf16"``, ``"fp16"``, ``"fp32"``)."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from strategy_config import normalize_dtype_name

_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def torch_dtype(name: str | torch.dtype | None, *, argument: str = "dtype") -> torch.dtype | None:
    """The ``torch.dtype`` for a dtype name; ``None`` stays ``None``.

    Args:
        name: ``"bf16"``, ``"fp16"``, ``"fp32"`` or an alias (``"bfloat16"``, ``"half"``, ...),
            a floating ``torch.dtype`` of those three, or ``None``.
        argument: The argument named in error messages.

    Returns:
        The dtype, or ``None``.

    Raises:
        TypeError: If ``name`` is neither a string, a dtype nor ``None``.
        ValueError: If the name is unknown (the valid names are listed) or the dtype is not
            one of bf16, fp16, fp32.
    """
    if name is None:
        return None
    if isinstance(name, torch.dtype):
        if name not in _TORCH_DTYPES.values():
            raise ValueError(
                f"{argument} must be one of torch.bfloat16, torch.float16, torch.float32, "
                f"got {name}"
            )
        return name
    canonical = normalize_dtype_name(name, path=argument)
    assert canonical is not None
    return _TORCH_DTYPES[canonical]


def mixed_precision_policy(
    param_dtype: str | torch.dtype | None, reduce_dtype: str | torch.dtype | None
) -> MixedPrecisionPolicy:
    """An FSDP2 ``MixedPrecisionPolicy`` from dtype names.

    Args:
        param_dtype: Dtype of the unsharded parameters in forward/backward; ``None`` keeps
            the parameters' own dtype.
        reduce_dtype: Dtype of the gradient reduce-scatter; ``None`` uses ``param_dtype``.

    Returns:
        The policy (``MixedPrecisionPolicy()`` when both are ``None``: full precision).
    """
    return MixedPrecisionPolicy(
        param_dtype=torch_dtype(param_dtype, argument="param_dtype"),
        reduce_dtype=torch_dtype(reduce_dtype, argument="reduce_dtype"),
    )
