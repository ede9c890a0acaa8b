"""``prepare_model``: normalise, build, apply the trainable policy, verify, wrap, report."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_wrap import wrap_module_ddp
from dist_core import DeviceLike, MemoryPeak, log_rank0, require_process_group, resolve_device
from distributed_strategy._pretrained import build_pretrained
from fsdp_wrap import ShardPolicy, hsdp_mesh, wrap_module_fsdp
from replica_init import (
    assert_replicas_identical,
    build_replicated_model,
    build_sharded_model,
)
from strategy_config import DistributedConfig

logger = logging.getLogger(__name__)

ModelFactory = Callable[..., nn.Module]
TrainablePolicy = Callable[[nn.Module], nn.Module | None]


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

    The pipeline: normalise ``config``; build with replica-init (``source`` from the argument,
    else from ``config.source``); apply ``trainable``; verify; wrap; log one summary line on
    rank 0 with each stage's time and memory peaks (host RSS growth; on CUDA the device
    allocator's peak).

    - DDP (the seed's path): a full replica on every device (``build_replicated_model``),
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
            (MMAudio's ``ode_wrapper``): routed through DDP's forward, or registered with
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
    settings = resolve_config(config)
    if source is not None:
        settings = DistributedConfig.from_mapping({**settings.to_dict(), "source": source})
    if trainable is not None and not callable(trainable):
        raise TypeError(
            f"trainable must be a callable taking the model, got {type(trainable).__name__} "
            f"({trainable!r})"
        )
    names = tuple(forward_methods)
    target = resolve_device(device)
    stages = _Stages(target)
    counted: dict[str, int] = {}

    def policy(model: nn.Module) -> nn.Module:
        model = _apply_trainable(model, trainable)
        counted["total"] = sum(p.numel() for p in model.parameters())
        counted["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return model

    model_name = ""
    mesh = None
    shard_degree = None
    if settings.strategy == "hsdp":
        replicate, shard_degree = settings.hsdp_mesh_shape(dist.get_world_size())
        mesh = hsdp_mesh(target, replicate=replicate, shard=shard_degree)

    def shard_it(model: nn.Module) -> nn.Module:
        nonlocal model_name
        model_name = type(model).__name__  # before FSDP2 swaps the class
        return wrap_module_fsdp(
            model,
            device=target,
            shard=shard,
            mesh=mesh,
            forward_methods=names,
            **settings.fsdp_options(),
        )

    def from_file(wrap: Callable[[nn.Module], nn.Module] | None) -> nn.Module:
        assert pretrained is not None
        return build_pretrained(
            model_cls,
            init_params,
            path=pretrained,
            device=target,
            default_dtype=default_dtype,
            policy=policy,
            wrap=wrap,
            stages=stages,
        )

    fingerprint: str | None = None
    wrapped: nn.Module
    if settings.is_ddp:  # a full replica on every device: seeded (the seed's path) or loaded
        if pretrained is not None:
            model = from_file(None)
        else:
            with stages("build"):
                model = build_replicated_model(
                    model_cls,
                    init_params,
                    device=target,
                    default_dtype=default_dtype,
                    seed=seed,
                    source=settings.source,
                )
            with stages("trainable"):
                model = policy(model)
        if verify:
            with stages("verify"):
                fingerprint = assert_replicas_identical(model)
        model_name = type(model).__name__
        with stages("wrap"):
            wrapped = wrap_module_ddp(
                model, device=target, forward_methods=names, **settings.ddp_options()
            )
    elif pretrained is not None:  # sharded on meta, then each rank loads its slices
        wrapped = from_file(shard_it)
    else:  # never the whole model on the device: built on the host (or meta), then sharded
        built = build_sharded_model(
            model_cls,
            init_params,
            device=target,
            default_dtype=default_dtype,
            seed=seed,
            shard=shard_it,
            source=settings.source,
            trainable=policy,
            verify=verify,
            stage=stages,
            shard_degree=shard_degree,
        )
        wrapped, fingerprint = built.module, built.fingerprint
    log_rank0(
        logger,
        logging.INFO,
        "prepared %s for %s on %d rank(s): %d parameters, %d trainable, source=%s, %s %s; %s",
        model_name,
        settings.strategy.upper(),
        dist.get_world_size(),
        counted["total"],
        counted["trainable"],
        "pretrained" if pretrained is not None else settings.source,
        "replicas" if settings.is_ddp else "shards",
        ("identical" if settings.is_ddp else "verified") + f" ({fingerprint[:12]})"
        if fingerprint
        else "not verified",
        stages.summary(),
    )
    return wrapped


def _apply_trainable(model: nn.Module, trainable: TrainablePolicy | None) -> nn.Module:
    if trainable is None:
        return model
    name = getattr(trainable, "__name__", None) or repr(trainable)
    result = trainable(model)
    if result is not None and not isinstance(result, nn.Module):
        raise TypeError(
            "the trainable policy must change the model in place and return None, or return an "
            f"nn.Module; {name!r} returned {type(result).__name__}"
        )
    if result is not None and result is not model and _is_submodule(model, result):
        raise TypeError(
            f"the trainable policy {name!r} returned {type(result).__name__}, a submodule of "
            f"the built {type(model).__name__}: the whole model would be replaced by that part "
            "(requires_grad_() returns the module it is called on). Return None (change the "
            "model in place) or the whole model"
        )
    model = model if result is None else result
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"the trainable policy {name!r} left no trainable parameter in "
            f"{type(model).__name__}; make at least one parameter require grad, or do not "
            "wrap the model"
        )
    return model


def _is_submodule(model: nn.Module, candidate: nn.Module) -> bool:
    return any(candidate is sub for sub in model.modules())


class _Stages:
    """Each stage's time and memory peaks (host RSS, device allocator), summed over entries."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._seconds: dict[str, float] = {}
        self._host: dict[str, int] = {}
        self._device_peak: dict[str, int] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        peak = MemoryPeak(self._device, interval=0.005)
        try:
            with peak:
                yield
        finally:
            self._seconds[stage] = self._seconds.get(stage, 0.0) + time.perf_counter() - start
            self._host[stage] = max(self._host.get(stage, 0), peak.host_growth)
            self._device_peak[stage] = max(self._device_peak.get(stage, 0), peak.device_peak)

    def summary(self) -> str:
        """``build 12.3 ms (host +40.0 MiB), ...``; the device's peak where it keeps one."""
        parts = []
        for stage, seconds in self._seconds.items():
            memory = f"host +{self._host[stage] / 2**20:.1f} MiB"
            if self._device.type == "cuda":
                memory += f", device peak {self._device_peak[stage] / 2**20:.1f} MiB"
            parts.append(f"{stage} {seconds * 1e3:.1f} ms ({memory})")
        return ", ".join(parts)
