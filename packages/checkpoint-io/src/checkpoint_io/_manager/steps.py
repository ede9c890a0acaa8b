"""Which checkpoints under a root are complete, the latest of them, and resuming from it."""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from checkpoint_io._collective import from_rank0
from checkpoint_io._errors import CheckpointError
from checkpoint_io._load import load_checkpoint
from checkpoint_io._rng import read_rng_state
from checkpoint_io._storage.files import read_checked
from checkpoint_io._storage.manifest import STEP_DIR, STEP_PREFIX, saved_sequence
from dist_core import log_rank0, rank

logger = logging.getLogger(__name__)


_PARTIAL = re.compile(rf"^\.{STEP_PREFIX}\d+\.(partial|old)-[0-9a-f]+$")


def step_path(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives under ``root``."""
    return root / f"{STEP_PREFIX}{step}"


def check_root(root: object, argument: str = "root") -> Path:
    """``root`` as a ``Path``; it may not exist yet, but it may not be a file.

    Raises:
        TypeError: If it is not a path.
        NotADirectoryError: If it is an existing file.
    """
    if not isinstance(root, str | os.PathLike):
        raise TypeError(f"{argument} must be a str or os.PathLike, got {type(root).__name__}")
    path = Path(os.fspath(root))
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(
            f"{argument}={str(path)!r} is a file; pass a directory to hold the step-<N> "
            "checkpoints (it is created if missing)"
        )
    return path


def step_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step-<N>`` directory under ``root``, by step."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.fullmatch(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)


def incomplete_reason(path: Path) -> str | None:
    """Why the checkpoint at ``path`` is not complete, or ``None`` when it is.

    Complete: it passes the read path's checks before any data (:func:`read_checked`), and
    its RNG states would restore. Nothing is hashed.
    """
    try:
        manifest, _, files = read_checked(path, verify=False)
        for saved in range(manifest["world_size"]) if manifest["rng"] else ():
            read_rng_state(files, saved)  # small: a state that would not restore is refused
    except (OSError, CheckpointError) as error:
        return str(error)
    except (TypeError, AttributeError, KeyError, IndexError, RecursionError) as error:
        # A manifest or index of the wrong shape (a list where a table belongs, fields of
        # the wrong type): a malformed directory, skipped, never a crash of the caller.
        return f"malformed ({type(error).__name__}: {error})"
    return None


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete ``step-<N>`` checkpoints under ``root``, the most recently saved first.

    By the manifests' ``sequence``, then the step: after a roll-back, the rolled-back run's
    come first. The others are skipped, each with a warning naming why.
    """
    found = []
    for step, candidate in step_checkpoints(root):
        reason = incomplete_reason(candidate)
        if reason is None:
            found.append((saved_sequence(candidate), step, candidate))
        else:
            logger.warning("skipping %s, which is not complete: %s", candidate, reason)
    return [path for _, _, path in sorted(found, key=lambda item: item[:2], reverse=True)]


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The most recently saved complete checkpoint under ``root``, or ``None``.

    Looks at the ``step-<N>`` directories that :class:`CheckpointManager` writes: the one of
    the highest ``sequence`` in their manifests (the highest step, unless a run rolled back to
    an older step and saved again: then the rolled-back run's). Partial, temporary and damaged
    ones (a missing manifest, a missing or truncated data file, an RNG state that would not
    restore) are skipped with a warning. Reads no tensor data, runs no collective.

    Raises:
        NotADirectoryError: If ``root`` is a file.
    """
    found = complete_checkpoints(check_root(root))
    return found[0] if found else None


def prune(root: Path, keep_last: int, published: int) -> list[Path]:
    """Remove the checkpoints older than the newest ``keep_last`` complete ones up to ``published``.

    Nothing at or above ``published`` (the step just published) is removed: after a
    roll-back the abandoned run's are kept, with a warning. Returns what was removed.
    """
    everything = step_checkpoints(root)
    newer = [path for step, path in everything if step > published]
    if newer:
        logger.warning(
            "step-%d was saved below the newest checkpoint (a roll-back?): keep_last=%d keeps "
            "%s and counts only the checkpoints at or below step-%d; remove the newer ones by "
            "hand once the abandoned run is not needed",
            published,
            keep_last,
            ", ".join(path.name for path in newer),
            published,
        )
    complete = [
        step for step, path in everything if step <= published and incomplete_reason(path) is None
    ]
    if published not in complete or len(complete) <= keep_last:
        return []
    oldest_kept = complete[-keep_last]
    removed = [path for step, path in everything if step < oldest_kept]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
        logger.info("removed %s (keep_last=%d)", path, keep_last)
    return removed


def remove_leftovers(root: Path) -> list[Path]:
    """Remove what saves that never finished left; an old one moved aside goes back."""
    if not root.is_dir():
        return []
    leftovers = []
    for child in sorted(root.iterdir()):
        match = _PARTIAL.match(child.name)
        if not match:
            continue
        target = root / child.name[1:].split(".", 1)[0]
        if match.group(1) == "old" and not target.exists():
            child.rename(target)
            logger.warning("restored %s: an overwrite was killed between its renames", target)
            continue
        shutil.rmtree(child, ignore_errors=True)
        logger.info("removed %s, left by a save that did not finish", child)
        leftovers.append(child)
    return leftovers


def resume_latest(
    root: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    stateful: Mapping[str, Any] | None,
) -> int:
    """Load the newest complete checkpoint under ``root`` that loads; its step (0: none).

    Collective: every rank tries rank 0's list in order; a failed load changed nothing.
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
