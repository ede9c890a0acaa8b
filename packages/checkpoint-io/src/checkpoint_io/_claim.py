"""Where a save writes, agreed before DCP's first collective (validate first, then agree).

One agreement carries each rank's failure, stateful digests and staging layout, and rank 0's
temporary directory. On a failure anywhere every rank raises there, no rank enters DCP, and
nothing is left on disk.
"""

from __future__ import annotations

import io
import shutil
import uuid
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from checkpoint_io._collective import agree
from checkpoint_io._errors import CheckpointError
from checkpoint_io._stateful import StatefulParts
from checkpoint_io._storage.planners import Whole
from dist_core import rank
from safe_store import dumps

WHAT = "preparing the save"
"""The work named when a rank fails before anything is written."""


class ClaimPlanner(DefaultSavePlanner):
    """DCP's default save planner, every value that is not a tensor written as JSON."""

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        """A tensor as it is; any other value (a :class:`Whole` unwrapped) as tagged JSON.

        Raises:
            TypeError: A value the codec cannot carry, named by its key.
        """
        if write_item.type != WriteItemType.BYTE_IO:
            return super().transform_object(write_item, object)
        value = object.value if isinstance(object, Whole) else object
        return io.BytesIO(dumps(value, what=f"the value {write_item.index.fqn!r}").encode())


def claim_now(
    target: Path,
    overwrite: bool,
    failure: BaseException | None,
    parts: StatefulParts | None,
    layout: str = "",
) -> Path:
    """The save's temporary directory, made by rank 0 and agreed by every rank (collective).

    A failure on any rank (on rank 0 also its refusal to overwrite) raises on every rank, as
    :func:`agree` does; the directory is removed. ``parts.everyone`` is set. ``layout``
    (``replicated_share``'s) must be the same on every rank.

    Raises:
        CheckpointError: On every rank, if the ranks' layouts differ.
    """
    claimed, made = None, None
    if rank() == 0 and failure is None:
        try:
            claimed = claim(target)
            partial = partial_for(target, overwrite, claimed)
            partial.mkdir(parents=True)
            made = partial  # removed below if the ranks do not agree
        except Exception as error:
            failure = error
    digests = None if parts is None else parts.digests
    try:
        everyone = agree(failure, WHAT, share=(digests, claimed, layout))
        _same_layout(target, [each for _, _, each in everyone])
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
    if parts is not None:
        parts.everyone = [digests for digests, _, _ in everyone]
    return partial_for(target, overwrite, everyone[0][1])


def _same_layout(target: Path, layouts: list[str]) -> None:
    differ = [index for index, other in enumerate(layouts) if other != layouts[0]]
    if differ:
        found = "; ".join(f"rank {i}: {layouts[i]}" for i in [0, *differ])
        raise CheckpointError(
            f"a background save of {str(target)!r}: rank(s) {differ} hold other plain "
            f"(replicated) tensors than rank 0, in keys, shapes or dtypes ({found}); each rank "
            "stages only its share of them, so nothing was written. Build the model and "
            "optimizer alike on every rank, or save with save_checkpoint (which writes one "
            "rank's copy of each)"
        )


def claim(target: Path) -> tuple[bool, str]:
    """What rank 0 settles as a save starts: ``target`` exists; a temporary name."""
    return target.exists(), uuid.uuid4().hex[:12]


def partial_for(target: Path, overwrite: bool, claimed: tuple[bool, str]) -> Path:
    """Where a save writes first, from rank 0's :func:`claim` (the same on every rank).

    Raises:
        FileExistsError: If ``target`` exists and ``overwrite`` is false.
    """
    exists, token = claimed
    if exists and not overwrite:
        raise FileExistsError(
            f"{str(target)!r} already exists; pass overwrite=True to replace it (the old "
            "checkpoint is removed only once the new one is complete), or choose a new path"
        )
    return target.parent / f".{target.name}.partial-{token}"
