"""``python -m hf_io export CKPT OUT``."""

from __future__ import annotations

from hf_io._cli import main

raise SystemExit(main())
