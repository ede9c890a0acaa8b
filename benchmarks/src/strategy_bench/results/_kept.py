"""Keeping what a run measured: the ``--out`` check and ``--resume``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from strategy_bench._errors import BenchUsageError
from strategy_bench.results._results import read_results


def check_out(out: Path, *, overwrite: bool, resume: bool) -> list[dict[str, Any]]:
    """Refuse an ``--out`` that would lose results, before any rank starts.

    Args:
        out: The output directory.
        overwrite: Replace an earlier run's results.
        resume: Keep an earlier run's rows and measure only the points it lacks.

    Returns:
        The rows to keep (``--resume``), else an empty list.

    Raises:
        BenchUsageError: If ``out`` is a file, or holds results and neither flag says what
            to do with them, or both flags are given, or ``--resume`` finds no results.
    """
    if overwrite and resume:
        raise BenchUsageError("--overwrite and --resume exclude each other; pick one")
    require_out_dir(out, "the results")
    results = out / "results.json"
    if not results.exists():
        if resume:
            raise BenchUsageError(
                f"--resume but {str(results)!r} does not exist; drop --resume to start a new run"
            )
        return []
    if overwrite:
        return []
    if not resume:
        raise BenchUsageError(
            f"--out {str(out)!r} already holds results ({str(results)!r}); pass --resume to "
            "measure only the points it lacks, --overwrite to replace it, or another --out"
        )
    try:
        payload = read_results(results)
    except ValueError as error:
        raise BenchUsageError(f"--resume: {error}") from None
    return [dict(row) for row in payload["results"]]


def require_out_dir(out: Path, what: str) -> None:
    """Refuse an ``--out`` that exists and is not a directory (``what`` goes in it).

    Raises:
        BenchUsageError: If ``out`` is a file.
    """
    if out.exists() and not out.is_dir():
        raise BenchUsageError(f"--out {str(out)!r} is a file; give a directory for {what}")
