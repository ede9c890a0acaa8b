from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import replica_init
from dist_harness import fresh_interpreter
from replica_init import (
    build_replicated_model,
    build_replicated_model_from_scratch,
    model_fingerprint,
)
from toy_models import ToyNet

PARAMS = {"vocab": 32, "width": 8, "depth": 2}


def _bare_recipe(dtype: torch.dtype, seed: int) -> nn.Module:
    previous = torch.get_default_dtype()
    try:
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        return ToyNet(**PARAMS).to("cpu")
    finally:
        torch.set_default_dtype(previous)


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bit_identical_to_bare_recipe(dtype: torch.dtype) -> None:
    ours = build_replicated_model_from_scratch(
        ToyNet, PARAMS, device="cpu", default_dtype=dtype, seed=1234
    )
    reference = _bare_recipe(dtype, 1234)
    ours_t, ref_t = _tensors(ours), _tensors(reference)
    assert ours_t.keys() == ref_t.keys()
    for name, tensor in ours_t.items():
        assert (
            tensor.dtype
            == ref_t[name].dtype
            == (dtype if tensor.is_floating_point() else tensor.dtype)
        )
        assert torch.equal(tensor.view(torch.uint8), ref_t[name].view(torch.uint8)), name
    assert model_fingerprint(ours) == model_fingerprint(reference)


def test_streams_and_default_dtype_unchanged() -> None:
    torch.manual_seed(9)
    random.seed(9)
    rng, py, dtype = torch.get_rng_state(), random.getstate(), torch.get_default_dtype()
    build_replicated_model_from_scratch(
        ToyNet, PARAMS, device=torch.device("cpu"), default_dtype=torch.float64, seed=1
    )
    assert torch.equal(torch.get_rng_state(), rng)
    assert random.getstate() == py
    assert torch.get_default_dtype() == dtype


class _Exploding(nn.Module):
    error = LookupError("constructor failed")

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        raise self.error


def test_failing_constructor_propagates_unchanged_and_restores_state() -> None:
    rng, dtype = torch.get_rng_state(), torch.get_default_dtype()
    with pytest.raises(LookupError) as info:
        build_replicated_model_from_scratch(
            _Exploding, None, device="cpu", default_dtype=torch.float64, seed=1
        )
    assert info.value is _Exploding.error
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.get_default_dtype() == dtype


def test_factory_and_outer_default_device() -> None:
    def factory(width: int) -> nn.Module:
        return nn.Linear(width, width)

    with torch.device("meta"):
        model = build_replicated_model_from_scratch(
            factory, {"width": 3}, device="cpu", default_dtype=torch.float32, seed=5
        )
    torch.manual_seed(5)
    assert model.weight.device.type == "cpu"
    assert torch.equal(model.weight, nn.Linear(3, 3).weight)


class _Counting(nn.Module):
    calls = 0

    def __init__(self, width: int = 2) -> None:
        super().__init__()
        type(self).calls += 1
        self.lin = nn.Linear(width, width)


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        (
            {"model_cls": 3},
            TypeError,
            "model_cls must be an nn.Module class or a factory returning one, got int",
        ),
        (
            {"init_params": [("width", 2)]},
            TypeError,
            "init_params must be a mapping of keyword arguments or None, got list",
        ),
        ({"init_params": {1: 2}}, TypeError, "init_params keys must be strings, got [1]"),
        (
            {"init_params": {"widht": 2}},
            TypeError,
            "init_params do not fit _Counting: got an unexpected keyword argument 'widht'; got keys ['widht'], the constructor takes (width)",
        ),
        (
            {"default_dtype": "float32"},
            TypeError,
            "default_dtype must be a torch.dtype such as torch.float32, got str",
        ),
        (
            {"default_dtype": torch.int64},
            ValueError,
            "default_dtype must be a floating dtype such as torch.float32, got torch.int64",
        ),
        ({"default_dtype": torch.complex64}, ValueError, "got torch.complex64"),
        ({"seed": 1.0}, TypeError, "seed must be an int, got float (1.0)"),
        ({"seed": False}, TypeError, "got bool"),
        (
            {"device": 1.5},
            TypeError,
            "device must be a torch.device, a string such as 'cuda:0', or an int index of the current accelerator, got float",
        ),
        ({"device": "tpu9"}, ValueError, "device='tpu9' is not a device string"),
    ],
)
def test_bad_arguments_fail_before_construction(
    kwargs: dict[str, object], error: type[Exception], fragment: str
) -> None:
    arguments: dict[str, object] = {
        "model_cls": _Counting,
        "init_params": {"width": 2},
        "device": "cpu",
        "default_dtype": torch.float32,
        "seed": 0,
        **kwargs,
    }
    model_cls, init_params = arguments.pop("model_cls"), arguments.pop("init_params")
    rng, dtype = torch.get_rng_state(), torch.get_default_dtype()
    before = _Counting.calls
    with pytest.raises(error) as info:
        build_replicated_model_from_scratch(model_cls, init_params, **arguments)  # type: ignore[arg-type]
    assert fragment in str(info.value)
    assert _Counting.calls == before
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.get_default_dtype() == dtype


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_unavailable_device_fails_before_construction() -> None:
    before = _Counting.calls
    with pytest.raises(
        RuntimeError, match="device='cuda:0': cuda is not available in this process"
    ):
        build_replicated_model_from_scratch(
            _Counting, None, device=0, default_dtype=torch.float32, seed=0
        )
    assert _Counting.calls == before


