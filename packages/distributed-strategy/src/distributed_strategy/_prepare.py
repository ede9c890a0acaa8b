"""``prepare_model``: normalise, build, apply the trainable policy, verify, wrap, report."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_wrap import wrap_module_ddp
from dist_core import DeviceLike, log_rank0, require_process_group, resolve_device
from distributed_strategy._ft_wiring import attach_fault_tolerance
from distributed_strategy._lighthouse import check_lighthouse
from distributed_strategy._pretrained import build_pretrained
from distributed_strategy._stages import Stages
from distributed_strategy._trainable import TrainablePolicy, apply_trainable
from distributed_strategy.recipe import apply_block_recipe, recipe_blocks
from fsdp_wrap import ShardPolicy, hsdp_mesh, wrap_module_fsdp
from replica_init import (
    assert_replicas_identical,
    build_replicated_model,
    build_sharded_model,
)
from strategy_config import DistributedConfig

logger = logging.getLogger(__name__)

ModelFactory = Callable[..., nn.Module]


def resolve_config(config: DistributedConfig | Mapping[str, Any] | str | None) -> DistributedConfig:
    """A :class:`DistributedConfig` from a config, a ``training.distributed`` mapping, or a name.

    Args:
        config: A ``DistributedConfig``; a mapping of the section's keys; a strategy name
            (``"ddp"``, ``"fsdp"``, any case); or ``None`` for the defaults.

    Returns:
        The validated config.

    Raises:
        TypeError: If ``config`` has another type, or a value has the wrong type.
        ValueError: If a value is invalid (strategy-config's messages).
    """
    if isinstance(config, DistributedConfig):
        return config
    if config is None or isinstance(config, str):
        return DistributedConfig(strategy=config)  # type: ignore[arg-type]
    if isinstance(config, Mapping):
        return DistributedConfig.from_mapping(config)
    raise TypeError(
        "config must be a DistributedConfig, a training.distributed mapping or a strategy name, "
        f"got {type(config).__name__} ({config!r})"
    )


def prepare_model(
    model_cls: ModelFactory,
    init_params: Mapping[str, Any] | None,
    *,
    config: DistributedConfig | Mapping[str, Any] | str | None,
    device: DeviceLike,
    default_dtype: torch.dtype,
    seed: int,
    trainable: TrainablePolicy | None = None,
    forward_methods: Iterable[str] = (),
    verify: bool = True,
    source: str | None = None,
    shard: ShardPolicy | None = None,
    pretrained: str | os.PathLike[str] | None = None,
) -> nn.Module:
    """Build the model on every rank and wrap it for the configured strategy.

    The stages, each a named step below: plan (normalise ``config``, check the arguments,
    build HSDP's mesh); build with replica-init (``source`` from the argument, else from
    ``config.source``) or from ``pretrained``; apply ``trainable``; verify; the recipe per
    block (``config.activation_checkpointing``, then ``config.compile``: see
    :func:`apply_block_recipe`; the blocks are the shard policy's units, or the whole model
    when it has none); wrap (DDP: the model; FSDP/HSDP: each unit, then the root, with
    ``config.offload``); report one summary line on rank 0 with each stage's time and memory
    peaks (host RSS growth; on CUDA the device allocator's peak).

    - DDP: a full replica on every device (``build_replicated_model``),
      proven identical across ranks, wrapped with ddp-wrap.
    - FSDP and HSDP: the whole model never reaches the device (``build_sharded_model``);
      HSDP shards over a 2-D mesh (``config.replicate`` x ``config.shard``, see
      ``DistributedConfig.hsdp_mesh_shape``), each replica holding the same shards. Under
      ``source="local"`` every rank builds it on the CPU and fsdp-wrap moves it to the device
      unit by unit, keeping only this rank's shards; under ``"rank0"`` only rank 0 builds it
      (on the CPU), the others build on the meta device, and rank 0's tensors are streamed
      into everyone's shards in bounded buckets. Verification then costs O(model / world) per
      rank: each rank's shards are checked against a second rank's copy (see
      ``build_sharded_model``).

    Args:
        model_cls: The model class or a factory returning an ``nn.Module``.
        init_params: Keyword arguments for ``model_cls``, or ``None``.
        config: The ``training.distributed`` section: a ``DistributedConfig``, a mapping, or
            just a strategy name.
        device: This rank's device (``torch.device``, string, or CUDA index).
        default_dtype: The floating default dtype during construction (``torch.float32``).
        seed: The construction seed, the same on every rank.
        trainable: The trainer's trainable policy, called on the built model before the wrap
            (freeze encoders here: the wrap must see the final ``requires_grad`` set). It may
            return ``None`` (it changed the model in place) or the module to use.
        forward_methods: Methods of the model that the trainer calls instead of ``forward``
            (an ODE sampler's ``ode_wrapper``): routed through DDP's forward, or registered with
            FSDP2 so that they gather the root's parameters.
        verify: Check that every rank holds the same replica (DDP, before the wrap) or that
            every rank's shards are the built model's (FSDP, after the wrap).
        source: ``"local"`` or ``"rank0"``; ``None`` takes ``config.source``.
        shard: FSDP's shard policy (see ``wrap_module_fsdp``); ignored for DDP.
        pretrained: A Hugging Face safetensors directory or file to start from instead of
            the seeded init: the model is built with its parameters on the meta device (no
            init, no whole copy), sharded (FSDP/HSDP), given storage on the device and loaded
            by ``hf_io.load_pretrained``, each rank reading only its slices; buffers the file
            lacks keep the constructor's values. ``seed`` and ``source`` are then unused, and
            FSDP's shard check against a second copy is skipped (the file is the reference);
            DDP's replicas are still checked when ``verify``.

    Returns:
        The wrapped model: a ``DelegatingDistributedDataParallel`` for DDP, the sharded model
        itself for FSDP.

    Raises:
        RuntimeError: If the default process group is not initialized (before anything is
            built); ``ReplicaMismatchError`` if the replicas differ.
        TypeError: If an argument has the wrong type (the argument is named).
        ValueError: If a config value is invalid, with strategy-config's message.
    """
    require_process_group("prepare_model", instead="before preparing the model")
    plan = _plan(config, source, trainable, forward_methods, device, shard)
    build = _Build(model_cls, init_params, default_dtype, seed, verify, pretrained)
    if plan.settings.is_ddp:
        wrapped, fingerprint = _replicated(plan, build)
    else:
        wrapped, fingerprint = _sharded(plan, build)
    _report(plan, build, fingerprint)
    return wrapped


@dataclasses.dataclass
class _Plan:
    """What prepare_model was asked, resolved: the settings, the device, the mesh, the stages."""

    settings: DistributedConfig
    trainable: TrainablePolicy | None
    names: tuple[str, ...]
    target: torch.device
    shard: ShardPolicy | None
    stages: Stages
    mesh: Any = None
    shard_degree: int | None = None
    counted: dict[str, int] = dataclasses.field(default_factory=dict)
    model_name: str = ""


@dataclasses.dataclass(frozen=True)
class _Build:
    """How the model is built: the factory, its arguments, the seed or the pretrained file."""

    model_cls: ModelFactory
    init_params: Mapping[str, Any] | None
    default_dtype: torch.dtype
    seed: int
    verify: bool
    pretrained: str | os.PathLike[str] | None


def _plan(
    config: DistributedConfig | Mapping[str, Any] | str | None,
    source: str | None,
    trainable: TrainablePolicy | None,
    forward_methods: Iterable[str],
    device: DeviceLike,
    shard: ShardPolicy | None,
) -> _Plan:
    """Stage 1: the config normalized, the arguments checked, HSDP's mesh built."""
    settings = resolve_config(config)
    if source is not None:
        settings = DistributedConfig.from_mapping({**settings.to_dict(), "source": source})
    if trainable is not None and not callable(trainable):
        raise TypeError(
            f"trainable must be a callable taking the model, got {type(trainable).__name__} "
            f"({trainable!r})"
        )
    target = resolve_device(device)
    plan = _Plan(settings, trainable, tuple(forward_methods), target, shard, Stages(target))
    if settings.fault_tolerance is not None:  # DDP or HSDP (strategy-config refuses FSDP)
        check_lighthouse(settings.fault_tolerance)  # before anything is built
    if settings.strategy == "hsdp":
        replicate, plan.shard_degree = settings.hsdp_mesh_shape(dist.get_world_size())
        plan.mesh = hsdp_mesh(target, replicate=replicate, shard=plan.shard_degree)
    return plan


def _policy(plan: _Plan) -> Callable[[nn.Module], nn.Module]:
    """Stage 2's end: the trainer's trainable policy, with the parameters counted."""

    def policy(model: nn.Module) -> nn.Module:
        model = apply_trainable(model, plan.trainable)
        plan.counted["total"] = sum(p.numel() for p in model.parameters())
        plan.counted["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return model

    return policy


def _recipe(plan: _Plan, model: nn.Module) -> nn.Module:
    """Stage 3: the recipe per block, before the wrap: checkpointing, then compile."""
    settings = plan.settings
    if settings.activation_checkpointing != "none" or settings.compile:
        with plan.stages("recipe"):
            apply_block_recipe(
                recipe_blocks(model, plan.shard),
                checkpointing=settings.activation_checkpointing,
                compile=settings.compile,
            )
    return model


def _replicated(plan: _Plan, build: _Build) -> tuple[nn.Module, str | None]:
    """DDP: a full replica on every device (seeded or loaded), verified, recipe, wrapped."""
    if build.pretrained is not None:
        model = _from_file(plan, build, None)
    else:
        with plan.stages("build"):
            model = build_replicated_model(
                build.model_cls,
                build.init_params,
                device=plan.target,
                default_dtype=build.default_dtype,
                seed=build.seed,
                source=plan.settings.source,
            )
        with plan.stages("trainable"):
            model = _policy(plan)(model)
    fingerprint = None
    if build.verify:
        with plan.stages("verify"):
            fingerprint = assert_replicas_identical(model)
    plan.model_name = type(model).__name__
    model = _recipe(plan, model)
    with plan.stages("wrap"):
        wrapped = wrap_module_ddp(
            model, device=plan.target, forward_methods=plan.names, **plan.settings.ddp_options()
        )
    return _managed(plan, wrapped), fingerprint


def _sharded(plan: _Plan, build: _Build) -> tuple[nn.Module, str | None]:
    """FSDP and HSDP: built on the host (or meta) or loaded, recipe, sharded unit by unit."""

    def shard_it(model: nn.Module) -> nn.Module:
        plan.model_name = type(model).__name__  # before FSDP2 swaps the class
        return wrap_module_fsdp(
            _recipe(plan, model),
            device=plan.target,
            shard=plan.shard,
            mesh=plan.mesh,
            forward_methods=plan.names,
            **plan.settings.fsdp_options(),
        )

    if build.pretrained is not None:  # sharded on meta, then each rank loads its slices
        return _managed(plan, _from_file(plan, build, shard_it)), None
    built = build_sharded_model(
        build.model_cls,
        build.init_params,
        device=plan.target,
        default_dtype=build.default_dtype,
        seed=build.seed,
        shard=shard_it,
        source=plan.settings.source,
        trainable=_policy(plan),
        verify=build.verify,
        stage=plan.stages,
        shard_degree=plan.shard_degree,
    )
    return _managed(plan, built.module), built.fingerprint


def _managed(plan: _Plan, model: nn.Module) -> nn.Module:
    """Under ``fault_tolerance``: the group's Manager attached, its reductions across groups."""
    if plan.settings.fault_tolerance is not None:
        attach_fault_tolerance(model, plan.settings.fault_tolerance, plan.target)
    return model


def _from_file(
    plan: _Plan, build: _Build, wrap: Callable[[nn.Module], nn.Module] | None
) -> nn.Module:
    assert build.pretrained is not None
    return build_pretrained(
        build.model_cls,
        build.init_params,
        path=build.pretrained,
        device=plan.target,
        default_dtype=build.default_dtype,
        policy=_policy(plan),
        wrap=wrap,
        stages=plan.stages,
    )


def _report(plan: _Plan, build: _Build, fingerprint: str | None) -> None:
    """The last stage: one summary line on rank 0, each stage's time and memory."""
    settings = plan.settings
    recipe = [
        f"checkpointing={settings.activation_checkpointing}",
        f"compile={settings.compile}",
        f"offload={settings.offload}",
    ]
    log_rank0(
        logger,
        logging.INFO,
        "prepared %s for %s on %d rank(s): %d parameters, %d trainable, source=%s, %s %s; %s; %s",
        plan.model_name,
        settings.strategy.upper(),
        dist.get_world_size(),
        plan.counted["total"],
        plan.counted["trainable"],
        "pretrained" if build.pretrained is not None else settings.source,
        "replicas" if settings.is_ddp else "shards",
        ("identical" if settings.is_ddp else "verified") + f" ({fingerprint[:12]})"
        if fingerprint
        else "not verified",
        ", ".join(recipe),
        plan.stages.summary(),
    )
