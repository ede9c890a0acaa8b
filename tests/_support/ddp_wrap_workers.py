"""Rank functions for ddp-wrap's two-rank tests (real gloo process groups)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_wrap import mark_forward_method, wrap_module_ddp
from dist_harness import rank_device
from toy_models import Nested, RunnerNet, TinyDecoder


def _model() -> RunnerNet:
    torch.manual_seed(0)
    return RunnerNet().to(rank_device())


def _data(rank: int) -> torch.Tensor:
    return torch.full((2, 4), float(rank + 1), device=rank_device())


def _grads(model: nn.Module) -> dict[str, list[float]]:
    return {n: p.grad.flatten().tolist() for n, p in model.named_parameters() if p.grad is not None}


def gradient_sync(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}

    # The reference: plain DDP forward.
    ddp = wrap_module_ddp(_model(), device=rank_device())
    (ddp(_data(rank)) ** 2).sum().backward()
    out["forward_grads"] = _grads(ddp.module)

    # A marked method: the same loss computed inside the method, routed through DDP.
    marked = wrap_module_ddp(_model(), device=rank_device(), forward_methods=["loss"])
    marked.loss(_data(rank)).backward()
    out["marked_grads"] = _grads(marked.module)

    # mark_forward_method after the wrap does the same.
    late = wrap_module_ddp(_model(), device=rank_device())
    mark_forward_method(late, "loss")
    late.loss(_data(rank)).backward()
    out["late_marked_grads"] = _grads(late.module)

    # What each rank would get alone (what an unguarded bypass leaves it with).
    local = _model()
    local.loss(_data(rank)).backward()
    out["local_grads"] = _grads(local)

    # An unmarked bypass whose backward follows no DDP forward is refused, on every rank,
    # before any gradient reaches the model.
    guarded = wrap_module_ddp(_model(), device=rank_device())
    try:
        guarded.loss(_data(rank)).backward()
    except RuntimeError as error:
        out["bypass_error"] = str(error)
    out["bypass_left_grads"] = _grads(guarded.module)
    with torch.no_grad():
        out["no_grad_ok"] = guarded.loss(_data(rank)).item()
    out["normalize_ok"] = guarded.normalize(_data(rank)).sum().item()
    out["encode_ok"] = guarded.encode(_data(rank)).shape[1]

    # A trainable submodule reached through the wrapper, at depth 1 and 2: refused under grad
    # on every rank, allowed under no_grad; the step through DDP then syncs its gradients.
    torch.manual_seed(0)
    nested = wrap_module_ddp(Nested().to(rank_device()), device=rank_device())
    out["submodule_errors"] = []
    for call in (nested.body, nested.body.layer1):
        try:
            call(_data(rank)).sum().backward()
        except RuntimeError as error:
            out["submodule_errors"].append(str(error).split(",")[0])
    out["submodule_left_grads"] = _grads(nested.module)
    with torch.no_grad():
        nested.body.layer1(_data(rank))
    nested(_data(rank)).sum().backward()
    out["nested_grads"] = _grads(nested.module)

    out.update(_allowed_bypasses(rank))

    # broadcast_buffers=False (the reference): a rank-local buffer is synced neither at init
    # nor in forward. True: synced from rank 0.
    for flag in (False, True):
        model = _model()
        model.mean.fill_(float(rank))
        wrapped = wrap_module_ddp(model, device=rank_device(), broadcast_buffers=flag)
        wrapped(_data(rank))
        out[f"mean_after_broadcast_{flag}"] = model.mean.tolist()
    return out


def _allowed_bypasses(rank: int) -> dict[str, Any]:
    """What raw DDP reduces correctly trains through ours too, with raw DDP's gradients."""
    out: dict[str, Any] = {}
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8 + rank]], device=rank_device())

    def decoder() -> TinyDecoder:
        torch.manual_seed(0)
        return TinyDecoder().to(rank_device())

    # inputs_embeds: the embedding computed through the wrapper, fed into its forward.
    for name, wrapped in (
        ("ours", wrap_module_ddp(decoder(), device=rank_device())),
        ("raw", DistributedDataParallel(decoder())),
    ):
        embeds = wrapped.module.get_input_embeddings()(ids) if name == "raw" else None
        if embeds is None:
            embeds = wrapped.get_input_embeddings()(ids)
        wrapped(inputs_embeds=embeds).float().pow(2).mean().backward()
        out[f"embeds_grads_{name}"] = _grads(wrapped.module)

    # An auxiliary loss from a submodule, added to the DDP loss.
    torch.manual_seed(0)
    nested = wrap_module_ddp(Nested().to(rank_device()), device=rank_device())
    x = _data(rank)
    (nested(x).sum() + nested.body(x).pow(2).sum()).backward()
    out["aux_grads"] = _grads(nested.module)

    # no_sync: a bypass micro-step, then a synchronised step through DDP. The accumulated
    # gradients equal the mean over ranks of each rank's local two-micro-step gradients.
    torch.manual_seed(0)
    accum = wrap_module_ddp(Nested().to(rank_device()), device=rank_device())
    torch.manual_seed(0)
    alone = Nested().to(rank_device())
    for model, context in ((accum, accum.no_sync), (alone, None)):
        if context is not None:
            with context():
                model.body(x).sum().backward()
        else:
            model.body(x).sum().backward()
        model(x * 2).sum().backward()
    out["no_sync_grads"] = _grads(accum.module)
    out["no_sync_local_grads"] = _grads(alone)
    return out
