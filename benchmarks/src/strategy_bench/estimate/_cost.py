"""What a training run costs at a predicted rate: days, GPU-hours and money for N tokens."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

SECONDS_PER_DAY = 86_400.0
SECONDS_PER_HOUR = 3_600.0

COST_FIELDS = ("train_tokens_per_s", "train_days", "train_gpu_hours", "train_cost")
"""What :func:`training_cost` adds: the job's tokens/s, and the run's days, GPU-hours, cost."""


def training_cost(
    choice: Mapping[str, Any], train_tokens: float, gpu_hour_price: float | None
) -> dict[str, float | None]:
    """The time and GPU-hours to train ``train_tokens`` at ``choice``'s predicted rate.

    The job's tokens/s is ``predicted_samples_per_s * tokens_per_sample`` (every rank's
    samples); the days are ``train_tokens`` over it, the GPU-hours those seconds times
    ``world_size``, the cost the GPU-hours times ``gpu_hour_price``.

    Args:
        choice: A row or recommendation with ``predicted_samples_per_s``,
            ``tokens_per_sample`` and ``world_size``.
        train_tokens: The tokens the run trains on.
        gpu_hour_price: The price of one GPU for one hour, or ``None`` (no cost).

    Returns:
        :data:`COST_FIELDS`, each ``None`` where the row has no predicted rate or no tokens
        per sample.
    """
    rate = choice.get("predicted_samples_per_s")
    tokens = choice.get("tokens_per_sample")
    if not rate or not tokens:
        return dict.fromkeys(COST_FIELDS)
    per_s = float(rate) * int(tokens)
    seconds = train_tokens / per_s
    gpu_hours = seconds * int(choice["world_size"]) / SECONDS_PER_HOUR
    return {
        "train_tokens_per_s": per_s,
        "train_days": seconds / SECONDS_PER_DAY,
        "train_gpu_hours": gpu_hours,
        "train_cost": None if gpu_hour_price is None else gpu_hours * gpu_hour_price,
    }


def check_train_tokens(train_tokens: float | None, gpu_hour_price: float | None) -> None:
    """``--train-tokens`` and ``--gpu-hour-price``: finite, positive, and the price with tokens.

    Raises:
        ValueError: A value that is not finite and positive (zero for the price), or a price
            without tokens; the message names the argument.
    """
    if train_tokens is not None and not (math.isfinite(train_tokens) and train_tokens >= 1):
        raise ValueError(
            f"--train-tokens must be a token count >= 1 such as 1e12, got {train_tokens}"
        )
    if gpu_hour_price is None:
        return
    if train_tokens is None:
        raise ValueError(
            f"--gpu-hour-price {gpu_hour_price} prices the GPU-hours of --train-tokens N; add it"
        )
    if not (math.isfinite(gpu_hour_price) and gpu_hour_price >= 0):
        raise ValueError(
            f"--gpu-hour-price must be a finite price >= 0 per GPU-hour, got {gpu_hour_price}"
        )


def training_plan(entries: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per model, over its world sizes: the fastest and the cheapest recommendation.

    Each entry is the fastest point that fits at its world size (so also the cheapest
    there: the same GPUs); across world sizes the fewest days and the fewest GPU-hours can
    be different runs.

    Args:
        entries: Recommendations with :data:`COST_FIELDS` (``strategy: None`` where nothing
            fits, which never competes).

    Returns:
        One ``{"model", "fastest", "cheapest"}`` per model with a costed recommendation;
        ``cheapest`` is the same entry as ``fastest`` when one run is both.
    """
    out = []
    for model in dict.fromkeys(entry["model"] for entry in entries):
        costed = [
            entry
            for entry in entries
            if entry["model"] == model and entry["strategy"] and entry.get("train_days")
        ]
        if not costed:
            continue
        fastest = min(costed, key=lambda entry: (entry["train_days"], entry["train_gpu_hours"]))
        cheapest = min(costed, key=lambda entry: (entry["train_gpu_hours"], entry["train_days"]))
        out.append({"model": model, "fastest": fastest, "cheapest": cheapest})
    return out
