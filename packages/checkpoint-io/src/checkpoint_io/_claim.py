"""Where a save writes, settled while DCP plans it: no collective of checkpoint-io's own.

Each rank's local plan carries what it collected (its stateful digests) or its failure, as
data (a type name and a message: an exception object need not pickle, and torch before 2.13
cannot pickle the traceback DCP would send with it on Python 3.13). The coordinator (rank 0)
claims the temporary directory once every rank's plan is in, and its answer rides back in
each rank's final plan. On a failure anywhere, or rank 0's refusal to overwrite, no rank
writes a byte, and each raises once DCP returns.
"""

from __future__ import annotations

import dataclasses
import io
import uuid
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from checkpoint_io._collective import agree, agreed
from checkpoint_io._errors import CheckpointError
from checkpoint_io._stateful import StatefulParts
from checkpoint_io._storage.planners import Whole
from dist_core import rank
from safe_store import dumps

WHAT = "collecting the state to save"
"""The work named when a rank fails before anything is written."""

Report = tuple[str, str]  # a failure, as the ranks exchange it: its type name, its message


@dataclasses.dataclass(frozen=True)
class Settled:
    """What the coordinator answers each rank's plan (its ``storage_data`` carries it).

    Attributes:
        name: The temporary directory's name (``None`` when nothing is written).
        failed: Each failing rank's :data:`Report`; empty when every rank goes on.
        what: The work that failed, for the message.
        digests: Every rank's stateful digests (for rank 0's manifest), or rank 0's alone.
    """

    name: str | None
    failed: dict[int, Report]
    digests: list[Any]
    what: str


class SaveClaim:
    """What the ranks of one save settle in DCP's planning (:class:`SafeWriter` asks).

    Args:
        target: The checkpoint directory.
        overwrite: Replace an existing ``target``.
        failure: This rank's failure while collecting the state.
        parts: This rank's ``stateful=`` parts: their digests travel in the plans.
        manifest: ``checkpoint.json`` as far as it is known (rank 0 publishes it).
        partial: The temporary directory, if already claimed (a background save claims it
            in the foreground).
    """

    def __init__(
        self,
        target: Path,
        overwrite: bool,
        *,
        failure: BaseException | None = None,
        parts: StatefulParts | None = None,
        manifest: dict[str, Any] | None = None,
        partial: Path | None = None,
    ) -> None:
        self.target = target
        self.overwrite = overwrite
        self.failure = failure
        self.parts = parts
        self.manifest = manifest if manifest is not None else {}
        self.partial = partial
        self.failed: dict[int, Report] = {}
        self._what = WHAT
        self._refused: BaseException | None = None

    def local(self) -> tuple[Report | None, Any]:
        """This rank's share of its local plan: its failure, or its stateful digests."""
        if self.failure is not None:
            return (type(self.failure).__name__, str(self.failure)), None
        return None, None if self.parts is None else self.parts.digests

    def settle(self, shares: list[tuple[Report | None, Any]]) -> list[Settled]:
        """On the coordinator, every rank's share in: claim the directory; each rank's answer.

        Nothing is claimed when a rank failed; rank 0's refusal to overwrite (or a directory
        it could not make) is a failure of rank 0.
        """
        failed = failures(shares)
        name, what = None, WHAT
        if not failed:
            try:
                if self.partial is None:
                    self.partial = partial_for(self.target, self.overwrite, claim(self.target))
                self.partial.mkdir(parents=True, exist_ok=True)
                name = self.partial.name
            except Exception as error:
                self._refused = error
                failed = {rank(): (type(error).__name__, str(error))}
                what = f"claiming {str(self.target)!r}"
        digests = [each for _, each in shares]
        # rank 0 needs every rank's digests (the manifest); the others, rank 0's alone
        answers = [Settled(name, failed, digests[:1], what) for _ in digests]
        answers[0] = Settled(name, failed, digests, what)
        return answers

    def apply(self, settled: Settled) -> Path | None:
        """On every rank, its answer in: the directory to write into; ``None``: write nothing."""
        self.failed, self._what = settled.failed, settled.what
        if settled.name is None:
            return None
        self.partial = self.target.parent / settled.name
        if self.parts is not None and not self.parts.everyone:
            self.parts.everyone = list(settled.digests)
            if rank() == 0:
                self.manifest["stateful_state"] = self.parts.manifest()
        return self.partial

    def raise_failure(self) -> None:
        """Once DCP returned: raise what was settled, if a rank failed (nothing was written).

        The rank that failed raises its own error; the others raise the same type
        (``FileExistsError``) or :class:`CheckpointError`, naming that rank.
        """
        if self.failed:
            own = self.failure or self._refused
            raise own if own is not None else agreed(self._what, self.failed)


