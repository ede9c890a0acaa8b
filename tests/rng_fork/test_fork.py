from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import rng_fork
from dist_core import _devices as dist_devices
from fake_accelerator import FakeAccelerator, patch_device_module
from rng_fork import fork_model_rng, fork_rng


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAccelerator]:
    accelerator = FakeAccelerator(count=4)
    lookups: list[str] = []

    def device_module(device_type: str) -> FakeAccelerator:
        lookups.append(device_type)
        assert device_type == "xpu", f"unexpected device module lookup {device_type!r}"
        return accelerator

    patch_device_module(monkeypatch, device_module)
    monkeypatch.setattr(dist_devices, "accelerator_type", lambda: "xpu")
    accelerator.lookups = lookups  # type: ignore[attr-defined]
    yield accelerator


def test_seeded_stream_equals_fresh_generator() -> None:
    with fork_rng(1234):
        inside = torch.rand(8)
        inside_int = torch.randint(0, 1000, (8,))
    expected_gen = torch.Generator().manual_seed(1234)
    assert torch.equal(inside, torch.rand(8, generator=expected_gen))
    assert torch.equal(inside_int, torch.randint(0, 1000, (8,), generator=expected_gen))


def test_outer_stream_continues_as_if_block_never_ran() -> None:
    torch.manual_seed(7)
    first = torch.rand(3)
    with fork_rng(99):
        torch.rand(100)
    second = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(torch.rand(6), torch.cat([first, second]))


def test_unseeded_fork_restores() -> None:
    before = torch.get_rng_state()
    with fork_rng():
        torch.randn(10)
    assert torch.equal(torch.get_rng_state(), before)


def test_restores_on_exception() -> None:
    before = torch.get_rng_state()
    with pytest.raises(KeyError, match="boom"), fork_rng(3):
        torch.rand(5)
        raise KeyError("boom")
    assert torch.equal(torch.get_rng_state(), before)


