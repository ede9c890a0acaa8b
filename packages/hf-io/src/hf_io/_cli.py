"""The command line: ``python -m hf_io export CKPT OUT`` (a checkpoint to transformers' layout)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from hf_io._export import export_checkpoint

USAGE_EXIT = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_EXIT, f"hf_io: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (2 for bad input, with one line)."""
    parser = _Parser(prog="python -m hf_io", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    export = commands.add_parser(
        "export", help="a checkpoint-io checkpoint as model.safetensors (or shards and index)"
    )
    export.add_argument("ckpt", type=Path, help="the checkpoint directory")
    export.add_argument("out", type=Path, help="the directory to create")
    export.add_argument("--max-shard-size", default="5GB", help="largest file (default 5GB)")
    export.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    export.add_argument(
        "--config-from",
        type=Path,
        help="copy config.json (and generation_config.json) from this directory",
    )
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(
            args.ckpt,
            args.out,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
            config_from=args.config_from,
        )
    except (OSError, ValueError) as error:  # CheckpointError is a ValueError
        message = str(error).encode("unicode_escape").decode("ascii")
        sys.stderr.write(f"hf_io: error: {message}\n")
        return USAGE_EXIT
    sys.stdout.write(f"wrote {out}\n")
    return 0
