"""User factories for strategy-bench's tests: good ones, and each kind of bad one."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.fsdp import FSDPModule

NOT_CALLABLE = 3


class UserNet(nn.Module):
    """A small user model with a ModuleList (FSDP's default units) and a frozen stem."""

    def __init__(self, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x * scale


def make_model(width: int = 16, depth: int = 2) -> UserNet:
    return UserNet(width, depth)


def make_batch(batch_size: int, device: torch.device, generator: torch.Generator) -> tuple:
    return (torch.randn(batch_size, 16, generator=generator).to(device), 0.5)


def freeze_stem(model: nn.Module) -> None:
    model.stem.requires_grad_(False)


def fail_on_rank1(width: int = 16) -> UserNet:
    if dist.is_initialized() and dist.get_rank() == 1:
        raise RuntimeError("model construction failed on rank 1 (on purpose)")
    return UserNet(width)


def not_a_module(**_: object) -> str:
    return "not a module"


def bad_batch(batch_size: int, device: torch.device, generator: torch.Generator) -> int:
    return 42


class OomOnRank1(UserNet):
    """Runs out of memory on rank 1 whenever it computes with its parameters unsharded, as a
    model that fits one GPU only under FSDP would."""

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        sharded = isinstance(self, FSDPModule)
        if dist.is_initialized() and dist.get_rank() == 1 and not sharded:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return super().forward(x, scale)


def oom_on_rank1(width: int = 16) -> OomOnRank1:
    return OomOnRank1(width)


class NeedsData(UserNet):
    """Reads a parameter's value while it is built: cannot be built on the meta device."""

    def __init__(self, width: int = 16) -> None:
        super().__init__(width)
        self.scale = float(self.stem.weight.detach().abs().max())


class ReadsValues(UserNet):
    """Branches on a tensor's value in forward: runs for real, not on fake tensors."""

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        if float(x.detach().abs().sum()) >= 0:
            x = x * 1.0
        return super().forward(x, scale)


class DtypeProbe(UserNet):
    """Records, per forward, its class, whether the output is real, and the output's dtype in
    ``$BENCH_DTYPE_LOG`` (FSDP2 renames the class of what it wraps: ``FSDPDtypeProbe``)."""

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        out = self.stem(x)
        path = os.environ.get("BENCH_DTYPE_LOG")
        if path:
            with open(path, "a") as log:
                real = not isinstance(out, FakeTensor) and out.device.type != "meta"
                log.write(f"{type(self).__name__} {real} {out.dtype}\n")
        for layer in self.layers:
            out = torch.relu(layer(out))
        return out * scale


def dtype_probe(width: int = 16, depth: int = 2) -> DtypeProbe:
    return DtypeProbe(width, depth)
