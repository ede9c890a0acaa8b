"""``prepare_model``: normalise, build, apply the trainable policy, verify, wrap, report."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_wrap import wrap_module_ddp
from dist_core import DeviceLike, log_rank0, require_process_group
from fsdp_wrap import ShardPolicy, wrap_module_fsdp
from replica_init import assert_replicas_identical, build_replicated_model
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
) -> nn.Module:
    """Build the model on every rank and wrap it for the configured strategy.

    The pipeline: normalise ``config``; build the replica with replica-init (``source`` from
    the argument, else from ``config.source``); apply ``trainable``; prove the replicas are
    identical across ranks (``verify``); wrap with ddp-wrap (DDP options from the config) or
    fsdp-wrap (FSDP options from the config); log one summary line on rank 0 with the time of
    each stage.

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
        verify: Check that every rank holds the same replica before wrapping.
        source: ``"local"`` or ``"rank0"``; ``None`` takes ``config.source``.
        shard: FSDP's shard policy (see ``wrap_module_fsdp``); ignored for DDP.

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
    stages: dict[str, float] = {}
    with _timed(stages, "build"):
        model = build_replicated_model(
            model_cls,
            init_params,
            device=device,
            default_dtype=default_dtype,
            seed=seed,
            source=settings.source,
        )
    with _timed(stages, "trainable"):
        model = _apply_trainable(model, trainable)
    fingerprint = None
    if verify:
        with _timed(stages, "verify"):
            fingerprint = assert_replicas_identical(model)
    model_name = type(model).__name__  # before FSDP2 swaps the class
    total = sum(p.numel() for p in model.parameters())
    trainable_count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with _timed(stages, "wrap"):
        wrapped: nn.Module
        if settings.is_ddp:
            wrapped = wrap_module_ddp(
                model, device=device, forward_methods=names, **settings.ddp_options()
            )
        else:
            wrapped = wrap_module_fsdp(
                model, device=device, shard=shard, forward_methods=names, **settings.fsdp_options()
            )
    log_rank0(
        logger,
        logging.INFO,
        "prepared %s for %s on %d rank(s): %d parameters, %d trainable, source=%s, replicas %s; %s",
        model_name,
        settings.strategy.upper(),
        dist.get_world_size(),
        total,
        trainable_count,
        settings.source,
        f"identical ({fingerprint[:12]})" if fingerprint else "not verified",
        ", ".join(f"{stage} {seconds * 1e3:.1f} ms" for stage, seconds in stages.items()),
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


@contextmanager
def _timed(stages: dict[str, float], stage: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        stages[stage] = time.perf_counter() - start
