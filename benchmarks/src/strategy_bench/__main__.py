"""``python -m strategy_bench``."""

from __future__ import annotations

from strategy_bench._cli import main

raise SystemExit(main())
