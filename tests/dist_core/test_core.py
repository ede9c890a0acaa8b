"""dist-core: the shared rules, tested on a one-rank gloo group where a group is needed."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from dist_core import (
    agree,
    bound_device,
    check_forward_methods,
    check_wrap_preconditions,
    fsdp_modules,
    log_rank0,
    rank,
    require_current_device,
    require_device_index,
    resolve_device,
    strategy_of,
    unwrap_compiled,
    unwrap_model,
    world_size,
)
from dist_harness import fresh_interpreter
from fake_accelerator import FakeAccelerator, patch_device_module


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.count = 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def sample(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)


class TestResolveDevice:
    def test_forms(self) -> None:
        assert resolve_device(None) is None
        assert resolve_device("cpu") == torch.device("cpu")
        cuda = torch.device("cuda", 1)
        assert resolve_device(cuda) is cuda
        # An int is an index of the current accelerator: CUDA on this (CPU-only) build, as in
        # torch.device(1) and DistributedDataParallel(device_ids=[1]).
        assert resolve_device(1) == torch.device("cuda", 1)

    @pytest.mark.parametrize(
        ("device", "error", "match"),
        [
            (1.5, TypeError, r"device must be a torch.device, .* got float \(1.5\)"),
            (True, TypeError, "got bool"),
            (-1, ValueError, "device index must be >= 0, got -1"),
            ("gpu0", ValueError, "device='gpu0' is not a device string"),
        ],
    )
    def test_bad(self, device: object, error: type[Exception], match: str) -> None:
        with pytest.raises(error, match=match):
            resolve_device(device)  # type: ignore[arg-type]

    def test_argument_is_named(self) -> None:
        with pytest.raises(TypeError, match="^target must be"):
            resolve_device([0], argument="target")  # type: ignore[arg-type]

    def test_concrete_index(self) -> None:
        require_device_index(torch.device("cuda", 0), caller="f")
        require_device_index(torch.device("cpu"), caller="f")
        with pytest.raises(ValueError, match="f requires a concrete local device index: .*'cuda'"):
            require_device_index(torch.device("cuda"), caller="f")


class TestForwardMethods:
    def test_valid(self) -> None:
        assert check_forward_methods(Two(), ["sample"]) == ("sample",)
        assert check_forward_methods(Two(), iter(())) == ()

    @pytest.mark.parametrize(
        ("name", "error", "match"),
        [
            (3, TypeError, "names must be strings, got int"),
            ("count", TypeError, "Two.count is a int, not a method"),
            ("blocks", TypeError, "Two.blocks is a ModuleList, not a method"),
            ("nope", AttributeError, "Two has no attribute 'nope'"),
            ("forward", ValueError, "name a method other than forward"),
            ("state_dict", ValueError, "W has its own 'state_dict'"),
        ],
    )
    def test_one_type_per_mistake(self, name: object, error: type[Exception], match: str) -> None:
        with pytest.raises(error, match=match):
            check_forward_methods(Two(), [name], reserved={"state_dict"}, wrapper="W")


def test_no_process_group_messages() -> None:
    out = fresh_interpreter(
        """
        import torch
        from dist_core import check_wrap_preconditions, rank, world_size
        print(rank(), world_size())
        try:
            check_wrap_preconditions(torch.nn.Linear(2, 2), "cpu", wrapper="my_wrap")
        except RuntimeError as error:
            print(error)
        """
    )
    first, second = out.splitlines()[:2]
    assert first == "0 1"
    assert second.startswith("my_wrap requires an initialized process group; call ")


@pytest.mark.usefixtures("process_group")
class TestWithGroup:
    def test_rank_and_size(self) -> None:
        assert (rank(), world_size()) == (0, 1)

    def test_preconditions_order(self) -> None:
        with pytest.raises(TypeError, match="w needs an nn.Module, got str"):
            check_wrap_preconditions("model", "cpu", wrapper="w")
        frozen = nn.Linear(2, 2).requires_grad_(False)
        with pytest.raises(ValueError, match="w needs at least one parameter"):
            check_wrap_preconditions(frozen, "cuda", wrapper="w")
        with pytest.raises(ValueError, match="requires a concrete local device index"):
            check_wrap_preconditions(nn.Linear(2, 2), "cuda", wrapper="w")
        with pytest.raises(ValueError, match="parameter 'weight' of Linear is on cpu"):
            check_wrap_preconditions(nn.Linear(2, 2), "meta", wrapper="w")
        assert check_wrap_preconditions(nn.Linear(2, 2), "cpu", wrapper="w").type == "cpu"
        on_meta = nn.Linear(2, 2, device="meta")
        with pytest.raises(ValueError, match="parameter 'weight' of Linear is on meta"):
            check_wrap_preconditions(on_meta, "cpu", wrapper="w")
        # A wrapper that shards unmaterialized models (FSDP2's deferred init) accepts it.
        assert check_wrap_preconditions(on_meta, "cpu", wrapper="w", allow_meta=True).type == "cpu"
        # Host parameters for an accelerator: refused for DDP (a replica must be on its
        # device), accepted where the wrapper moves each unit itself (FSDP2 shards).
        on_host = nn.Linear(2, 2)
        with pytest.raises(ValueError, match="parameter 'weight' of Linear is on cpu, but "):
            check_wrap_preconditions(on_host, "cuda:0", wrapper="w")
        accepted = check_wrap_preconditions(on_host, "cuda:0", wrapper="w", allow_host=True)
        assert accepted == torch.device("cuda", 0)
        with pytest.raises(ValueError, match="parameter 'weight' of Linear is on meta"):
            check_wrap_preconditions(on_meta, "cuda:0", wrapper="w", allow_host=True)

    def test_agree_gathers_on_the_device_the_group_is_bound_to(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Under NCCL an object gather stages on the current device: agree enters the group's
        bound device (init_process_group(device_id=...)) around it, whatever is current."""
        import torch.distributed as dist

        fake = FakeAccelerator(4)
        patch_device_module(monkeypatch, lambda kind: fake)
        seen: list[int] = []
        gather = dist.all_gather_object

        def recording(*args: object, **kwargs: object) -> None:
            seen.append(fake.current)
            gather(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(dist, "all_gather_object", recording)
        world = dist.group.WORLD
        assert world is not None and bound_device() is None
        assert agree(None, "x", share=5) == [5] and seen == [0]
        world.bound_device_id = torch.device("cuda", 3)
        try:
            assert bound_device() == torch.device("cuda", 3)
            assert agree(None, "x", share=6) == [6] and seen == [0, 3]
        finally:
            world.bound_device_id = None
        assert fake.current == 0

    # Importing dynamo for torch.compile warns about torch.jit in torch 2.13.
    @pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
    def test_strategy_of_and_unwrap(self) -> None:
        plain = Two()
        assert strategy_of(plain) == "none"
        assert unwrap_model(plain) is plain
        assert fsdp_modules(plain) == []

        ddp = DistributedDataParallel(Two())
        assert strategy_of(ddp) == "ddp"
        assert unwrap_model(ddp) is ddp.module
        compiled = torch.compile(
            ddp, backend="eager"
        )  # the wrapper only; nothing is compiled until called
        assert strategy_of(compiled) == "ddp"  # type: ignore[arg-type]
        assert unwrap_model(compiled) is ddp.module  # type: ignore[arg-type]
        assert unwrap_compiled(compiled) is ddp  # type: ignore[arg-type]
        assert unwrap_compiled(ddp) is ddp

        sharded = Two()
        fully_shard(sharded.blocks[0])
        fully_shard(sharded)
        assert strategy_of(sharded) == "fsdp"
        assert unwrap_model(sharded) is sharded
        assert fsdp_modules(sharded) == [sharded, sharded.blocks[0]]

        inner = Two()
        fully_shard(inner.blocks[1])  # sharded below the root only: still FSDP
        assert strategy_of(inner) == "fsdp"


def test_log_rank0_logs_without_group(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("dist_core.test")
    with caplog.at_level(logging.INFO, logger="dist_core.test"):
        log_rank0(logger, logging.INFO, "hello %s", "there")
    assert [r.getMessage() for r in caplog.records] == ["hello there"]


def test_require_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeAccelerator(count=4)
    fake.current = 2
    patch_device_module(monkeypatch, lambda _kind: fake)
    require_current_device(torch.device("cuda", 2), caller="f")
    require_current_device(torch.device("cpu"), caller="f")
    require_current_device(torch.device("meta"), caller="f")
    with pytest.raises(ValueError) as info:
        require_current_device(torch.device("cuda", 3), caller="wrap_module_fsdp")
    assert str(info.value).startswith(
        "wrap_module_fsdp: device='cuda:3' is not the current cuda device (cuda:2); "
        "collectives stage their buffers on the current device, so call "
        "torch.cuda.set_device(3) first"
    )


class _FakeAllocator:
    """The CUDA allocator's counters for one device: what MemoryPeak reads and resets."""

    def __init__(self) -> None:
        self.allocated = 0
        self.peak = 0

    def alloc(self, size: int) -> None:
        self.allocated += size
        self.peak = max(self.peak, self.allocated)

    def free(self, size: int) -> None:
        self.allocated -= size

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def reset(_device: object = None) -> None:
            self.peak = self.allocated

        for name, value in {
            "synchronize": lambda _device=None: None,
            "reset_peak_memory_stats": reset,
            "memory_allocated": lambda _device=None: self.allocated,
            "memory_reserved": lambda _device=None: self.allocated,
            "max_memory_allocated": lambda _device=None: self.peak,
            "max_memory_reserved": lambda _device=None: self.peak,
            "current_device": lambda: 0,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)


def test_nested_memory_peaks_do_not_erase_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """An outer reading sees the peak of every nested stage, not only the last one's."""
    from dist_core import MemoryPeak

    allocator = _FakeAllocator()
    allocator.install(monkeypatch)
    device = torch.device("cuda", 0)
    allocator.alloc(100)
    with MemoryPeak(device, host=False) as outer:
        with MemoryPeak(device, host=False) as first:  # a stage that peaks at 300
            allocator.alloc(200)
            allocator.free(200)
        with MemoryPeak(device, host=False) as second:  # a later, smaller stage
            with MemoryPeak(device, host=False) as inner:
                allocator.alloc(50)
            allocator.free(50)
        allocator.alloc(10)
    assert (outer.device_start, outer.device_peak) == (100, 300)
    assert (first.device_peak, second.device_peak, inner.device_peak) == (300, 150, 150)
    assert outer.device_reserved_peak == 300
    with MemoryPeak(device, host=False) as after:  # closed readings are no longer updated
        allocator.alloc(1000)
    assert after.device_peak == 1110 and outer.device_peak == 300


def test_init_distributed_from_the_environment() -> None:
    """gloo on a CPU host, this rank's device back, a per-round store prefix, one call only;
    a missing launcher variable and bad arguments are named before anything starts."""
    out = fresh_interpreter(
        """
import datetime, os, socket
import torch.distributed as dist
from dist_core import DEFAULT_TIMEOUT, init_distributed
try:
    init_distributed()
except ValueError as error:
    print("missing:", error)
for bad in ({"timeout": 0}, {"timeout": "1"}, {"backend": 3}):
    try:
        init_distributed(**bad)
    except (TypeError, ValueError) as error:
        print("bad:", type(error).__name__, error)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                  LOCAL_RANK="0", TORCHELASTIC_RESTART_COUNT="3")
device = init_distributed(timeout=30)
print("device:", device, dist.get_backend(), dist.get_world_size())
store = dist.distributed_c10d._get_default_store()  # default_pg's prefix over ours
store.set("probe", "1")
raw = store._underlying_non_prefix_store
print("prefixed:", sorted({key.split("/")[0] for key in raw.list_keys()}))
try:
    init_distributed()
except RuntimeError as error:
    print("again:", error)
dist.barrier()
dist.destroy_process_group()
print("default timeout:", DEFAULT_TIMEOUT)
"""
    )
    assert (
        "missing: init_distributed: the environment lacks MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; start the processes with torchrun"
        in out
    )
    assert "bad: ValueError timeout must be positive, got 0 s" in out
    assert "bad: TypeError timeout must be a datetime.timedelta or seconds, got str" in out
    assert "bad: TypeError backend must be a string or None, got int" in out
    assert "device: cpu gloo 1" in out
    # every key of this round under its prefix, beside the rounds' counter
    assert "prefixed: ['dist_core', 'world-1-round-0']" in out
    assert (
        "again: init_distributed: the default process group is already initialized (backend 'gloo', 1 ranks)"
        in out
    )
    assert "default timeout: 0:10:00" in out


def test_compute_device_comes_from_the_mesh_not_an_offloaded_shard() -> None:
    """FSDP2's CPU offload keeps every shard in host memory under a CUDA mesh: the model
    computes (and holds its RNG state) on this rank's GPU of the mesh, not on the shard's
    device (checkpoints saved only the CPU generator). Run without CUDA over torch's fake
    process group; DDP and a plain model keep their own rules."""
    out = fresh_interpreter(
        """
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.testing._internal.distributed.fake_pg import FakeStore
from dist_core import compute_device
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
torch.cuda.current_device = lambda: 3

def sharded(mesh, placements, local):  # a DTensor over a mesh this CPU build cannot use
    meta = TensorMeta(torch.Size([4, *local.shape[1:]]), local.stride(), local.dtype)
    spec = DTensorSpec(mesh, placements, meta)
    return nn.Parameter(DTensor(local, spec, requires_grad=False), requires_grad=False)

mesh = DeviceMesh("cuda", torch.arange(4).view(2, 2), mesh_dim_names=("replicate", "shard"),
                  _init_backend=False)
model = nn.Module()
model.weight = sharded(mesh, (Replicate(), Shard(0)), torch.zeros(2, 3))
print("offloaded", model.weight.to_local().device, compute_device(model))
cpu_mesh = DeviceMesh("cpu", torch.arange(4), _init_backend=False)
model.weight = sharded(cpu_mesh, (Shard(0),), torch.zeros(1, 3))
print("cpu", compute_device(model), compute_device(nn.Linear(1, 1)), compute_device(nn.Module()))
dist.destroy_process_group()
"""
    )
    assert "offloaded cpu cuda:3" in out
    assert "cpu cpu cpu cpu" in out


def test_a_collective_on_nccl_takes_the_current_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device rule replica_drift and the counts rely on, run without CUDA: a backend
    naming NCCL takes this rank's current GPU (host shards under offload are copied there:
    an NCCL group refuses host tensors), gloo the host."""
    import torch.distributed as dist

    from dist_core import collective_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    for backend, expected in (
        ("nccl", "cuda:2"),
        ("cpu:gloo,cuda:NCCL", "cuda:2"),
        ("gloo", "cpu"),
    ):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert collective_device() == torch.device(expected), backend
