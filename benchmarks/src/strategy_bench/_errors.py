"""The error the command line reports as one line with exit code 2, and one-line reasons."""

from __future__ import annotations


class BenchUsageError(Exception):
    """Bad input to strategy-bench: reported as one line, exit code 2, before any rank runs."""


def error_summary(error: BaseException, limit: int = 300) -> str:
    """``"TypeName: first line of the message"``, at most ``limit`` characters.

    A reason for a row or a progress line: torch's compiler and fake-tensor errors put the
    cause first.
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:limit]
