"""What is trained: the presets, a user's factories, the step and wrap knobs."""

from __future__ import annotations

from distributed_strategy.recipe import selective_kept
from strategy_bench.workload._hf import (
    DEFAULT_HF_SEQ_LEN,
    HF_EXTRA,
    HF_SCALE_PARAM,
    causal_lm,
    hf_workload,
    require_transformers,
)
from strategy_bench.workload._knobs import (
    ACCUM_SYNC,
    checkpoint_mode,
    compile_backend,
    compile_unavailable,
    compute_dtype,
    ddp_wrap_knobs,
    fsdp_wrap_knobs,
    knob_key,
    micro_steps,
    needs_compiler,
    offloads,
    prepare_blocks,
    recipe_for,
    step_knobs,
    syncs_every_micro_step,
    wrap_knobs,
)
from strategy_bench.workload._presets import (
    CPU_DEFAULT_MODELS,
    ESTIMATE_DEFAULT_MODELS,
    GPU_DEFAULT_MODELS,
    PRESETS,
    BenchTransformer,
    Preset,
    next_token_loss,
    synthetic_tokens,
)
from strategy_bench.workload._spec import WorkloadSpec
from strategy_bench.workload._workload import (
    Workload,
    check_workload,
    load_callable,
    parse_init_params,
    preset_workload,
    training_optimizer,
)
from strategy_config import CHECKPOINT_MODES, OFFLOAD_MODES

__all__ = [
    "ACCUM_SYNC",
    "CHECKPOINT_MODES",
    "CPU_DEFAULT_MODELS",
    "DEFAULT_HF_SEQ_LEN",
    "ESTIMATE_DEFAULT_MODELS",
    "GPU_DEFAULT_MODELS",
    "HF_EXTRA",
    "HF_SCALE_PARAM",
    "OFFLOAD_MODES",
    "PRESETS",
    "BenchTransformer",
    "Preset",
    "Workload",
    "WorkloadSpec",
    "causal_lm",
    "check_workload",
    "checkpoint_mode",
    "compile_backend",
    "compile_unavailable",
    "compute_dtype",
    "ddp_wrap_knobs",
    "fsdp_wrap_knobs",
    "hf_workload",
    "knob_key",
    "load_callable",
    "micro_steps",
    "needs_compiler",
    "next_token_loss",
    "offloads",
    "parse_init_params",
    "prepare_blocks",
    "preset_workload",
    "recipe_for",
    "require_transformers",
    "selective_kept",
    "step_knobs",
    "syncs_every_micro_step",
    "synthetic_tokens",
    "training_optimizer",
    "wrap_knobs",
]