def test_nesting() -> None:
    before = torch.get_rng_state()
    with fork_rng(1):
        a = torch.rand(2)
        mid = torch.get_rng_state()
        with fork_rng(2):
            assert torch.equal(
                torch.rand(2), torch.rand(2, generator=torch.Generator().manual_seed(2))
            )
        assert torch.equal(torch.get_rng_state(), mid)
        b = torch.rand(2)
    assert torch.equal(torch.cat([a, b]), torch.rand(4, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize(
    ("seed", "error", "fragment"),
    [
        (True, TypeError, "seed must be an int, got bool (True)"),
        (1.5, TypeError, "got float (1.5)"),
        ("42", TypeError, "got str ('42')"),
        (2**64, ValueError, f"got {2**64}"),
        (-(2**63) - 1, ValueError, "the range torch.manual_seed accepts"),
    ],
)
def test_bad_seed_changes_nothing(seed: object, error: type[Exception], fragment: str) -> None:
    random.seed(11)
    np.random.seed(11)
    torch_before, py_before, np_before = (
        torch.get_rng_state(),
        random.getstate(),
        np.random.get_state(),
    )
    with pytest.raises(error) as info, fork_rng(seed, python=True, numpy=True):  # type: ignore[arg-type]
        pytest.fail("the block must not run")
    assert fragment in str(info.value)
    assert torch.equal(torch.get_rng_state(), torch_before)
    assert random.getstate() == py_before
    assert np.array_equal(np.random.get_state()[1], np_before[1])


def test_extreme_seeds_are_accepted() -> None:
    for seed in (0, 2**64 - 1, -(2**63), np.int64(5)):
        with fork_rng(seed, python=True, numpy=True):  # type: ignore[arg-type]
            torch.rand(1)


def test_fork_model_rng_requires_seed() -> None:
    with pytest.raises(TypeError, match=r"seed must be an int, got NoneType \(None\)"):
        fork_model_rng("cpu", None)  # type: ignore[arg-type]
    with fork_model_rng("cpu", 5):
        value = torch.rand(1)
    assert torch.equal(value, torch.rand(1, generator=torch.Generator().manual_seed(5)))


def test_python_and_numpy_forks() -> None:
    random.seed(1)
    np.random.seed(1)
    py_expected, np_expected = random.Random(1).random(), np.random.RandomState(1).rand()
    with fork_rng(77, python=True, numpy=True):
        assert random.random() == random.Random(77).random()
        assert np.random.rand() == np.random.RandomState(77).rand()
    assert random.random() == py_expected
    assert np.random.rand() == np_expected


def test_global_streams_untouched_unless_asked() -> None:
    random.seed(5)
    np.random.seed(5)
    with fork_rng(1):
        pass
    assert random.random() == random.Random(5).random()
    assert np.random.rand() == np.random.RandomState(5).rand()


def test_large_seed_reaches_numpy_as_words() -> None:
    with fork_rng(2**40 + 3, numpy=True):
        value = np.random.rand()
    assert value == np.random.RandomState([3, 2**8]).rand()


def test_device_dispatch_touches_only_named_device(fake: FakeAccelerator) -> None:
    before = fake.states()
    with fork_rng(42, device="xpu:2"):
        assert torch.equal(
            fake.generators[2].get_state(), torch.Generator().manual_seed(42).get_state()
        )
        for index in (0, 1, 3):
            assert torch.equal(fake.generators[index].get_state(), before[index])
        fake.generators[2].manual_seed(0)  # the block consumes/changes the stream
    assert all(torch.equal(a, b) for a, b in zip(fake.states(), before, strict=True))
    assert {index for _, index in fake.calls} == {2}
    assert fake.current == 0


def test_int_device_is_current_accelerator_index(fake: FakeAccelerator) -> None:
    with fork_rng(1, device=3):
        pass
    assert {index for _, index in fake.calls} == {3}


def test_bare_type_uses_current_device(fake: FakeAccelerator) -> None:
    fake.current = 1
    with fork_rng(1, device=torch.device("xpu")):
        pass
    assert {index for _, index in fake.calls} == {1}


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu"), "meta"])
def test_cpu_device_never_looks_up_an_accelerator(fake: FakeAccelerator, device: object) -> None:
    with fork_rng(1, device=device):  # type: ignore[arg-type]
        pass
    assert fake.lookups == []  # type: ignore[attr-defined]
    assert fake.calls == []


def test_unavailable_or_missing_device_fails_before_changes(fake: FakeAccelerator) -> None:
    before = torch.get_rng_state()
    with (
        pytest.raises(
            RuntimeError, match=r"only 4 xpu device\(s\) are visible; use an index in 0..3"
        ),
        fork_rng(1, device="xpu:9"),
    ):
        pass
    fake.available = False
    with (
        pytest.raises(RuntimeError, match="xpu is not available in this process"),
        fork_rng(1, device="xpu:0"),
    ):
        pass
    assert fake.calls == []
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize(
    ("device", "error", "fragment"),
    [
        ("gpu:0", ValueError, "device='gpu:0' is not a device string"),
        (-1, ValueError, "device index must be >= 0, got -1"),
        (1.0, TypeError, "got float (1.0)"),
        (True, TypeError, "got bool (True)"),
    ],
)
def test_bad_device_argument(device: object, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error) as info, fork_rng(1, device=device):  # type: ignore[arg-type]
        pass
    assert fragment in str(info.value)


def test_exports() -> None:
    for name in rng_fork.__all__:
        assert hasattr(rng_fork, name)


@pytest.mark.cuda
def test_cuda_fork_seeds_and_restores_only_its_device() -> None:
    before = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    with fork_rng(5, device="cuda:0"):
        inside = torch.rand(4, device="cuda:0")
    expected = torch.rand(4, device="cuda:0", generator=torch.Generator("cuda:0").manual_seed(5))
    assert torch.equal(inside, expected)
    after = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.cuda
def test_cpu_fork_does_not_initialize_cuda() -> None:
    code = (
        "import torch, rng_fork\n"
        "with rng_fork.fork_rng(1, device='cpu'): torch.rand(1)\n"
        "with rng_fork.fork_rng(1): torch.rand(1)\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
