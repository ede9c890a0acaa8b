"""A finished output directory appears whole, durable before it is published.

Files are written into a staging directory beside the output (same filesystem), every file and
directory of it flushed, then published: a new directory by one rename of the staging
directory; an existing one either replaced whole (moved aside, the new one renamed in, the
parent flushed, only then the old one removed: a checkpoint) or, file by file, each by one
rename, removing only the files the writer names as its own (a ``save_pretrained`` directory
that also holds ``step-100/`` or a training log keeps them). The parent directory is flushed
after the rename, before anything older is removed.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from dist_core import fsync_dir, fsync_file, fsync_tree

__all__ = ["abandon", "begin", "check_target", "output_dir", "publish", "staging_dir"]


def output_dir(value: str | os.PathLike[str], argument: str = "out_dir") -> Path:
    """``value`` as an absolute directory path that a staging directory can sit beside.

    Raises:
        TypeError: If it is not a path.
        ValueError: If it is the filesystem root or empty.
    """
    if not isinstance(value, str | os.PathLike):
        raise TypeError(f"{argument} must be a path, got {type(value).__name__}")
    text = os.fspath(value)
    if not text:
        raise ValueError(f"{argument} is empty; pass the directory to write")
    out = Path(os.path.abspath(text))
    if not out.name:
        raise ValueError(
            f"{argument}={text!r} is the filesystem root; pass a directory to write into"
        )
    return out


def staging_dir(out_dir: Path) -> Path:
    """The directory written before it is published to ``out_dir`` (beside it)."""
    return out_dir.with_name(f".{out_dir.name}.partial")


def check_target(out_dir: Path, overwrite: bool, argument: str = "out_dir") -> None:
    """Refuse an existing ``out_dir`` unless ``overwrite``; refuse a file or a link there always.

    ``argument`` names the parameter in the messages (``out_dir='.'`` is the working
    directory, shown as its absolute path).

    Raises:
        FileExistsError: If ``out_dir`` exists (and is not a directory to overwrite).
    """
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise FileExistsError(
            f"{argument} {str(out_dir)!r} exists and is not a directory; choose another "
            "output directory"
        )
    if out_dir.exists() and not overwrite:
        raise FileExistsError(
            f"{argument} {str(out_dir)!r} already exists; pass overwrite=True to replace what "
            "it holds of an earlier output, or choose another output directory"
        )


def begin(out_dir: Path) -> Path:
    """Create the empty staging directory (a stale one from a crashed run is removed)."""
    partial = staging_dir(out_dir)
    shutil.rmtree(partial, ignore_errors=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial.mkdir()
    return partial


def publish(
    partial: Path,
    out_dir: Path,
    *,
    stale: Callable[[str], bool] | None = None,
    aside: Path | None = None,
) -> None:
    """Flush every file and directory of ``partial``, then publish it as ``out_dir``.

    Args:
        partial: The staging directory.
        out_dir: The output directory.
        stale: Merge into an existing ``out_dir`` file by file: whether a file there is an
            earlier output's (removed when the new output does not hold a file of that name);
            nothing else there is touched. (``partial`` holds files only.)
        aside: Replace an existing ``out_dir`` whole: where it goes until the new one is in
            place and flushed (then removed; renamed back if the new one cannot go in).

    Raises:
        FileExistsError: If ``out_dir`` exists and neither ``stale`` nor ``aside`` is given.
    """
    for folder, _, names in os.walk(partial):
        for name in names:
            fsync_file(Path(folder, name))
    fsync_tree(partial)
    if not out_dir.exists():
        os.replace(partial, out_dir)
        fsync_dir(out_dir.parent)
        return
    if aside is not None:
        out_dir.rename(aside)
        try:
            partial.rename(out_dir)
        except BaseException:
            aside.rename(out_dir)
            raise
        fsync_dir(out_dir.parent)  # the rename is on the disk before the old one goes
        shutil.rmtree(aside, ignore_errors=True)
        return
    if stale is None:
        raise FileExistsError(f"{str(out_dir)!r} exists; nothing was published over it")
    new = {file.name for file in partial.iterdir()}
    for name in sorted(new):
        os.replace(partial / name, out_dir / name)
    for old in out_dir.iterdir():
        if old.name not in new and stale(old.name) and old.is_file() and not old.is_symlink():
            old.unlink()
    fsync_dir(out_dir)
    partial.rmdir()


def abandon(out_dir: Path) -> None:
    """Remove what a failed write left (the staging directory only)."""
    shutil.rmtree(staging_dir(out_dir), ignore_errors=True)
