"""The ``training.distributed`` section as a validated, frozen dataclass."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, ClassVar

from strategy_config._fault_tolerance import FaultToleranceConfig, check_strategy
from strategy_config._hints import did_you_mean
from strategy_config._recipe import normalize_checkpointing, normalize_offload
from strategy_config._strategy import normalize_distributed_strategy, read_key

SECTION_PATH = "training.distributed"

DTYPE_NAMES: frozenset[str] = frozenset({"bf16", "fp16", "fp32"})
_DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
}

BUILD_SOURCES: frozenset[str] = frozenset({"local", "rank0"})


def normalize_dtype_name(value: str | None, *, path: str = "dtype") -> str | None:
    """Return the canonical mixed-precision dtype name (``"bf16"``, ``"fp16"``, ``"fp32"``).

    Args:
        value: A dtype name such as ``"bf16"``, ``"bfloat16"`` or ``"float32"`` (any case),
            or ``None`` for "not set".
        path: The config path named in error messages.

    Returns:
        The canonical name, or ``None`` when ``value`` is ``None``.

    Raises:
        TypeError: If ``value`` is not a string or ``None``.
        ValueError: If the name is unknown; the message lists the valid names.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(
            f"{path} must be a dtype name (str) or None, got {type(value).__name__} ({value!r})"
        )
    key = value.strip().lower()
    if key not in _DTYPE_ALIASES:
        valid = ", ".join(sorted(_DTYPE_ALIASES))
        raise ValueError(
            f"{path} must be one of {{{valid}}}, got {value!r}{did_you_mean(key, _DTYPE_ALIASES)}"
        )
    return _DTYPE_ALIASES[key]


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """The validated ``training.distributed`` section.

    Every field is checked on construction; string fields are normalised (``strategy`` to
    ``"ddp"``/``"fsdp"``/``"hsdp"``, dtypes to ``"bf16"``/``"fp16"``/``"fp32"``). HSDP's
    degrees are checked against the world size when the mesh is built
    (:meth:`hsdp_mesh_shape`).

    Attributes:
        strategy: ``"ddp"``, ``"fsdp"`` (the default) or ``"hsdp"`` (FSDP sharded within a
            group of ``shard`` ranks, replicated across ``replicate`` such groups).
        source: How replicas are built: ``"local"`` (every rank constructs) or ``"rank0"``
            (rank 0 constructs, the others receive a broadcast).
        broadcast_buffers: DDP: sync buffers from rank 0 at init and before each forward.
        find_unused_parameters: DDP: tolerate parameters that get no gradient in a step.
        gradient_as_bucket_view: DDP: gradients are views into the communication buckets.
        static_graph: DDP: the set of used parameters is the same every step.
        bucket_cap_mb: DDP: gradient bucket size in MiB; ``None`` keeps torch's default.
        reshard_after_forward: FSDP: free the unsharded parameters after forward.
        param_dtype: FSDP mixed precision: dtype of the unsharded parameters in compute.
        reduce_dtype: FSDP mixed precision: dtype of the gradient reduction.
        replicate: HSDP: the number of replicas (the mesh's first dimension); ``None``: the
            world size divided by ``shard``.
        shard: HSDP: the ranks each replica is sharded over (the mesh's second dimension,
            inside a node); ``None``: the ranks per node (``LOCAL_WORLD_SIZE``).
        activation_checkpointing: Per block: ``"none"`` (the default), ``"full"`` (recompute
            the block in backward) or ``"selective"`` (keep matmul and attention outputs,
            recompute the rest). Changes no bit of the gradients.
        compile: Compile each block with ``torch.compile`` (inductor) before the wrap.
        offload: ``"none"`` (the default) or ``"cpu"``: FSDP2's CPU offload of the sharded
            parameters, gradients and optimizer state (FSDP and HSDP only).
        fault_tolerance: torchft's replica groups (:class:`FaultToleranceConfig`, from a
            mapping); DDP and HSDP only. ``None`` (the default): a failure stops the job.
    """

    strategy: str = "fsdp"
    source: str = "local"
    broadcast_buffers: bool = False
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    bucket_cap_mb: float | None = None
    reshard_after_forward: bool = True
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    replicate: int | None = None
    shard: int | None = None
    activation_checkpointing: str = "none"
    compile: bool = False
    offload: str = "none"
    fault_tolerance: FaultToleranceConfig | None = None

    _BOOL_FIELDS: ClassVar[tuple[str, ...]] = (
        "broadcast_buffers",
        "find_unused_parameters",
        "gradient_as_bucket_view",
        "static_graph",
        "reshard_after_forward",
        "compile",
    )

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "strategy", normalize_distributed_strategy(self.strategy))
        for name in self._BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(_type_message(name, "bool (true or false)", value))
        set_(self, "source", _check_source(self.source))
        set_(self, "bucket_cap_mb", _check_bucket_cap(self.bucket_cap_mb))
        for name in ("param_dtype", "reduce_dtype"):
            set_(self, name, normalize_dtype_name(getattr(self, name), path=_path(name)))
        for name in ("replicate", "shard"):
            _check_degree(name, getattr(self, name), self.strategy)
        set_(
            self,
            "activation_checkpointing",
            normalize_checkpointing(
                self.activation_checkpointing, path=_path("activation_checkpointing")
            ),
        )
        set_(
            self,
            "offload",
            normalize_offload(self.offload, path=_path("offload"), strategy=self.strategy),
        )
        if self.fault_tolerance is not None:
            set_(self, "fault_tolerance", FaultToleranceConfig.from_mapping(self.fault_tolerance))
            check_strategy(self.strategy, static_graph=self.static_graph)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> DistributedConfig:
        """Build the section from a mapping (a parsed YAML/JSON dict or an OmegaConf node).

        Args:
            mapping: Keys are the field names; missing keys take their defaults.

        Returns:
            The validated config.

        Raises:
            TypeError: If ``mapping`` is not a mapping, or a value has the wrong type (the
                message names the dotted path, the expected type and the value).
            ValueError: If a key is unknown (each is named with the closest known key), or a
                value is out of range.
        """
        if not isinstance(mapping, Mapping):
            raise TypeError(
                f"{SECTION_PATH} must be a mapping, got {type(mapping).__name__} ({mapping!r})"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = [str(key) for key in mapping if key not in known]
        if unknown:
            listed = ", ".join(f"'{k}'{did_you_mean(k, known)}" for k in unknown)
            raise ValueError(
                f"unknown key(s) in {SECTION_PATH}: {listed}; known keys are "
                f"{', '.join(sorted(known))}"
            )
        return cls(**{str(key): value for key, value in mapping.items()})

    def to_dict(self) -> dict[str, Any]:
        """The section as a plain dict that :meth:`from_mapping` accepts back."""
        return dataclasses.asdict(self)

    @property
    def is_ddp(self) -> bool:
        """Whether this config selects DDP."""
        return self.strategy == "ddp"

    def ddp_options(self) -> dict[str, Any]:
        """Keyword arguments for ``DistributedDataParallel`` (``bucket_cap_mb`` only when set).

        Under ``fault_tolerance``, ``find_unused_parameters`` is ``True``: DDP then keeps the
        bucket layout it built at construction (it never rebuilds it from the first backward's
        order), so a group that joins late reduces the same layout as groups long past their
        first step.
        """
        options: dict[str, Any] = {
            "broadcast_buffers": self.broadcast_buffers,
            "find_unused_parameters": self.find_unused_parameters
            or self.fault_tolerance is not None,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "static_graph": self.static_graph,
        }
        if self.bucket_cap_mb is not None:
            options["bucket_cap_mb"] = self.bucket_cap_mb
        return options

    def hsdp_mesh_shape(
        self, world_size: int, local_world_size: int | None = None
    ) -> tuple[int, int]:
        """HSDP's mesh, ``(replicate, shard)``, for ``world_size`` ranks.

        Args:
            world_size: The number of ranks.
            local_world_size: The ranks per node; ``None`` reads ``LOCAL_WORLD_SIZE`` (set by
                torchrun), else takes ``world_size`` (one node).

        Returns:
            ``(replicate, shard)`` with ``replicate * shard == world_size``.

        Raises:
            ValueError: If the strategy is not HSDP, or the degrees do not fit the world:
                their product is not the world size, or ``shard`` does not divide the ranks
                per node (a shard group would span nodes). The message names the keys.
        """
        if self.strategy != "hsdp":
            raise ValueError(
                f"{_path('strategy')} is {self.strategy!r}: only HSDP has a 2-D mesh; set "
                "strategy: hsdp"
            )
        local = local_world_size if local_world_size is not None else _local_world(world_size)
        shard = self.shard if self.shard is not None else local
        if self.replicate is not None and self.shard is None and world_size % self.replicate == 0:
            shard = world_size // self.replicate
        replicate = self.replicate if self.replicate is not None else max(1, world_size // shard)
        if replicate * shard != world_size:
            raise ValueError(
                f"{_path('replicate')} * {_path('shard')} must equal the world size "
                f"{world_size}, got {replicate} * {shard} = {replicate * shard}; e.g. "
                f"replicate: {max(1, world_size // local)}, shard: {min(local, world_size)}"
            )
        if local % shard != 0:
            raise ValueError(
                f"{_path('shard')}={shard} must divide the ranks per node "
                f"(LOCAL_WORLD_SIZE={local}), so that each shard group stays inside a node; "
                f"use a divisor of {local}"
            )
        return replicate, shard

    def fsdp_options(self) -> dict[str, Any]:
        """Keyword arguments for an FSDP wrapper: resharding, dtype names, CPU offload."""
        return {
            "reshard_after_forward": self.reshard_after_forward,
            "param_dtype": self.param_dtype,
            "reduce_dtype": self.reduce_dtype,
            "offload": self.offload == "cpu",
        }


def load_distributed_config(training_config: Any) -> DistributedConfig:
    """Read and validate ``training_config.distributed``.

    Args:
        training_config: The ``training`` section: an attribute object (dataclass, namespace,
            OmegaConf ``DictConfig``) or a mapping. Its ``distributed`` entry may be a mapping,
            an attribute object, a :class:`DistributedConfig`, or missing (all defaults).

    Returns:
        The validated config.

    Raises:
        TypeError: See :meth:`DistributedConfig.from_mapping`.
        ValueError: See :meth:`DistributedConfig.from_mapping`.
    """
    section = read_key(training_config, "distributed")
    if section is None:
        return DistributedConfig()
    if isinstance(section, DistributedConfig):
        return section
    if isinstance(section, Mapping):
        return DistributedConfig.from_mapping(section)
    if dataclasses.is_dataclass(section) and not isinstance(section, type):
        return DistributedConfig.from_mapping(
            {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
        )
    if hasattr(section, "__dict__"):
        return DistributedConfig.from_mapping(
            {k: v for k, v in vars(section).items() if not k.startswith("_")}
        )
    raise TypeError(
        f"{SECTION_PATH} must be a mapping or an attribute object, got "
        f"{type(section).__name__} ({section!r})"
    )


def _path(name: str) -> str:
    return f"{SECTION_PATH}.{name}"


def _type_message(name: str, expected: str, value: object) -> str:
    return (
        f"{_path(name)} must be {expected}, got {type(value).__name__} ({value!r}); "
        f"set it to a {expected} value"
    )


def _check_source(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(_type_message("source", "str", value))
    normalized = value.strip().lower()
    if normalized not in BUILD_SOURCES:
        raise ValueError(
            f"{_path('source')} must be one of {{local, rank0}}, got {value!r}"
            f"{did_you_mean(normalized, BUILD_SOURCES)}"
        )
    return normalized


def _local_world(world_size: int) -> int:
    text = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if not text:
        return world_size
    try:
        value = int(text)
    except ValueError:
        raise ValueError(
            f"LOCAL_WORLD_SIZE must be an integer (the ranks per node), got {text!r}"
        ) from None
    return value if value > 0 else world_size


def _check_degree(name: str, value: object, strategy: str) -> None:
    if value is None:
        return
    if strategy != "hsdp":
        raise ValueError(
            f"{_path(name)} is an HSDP degree, but {_path('strategy')} is {strategy!r}; set "
            f"strategy: hsdp, or remove {name}"
        )
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(_type_message(name, "int (a number of ranks)", value))
    if value < 1:
        raise ValueError(f"{_path(name)} must be >= 1 (a number of ranks), got {value}")


def _check_bucket_cap(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(_type_message("bucket_cap_mb", "number (MiB) or null", value))
    if not value > 0:
        raise ValueError(
            f"{_path('bucket_cap_mb')} must be a positive number of MiB, got {value!r}; "
            "use e.g. 25 (torch's default)"
        )
    return value
