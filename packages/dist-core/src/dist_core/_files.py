"""Opening untrusted files: regular files only, never through a link, never blocking.

Every reader of a file that someone else made (a checkpoint's manifest, DCP's index, values,
RNG files; a safetensors header) opens it here, so that a planted FIFO cannot block a reader
and a planted symbolic link cannot lead it out of the directory it reads: ``O_NONBLOCK`` makes
opening a FIFO return at once (and changes nothing for a regular file), ``O_NOFOLLOW`` refuses
a link, and the opened file must be a regular one.

One kind of link is followed where the caller asks: a Hugging Face hub cache snapshot's. In
``<cache>/models--org--name/snapshots/<revision>/`` every file is a relative link to
``../../blobs/<hash>``; such a link is followed when its real path is a file directly in the
same repository's ``blobs/`` (opened with the same flags, so still never a FIFO).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


_HUB_REPOS = ("models--", "datasets--", "spaces--")


def open_regular(
    file: Path,
    *,
    error: type[Exception] = ValueError,
    holder: str = "a checkpoint",
    hub_cache: bool = False,
) -> BinaryIO:
    """Open ``file`` for reading in binary mode, refusing what is not a regular file.

    Args:
        file: The file.
        error: The exception type raised for a link or a file that is not regular.
        holder: What holds the file, for the message (``"a checkpoint"``).
        hub_cache: Follow a hub cache snapshot's link into its repository's ``blobs/``.

    Raises:
        error: If it is a symbolic link, a FIFO, a device, a socket or a directory.
        OSError: If it cannot be opened (missing, no permission).
    """
    try:
        fd = os.open(file, _FLAGS)
    except OSError as failure:
        blob = hub_blob(Path(file)) if failure.errno == errno.ELOOP and hub_cache else None
        if blob is not None:
            return open_regular(blob, error=error, holder=holder)
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
    file: Path,
    *,
    error: type[Exception] = ValueError,
    holder: str = "a checkpoint",
    hub_cache: bool = False,
) -> bytes:
    """The whole content of ``file``, opened by :func:`open_regular`."""
    with open_regular(file, error=error, holder=holder, hub_cache=hub_cache) as stream:
        return stream.read()


def hub_blob(link: Path) -> Path | None:
    """The blob a hub cache snapshot's ``link`` points to, or ``None`` if it is not one.

    ``link`` must sit under ``<repo>/snapshots/<revision>/`` of a repository folder named as
    the hub names them (``models--org--name``), and its real path must be a file directly in
    ``<repo>/blobs/``.
    """
    absolute = Path(os.path.abspath(link))
    repo = next((p.parent.parent for p in absolute.parents if p.parent.name == "snapshots"), None)
    if repo is None or not repo.name.startswith(_HUB_REPOS):
        return None
    blobs = Path(os.path.realpath(repo / "blobs"))
    real = Path(os.path.realpath(absolute))
    return real if real.parent == blobs and (repo / "blobs").is_dir() else None


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
