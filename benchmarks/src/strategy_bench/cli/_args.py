"""The argument groups the commands share, and checks of their values."""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path
from typing import Any, NoReturn

from strategy_bench._errors import BenchUsageError
from strategy_bench.measure import RunOptions
from strategy_bench.results import read_results
from strategy_bench.workload import (
    ACCUM_SYNC,
    CHECKPOINT_MODES,
    CPU_DEFAULT_MODELS,
    DEFAULT_HF_SEQ_LEN,
    ESTIMATE_DEFAULT_MODELS,
    GPU_DEFAULT_MODELS,
    HF_EXTRA,
    OFFLOAD_MODES,
    PRESETS,
    WorkloadSpec,
    check_workload,
    load_callable,
    parse_init_params,
    require_transformers,
)

logger = logging.getLogger(__name__)


USAGE_EXIT = 2
"""The exit code of bad input (one line on stderr)."""


class Parser(argparse.ArgumentParser):
    """Bad input is one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_EXIT, f"strategy-bench: error: {message} (see {self.prog} --help)\n")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks to spawn (default: every visible GPU on CUDA, 2 on CPU)",
    )
    add_workload_arguments(parser, default_models="tiny small on CPU, small medium large on CUDA")
    add_recipe_arguments(parser)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ckpt-samples",
        type=int,
        default=RunOptions.ckpt_samples,
        metavar="N",
        help=(
            "rounds of the checkpoint cost per point, ours and raw DCP alternating; the median "
            "and range are reported (default 3; 0 skips it)"
        ),
    )
    parser.add_argument(
        "--threads-per-rank",
        type=int,
        default=None,
        metavar="N",
        help=(
            "each rank's intra-op threads (default: the host's cores shared by its ranks); a "
            "1-rank calibration for a 2-rank CPU run wants the 2-rank run's count"
        ),
    )
    parser.add_argument(
        "--probe-mib",
        type=float,
        nargs="*",
        default=list(RunOptions.probe_mib),
        metavar="MIB",
        help=(
            "message sizes the run times all_reduce, all_gather and reduce_scatter at, fitted to "
            "latency + bytes / bandwidth for the estimate's --calibrate (default 0.0625 1 16 "
            "64; none: no probe)"
        ),
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/latest"))
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        metavar="TFLOPS",
        help="peak TFLOP/s per rank for MFU (default: the datasheet of a known GPU)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results an earlier run left in --out",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the earlier run's rows in --out and measure only the points it lacks",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="end the whole run after this, killing a point in progress (default 3600)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help=(
            "end cleanly: start no point that would end past this, listing it as skipped "
            "(a point's cost is its model's previous point's; default: run: none, sweep: 900)"
        ),
    )


def add_workload_arguments(parser: argparse.ArgumentParser, *, default_models: str) -> None:
    parser.add_argument(
        "--models",
        nargs="+",
        choices=sorted(PRESETS),
        default=None,
        help=f"preset sizes (default: {default_models})",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--seq-len", type=int, default=None, help="override the presets' length")
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: autocast compute, fp32 master weights",
    )
    parser.add_argument(
        "--hf-config",
        default=None,
        metavar="PATH",
        help="a Hugging Face model's config.json (or its directory): the causal LM "
        "transformers builds from it, random weights, --seq-len token ids per sample (default "
        f"{DEFAULT_HF_SEQ_LEN}); needs transformers ({HF_EXTRA})",
    )
    parser.add_argument(
        "--model-factory",
        default=None,
        metavar="package.module:callable",
        help="benchmark your own model (with --input-factory)",
    )
    parser.add_argument(
        "--init-params",
        default=None,
        metavar="JSON",
        help="keyword arguments for --model-factory, a JSON object",
    )
    parser.add_argument(
        "--input-factory",
        default=None,
        metavar="package.module:callable",
        help="(batch_size, device, generator) -> one batch for one rank",
    )
    parser.add_argument(
        "--trainable",
        default=None,
        metavar="package.module:callable",
        help="trainable policy applied to the built model before the wrap",
    )
    parser.add_argument(
        "--tokens-per-sample",
        type=int,
        default=None,
        metavar="N",
        help="tokens in one sample of --input-factory's batches, for tokens/s (a preset knows "
        "its own: --seq-len)",
    )


RECIPE_DTYPES = ("fp32", "bf16")
"""What ``--param-dtype`` and ``--reduce-dtype`` take (strategy-config's spelling)."""


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """The recipe: the names and meanings of strategy-config's ``training.distributed`` keys."""
    group = parser.add_argument_group(
        "recipe (each strategy's point gets it; the names of training.distributed's keys)"
    )
    group.add_argument(
        "--param-dtype",
        choices=RECIPE_DTYPES,
        default=None,
        help="FSDP/HSDP: the gathered parameters' dtype (MixedPrecisionPolicy; the reduction "
        "stays fp32 unless --reduce-dtype); DDP: bf16 autocast over fp32 parameters",
    )
    group.add_argument(
        "--reduce-dtype",
        choices=RECIPE_DTYPES,
        default=None,
        help="FSDP/HSDP: the gradient reduction's dtype (DDP reduces in the parameters')",
    )
    group.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const="full",
        choices=CHECKPOINT_MODES,
        default=None,
        help="per block: full (recompute the block; the bare flag), selective (keep matmul and "
        "attention outputs, recompute the rest; op-level, after torchtitan's policy) or none",
    )
    group.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each block (inductor) before the wrap; the first step's extra "
        "seconds are reported as compile_s",
    )
    group.add_argument(
        "--offload",
        choices=OFFLOAD_MODES,
        default=None,
        help="FSDP/HSDP: cpu keeps the sharded parameters, gradients and optimizer state in "
        "host memory (FSDP2's CPUOffloadPolicy); DDP points run without it",
    )
    group.add_argument(
        "--grad-accum",
        type=int,
        default=None,
        metavar="N",
        help="micro-batches of --batch-size per optimizer step (no_sync on all but the last)",
    )
    group.add_argument(
        "--grad-accum-sync",
        choices=ACCUM_SYNC,
        default=None,
        help="with --grad-accum: reduce on the last micro-batch only (default: grad-sync's "
        "no_sync, unsharded gradients held until then) or on every one (Composer's and "
        "torchtitan's FSDP accumulation: a reduce-scatter each, sharded gradients held)",
    )


