"""Format 4 runs no code from a checkpoint, by construction: no path of a load unpickles.

Python's own audit events watch every reader of checkpoints saved under DDP, FSDP, HSDP and
in one process (each with an optimizer, a stateful object and the RNG): no
``pickle.find_class`` event, and ``torch.load`` (patched to raise) never called, while
``load_checkpoint``, ``latest_checkpoint``, ``CheckpointManager.resume``, ``consolidate``,
``inspect`` and hf-io's ``load_pretrained`` of the consolidated model run.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpoint_workers as workers
from checkpoint_io import (
    CheckpointManager,
    consolidate_checkpoint,
    latest_checkpoint,
    load_checkpoint,
)
from checkpoint_io._cli import main
from dist_harness import run_ranks
from hf_io import load_pretrained

_WATCHING = [False]
_EVENTS: list[tuple[str, Any]] = []


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if _WATCHING[0] and event.startswith("pickle."):
        _EVENTS.append((event, args))


sys.addaudithook(_hook)  # cannot be removed: it records only while watching


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("audit")
    run_ranks(workers.saves_for_the_audit, str(folder), world_size=4)
    torch.manual_seed(0)
    model = workers.Net()
    optimizer, scheduler = workers.optimizer_for(model)
    workers.train(model, optimizer, scheduler, 0, range(1))
    CheckpointManager(folder / "one", every=1).maybe_save(
        1, model, optimizer, stateful={"sched": scheduler}
    )
    return folder


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, Any]]]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch.load was called on a checkpoint-io read path")

    monkeypatch.setattr(torch, "load", refused)
    _EVENTS.clear()
    _WATCHING[0] = True
    try:
        yield _EVENTS
    finally:
        _WATCHING[0] = False


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["one", "ddp", "fsdp", "hsdp"])
def test_no_reader_unpickles(
    saved: Path, watched: list[tuple[str, Any]], strategy: str, tmp_path: Path
) -> None:
    root = saved / strategy
    step = latest_checkpoint(root)
    assert step == root / "step-1"
    model = workers.Net()
    optimizer, scheduler = workers.optimizer_for(model)
    info = load_checkpoint(step, model, optimizer, stateful={"sched": scheduler})
    assert info.step == 1 and scheduler.last_epoch == 1
    resumed = workers.Net()
    optimizer, scheduler = workers.optimizer_for(resumed)
    assert (
        CheckpointManager(root, every=1).resume(resumed, optimizer, stateful={"sched": scheduler})
        == 1
    )
    out = consolidate_checkpoint(step, tmp_path / "hf")
    assert main(["inspect", str(step), "--fingerprint"]) == 0
    pretrained = workers.Net()
    load_pretrained(pretrained, out)
    for key, value in model.state_dict().items():
        assert torch.equal(pretrained.state_dict()[key], value), key
    assert watched == [], watched[:3]
