"""The error the command line reports as one line with exit code 2."""

from __future__ import annotations


class BenchUsageError(Exception):
    """Bad input to strategy-bench: reported as one line, exit code 2, before any rank runs."""
