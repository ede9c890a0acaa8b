"""Opening untrusted files: regular files only, never through a link, never blocking.

Every reader of a file that someone else made (a checkpoint's manifest, DCP's index, values,
RNG files; a safetensors header) opens it here. A planted FIFO named ``.metadata`` hung every
checkpoint read path, and a symbolic link named ``checkpoint.json`` was followed out of the
checkpoint: ``O_NONBLOCK`` makes opening a FIFO return at once (and changes nothing for a
regular file), ``O_NOFOLLOW`` refuses a link, and the opened file must be a regular one.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def open_regular(
    file: Path, *, error: type[Exception] = ValueError, holder: str = "a checkpoint"
) -> BinaryIO:
    """Open ``file`` for reading in binary mode, refusing what is not a regular file.

    Args:
        file: The file.
        error: The exception type raised for a link or a file that is not regular.
        holder: What holds the file, for the message (``"a checkpoint"``).

    Raises:
        error: If it is a symbolic link, a FIFO, a device, a socket or a directory.
        OSError: If it cannot be opened (missing, no permission).
    """
    try:
        fd = os.open(file, _FLAGS)
    except OSError as failure:
        if failure.errno == errno.ELOOP:
            raise error(
                f"{file} is a symbolic link; the files of {holder} are read only as regular "
                "files inside it (refused as unsafe)"
            ) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(
                f"{file} is not a regular file ({_kind(mode)}); {holder} holds regular files "
                "only (refused: reading it could block or never end)"
            )
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(
    file: Path, *, error: type[Exception] = ValueError, holder: str = "a checkpoint"
) -> bytes:
    """The whole content of ``file``, opened by :func:`open_regular`."""
    with open_regular(file, error=error, holder=holder) as stream:
        return stream.read()


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"
