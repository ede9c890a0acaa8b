"""Rank bodies for the grad-sync tests (spawned children import them by name)."""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from dist_harness import rank_device
from grad_sync import clip_grad_norm, no_sync

K = 3  # micro-steps per optimizer step
BATCH = 4  # samples per rank per micro-step


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def build() -> nn.Module:
    torch.manual_seed(0)
    return Blocks().to(rank_device())


def batches(rank: int, step: int) -> list[torch.Tensor]:
    """Rank ``rank``'s K micro-batches of optimizer step ``step``: different on every rank."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(BATCH, 6, generator=generator).to(rank_device()) for _ in range(K)]


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return (out - 1.0).pow(2).mean()


def reference_grads(model: nn.Module, world_size: int, step: int) -> dict[str, torch.Tensor]:
    """One process, one backward on the concatenated global batch of the step."""
    plain = copy.deepcopy(model)
    plain.zero_grad(set_to_none=True)
    every = torch.cat([x for rank in range(world_size) for x in batches(rank, step)])
    loss_fn(plain(every)).backward()
    return {name: p.grad.clone() for name, p in plain.named_parameters()}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def accumulate(model: nn.Module, rank: int, step: int, sent: Any) -> list[int]:
    """K micro-steps, no_sync on all but the last; the collectives counted after each."""
    counts = []
    for index, x in enumerate(batches(rank, step)):
        if index < K - 1:
            with no_sync(model):
                (loss_fn(model(x)) / K).backward()
        else:
            (loss_fn(model(x)) / K).backward()
        counts.append(sent())
    return counts


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return {n: full(p.grad).clone() for n, p in inner.named_parameters()}


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def ddp_accumulation(rank: int, world_size: int, options: dict[str, Any]) -> dict[str, Any]:
    """Two optimizer steps under DDP with ``options``; reduction calls counted by a comm hook."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13: broadcast_buffers
        model = DistributedDataParallel(build(), broadcast_buffers=False, **options)
    calls = [0]

    # No annotations: DDP checks them, and this module's are strings (PEP 563).
    def counting_hook(_state, bucket):  # type: ignore[no-untyped-def]
        calls[0] += 1
        work = dist.all_reduce(bucket.buffer(), async_op=True)
        assert work is not None
        return work.get_future().then(lambda f: f.value()[0] / world_size)

    model.register_comm_hook(None, counting_hook)
    out: dict[str, Any] = {"counts": [], "match": []}
    for step in range(2):
        expected = reference_grads(model.module, world_size, step)
        out["counts"].append(accumulate(model, rank, step, lambda: calls[0]))
        out["match"].append(close(grads_of(model), expected))
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)
        model.zero_grad(set_to_none=True)
    return out


def ddp_forward_outside(rank: int, world_size: int) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = DistributedDataParallel(build(), broadcast_buffers=False)
    x = batches(rank, 0)[0]
    with no_sync(model):  # a correct micro-step first
        loss_fn(model(x)).backward()
    loss = loss_fn(model(x))  # forward outside: DDP will reduce in this backward
    try:
        with no_sync(model):
            loss.backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


def fsdp_accumulation(rank: int, world_size: int) -> dict[str, Any]:
    """Two optimizer steps under FSDP2; collectives counted with torch's CommDebugMode."""
    model = build()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    out: dict[str, Any] = {"counts": [], "match": [], "restored": None}
    reference_model = build()
    calls = _count_reduce_scatters()
    for step in range(2):
        expected = reference_grads(reference_model, world_size, step)
        out["counts"].append(accumulate(model, rank, step, lambda: calls[0]))
        out["match"].append(close(grads_of(model), expected))
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)
            step_of = expected_by_param(reference_model, expected)
            for p in reference_model.parameters():
                p.sub_(0.1 * step_of[p])
        model.zero_grad(set_to_none=True)
    try:
        with no_sync(model):
            raise KeyError("boom")
    except KeyError:
        pass
    out["restored"] = [_requires_sync(m) for m in model.modules() if hasattr(m, "reshard")]
    return out


