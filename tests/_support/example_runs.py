"""Running the example trainer (docs/examples/train.py) under torchrun, and reading its lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "train.py"


def example(
    *args: str,
    torchrun: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    nproc: int = 2,
    ok: bool = True,
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            *torchrun,
            str(EXAMPLE),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
    assert (result.returncode == 0) is ok, result.stderr[-3000:]
    return result


def final(result: subprocess.CompletedProcess[str], what: str) -> str:
    lines = [line for line in result.stdout.splitlines() if f"final {what}" in line]
    assert len(lines) == 1, result.stdout
    return lines[0].rsplit(" ", 1)[1]


def final_sum(result: subprocess.CompletedProcess[str]) -> float:
    lines = [line for line in result.stdout.splitlines() if "final weight sum" in line]
    assert len(lines) == 1, result.stdout
    return float(lines[0].rsplit(" ", 1)[1])