def recipe_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """The knobs the recipe arguments set; empty when none differs from the defaults.

    Raises:
        BenchUsageError: A ``--grad-accum`` below 1.
    """
    knobs: dict[str, Any] = {}
    if args.param_dtype == "bf16":
        knobs["param_dtype"] = "bf16"
        knobs["reduce_dtype"] = args.reduce_dtype or "fp32"
    elif args.reduce_dtype == "bf16":
        knobs["reduce_dtype"] = "bf16"
    if args.activation_checkpointing not in (None, "none"):
        knobs["activation_checkpointing"] = args.activation_checkpointing
    if getattr(args, "compile", False):
        knobs["compile"] = True
    if getattr(args, "offload", None) not in (None, "none"):
        knobs["offload"] = args.offload
    if args.grad_accum is not None:
        if args.grad_accum < 1:
            raise BenchUsageError(
                f"--grad-accum must be >= 1 (micro-batches per optimizer step), got "
                f"{args.grad_accum}"
            )
        if args.grad_accum > 1:
            knobs["grad_accum"] = args.grad_accum
    if args.grad_accum_sync is not None:
        if "grad_accum" not in knobs:
            raise BenchUsageError(
                f"--grad-accum-sync {args.grad_accum_sync} says how an accumulation reduces; "
                "add --grad-accum N (N >= 2)"
            )
        if args.grad_accum_sync == "every":
            knobs["grad_accum_sync"] = "every"
    return knobs


