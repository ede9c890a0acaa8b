"""The command line: inspect a checkpoint, or consolidate it into one file."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoint_io._errors import CheckpointError
from checkpoint_io._read.files import read_checked
from checkpoint_io._read.whole import consolidate_checkpoint, model_fingerprint

USAGE_EXIT = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_EXIT, f"checkpoint_io: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (2 for bad input, with one line)."""
    parser = _Parser(prog="python -m checkpoint_io", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    inspect = commands.add_parser("inspect", help="the manifest and a table of the tensors")
    inspect.add_argument("path", type=Path)
    inspect.add_argument(
        "--fingerprint",
        action="store_true",
        help="also read the whole model (one process) and print its strategy-independent "
        "fingerprint, the value replica_init.state_fingerprint gives for the full state",
    )
    consolidate = commands.add_parser("consolidate", help="one torch.save file of plain tensors")
    consolidate.add_argument("path", type=Path)
    consolidate.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            _inspect(args.path, fingerprint=args.fingerprint)
        else:
            out = consolidate_checkpoint(args.path, args.out)
            sys.stdout.write(f"wrote {out}\n")
    except (FileNotFoundError, CheckpointError, OSError) as error:
        sys.stderr.write(f"checkpoint_io: error: {_printable(str(error))}\n")
        return USAGE_EXIT
    except (TypeError, KeyError, AttributeError, IndexError, RecursionError) as error:
        # A manifest or index of the wrong shape: one line, not a traceback.
        sys.stderr.write(
            f"checkpoint_io: error: {_printable(str(args.path))} is malformed "
            f"({type(error).__name__}: {_printable(str(error))})\n"
        )
        return USAGE_EXIT
    return 0


def _printable(text: str) -> str:
    """``text`` with its control and format characters escaped, as ``repr`` writes them.

    Names read from a checkpoint never reach the terminal as escape sequences.
    """
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _inspect(path: Path, *, fingerprint: bool) -> None:
    manifest, metadata, _ = read_checked(path, verify=False)  # no code runs; index checked
    out = sys.stdout
    out.write(json.dumps(manifest, indent=2, sort_keys=True) + "\n\n")
    rows = [
        (
            _printable(key),
            "x".join(str(d) for d in storage.size) or "scalar",
            str(storage.properties.dtype),
        )
        for key, storage in sorted(metadata.state_dict_metadata.items())
        if isinstance(storage, TensorStorageMetadata)
    ]
    width = max((len(r[0]) for r in rows), default=4)
    out.write(f"{'name':<{width}}  {'shape':<16}  dtype\n")
    for name, shape, dtype in rows:
        out.write(f"{name:<{width}}  {shape:<16}  {dtype}\n")
    out.write(f"{len(rows)} tensors\n")
    if fingerprint:
        out.write(f"fingerprint {model_fingerprint(path)}\n")