def expected_by_param(model: nn.Module, grads: dict[str, torch.Tensor]) -> dict[Any, torch.Tensor]:
    return {p: grads[n] for n, p in model.named_parameters()}


def _count_reduce_scatters() -> list[int]:
    """Count FSDP2's gradient reduce-scatters (this rank process only; it ends after the test)."""
    calls = [0]
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):  # 2.13, older torch
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            calls[0] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return calls


def _requires_sync(module: nn.Module) -> bool:
    from grad_sync import _compat

    return _compat.requires_gradient_sync(module)  # type: ignore[arg-type]


def clip_norms(rank: int, world_size: int) -> dict[str, Any]:
    """clip_grad_norm under DDP, FSDP2 and (on each rank) one process with the global batch."""
    out: dict[str, Any] = {}
    for norm_type in (2.0, math.inf):
        key = "inf" if math.isinf(norm_type) else "2"
        single = build()
        every = torch.cat([x for r in range(world_size) for x in batches(r, 0)])
        loss_fn(single(every)).backward()
        out[f"single_{key}"] = float(clip_grad_norm(single, 0.05, norm_type))
        clipped = {n: p.grad.clone() for n, p in single.named_parameters()}
        for strategy in ("ddp", "fsdp"):
            model = _wrapped(strategy)
            for x in batches(rank, 0):
                (loss_fn(model(x)) / K).backward()
            total = clip_grad_norm(model, 0.05, norm_type)
            out[f"{strategy}_{key}"] = float(total)
            out[f"{strategy}_{key}_clipped"] = close(grads_of(model), clipped)
            # torch's own clip of the same gradients, bit for bit (its inf norm fails on a
            # rank whose shard is empty: ours reduces the maxima itself)
            if strategy == "fsdp" and not math.isinf(norm_type):
                theirs = _wrapped(strategy)
                for x in batches(rank, 0):
                    (loss_fn(theirs(x)) / K).backward()
                expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.05, norm_type)
                pairs = zip(model.parameters(), theirs.parameters(), strict=True)
                out[f"fsdp_{key}_as_torch"] = float(total) == float(expected.full_tensor()) and all(
                    torch.equal(a.grad.to_local(), b.grad.to_local()) for a, b in pairs
                )
    return out


def _wrapped(strategy: str) -> nn.Module:
    model = build()
    if strategy == "ddp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return DistributedDataParallel(model, broadcast_buffers=False)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def between_forward_and_backward(rank: int, world_size: int) -> dict[str, Any]:
    """What the count and clip read after a forward, before its backward, where no parameter
    is a sharded DTensor: a root-only FSDP2 model (torch keeps the root gathered for the
    backward) and units with reshard_after_forward=False."""
    from dist_core import strategy_of
    from grad_sync import data_parallel_size

    out: dict[str, Any] = {}
    for name in ("root_only", "no_reshard"):
        model = build()
        if name == "no_reshard":
            for block in model.blocks:
                fully_shard(block, reshard_after_forward=False)
        fully_shard(model)
        x = batches(rank, 0)[0]
        loss = loss_fn(model(x))
        sharded = any(isinstance(p, DTensor) for p in model.parameters())
        out[name] = {
            "sharded_params_seen": sharded,
            "data_parallel_size": data_parallel_size(model),
            "strategy": strategy_of(model),
        }
        loss.backward()
    return out


