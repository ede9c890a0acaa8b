"""A causal language model from a Hugging Face ``config.json``: no weights, no network.

``--hf-config PATH`` is the one-command way to estimate or run a published architecture:
transformers' ``AutoModelForCausalLM.from_config`` builds it (on the meta device for the
estimate), its own ``_no_split_modules`` names the FSDP blocks, and each sample is
``seq_len`` random token ids below the config's ``vocab_size``, trained with the model's own
next-token loss, so tokens/s is known.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from strategy_bench._errors import BenchUsageError
from strategy_bench.workload._presets import synthetic_tokens
from strategy_bench.workload._workload import Workload

HF_EXTRA = "pip install 'strategy-bench[hf]'"
"""What installs transformers, the optional extra ``--hf-config`` needs."""

HF_SCALE_PARAM = "num_hidden_layers"
"""What ``--largest`` scales in a config (the depth), unless ``--scale-param`` says otherwise."""

DEFAULT_HF_SEQ_LEN = 2048
"""Tokens per sample when ``--seq-len`` is not given (capped at the config's positions)."""


def require_transformers() -> None:
    """Raise one line naming the extra when transformers is not installed.

    Raises:
        BenchUsageError: If ``transformers`` cannot be imported.
    """
    if importlib.util.find_spec("transformers") is None:
        raise BenchUsageError(f"--hf-config needs transformers, which is not installed: {HF_EXTRA}")


def config_file(path: str | Path) -> Path:
    """``--hf-config``'s ``config.json``: the file itself, or the one in a directory.

    Raises:
        BenchUsageError: If there is no such file, or it is not a JSON object with a
            ``model_type``.
    """
    given = Path(path)
    found = given / "config.json" if given.is_dir() else given
    if not found.is_file():
        where = f"{given} holds no config.json" if given.is_dir() else f"{given} does not exist"
        raise BenchUsageError(
            f"--hf-config {str(path)!r}: {where}; give a model's config.json or its directory"
        )
    try:
        value = json.loads(found.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BenchUsageError(
            f"--hf-config {str(found)!r} is not readable JSON ({type(error).__name__}: {error})"
        ) from None
    if not isinstance(value, dict) or not isinstance(value.get("model_type"), str):
        raise BenchUsageError(
            f"--hf-config {str(found)!r} has no 'model_type'; it must be a Hugging Face model's "
            "config.json"
        )
    return found


def _first_line(error: Exception) -> str:
    """Transformers' messages run to several lines; a usage error is one."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def _load_config(path: str, overrides: dict[str, Any]) -> tuple[Path, Any]:
    """``path``'s ``config.json`` and transformers' config read from it, ``overrides`` set."""
    require_transformers()
    from transformers import AutoConfig

    found = config_file(path)
    try:
        # NOTE: a local file and local_files_only: nothing is fetched, and trust_remote_code
        # stays False, so a config that names remote code is refused, not run.
        config = AutoConfig.from_pretrained(str(found), local_files_only=True)
    except (ValueError, KeyError, OSError) as error:
        raise BenchUsageError(
            f"--hf-config {str(found)!r}: transformers cannot read it ({_first_line(error)}); "
            "is its model_type known to the installed transformers?"
        ) from None
    for name, value in overrides.items():
        if not hasattr(config, name):
            raise BenchUsageError(
                f"--hf-config {str(found)!r}: the config has no {name!r} to set to {value!r}"
            )
        setattr(config, name, value)
    return found, config


def causal_lm(config: str, **overrides: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_config``: the architecture of ``config``, random weights.

    Args:
        config: A ``config.json``, or a directory holding one.
        **overrides: Config attributes to set first (``--largest`` scales
            ``num_hidden_layers`` this way).

    Raises:
        BenchUsageError: If transformers is missing, or the config cannot be read, or is not
            a causal language model.
    """
    _, loaded = _load_config(config, overrides)
    from transformers import AutoModelForCausalLM

    try:
        # NOTE: the default dtype (fp32 master weights), whatever the config's "dtype" says;
        # --dtype and --param-dtype set the compute precision, as for every model.
        model: nn.Module = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call, unused-ignore]
            loaded, dtype=torch.get_default_dtype()
        )
    except ValueError as error:
        raise BenchUsageError(
            f"--hf-config {config!r}: {loaded.model_type!r} is not a causal language model "
            f"transformers can build from a config ({_first_line(error)})"
        ) from None
    return model


def _seq_len(loaded: Any, seq_len: int | None) -> int:
    positions = getattr(loaded, "max_position_embeddings", None)
    if seq_len is None:
        return DEFAULT_HF_SEQ_LEN if positions is None else min(DEFAULT_HF_SEQ_LEN, positions)
    if positions is not None and seq_len > positions:
        raise BenchUsageError(
            f"--seq-len {seq_len} is longer than the config's max_position_embeddings "
            f"({positions}); give --seq-len {positions} or less"
        )
    return seq_len


def _positive(loaded: Any, config: str, name: str) -> int:
    value = getattr(loaded, name, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BenchUsageError(f"--hf-config {config!r} has no positive {name}, got {value!r}")
    return value


def model_name(found: Path) -> str:
    """The label of a config's rows: its directory's name, else the file's stem."""
    if found.name == "config.json" and found.parent.name:
        return found.parent.name
    return found.stem


def token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The model's own next-token loss on ``batch`` (no cache kept: a training step)."""
    return model(input_ids=batch, labels=batch, use_cache=False).loss  # type: ignore[no-any-return]


def hf_workload(config: str, seq_len: int | None) -> Workload:
    """The workload of ``--hf-config``: :func:`causal_lm`, token ids, :func:`token_loss`.

    Raises:
        BenchUsageError: As :func:`causal_lm`, or if ``seq_len`` exceeds the config's
            ``max_position_embeddings``, or the config has no ``vocab_size`` or depth.
    """
    found, loaded = _load_config(config, {})
    length = _seq_len(loaded, seq_len)
    vocab = _positive(loaded, config, "vocab_size")
    depth = _positive(loaded, config, HF_SCALE_PARAM)

    def make_batch(batch_size: int, device: torch.device, generator: torch.Generator) -> Any:
        # length ids: the model shifts its labels itself (synthetic_tokens draws one id more
        # than it is asked for: the presets' shifted target)
        return synthetic_tokens(batch_size, length - 1, vocab, device, generator)

    return Workload(
        name=model_name(found),
        factory=causal_lm,
        init_params={"config": config, HF_SCALE_PARAM: depth},
        make_batch=make_batch,
        loss=token_loss,
        tokens_per_sample=length,
    )
