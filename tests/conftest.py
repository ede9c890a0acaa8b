"""Shared pytest configuration: skip ``cuda``-marked tests where no CUDA device is visible.

This file must not import torch at module level: strategy-config's tests run without torch.
"""

from __future__ import annotations

import importlib.util

import pytest


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("cuda" in item.keywords for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def process_group() -> None:
    """A one-rank gloo process group in the test process, shared by every test that asks."""
    from dist_harness import single_rank_group

    single_rank_group()
