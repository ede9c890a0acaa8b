from __future__ import annotations

from typing import Any

import pytest
import torch

from dist_harness import run_ranks, two_rank_backends
from replica_init_workers import replica_checks

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module", params=two_rank_backends())
def ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    backend, world_size = request.param
    return run_ranks(replica_checks, world_size=world_size, backend=backend)


def test_two_ranks_agree(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["fp_local"] == ranks[1]["fp_local"]
    assert all(r["rng_unchanged"] for r in ranks)


def test_rank_dependent_seed_is_caught_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        message, differing, tensor = rank["seed_mismatch"]
        assert differing == [1]
        assert tensor is not None
        assert message.startswith("model replicas differ: ranks [1] differ from rank 0")
    assert ranks[0]["seed_mismatch"] == ranks[1]["seed_mismatch"]


def test_flipped_bit_names_the_tensor_and_ranks(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        message, differing, tensor = rank["bit_mismatch"]
        assert differing == [1]
        assert tensor == "param:blocks.1.mlp.0.bias"
        assert (
            "first differing tensor: 'param:blocks.1.mlp.0.bias' (ranks [0]: torch.float32 (16,) sha256"
            in message
        )
        assert "; ranks [1]: torch.float32 (16,) sha256" in message


def test_rank0_source_equals_local(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["fp_rank0"] == rank["fp_local"]
        assert rank["rank0_tied"]
        assert not rank["rank0_meta_left"]
        assert rank["rank0_rng_unchanged"]
    assert ranks[0]["rank0_noise"] == ranks[1]["rank0_noise"]


def test_rank0_failure_reaches_every_rank(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["rank0_failure"] == "ValueError: constructor failed on rank 0"
    assert ranks[1]["rank0_failure"] == (
        "RuntimeError: ranks [0] failed to build the model (ValueError: constructor failed on "
        "rank 0); see the traceback on those ranks"
    )


def test_coalesced_broadcast_gives_rank0_bits(ranks: list[dict[str, Any]]) -> None:
    received = ranks[1]["coalesced"]
    assert received == ranks[0]["coalesced"]
    assert received[0] == [0.5] * 3
    assert received[1] == list(range(40))
    assert received[2] == [True, False]
    assert received[5] == (torch.arange(12.0).reshape(3, 4).t()).tolist()


def test_sharded_builds_equal_the_official_order(ranks: list[dict[str, Any]]) -> None:
    for source in ("local", "rank0"):
        for rank in ranks:
            built = rank[f"sharded_{source}"]
            assert built["full"] == rank["sharded_reference"], source
            assert built["dtensors"] and built["tied"], source
            assert built["rng_unchanged"] and built["dtype"], source
            assert built["verified"] == ranks[0][f"sharded_{source}"]["verified"], source
        assert ranks[0][f"sharded_{source}"]["noise"] == ranks[1][f"sharded_{source}"]["noise"]
    # The same shards, whichever rank built them.
    assert ranks[0]["sharded_local"]["verified"] == ranks[0]["sharded_rank0"]["verified"]


def test_sharded_verification_catches_a_rank_dependent_seed(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["sharded_seed_mismatch"] == ranks[1]["sharded_seed_mismatch"]
    message, differing, tensor = ranks[0]["sharded_seed_mismatch"]
    assert message.startswith("sharded model differs: the shards rank ")
    assert differing in ([0], [1]) and tensor is not None


def test_sharded_verification_names_a_flipped_bit(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["sharded_bit_mismatch"] == ranks[1]["sharded_bit_mismatch"]
    message, differing, tensor = ranks[0]["sharded_bit_mismatch"]
    assert differing == [1]
    assert tensor == "param:blocks.1.mlp.0.bias"
    assert message.startswith(
        "sharded model differs: the shards rank 1 holds differ from rank 0's copy of them, "
        "first at 'param:blocks.1.mlp.0.bias' (sha256 "
    )


def test_sharded_rank0_failure_reaches_every_rank(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["sharded_rank0_failure"] == "ValueError: constructor failed on rank 0"
    assert ranks[1]["sharded_rank0_failure"].startswith("RuntimeError: ranks [0] failed")


def test_sharded_wrap_failure_reaches_every_rank(ranks: list[dict[str, Any]]) -> None:
    """A rank that fails to shard is named on every rank, before the stream's broadcast."""
    assert ranks[1]["sharded_wrap_failure"] == "ValueError: shard failed on rank 1"
    assert ranks[0]["sharded_wrap_failure"] == (
        "RuntimeError: sharding the model failed on rank(s) [1]; rank 1: shard failed on rank 1"
    )
    # The exchanged message above is the proof that rank 0 did not sit out the group's 60 s
    # timeout (that raises another error); no wall-clock bound, which a busy host can break.


def test_replica_drift_names_a_nudged_parameter_and_its_rank(ranks: list[dict[str, Any]]) -> None:
    """Untouched DDP replicas: no drift, every tensor compared, each rank's local (unreduced,
    no_sync) gradient norm reported. One parameter nudged by 1e-3 on rank 1: named, with the
    rank and the difference, on every rank. FSDP over one dimension replicates nothing."""
    for rank in ranks:
        compared, drifted, tensor, line = rank["drift_clean"]
        assert compared > 0 and drifted is False and tensor is None
        assert line.startswith("replica drift: none")
        norms = rank["drift_norms"]
        assert len(norms) == 2 and norms[0] != norms[1]  # different data per rank
        drifted, tensor, differing, worst = rank["drift_nudged"]
        assert drifted is True and tensor == "param:blocks.1.mlp.0.weight" and differing == [1]
        assert worst == pytest.approx(1e-3, rel=1e-3)
        assert "param:blocks.1.mlp.0.weight differs on ranks [1] from rank 0" in rank["drift_line"]
        chunked = rank["drift_chunked"]
        assert chunked["found"] == ("param:blocks.1.mlp.0.weight", [1], worst)
        assert chunked["largest"] == 16 and chunked["chunks"] > 1
        assert rank["drift_fsdp"] == (0, "replica drift: nothing replicated to compare")
    assert ranks[0]["drift_norms"] == ranks[1]["drift_norms"]


def test_replica_drift_compares_replica_groups(ranks: list[dict[str, Any]]) -> None:
    """Under fault tolerance each replica group is its own process group: replica_drift
    compares the groups through their reduction (here each rank a group, a real all-reduce).
    Equal groups: none. One bias element nudged by 1e-6 in group 11: named, with the group,
    on every group. A reduction that failed in one group is refused, not reported as drift."""
    for rank in ranks:
        drifted, groups, differing, line = rank["groups_clean"]
        assert (drifted, groups, differing) == (False, [10, 11], [])
        assert line.startswith("replica drift: none (") and "replica groups [10, 11]" in line
        drifted, tensor, differing, line = rank["groups_nudged"]
        assert (drifted, tensor, differing) == (True, "param:blocks.0.mlp.0.bias", [11])
        assert "param:blocks.0.mlp.0.bias differs in replica groups [11] from group 10" in line
    for rank in ranks:  # the group's ranks agree before raising: none is left waiting
        assert "the replica groups changed while they were compared" in rank["groups_failed"]


def test_replica_drift_compares_hsdp_shards_across_the_replicas() -> None:
    """HSDP 2 x 2: rank r's shard is compared with the other replica's copy of it (ranks
    {0, 2} and {1, 3}); a shard nudged on rank 3 is found by its replica group only."""
    from replica_init_workers import hsdp_drift

    results = run_ranks(hsdp_drift, world_size=4)
    for rank, result in enumerate(results):
        compared, drifted, members = result["clean"]
        assert compared > 0 and drifted is False and members == [rank % 2, rank % 2 + 2]
        drifted, tensor, differing, worst = result["nudged"]
        if rank % 2 == 1:
            assert (drifted, tensor, differing) == (True, "param:blocks.0.mlp.2.bias", [3])
            assert worst == pytest.approx(0.5)
        else:
            assert drifted is False
