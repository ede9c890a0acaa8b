"""``full_state_dict``: the whole model state of a live (wrapped) model, copied."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from checkpoint_io._state.model import model_state
from dist_core import is_distributed, local_tensor, unwrap_model


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The canonical full state dict as plain CPU tensors, under any strategy (collective).

    Keys are the plain model's ``state_dict()`` keys; FSDP2 shards are gathered. Use it for
    ``save_pretrained``, evaluation and export.

    Args:
        model: Plain, DDP, FSDP2 or compiled.
        rank0_only: Only rank 0 receives the tensors (the others get ``{}``), so the other
            ranks need no host memory for them.

    Returns:
        ``name -> CPU tensor``, never sharing storage with the model (a later step does not
        change it, whatever the device).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not is_distributed():
        state = model_state(model)
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
        state = get_model_state_dict(model, options=options)  # type: ignore[assignment]
    # Never an alias of the model's own storage (a DDP or plain model on the CPU): the
    # result is a snapshot, on the CPU as on CUDA, which training does not change.
    live = {_storage(t) for t in unwrap_model(model).state_dict().values()}
    return {k: _snapshot(v, live) for k, v in state.items()}


def _snapshot(tensor: torch.Tensor, live: set[int]) -> torch.Tensor:
    copy = tensor.detach().cpu()
    return copy.clone() if _storage(copy) in live else copy


def _storage(tensor: torch.Tensor) -> int:
    return int(local_tensor(tensor).untyped_storage().data_ptr())
