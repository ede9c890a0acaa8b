"""grad-sync: accumulation and clipping under DDP, FSDP2 and one process."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import grad_sync_workers as workers
from dist_harness import run_ranks, two_rank_backends
from grad_sync import clip_grad_norm, no_sync


@pytest.fixture(scope="module", params=two_rank_backends())
def two_ranks(request: pytest.FixtureRequest) -> list[dict[str, object]]:
    """Every multi-rank check, run once on 2 ranks (gloo; NCCL where 2 GPUs are visible)
    with different data per rank."""
    backend, world_size = request.param
    return run_ranks(workers.everything, world_size=world_size, backend=backend)


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["ddp", "ddp_bucket_view", "ddp_static"])
def test_ddp_accumulation_equals_the_global_batch(
    two_ranks: list[dict[str, object]], variant: str
) -> None:
    for rank in two_ranks:
        result = rank[variant]
        assert result["match"] == [True, True]  # both optimizer steps, on every rank
    counts = two_ranks[0][variant]["counts"]
    if variant == "ddp_static":
        # static_graph: DDP's very first forward-backward synchronises (DDP records its
        # graph there; a no_sync there fails inside torch); after it, micro-steps send nothing.
        assert counts == [[1, 1, 2], [2, 2, 3]]
    else:
        assert counts == [[0, 0, 1], [1, 1, 2]]  # one bucket, reduced once per optimizer step


@pytest.mark.multiprocess
def test_forward_outside_backward_inside_is_refused(two_ranks: list[dict[str, object]]) -> None:
    for rank in two_ranks:
        message = rank["ddp_outside"]
        assert isinstance(message, str)
        assert message.startswith("no_sync(model) did not take effect")
        assert "run the forward and the backward inside the context" in message


@pytest.mark.multiprocess
def test_fsdp_accumulation_equals_the_global_batch(two_ranks: list[dict[str, object]]) -> None:
    for rank in two_ranks:
        result = rank["fsdp"]
        assert result["match"] == [True, True]
        # 3 FSDP units (2 blocks and the root): 3 reduce-scatters, only on the last micro-step.
        assert result["counts"] == [[0, 0, 3], [3, 3, 6]]
        assert result["restored"] == [True, True, True]  # also after an exception


@pytest.mark.multiprocess
@pytest.mark.parametrize("norm", ["2", "inf"])
def test_clip_norm_is_the_same_everywhere(two_ranks: list[dict[str, object]], norm: str) -> None:
    expected = two_ranks[0]["clip"][f"single_{norm}"]
    for rank in two_ranks:
        clip = rank["clip"]
        for strategy in ("ddp", "fsdp"):
            assert clip[f"{strategy}_{norm}"] == pytest.approx(expected, rel=1e-5)
            assert clip[f"{strategy}_{norm}_clipped"] is True
    assert expected > 0.05  # so clipping really changed the gradients
    # Under FSDP2 the norm and the clipped gradients are torch's clip_grad_norm_'s, bit for
    # bit (the weights of a run that clips stay identical to raw FSDP2's)
    if norm == "2":
        assert all(rank["clip"]["fsdp_2_as_torch"] for rank in two_ranks)


@pytest.mark.multiprocess
def test_the_world_is_read_between_the_forward_and_the_backward(
    two_ranks: list[dict[str, object]],
) -> None:
    """After a forward no parameter of these models is a sharded DTensor (the root kept
    gathered; units with reshard_after_forward=False): the mesh comes from FSDP's state, so
    count_mean still scales by the world and strategy_of still says fsdp."""
    for rank in two_ranks:
        for name, seen in rank["mid_step"].items():  # type: ignore[union-attr]
            assert seen["sharded_params_seen"] is False, name  # the case this guards
            assert seen["data_parallel_size"] == len(two_ranks), name
            assert seen["strategy"] == "fsdp", name


@pytest.mark.multiprocess
def test_a_nonfinite_fsdp_norm_raises_before_any_gradient_changes(
    two_ranks: list[dict[str, object]],
) -> None:
    for rank in two_ranks:
        assert rank["nonfinite_clip"] == {"raised": True, "unchanged": True}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _backward(model: nn.Module, scale: float = 1.0) -> None:
    (model(torch.randn(5, 4, generator=torch.Generator().manual_seed(1))) * scale).sum().backward()


class TestSingleProcess:
    def test_no_sync_on_a_plain_module_is_a_no_op(self) -> None:
        model = _net()
        with no_sync(model):
            _backward(model)
        assert all(p.grad is not None for p in model.parameters())

    @pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, "inf"])
    def test_matches_torch(self, norm_type: float) -> None:
        ours, theirs = _net(), _net()
        _backward(ours)
        _backward(theirs)
        total = clip_grad_norm(ours, 0.1, norm_type)
        p = math.inf if norm_type == "inf" else norm_type
        expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1, p)
        torch.testing.assert_close(total, expected)
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad)

    def test_frozen_and_gradless_parameters_are_skipped(self) -> None:
        model = _net()
        model[0].requires_grad_(False)
        _backward(model)
        assert clip_grad_norm(model, 1e9).item() > 0
        assert clip_grad_norm(_net(), 1.0).item() == 0.0  # no gradient at all

    def test_nonfinite(self) -> None:
        model = _net()
        _backward(model, scale=float("inf"))
        assert not torch.isfinite(clip_grad_norm(model, 1.0))
        with pytest.raises(RuntimeError, match="is non-finite"):
            clip_grad_norm(model, 1.0, error_if_nonfinite=True)

    @pytest.mark.parametrize(
        ("kwargs", "error", "match"),
        [
            ({"max_norm": 0.0}, ValueError, "max_norm must be a positive number, got 0.0"),
            ({"max_norm": True}, ValueError, "max_norm must be a positive number, got True"),
            ({"norm_type": -1.0}, ValueError, "norm_type must be a positive number or 'inf'"),
            ({"norm_type": "two"}, ValueError, "got 'two'"),
        ],
    )
    def test_bad_arguments(self, kwargs: dict[str, object], error: type, match: str) -> None:
        args: dict[str, object] = {"max_norm": 1.0, **kwargs}
        with pytest.raises(error, match=match):
            clip_grad_norm(_net(), **args)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="clip_grad_norm needs an nn.Module, got list"):
            clip_grad_norm([], 1.0)  # type: ignore[arg-type]


@pytest.mark.usefixtures("process_group")
def test_ddp_one_rank_restores_sync_on_exception() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = DistributedDataParallel(_net(), broadcast_buffers=False)
    with pytest.raises(KeyError), no_sync(model):
        assert model.require_backward_grad_sync is False
        raise KeyError("boom")
    assert model.require_backward_grad_sync is True


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("accum", [1, 2])
def test_count_mean_makes_variable_length_exact(
    two_ranks: list[dict[str, object]], strategy: str, accum: int
) -> None:
    """Masked batches whose token counts differ per rank and per micro-batch: with
    global_count + count_mean the stepped gradients equal one process's over the same global
    batch to float order (here exactly); with the usual mean() they are off by 0.7-4% of the
    largest gradient entry (asserted above 0.1%, a hundred times float order)."""
    for rank in two_ranks:
        result = rank["variable"]
        assert isinstance(result, dict)
        assert result[f"{strategy}_{accum}_count"]["relative"] < 1e-5, result
        assert result[f"{strategy}_{accum}_mean"]["relative"] > 1e-3, result
        assert result[f"{strategy}_{accum}_global"] == result[f"{strategy}_{accum}_expected"]
        assert result[f"{strategy}_dp"] == 2


@pytest.mark.multiprocess
def test_count_mean_under_hsdp_2x2() -> None:
    """HSDP over 2 replicas of 2 shards: the count spans both mesh dimensions, the scale the
    reduction over both; exact against one process, mean() is not. Mixed and bad counts
    agree over both dimensions too."""
    results = run_ranks(workers.hsdp_counts, world_size=4)
    for result in results:
        for accum in (1, 2):
            assert result[f"hsdp_{accum}_count"]["relative"] < 1e-5, result
            assert result[f"hsdp_{accum}_mean"]["relative"] > 1e-3, result
            assert result[f"hsdp_{accum}_global"] == result[f"hsdp_{accum}_expected"]
        assert result["hsdp_dp"] == 4
    # rank 0 passes the first kind of count, ranks 1-3 the second
    _check_count_inputs([r["inputs"] for r in results], others=3)


def _check_count_inputs(results: list[dict[str, object]], *, others: int) -> None:
    """Every rank got the same exact count, or every rank raised (none waited)."""
    assert {r["int_float"] for r in results} == {(3.0 + 4.0 * others, "float64")}
    assert {r["numpy_empty"] for r in results} == {(5, "int64")}
    assert {r["bf16_fp16"] for r in results} == {(1001.0 + 70_000.0 * others, "float64")}
    assert {r["bool_mask"] for r in results} == {(7 + 2 * others, "int64")}
    failing = {
        "nan_number": ("ValueError", "counts must be finite and >= 0, got nan"),
        "string": ("TypeError", "counts must be a number, a tensor or an iterable of them"),
        "bool": ("TypeError", "counts holds a bool (True)"),
    }
    for case, (kind, message) in failing.items():
        assert results[0][case][0] == kind, results[0][case]
        assert message in results[0][case][1]
        for other in results[1:]:
            assert other[case] == (
                "ValueError",
                "global_count failed on 1 other rank(s) (each raised its own error, naming the "
                "bad input); this rank's input was valid",
            )
    # a tensor's bad sum is found on its device and travels with the reduction
    assert results[0]["nan_tensor"][1].startswith(
        "counts must be finite and >= 0: a tensor count on this rank"
    )
    assert results[1]["nan_tensor"][1].startswith(
        "counts must be finite and >= 0: a tensor count on another rank"
    )
    assert all(r["negative_tensor"][0] == "ValueError" for r in results)
    assert "on this rank" in results[1]["negative_tensor"][1]
    assert "on another rank" in results[0]["negative_tensor"][1]
    assert {r["mean"] for r in results} == {2.0 * (1 + others) / (4 + 4 * others)}


@pytest.mark.multiprocess
def test_global_count_is_exact_and_agreed_on_every_rank(
    two_ranks: list[dict[str, object]],
) -> None:
    """Mixed inputs per rank give one exact count everywhere (int + float reinterpreted
    under gloo gave 4.6e18 and 100.00000000000142; bf16 and fp16 masks summed in their own
    dtype lost counts); a bad count on one rank raises on both, not after a timeout."""
    _check_count_inputs([r["inputs"] for r in two_ranks], others=1)


@pytest.mark.multiprocess
def test_a_zero_global_count_is_an_error(two_ranks: list[dict[str, object]]) -> None:
    for rank in two_ranks:
        assert str(rank["zero"]).startswith("global_count is 0: no item (token) in this step's")


def test_counts_in_one_process() -> None:
    """A plain model: no reduction, the count is the local sum, the scale 1."""
    from grad_sync import count_mean, data_parallel_size, global_count

    model = nn.Linear(2, 1)
    assert data_parallel_size(model) == 1
    count = global_count([torch.tensor([1, 0, 1]), 3, torch.tensor(2)], model=model)
    assert count.dtype == torch.int64 and int(count) == 7
    assert global_count([0.5, 1.5], model=model).dtype == torch.float64
    loss = torch.tensor(14.0, requires_grad=True)
    assert float(count_mean(loss, count, model=model).detach()) == 2.0
    with pytest.raises(TypeError, match="counts must be a number, a tensor or an iterable"):
        global_count("12", model=model)
    with pytest.raises(ValueError, match="counts must be finite and >= 0, got -1"):
        global_count([3, -1], model=model)
    with pytest.raises(TypeError, match="loss_sum must be a tensor"):
        count_mean(1.0, count, model=model)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="global_count is 0"):
        count_mean(loss, 0, model=model)


@pytest.mark.parametrize(
    ("loss", "count", "error", "match"),
    [
        (torch.tensor(1.0), True, TypeError, r"got bool \(True\)"),
        (torch.tensor(1.0), "4", TypeError, r"got str \('4'\)"),
        (torch.tensor(1.0), torch.tensor([2, 3]), TypeError, "one-element numeric tensor"),
        (torch.tensor(1.0), 1e-320, ValueError, "the loss scale 1/count overflows"),
        (torch.ones(3), 4, TypeError, r"0-dim floating-point tensor .* got shape \(3,\)"),
        (torch.tensor(3), 4, TypeError, "of torch.int64"),
    ],
)
def test_count_mean_refuses(loss: torch.Tensor, count: object, error: type, match: str) -> None:
    """A bool, a string or a denormal count, and a loss that is not one float, are refused
    (they were accepted: True as 1, '4' as 4.0, 1e-320 as an inf loss)."""
    from grad_sync import count_mean

    with pytest.raises(error, match=match):
        count_mean(loss, count, model=nn.Linear(2, 1))


def test_count_mean_reads_global_count_without_a_host_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A count made by global_count is read from its record, not from the tensor (on CUDA
    each .item() per micro-batch was a host sync)."""
    from grad_sync import count_mean, global_count

    model = nn.Linear(2, 1)
    count = global_count([torch.tensor([1, 1, 0]), 2], model=model)

    def synced(self: torch.Tensor) -> float:
        raise AssertionError("count_mean synchronised with the device")

    monkeypatch.setattr(torch.Tensor, "item", synced)
    assert float(count_mean(torch.tensor(8.0), count, model=model)) == 2.0