def nonfinite_clip(rank: int, world_size: int) -> dict[str, Any]:
    """An inf gradient with error_if_nonfinite=True under FSDP2: raises, changes nothing."""
    model = _wrapped("fsdp")
    for x in batches(rank, 0):
        (loss_fn(model(x)) / K).backward()
    first = next(p for p in model.parameters() if p.grad is not None)
    first.grad.to_local().fill_(math.inf)  # type: ignore[union-attr]
    before = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
    try:
        clip_grad_norm(model, 0.05, error_if_nonfinite=True)
    except RuntimeError as error:
        raised = "non-finite" in str(error)
    else:
        raised = False
    after = {n: p.grad.to_local() for n, p in model.named_parameters()}  # type: ignore[union-attr]
    unchanged = all(
        torch.equal(before[n], after[n]) or bool(torch.isinf(before[n]).all()) for n in before
    )
    return {"raised": raised, "unchanged": unchanged}


def everything(rank: int, world_size: int) -> dict[str, Any]:
    """All multi-rank grad-sync checks in one spawned run (one process group)."""
    return {
        "ddp": ddp_accumulation(rank, world_size, {}),
        "ddp_bucket_view": ddp_accumulation(rank, world_size, {"gradient_as_bucket_view": True}),
        "ddp_static": ddp_accumulation(rank, world_size, {"static_graph": True}),
        "ddp_outside": ddp_forward_outside(rank, world_size),
        "fsdp": fsdp_accumulation(rank, world_size),
        "clip": clip_norms(rank, world_size),
        "variable": variable_length(rank, world_size, ("ddp", "fsdp")),
        "zero": zero_count(rank, world_size),
        "inputs": count_inputs(rank, world_size),
        "mid_step": between_forward_and_backward(rank, world_size),
        "nonfinite_clip": nonfinite_clip(rank, world_size),
    }


# --- Variable-length data: the loss normalised by the global count of tokens ---------------

SEQ = 5  # positions per sample; each sample has 1..SEQ valid ones


