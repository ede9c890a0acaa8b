"""Entering and leaving a seeded fork, beside torch.random.fork_rng + manual_seed."""

from __future__ import annotations

from typing import Any

import torch

from rng_fork import fork_rng

GROUPS = {"test_fork": "rng-fork: seeded fork enter+exit"}


def test_fork(paired: Any) -> None:
    if paired.side == "raw":

        def fork() -> None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(1234)
    else:

        def fork() -> None:
            with fork_rng(1234):
                pass

    paired(fork, rounds=2000)
