"""results.json: the rows' schema and vocabulary, merging ranks, keeping earlier results."""

from __future__ import annotations

from strategy_bench.results._kept import check_out, require_out_dir
from strategy_bench.results._results import (
    MEMORY_KINDS,
    SCHEMA,
    byte_unit,
    environment,
    host_environment,
    merge_ranks,
    read_results,
    write_json_atomic,
    write_results,
)
from strategy_bench.results._rows import (
    FAILED,
    OK,
    OOM,
    describe_failure,
    describe_skipped,
    done_keys,
    failure_row,
    knob_text,
    ok_rows,
    point_key,
)

__all__ = [
    "FAILED",
    "MEMORY_KINDS",
    "OK",
    "OOM",
    "SCHEMA",
    "byte_unit",
    "check_out",
    "describe_failure",
    "describe_skipped",
    "done_keys",
    "environment",
    "failure_row",
    "host_environment",
    "knob_text",
    "merge_ranks",
    "ok_rows",
    "point_key",
    "read_results",
    "require_out_dir",
    "write_json_atomic",
    "write_results",
]
