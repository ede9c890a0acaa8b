"""checkpoint-io beside raw DCP (get_state_dict + dcp.save, dcp.load + set_state_dict).

A ~50 MB model (12.6 M fp32 parameters) with AdamW state, on a one-rank gloo group, saved to
and loaded from a temporary directory on this machine's disk.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from microbench_models import RunnerModel
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from checkpoint_io import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.usefixtures("process_group")

GROUPS = {
    "test_save": "checkpoint-io: save vs get_state_dict + dcp.save",
    "test_load": "checkpoint-io: load vs dcp.load + set_state_dict",
}
_COUNTER = itertools.count()


@pytest.fixture(scope="module")
def trained() -> Iterator[tuple[RunnerModel, torch.optim.Optimizer, Path]]:
    torch.manual_seed(0)
    model = RunnerModel(width=512, depth=6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, 512)).sum().backward()
    optimizer.step()
    folder = Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    save_checkpoint(folder / "ours", model, optimizer, step=1)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / "raw"))
    yield model, optimizer, folder
    shutil.rmtree(folder, ignore_errors=True)


def test_save(paired: Any, trained: tuple[RunnerModel, torch.optim.Optimizer, Path]) -> None:
    model, optimizer, folder = trained
    assert sum(p.numel() for p in model.parameters()) * 4 > 45e6

    def raw() -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(_fresh(folder)))

    def ours() -> None:
        save_checkpoint(_fresh(folder), model, optimizer, step=1)

    paired(raw if paired.side == "raw" else ours, rounds=8)


@pytest.mark.parametrize("verify", [False, True], ids=["in-place", "verified"])
def test_load(
    paired: Any, trained: tuple[RunnerModel, torch.optim.Optimizer, Path], verify: bool
) -> None:
    model, optimizer, folder = trained
    if verify:  # the default: fresh tensors, checked before the model changes
        paired.rename("checkpoint-io: load, verified, vs raw")

    def ours() -> None:
        load_checkpoint(folder / "ours", model, optimizer, verify=verify)

    paired(_raw_load(model, optimizer, folder) if paired.side == "raw" else ours, rounds=8)


def _raw_load(model: RunnerModel, optimizer: torch.optim.Optimizer, folder: Path) -> Any:
    def raw() -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(folder / "raw"))
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

    return raw


def _fresh(folder: Path) -> Path:
    path = folder / f"save-{next(_COUNTER)}"
    shutil.rmtree(path, ignore_errors=True)
    return path
