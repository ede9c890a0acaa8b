"""FLOPs: counted over one training step of the actual model, and the peaks MFU divides by."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from distributed_strategy import derive_seed
from strategy_bench._compat import FakeTensorMode
from strategy_bench.measure._accounting import autocast

if TYPE_CHECKING:
    from strategy_bench.workload import Workload

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")

# Dense (no sparsity) peak TFLOP/s per GPU from the vendors' datasheets: (bf16, fp32).
# fp32 is the non-tensor-core rate, what --dtype fp32 runs at under torch's default
# matmul precision ("highest"). Matched in this order against torch.cuda.get_device_name().
DATASHEET_TFLOPS: tuple[tuple[str, float | None, float | None], ...] = (
    ("B200", 2250.0, None),
    ("H200", 989.4, 66.9),
    ("H100 PCIe", 756.5, 51.2),
    ("H100", 989.4, 66.9),  # SXM
    ("A100", 312.0, 19.5),
    ("L40S", 362.05, 91.6),
    ("A10G", 70.0, 31.2),
    ("L4", 121.0, 30.3),
)


def count_step_flops(step: Callable[[], object]) -> float:
    """FLOPs of one call of ``step`` (forward and backward), counted by FlopCounterMode.

    Matmuls, convolutions and attention kernels are counted for whatever model runs, so user
    models get a figure too.
    """
    with FlopCounterMode(display=False, custom_mapping=_cpu_attention()) as counter:
        step()
    return float(counter.get_total_flops())


def fake_flops_per_sample(
    workload: Workload, batch_size: int, dtype: str, seed: int = 0
) -> float | None:
    """Training FLOPs per sample: one forward and backward on fake tensors, never a device.

    The model is built on the meta device and stepped on fake tensors (no memory, no real
    compute): what the wrapped step computes on every rank, whatever the strategy (the
    optimizer step is not counted, nor the recompute of activation checkpointing). ``None``
    when the model cannot run on fake tensors (its forward reads values); ``run`` then counts
    its wrapped step instead.
    """
    try:
        model = workload.meta_model()
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device=_CPU)
            generator = torch.Generator().manual_seed(derive_seed(seed, "flops"))
            batch = workload.make_batch(batch_size, _CPU, generator)

            def step() -> None:
                with autocast(dtype, _CPU):
                    loss = workload.loss(model, batch)
                loss.backward()  # type: ignore[no-untyped-call]

            flops = count_step_flops(step)
    except Exception:  # data-dependent forwards: counted on the wrapped step instead
        logger.debug("FLOPs of %s not countable on fake tensors", workload.name, exc_info=True)
        return None
    return flops / batch_size


def _cpu_attention() -> dict[Any, Any]:
    """Formulas for the CPU attention kernel, which torch's counter does not know.

    torch counts the CUDA attention kernels but not the flash kernel that
    ``scaled_dot_product_attention`` runs on CPU; this counts it with torch's own formulas.
    """
    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is None or backward is None:  # pragma: no cover - other torch builds
        return {}
    return {forward: _sdpa_forward, backward: _sdpa_backward}


def _sdpa_forward(query: Any, key: Any, value: Any, *_: Any, **__: Any) -> int:
    return int(flop_counter.sdpa_flop_count(query, key, value))  # type: ignore[no-untyped-call]


def _sdpa_backward(grad: Any, query: Any, key: Any, value: Any, *_: Any, **__: Any) -> int:
    flops = flop_counter.sdpa_backward_flop_count(grad, query, key, value)  # type: ignore[no-untyped-call]
    return int(flops)


def datasheet_peak(device_name: str, dtype: str) -> tuple[float, str] | None:
    """The datasheet's dense peak FLOP/s for a GPU in ``dtype``, and where it came from.

    ``None`` for a device (or dtype) the table does not know.
    """
    for key, bf16, fp32 in DATASHEET_TFLOPS:
        if key in device_name:
            tflops = bf16 if dtype == "bf16" else fp32
            if tflops is None:
                return None
            return tflops * 1e12, f"datasheet: {key} dense {dtype} {tflops:g} TFLOP/s"
    return None


def peak_flops(
    device_name: str, dtype: str, peak_tflops: float | None
) -> tuple[float | None, str | None]:
    """The MFU denominator per rank and its source: ``--peak-tflops``, else the datasheet."""
    if peak_tflops is not None:
        return peak_tflops * 1e12, f"--peak-tflops {peak_tflops:g}"
    found = datasheet_peak(device_name, dtype)
    return (None, None) if found is None else found


def measure_matmul_flops(
    device: torch.device, dtype: str, *, size: int = 8192, min_seconds: float = 0.2
) -> float | None:
    """Achieved square-matmul FLOP/s on this GPU in the run's dtype; ``None`` off CUDA.

    Warmed up for at least ``min_seconds`` and 50 matmuls (clocks ramp up), then timed over
    at least as long and as many with CUDA events.
    """
    if device.type != "cuda":
        return None
    kind = torch.bfloat16 if dtype == "bf16" else torch.float32
    mats = [torch.randn(size, size, device=device, dtype=kind) for _ in range(2)]

    def run(count: int) -> None:
        for _ in range(count):
            torch.mm(mats[0], mats[1])

    begin, done = time.perf_counter(), 0
    while done < 50 or time.perf_counter() - begin < min_seconds:
        run(10)
        torch.cuda.synchronize(device)
        done += 10
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    run(done)
    end.record()
    torch.cuda.synchronize(device)
    seconds = float(start.elapsed_time(end)) / 1e3
    mats.clear()
    torch.cuda.empty_cache()
    return 2.0 * size**3 * done / seconds
