"""What is benchmarked: a model factory, its arguments, batches, and the training loss."""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from strategy_bench._errors import BenchUsageError
from strategy_bench.workload._presets import (
    PRESETS,
    BenchTransformer,
    next_token_loss,
    synthetic_tokens,
)

BatchFactory = Callable[[int, torch.device, torch.Generator], Any]


@dataclasses.dataclass(frozen=True)
class Workload:
    """One model to benchmark, built and fed the same way on every rank.

    Attributes:
        name: The label in results and plots.
        factory: Model class or factory returning an ``nn.Module``.
        init_params: Keyword arguments for ``factory``.
        make_batch: ``(batch_size, device, generator) -> batch`` for one rank.
        loss: ``(model, batch) -> scalar loss``.
        tokens_per_sample: Tokens in one sample, or ``None`` when unknown.
        flops_per_sample: Training FLOPs per sample, or ``None`` when unknown (no MFU).
        trainable: Optional trainable policy applied before the wrap.
    """

    name: str
    factory: Callable[..., nn.Module]
    init_params: Mapping[str, Any]
    make_batch: BatchFactory
    loss: Callable[[nn.Module, Any], torch.Tensor]
    tokens_per_sample: int | None = None
    flops_per_sample: float | None = None
    trainable: Callable[[nn.Module], Any] | None = None

    def with_trainable(self, model: nn.Module) -> nn.Module:
        """``model`` after the trainable policy (which may return the model or ``None``)."""
        if self.trainable is None:
            return model
        result = self.trainable(model)
        return result if isinstance(result, nn.Module) else model

    def meta_model(self) -> nn.Module:
        """The model on the meta device (no memory), with its trainable policy applied.

        What the estimate wraps and steps on fake tensors, and what ``run`` counts FLOPs on.

        Raises:
            BenchUsageError: If the factory cannot build the model on the meta device.
        """
        try:
            with torch.device("meta"):
                model = self.factory(**self.init_params)
        except BenchUsageError:
            raise  # the factory's own one line (--hf-config's), not a meta-device failure
        except Exception as error:
            raise BenchUsageError(
                f"the model is built on the meta device (no memory), and "
                f"{self.name}(**{dict(self.init_params)}) failed there: "
                f"{type(error).__name__}: {error}; keep its constructor free of data-dependent "
                "work (.item(), numpy on parameters, loading weights)"
            ) from None
        if not isinstance(model, nn.Module):
            raise BenchUsageError(
                f"the model factory {self.name!r} returned {type(model).__name__}, not an nn.Module"
            )
        return self.with_trainable(model)


def preset_workload(name: str, *, seq_len: int | None = None) -> Workload:
    """The workload of a preset model size (``tiny``, ``small``, ``medium``, ``large``)."""
    preset = PRESETS[name]
    if seq_len is not None:
        preset = dataclasses.replace(preset, seq_len=seq_len)

    def make_batch(batch_size: int, device: torch.device, generator: torch.Generator) -> Any:
        return synthetic_tokens(batch_size, preset.seq_len, preset.vocab, device, generator)

    return Workload(
        name=name,
        factory=BenchTransformer,
        init_params=preset.init_params(),
        make_batch=make_batch,
        loss=next_token_loss,
        tokens_per_sample=preset.seq_len,
        flops_per_sample=preset.flops_per_sample(),
    )


