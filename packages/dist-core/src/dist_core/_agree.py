"""Every rank reaches the same verdict: no rank raises alone while another waits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dist_core._devices import on_device
from dist_core._group import bound_device, is_distributed
from dist_core._replicas import ReplicaReduce


def agree(
    error: BaseException | None,
    what: str,
    group: dist.ProcessGroup | None = None,
    *,
    share: Any = None,
    kinds: Mapping[str, type[Exception]] | None = None,
    default: type[Exception] = RuntimeError,
) -> list[Any]:
    """Raise on every rank if ``error`` happened on any rank (collective over ``group``).

    Put it after work that may fail on some ranks only and before the next collective: the
    failing rank re-raises its own error; the others raise ``default`` (or the failing rank's
    exception type where ``kinds`` maps its name) naming the failing ranks and the first
    rank's message, instead of waiting in that collective until the timeout.

    Args:
        error: This rank's failure, or ``None``.
        what: The work, for the message (``"wrapping the model"``).
        group: The group that agrees; ``None`` is the default group.
        share: A picklable value gathered in the same collective.
        kinds: Exception type names that the other ranks raise as themselves.
        default: The type the other ranks raise otherwise.

    Returns:
        Every rank's ``share``, by rank in ``group`` (``[share]`` without a process group).
    """
    if not is_distributed():
        if error is not None:
            raise error
        return [share]
    report = None if error is None else (type(error).__name__, str(error))
    reports: list[Any] = [None] * dist.get_world_size(group)
    # Under NCCL the object gather stages on the current device; the failure being reported
    # may be that the current device is the wrong one, so the group's own device is entered.
    with on_device(bound_device(group)):
        dist.all_gather_object(reports, (report, share), group=group)
    if error is not None:
        raise error
    failed = {r: rep for r, (rep, _) in enumerate(reports) if rep is not None}
    if failed:
        raise agreed_error(what, failed, kinds=kinds, default=default)
    return [shared for _, shared in reports]


def agreed_error(
    what: str,
    failed: Mapping[int, tuple[str, str]],
    *,
    kinds: Mapping[str, type[Exception]] | None = None,
    default: type[Exception] = RuntimeError,
) -> Exception:
    """What a rank that did not fail raises when others did (:func:`agree`'s message).

    Args:
        what: The work, for the message.
        failed: ``rank -> (exception type name, message)`` of each failing rank.
        kinds: Exception type names raised as themselves.
        default: The type raised otherwise.

    Returns:
        The exception: ``"<what> failed on rank(s) [..]; rank <first>: <its message>"``.
    """
    first = min(failed)
    kind, message = failed[first]
    return (kinds or {}).get(kind, default)(
        f"{what} failed on rank(s) {sorted(failed)}; rank {first}: {message}"
    )


def all_reduce_agreed(
    data: torch.Tensor,
    error: BaseException | None,
    what: str,
    groups: Sequence[dist.ProcessGroup | None],
    *,
    default: type[Exception] = ValueError,
    across: ReplicaReduce | None = None,
) -> list[float]:
    """Sum ``data`` over ``groups`` in the same all-reduce that tells every rank of a failure.

    The check-locally-then-agree rule for a reduction: a rank whose input was bad still enters
    the collective (with its ``error`` and zeros), so no rank waits for a timeout, and every
    rank raises: the failing ones their own error, the others ``default`` naming how many
    ranks failed.

    Args:
        data: A 1-D ``float64`` tensor on the groups' device (summed).
        error: This rank's failure, or ``None``; its ``data`` is then ignored.
        what: The work, for the message (``"global_count"``).
        groups: The groups reduced over, one after another (a mesh's dimensions); ``[None]``
            is the default group.
        default: What a rank that did not fail raises.
        across: The replica groups beyond ``groups`` (:func:`replica_reduce`), summed last.

    Returns:
        The summed ``data``, read to the host (the one host read the check needs).
    """
    # NOTE: the flag rides in the data's own buffer and dtype: one collective per group, and a
    # NaN in the data cannot hide a failure (the flag is its own element).
    mine = torch.zeros_like(data) if error is not None else data
    flag = torch.tensor([0.0 if error is None else 1.0], dtype=data.dtype, device=data.device)
    payload = torch.cat([mine, flag])
    for group in groups:
        dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=group)
    if across is not None:
        across.sum_(payload)
    *total, failed = payload.tolist()
    if error is not None:
        raise error
    if failed:
        raise default(
            f"{what} failed on {int(failed)} other rank(s) (each raised its own error, naming the "
            "bad input); this rank's input was valid"
        )
    return [float(value) for value in total]
