"""Seeded RNG forks that restore every stream they touched and touch nothing else."""

from __future__ import annotations

from rng_fork._fork import fork_model_rng, fork_rng
from rng_fork._seed import SEED_MAX, SEED_MIN, derive_seed
from rng_fork._state import (
    DeviceRngState,
    RngState,
    capture_rng_state,
    check_rng_state,
    restore_rng_state,
    seed_rng,
)

__all__ = [
    "SEED_MAX",
    "SEED_MIN",
    "DeviceRngState",
    "RngState",
    "capture_rng_state",
    "check_rng_state",
    "derive_seed",
    "fork_model_rng",
    "fork_rng",
    "restore_rng_state",
    "seed_rng",
]
