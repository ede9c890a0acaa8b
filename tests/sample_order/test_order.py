"""sample-order: the same global batches at any world size, each rank's contiguous share."""

from __future__ import annotations

import itertools

import pytest
import torch

from sample_order import SampleOrder


def test_batches_partition_an_epoch_and_epochs_differ() -> None:
    order = SampleOrder(103, global_batch=8, seed=7)
    assert order.steps_per_epoch == 12  # 96 samples, the tail of 7 dropped
    epoch = [i for s in range(12) for i in order.batch(s)]
    assert len(epoch) == len(set(epoch)) == 96 and set(epoch) <= set(range(103))
    assert epoch != list(range(96))  # shuffled
    second = [i for s in range(12, 24) for i in order.batch(s)]
    assert second != epoch and len(set(second)) == 96  # a new permutation per epoch
    assert order.batch(5) == order.batch(5) == SampleOrder(103, global_batch=8, seed=7).batch(5)
    assert order.batch(5) != SampleOrder(103, global_batch=8, seed=8).batch(5)
    assert order.batch(13) == order.batch(13)  # going back and forth between epochs


def test_shards_partition_the_batch_at_any_world_size() -> None:
    order = SampleOrder(1000, global_batch=64, seed=1)
    for step in (0, 15, 16, 100):
        batch = order.batch(step)
        for world in (1, 2, 4, 8):
            shards = [order.shard(step, rank=r, world_size=world) for r in range(world)]
            assert [i for shard in shards for i in shard] == batch, (step, world)
            for rank in range(world):
                micro = order.micro_batches(step, rank=rank, world_size=world, accum=2)
                assert len(micro) == 2 and [i for m in micro for i in m] == shards[rank]


def test_no_shuffle_is_sequential() -> None:
    order = SampleOrder(10, global_batch=4, seed=3, shuffle=False)
    assert [order.batch(s) for s in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]


def test_the_batch_sampler_continues_from_start_step() -> None:
    order = SampleOrder(50, global_batch=8, seed=2)
    sampler = order.batch_sampler(rank=1, world_size=2, accum=2, start_step=3)
    got = list(itertools.islice(sampler, 6))  # 3 steps of 2 micro-batches
    want = [m for s in (3, 4, 5) for m in order.micro_batches(s, rank=1, world_size=2, accum=2)]
    assert got == want and all(len(m) == 2 for m in got)
    # A DataLoader reads exactly those samples, and continues across the epoch boundary.
    data = torch.arange(50) * 10
    loader = torch.utils.data.DataLoader(
        data, batch_sampler=order.batch_sampler(rank=0, world_size=1)
    )
    first = [batch.tolist() for batch in itertools.islice(loader, 7)]
    assert first == [[10 * i for i in order.batch(s)] for s in range(7)]
    # Resuming at step 4 on another number of ranks reads the same global batches.
    resumed = [order.batch_sampler(rank=r, world_size=4, start_step=4) for r in range(4)]
    step4 = [next(iter(s)) for s in resumed]
    assert [i for part in step4 for i in part] == order.batch(4)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: SampleOrder(0, global_batch=1, seed=0),
            ValueError,
            "num_samples must be >= 1, got 0",
        ),
        (
            lambda: SampleOrder(10, global_batch=0, seed=0),
            ValueError,
            "global_batch must be >= 1, got 0",
        ),
        (
            lambda: SampleOrder(3, global_batch=4, seed=0),
            ValueError,
            "num_samples (3) is smaller than one global batch (global_batch=4)",
        ),
        (
            lambda: SampleOrder(10.0, global_batch=2, seed=0),
            TypeError,
            "num_samples must be an int, got float (10.0)",
        ),  # type: ignore[arg-type]
        (
            lambda: SampleOrder(10, global_batch=True, seed=0),
            TypeError,
            "global_batch must be an int, got bool (True)",
        ),
        (
            lambda: SampleOrder(10, global_batch=2, seed="1"),
            TypeError,
            "seed must be an int, got str ('1')",
        ),  # type: ignore[arg-type]
        (
            lambda: SampleOrder(10, global_batch=2, seed=0, shuffle=1),
            TypeError,
            "shuffle must be a bool, got int (1)",
        ),  # type: ignore[arg-type]
        (
            lambda: SampleOrder(10, global_batch=2, seed=0).batch(-1),
            ValueError,
            "step must be >= 0, got -1",
        ),
        (
            lambda: SampleOrder(10, global_batch=2, seed=0).batch(1.5),
            TypeError,
            "step must be an int, got float (1.5)",
        ),  # type: ignore[arg-type]
        (
            lambda: SampleOrder(12, global_batch=6, seed=0).shard(0, rank=0, world_size=4),
            ValueError,
            "global_batch (6) is not divisible by world_size (4)",
        ),
        (
            lambda: SampleOrder(12, global_batch=6, seed=0).shard(0, rank=2, world_size=2),
            ValueError,
            "rank must be in 0..1 (world_size=2), got 2",
        ),
        (
            lambda: SampleOrder(12, global_batch=6, seed=0).shard(0, rank=-1, world_size=2),
            ValueError,
            "rank must be in 0..1 (world_size=2), got -1",
        ),
        (
            lambda: SampleOrder(12, global_batch=6, seed=0).shard(0, rank=0, world_size=0),
            ValueError,
            "world_size must be >= 1, got 0",
        ),
        (
            lambda: SampleOrder(12, global_batch=6, seed=0).micro_batches(
                0, rank=0, world_size=1, accum=4
            ),
            ValueError,
            "each rank's share of the global batch (6 = 6 / 1 ranks) is not divisible by accum (4)",
        ),
        (
            lambda: SampleOrder(12, global_batch=6, seed=0).batch_sampler(
                rank=0, world_size=1, accum=0
            ),
            ValueError,
            "accum must be >= 1, got 0",
        ),
        (
            lambda: SampleOrder(12, global_batch=6, seed=0).batch_sampler(
                rank=0, world_size=1, start_step=-2
            ),
            ValueError,
            "start_step must be >= 0, got -2",
        ),
    ],
)
def test_bad_input_is_refused_naming_the_values(call: object, error: type, message: str) -> None:
    with pytest.raises(error) as raised:
        call()  # type: ignore[operator]
    assert str(raised.value).startswith(message), str(raised.value)
