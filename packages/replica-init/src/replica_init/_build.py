"""Construct a model replica bit-identically on every rank: seeded CPU construction, then move."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.nn.parameter import UninitializedParameter

from dist_core import DeviceLike, resolve_device
from rng_fork import fork_model_rng, fork_rng

ModelFactory = Callable[..., nn.Module]


def build_replicated_model_from_scratch(
    model_cls: ModelFactory,
    init_params: Mapping[str, Any] | None,
    *,
    device: DeviceLike,
    default_dtype: torch.dtype,
    seed: int,
) -> nn.Module:
    """Build one full replica of a model, bit-identical on every rank.

    Set the default dtype, construct on CPU under a fixed seed, then move to ``device``
    (constructing on the device would draw from another generator). The result equals
    ``torch.manual_seed(seed); torch.set_default_dtype(default_dtype);
    model_cls(**init_params).to(device)`` bit for bit, but the process's random streams (CPU
    and ``device``'s) and its default dtype are left exactly as they were, also when the
    constructor raises.

    Args:
        model_cls: A model class, or any factory returning an ``nn.Module``.
        init_params: Keyword arguments for ``model_cls``; ``None`` means none.
        device: Where the replica lives: a ``torch.device``, a string, or an int (CUDA index).
        default_dtype: The floating default dtype during construction (e.g. ``torch.float32``).
        seed: The construction seed, the same on every rank.

    Returns:
        The model on ``device``.

    Raises:
        TypeError: If an argument has the wrong type, ``init_params`` does not fit the
            constructor's signature (the model's name and the keys are named), or the factory
            returns something that is not an ``nn.Module``.
        ValueError: If ``default_dtype`` is not a floating dtype torch accepts as default.
        RuntimeError: If ``device`` is not available in this process.

    Argument errors are raised before anything is constructed; an exception raised by the
    constructor itself propagates unchanged.
    """
    params = check_build_arguments(model_cls, init_params, default_dtype)
    target = resolve_device(device)
    model = construct_on_cpu(
        model_cls, params, default_dtype=default_dtype, seed=seed, rng_device=target
    )
    return model.to(device=target)


def construct_on_cpu(
    model_cls: ModelFactory,
    params: Mapping[str, Any],
    *,
    default_dtype: torch.dtype,
    seed: int,
    rng_device: torch.device,
) -> nn.Module:
    """The official construction (checked arguments): on CPU, seeded, in ``rng_device``'s fork.

    The CPU generator and ``rng_device``'s are seeded as ``torch.manual_seed(seed)`` would,
    and restored afterwards, like the default dtype, also when the constructor raises.
    """
    with fork_model_rng(rng_device, seed), _default_dtype(default_dtype), _cpu_construction():
        model = model_cls(**params)
    check_is_module(model_cls, model)
    return model


def build_on_meta(
    model_cls: ModelFactory, params: Mapping[str, Any], default_dtype: torch.dtype
) -> nn.Module:
    """Construct the model's structure on the meta device (no storage, no RNG consumed)."""
    with fork_rng(), _default_dtype(default_dtype), torch.device("meta"):
        model = model_cls(**params)
    check_is_module(model_cls, model)
    return model


