"""Before a replica group is built: torchft, its store, the lighthouse and its id, checked.

torchft imports, the group's store is named, the lighthouse answers and no live group uses
this replica id. The group's rank 0 talks to the lighthouse; the group agrees on the verdict,
so every rank raises the same error before anything is built.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
import urllib.request
from urllib.parse import urlsplit

import torch.distributed as dist

from dist_core import agree
from strategy_config import FaultToleranceConfig

logger = logging.getLogger(__name__)

_INSTALL = "pip install torchft==0.2.0 (Linux, Python 3.11)"
_PREFIX = "replica_"


def replica_name(config: FaultToleranceConfig) -> str:
    """The replica id this group gives torchft's Manager (which appends ``:<uuid>``)."""
    return f"{_PREFIX}{config.replica_id}"


def group_store() -> tuple[str, int]:
    """This group's store, ``MASTER_ADDR``/``MASTER_PORT`` (its default process group's).

    Raises:
        RuntimeError: Either is unset, or the port is not a number.
    """
    address, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if not address or not port.isdigit():
        raise RuntimeError(
            "fault tolerance needs this group's store at MASTER_ADDR/MASTER_PORT (got "
            f"{address!r}/{port!r}); launch each replica group with torchrun or "
            "init_distributed"
        )
    return address, int(port)


def check_lighthouse(config: FaultToleranceConfig) -> None:
    """Before anything is built: torchft is importable and the lighthouse answers (collective).

    Every rank checks that its group's store is named (:func:`group_store`). The group's rank 0
    (the one that talks to the lighthouse) opens a connection within ``connect_timeout_s``,
    then reads the lighthouse's status: a live group that heartbeats under this
    ``replica_id`` means the id is taken. Every rank of the group raises if any check fails.

    Raises:
        ImportError: torchft is not installed (on every rank).
        RuntimeError: ``MASTER_ADDR``/``MASTER_PORT`` do not name the group's store.
        ConnectionError: The lighthouse cannot be reached, named with its address.
        ValueError: Another live group uses this ``replica_id``.
    """
    failure: BaseException | None = None
    try:
        import torchft  # noqa: F401
    except ImportError as error:
        failure = ImportError(
            f"training.distributed.fault_tolerance needs torchft ({error}); {_INSTALL}"
        )
    if failure is None:
        try:
            group_store()
        except RuntimeError as error:
            failure = error
    if failure is None and dist.get_rank() == 0:
        address = urlsplit(config.lighthouse)
        try:
            with socket.create_connection(
                (address.hostname or "", address.port or 0), timeout=config.connect_timeout_s
            ):
                pass
        except OSError as error:
            failure = ConnectionError(
                f"the torchft lighthouse at {config.lighthouse} "
                "(training.distributed.fault_tolerance.lighthouse) did not answer within "
                f"connect_timeout_s={config.connect_timeout_s:g} s ({error}); start it first "
                "(torchft_lighthouse --bind [::]:PORT --min_replicas N) or fix the address"
            )
        if failure is None:
            failure = _replica_id_taken(config)
    agree(
        failure,
        "reaching the torchft lighthouse",
        kinds={
            "ImportError": ImportError,
            "ConnectionError": ConnectionError,
            "RuntimeError": RuntimeError,
            "ValueError": ValueError,
        },
    )


# A manager heartbeats every 100 ms: one seen within this is alive. A group killed a moment ago
# is seen once more, then ages past it (checked again after _RECHECK_S).
_ALIVE_S = 1.0
_RECHECK_S = 1.5
_HEARTBEAT = re.compile(rf"({_PREFIX}\d+):[\w-]+: seen ([0-9.]+)(ns|µs|us|ms|s) ago")
_UNIT_S = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def _replica_id_taken(config: FaultToleranceConfig) -> ValueError | None:
    """A ``ValueError`` if a live group heartbeats under this group's ``replica_id``."""
    name = replica_name(config)
    for attempt in range(2):
        seen = _heartbeats(config).get(name)
        if seen is None or seen > _ALIVE_S:
            return None
        if attempt == 0:
            time.sleep(_RECHECK_S)  # a predecessor that just died stops heartbeating
    return ValueError(
        f"training.distributed.fault_tolerance.replica_id={config.replica_id} is in use: a live "
        f"group heartbeats as {name} at the lighthouse {config.lighthouse} (seen {seen:.2f} s "
        f"ago); give every group its own replica_id, 0 .. replica_groups - 1 = "
        f"{config.replica_groups - 1}"
    )


def _heartbeats(config: FaultToleranceConfig) -> dict[str, float]:
    """The freshest heartbeat per replica id on the lighthouse's status page (seconds ago)."""
    try:
        with urllib.request.urlopen(
            f"{config.lighthouse}/status", timeout=config.connect_timeout_s
        ) as response:
            page = response.read(1 << 20).decode("utf-8", "replace")
    except OSError as error:
        logger.warning("could not read the lighthouse's status (%s): replica ids unchecked", error)
        return {}
    seen: dict[str, float] = {}
    for name, value, unit in _HEARTBEAT.findall(page):
        ago = float(value) * _UNIT_S[unit]
        seen[name] = min(ago, seen.get(name, ago))
    return seen