def test_factory_returning_non_module() -> None:
    with pytest.raises(TypeError, match="returned dict, not an nn.Module"):
        build_replicated_model_from_scratch(
            lambda: {"w": 1},
            None,
            device="cpu",
            default_dtype=torch.float32,
            seed=0,  # type: ignore[arg-type,return-value]
        )


def test_source_validation_and_uninitialized_group() -> None:
    with pytest.raises(ValueError, match="source must be one of \\{local, rank0\\}, got 'rank1'"):
        build_replicated_model(
            ToyNet, None, device="cpu", default_dtype=torch.float32, seed=0, source="rank1"
        )
    with pytest.raises(
        RuntimeError, match="source='rank0'\\) requires an initialized process group"
    ):
        build_replicated_model(
            ToyNet, None, device="cpu", default_dtype=torch.float32, seed=0, source="rank0"
        )


def test_local_source_is_the_scratch_build() -> None:
    a = build_replicated_model(ToyNet, PARAMS, device="cpu", default_dtype=torch.float32, seed=2)
    b = build_replicated_model_from_scratch(
        ToyNet, PARAMS, device="cpu", default_dtype=torch.float32, seed=2
    )
    assert model_fingerprint(a) == model_fingerprint(b)


def test_exports() -> None:
    for name in replica_init.__all__:
        assert hasattr(replica_init, name)


@pytest.mark.cuda
def test_cuda_parity() -> None:
    ours = build_replicated_model_from_scratch(
        ToyNet, PARAMS, device="cuda:0", default_dtype=torch.float32, seed=7
    )
    torch.manual_seed(7)
    reference = ToyNet(**PARAMS).to("cuda:0")
    assert ours.embed.weight.device.type == "cuda"
    assert model_fingerprint(ours) == model_fingerprint(reference)


def test_rank0_source_refuses_a_device_that_is_not_current() -> None:
    """NCCL's object collectives stage on the current device: cuda:1 needs set_device(1)."""
    out = fresh_interpreter(
        """
        import types
        import torch
        import torch.distributed as dist
        from replica_init import build_replicated_model

        fake = types.SimpleNamespace(current_device=lambda: 0)
        torch.get_device_module = lambda device=None: fake
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            build_replicated_model(
                torch.nn.Linear, {"in_features": 2, "out_features": 2}, device="cuda:1",
                default_dtype=torch.float32, seed=0, source="rank0",
            )
        except ValueError as error:
            print(error)
        dist.destroy_process_group()
        """
    )
    assert "build_replicated_model: device='cuda:1' is not the current cuda device (cuda:0)" in out
    assert "torch.cuda.set_device(1) first" in out


def test_stream_bucket_bound_keeps_shards_plus_bucket_below_the_model() -> None:
    mib = 2**20
    assert replica_init.stream_bucket_bytes(10 * 2**30, 2) == replica_init.STREAM_BUCKET_BYTES
    assert replica_init.stream_bucket_bytes(8 * mib, 2) == 2 * mib  # half of one rank's share
    assert replica_init.stream_bucket_bytes(8 * mib, 4) == mib
    assert replica_init.stream_bucket_bytes(0, 1) == 1


@pytest.mark.usefixtures("process_group")
def test_the_stream_at_world_size_1_copies_nothing() -> None:
    """Rank 0's shards were cut from the tensors it would send: at one rank there is nothing
    to stream (it copied the whole model host-to-device, bucket by bucket, for nothing)."""
    from replica_init._stream import stream_from_rank0

    target = torch.zeros(4)
    stream_from_rank0([("w", target)], None, torch.device("cpu"))  # no source tensors needed
    assert torch.equal(target, torch.zeros(4))


def test_build_structure_puts_parameters_on_meta_and_keeps_buffers() -> None:
    from replica_init import build_structure

    class WithTable(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 3)
            self.proj.weight.tagged = "kept"  # type: ignore[attr-defined]
            self.register_buffer("table", torch.arange(4.0) * 2, persistent=False)

    state = torch.random.get_rng_state()
    model = build_structure(WithTable, {}, torch.float32)
    assert all(p.is_meta for p in model.parameters())
    assert model.proj.weight.tagged == "kept"  # type: ignore[attr-defined]
    assert torch.equal(model.table, torch.arange(4.0) * 2)
    assert torch.equal(torch.random.get_rng_state(), state)  # no stream consumed
    assert not torch.nn.Linear(2, 2).weight.is_meta  # the hook is gone

    class Normed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.utils.spectral_norm(torch.nn.Linear(4, 3))

    with pytest.raises(ValueError, match="computes the buffers \\['proj.weight_u'"):
        build_structure(Normed, {}, torch.float32)
