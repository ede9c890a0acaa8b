"""A model's saved tensors as Hugging Face names them, with ties, and ``key_map``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from dist_core import state_groups
from safe_store import METADATA_KEY

KeyMap = Mapping[str, str] | Callable[[str], str | None]
"""Names in the file -> names in the model (``load_pretrained``), or the reverse
(``save_pretrained``): a mapping (names it lacks are kept) or a callable (``None`` drops one)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """One tensor of the model's state dict, with every name it goes by.

    Attributes:
        names: Its names in state-dict order; more than one for a tie (GPT-2's ``lm_head``).
        tensor: The parameter or persistent buffer (a ``DTensor`` shard under FSDP2).
    """

    names: tuple[str, ...]
    tensor: torch.Tensor

    @property
    def name(self) -> str:
        """The first name, under which a tie is written."""
        return self.names[0]


def model_targets(model: nn.Module) -> list[Target]:
    """The parameters and persistent buffers of ``model`` (unwrapped), ties grouped, in order.

    The names are the plain model's ``state_dict()`` keys: DDP's ``module.`` and
    ``torch.compile``'s ``_orig_mod.`` are peeled; FSDP2 keeps the plain names.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__} ({model!r})")
    return [Target(names, tensor) for names, tensor in state_groups(model)]


def rename(names: Iterable[str], key_map: KeyMap | None, argument: str) -> dict[str, str]:
    """``{new name: old name}`` for ``names`` through ``key_map`` (dropped names left out).

    Raises:
        TypeError: If ``key_map`` is neither a mapping nor a callable, or returns a non-string.
        ValueError: If two names map to one.
    """
    if key_map is not None and not isinstance(key_map, Mapping) and not callable(key_map):
        raise TypeError(
            f"{argument} must be a mapping of names or a callable returning a name (or None "
            f"to drop it), got {type(key_map).__name__} ({key_map!r})"
        )
    renamed: dict[str, str] = {}
    for old in names:
        if key_map is None:
            new: object = old
        elif isinstance(key_map, Mapping):
            new = key_map.get(old, old)
        else:
            new = key_map(old)
        if new is None:
            continue
        if not isinstance(new, str):
            raise TypeError(f"{argument} mapped {old!r} to {new!r}; names are strings")
        if new == METADATA_KEY:
            raise ValueError(
                f"{argument} maps {old!r} to {METADATA_KEY!r}, the key safetensors reserves "
                "for a file's metadata (no reader would find the tensor); map it to another name"
            )
        if new in renamed:
            raise ValueError(
                f"{argument} maps both {renamed[new]!r} and {old!r} to {new!r}; each name must "
                "map to its own"
            )
        renamed[new] = old
    return renamed
