"""checkpoint-io stays small: at most 4,500 lines in all, no module over 300."""

from __future__ import annotations

from pathlib import Path

import checkpoint_io


def test_the_package_stays_within_its_size() -> None:
    root = Path(checkpoint_io.__file__).parent
    lines = {str(f.relative_to(root)): len(f.read_text().splitlines()) for f in root.rglob("*.py")}
    assert sum(lines.values()) <= 4500, f"{sum(lines.values())} lines; cut before adding"
    assert {name: n for name, n in lines.items() if n > 300} == {}
