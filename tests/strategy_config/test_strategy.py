from __future__ import annotations

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import pytest

import strategy_config as sc
from strategy_config import (
    DEFAULT_DISTRIBUTED_STRATEGY,
    SUPPORTED_DISTRIBUTED_STRATEGIES,
    is_ddp_strategy,
    normalize_distributed_strategy,
)


def test_constants() -> None:
    assert SUPPORTED_DISTRIBUTED_STRATEGIES == frozenset({"ddp", "fsdp", "hsdp"})
    assert DEFAULT_DISTRIBUTED_STRATEGY == "fsdp"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "fsdp"),
        ("", "fsdp"),
        ("   ", "fsdp"),
        ("ddp", "ddp"),
        (" DDP ", "ddp"),
        ("FSDP", "fsdp"),
        ("\tfsdp\n", "fsdp"),
    ],
)
def test_normalize(value: str | None, expected: str) -> None:
    assert normalize_distributed_strategy(value) == expected


def test_unknown_strategy_message_and_hint() -> None:
    with pytest.raises(ValueError, match=r"did you mean 'ddp'\?") as info:
        normalize_distributed_strategy("  DPP ")
    assert str(info.value).startswith(
        "training.distributed.strategy must be one of {ddp, fsdp, hsdp}, got 'dpp'"
    )


def test_unknown_strategy_without_close_match_has_no_hint() -> None:
    with pytest.raises(ValueError) as info:
        normalize_distributed_strategy("deepspeed")
    assert str(info.value) == (
        "training.distributed.strategy must be one of {ddp, fsdp, hsdp}, got 'deepspeed'"
    )


@pytest.mark.parametrize("value", [1, True, ["ddp"], b"ddp"])
def test_non_string_is_type_error_naming_type(value: object) -> None:
    with pytest.raises(TypeError, match=type(value).__name__):
        normalize_distributed_strategy(value)  # type: ignore[arg-type]


@dataclasses.dataclass
class _Distributed:
    strategy: str | None = None


@dataclasses.dataclass
class _Training:
    distributed: _Distributed | None = None


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (SimpleNamespace(distributed=SimpleNamespace(strategy="ddp")), True),
        (SimpleNamespace(distributed=SimpleNamespace(strategy="fsdp")), False),
        (SimpleNamespace(distributed=SimpleNamespace()), False),
        (SimpleNamespace(), False),
        (_Training(_Distributed(" DDP")), True),
        (_Training(), False),
        ({"distributed": {"strategy": "ddp"}}, True),
        ({"distributed": {}}, False),
        ({}, False),
        ({"distributed": None}, False),
        (None, False),
    ],
)
def test_is_ddp_strategy(config: object, expected: bool) -> None:
    assert is_ddp_strategy(config) is expected


def test_is_ddp_strategy_propagates_bad_values() -> None:
    with pytest.raises(ValueError, match="got 'dddp'"):
        is_ddp_strategy({"distributed": {"strategy": "dddp"}})


def test_all_names_are_exported() -> None:
    for name in sc.__all__:
        assert hasattr(sc, name), name


def test_import_does_not_import_torch() -> None:
    code = (
        "import sys, strategy_config\n"
        "strategy_config.load_distributed_config({'distributed': {'strategy': 'ddp'}})\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
