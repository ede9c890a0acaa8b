"""Values as JSON that carries no code: what a checkpoint holds besides its tensors.

JSON's own types carry most values (``None``, bools, ints, finite floats, strings, lists and
dicts with string keys). A few tags, each a one-key object whose key starts with ``$``, carry
what JSON lacks:

==================  ===========================================================
``{"$tuple": [..]}``  a tuple
``{"$dict": [[k, v], ..]}``  a dict with a key that is not a string (or starts with ``$``)
``{"$odict": [[k, v], ..]}``  an ``OrderedDict``
``{"$bytes": "..."}``  bytes (base64)
``{"$float": "nan"}``  a float JSON has no number for (``nan``, ``inf``, ``-inf``)
``{"$dtype": "float32"}``  a ``torch.dtype``
``{"$device": "cuda:0"}``  a ``torch.device``
``{"$tensor": "name"}``  a tensor, stored apart in a safetensors file under ``name``
==================  ===========================================================

Anything else (a class instance, a ``bytearray``, a buffer, a function) is a ``TypeError`` at
:func:`dumps`, naming where it sits, before anything is written. :func:`loads` reads untrusted
text with caps: its length, its nesting, an integer's digits, no key twice, no unknown tag;
what it builds is linear in the text (JSON has no references).
"""

from __future__ import annotations

import base64
import collections
import json
import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["MAX_DEPTH", "MAX_DIGITS", "MAX_TEXT", "dumps", "loads"]

MAX_TEXT = 256 << 20
"""The longest text :func:`loads` reads, in bytes."""
MAX_DEPTH = 100
"""The deepest nesting of lists and objects :func:`loads` accepts."""
MAX_DIGITS = 64
"""The most digits of an integer :func:`loads` accepts."""

_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.bool,
    )
}
_SPECIAL = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
TensorSink = Callable[[torch.Tensor], str]
"""Stores a tensor apart and returns the name :func:`loads` will be given it by."""


def dumps(value: Any, *, what: str, tensors: TensorSink | None = None) -> str:
    """``value`` as tagged JSON text.

    Args:
        value: The value.
        what: Where it comes from, for the error (``"stateful['sched']"``).
        tensors: Where tensors go (each replaced by a ``$tensor`` tag); ``None``: a tensor
            is refused like any other object.

    Raises:
        TypeError: If ``value`` holds something the codec cannot carry, naming its path.
    """
    return json.dumps(_encode(value, what, tensors, 0), separators=(",", ":"), allow_nan=False)


def loads(
    text: str | bytes,
    *,
    what: str,
    tensors: Callable[[str], torch.Tensor] | None = None,
) -> Any:
    """The value :func:`dumps` wrote, from untrusted ``text``.

    Args:
        text: The JSON text.
        what: Where it comes from, for the error.
        tensors: The stored tensor of a ``$tensor`` tag's name (``None``: such a tag is
            refused).

    Raises:
        ValueError: If the text is too long, not JSON, nested too deep, holds an integer of
            too many digits, a key twice, an unknown or malformed tag, or a tensor it may not.
    """
    if len(text) > MAX_TEXT:
        raise ValueError(f"{what}: {len(text)} bytes of JSON, more than {MAX_TEXT}")
    raw = strict_json(text, what)
    return _decode(raw, what, tensors, 0)


def strict_json(text: str | bytes, what: str) -> Any:
    """``json.loads`` with no key twice, no ``NaN``, integers of at most MAX_DIGITS digits.

    Raises:
        ValueError: Naming ``what`` and the fault.
    """

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in items:
            if key in seen:
                raise ValueError(f"{what}: the key {key[:80]!a} appears twice")
            seen.add(key)
        return dict(items)

    def integer(digits: str) -> int:
        if len(digits.lstrip("-")) > MAX_DIGITS:
            raise ValueError(f"{what}: an integer of {len(digits)} digits")
        return int(digits)

    def constant(name: str) -> Any:
        raise ValueError(f"{what}: {name} is not JSON (a count or a size must be a number)")

    try:
        decoded = text.decode("utf-8") if isinstance(text, bytes) else text
        return json.loads(
            decoded, object_pairs_hook=pairs, parse_int=integer, parse_constant=constant
        )
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"{what}: not JSON ({str(error)[:120]})") from None


