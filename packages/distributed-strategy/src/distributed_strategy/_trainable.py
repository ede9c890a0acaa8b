"""The trainer's trainable policy, applied to the built model and checked."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

TrainablePolicy = Callable[[nn.Module], nn.Module | None]


def apply_trainable(model: nn.Module, trainable: TrainablePolicy | None) -> nn.Module:
    if trainable is None:
        return model
    name = getattr(trainable, "__name__", None) or repr(trainable)
    result = trainable(model)
    if result is not None and not isinstance(result, nn.Module):
        raise TypeError(
            "the trainable policy must change the model in place and return None, or return an "
            f"nn.Module; {name!r} returned {type(result).__name__}"
        )
    if result is not None and result is not model and _is_submodule(model, result):
        raise TypeError(
            f"the trainable policy {name!r} returned {type(result).__name__}, a submodule of "
            f"the built {type(model).__name__}: the whole model would be replaced by that part "
            "(requires_grad_() returns the module it is called on). Return None (change the "
            "model in place) or the whole model"
        )
    model = model if result is None else result
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"the trainable policy {name!r} left no trainable parameter in "
            f"{type(model).__name__}; make at least one parameter require grad, or do not "
            "wrap the model"
        )
    return model


def _is_submodule(model: nn.Module, candidate: nn.Module) -> bool:
    return any(candidate is sub for sub in model.modules())