def test_low_precision_masks_count_exactly() -> None:
    """bf16 and fp16 masks are summed in float64: 1,001 bf16 ones are 1,001 (1,000 in bf16);
    70,000 fp16 ones are 70,000 (inf in fp16); a huge total is refused, not rounded."""
    from grad_sync import global_count

    model = nn.Linear(2, 1)
    assert int(global_count(torch.ones(1001, dtype=torch.bfloat16), model=model)) == 1001
    assert int(global_count(torch.ones(70_000, dtype=torch.float16), model=model)) == 70_000
    with pytest.raises(ValueError, match="past 2\\*\\*53"):
        global_count([2**53, 2**53], model=model)


class _ThreeGroups:
    """dist-core's ReplicaReduce as three live groups holding this group's values would."""

    def sum_(self, tensor: torch.Tensor) -> None:
        tensor.mul_(3)

    def live(self) -> int:
        return 3


@pytest.mark.usefixtures("process_group")
def test_counts_span_the_live_replica_groups() -> None:
    """Under fault tolerance the count and the scale cover every live group, not one."""
    from dist_core import replica_reduce, set_replica_reduce
    from grad_sync import count_mean, data_parallel_size, global_count

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = DistributedDataParallel(_net(), broadcast_buffers=False)
    assert (data_parallel_size(model), int(global_count(5, model=model))) == (1, 5)
    set_replica_reduce(model, _ThreeGroups())
    assert replica_reduce(model) is not None
    assert data_parallel_size(model) == 3
    count = global_count([torch.tensor([1, 1, 0]), 3], model=model)
    assert count.dtype == torch.int64 and int(count) == 15
    loss = torch.tensor(10.0)
    assert float(count_mean(loss, count, model=model)) == 2.0  # 10 * 3 groups / 15 items
    with pytest.raises(ValueError, match="counts must be finite and >= 0, got -1"):
        global_count([-1], model=model)  # still refused before any reduce
