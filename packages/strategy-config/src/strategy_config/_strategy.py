"""Strategy names: the supported set, the default, and normalisation of config values."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from strategy_config._hints import did_you_mean

SUPPORTED_DISTRIBUTED_STRATEGIES: frozenset[str] = frozenset({"ddp", "fsdp", "hsdp"})
DEFAULT_DISTRIBUTED_STRATEGY: str = "fsdp"

_STRATEGY_PATH = "training.distributed.strategy"


def normalize_distributed_strategy(value: str | None) -> str:
    """Return the canonical strategy name for a config value.

    Args:
        value: The configured strategy. ``None`` or an empty string selects the default
            (``"fsdp"``); other strings are stripped and lower-cased.

    Returns:
        ``"ddp"``, ``"fsdp"`` or ``"hsdp"``.

    Raises:
        TypeError: If ``value`` is neither a string nor ``None``.
        ValueError: If the normalised value is not a supported strategy. The message starts
            with ``training.distributed.strategy must be one of {ddp, fsdp, hsdp}, got
            '<value>'``
            and ends with a "did you mean" hint when a supported name is close.
    """
    if value is None:
        return DEFAULT_DISTRIBUTED_STRATEGY
    if not isinstance(value, str):
        raise TypeError(
            f"{_STRATEGY_PATH} must be a string or None, got {type(value).__name__} "
            f"({value!r}); use one of {_supported_listing()}"
        )
    normalized = value.strip().lower()
    if not normalized:
        return DEFAULT_DISTRIBUTED_STRATEGY
    if normalized not in SUPPORTED_DISTRIBUTED_STRATEGIES:
        hint = did_you_mean(normalized, SUPPORTED_DISTRIBUTED_STRATEGIES)
        raise ValueError(
            f"{_STRATEGY_PATH} must be one of {_supported_listing()}, got '{normalized}'{hint}"
        )
    return normalized


def is_ddp_strategy(training_config: Any) -> bool:
    """Whether ``training_config.distributed.strategy`` selects DDP.

    Args:
        training_config: The ``training`` section as an attribute object (dataclass,
            namespace, OmegaConf ``DictConfig``) or a mapping. A missing ``distributed``
            section or ``strategy`` key means the default strategy.

    Returns:
        ``True`` exactly when the normalised strategy is ``"ddp"``.

    Raises:
        TypeError: See :func:`normalize_distributed_strategy`.
        ValueError: See :func:`normalize_distributed_strategy`.
    """
    section = read_key(training_config, "distributed")
    return normalize_distributed_strategy(read_key(section, "strategy")) == "ddp"


def read_key(container: Any, key: str) -> Any:
    """Read ``key`` from a mapping or an attribute object; missing (or ``None``) gives ``None``."""
    if container is None:
        return None
    if isinstance(container, Mapping):
        return container.get(key)
    return getattr(container, key, None)


def _supported_listing() -> str:
    return "{" + ", ".join(sorted(SUPPORTED_DISTRIBUTED_STRATEGIES)) + "}"
