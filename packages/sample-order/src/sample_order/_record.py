"""The record of a run: which samples each committed step trained on, and which were lost.

Each writer (a replica group under fault tolerance, or one run) appends one JSON line per
committed step to its own file, ``FOLDER/<writer>.jsonl``: ``{"step": s, "writer": w,
"samples": [...]}``. Read back against the run's :class:`SampleOrder`, the lines say, for
every step some writer committed, which samples of its global batch were trained on and
which were not (a writer that was down, or not yet healed, at that step).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

from sample_order._order import SampleOrder, _at_least, _integer

logger = logging.getLogger(__name__)

_WRITER = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def _writer_name(writer: object) -> str:
    if not isinstance(writer, str) or not _WRITER.fullmatch(writer):
        raise ValueError(
            f"writer must be 1 to 128 letters, digits, '_', '.' or '-' (it names a file), got "
            f"{writer!r}; e.g. 'replica_0'"
        )
    return writer


class SampleLog:
    """One writer's record: appends a line per committed step to ``FOLDER/<writer>.jsonl``.

    Each line is written whole by one ``write`` and flushed (a writer killed between two
    lines loses neither). A line cut short by a crash at the file's end is dropped, with a
    warning, when the log is opened again.

    Args:
        folder: The run's record folder (created if missing), shared by its writers.
        writer: This writer's name, e.g. ``"replica_2"``.

    Raises:
        ValueError: If ``writer`` cannot name a file.
    """

    def __init__(self, folder: str | os.PathLike[str], *, writer: str) -> None:
        self.writer = _writer_name(writer)
        self.path = Path(folder) / f"{self.writer}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_torn_tail(self.path)

    def write(self, step: int, samples: Sequence[int]) -> None:
        """Record that ``step`` committed, trained on ``samples`` by this writer.

        Raises:
            TypeError: A non-integer step or sample.
            ValueError: A negative step or sample.
        """
        step = _at_least(step, "step", 0)
        listed = [_at_least(sample, "samples[]", 0) for sample in samples]
        line = json.dumps({"step": step, "writer": self.writer, "samples": listed}) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            data = line.encode()
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line that has no newline (its writer died in the middle of it)."""
    if not path.is_file():
        return
    with open(path, "rb+") as file:
        data = file.read()
        if not data or data.endswith(b"\n"):
            return
        keep = data.rfind(b"\n") + 1
        logger.warning(
            "%s ends in a line cut short (%d bytes, a writer killed mid-line); dropped",
            path,
            len(data) - keep,
        )
        file.truncate(keep)


@dataclasses.dataclass(frozen=True)
class SampleHistory:
    """A run's record, step by committed step.

    Attributes:
        trained: For each step some writer committed: each writer's samples.
        lost: For the same steps: the samples of the step's global batch that no writer
            trained on (sorted; empty when every writer was there).
    """

    trained: dict[int, dict[str, list[int]]]
    lost: dict[int, list[int]]

    @property
    def lost_count(self) -> int:
        """Samples lost over the whole record."""
        return sum(len(samples) for samples in self.lost.values())


def read_sample_log(folder: str | os.PathLike[str], order: SampleOrder) -> SampleHistory:
    """Every writer's record in ``folder``, checked against ``order``.

    A writer's later line for a step replaces its earlier one (the run resumed from a
    checkpoint before that step and trained it again).

    Raises:
        FileNotFoundError: If ``folder`` holds no ``*.jsonl`` record.
        ValueError: A malformed line (named by file and line number); a sample that is not
            in its step's global batch, or that two writers trained at the same step (the
            record does not belong to this order, or the shards overlapped).
    """
    files = sorted(Path(folder).glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no sample record (*.jsonl) in {str(folder)!r}")
    trained: dict[int, dict[str, list[int]]] = {}
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            step, writer, samples = _parse(line, f"{path}:{number}", path.stem, order)
            trained.setdefault(step, {})[writer] = samples
    lost: dict[int, list[int]] = {}
    for step in sorted(trained):
        batch, seen = set(order.batch(step)), dict[int, str]()
        for writer, samples in sorted(trained[step].items()):
            extra = sorted(set(samples) - batch)
            if extra:
                raise ValueError(
                    f"{writer} recorded samples {extra[:5]} at step {step}, which are not in "
                    f"that step's global batch of {order!r}; read the record with the order "
                    "the run used"
                )
            for sample in samples:
                if sample in seen:
                    raise ValueError(
                        f"sample {sample} was trained at step {step} by both {seen[sample]} and "
                        f"{writer}; each writer must record its own share of the batch"
                    )
                seen[sample] = writer
        lost[step] = sorted(batch - set(seen))
    return SampleHistory(trained={s: trained[s] for s in sorted(trained)}, lost=lost)


def _parse(line: str, where: str, stem: str, order: SampleOrder) -> tuple[int, str, list[int]]:
    """``(step, writer, samples)`` of one line, or a ``ValueError`` naming ``where``."""
    try:
        entry = json.loads(line)
        if not isinstance(entry, dict) or set(entry) != {"step", "writer", "samples"}:
            raise ValueError('not an object with keys "step", "writer", "samples"')
        if entry["writer"] != stem:
            raise ValueError(f"writer {entry['writer']!r} in the file of {stem!r}")
        step = _at_least(entry["step"], "step", 0)
        if not isinstance(entry["samples"], list):
            raise ValueError("samples is not a list")
        samples = [_integer(sample, "samples[]") for sample in entry["samples"]]
        if any(not 0 <= sample < order.num_samples for sample in samples):
            raise ValueError(f"a sample outside 0..{order.num_samples - 1}")
    except (ValueError, TypeError, RecursionError) as error:
        raise ValueError(f"{where}: malformed sample record ({error}); {line[:120]!r}") from None
    return step, stem, samples
