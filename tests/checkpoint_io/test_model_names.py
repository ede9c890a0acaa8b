"""The model's state under plain names: checkpoint-io's fast path names it as torch's DSD does.

Without FSDP, checkpoint-io reads and loads the unwrapped module's own ``state_dict``; DSD
(``get_model_state_dict``) stays the owner of the names. Each case here holds the two to the
same names and the same tensors, and says which path it takes (a case that should take the
fast path and silently fell back would not be a speed-up; one that should not, a renaming).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from checkpoint_io._model import _unsharded, load_model, model_state

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)


def _net() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model.register_buffer("scratch", torch.zeros(3), persistent=False)
    return model


def _inner_compiled() -> nn.Module:
    model = _net()
    model[2] = torch.compile(model[2], backend="eager")  # type: ignore[assignment]
    return model


def _checkpointed() -> nn.Module:
    model = _net()
    model[0] = checkpoint_wrapper(model[0])
    return model


class _Renamed(nn.Module):
    """A module that asks DSD to rename its children (``_fqn_modifiers``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)

    def _fqn_modifiers(self) -> dict[str, str]:
        return {}


def _hooked() -> nn.Module:
    model = _net()
    extra = torch.ones(1)
    model[0]._register_state_dict_hook(
        lambda m, sd, prefix, local: sd.update({prefix + "x": extra})
    )
    return model


CASES: dict[str, tuple[Callable[[], nn.Module], bool]] = {
    "plain": (_net, True),
    "compiled": (lambda: torch.compile(_net(), backend="eager"), True),  # type: ignore[dict-item]
    "checkpoint-wrapped block": (_checkpointed, True),
    "compiled block inside": (_inner_compiled, False),
    "DataParallel": (lambda: nn.DataParallel(_net()), False),
    "fqn modifiers": (lambda: nn.Sequential(_net(), _Renamed()), False),
}


def test_a_key_a_state_dict_hook_adds_goes_through_dsd() -> None:
    model = _hooked()  # its key is no attribute path: DSD refuses it, at save as under FSDP2
    assert _unsharded(model) is False
    with pytest.raises(AttributeError):
        model_state(model)


@pytest.mark.parametrize("case", sorted(CASES))
def test_model_state_names_and_tensors_are_dsds(case: str) -> None:
    build, fast = CASES[case]
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DataParallel without a GPU says so
        ours = model_state(model)
        dsd = get_model_state_dict(model)
    assert _unsharded(model) is fast
    assert list(ours) == list(dsd)
    assert all(ours[k].data_ptr() == dsd[k].data_ptr() for k in ours)


@pytest.mark.parametrize("case", sorted(CASES))
def test_load_model_puts_every_value_in_place(case: str) -> None:
    build, _ = CASES[case]
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = list(model_state(model))
        new = {
            k: torch.full_like(v, float(i + 1))
            for i, (k, v) in enumerate(model_state(model).items())
        }
        before = {k: v.data_ptr() for k, v in model_state(model).items()}
        load_model(model, dict(new), strict=True)  # DSD renames the keys it is given
        after = model_state(model)
    assert list(after) == names
    assert all(torch.equal(after[k], new[k]) for k in names)
    assert {k: v.data_ptr() for k, v in after.items()} == before  # copied in, not swapped
