"""The command line: inspect, consolidate (Hugging Face's layout) or import a checkpoint.

``import`` reads a checkpoint of an older format (or raw ``dcp.save``) into format 4.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoint_io._errors import CheckpointError, escaped
from checkpoint_io._storage.files import read_checked
from checkpoint_io._whole import consolidate_checkpoint, model_fingerprint

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
    consolidate = commands.add_parser(
        "consolidate", help="the model as model.safetensors (or shards and index), via hf-io"
    )
    consolidate.add_argument("path", type=Path, help="the checkpoint directory")
    consolidate.add_argument("out", type=Path, help="the directory to create")
    consolidate.add_argument("--max-shard-size", default="5GB", help="largest file (5GB)")
    consolidate.add_argument("--overwrite", action="store_true", help="write into OUT")
    consolidate.add_argument(
        "--config-from", type=Path, help="copy config.json from this directory"
    )
    imports = commands.add_parser(
        "import",
        help="a checkpoint of format 1-3 or raw dcp.save, into format 4 (runs its pickles)",
    )
    imports.add_argument("src", type=Path, help="the checkpoint to import")
    imports.add_argument("dst", type=Path, help="the format-4 checkpoint to create")
    imports.add_argument(
        "--trust-pickle",
        action="store_true",
        help="required: reading SRC unpickles it, which runs any code it holds",
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            _inspect(args.path, fingerprint=args.fingerprint)
        elif args.command == "consolidate":
            out = consolidate_checkpoint(
                args.path,
                args.out,
                max_shard_size=args.max_shard_size,
                overwrite=args.overwrite,
                config_from=args.config_from,
            )
            sys.stdout.write(f"wrote {out}\n")
        else:
            from checkpoint_io._importer import import_checkpoint  # the one door to pickles

            out = import_checkpoint(args.src, args.dst, trust_pickle=args.trust_pickle)
            sys.stdout.write(f"imported {args.src} into {out} (format 4)\n")
    except (FileNotFoundError, CheckpointError, OSError, ValueError) as error:
        sys.stderr.write(f"checkpoint_io: error: {escaped(str(error))}\n")
        return USAGE_EXIT
    except (TypeError, KeyError, AttributeError, IndexError, RecursionError) as error:
        # A manifest or index of the wrong shape: one line, not a traceback.
        sys.stderr.write(
            f"checkpoint_io: error: {escaped(str(args.path))} is malformed "
            f"({type(error).__name__}: {escaped(str(error))})\n"
        )
        return USAGE_EXIT
    return 0


def _inspect(path: Path, *, fingerprint: bool) -> None:
    manifest, metadata, _ = read_checked(path, verify=False)  # no code runs; index checked
    out = sys.stdout
    out.write(json.dumps(manifest, indent=2, sort_keys=True) + "\n\n")
    rows = [
        (
            escaped(key),
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
