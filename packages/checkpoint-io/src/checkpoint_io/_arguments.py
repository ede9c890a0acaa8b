"""What a public entry checks first, before any state changes or any collective starts."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from checkpoint_io._background.inflight import settle_in_flight


def check_stateful(stateful: object) -> None:
    """``stateful`` is ``None`` or a mapping of names to objects with both state methods."""
    if stateful is None:
        return
    if not isinstance(stateful, Mapping):
        raise TypeError(
            f"stateful must be a mapping of names to objects, got {type(stateful).__name__}"
        )
    for name, obj in stateful.items():
        if not isinstance(name, str):
            raise TypeError(f"stateful keys must be strings, got {name!r}")
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"stateful[{name!r}] is a {type(obj).__name__}, which lacks state_dict() and "
                "load_state_dict(); pass an object with both (LR scheduler, module, sampler)"
            )


def check_model_optimizer(model: object, optimizer: object) -> None:
    """``model`` is a module; ``optimizer`` is ``None`` or an optimizer."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )


def begin(
    path: object,
    model: object,
    optimizer: object,
    step: object,
    extra: object,
    stateful: object,
) -> Path:
    """Check the arguments and settle a save still in flight (no collective).

    Returns:
        The checkpoint directory.

    Raises:
        TypeError: An argument of the wrong type, named with its value.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__} ({path!r})")
    check_model_optimizer(model, optimizer)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise TypeError(f"step must be an int or None, got {type(step).__name__} ({step!r})")
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise TypeError(f"extra must be a mapping or None, got {type(extra).__name__}")
        try:
            json.dumps(dict(extra), allow_nan=False)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"extra must be JSON-serialisable (it goes into checkpoint.json): {error}; "
                "store tensors and other objects through stateful= instead"
            ) from None
    check_stateful(stateful)
    settle_in_flight()
    return Path(os.fspath(path))