def failures(shares: list[tuple[Report | None, Any]]) -> dict[int, Report]:
    """Each failing rank's report, from every rank's share."""
    return {r: report for r, (report, _) in enumerate(shares) if report is not None}


class ClaimPlanner(DefaultSavePlanner):
    """DCP's default save planner that leaves the plans alone when a rank failed.

    A rank that failed to collect its state plans nothing, which DCP's merge of the plans
    would refuse (a sharded tensor's shards no longer cover it) before the claim could name
    the rank that failed: nothing is merged, nothing is written, the claim raises.
    """

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's merge, unless a rank's plan carries a failure."""
        if failures([share_of(plan) for plan in all_plans]):
            return all_plans, Metadata(state_dict_metadata={})
        return super().create_global_plan(all_plans)

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        """A tensor as it is; any other value as safe-store's tagged JSON (never a pickle).

        A :class:`Whole` is one value, unwrapped here.

        Raises:
            TypeError: A value the codec cannot carry, named by its key.
        """
        if write_item.type != WriteItemType.BYTE_IO:
            return super().transform_object(write_item, object)
        value = object.value if isinstance(object, Whole) else object
        return io.BytesIO(dumps(value, what=f"the value {write_item.index.fqn!r}").encode())


def share_of(plan: SavePlan) -> tuple[Report | None, Any]:
    """A local plan's share of the claim (none: no failure, no digests)."""
    return getattr(plan.storage_data, "value", (None, None))


@dataclasses.dataclass(frozen=True)
class Share:
    """A rank's share of the claim, in its local plan."""

    value: tuple[Report | None, Any]


@dataclasses.dataclass(frozen=True)
class Planned:
    """A final plan's storage data: this rank's data file, and the claim's answer."""

    file: str
    settled: Settled


def claim_now(
    target: Path,
    overwrite: bool,
    failure: BaseException | None,
    parts: StatefulParts | None,
    layout: str,
) -> Path:
    """The claim settled by a collective of its own: a background save's, before it returns.

    A failure on any rank (``failure``, or rank 0's refusal to overwrite) raises on every
    rank as :meth:`SaveClaim.raise_failure` would; ``parts.everyone`` is set. ``layout``
    (:func:`~checkpoint_io._background.staging.replicated_share`'s) must be the same on every
    rank.

    Returns:
        The temporary directory (not yet made).

    Raises:
        CheckpointError: On every rank, if the ranks' layouts differ.
    """
    claimed = claim(target) if rank() == 0 else None
    digests = None if parts is None else parts.digests
    everyone = agree(failure, WHAT, share=(digests, claimed, layout))
    differ = [index for index, (_, _, other) in enumerate(everyone) if other != everyone[0][2]]
    if differ:
        found = "; ".join(f"rank {i}: {everyone[i][2]}" for i in [0, *differ])
        raise CheckpointError(
            f"a background save of {str(target)!r}: rank(s) {differ} hold other plain "
            f"(replicated) tensors than rank 0, in keys, shapes or dtypes ({found}); each rank "
            "stages only its share of them, so nothing was written. Build the model and "
            "optimizer alike on every rank, or save with save_checkpoint (which writes one "
            "rank's copy of each)"
        )
    if parts is not None:
        parts.everyone = [digests for digests, _, _ in everyone]
    return partial_for(target, overwrite, everyone[0][1])


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