def build_structure(
    model_cls: ModelFactory, params: Mapping[str, Any], default_dtype: torch.dtype
) -> nn.Module:
    """Construct the model with its parameters on the meta device and its buffers real.

    For weights that come from a file: each parameter is moved to the meta device as it is
    registered (torch's parameter-registration hook), before the constructor's init runs on
    it, so nothing is initialized and no parameter stays allocated; buffers (rotary tables,
    masks, non-persistent ones a file does not hold) keep the values the constructor gives
    them, on the CPU. Lazy parameters are left as they are. No RNG stream is consumed.

    Raises:
        ValueError: If a buffer ends on the meta device (computed from a parameter, as
            spectral norm's ``weight_u``): its value could not come from the constructor.
    """

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> Any:
        if param is None or param.is_meta or isinstance(param, UninitializedParameter):
            return None
        moved = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
        moved.__dict__.update(param.__dict__)  # attributes set on the parameter
        return moved

    with fork_rng(), _default_dtype(default_dtype), _cpu_construction():
        handle = register_module_parameter_registration_hook(on_meta)
        try:
            model = model_cls(**params)
        finally:
            handle.remove()
    check_is_module(model_cls, model)
    on_meta_buffers = [name for name, b in model.named_buffers() if b.is_meta]
    if on_meta_buffers:
        raise ValueError(
            f"{_name(model_cls)} computes the buffers {on_meta_buffers[:5]} from its parameters, "
            "so they have no value before the weights are loaded; build it with the seeded "
            "init instead (no pretrained=), then load the weights with hf_io.load_pretrained"
        )
    return model


def check_build_arguments(
    model_cls: object, init_params: object, default_dtype: object
) -> dict[str, Any]:
    """Validate the construction arguments; return the keyword arguments as a dict."""
    if not callable(model_cls):
        raise TypeError(
            f"model_cls must be an nn.Module class or a factory returning one, got "
            f"{type(model_cls).__name__} ({model_cls!r})"
        )
    if init_params is None:
        params: dict[str, Any] = {}
    elif isinstance(init_params, Mapping):
        params = dict(init_params)
    else:
        raise TypeError(
            f"init_params must be a mapping of keyword arguments or None, got "
            f"{type(init_params).__name__} ({init_params!r})"
        )
    bad_keys = [key for key in params if not isinstance(key, str)]
    if bad_keys:
        raise TypeError(f"init_params keys must be strings, got {bad_keys!r}")
    _check_signature(model_cls, params)
    _check_default_dtype(default_dtype)
    return params


def check_is_module(model_cls: object, model: object) -> None:
    """Raise ``TypeError`` unless the factory returned an ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model_cls {_name(model_cls)} returned {type(model).__name__}, not an nn.Module; "
            "pass a module class or a factory that returns a module"
        )


def _check_signature(model_cls: Callable[..., Any], params: dict[str, Any]) -> None:
    try:
        signature = inspect.signature(model_cls)
    except (TypeError, ValueError):  # builtins and C extensions: the call itself will tell
        return
    try:
        signature.bind(**params)
    except TypeError as error:
        accepted = ", ".join(signature.parameters) or "none"
        raise TypeError(
            f"init_params do not fit {_name(model_cls)}: {error}; got keys "
            f"{sorted(params)}, the constructor takes ({accepted})"
        ) from error


def _check_default_dtype(default_dtype: object) -> None:
    if not isinstance(default_dtype, torch.dtype):
        raise TypeError(
            f"default_dtype must be a torch.dtype such as torch.float32, got "
            f"{type(default_dtype).__name__} ({default_dtype!r})"
        )
    if not default_dtype.is_floating_point:
        raise ValueError(
            f"default_dtype must be a floating dtype such as torch.float32, got {default_dtype}"
        )
    try:
        with _default_dtype(default_dtype):
            pass
    except TypeError as error:
        raise ValueError(
            f"default_dtype={default_dtype} is not accepted by torch.set_default_dtype ({error}); "
            "use torch.float32 or torch.float64"
        ) from error


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _name(model_cls: object) -> str:
    return str(getattr(model_cls, "__qualname__", None) or repr(model_cls))


def _cpu_construction() -> contextlib.AbstractContextManager[object]:
    """A context in which tensor factories allocate on CPU.

    ``torch.device("cpu")`` as a context installs a torch-function mode that every factory
    call of the constructor goes through (about 5% of a small model's construction time), so
    it is entered only when an outer default device (``torch.set_default_device``) is not CPU.
    """
    if torch.get_default_device().type == "cpu":
        return contextlib.nullcontext()
    return torch.device("cpu")
