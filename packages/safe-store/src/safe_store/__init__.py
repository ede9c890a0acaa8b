"""Files that carry no code, read as untrusted input and published whole.

The bottom layer under hf-io: a safetensors header checked by the safetensors library's own
rules (with caps) before any data is read, and one atomic publish of a finished directory.
"""

from __future__ import annotations

from safe_store.header import (
    DTYPES,
    MAX_DIMS,
    MAX_HEADER_BYTES,
    METADATA_KEY,
    Entry,
    Header,
    identity,
    read_header,
)
from safe_store.publish import abandon, begin, check_target, output_dir, publish, staging_dir

__all__ = [
    "DTYPES",
    "MAX_DIMS",
    "MAX_HEADER_BYTES",
    "METADATA_KEY",
    "Entry",
    "Header",
    "abandon",
    "begin",
    "check_target",
    "identity",
    "output_dir",
    "publish",
    "read_header",
    "staging_dir",
]
