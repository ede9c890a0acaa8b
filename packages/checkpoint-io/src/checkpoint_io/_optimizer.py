"""The optimizer's state keyed by parameter name: collected, templated, put back."""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from checkpoint_io._compat import set_element
from checkpoint_io._errors import CheckpointError
from checkpoint_io._model import parameter_names
from checkpoint_io._storage.manifest import OPTIM
from checkpoint_io._storage.planners import Whole
from checkpoint_io._storage.tiling import saved_entries
from dist_core import local_tensor, unwrap_model
from safe_store import dumps
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
    # What the JSON cannot carry is refused before anything is written: the hyperparameters
    # (the groups are one entry in DCP) and the state's values that are not tensors.
    kind = type(optimizer).__name__
    nested = [
        (name, key, value)
        for name, values in state.items()
        for key, value in values.items()
        if type(value) not in _FLAT
    ]
    _check_keys([(name, value) for name, _, value in nested], kind)
    for name, key, value in nested:
        _check_value(value, f"the optimizer's state ({kind}) for {name!r}[{key!r}]")
    dumps(groups, what=f"the optimizer's param_groups ({kind})")
    return {"state": state, "param_groups": Whole(groups)}


def _check_value(value: Any, what: str) -> None:
    """Check ``value`` as DCP writes it: dicts and lists walked, the rest one JSON value."""
    if isinstance(value, torch.Tensor):
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            _check_value(item, f"{what}[{key!r}]")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_value(item, f"{what}[{index}]")
    else:
        dumps(value, what=what + f" ({_FIX})")


_FLAT = frozenset({torch.Tensor, nn.Parameter, DTensor, int, float, bool, type(None)})
"""The state values that need no look inside (nearly all of them: a step, Adam's moments)."""


def _check_keys(values: list[tuple[str, Any]], kind: str) -> None:
    """Every dict inside the state has string keys (DCP makes each key a string)."""
    for name, value in values:
        stack: list[Any] = [value]
        while stack:
            item = stack.pop()
            if isinstance(item, Mapping):
                odd = [key for key in item if type(key) is not str]
                if odd:
                    raise TypeError(
                        f"the optimizer's state ({kind}) for '{name}' holds a dict with the "
                        f"key {odd[0]!r} ({type(odd[0]).__name__}); DCP stores a dict inside "
                        "the state a key each, by name, so it would load back as "
                        f"{str(odd[0])!r}: use string keys"
                    )
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)


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
    """The saved ``param_groups`` (decoded from the index's JSON), checked.

    Raises:
        CheckpointError: If the value is not a list of groups with ``params`` lists.
    """
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


def _check_paths(paths: list[tuple[object, ...]]) -> None:
    """The optimizer state's paths in DCP's index are as DCP writes them, or refused.

    A path is ``("state", name, key, ...)``: string keys below a dict, indices below a list,
    none of them a value's and a container's at once.
    """
    leaves = set(paths)
    kinds: dict[tuple[object, ...], type] = {}
    for path in paths:
        fault = None
        shaped = len(path) >= 3 and type(path[1]) is str and type(path[2]) is str
        if not shaped or not all(type(key) in (str, int) for key in path[2:]):
            fault = "which DCP does not write"
        elif any(path[:end] in leaves for end in range(3, len(path))):  # a value above it
            fault = "both as a value and as a container"
        elif any(type(key) is int and not 0 <= key < len(paths) for key in path[3:]):
            fault = f"an index outside its {len(paths)} entries"
        else:
            for end in range(3, len(path)):  # below one container, keys of one kind
                if kinds.setdefault(path[:end], type(path[end])) is not type(path[end]):
                    fault = f"whose {path[:end]!r} is both a dict and a list"
        if fault is not None:
            raise CheckpointError(
                f"the checkpoint's index holds the optimizer state path {path!r}, {fault}; "
                "the checkpoint is damaged or crafted. Nothing was loaded"
            )


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
    entries = saved_entries(metadata, OPTIM)
    _check_paths([path for path in entries if path[0] == "state"])
    for path, storage in entries.items():
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
        if not isinstance(storage, TensorStorageMetadata):
            leaf: Any = None
        elif tuple(storage.size) == tuple(param.shape):
            leaf = torch.empty_like(param, dtype=storage.properties.dtype)
        else:  # a scalar step, or a factored statistic: a whole tensor on every rank
            device = "cpu" if len(storage.size) == 0 else local_tensor(param).device
            leaf = torch.empty(tuple(storage.size), dtype=storage.properties.dtype, device=device)
        # the dicts and lists DCP flattened, made again as DCP's own loader makes them (a
        # string key a dict's, an index a list's, padded with None); paths checked above
        set_element(state, (name, *keys), leaf)
    return {"state": state, "param_groups": io.BytesIO()}
