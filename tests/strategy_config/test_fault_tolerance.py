"""strategy-config's ``fault_tolerance`` section: torchft's keys, checked without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from strategy_config import DistributedConfig, FaultToleranceConfig

GOOD = {"lighthouse": "node0:29510", "replica_id": 1, "replica_groups": 3}


def test_the_section_is_normalised_and_round_trips() -> None:
    config = DistributedConfig.from_mapping(
        {"strategy": "hsdp", "fault_tolerance": {**GOOD, "min_replica_size": 2, "timeout_s": 5}}
    )
    ft = config.fault_tolerance
    assert isinstance(ft, FaultToleranceConfig)
    assert ft.lighthouse == "http://node0:29510"
    assert (ft.replica_id, ft.replica_groups, ft.min_replica_size) == (1, 3, 2)
    assert ft.timeout_s == 5.0 and isinstance(ft.timeout_s, float)
    assert DistributedConfig.from_mapping(config.to_dict()) == config
    assert DistributedConfig().fault_tolerance is None
    http = FaultToleranceConfig.from_mapping({**GOOD, "lighthouse": "http://10.0.0.2:80"})
    assert http.lighthouse == "http://10.0.0.2:80"


@pytest.mark.parametrize(
    ("change", "kind", "fragment"),
    [
        ({"lighthouse": "node0"}, ValueError, "must be 'host:port'"),
        ({"lighthouse": "node0:99999"}, ValueError, "'node0:99999'"),
        ({"lighthouse": 29510}, TypeError, "lighthouse must be a str"),
        ({"replica_id": 3}, ValueError, "replica_id=3 is not a group of replica_groups=3"),
        ({"replica_id": -1}, ValueError, "replica_id must be >= 0, got -1"),
        ({"replica_id": True}, TypeError, "replica_id must be an int, got bool"),
        ({"min_replica_size": 4}, ValueError, "min_replica_size=4 is above replica_groups=3"),
        ({"min_replica_size": 0}, ValueError, "min_replica_size must be >= 1"),
        ({"timeout_s": 0}, ValueError, "timeout_s must be a finite number of seconds > 0"),
        ({"quorum_timeout_s": float("nan")}, ValueError, "quorum_timeout_s"),
        ({"connect_timeout_s": "10"}, TypeError, "connect_timeout_s must be a number"),
        ({"min_replicas": 2}, ValueError, "'min_replicas' (did you mean 'min_replica_size'?)"),
    ],
)
def test_bad_values_are_named_with_the_fix(
    change: dict[str, object], kind: type[Exception], fragment: str
) -> None:
    with pytest.raises(kind, match="training.distributed.fault_tolerance") as info:
        DistributedConfig.from_mapping({"strategy": "ddp", "fault_tolerance": {**GOOD, **change}})
    assert fragment in str(info.value)


def test_missing_keys_and_a_strategy_without_replicas() -> None:
    with pytest.raises(ValueError, match="needs replica_id, replica_groups"):
        DistributedConfig.from_mapping(
            {"strategy": "ddp", "fault_tolerance": {"lighthouse": "h:1"}}
        )
    with pytest.raises(TypeError, match="fault_tolerance must be a mapping, got list"):
        DistributedConfig.from_mapping({"strategy": "ddp", "fault_tolerance": ["h:1"]})
    with pytest.raises(ValueError) as info:
        DistributedConfig.from_mapping({"strategy": "fsdp", "fault_tolerance": GOOD})
    text = str(info.value)
    assert "training.distributed.fault_tolerance" in text
    assert "training.distributed.strategy is 'fsdp'" in text
    assert "use strategy: hsdp" in text


def test_ddp_keeps_one_bucket_layout_in_every_group() -> None:
    # DDP rebuilds its buckets after the first backward unless it looks for unused
    # parameters without a static graph: a group healed mid-run would reduce another layout.
    plain = DistributedConfig.from_mapping({"strategy": "ddp"})
    assert plain.ddp_options()["find_unused_parameters"] is False
    managed = DistributedConfig.from_mapping({"strategy": "ddp", "fault_tolerance": GOOD})
    assert managed.ddp_options()["find_unused_parameters"] is True
    assert managed.ddp_options()["static_graph"] is False
    with pytest.raises(ValueError) as info:
        DistributedConfig.from_mapping(
            {"strategy": "ddp", "static_graph": True, "fault_tolerance": GOOD}
        )
    assert "static_graph=True" in str(info.value) and "set static_graph: false" in str(info.value)


def test_the_section_never_imports_torch() -> None:
    code = (
        "import sys; from strategy_config import DistributedConfig; "
        f"DistributedConfig.from_mapping({{'strategy': 'ddp', 'fault_tolerance': {GOOD!r}}}); "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
