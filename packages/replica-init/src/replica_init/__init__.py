"""Bit-identical model replicas on every rank, whole or sharded, verified."""

from __future__ import annotations

from replica_init._broadcast import BROADCAST_BUCKET_BYTES
from replica_init._build import build_replicated_model_from_scratch, build_structure
from replica_init._drift import DriftReport, replica_drift
from replica_init._fingerprint import model_fingerprint, state_fingerprint
from replica_init._sharded import ShardedModel, build_sharded_model
from replica_init._source import build_replicated_model, check_same_structure, materialize
from replica_init._stream import STREAM_BUCKET_BYTES, stream_bucket_bytes
from replica_init._verify import ReplicaMismatchError, assert_replicas_identical

__all__ = [
    "BROADCAST_BUCKET_BYTES",
    "STREAM_BUCKET_BYTES",
    "DriftReport",
    "ReplicaMismatchError",
    "ShardedModel",
    "assert_replicas_identical",
    "build_replicated_model",
    "build_replicated_model_from_scratch",
    "build_sharded_model",
    "build_structure",
    "check_same_structure",
    "materialize",
    "model_fingerprint",
    "replica_drift",
    "state_fingerprint",
    "stream_bucket_bytes",
]