def workload_specs(args: argparse.Namespace, device: str) -> list[WorkloadSpec]:
    user = (args.model_factory, args.input_factory)
    if any(user) and not all(user):
        missing = "--input-factory" if args.model_factory else "--model-factory"
        raise BenchUsageError(f"--model-factory and --input-factory go together; add {missing}")
    if (args.init_params or args.trainable) and not args.model_factory:
        raise BenchUsageError("--init-params and --trainable need --model-factory")
    hf_config = args.hf_config
    if hf_config is not None:
        if args.model_factory or args.input_factory or args.init_params or args.trainable:
            raise BenchUsageError(
                "--hf-config builds the model and its input; drop --model-factory, "
                "--input-factory, --init-params and --trainable (or drop --hf-config)"
            )
        if args.tokens_per_sample is not None:
            raise BenchUsageError(
                f"--tokens-per-sample {args.tokens_per_sample}: --hf-config's samples are "
                "--seq-len tokens; set --seq-len instead"
            )
    if args.model_factory and args.seq_len is not None:
        raise BenchUsageError(
            f"--seq-len {args.seq_len} sets a preset's sequence length, and --model-factory's "
            "length is what its --input-factory makes; drop --seq-len, make the input factory "
            "produce that length, and give --tokens-per-sample N for tokens/s"
        )
    tokens = args.tokens_per_sample
    if tokens is not None and not args.model_factory:
        raise BenchUsageError(
            f"--tokens-per-sample {tokens} is for --model-factory; a preset knows its own "
            "(set it with --seq-len)"
        )
    if tokens is not None and tokens < 1:
        raise BenchUsageError(f"--tokens-per-sample must be >= 1, got {tokens}")
    specs: list[WorkloadSpec] = []
    if hf_config is not None:
        require_transformers()
        spec = WorkloadSpec(hf_config=str(hf_config), seq_len=args.seq_len)
        check_workload(spec.build(), args.batch_size)
        specs.append(spec)
    if args.model_factory:
        load_callable(args.model_factory, argument="--model-factory")
        load_callable(args.input_factory, argument="--input-factory")
        if args.trainable:
            load_callable(args.trainable, argument="--trainable")
        parse_init_params(args.init_params)
        spec = WorkloadSpec(
            model_factory=args.model_factory,
            init_params=args.init_params,
            input_factory=args.input_factory,
            trainable=args.trainable,
            tokens_per_sample=tokens,
        )
        check_workload(spec.build(), args.batch_size)
        specs.append(spec)
    models = args.models
    if models is None and not specs:
        if args.command == "estimate":
            models = list(ESTIMATE_DEFAULT_MODELS)
        elif args.command == "sweep":
            models = ["small"] if device == "cpu" else ["medium"]
        else:
            models = list(CPU_DEFAULT_MODELS if device == "cpu" else GPU_DEFAULT_MODELS)
    specs += [WorkloadSpec(preset=name, seq_len=args.seq_len) for name in models or ()]
    return specs


_UNITS = {
    "": 2**20,
    "b": 1,
    "k": 2**10,
    "kb": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mb": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gb": 2**30,
    "gib": 2**30,
}


def parse_memory(text: str) -> int:
    """``--memory-budget``: ``"4GiB"``, ``"512MiB"``, ``"1.5g"``; a bare number is MiB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise BenchUsageError(
            f"--memory-budget must be a size such as 4GiB, 512MiB or 2048 (MiB), got {text!r}"
        )
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value <= 0:
        raise BenchUsageError(f"--memory-budget must be positive, got {text!r}")
    return int(value)


def check_sizes(args: argparse.Namespace) -> None:
    if args.batch_size < 1:
        raise BenchUsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.seq_len is not None and args.seq_len < 2:
        raise BenchUsageError(f"--seq-len must be >= 2, got {args.seq_len}")


def read_or_usage_error(path: Path) -> dict[str, Any]:
    try:
        return read_results(path)
    except ValueError as error:
        raise BenchUsageError(str(error)) from None
