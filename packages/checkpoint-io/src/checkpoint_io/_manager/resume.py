"""Resuming a run: the newest complete checkpoint that loads, falling back to older ones."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from checkpoint_io._collective import from_rank0
from checkpoint_io._errors import CheckpointError
from checkpoint_io._load import load_checkpoint
from checkpoint_io._manager.steps import complete_checkpoints, remove_leftovers
from dist_core import log_rank0, rank

logger = logging.getLogger(__name__)


def resume_latest(
    root: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    stateful: Mapping[str, Any] | None,
) -> int:
    """Load the newest complete checkpoint under ``root`` that loads; its step (0: none).

    Collective: rank 0 lists the complete checkpoints (newest first) and removes the
    temporary directories of saves that never finished; every rank loads the same one. A
    failed load changed nothing (it reads into staging), so the next older one starts clean.
    """
    candidates: list[Path] = []
    if rank() == 0:
        remove_leftovers(root)
        candidates = complete_checkpoints(root)
    for path in from_rank0(candidates):
        try:  # collective: every rank gets the same outcome
            info = load_checkpoint(path, model, optimizer, stateful=stateful)
            # the manifest's step is an int >= 0 or null (checked when it was read)
            step = info.step if info.step is not None else int(path.name.split("-")[-1])
        except CheckpointError as error:
            log_rank0(
                logger,
                logging.WARNING,
                "cannot resume from %s (%s); trying the next older checkpoint",
                path,
                error,
            )
            continue
        log_rank0(logger, logging.INFO, "resuming from %s at step %d", path, step)
        return step
    log_rank0(logger, logging.INFO, "no checkpoint under %s: starting at step 0", root)
    return 0
