"""The estimate's failure cost: restart from a checkpoint against healing one replica group."""

from __future__ import annotations

from strategy_bench.estimate import failure_cost, replica_groups
from strategy_bench.report import failure_table

ROW = {
    "status": "ok",
    "model": "m",
    "knobs": {},
    "fits": True,
    "train_days": 10.0,
    "predicted_step_ms": 1_000.0,
}
TIMES = {"checkpoint_every_s": 1800.0, "restart_s": 600.0, "heal_s": 60.0, "gpus_per_node": 8}


def test_the_groups_each_strategy_can_lose_one_of() -> None:
    assert replica_groups("ddp", 64, 8) == 64
    assert replica_groups("hsdp", 64, 8) == 8  # one replica per node
    assert replica_groups("fsdp", 64, 8) is None


def test_a_run_that_loses_as_fast_as_it_trains_never_ends() -> None:
    """128 GPUs failing every 10 GPU-hours: a failure every 281 s of job time, each costing
    1,500 s to restart; healing 1 of 16 HSDP groups costs 60/16 s plus the 1 s step."""
    row = {**ROW, "strategy": "hsdp", "world_size": 128}
    cost = failure_cost(row, gpu_mtbf_hours=10.0, **TIMES)
    assert cost["restart_days"] is None and cost["restart_gpu_hours"] is None
    assert cost["replica_groups"] == 16
    heal = 10.0 / (1 - 128 / 36_000 * (60 / 16 + 1.0))
    assert cost["heal_days"] is not None and abs(cost["heal_days"] - heal) < 1e-9
    table = failure_table([{**row, **cost}])
    assert "never ends" in table.splitlines()[2], table


def test_fsdp_has_nothing_to_heal_from() -> None:
    row = {**ROW, "strategy": "fsdp", "world_size": 64}
    cost = failure_cost(row, gpu_mtbf_hours=50_000.0, **TIMES)
    assert cost["replica_groups"] is None and cost["heal_days"] is None
    assert cost["restart_days"] is not None and cost["restart_days"] > 10.0
    line = failure_table([{**row, **cost}]).splitlines()[2].split()
    assert line[2] == "fsdp" and line[-2:] == ["-", "-"], line
    assert failure_cost({**row, "train_days": None}, gpu_mtbf_hours=1.0, **TIMES) == dict.fromkeys(
        cost
    )
