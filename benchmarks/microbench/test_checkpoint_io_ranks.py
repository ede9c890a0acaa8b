"""checkpoint-io on 2 gloo ranks under DDP and FSDP2, beside raw DCP in the same rounds.

A ~50 MB model (12.6 M fp32 parameters) with its AdamW state; each side runs in alternating
rounds on the same ranks, timed from a barrier to a barrier (the slowest rank's time), the
garbage collected before each (outside the timing):

- save: ``save_checkpoint`` vs ``get_state_dict`` + ``dcp.save``;
- verified load: ``load_checkpoint`` (the default, every file's digest checked) vs
  ``dcp.load`` + ``set_state_dict``;
- async stall: what ``async_save_checkpoint`` holds the training loop (staging) vs a
  synchronous ``save_checkpoint``; the background write is waited for outside the timing.
"""

from __future__ import annotations

import gc
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from microbench_models import RunnerModel
from microbench_spawn import run_two_ranks
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from checkpoint_io import async_save_checkpoint, load_checkpoint, save_checkpoint

ROUNDS = 10
STRATEGIES = ("ddp", "fsdp")


def group(strategy: str, case: str) -> str:
    """The name a case is reported (and judged) under."""
    return f"checkpoint-io, 2 ranks, {strategy.upper()}: {case}"


CASES = {
    "save": "save vs get_state_dict + dcp.save",
    "load": "load, verified, vs dcp.load + set_state_dict",
    "stall": "async save stall vs a synchronous save",
}


def _trained(strategy: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model: torch.nn.Module = RunnerModel(width=512, depth=6)
    if strategy == "ddp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = DistributedDataParallel(model)
    else:
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, 512)).sum().backward()
    optimizer.step()
    return model, optimizer


def _sides(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path
) -> dict[str, dict[str, Callable[[], object]]]:
    def raw_save() -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / "raw"))

    def ours_save() -> None:
        save_checkpoint(folder / "ours", model, optimizer, step=1, overwrite=True)

    def raw_load() -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / "raw-kept"))
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

    def ours_load() -> None:
        load_checkpoint(folder / "ours-kept", model, optimizer)

    def async_stall() -> Any:
        return async_save_checkpoint(folder / "async", model, optimizer, step=1, overwrite=True)

    return {
        "save": {"raw": raw_save, "ours": ours_save},
        "load": {"raw": raw_load, "ours": ours_load},
        "stall": {"raw": ours_save, "ours": async_stall},
    }


def _rank(rank: int, folder: str) -> dict[str, dict[str, list[float]]]:
    times: dict[str, dict[str, list[float]]] = {}
    for strategy in STRATEGIES:
        root = Path(folder) / strategy
        model, optimizer = _trained(strategy)
        save_checkpoint(root / "ours-kept", model, optimizer, step=1)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root / "raw-kept"))
        for case, sides in _sides(model, optimizer, root).items():
            measured: dict[str, list[float]] = {"raw": [], "ours": []}
            for index in range(ROUNDS + 1):  # round 0 warms up
                for side in ("raw", "ours") if index % 2 == 0 else ("ours", "raw"):
                    gc.collect()  # outside the timing, as conftest's rounds do
                    dist.barrier()
                    begin = time.perf_counter()
                    result = sides[side]()
                    dist.barrier()  # the slowest rank's time
                    elapsed = time.perf_counter() - begin
                    if hasattr(result, "wait"):  # the background write, outside the timing
                        result.wait()
                    if index:
                        measured[side].append(elapsed)
                    dist.barrier()
                    if rank == 0:
                        for name in ("raw", "ours", "async"):
                            shutil.rmtree(root / name, ignore_errors=True)
                    dist.barrier()
            times[group(strategy, CASES[case])] = measured
    return times


def test_checkpoint_io_on_two_ranks(tmp_path: Any, record_interleaved: Any) -> None:
    times = run_two_ranks(__file__, "_rank", str(tmp_path), timeout_s=600)
    for name, measured in times.items():
        record_interleaved(name, measured)
