from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from strategy_config import DistributedConfig, load_distributed_config, normalize_dtype_name


def test_defaults() -> None:
    config = DistributedConfig()
    assert config.strategy == "fsdp"
    assert config.broadcast_buffers is False
    assert config.reshard_after_forward is True
    assert config.source == "local"
    assert config.param_dtype is None
    assert not config.is_ddp


def test_from_mapping_normalises() -> None:
    config = DistributedConfig.from_mapping(
        {"strategy": " DDP", "bucket_cap_mb": 50, "param_dtype": "BFloat16", "source": "Rank0"}
    )
    assert config.strategy == "ddp"
    assert config.is_ddp
    assert config.bucket_cap_mb == 50
    assert config.param_dtype == "bf16"
    assert config.source == "rank0"


def test_round_trip_through_to_dict() -> None:
    config = DistributedConfig.from_mapping({"strategy": "ddp", "static_graph": True})
    assert DistributedConfig.from_mapping(config.to_dict()) == config


def test_is_frozen() -> None:
    config = DistributedConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.strategy = "ddp"  # type: ignore[misc]


def test_unknown_keys_are_each_named_with_closest_known_key() -> None:
    with pytest.raises(ValueError) as info:
        DistributedConfig.from_mapping({"bucket_cap": 25, "reshard_after_fwd": False, "zzz": 1})
    message = str(info.value)
    assert "'bucket_cap' (did you mean 'bucket_cap_mb'?)" in message
    assert "'reshard_after_fwd' (did you mean 'reshard_after_forward'?)" in message
    assert "'zzz';" in message  # no close key, so no hint
    assert message.startswith("unknown key(s) in training.distributed:")


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("bucket_cap_mb", "25", "training.distributed.bucket_cap_mb must be number"),
        ("bucket_cap_mb", True, "training.distributed.bucket_cap_mb must be number"),
        ("static_graph", 1, "training.distributed.static_graph must be bool"),
        ("broadcast_buffers", "false", "training.distributed.broadcast_buffers must be bool"),
        ("param_dtype", 16, "training.distributed.param_dtype must be a dtype name"),
        ("source", 0, "training.distributed.source must be str"),
        ("strategy", 3, "training.distributed.strategy must be a string"),
    ],
)
def test_wrong_types_name_path_type_and_value(key: str, value: object, expected: str) -> None:
    with pytest.raises(TypeError) as info:
        DistributedConfig.from_mapping({key: value})
    message = str(info.value)
    assert message.startswith(expected)
    assert type(value).__name__ in message
    assert repr(value) in message


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("bucket_cap_mb", 0, "must be a positive number of MiB, got 0"),
        ("bucket_cap_mb", -1.5, "got -1.5"),
        ("reduce_dtype", "bf61", "did you mean 'bf16'?"),
        ("source", "rank1", "must be one of {local, rank0}, got 'rank1'"),
        ("strategy", "fdsp", "got 'fdsp' (did you mean 'fsdp'?)"),
    ],
)
def test_out_of_range_values(key: str, value: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        DistributedConfig.from_mapping({key: value})
    assert fragment in str(info.value)


def test_not_a_mapping() -> None:
    with pytest.raises(TypeError, match="training.distributed must be a mapping, got list"):
        DistributedConfig.from_mapping([("strategy", "ddp")])  # type: ignore[arg-type]


def test_dtype_names() -> None:
    assert normalize_dtype_name(None) is None
    assert normalize_dtype_name("half") == "fp16"
    assert normalize_dtype_name("FP32") == "fp32"
    with pytest.raises(ValueError, match=r"must be one of \{bf16, bfloat16"):
        normalize_dtype_name("int8", path="x")


def test_option_views() -> None:
    config = DistributedConfig(strategy="ddp", bucket_cap_mb=1, static_graph=True)
    assert config.ddp_options() == {
        "broadcast_buffers": False,
        "find_unused_parameters": False,
        "gradient_as_bucket_view": False,
        "static_graph": True,
        "bucket_cap_mb": 1,
    }
    assert "bucket_cap_mb" not in DistributedConfig().ddp_options()
    assert DistributedConfig(param_dtype="bf16").fsdp_options() == {
        "reshard_after_forward": True,
        "param_dtype": "bf16",
        "reduce_dtype": None,
        "offload": False,
    }
    assert DistributedConfig(offload="cpu").fsdp_options()["offload"] is True


@dataclasses.dataclass
class _Section:
    strategy: str = "ddp"
    bucket_cap_mb: float = 10.0


@pytest.mark.parametrize(
    "training",
    [
        {"distributed": {"strategy": "ddp", "bucket_cap_mb": 10.0}},
        SimpleNamespace(distributed=SimpleNamespace(strategy="ddp", bucket_cap_mb=10.0)),
        SimpleNamespace(distributed=_Section()),
        {"distributed": DistributedConfig(strategy="ddp", bucket_cap_mb=10.0)},
    ],
)
def test_load_distributed_config_sources(training: object) -> None:
    assert load_distributed_config(training) == DistributedConfig(
        strategy="ddp", bucket_cap_mb=10.0
    )


def test_load_distributed_config_missing_section_is_default() -> None:
    assert load_distributed_config({}) == DistributedConfig()
    assert load_distributed_config(SimpleNamespace()) == DistributedConfig()


def test_load_distributed_config_rejects_scalars() -> None:
    with pytest.raises(TypeError, match="training.distributed must be a mapping or an attribute"):
        load_distributed_config({"distributed": "ddp"})


def test_load_reports_unknown_keys() -> None:
    with pytest.raises(ValueError, match="'statc_graph' \\(did you mean 'static_graph'\\?\\)"):
        load_distributed_config({"distributed": {"statc_graph": True}})


def test_hsdp_mesh_shape_defaults_to_the_ranks_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    config = DistributedConfig.from_mapping({"strategy": "HSDP"})
    assert config.strategy == "hsdp" and not config.is_ddp
    assert config.hsdp_mesh_shape(16, 8) == (2, 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert config.hsdp_mesh_shape(8) == (2, 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert config.hsdp_mesh_shape(4) == (1, 4)  # one node
    assert DistributedConfig(strategy="hsdp", replicate=2, shard=2).hsdp_mesh_shape(4, 4) == (2, 2)
    assert DistributedConfig(strategy="hsdp", replicate=4).hsdp_mesh_shape(8, 8) == (4, 2)
    assert config.fsdp_options() == DistributedConfig().fsdp_options()


@pytest.mark.parametrize(
    ("mapping", "world", "local", "error", "message"),
    [
        (
            {"strategy": "hsdp", "replicate": 3, "shard": 2},
            4,
            4,
            ValueError,
            "training.distributed.replicate * training.distributed.shard must equal the world "
            "size 4, got 3 * 2 = 6; e.g. replicate: 1, shard: 4",
        ),
        (
            {"strategy": "hsdp", "shard": 3},
            6,
            4,
            ValueError,
            "training.distributed.shard=3 must divide the ranks per node (LOCAL_WORLD_SIZE=4)",
        ),
        (
            {"strategy": "hsdp", "shard": 0},
            4,
            4,
            ValueError,
            "training.distributed.shard must be >= 1 (a number of ranks), got 0",
        ),
        (
            {"strategy": "hsdp", "replicate": "2"},
            4,
            4,
            TypeError,
            "training.distributed.replicate must be int (a number of ranks), got str ('2')",
        ),
        (
            {"strategy": "fsdp", "shard": 2},
            4,
            4,
            ValueError,
            "training.distributed.shard is an HSDP degree, but training.distributed.strategy is "
            "'fsdp'; set strategy: hsdp, or remove shard",
        ),
        (
            {"strategy": "hsdp", "replicat": 2},
            4,
            4,
            ValueError,
            "unknown key(s) in training.distributed: 'replicat' (did you mean 'replicate'?)",
        ),
        (
            {"strategy": "ddp"},
            4,
            4,
            ValueError,
            "training.distributed.strategy is 'ddp': only HSDP has a 2-D mesh",
        ),
    ],
)
def test_bad_hsdp_configs_are_one_line_errors(
    mapping: dict[str, object], world: int, local: int, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as raised:
        DistributedConfig.from_mapping(mapping).hsdp_mesh_shape(world, local)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_local_world_size_that_is_not_a_number_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")
    with pytest.raises(ValueError) as raised:
        DistributedConfig(strategy="hsdp").hsdp_mesh_shape(8)
    assert str(raised.value) == (
        "LOCAL_WORLD_SIZE must be an integer (the ranks per node), got 'four'"
    )


def test_the_recipe_keys_are_validated_and_normalised() -> None:
    """Issue 47 (1): activation_checkpointing, compile and offload, torch-free."""
    config = DistributedConfig.from_mapping(
        {
            "strategy": "hsdp",
            "activation_checkpointing": "Selective",
            "compile": True,
            "offload": "CPU",
        }
    )
    assert (config.activation_checkpointing, config.compile, config.offload) == (
        "selective",
        True,
        "cpu",
    )
    assert DistributedConfig().activation_checkpointing == "none"
    assert DistributedConfig().offload == "none" and DistributedConfig().compile is False
    assert DistributedConfig(activation_checkpointing=True).activation_checkpointing == "full"
    assert DistributedConfig.from_mapping(config.to_dict()) == config
    with pytest.raises(
        ValueError,
        match=r"activation_checkpointing must be one of \{none, "
        r"full, selective\}, got 'selectiv'.*did you mean 'selective'",
    ):
        DistributedConfig(activation_checkpointing="selectiv")
    with pytest.raises(ValueError, match=r"offload must be one of \{none, cpu\}, got 'gpu'"):
        DistributedConfig(offload="gpu")
    with pytest.raises(TypeError, match=r"training.distributed.compile must be bool"):
        DistributedConfig(compile="yes")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"offload='cpu' needs a sharded strategy .*set "
        r"strategy: fsdp, or offload: none",
    ):
        DistributedConfig(strategy="ddp", offload="cpu")
    with pytest.raises(ValueError, match=r"unknown key\(s\).*'ofload'.*did you mean 'offload'"):
        DistributedConfig.from_mapping({"ofload": "cpu"})