def user_workload(
    model_factory: str,
    init_params: str | None,
    input_factory: str,
    trainable: str | None = None,
    *,
    tokens_per_sample: int | None = None,
) -> Workload:
    """A workload from the user's ``package.module:callable`` factories.

    ``tokens_per_sample``: the tokens in one sample of the input factory's batches, where
    the user knows them (``--tokens-per-sample``), for tokens/s.

    The input factory is called as ``input_factory(batch_size, device, generator)`` and returns
    one batch for one rank: a tensor (``model(batch)``), a tuple or list
    (``model(*batch)``) or a dict (``model(**batch)``). The loss is the model's output when it
    is a scalar, else the mean square of its (first) output: a synthetic objective whose
    backward pass touches every parameter that the forward used.

    Raises:
        BenchUsageError: If a factory cannot be imported or is not callable, or the init
            parameters are not a JSON object.
    """
    factory = load_callable(model_factory, argument="--model-factory")
    batches = load_callable(input_factory, argument="--input-factory")
    policy = None if trainable is None else load_callable(trainable, argument="--trainable")
    params = parse_init_params(init_params)
    return Workload(
        name=model_factory.rsplit(":", 1)[-1],
        factory=factory,
        init_params=params,
        make_batch=batches,
        loss=output_loss,
        tokens_per_sample=tokens_per_sample,
        trainable=policy,
    )


def parse_init_params(text: str | None) -> dict[str, Any]:
    """``--init-params``: a JSON object, or nothing."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise BenchUsageError(
            f"--init-params must be a JSON object such as '{{\"width\": 512}}', got {text!r} "
            f"({error.msg})"
        ) from None
    if not isinstance(value, dict):
        raise BenchUsageError(
            f"--init-params must be a JSON object such as '{{\"width\": 512}}', got {text!r}"
        )
    return value


def load_callable(spec: str, *, argument: str) -> Callable[..., Any]:
    """Import ``package.module:callable`` (dots allowed after the colon for attributes)."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise BenchUsageError(f"{argument} must look like 'package.module:callable', got {spec!r}")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or whatever the module raised at import
        raise BenchUsageError(
            f"{argument} {spec!r}: cannot import module {module_name!r} "
            f"({type(error).__name__}: {error}); is it on PYTHONPATH?"
        ) from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            owner = getattr(target, "__name__", repr(target))
            raise BenchUsageError(f"{argument} {spec!r}: {owner} has no attribute {part!r}")
        target = getattr(target, part)
    if not callable(target):
        raise BenchUsageError(
            f"{argument} {spec!r} is a {type(target).__name__}, not a callable; name a class or "
            "a function"
        )
    return target  # type: ignore[no-any-return]


def check_workload(workload: Workload, batch_size: int) -> None:
    """Build the model once on the meta device and one batch on CPU, to fail before spawning.

    A model that cannot be constructed on the meta device is not judged here; the ranks
    build it for real and report its error.

    Raises:
        BenchUsageError: If the factory does not return an ``nn.Module`` or the input factory
            does not return a tensor, a tuple/list or a dict.
    """
    try:
        with torch.device("meta"):
            model = workload.factory(**workload.init_params)
    except Exception:  # some models cannot be built on meta: the ranks will tell
        model = nn.Module()
    if not isinstance(model, nn.Module):
        raise BenchUsageError(
            f"the model factory {workload.name!r} returned {type(model).__name__}, not an nn.Module"
        )
    try:
        batch = workload.make_batch(batch_size, torch.device("cpu"), torch.Generator())
    except Exception as error:
        raise BenchUsageError(
            f"the input factory failed for batch_size={batch_size}, device=cpu: "
            f"{type(error).__name__}: {error}"
        ) from None
    if not isinstance(batch, torch.Tensor | tuple | list | dict):
        raise BenchUsageError(
            f"the input factory returned {type(batch).__name__}; return one batch: a tensor, a "
            "tuple/list of model arguments, or a dict of keyword arguments"
        )


def output_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Run ``model`` on a user batch and reduce its output to a scalar loss."""
    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, tuple | list):
        out = model(*batch)
    else:
        out = model(batch)
    while isinstance(out, tuple | list):
        out = out[0]
    if isinstance(out, dict):
        out = next(iter(out.values()))
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the model returned {type(out).__name__}; expected a tensor")
    return out if out.dim() == 0 else out.float().pow(2).mean()


def training_optimizer(parameters: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The optimizer every point trains with: AdamW over the trainable ``parameters``."""
    return torch.optim.AdamW([p for p in parameters if p.requires_grad], lr=1e-4)
