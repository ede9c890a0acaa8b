"""How each point is measured: steps, batch, dtype, seed."""

from __future__ import annotations

import dataclasses

from strategy_bench.measure._probe import PROBE_MIB

CKPT_SAMPLES = 3
"""Rounds of the checkpoint cost per point: ours and raw alternate which goes first."""


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How each configuration is measured.

    Attributes:
        steps: Timed training steps.
        warmup: Untimed steps before them.
        batch_size: Samples per rank per step.
        dtype: ``"fp32"``, or ``"bf16"`` for bf16 autocast (fp32 master weights).
        seed: Construction seed; each rank's data stream is derived from it.
        wrap_repeats: Warm wraps timed per wrapper (the median is reported).
        ckpt_samples: Rounds of the checkpoint cost (ours and raw alternating; the median
            and the range are reported); ``0`` skips the checkpoint cost.
        probe_mib: Message sizes of the run's communication probe, in MiB (empty: none).
    """

    steps: int = 20
    warmup: int = 5
    batch_size: int = 8
    dtype: str = "fp32"
    seed: int = 0
    wrap_repeats: int = 5
    ckpt_samples: int = CKPT_SAMPLES
    probe_mib: tuple[float, ...] = PROBE_MIB
