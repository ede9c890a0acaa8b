"""The composed import and prepare_model on a one-rank gloo group."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import distributed_strategy
from distributed_strategy import DelegatingDistributedDataParallel, DistributedConfig, prepare_model
from distributed_strategy._prepare import resolve_config
from toy_models import Regressor, RunnerNet

REFERENCE_ALL = {
    "DelegatingDistributedDataParallel",
    "SUPPORTED_DISTRIBUTED_STRATEGIES",
    "build_replicated_model_from_scratch",
    "is_ddp_strategy",
    "normalize_distributed_strategy",
    "unwrap_ddp_module",
    "wrap_module_ddp",
}


FACE = {
    # what a trainer calls: config, build and wrap, launch
    "DistributedConfig",
    "load_distributed_config",
    "prepare_model",
    "TrainablePolicy",
    "apply_block_recipe",
    "build_replicated_model",
    "wrap_module_fsdp",
    "strategy_of",
    "Strategy",
    "unwrap_model",
    "init_distributed",
    # the train step
    "no_sync",
    "clip_grad_norm",
    "global_count",
    "count_mean",
    "data_parallel_size",
    "SampleOrder",
    "seed_rng",
    "fork_rng",
    "derive_seed",
    "replica_drift",
    "DriftReport",
    "assert_replicas_identical",
    "ReplicaMismatchError",
    "state_fingerprint",
    # checkpoints
    "save_checkpoint",
    "load_checkpoint",
    "async_save_checkpoint",
    "PendingCheckpoint",
    "CheckpointManager",
    "CheckpointInfo",
    "CheckpointError",
    "latest_checkpoint",
    "full_state_dict",
    "consolidate_checkpoint",
    # pretrained weights
    "load_pretrained",
    "save_pretrained",
    "PretrainedInfo",
}


def test_the_composed_import_is_what_a_trainer_calls() -> None:
    """The face is pinned: the reference module's names and the trainer's, 45 at most; each
    is the owning package's own object; plumbing is not re-exported."""
    import checkpoint_io
    import ddp_wrap
    import dist_core
    import fsdp_wrap
    import grad_sync
    import hf_io
    import replica_init
    import rng_fork
    import sample_order
    import strategy_config

    exported = set(distributed_strategy.__all__)
    assert exported == REFERENCE_ALL | FACE
    assert len(distributed_strategy.__all__) == len(exported) <= 45
    pieces = (
        dist_core,
        ddp_wrap,
        fsdp_wrap,
        grad_sync,
        hf_io,
        checkpoint_io,
        replica_init,
        rng_fork,
        sample_order,
        strategy_config,
    )
    owned = {name: piece for piece in pieces for name in piece.__all__}
    for name in exported:
        if name in owned:  # one owner per name: the same object
            assert getattr(distributed_strategy, name) is getattr(owned[name], name), name
        else:  # the composed package's own: prepare_model, its recipe, its policy type
            assert name in {"prepare_model", "apply_block_recipe", "TrainablePolicy"}, name
    public = {name for name in vars(distributed_strategy) if not name.startswith("_")}
    assert public - exported <= {
        "annotations",
        "recipe",
        "fault_tolerance",
    }  # no plumbing beside the face
    for plumbing in ("fsync_dir", "open_regular", "slurm_port", "names_nccl", "KEPT_OPS"):
        assert not hasattr(distributed_strategy, plumbing), plumbing
    namespace: dict[str, object] = {}
    exec("from distributed_strategy import *", namespace)
    assert exported <= set(namespace)


class TestResolveConfig:
    def test_forms(self) -> None:
        assert resolve_config("DDP").strategy == "ddp"
        assert resolve_config(None).strategy == "fsdp"
        assert resolve_config({"strategy": "ddp", "bucket_cap_mb": 5}).bucket_cap_mb == 5
        config = DistributedConfig(strategy="ddp")
        assert resolve_config(config) is config

    def test_bad(self) -> None:
        with pytest.raises(TypeError, match="config must be a DistributedConfig, .* got int"):
            resolve_config(3)  # type: ignore[arg-type]
        with pytest.raises(
            ValueError,
            match=r"^training.distributed.strategy must be one of \{ddp, fsdp, hsdp\}, got 'dpp'",
        ):
            resolve_config("dpp")
        with pytest.raises(
            ValueError, match="unknown key\\(s\\) in training.distributed: 'bucket_cap'"
        ):
            resolve_config({"bucket_cap": 5})


