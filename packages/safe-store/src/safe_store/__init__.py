"""Files that carry no code, read as untrusted input and published whole.

The bottom layer under hf-io and checkpoint-io: a safetensors header checked by the
safetensors library's own rules (with caps) before any data is read; one safetensors file
written as a stream, hashed as it goes (xxh3-128); values as tagged JSON (the codec); and one
atomic publish of a finished directory.
"""

from __future__ import annotations

from safe_store.codec import dumps, loads, strict_json
from safe_store.header import (
    CODES,
    DTYPES,
    MAX_DIMS,
    MAX_ENTRIES,
    MAX_HEADER_BYTES,
    METADATA_KEY,
    Entry,
    Header,
    header_of,
    identity,
    parse_header,
    read_header,
    tensor_of,
)
from safe_store.publish import abandon, begin, check_target, output_dir, publish, staging_dir
from safe_store.writer import ALGORITHM, RECORDS, StreamWriter, record_digest

__all__ = [
    "ALGORITHM",
    "CODES",
    "DTYPES",
    "MAX_DIMS",
    "MAX_ENTRIES",
    "MAX_HEADER_BYTES",
    "METADATA_KEY",
    "RECORDS",
    "Entry",
    "Header",
    "StreamWriter",
    "abandon",
    "begin",
    "check_target",
    "dumps",
    "header_of",
    "identity",
    "loads",
    "output_dir",
    "parse_header",
    "publish",
    "read_header",
    "record_digest",
    "staging_dir",
    "strict_json",
    "tensor_of",
]
