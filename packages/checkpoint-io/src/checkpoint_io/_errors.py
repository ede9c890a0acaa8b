"""The one exception type of checkpoint-io, and the file openers that raise it."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import BinaryIO

import dist_core


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read as asked; the message says why and what to do.

    Raised on every rank. DCP's own ``CheckpointException`` derives from ``BaseException``
    (``except Exception`` would not catch it); checkpoint-io turns it into this.
    """


def open_regular(file: Path) -> BinaryIO:
    """Open a checkpoint's file: a regular file, not through a link, never blocking.

    Raises:
        CheckpointError: If it is a symbolic link, a FIFO, a device, a socket or a directory.
        OSError: If it cannot be opened (missing, no permission).
    """
    return dist_core.open_regular(file, error=CheckpointError, holder="a checkpoint")


def inside(root: Path, name: str, *, source: str) -> Path:
    """``root / name``, refused unless inside ``root`` (no absolute path, ``..`` or link out).

    Raises:
        CheckpointError: Naming the file name and where it was found.
    """
    pure = PurePosixPath(name)
    if pure.is_absolute() or Path(name).is_absolute() or ".." in pure.parts or not pure.parts:
        raise CheckpointError(
            f"{source} names the file {shown(name)}, which is outside the checkpoint "
            "directory; refused as unsafe (a checkpoint's files are relative paths inside it)"
        )
    path = root / name
    base = os.path.realpath(root)
    try:
        real = os.path.realpath(path)
    except (ValueError, OSError) as error:  # a NUL byte, a loop of links
        raise CheckpointError(
            f"{source} names the file {shown(name)}, which cannot be resolved ({error})"
        ) from None
    if os.path.commonpath([base, real]) != base:
        raise CheckpointError(
            f"{source} names the file {shown(name)}, which leads outside the checkpoint "
            f"directory (to {shown(real)}, through a symbolic link); refused as unsafe"
        )
    return path


def escaped(text: object) -> str:
    """``text`` with every character that is not printable escaped (no ESC, no BEL)."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(text))


def shown(text: object, most: int = 120) -> str:
    """An untrusted value for a message: escaped (no ESC or BEL), cut, a string quoted.

    Anything that is not a string is shown as its ``repr``.
    """
    value = text if isinstance(text, str) else repr(text)
    value = value if len(value) <= most else value[: most - 3] + "..."
    return ascii(value) if isinstance(text, str) else escaped(value)
