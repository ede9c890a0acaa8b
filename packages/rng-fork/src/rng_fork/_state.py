"""Snapshots of random streams as plain values, and their exact restoration."""

from __future__ import annotations

import random
from typing import Any, TypedDict

import torch

from dist_core import DeviceLike, resolve_device
from rng_fork._devices import AcceleratorStream, accelerator_stream
from rng_fork._seed import check_seed

STATE_FORMAT = "rng_fork.state/1"


class DeviceRngState(TypedDict):
    """The generator state of one accelerator device."""

    type: str
    index: int
    state: torch.Tensor


class RngState(TypedDict):
    """A snapshot of random streams, made only of tensors, lists, dicts and scalars.

    It pickles, and it survives ``torch.save`` and ``torch.load(..., weights_only=True)``.
    """

    format: str
    cpu: torch.Tensor
    device: DeviceRngState | None
    python: list[Any] | None
    numpy: dict[str, Any] | None


def capture_rng_state(
    device: DeviceLike | None = None, *, python: bool = False, numpy: bool = False
) -> RngState:
    """Snapshot the CPU generator and, for an accelerator ``device``, that device's generator.

    Args:
        device: An accelerator device (``"cuda:1"``, ``torch.device("xpu", 0)``, an int index)
            whose generator is captured too. CPU, meta or ``None`` capture the CPU generator
            only, and never initialize an accelerator.
        python: Also capture ``random``'s global state.
        numpy: Also capture ``numpy.random``'s global (legacy) state.

    Returns:
        A value for :func:`restore_rng_state`, safe to store in a checkpoint.
    """
    stream = accelerator_stream(resolve_device(device), argument="device")
    return capture_streams(stream, python=python, numpy=numpy)


def capture_streams(stream: AcceleratorStream | None, *, python: bool, numpy: bool) -> RngState:
    """Snapshot the CPU generator, ``stream`` (if any) and the optional global streams."""
    return {
        "format": STATE_FORMAT,
        "cpu": torch.get_rng_state(),
        "device": (
            None
            if stream is None
            else {"type": stream.type, "index": stream.index, "state": stream.get_state()}
        ),
        "python": _python_state() if python else None,
        "numpy": _numpy_state() if numpy else None,
    }


def restore_rng_state(state: RngState) -> None:
    """Restore exactly the streams that ``state`` holds.

    The whole value is checked before anything is written, and if a write still fails, the
    streams already written are put back: on error nothing is changed.

    Raises:
        TypeError: If ``state`` is not a state made by :func:`capture_rng_state`.
        ValueError: If a part of it is malformed (the message names the part).
    """
    _check_state(state)
    device = state["device"]
    before = capture_rng_state(
        None if device is None else torch.device(device["type"], device["index"]),
        python=state["python"] is not None,
        numpy=state["numpy"] is not None,
    )
    try:
        apply_state(state)
    except Exception:
        apply_state(before)
        raise


def apply_state(state: RngState) -> None:
    torch.set_rng_state(state["cpu"])
    device = state["device"]
    if device is not None:
        stream = accelerator_stream(
            torch.device(device["type"], device["index"]), argument="state['device']"
        )
        assert stream is not None  # checked by _check_state
        stream.set_state(device["state"])
    if state["python"] is not None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if state["numpy"] is not None:
        import numpy as np

        saved = state["numpy"]
        keys = np.asarray(saved["keys"], dtype=np.uint32)
        np.random.set_state(
            (saved["bit_generator"], keys, saved["pos"], saved["has_gauss"], saved["gauss"])
        )


def _python_state() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _numpy_state() -> dict[str, Any]:
    import numpy as np

    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    return {
        "bit_generator": str(name),
        "keys": [int(k) for k in keys],
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }


def _fail(part: str, problem: str) -> ValueError:
    return ValueError(
        f"malformed RNG state: {part} {problem}; pass a value made by capture_rng_state()"
    )


def _check_byte_tensor(value: object, part: str, expected_numel: int | None) -> None:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise _fail(part, f"must be a 1-D uint8 tensor, got {_describe(value)}")
    if expected_numel is not None and value.numel() != expected_numel:
        raise _fail(part, f"has {value.numel()} bytes, expected {expected_numel}")


def check_rng_state(state: object) -> None:
    """Check that :func:`restore_rng_state` would restore ``state``, changing nothing.

    Raises:
        TypeError: If ``state`` is not a state made by :func:`capture_rng_state`.
        ValueError: If a part of it is malformed (the message names the part).
    """
    _check_state(state)


def _check_state(state: object) -> None:
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise TypeError(
            f"state must be a dict made by capture_rng_state() (format {STATE_FORMAT!r}), "
            f"got {_describe(state)}"
        )
    missing = {"cpu", "device", "python", "numpy"} - state.keys()
    if missing:
        raise _fail("the state", f"lacks the key(s) {sorted(missing)}")
    _check_byte_tensor(state["cpu"], "state['cpu']", torch.get_rng_state().numel())
    device = state["device"]
    if device is not None:
        if not isinstance(device, dict) or not {"type", "index", "state"} <= device.keys():
            raise _fail(
                "state['device']", f"must be a dict with type, index, state, got {device!r}"
            )
        if not isinstance(device["type"], str) or not isinstance(device["index"], int):
            raise _fail("state['device']", f"has a bad type or index: {device!r}")
        stream = accelerator_stream(
            torch.device(device["type"], device["index"]), argument="state['device']"
        )
        if stream is None:
            raise _fail("state['device']", f"names {device['type']!r}, which is no accelerator")
        _check_byte_tensor(device["state"], "state['device']['state']", None)
    python = state["python"]
    if python is not None and not (
        isinstance(python, (list, tuple))
        and len(python) == 3
        and isinstance(python[1], (list, tuple))
        and len(python[1]) == len(random.getstate()[1])
    ):
        raise _fail("state['python']", "is not a random.getstate() snapshot")
    numpy_state = state["numpy"]
    if numpy_state is not None:
        needed = {"bit_generator", "keys", "pos", "has_gauss", "gauss"}
        if not isinstance(numpy_state, dict) or not needed <= numpy_state.keys():
            raise _fail("state['numpy']", f"must be a dict with keys {sorted(needed)}")
        if numpy_state["bit_generator"] != "MT19937" or len(numpy_state["keys"]) != 624:
            raise _fail("state['numpy']", "is not an MT19937 legacy snapshot")


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor(dtype={value.dtype}, shape={tuple(value.shape)})"
    text = repr(value)
    return f"{type(value).__name__} ({text[:60]}{'...' if len(text) > 60 else ''})"


def seed_rng(seed: int, *, device: DeviceLike | None = None) -> None:
    """Seed the CPU generator and, for an accelerator ``device``, that device's generator only.

    What ``torch.manual_seed`` does for one rank, without reseeding every other GPU of the
    process. Afterwards each stream is that of a fresh generator seeded with ``seed``.

    Raises:
        TypeError, ValueError: A seed that is not an int in ``torch.manual_seed``'s range,
            before anything is seeded.
    """
    value = check_seed(seed, argument="seed")
    stream = accelerator_stream(resolve_device(device), argument="device")
    torch.default_generator.manual_seed(value)
    if stream is not None:
        stream.seed(value)