def tokens(rank: int, micro: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch ``micro``: inputs and a mask of valid positions.

    Lengths differ per sample, so per-rank and per-micro-batch token counts differ.
    """
    generator = torch.Generator().manual_seed(7919 * step + 101 * rank + micro)
    x = torch.randn(BATCH, SEQ, 6, generator=generator)
    lengths = torch.randint(1, SEQ + 1, (BATCH,), generator=generator)
    mask = torch.arange(SEQ)[None, :] < lengths[:, None]
    return x.to(rank_device()), mask.to(rank_device())


def token_losses(model: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sum of the valid positions' losses (the padding contributes nothing)."""
    per_token = (model(x).squeeze(-1) - 1.0).pow(2)
    return (per_token * mask).sum()


def count_reference(
    model: nn.Module, parts: list[tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """One process over the whole global batch: d(sum of token losses / token count)."""
    plain = copy.deepcopy(model)
    plain.zero_grad(set_to_none=True)
    total = sum(int(mask.sum()) for _, mask in parts)
    loss = sum(token_losses(plain, x, mask) for x, mask in parts) / total
    loss.backward()
    return {name: p.grad.clone() for name, p in plain.named_parameters()}


def count_step(
    model: nn.Module, parts: list[tuple[torch.Tensor, torch.Tensor]], *, exact: bool
) -> None:
    """One optimizer step's backwards over ``parts`` (this rank's micro-batches).

    ``exact``: global_count + count_mean. Otherwise the usual mean: each micro-batch's
    token mean, divided by the accumulation steps (averaged over ranks by the reduction).
    """
    from grad_sync import count_mean, global_count

    count = global_count([mask.sum() for _, mask in parts], model=model) if exact else None
    for index, (x, mask) in enumerate(parts):
        last = index == len(parts) - 1
        with contextlib.nullcontext() if last else no_sync(model):
            if exact:
                loss = count_mean(token_losses(model, x, mask), count, model=model)
            else:
                loss = token_losses(model, x, mask) / mask.sum() / len(parts)
            loss.backward()


def _variable_model(strategy: str, world_size: int) -> nn.Module:
    model = build()
    if strategy == "ddp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return DistributedDataParallel(model, broadcast_buffers=False)
    mesh = None
    if strategy == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        shape = (2, world_size // 2)
        mesh = init_device_mesh(rank_device().type, shape, mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def variable_length(rank: int, world_size: int, strategies: tuple[str, ...]) -> dict[str, Any]:
    """For each strategy and accumulation 1 and 2: the stepped gradients against one
    process over the same global batch, with count_mean and with the usual mean()."""
    from grad_sync import data_parallel_size, global_count

    out: dict[str, Any] = {}
    for strategy in strategies:
        for accum in (1, 2):
            every = [tokens(r, m) for r in range(world_size) for m in range(accum)]
            mine = every[rank * accum : (rank + 1) * accum]
            reference = count_reference(build(), every)
            for exact in (True, False):
                model = _variable_model(strategy, world_size)
                count_step(model, mine, exact=exact)
                got = grads_of(model)
                worst = max(float((got[k] - reference[k]).abs().max()) for k in reference)
                scale = max(float(v.abs().max()) for v in reference.values())
                key = f"{strategy}_{accum}_{'count' if exact else 'mean'}"
                out[key] = {"max_abs": worst, "relative": worst / scale}
            model = _variable_model(strategy, world_size)
            counts = [int(mask.sum()) for _, mask in mine]
            out[f"{strategy}_{accum}_global"] = int(global_count(counts, model=model))
            out[f"{strategy}_{accum}_expected"] = sum(int(mask.sum()) for _, mask in every)
            out[f"{strategy}_dp"] = data_parallel_size(model)
    return out


def hsdp_counts(rank: int, world_size: int) -> dict[str, Any]:
    """HSDP 2x2: the variable-length checks and the counts' inputs, one spawned run."""
    return {
        **variable_length(rank, world_size, ("hsdp",)),
        "inputs": count_inputs(rank, world_size, "hsdp"),
    }


def zero_count(rank: int, world_size: int) -> str:
    from grad_sync import count_mean, global_count

    model = _variable_model("ddp", world_size)
    count = global_count(0, model=model)
    try:
        count_mean(torch.zeros((), requires_grad=True), count, model=model)
    except ValueError as error:
        return str(error)
    return "no error"


def count_inputs(rank: int, world_size: int, strategy: str = "ddp") -> dict[str, Any]:
    """global_count over mixed inputs per rank, and a bad count on one rank only.

    Each entry is the count (value, dtype name) every rank got, or the error it raised
    (type name, message).
    """
    import numpy as np

    from grad_sync import count_mean, global_count

    model = _variable_model(strategy, world_size)
    device = rank_device()
    first = rank == 0
    cases: dict[str, Any] = {
        # a Python int on one rank, a float on the other (reduced as int64 and float64
        # reinterpreted under gloo before: 4.6e18 and 100.00000000000142)
        "int_float": 3 if first else 4.0,
        "numpy_empty": [np.int64(5)] if first else [],
        "bf16_fp16": (
            [torch.ones(1001, dtype=torch.bfloat16, device=device)]
            if first
            else [torch.ones(70_000, dtype=torch.float16, device=device)]
        ),
        "bool_mask": torch.ones(7, dtype=torch.bool, device=device) if first else 2,
        "nan_number": float("nan") if first else 3,
        "nan_tensor": torch.tensor([float("nan")], device=device) if first else 3,
        "negative_tensor": 2 if first else torch.tensor([-1.0], device=device),
        "string": "12" if first else 3,
        "bool": True if first else 3,
    }
    out: dict[str, Any] = {}
    for name, counts in cases.items():
        try:
            count = global_count(counts, model=model)
            out[name] = (count.item(), str(count.dtype).removeprefix("torch."))
        except (TypeError, ValueError) as error:
            out[name] = (type(error).__name__, str(error))
    count = global_count(4, model=model)
    loss = torch.tensor(2.0, device=device)
    out["mean"] = float(count_mean(loss, count, model=model))
    return out
