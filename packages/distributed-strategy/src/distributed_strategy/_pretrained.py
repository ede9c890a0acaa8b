"""``prepare_model(..., pretrained=PATH)``: the structure without init, wrapped, then loaded.

No parameter is initialized or allocated whole: the model is built with its parameters on the
meta device (buffers keep the constructor's values), sharded (FSDP/HSDP) or kept whole (DDP),
given storage on the device, and filled from the safetensors files, each rank reading only
its own slices. Buffers the files lack (rotary tables, non-persistent ones) get back the
constructor's values.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from dist_core import agree
from hf_io import load_pretrained
from replica_init import build_structure, check_same_structure, materialize

Stage = Callable[[str], Any]


def build_pretrained(
    model_cls: Callable[..., nn.Module],
    init_params: Mapping[str, Any] | None,
    *,
    path: str | os.PathLike[str],
    device: torch.device,
    default_dtype: torch.dtype,
    policy: Callable[[nn.Module], nn.Module],
    wrap: Callable[[nn.Module], nn.Module] | None,
    stages: Stage,
) -> nn.Module:
    """The model from ``path``: built on meta, sharded by ``wrap`` (or whole), then loaded.

    Args:
        model_cls: The model class or factory.
        init_params: Its keyword arguments.
        path: The pretrained directory or file (``hf_io.load_pretrained``'s ``path``).
        device: This rank's device.
        default_dtype: The floating default dtype during construction.
        policy: The trainable policy, applied to the structure.
        wrap: Shards the structure (FSDP/HSDP) before it gets storage; ``None`` keeps it whole
            (DDP, wrapped by the caller after the load).
        stages: The stage context of ``prepare_model``.

    Returns:
        The loaded model: sharded if ``wrap`` was given, else whole on ``device``.
    """
    failure: Exception | None = None
    model: nn.Module | None = None
    try:
        with stages("build"):
            model = build_structure(model_cls, dict(init_params or {}), default_dtype)
        with stages("trainable"):
            model = policy(model)
    except Exception as error:
        failure = error
    check_same_structure(model, failure, None)
    assert model is not None
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        with stages("wrap"):
            model = wrap(model) if wrap is not None else model
        with stages("load"):
            materialize(model, device)
            with torch.no_grad():
                for name, buffer in model.named_buffers():
                    buffer.copy_(buffers[name])
    except Exception as error:
        failure = error
    agree(failure, "sharding the pretrained model's structure")
    del buffers
    with stages("load"):
        load_pretrained(model, path)
    return model
