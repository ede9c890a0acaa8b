"""``training.distributed.fault_tolerance``: torchft's replica groups, checked without torch.

A replica group is one copy of the model (a DDP replica, or an HSDP shard group); the groups
keep training while one of them is down, and a group that comes back heals from a live peer.
The keys are torchft's own vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from strategy_config._hints import did_you_mean

FT_PATH = "training.distributed.fault_tolerance"

STRATEGIES_WITH_REPLICAS: frozenset[str] = frozenset({"ddp", "hsdp"})
"""The strategies whose model is replicated across groups (``fsdp`` shards one copy)."""


@dataclasses.dataclass(frozen=True)
class FaultToleranceConfig:
    """The validated ``fault_tolerance`` section.

    Attributes:
        lighthouse: The torchft lighthouse, ``"host:port"`` (``http://`` is added; an
            ``http://host:port`` address is taken as it is).
        replica_id: This replica group's id, ``0 <= replica_id < replica_groups``.
        replica_groups: How many replica groups the job runs.
        min_replica_size: The live groups a step needs to commit, ``1..replica_groups``.
        timeout_s: Seconds a collective, a commit or a heal's transfer may take.
        quorum_timeout_s: Seconds to wait for the lighthouse's quorum.
        connect_timeout_s: Seconds to reach the lighthouse and the peers' managers.
    """

    lighthouse: str
    replica_id: int
    replica_groups: int
    min_replica_size: int = 1
    timeout_s: float = 60.0
    quorum_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "lighthouse", _lighthouse(self.lighthouse))
        for name in ("replica_id", "replica_groups", "min_replica_size"):
            _integer(name, getattr(self, name), low=0 if name == "replica_id" else 1)
        if self.replica_id >= self.replica_groups:
            raise ValueError(
                f"{FT_PATH}.replica_id={self.replica_id} is not a group of "
                f"replica_groups={self.replica_groups}; ids run from 0 to "
                f"{self.replica_groups - 1}"
            )
        if self.min_replica_size > self.replica_groups:
            raise ValueError(
                f"{FT_PATH}.min_replica_size={self.min_replica_size} is above "
                f"replica_groups={self.replica_groups}: no step could ever commit; use at most "
                f"{self.replica_groups}"
            )
        for name in ("timeout_s", "quorum_timeout_s", "connect_timeout_s"):
            set_(self, name, _seconds(name, getattr(self, name)))

    @classmethod
    def from_mapping(cls, mapping: Any) -> FaultToleranceConfig:
        """Build the section from a mapping; unknown keys are named with the closest known.

        Raises:
            TypeError: Not a mapping, or a value of the wrong type.
            ValueError: An unknown or missing key, or a value out of range.
        """
        if isinstance(mapping, FaultToleranceConfig):
            return mapping
        if not isinstance(mapping, Mapping):
            raise TypeError(
                f"{FT_PATH} must be a mapping, got {type(mapping).__name__} ({mapping!r})"
            )
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = [str(key) for key in mapping if key not in fields]
        if unknown:
            listed = ", ".join(f"'{k}'{did_you_mean(k, fields)}" for k in unknown)
            raise ValueError(
                f"unknown key(s) in {FT_PATH}: {listed}; known keys are {', '.join(fields)}"
            )
        required = [n for n, f in fields.items() if f.default is dataclasses.MISSING]
        missing = [name for name in required if name not in mapping]
        if missing:
            raise ValueError(
                f"{FT_PATH} needs {', '.join(missing)} (e.g. lighthouse: 'host:29510', "
                "replica_id: 0, replica_groups: 2)"
            )
        return cls(**{str(key): value for key, value in mapping.items()})


def check_strategy(strategy: str, *, static_graph: bool = False) -> None:
    """``fault_tolerance`` needs replicas across groups (DDP or HSDP) and a fixed bucket layout.

    Raises:
        ValueError: Naming both keys, for ``fsdp``, or for DDP's ``static_graph`` (DDP then
            rebuilds its buckets after the first step, and a group that joins late would
            reduce another layout than its peers).
    """
    if strategy not in STRATEGIES_WITH_REPLICAS:
        raise ValueError(
            f"{FT_PATH} is set but training.distributed.strategy is {strategy!r}, which keeps "
            "one sharded copy of the model and so has no replica group to lose; use strategy: "
            "hsdp (shard inside a group, replicate across groups) or ddp, or remove "
            "fault_tolerance"
        )
    if static_graph and strategy == "ddp":
        raise ValueError(
            f"{FT_PATH} is set with training.distributed.static_graph=True: a static graph "
            "makes DDP rebuild its gradient buckets after the first step, so a group that "
            "heals mid-run would reduce a different layout than its peers; set static_graph: "
            "false, or remove fault_tolerance"
        )


def _lighthouse(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(
            f"{FT_PATH}.lighthouse must be a str ('host:port'), got {type(value).__name__} "
            f"({value!r})"
        )
    text = value.strip()
    address = text.removeprefix("http://")
    host, _, port = address.rpartition(":")
    if not host or "/" in address or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"{FT_PATH}.lighthouse must be 'host:port' (the torchft_lighthouse's --bind), got "
            f"{value!r}; e.g. 'node0:29510'"
        )
    return f"http://{host}:{int(port)}"


def _integer(name: str, value: object, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{FT_PATH}.{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < low:
        raise ValueError(f"{FT_PATH}.{name} must be >= {low}, got {value}")


def _seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{FT_PATH}.{name} must be a number of seconds, got {type(value).__name__} ({value!r})"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{FT_PATH}.{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)
