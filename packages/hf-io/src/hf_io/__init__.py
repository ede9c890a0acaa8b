"""Hugging Face safetensors in (shard-on-read into DDP, FSDP or HSDP) and out.

``load_pretrained`` reads a ``save_pretrained`` directory into a live model, each rank only
its slices; ``save_pretrained`` and ``export_tensors`` write transformers' layout from a live
model (no rank gathers it) or offline, one tensor at a time (checkpoint-io's
``consolidate_checkpoint`` uses it).
"""

from __future__ import annotations

from hf_io._export import export_tensors
from hf_io._load import PretrainedInfo, load_pretrained
from hf_io._names import KeyMap
from hf_io._save import save_pretrained

__all__ = [
    "KeyMap",
    "PretrainedInfo",
    "export_tensors",
    "load_pretrained",
    "save_pretrained",
]
