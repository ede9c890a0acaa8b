"""``python -m strategy_bench``."""

from __future__ import annotations

from strategy_bench.cli import main

raise SystemExit(main())
