"""The recipe keys of ``training.distributed``: activation checkpointing, compile, CPU offload.

One owner for their names and values: prepare_model applies them, the bench measures them and
the estimate predicts them under the same spelling.
"""

from __future__ import annotations

from strategy_config._hints import did_you_mean

CHECKPOINT_MODES: tuple[str, ...] = ("none", "full", "selective")
"""``activation_checkpointing``: ``none``; ``full`` (each block recomputed whole in backward);
``selective`` (op level: the outputs of matmuls and attention kept, the rest recomputed)."""
OFFLOAD_MODES: tuple[str, ...] = ("none", "cpu")
"""``offload``: ``none``; ``cpu`` (FSDP2's ``CPUOffloadPolicy``: sharded parameters,
gradients and optimizer state in pinned host memory; FSDP and HSDP only)."""
SHARDED_STRATEGIES: frozenset[str] = frozenset({"fsdp", "hsdp"})
"""The strategies that shard, and so can offload their shards."""


def normalize_checkpointing(value: object, *, path: str) -> str:
    """``activation_checkpointing``'s canonical value.

    Args:
        value: ``"none"``, ``"full"`` or ``"selective"`` (any case); ``True`` reads as
            ``"full"`` and ``False`` or ``None`` as ``"none"`` (older configs' booleans).
        path: The config path named in error messages.

    Raises:
        TypeError: If ``value`` is not a string, a bool or ``None``.
        ValueError: If the name is unknown (with the closest one).
    """
    if value is None or value is False:
        return "none"
    if value is True:
        return "full"
    return _choice(value, CHECKPOINT_MODES, path)


def normalize_offload(value: object, *, path: str, strategy: str) -> str:
    """``offload``'s canonical value, checked against the strategy.

    Args:
        value: ``"none"`` or ``"cpu"`` (any case); ``None`` or ``False`` read as ``"none"``.
        path: The config path named in error messages.
        strategy: The normalized strategy: only FSDP and HSDP offload.

    Raises:
        TypeError: If ``value`` is not a string, ``False`` or ``None``.
        ValueError: If the name is unknown, or ``cpu`` is asked of DDP (named, with what to
            do instead).
    """
    if value is None or value is False:
        return "none"
    key = _choice(value, OFFLOAD_MODES, path)
    if key != "none" and strategy not in SHARDED_STRATEGIES:
        raise ValueError(
            f"{path}={key!r} needs a sharded strategy (fsdp or hsdp): DDP keeps a whole "
            f"replica on every device and has nothing to offload; set strategy: fsdp, or "
            "offload: none"
        )
    return key


def _choice(value: object, modes: tuple[str, ...], path: str) -> str:
    """``value`` as one of ``modes`` (stripped, any case), or the error naming ``path``."""
    if not isinstance(value, str):
        raise TypeError(
            f"{path} must be one of {{{', '.join(modes)}}}, got {type(value).__name__} ({value!r})"
        )
    key = value.strip().lower()
    if key not in modes:
        raise ValueError(
            f"{path} must be one of {{{', '.join(modes)}}}, got {value!r}{did_you_mean(key, modes)}"
        )
    return key
