"""Durable before published: what is written reaches the disk before anything older goes.

A rename is atomic but not durable: after a power or kernel failure the new directory entry,
the manifest or a data file may be lost while the checkpoint it replaced was already removed.
Every file checkpoint-io (or hf-io) writes, the directory and its parent are fsynced before
the checkpoint is published and before ``overwrite`` or ``keep_last`` removes an older one.
Nothing relies on DCP's own flushing: a data file is flushed by the writer that wrote it
(safe-store's ``StreamWriter``, hf-io's slice writes), and safe-store's ``publish`` flushes
every file of the output again, its directories, and the parent after the rename.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data and size to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush ``path``'s directory entries (files created or renamed in it) to the disk.

    A no-op where directories cannot be opened (Windows).
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every directory under ``root`` (and ``root``) once its files are flushed."""
    for folder, _, _ in os.walk(root):
        fsync_dir(Path(folder))


def make_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents, each one's entry flushed in its parent.

    A root created on the first save was not itself durable: after a failure its first
    checkpoints could vanish with its directory entry.
    """
    missing = []
    current = path
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    path.mkdir(parents=True, exist_ok=True)
    for created in reversed(missing):
        fsync_dir(created.parent)
