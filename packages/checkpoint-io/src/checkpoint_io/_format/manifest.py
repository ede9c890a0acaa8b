"""``checkpoint.json``: what a checkpoint holds, and the ``CheckpointInfo`` a load returns."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from checkpoint_io._errors import CheckpointError, read_regular

FORMAT = "checkpoint_io"


# 2: a table of every file's size and checksum ("files") replaces the gathered model fingerprint.
# 3: the files' digests are xxh3_128 (2: wsum64); stateful objects' state is kept per rank
#    ("stateful_state"); reading runs no code from the checkpoint.
FORMAT_VERSION = 3


PathLike = str | os.PathLike[str]
"""A checkpoint's path, as the public functions take it."""
MANIFEST = "checkpoint.json"


METADATA_FILE = ".metadata"  # DCP's own index, written by the coordinator


RNG_DIR = "rng"


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`load_checkpoint` read.

    Attributes:
        step: The ``step`` given to ``save_checkpoint`` (``None`` if none was).
        extra: The ``extra`` mapping given to ``save_checkpoint``.
        world_size: Ranks that wrote the checkpoint.
        strategy: ``"ddp"``, ``"fsdp"``, ``"hsdp"`` or ``"none"``: how the saved model was
            wrapped.
        torch_version: The torch that wrote it.
        fingerprint: ``replica_init.state_fingerprint`` of the full model state, for
            checkpoints of format 1, which gathered the model to compute it. ``None`` for
            format 2: saves no longer gather, and the same value is computed offline by
            ``python -m checkpoint_io inspect PATH --fingerprint``.
        path: The checkpoint directory.
    """

    step: int | None
    extra: dict[str, Any]
    world_size: int
    strategy: str
    torch_version: str
    fingerprint: str | None
    path: Path


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``, checked.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        CheckpointError: If it is not a checkpoint directory, the manifest is unreadable, or
            it was written by a newer format version.
    """
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}: the path does not exist")
    file = path / MANIFEST
    if not path.is_dir() or not file.is_file():
        raise CheckpointError(
            f"{str(path)!r} is not a checkpoint: it has no {MANIFEST} (a directory written by "
            "save_checkpoint holds one); pass the directory save_checkpoint returned"
        )
    try:
        manifest = json.loads(read_regular(file).decode())
    except CheckpointError:
        raise
    except (OSError, ValueError, RecursionError) as error:  # RecursionError: nested too deep
        raise CheckpointError(f"{file} is unreadable or corrupt ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a checkpoint-io manifest")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{str(path)!r} has format version {version!r}, newer than this checkpoint-io "
            f"reads ({FORMAT_VERSION}); upgrade checkpoint-io"
        )
    return manifest


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Write ``checkpoint.json`` into the (temporary) checkpoint directory."""
    (path / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def info_from(manifest: dict[str, Any], path: Path) -> CheckpointInfo:
    """The :class:`CheckpointInfo` of a manifest."""
    return CheckpointInfo(
        step=manifest.get("step"),
        extra=dict(manifest.get("extra") or {}),
        world_size=int(manifest["world_size"]),
        strategy=str(manifest["strategy"]),
        torch_version=str(manifest["torch_version"]),
        fingerprint=str(manifest["fingerprint"]) if manifest.get("fingerprint") else None,
        path=path,
    )


MODEL, OPTIM, STATEFUL = "model", "optim", "stateful"
