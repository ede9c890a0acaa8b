"""The optimizer's state keyed by parameter name: collected, templated, put back."""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from checkpoint_io._errors import CheckpointError
from checkpoint_io._format.index import saved_entries
from checkpoint_io._format.manifest import OPTIM
from checkpoint_io._format.values import safe_bytes
from checkpoint_io._state.model import parameter_names
from dist_core import local_tensor, unwrap_model
from strategy_config import did_you_mean

_FIX = "keep the optimizer's hyperparameters and state to these, or save the rest apart"


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name; parameters without state are absent.

    Written here rather than with ``get_optimizer_state_dict``: that one gives an optimizer
    with no state yet a state by running a step with zero gradients (it changes the user's
    optimizer, and AdamW's step count), and its loader refuses a state in which some
    parameters have none (a head not trained yet, conditioning features without a gradient).
    """
    names = _optimizer_names(model, optimizer)
    saved = optimizer.state_dict()
    state = {names[index]: dict(values) for index, values in saved["state"].items()}
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [names[i] for i in group["params"]],
        }
        for group in saved["param_groups"]
    ]
    # What a load would refuse is refused before anything is written: the hyperparameters
    # and names (one opaque entry in DCP), and any state that is not a tensor or a number.
    kind = type(optimizer).__name__
    others = {
        (name, key): value
        for name, values in state.items()
        for key, value in values.items()
        if not isinstance(value, torch.Tensor | int | float | bool | str | None)
    }
    if others:
        safe_bytes(others, f"the optimizer's state ({kind})", _FIX)
    buffer = io.BytesIO(safe_bytes(groups, f"the optimizer's param_groups ({kind})", _FIX))
    return {"state": state, "param_groups": buffer}


def _optimizer_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    by_id = parameter_names(model)
    names = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = by_id.get(id(param))
            if name is None:
                raise CheckpointError(
                    f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not "
                    f"a parameter of {type(unwrap_model(model)).__name__}; build the optimizer "
                    "from model.parameters() after wrapping"
                )
            names.append(name)
    return names


def load_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, loaded: Mapping[str, Any]
) -> None:
    """Put a loaded name-keyed optimizer state into ``optimizer`` (its own index order)."""
    names = _optimizer_names(model, optimizer)
    index = {name: i for i, name in enumerate(names)}
    saved_groups = saved_param_groups(loaded["param_groups"])
    current = check_optimizer_groups(model, optimizer, saved_groups)
    groups = [
        {**{k: v for k, v in saved.items() if k != "params"}, "params": [index[n] for n in now]}
        for saved, now in zip(saved_groups, current, strict=True)
    ]
    state = {index[name]: values for name, values in loaded["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def saved_param_groups(value: Any) -> list[dict[str, Any]]:
    """The saved ``param_groups`` from their value (a buffer of ``torch.save`` bytes).

    Raises:
        CheckpointError: If the value is not a list of groups with ``params`` lists.
    """
    if isinstance(value, io.BytesIO):
        value.seek(0)
        value = torch.load(value, weights_only=True, map_location="cpu")
    if not isinstance(value, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in value
    ):
        raise CheckpointError("the checkpoint's optimizer param_groups are malformed")
    return value


def check_optimizer_groups(
    model: nn.Module, optimizer: torch.optim.Optimizer, saved_groups: list[dict[str, Any]]
) -> list[list[str]]:
    """The optimizer's groups by parameter name, checked against the saved ones.

    Raises:
        CheckpointError: If the groups hold other parameters than the saved ones.
    """
    names = _optimizer_names(model, optimizer)
    current = [
        [names[i] for i in range(start, start + len(g["params"]))]
        for start, g in _starts(optimizer)
    ]
    if [sorted(g["params"]) for g in saved_groups] != [sorted(g) for g in current]:
        raise CheckpointError(
            "the optimizer's parameter groups differ from the saved ones (saved "
            f"{[len(g['params']) for g in saved_groups]} parameters per group, now "
            f"{[len(g) for g in current]}); build the optimizer with the same groups"
        )
    return current


def _starts(optimizer: torch.optim.Optimizer) -> Iterator[tuple[int, dict[str, Any]]]:
    start = 0
    for group in optimizer.param_groups:
        yield start, group
        start += len(group["params"])


def optimizer_template(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    metadata: Metadata,
    *,
    strict: bool,
) -> dict[str, Any]:
    """What to load the saved optimizer state into: shaped like each parameter where it is.

    Fresh tensors (the staging of a load): the optimizer's own state is replaced only once
    everything was read and checked.
    """
    params = dict(unwrap_model(model).named_parameters())
    state: dict[str, dict[str, Any]] = {}
    for path, storage in saved_entries(metadata, OPTIM).items():
        if path[0] != "state":
            continue
        name, keys = path[1], path[2:]
        param = params.get(name)
        if param is None:
            if strict:
                raise CheckpointError(
                    f"the checkpoint has optimizer state for '{name}'"
                    f"{did_you_mean(name, params)}, which the model does not have; pass "
                    "strict=False to skip it"
                )
            continue
        slot = state.setdefault(name, {})
        for key in keys[:-1]:  # a dict inside the state (DCP flattens it into one key each)
            slot = slot.setdefault(key, {})
        if not isinstance(storage, TensorStorageMetadata):
            slot[keys[-1]] = None
        elif tuple(storage.size) == tuple(param.shape):
            slot[keys[-1]] = torch.empty_like(param, dtype=storage.properties.dtype)
        else:  # a scalar step, or a factored statistic: a whole tensor on every rank
            device = "cpu" if len(storage.size) == 0 else local_tensor(param).device
            slot[keys[-1]] = torch.empty(
                tuple(storage.size), dtype=storage.properties.dtype, device=device
            )
    return {"state": state, "param_groups": io.BytesIO()}
