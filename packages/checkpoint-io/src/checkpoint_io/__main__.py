"""``python -m checkpoint_io inspect PATH`` and ``python -m checkpoint_io consolidate PATH OUT``."""

from __future__ import annotations

import sys

from checkpoint_io._cli import main

if __name__ == "__main__":
    sys.exit(main())
