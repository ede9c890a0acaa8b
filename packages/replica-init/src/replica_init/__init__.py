"""Bit-identical full model replicas on every rank, verified."""

from __future__ import annotations

from replica_init._build import build_replicated_model_from_scratch
from replica_init._fingerprint import model_fingerprint, state_fingerprint
from replica_init._source import build_replicated_model
from replica_init._verify import ReplicaMismatchError, assert_replicas_identical

__all__ = [
    "ReplicaMismatchError",
    "assert_replicas_identical",
    "build_replicated_model",
    "build_replicated_model_from_scratch",
    "model_fingerprint",
    "state_fingerprint",
]
