"""``checkpoint.json``: what a checkpoint holds, and the ``CheckpointInfo`` a load returns.

The manifest is untrusted input like every file of a checkpoint: its size is capped before it
is read, it is strict JSON (no key twice, no ``NaN``, bounded integers), and every field a
reader uses is checked for its type and range here, so that a malformed one is one
:class:`CheckpointError` (which ``resume`` falls back on) and never a raw ``KeyError`` later.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from checkpoint_io._errors import CheckpointError, open_regular, shown
from safe_store import ALGORITHM, record_digest, strict_json

FORMAT = "checkpoint_io"

# 2: a table of every file's size and checksum ("files") replaces the gathered model fingerprint.
# 3: the files' digests are xxh3_128; stateful objects' state is kept per rank.
# 4: no pickle anywhere: tensors in safetensors files, everything else in JSON (index.json).
FORMAT_VERSION = 4

PathLike = str | os.PathLike[str]
"""A checkpoint's path, as the public functions take it."""

MANIFEST = "checkpoint.json"
INDEX_FILE = "index.json"  # DCP's index, as JSON, written by the coordinator
DCP_METADATA = ".metadata"  # DCP's own (pickled) index: formats 1-3 and raw dcp.save
RNG_DIR = "rng"
STATEFUL_DIR = "stateful"
MAX_MANIFEST = 64 << 20
"""The largest ``checkpoint.json`` read, in bytes (a padded one is refused unread)."""

MODEL, OPTIM, STATEFUL = "model", "optim", "stateful"

# The manifest's "files": each file's name (relative, "/"-separated) -> {"bytes": n,
# "xxh3_128": hex, "records": [[offset, length, hex], ...] (a data file's), "rank": writer}.
# Each rank hashes what it writes as it writes it; no tensor is gathered to check a checkpoint.
FileTable = dict[str, dict[str, Any]]

IMPORT_HINT = (
    "import it into format 4 with `python -m checkpoint_io import SRC DST --trust-pickle` "
    "(or checkpoint_io.import_checkpoint(src, dst, trust_pickle=True)), which runs the code "
    "its pickles hold: only for a checkpoint you trust"
)


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
        fingerprint: Always ``None`` (``inspect PATH --fingerprint`` computes it offline).
        path: The checkpoint directory.
    """

    step: int | None
    extra: dict[str, Any]
    world_size: int
    strategy: str
    torch_version: str
    fingerprint: str | None
    path: Path


def rng_file(rank: int) -> str:
    """The RNG file of ``rank``, relative to the checkpoint."""
    return f"{RNG_DIR}/rank{rank}.safetensors"


def stateful_file(rank: int) -> str:
    """The per-rank ``stateful=`` file of ``rank``, relative to the checkpoint."""
    return f"{STATEFUL_DIR}/rank{rank}.safetensors"


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``, checked field by field.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        CheckpointError: If it is not a checkpoint directory, the manifest is unreadable or
            malformed, or its format is another (an older one names the import).
    """
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}: the path does not exist")
    file = path / MANIFEST
    if not path.is_dir() or not (file.is_file() or file.is_symlink()):
        raw_dcp = (path / DCP_METADATA).exists()
        raise CheckpointError(
            f"{str(path)!r} is not a checkpoint: it has no {MANIFEST}"
            + (
                f"; it holds DCP's pickled {DCP_METADATA} (a raw dcp.save checkpoint): "
                + IMPORT_HINT
                if raw_dcp
                else " (a directory written by save_checkpoint holds one); pass the directory "
                "save_checkpoint returned"
            )
        )
    try:
        with open_regular(file) as stream:
            size = os.fstat(stream.fileno()).st_size
            if size > MAX_MANIFEST:
                raise CheckpointError(
                    f"{file} is {size} bytes, more than a manifest's {MAX_MANIFEST}; refused "
                    "unread as damaged or crafted"
                )
            manifest = strict_json(stream.read(MAX_MANIFEST), str(file))
    except CheckpointError:
        raise
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{file} is unreadable or corrupt ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a checkpoint-io manifest")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        if isinstance(version, int) and 1 <= version < FORMAT_VERSION:
            raise CheckpointError(
                f"{str(path)!r} has format version {version}, whose files are pickles; this "
                f"checkpoint-io reads format {FORMAT_VERSION} only: " + IMPORT_HINT
            )
        raise CheckpointError(
            f"{str(path)!r} has format version {shown(version)}, which this checkpoint-io "
            f"does not read (it reads {FORMAT_VERSION}); upgrade checkpoint-io"
        )
    check_manifest(manifest, file)
    return manifest


_HEX = re.compile(r"[0-9a-f]{32}")


