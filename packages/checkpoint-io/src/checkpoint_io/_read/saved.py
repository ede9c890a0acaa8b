"""The saved model read one tensor at a time, for exports that must not hold it all."""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from checkpoint_io import _compat
from checkpoint_io._errors import CheckpointError
from checkpoint_io._format.index import saved_entries
from checkpoint_io._format.manifest import MODEL
from checkpoint_io._read.files import CheckpointFiles, read_checked
from checkpoint_io._read.planner import SafeLoadPlanner, refusal
from checkpoint_io._read.storage import SafeReader


@dataclasses.dataclass(frozen=True)
class SavedModel:
    """A checkpoint's model tensors, described from the index and read on demand.

    Attributes:
        path: The checkpoint directory.
        tensors: Name -> ``(dtype, shape)`` of every model tensor, in the saved model's
            state-dict order (recorded in the manifest; DCP's index order otherwise).
        tied: Groups of names that shared one tensor in the saved model (empty for
            checkpoints written before ties were recorded).
    """

    path: Path
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    tied: tuple[tuple[str, ...], ...]
    _metadata: Metadata = dataclasses.field(repr=False)
    _files: CheckpointFiles = dataclasses.field(repr=False)

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` as a CPU tensor (only its chunks are read).

        Raises:
            KeyError: If the model has no tensor ``name``.
            CheckpointError: If it cannot be read safely.
        """
        dtype, shape = self.tensors[name]
        state = {MODEL: {name: torch.empty(shape, dtype=dtype)}}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                _compat.load_in_process(
                    state, SafeReader(self._files, self._metadata), SafeLoadPlanner()
                )
        except CheckpointError:
            raise
        except (Exception, _compat.CheckpointException) as error:
            raise refusal(error) or CheckpointError(
                f"reading {name!r} from {str(self.path)!r} failed ({error})"
            ) from None
        return state[MODEL][name]


def saved_model(path: str | os.PathLike[str]) -> SavedModel:
    """Describe the model tensors of the checkpoint at ``path`` (offline, one process).

    Reads the manifest and DCP's index (no code runs) and checks every file's size and
    digest (a pass over the files: ``read`` then reads one record at a time, not whole
    files); tensors are read by ``read``.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        CheckpointError: If it is not a readable checkpoint.
    """
    root = Path(os.fspath(path))
    manifest, metadata, files = read_checked(root, verify=True)
    files.check_all()  # digests first: each read below takes only its records
    records = CheckpointFiles(root, manifest, verify=False)
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for key, storage in saved_entries(metadata, MODEL).items():
        if len(key) == 1 and isinstance(storage, TensorStorageMetadata):
            tensors[str(key[0])] = (storage.properties.dtype, tuple(storage.size))
    order = manifest.get("model_keys")  # the model's state-dict order (DCP's index has its own)
    if isinstance(order, list) and sorted(map(str, order)) == sorted(tensors):
        tensors = {str(name): tensors[str(name)] for name in order}
    tied = manifest.get("tied") or []
    if not isinstance(tied, list) or not all(
        isinstance(g, list) and all(isinstance(n, str) and n in tensors for n in g) for g in tied
    ):
        raise CheckpointError(f"{root}'s manifest has a malformed 'tied' list")
    return SavedModel(root, tensors, tuple(tuple(g) for g in tied), metadata, records)
