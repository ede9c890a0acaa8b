"""sample-order's record: which samples each committed step trained on, and which were lost."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from sample_order import SampleLog, SampleOrder, read_sample_log

ORDER = SampleOrder(60, global_batch=12, seed=5)  # 3 writers of 4 samples a step


def _share(step: int, writer: int) -> list[int]:
    return ORDER.shard(step, rank=writer, world_size=3)


def test_the_record_names_what_each_step_trained_and_lost(tmp_path: Path) -> None:
    logs = [SampleLog(tmp_path, writer=f"replica_{w}") for w in range(3)]
    for step in range(6):
        for writer, log in enumerate(logs):
            if writer == 2 and 2 <= step < 4:  # down for steps 2 and 3
                continue
            log.write(step, _share(step, writer))
    history = read_sample_log(tmp_path, ORDER)
    assert sorted(history.trained) == list(range(6))
    assert history.trained[3] == {"replica_0": _share(3, 0), "replica_1": _share(3, 1)}
    assert history.lost == {s: sorted(_share(s, 2)) if s in (2, 3) else [] for s in range(6)}
    assert history.lost_count == 8
    # A resumed writer's later line for a step replaces its earlier one.
    logs[2].write(3, _share(3, 2))
    assert read_sample_log(tmp_path, ORDER).lost[3] == []


def test_a_line_cut_short_by_a_crash_is_dropped_on_reopen(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    SampleLog(tmp_path, writer="replica_0").write(0, _share(0, 0))
    path = tmp_path / "replica_0.jsonl"
    path.write_bytes(path.read_bytes() + b'{"step": 1, "wri')  # killed mid-line
    with caplog.at_level(logging.WARNING):
        log = SampleLog(tmp_path, writer="replica_0")
    assert "ends in a line cut short (16 bytes" in caplog.text
    log.write(1, _share(1, 0))
    assert sorted(read_sample_log(tmp_path, ORDER).trained) == [0, 1]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"step": 0, "writer": "replica_0"}', 'not an object with keys "step"'),
        ('{"step": -1, "writer": "replica_0", "samples": []}', "step must be >= 0, got -1"),
        ('{"step": true, "writer": "replica_0", "samples": []}', "step must be an int"),
        ('{"step": 0, "writer": "replica_9", "samples": []}', "writer 'replica_9' in the file"),
        ('{"step": 0, "writer": "replica_0", "samples": [60]}', "a sample outside 0..59"),
        ('{"step": 0, "writer": "replica_0", "samples": [1.5]}', "samples[] must be an int"),
        ("[" * 100_000, "malformed sample record"),
    ],
)
def test_a_malformed_line_is_named_by_file_and_line(
    tmp_path: Path, line: str, message: str
) -> None:
    (tmp_path / "replica_0.jsonl").write_text(line + "\n")
    with pytest.raises(ValueError, match=r"replica_0\.jsonl:1: malformed") as info:
        read_sample_log(tmp_path, ORDER)
    assert message in str(info.value)


def test_a_record_of_another_order_or_overlapping_shards_is_refused(tmp_path: Path) -> None:
    log = SampleLog(tmp_path, writer="replica_0")
    other = next(i for i in range(60) if i not in ORDER.batch(0))
    log.write(0, [other])
    with pytest.raises(ValueError, match=rf"replica_0 recorded samples \[{other}\] at step 0"):
        read_sample_log(tmp_path, ORDER)
    (tmp_path / "replica_0.jsonl").unlink()
    SampleLog(tmp_path, writer="replica_0").write(0, _share(0, 0))
    SampleLog(tmp_path, writer="replica_1").write(0, _share(0, 0))
    with pytest.raises(ValueError, match="by both replica_0 and replica_1"):
        read_sample_log(tmp_path, ORDER)


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="writer must be 1 to 128 letters"):
        SampleLog(tmp_path, writer="../escape")
    log = SampleLog(tmp_path, writer="w")
    with pytest.raises(ValueError, match="step must be >= 0, got -2"):
        log.write(-2, [1])
    with pytest.raises(TypeError, match=r"samples\[\] must be an int, got str"):
        log.write(0, ["1"])  # type: ignore[list-item]
    assert not (tmp_path / "w.jsonl").exists()
    with pytest.raises(FileNotFoundError, match="no sample record"):
        read_sample_log(tmp_path, ORDER)
