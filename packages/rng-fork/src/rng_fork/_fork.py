"""The ``fork_rng`` context manager: seed exactly the named streams, restore exactly them."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch

from dist_core import DeviceLike, resolve_device
from rng_fork._devices import accelerator_stream
from rng_fork._seed import check_seed
from rng_fork._state import apply_state, capture_streams

_NUMPY_WORD = 2**32


@contextlib.contextmanager
def fork_rng(
    seed: int | None = None,
    *,
    device: DeviceLike | None = None,
    python: bool = False,
    numpy: bool = False,
) -> Iterator[None]:
    """Fork the random streams for the duration of a ``with`` block.

    On entry it snapshots the CPU generator and, when ``device`` is an accelerator, that one
    device's generator (and ``random``/``numpy.random`` when asked); with a ``seed`` it seeds
    exactly those. On exit, normal or by exception, it restores exactly those, so the outer
    streams continue as if the block never ran. No other device is touched, seeded or
    initialized: a CPU ``device`` (or ``None``) never initializes CUDA. Unlike
    ``torch.manual_seed`` inside ``torch.random.fork_rng``, seeding does not reach the other
    GPUs of the process. Forks nest.

    Args:
        seed: Seed for the forked streams; ``None`` forks without seeding.
        device: An accelerator whose generator is forked too: a ``torch.device``, a string
            (``"cuda:1"``) or an int index of the current accelerator type.
        python: Also fork (and seed) ``random``'s global state.
        numpy: Also fork (and seed) ``numpy.random``'s global state. A seed outside
            ``[0, 2**32)`` is given to numpy as its 32-bit words.

    Yields:
        Nothing; the block runs with the forked streams.

    Raises:
        TypeError: If ``seed`` is not an int (``bool`` is rejected) or ``device`` has a bad type.
        ValueError: If ``seed`` is out of the range torch accepts, or ``device`` is malformed.
        RuntimeError: If ``device`` is not available in this process.

    All argument errors are raised before any state is changed.
    """
    checked = None if seed is None else check_seed(seed)
    stream = accelerator_stream(resolve_device(device), argument="device")
    if numpy:
        import numpy as np  # fail before any state changes when numpy is missing
    saved = capture_streams(stream, python=python, numpy=numpy)
    try:
        if checked is not None:
            torch.default_generator.manual_seed(checked)
            if stream is not None:
                stream.seed(checked)
            if python:
                random.seed(checked)
            if numpy:
                np.random.seed(_numpy_seed(checked))
        yield
    finally:
        apply_state(saved)


def fork_model_rng(device: DeviceLike, seed: int) -> contextlib.AbstractContextManager[None]:
    """The fork the replica builder uses: CPU plus ``device``'s generator, seeded with ``seed``.

    Args:
        device: The device the model will live on; an accelerator's generator is forked too.
        seed: Required seed.

    Returns:
        A context manager; see :func:`fork_rng`.
    """
    return fork_rng(check_seed(seed), device=device)


def _numpy_seed(seed: int) -> int | list[int]:
    if 0 <= seed < _NUMPY_WORD:
        return seed
    value = seed % 2**64  # two's complement of negative int64 seeds
    return [value % _NUMPY_WORD, value // _NUMPY_WORD]