@pytest.mark.usefixtures("process_group")
class TestPrepareModel:
    def test_ddp(self, caplog: pytest.LogCaptureFixture) -> None:
        with caplog.at_level(logging.INFO, logger="distributed_strategy"):
            model = prepare_model(
                RunnerNet,
                {"width": 4},
                config={"strategy": "ddp", "bucket_cap_mb": 1},
                device="cpu",
                default_dtype=torch.float32,
                seed=5,
                forward_methods=["loss"],
            )
        assert isinstance(model, DelegatingDistributedDataParallel)
        assert model.bucket_bytes_cap == 1024 * 1024
        assert model.latent_seq_len == 7
        model.loss(torch.ones(2, 4)).backward()
        (line,) = [
            r.getMessage() for r in caplog.records if r.name.startswith("distributed_strategy")
        ]
        assert line.startswith(
            "prepared RunnerNet for DDP on 1 rank(s): 28 parameters, 8 trainable"
        )
        for stage in ("build", "trainable", "verify", "wrap"):
            assert f"{stage} " in line and " ms" in line

    def test_fsdp_with_policy_and_source(self) -> None:
        def freeze(model: nn.Module) -> None:
            model.encoder.requires_grad_(False)

        model = prepare_model(
            Regressor,
            None,
            config="fsdp",
            device="cpu",
            default_dtype=torch.float32,
            seed=5,
            trainable=freeze,
            source="rank0",
        )
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert not model.encoder.weight.requires_grad
        assert model.blocks[0].norm.weight.requires_grad

    def test_trainable_policy_may_return_the_module(self) -> None:
        swapped = Regressor()
        model = prepare_model(
            Regressor,
            None,
            config="ddp",
            device="cpu",
            default_dtype=torch.float32,
            seed=5,
            trainable=lambda m: swapped,
            verify=False,
        )
        assert model.module is swapped

    def test_bad_trainable_policy(self) -> None:
        with pytest.raises(
            TypeError, match="trainable must be a callable taking the model, got int"
        ):
            prepare_model(
                Regressor,
                None,
                config="ddp",
                device="cpu",
                default_dtype=torch.float32,
                seed=5,
                trainable=3,
            )  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="'<lambda>' returned str"):
            prepare_model(
                Regressor,
                None,
                config="ddp",
                device="cpu",
                default_dtype=torch.float32,
                seed=5,
                trainable=lambda m: "frozen",
            )  # type: ignore[arg-type,return-value]

    def test_policy_returning_a_submodule_is_refused(self) -> None:
        # requires_grad_() returns the module it is called on: this one-liner returns `net`.
        def policy(m: nn.Module) -> nn.Module:
            return m.requires_grad_(False).net.requires_grad_(True)  # type: ignore[no-any-return]

        with pytest.raises(TypeError, match="policy 'policy' returned Linear, a submodule of"):
            prepare_model(
                RunnerNet,
                None,
                config="ddp",
                device="cpu",
                default_dtype=torch.float32,
                seed=5,
                trainable=policy,
            )

    def test_policy_that_freezes_everything_is_named(self) -> None:
        def freeze_all(m: nn.Module) -> None:
            m.requires_grad_(False)

        with pytest.raises(ValueError, match="policy 'freeze_all' left no trainable parameter"):
            prepare_model(
                RunnerNet,
                None,
                config="fsdp",
                device="cpu",
                default_dtype=torch.float32,
                seed=5,
                trainable=freeze_all,
            )

    def test_bad_source(self) -> None:
        with pytest.raises(
            ValueError,
            match="training.distributed.source must be one of \\{local, rank0\\}, got 'rank1'",
        ):
            prepare_model(
                Regressor,
                None,
                config="ddp",
                device="cpu",
                default_dtype=torch.float32,
                seed=5,
                source="rank1",
            )

    def test_restores_rng_and_default_dtype(self) -> None:
        rng = torch.get_rng_state()
        prepare_model(
            Regressor, None, config="ddp", device="cpu", default_dtype=torch.float64, seed=5
        )
        assert torch.equal(torch.get_rng_state(), rng)
        assert torch.get_default_dtype() == torch.float32
