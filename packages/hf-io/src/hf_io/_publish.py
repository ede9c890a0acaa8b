"""A finished output directory appears whole or not at all, durable before it is published."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dist_core import fsync_dir, fsync_file


def staging(out_dir: Path) -> Path:
    """The directory written before it is renamed to ``out_dir`` (beside it, same filesystem)."""
    return out_dir.with_name(f".{out_dir.name}.partial")


def check_target(out_dir: Path, overwrite: bool) -> None:
    """Refuse an existing ``out_dir`` unless ``overwrite``; refuse a file there always.

    Raises:
        FileExistsError: If ``out_dir`` exists (and is not a directory to overwrite).
    """
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise FileExistsError(
            f"{str(out_dir)!r} exists and is not a directory; choose another output directory"
        )
    if out_dir.exists() and not overwrite:
        raise FileExistsError(
            f"{str(out_dir)!r} already exists; pass overwrite=True to replace it or choose "
            "another output directory"
        )


def begin(out_dir: Path) -> Path:
    """Create the empty staging directory (a stale one from a crashed run is removed)."""
    partial = staging(out_dir)
    shutil.rmtree(partial, ignore_errors=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial.mkdir()
    return partial


def publish(partial: Path, out_dir: Path) -> None:
    """Flush every file of ``partial``, then rename it to ``out_dir`` (replacing an old one)."""
    for file in partial.iterdir():
        fsync_file(file)
    fsync_dir(partial)
    old = out_dir.with_name(f".{out_dir.name}.old")
    if out_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
    os.replace(partial, out_dir)
    fsync_dir(out_dir.parent)
    shutil.rmtree(old, ignore_errors=True)


def abandon(out_dir: Path) -> None:
    """Remove what a failed write left (the staging directory only)."""
    shutil.rmtree(staging(out_dir), ignore_errors=True)
