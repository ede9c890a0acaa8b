"""The one door to pickled checkpoints (formats 1-3 of checkpoint-io, raw ``dcp.save``).

Reached only by ``import_checkpoint(..., trust_pickle=True)`` or ``--trust-pickle``: it reads
with DCP's reader and ``torch.load`` (running the checkpoint's code) and writes format 4.
"""

from __future__ import annotations

import functools
import io
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from checkpoint_io import _compat
from checkpoint_io._claim import ClaimPlanner, claim, partial_for
from checkpoint_io._errors import CheckpointError
from checkpoint_io._rng import rng_tensors
from checkpoint_io._save import seal
from checkpoint_io._stateful import encode_states
from checkpoint_io._storage.manifest import (
    DCP_METADATA,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MODEL,
    OPTIM,
    STATEFUL,
    FileTable,
    rng_file,
    stateful_file,
)
from checkpoint_io._storage.planners import Whole
from checkpoint_io._storage.writer import SafeWriter, write_tensors_file


def import_checkpoint(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], *, trust_pickle: bool = False
) -> Path:
    """Write a pickled checkpoint (formats 1-3, or raw ``dcp.save``) again as format 4.

    Args:
        src: The checkpoint to import.
        dst: The format-4 checkpoint to create.
        trust_pickle: Must be ``True``: reading ``src`` unpickles it, which runs any code it
            holds.

    Returns:
        ``dst`` as a ``pathlib.Path``.

    Raises:
        ValueError: Without ``trust_pickle=True``.
        CheckpointError: If ``src`` is not such a checkpoint, or holds no ``model``.
        FileExistsError: If ``dst`` exists.
    """
    if trust_pickle is not True:
        raise ValueError(
            f"import_checkpoint reads {str(src)!r} by unpickling it, which runs any code it "
            f"holds; pass trust_pickle=True (--trust-pickle) only for a checkpoint you trust, "
            f"got trust_pickle={trust_pickle!r}"
        )
    root, target = Path(os.fspath(src)), Path(os.fspath(dst))
    if not (root / DCP_METADATA).is_file():
        raise CheckpointError(
            f"{str(root)!r} holds no DCP {DCP_METADATA}: neither a checkpoint-io checkpoint of "
            "format 1-3 nor a dcp.save output"
        )
    old = _old_manifest(root)
    state: dict[str, Any] = {}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        planner = _compat.EmptyStateDictLoadPlanner()  # type: ignore[no-untyped-call]
        _compat.load_in_process(state, FileSystemReader(str(root)), planner)
    if not isinstance(state.get(MODEL), dict):
        raise CheckpointError(
            f"{str(root)!r} holds no {MODEL!r} entry of tensors (its top-level keys: "
            f"{sorted(state)[:8]}); checkpoint-io imports a model's checkpoint"
        )
    world = int(old.get("world_size", 1))
    dcp_state: dict[str, Any] = {MODEL: state[MODEL]}
    if isinstance(state.get(OPTIM), dict) and "param_groups" in state[OPTIM]:
        groups = state[OPTIM]["param_groups"]
        if isinstance(groups, io.BytesIO):
            groups.seek(0)
            groups = torch.load(groups, weights_only=False)  # the door: runs its code
        dcp_state[OPTIM] = {"state": state[OPTIM].get("state", {}), "param_groups": Whole(groups)}
    locals_by_rank = _stateful_states(root, old, state, world)
    if old.get("format_version") == 3 and isinstance(state.get(STATEFUL), dict):
        dcp_state[STATEFUL] = state[STATEFUL]  # the DTensor leaves, as DCP reshards them
    rng_states = [_load(root / f"rng/rank{r}.pt") for r in range(world)] if old.get("rng") else []
    manifest = _manifest(old, dcp_state, world, rng=bool(rng_states))
    texts = [encode_states(local, {n: "imported" for n in local}) for local in locals_by_rank]
    if texts:
        manifest["stateful_state"] = {
            name: {
                "class": str(old["stateful_state"][name]["class"])
                if "stateful_state" in old
                else "imported",
                "sharded": list(old.get("stateful_state", {}).get(name, {}).get("sharded", [])),
                "digests": [digests[name] for _, _, digests in texts],
            }
            for name in locals_by_rank[0]
        }
        manifest["stateful"] = sorted(locals_by_rank[0])

    def side_files(folder: Path) -> FileTable:
        table: FileTable = {}
        for r, rng in enumerate(rng_states):
            table[rng_file(r)] = write_tensors_file(folder / rng_file(r), *rng_tensors(rng))
        for r, (text, tensors, digests) in enumerate(texts):
            if r == 0 or digests != texts[0][2]:
                named = [(f"t{i}", t) for i, t in enumerate(tensors)]
                table[stateful_file(r)] = write_tensors_file(
                    folder / stateful_file(r), named, {"state": text}
                )
        return table

    partial = partial_for(target, False, claim(target))
    writer = SafeWriter(partial, side_files, functools.partial(seal, partial, target, manifest))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp_save(dcp_state, storage_writer=writer, planner=ClaimPlanner(), no_dist=True)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return target


def _old_manifest(root: Path) -> dict[str, Any]:
    file = root / MANIFEST
    if not file.is_file():
        return {}  # raw dcp.save
    manifest = json.loads(file.read_text())
    if manifest.get("format_version") == FORMAT_VERSION:
        raise CheckpointError(f"{str(root)!r} is of format {FORMAT_VERSION} already: load it")
    return dict(manifest)


def _load(file: Path) -> Any:
    return torch.load(file, weights_only=False, map_location="cpu")  # the door: runs its code


def _stateful_states(
    root: Path, old: dict[str, Any], state: dict[str, Any], world: int
) -> list[dict[str, Any]]:
    """Each saved rank's per-rank ``stateful=`` states (format 3's files; 1-2's DCP entry)."""
    names = list(old.get("stateful") or [])
    if not names:
        return []
    if old.get("format_version") != 3:  # formats 1-2: one state per object, under DCP
        return [dict(state.get(STATEFUL, {}))] * world
    first = _load(root / "stateful/rank0.pt")
    found = []
    for r in range(world):
        file = root / f"stateful/rank{r}.pt"
        found.append(_load(file) if r and file.is_file() else first)
    return found


def _manifest(
    old: dict[str, Any], state: dict[str, Any], world: int, *, rng: bool
) -> dict[str, Any]:
    model = state[MODEL]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": old.get("step"),
        "world_size": world,
        "strategy": str(old.get("strategy", "none")),
        "torch_version": str(old.get("torch_version", torch.__version__)),
        "model_class": str(old.get("model_class", "imported")),
        "parameters": int(
            old.get(
                "parameters", sum(t.numel() for t in model.values() if isinstance(t, torch.Tensor))
            )
        ),
        "optimizer": OPTIM in state,
        "stateful": [],
        "stateful_state": {},
        "rng": rng,
        "tied": list(old.get("tied", [])),
        "model_keys": list(old.get("model_keys", list(model))),
        "extra": dict(old.get("extra") or {}),
        "imported_from": {"format_version": old.get("format_version", "dcp")},
    }