def _encode(value: Any, path: str, tensors: TensorSink | None, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise TypeError(f"{path}: nested deeper than {MAX_DEPTH}")
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"$float": repr(value)}
    if kind is list:
        return [_encode(v, f"{path}[{i}]", tensors, depth + 1) for i, v in enumerate(value)]
    if kind is tuple:
        items = [_encode(v, f"{path}[{i}]", tensors, depth + 1) for i, v in enumerate(value)]
        return {"$tuple": items}
    if kind in (dict, collections.OrderedDict):
        pairs = [
            (
                _encode(k, f"{path} key", tensors, depth + 1),
                _encode(v, f"{path}[{k!r}]", tensors, depth + 1),
            )
            for k, v in value.items()
        ]
        if kind is collections.OrderedDict:
            return {"$odict": [list(p) for p in pairs]}
        if all(type(k) is str and not k.startswith("$") for k in value):
            return dict(pairs)
        return {"$dict": [list(p) for p in pairs]}
    if kind is bytes:
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    if isinstance(value, torch.dtype) and str(value).removeprefix("torch.") in _DTYPES:
        return {"$dtype": str(value).removeprefix("torch.")}
    if kind is torch.device:
        return {"$device": str(value)}
    if (
        isinstance(value, torch.Tensor)
        and tensors is not None
        and type(value)
        in (
            torch.Tensor,
            torch.nn.Parameter,
        )
    ):
        return {"$tensor": tensors(value)}
    shown = f"{kind.__module__}.{kind.__qualname__}"
    raise TypeError(
        f"{path} holds a {shown}, which a checkpoint stores only as code; keep to None, bools, "
        "numbers, strings, bytes, lists, tuples, dicts, dtypes, devices and tensors"
        + (
            ""
            if tensors is not None or not isinstance(value, torch.Tensor)
            else " (here: no tensors)"
        )
    )


def _decode(
    value: Any, what: str, tensors: Callable[[str], torch.Tensor] | None, depth: int
) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"{what}: nested deeper than {MAX_DEPTH}")
    if isinstance(value, list):
        return [_decode(v, what, tensors, depth + 1) for v in value]
    if not isinstance(value, dict):
        return value
    tag = next(iter(value), None) if len(value) == 1 else None
    if tag is None or not tag.startswith("$"):
        if any(k.startswith("$") for k in value):
            raise ValueError(
                f"{what}: a tag ({next(k for k in value if k.startswith('$'))!a}) among other keys"
            )
        return {k: _decode(v, what, tensors, depth + 1) for k, v in value.items()}
    body = value[tag]
    if tag == "$tuple" and isinstance(body, list):
        return tuple(_decode(v, what, tensors, depth + 1) for v in body)
    if tag in ("$dict", "$odict") and isinstance(body, list):
        if not all(isinstance(p, list) and len(p) == 2 for p in body):
            raise ValueError(f"{what}: a {tag} that is not a list of [key, value] pairs")
        items = [
            (_key(_decode(k, what, tensors, depth + 1), what), _decode(v, what, tensors, depth + 1))
            for k, v in body
        ]
        built = collections.OrderedDict(items) if tag == "$odict" else dict(items)
        if len(built) != len(items):
            raise ValueError(f"{what}: a {tag} with a key twice")
        return built
    if tag == "$bytes" and isinstance(body, str):
        try:
            return base64.b64decode(body, validate=True)
        except ValueError:
            raise ValueError(f"{what}: a $bytes that is not base64") from None
    if tag == "$float" and body in _SPECIAL:
        return _SPECIAL[body]
    if tag == "$dtype" and body in _DTYPES:
        return _DTYPES[body]
    if tag == "$device" and isinstance(body, str) and len(body) < 64:
        try:
            return torch.device(body)
        except RuntimeError:
            raise ValueError(f"{what}: {body!a} is not a device") from None
    if tag == "$tensor" and isinstance(body, str) and tensors is not None:
        return tensors(body)
    raise ValueError(f"{what}: an unknown or malformed tag {tag[:40]!a}")


def _key(key: Any, what: str) -> Any:
    try:
        hash(key)
    except TypeError:
        raise ValueError(f"{what}: a dict key of type {type(key).__name__}") from None
    return key