def check_manifest(manifest: Mapping[str, Any], file: Path) -> None:
    """Check every field a reader uses, by type and range, and the files each rank must have.

    Raises:
        CheckpointError: Naming the field and what it holds.
    """

    def bad(field: str, value: Any, expected: str) -> CheckpointError:
        return CheckpointError(
            f"{file}'s {field} is {shown(value, 60)}, not {expected}; the manifest is "
            "malformed (refused, nothing was read)"
        )

    world = manifest.get("world_size")
    if type(world) is not int or not 1 <= world <= 1 << 20:
        raise bad("world_size", world, "a rank count")
    step = manifest.get("step")
    if step is not None and (type(step) is not int or step < 0):
        raise bad("step", step, "an int >= 0 or null")
    sequence = manifest.get("sequence")
    if type(sequence) is not int or sequence < 0:
        raise bad("sequence", sequence, "a save's place in its root's order (an int >= 0)")
    for field in ("strategy", "torch_version", "model_class"):
        if not isinstance(manifest.get(field), str):
            raise bad(field, manifest.get(field), "a string")
    for field in ("rng", "optimizer"):
        if type(manifest.get(field)) is not bool:
            raise bad(field, manifest.get(field), "true or false")
    if not isinstance(manifest.get("extra"), dict):
        raise bad("extra", manifest.get("extra"), "an object")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise bad("files", files, "a table of files")
    keys = manifest.get("model_keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise bad("model_keys", keys, "a list of names")
    tied = manifest.get("tied")
    if not isinstance(tied, list) or not all(
        isinstance(g, list) and all(isinstance(n, str) for n in g) for g in tied
    ):
        raise bad("tied", tied, "a list of lists of names")
    if manifest["rng"]:
        missing = [rng_file(r) for r in range(world) if rng_file(r) not in files]
        if missing:
            raise bad(
                "files", missing[:3], f"a table holding the RNG file of each of {world} ranks"
            )
    names = manifest.get("stateful")
    state = manifest.get("stateful_state")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise bad("stateful", names, "a list of names")
    if not isinstance(state, dict) or sorted(state) != sorted(names):
        raise bad("stateful_state", state, f"an entry for each of {names}")
    for name, entry in state.items():
        field = f"stateful_state[{name!r}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class"), str):
            raise bad(field, entry, "{class, sharded, digests}")
        sharded, digests = entry.get("sharded"), entry.get("digests")
        if not isinstance(sharded, list) or not all(isinstance(k, str) for k in sharded):
            raise bad(f"{field}['sharded']", sharded, "a list of keys")
        if (
            not isinstance(digests, list)
            or len(digests) != world
            or not all(isinstance(d, str) and _HEX.fullmatch(d) for d in digests)
        ):
            raise bad(f"{field}['digests']", digests, f"{world} digests, one per saved rank")
        if stateful_file(0) not in files:
            raise bad("files", stateful_file(0), "a table holding rank 0's stateful file")


STEP_PREFIX = "step-"
STEP_DIR = re.compile(rf"{STEP_PREFIX}(0|[1-9][0-9]*)", re.ASCII)
"""A :class:`CheckpointManager` checkpoint's name: canonical only (``step-007`` is none)."""


def saved_sequence(path: Path) -> int:
    """The manifest's ``sequence`` of a checkpoint: its place in its root's saving order.

    Raises:
        CheckpointError: As :func:`read_manifest`.
    """
    return int(read_manifest(path)["sequence"])


def next_sequence(root: Path) -> int:
    """One past the ``sequence`` of every ``step-<N>`` checkpoint under ``root`` (1 if none)."""
    highest = 0
    if root.is_dir():
        for child in root.iterdir():
            if STEP_DIR.fullmatch(child.name) and (child / MANIFEST).is_file():
                try:
                    highest = max(highest, saved_sequence(child))
                except (OSError, CheckpointError):
                    continue  # a damaged one holds no place in the order
    return highest + 1


def file_entry(file: Path) -> dict[str, Any]:
    """``{"bytes": size, "xxh3_128": digest}`` of one small file (the index)."""
    with open_regular(file) as stream:
        data = stream.read()
    return {"bytes": len(data), ALGORITHM: record_digest(data)}


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Write ``checkpoint.json`` into the (temporary) checkpoint directory."""
    text = json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False)
    (path / MANIFEST).write_text(text + "\n")


def info_from(manifest: dict[str, Any], path: Path) -> CheckpointInfo:
    """The :class:`CheckpointInfo` of a checked manifest."""
    return CheckpointInfo(
        step=manifest.get("step"),
        extra=dict(manifest["extra"]),
        world_size=int(manifest["world_size"]),
        strategy=str(manifest["strategy"]),
        torch_version=str(manifest["torch_version"]),
        fingerprint=None,
        path=path,
    )
