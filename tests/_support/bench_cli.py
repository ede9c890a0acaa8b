"""strategy-bench's command line as the tests run it: short runs of real spawned ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from strategy_bench import main

SUPPORT = Path(__file__).resolve().parent


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


QUICK = [
    "--device",
    "cpu",
    "--world-size",
    "2",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--batch-size",
    "2",
    "--probe-mib",
    "0.0625",
    "16",
    "--ckpt-samples",
    "1",
]
"""Short runs. A probe of two sizes far enough apart for a fit under load (64 KiB and 16
MiB); one checkpoint-cost sample per point (the smoke run measures the default's three,
alternating). ``--ckpt-samples`` comes last."""


USER_MODEL = (
    "--model-factory",
    "bench_factories:make_model",
    "--init-params",
    '{"width": 16, "depth": 3}',
    "--input-factory",
    "bench_factories:make_batch",
    "--trainable",
    "bench_factories:freeze_stem",
)


def bench(
    *args: str,
    timeout: float = 300,
    launcher: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python [launcher...] -m strategy_bench ARGS`` with the test factories importable."""
    env = {
        **os.environ,
        **(env or {}),
        "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, *launcher, "-m", "strategy_bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def assert_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC, path
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 200 and image.shape[1] > 200, (path, image.shape)
    assert image.std() > 0.01, f"{path} is blank"


def exit_code(args: list[str]) -> int:
    """``strategy-bench ARGS`` in this process (no ranks start): its exit code."""
    try:
        return main(args)
    except SystemExit as exit:
        return int(exit.code or 0)
