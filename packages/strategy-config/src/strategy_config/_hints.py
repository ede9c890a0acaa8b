"""'Did you mean' hints shared by every validation message of the package."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(value: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``value``, or ``None`` when nothing is reasonably close."""
    matches = difflib.get_close_matches(value, sorted(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(value: str, candidates: Iterable[str]) -> str:
    """A ``" (did you mean 'x'?)"`` suffix, or an empty string when no candidate is close."""
    match = closest(value, candidates)
    return f" (did you mean '{match}'?)" if match is not None else ""
