"""Seed validation and stable seed derivation."""

from __future__ import annotations

import hashlib
import numbers

# The range torch.manual_seed accepts: any int64 or uint64 value.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


def check_seed(seed: object, *, argument: str = "seed") -> int:
    """Validate a seed and return it as a plain ``int``.

    Raises:
        TypeError: If ``seed`` is a ``bool`` or not an integer.
        ValueError: If ``seed`` is outside the range ``torch.manual_seed`` accepts.
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(
            f"{argument} must be an int, got {type(seed).__name__} ({seed!r}); "
            "pass an integer such as 42"
        )
    value = int(seed)
    if not SEED_MIN <= value <= SEED_MAX:
        raise ValueError(
            f"{argument} must be in [{SEED_MIN}, {SEED_MAX}] (the range torch.manual_seed "
            f"accepts), got {value}"
        )
    return value


def derive_seed(base_seed: int, *keys: int | str | bytes, bits: int = 63) -> int:
    """Derive a stable, well-mixed seed for one stream (rank, worker, epoch, ...).

    The value is a BLAKE2b digest of a canonical encoding of the inputs, so it is the same in
    every process, on every machine and in every Python version (it never uses ``hash()``),
    and adjacent keys (rank 0 and rank 1) give unrelated seeds.

    Args:
        base_seed: The run's seed.
        *keys: What identifies the stream, e.g. ``derive_seed(seed, "data", rank, epoch)``.
        bits: Width of the result; the default 63 fits ``torch.manual_seed`` and int64.

    Returns:
        A seed in ``[0, 2**bits)``.

    Raises:
        TypeError: If ``base_seed`` is not an int or a key is not an int, str or bytes.
        ValueError: If ``base_seed`` is out of range or ``bits`` is not in 1..64.
    """
    base = check_seed(base_seed, argument="base_seed")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 64:
        raise ValueError(f"bits must be an int in 1..64, got {bits!r}")
    digest = hashlib.blake2b(digest_size=8, person=b"rng_fork.seed")
    digest.update(_encode(base))
    for position, key in enumerate(keys):
        if isinstance(key, bool) or not isinstance(key, (int, str, bytes)):
            raise TypeError(
                f"derive_seed key {position} must be an int, str or bytes, got "
                f"{type(key).__name__} ({key!r})"
            )
        digest.update(_encode(key))
    return int.from_bytes(digest.digest(), "big") >> (64 - bits)


def _encode(value: int | str | bytes) -> bytes:
    if isinstance(value, int):
        tag, payload = b"i", value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True)
    elif isinstance(value, str):
        tag, payload = b"s", value.encode("utf-8")
    else:
        tag, payload = b"b", value
    return tag + len(payload).to_bytes(4, "big") + payload
