"""``SampleOrder``: the global batch of every step, and each rank's share of it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch


def _integer(value: object, argument: str) -> int:
    """``value`` as an int; bools and other types are refused (``TypeError``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{argument} must be an int, got {type(value).__name__} ({value!r})")
    return value


def _at_least(value: object, argument: str, low: int) -> int:
    number = _integer(value, argument)
    if number < low:
        raise ValueError(f"{argument} must be >= {low}, got {number}")
    return number


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of epoch ``epoch``'s permutation: BLAKE2b of (seed, epoch), 63 bits.

    The same in every process, machine and Python version (never ``hash()``); adjacent
    epochs give unrelated permutations.
    """
    digest = hashlib.blake2b(digest_size=8, person=b"sample_order")
    digest.update(seed.to_bytes(16, "little", signed=True))
    digest.update(epoch.to_bytes(16, "little", signed=True))
    return int.from_bytes(digest.digest(), "little") >> 1


class SampleOrder:
    """The order in which a run reads a dataset: a global batch per step, split by rank.

    Step ``s`` belongs to epoch ``s // steps_per_epoch``; each epoch is a permutation of
    ``range(num_samples)`` drawn from ``(seed, epoch)`` (:func:`epoch_seed`, torch's
    ``randperm`` on a CPU generator), cut into ``steps_per_epoch`` global batches of
    ``global_batch`` indices; the tail that does not fill a batch is dropped. Nothing depends
    on the rank or the world size: every rank computes the same global batch, at any world
    size, and takes its contiguous share. The data position is the step, so a checkpoint
    needs nothing else to continue the order, on any number of ranks.

    Args:
        num_samples: The dataset's length.
        global_batch: Samples per optimizer step, over all ranks and micro-batches.
        seed: The run's data seed.
        shuffle: ``False`` reads ``0, 1, 2, ...`` in every epoch.

    Raises:
        TypeError: A non-integer size or seed, or a non-bool ``shuffle``.
        ValueError: A size below 1, or fewer samples than one global batch.
    """

    def __init__(
        self, num_samples: int, *, global_batch: int, seed: int, shuffle: bool = True
    ) -> None:
        self.num_samples = _at_least(num_samples, "num_samples", 1)
        self.global_batch = _at_least(global_batch, "global_batch", 1)
        self.seed = _integer(seed, "seed")
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be a bool, got {type(shuffle).__name__} ({shuffle!r})")
        self.shuffle = shuffle
        if self.num_samples < self.global_batch:
            raise ValueError(
                f"num_samples ({self.num_samples}) is smaller than one global batch "
                f"(global_batch={self.global_batch}); use a global_batch of at most "
                f"{self.num_samples}"
            )
        self._epoch: tuple[int, torch.Tensor] | None = None  # the last epoch's permutation

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per epoch (``num_samples // global_batch``; the tail is dropped)."""
        return self.num_samples // self.global_batch

    def __repr__(self) -> str:
        return (
            f"SampleOrder({self.num_samples}, global_batch={self.global_batch}, "
            f"seed={self.seed}, shuffle={self.shuffle})"
        )

    def batch(self, step: int) -> list[int]:
        """The global batch of ``step``: the same on every rank and at any world size.

        Raises:
            TypeError: If ``step`` is not an int.
            ValueError: If ``step`` is negative.
        """
        step = _at_least(step, "step", 0)
        epoch, within = divmod(step, self.steps_per_epoch)
        start = within * self.global_batch
        return self._permutation(epoch)[start : start + self.global_batch].tolist()

    def shard(self, step: int, *, rank: int, world_size: int) -> list[int]:
        """``rank``'s contiguous share of step ``step``'s global batch.

        ``batch(step)[rank * b : (rank + 1) * b]`` with ``b = global_batch // world_size``.

        Raises:
            TypeError: A non-integer argument.
            ValueError: A negative step, a world size below 1, a rank outside
                ``0..world_size-1``, or a global batch that ``world_size`` does not divide.
        """
        size = self._per_rank(rank, world_size)
        return self.batch(step)[rank * size : (rank + 1) * size]

    def micro_batches(
        self, step: int, *, rank: int, world_size: int, accum: int
    ) -> list[list[int]]:
        """``rank``'s share of step ``step`` cut into ``accum`` consecutive micro-batches.

        Raises:
            TypeError: A non-integer argument.
            ValueError: As :meth:`shard`, or ``accum`` below 1 or not dividing the rank's
                share.
        """
        share = self.shard(step, rank=rank, world_size=world_size)
        micro = self._micro(len(share), accum, world_size)
        return [share[i : i + micro] for i in range(0, len(share), micro)]

    def batch_sampler(
        self, *, rank: int, world_size: int, accum: int = 1, start_step: int = 0
    ) -> _BatchSampler:
        """An iterable of index lists for ``DataLoader(dataset, batch_sampler=...)``.

        Yields ``rank``'s micro-batches of step ``start_step``, then of every later step, one
        list per micro-batch (``accum`` per step), without end: the trainer stops at its last
        step. Resuming from a checkpoint of step ``s`` is ``start_step=s``, at any world size.

        Raises:
            TypeError: A non-integer argument.
            ValueError: As :meth:`micro_batches`, or a negative ``start_step``.
        """
        self._micro(self._per_rank(rank, world_size), accum, world_size)
        _at_least(start_step, "start_step", 0)
        return _BatchSampler(self, rank, world_size, accum, start_step)

    def _per_rank(self, rank: int, world_size: int) -> int:
        world = _at_least(world_size, "world_size", 1)
        rank = _integer(rank, "rank")
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in 0..{world - 1} (world_size={world}), got {rank}")
        if self.global_batch % world:
            raise ValueError(
                f"global_batch ({self.global_batch}) is not divisible by world_size ({world}); "
                "use a global batch that is a multiple of the number of ranks"
            )
        return self.global_batch // world

    def _micro(self, share: int, accum: int, world_size: int) -> int:
        accum = _at_least(accum, "accum", 1)
        if share % accum:
            raise ValueError(
                f"each rank's share of the global batch ({share} = {self.global_batch} / "
                f"{world_size} ranks) is not divisible by accum ({accum}); use an accum that "
                f"divides {share}"
            )
        return share // accum

    def _permutation(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s order as an int64 tensor (8 bytes a sample, not a Python list)."""
        if self._epoch is None or self._epoch[0] != epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
                order = torch.randperm(self.num_samples, generator=generator)
            else:
                order = torch.arange(self.num_samples)
            self._epoch = (epoch, order)
        return self._epoch[1]


class _BatchSampler:
    """Rank ``rank``'s micro-batches from ``start_step`` on (see ``batch_sampler``)."""

    def __init__(
        self, order: SampleOrder, rank: int, world_size: int, accum: int, start_step: int
    ) -> None:
        self.order = order
        self.rank = rank
        self.world_size = world_size
        self.accum = accum
        self.start_step = start_step

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        while True:
            yield from self.order.micro_batches(
                step, rank=self.rank, world_size=self.world_size, accum=self.accum
            )
            step += 1
