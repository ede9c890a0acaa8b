"""Delegation through DelegatingDistributedDataParallel, on a one-rank gloo group."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_wrap import DelegatingDistributedDataParallel, mark_forward_method, wrap_module_ddp
from toy_models import RunnerNet, ToyNet

pytestmark = pytest.mark.usefixtures("process_group")


@pytest.fixture
def wrapped() -> DelegatingDistributedDataParallel:
    torch.manual_seed(0)
    return wrap_module_ddp(RunnerNet(), device="cpu")


def test_reads_fall_through(wrapped: DelegatingDistributedDataParallel) -> None:
    inner = wrapped.module
    assert wrapped.latent_seq_len == 7
    assert wrapped.cfg_strength == 1.0
    assert wrapped.empty_clip_feat is inner.empty_clip_feat
    assert wrapped.net is inner.net
    assert wrapped.mean is inner.mean
    x = torch.ones(2, 4)
    assert torch.equal(wrapped.normalize(x), inner.normalize(x))


def test_ddp_names_win(wrapped: DelegatingDistributedDataParallel) -> None:
    assert isinstance(wrapped.module, RunnerNet)
    # DDP's own methods, not the wrapped module's.
    assert wrapped.state_dict.__self__ is wrapped
    assert next(iter(wrapped.state_dict())).startswith("module.")
    assert wrapped.forward.__func__ is DelegatingDistributedDataParallel.forward
    assert wrapped.device_ids is None  # CPU: no device_ids


def test_dir_lists_both(wrapped: DelegatingDistributedDataParallel) -> None:
    names = dir(wrapped)
    for name in ("latent_seq_len", "normalize", "cfg_strength", "no_sync", "module"):
        assert name in names


def test_missing_name_names_the_wrapped_class(wrapped: DelegatingDistributedDataParallel) -> None:
    with pytest.raises(AttributeError, match=r"RunnerNet has an attribute 'nope'"):
        _ = wrapped.nope
    assert not hasattr(wrapped, "nope")


def test_writes_go_to_the_wrapped_module(wrapped: DelegatingDistributedDataParallel) -> None:
    inner = wrapped.module
    wrapped.latent_seq_len = 9
    assert inner.latent_seq_len == 9
    assert "latent_seq_len" not in wrapped.__dict__
    wrapped.cfg_strength = 2.5  # property setter of the wrapped module
    assert inner.cfg_strength == 2.5
    with pytest.raises(ValueError, match="cfg_strength must be >= 0"):
        wrapped.cfg_strength = -1.0
    assert inner.cfg_strength == 2.5
    wrapped.brand_new = 3  # a name neither has: the wrapper's
    assert wrapped.__dict__["brand_new"] == 3
    assert not hasattr(inner, "brand_new")


def test_pickle_and_state_dict_as_ddp(wrapped: DelegatingDistributedDataParallel) -> None:
    raw = DistributedDataParallel(RunnerNet())
    assert list(wrapped.state_dict()) == list(raw.state_dict())
    clone = pickle.loads(pickle.dumps(wrapped))
    assert isinstance(clone, DelegatingDistributedDataParallel)
    assert clone.latent_seq_len == 7
    x = torch.ones(2, 4)
    assert torch.equal(clone(x), wrapped(x))
    with pytest.raises(RuntimeError, match="ran the forward of submodule 'net'"):
        clone.loss(x)


def test_bypass_is_refused_and_names_the_fix(wrapped: DelegatingDistributedDataParallel) -> None:
    with pytest.raises(RuntimeError) as info:
        wrapped.loss(torch.ones(2, 4))
    message = str(info.value)
    assert "RunnerNet.loss() ran the forward of submodule 'net' (Linear)" in message
    assert "mark_forward_method(model, 'loss')" in message
    assert "forward_methods=['loss']" in message
    assert wrapped.module.net.weight.grad is None


def test_bypass_allowed_without_grad_or_trainable_submodule(
    wrapped: DelegatingDistributedDataParallel,
) -> None:
    x = torch.ones(2, 4)
    with torch.no_grad():
        wrapped.loss(x)
    with torch.inference_mode():
        wrapped.loss(x)
    wrapped.encode(x)  # frozen submodule only
    wrapped.normalize(x)  # no submodule at all


def test_bypass_detection_can_be_turned_off() -> None:
    wrapped = wrap_module_ddp(RunnerNet(), device="cpu", detect_bypass=False)
    wrapped.loss(torch.ones(2, 4)).backward()
    assert wrapped.module.net.weight.grad is not None


def test_bypass_hook_is_removed_after_an_error(wrapped: DelegatingDistributedDataParallel) -> None:
    from torch.nn.modules import module as module_impl

    before = dict(module_impl._global_forward_pre_hooks)
    with pytest.raises(RuntimeError):
        wrapped.loss(torch.ones(2, 4))
    assert dict(module_impl._global_forward_pre_hooks) == before
    nn.Linear(4, 1)(torch.ones(1, 4))  # a plain module elsewhere runs untouched


def test_marked_method_runs_through_ddp_forward(wrapped: DelegatingDistributedDataParallel) -> None:
    mark_forward_method(wrapped, "loss")
    seen: list[str] = []
    wrapped.register_forward_pre_hook(lambda *_: seen.append("ddp"))
    loss = wrapped.loss(torch.ones(2, 4))
    assert seen == ["ddp"]
    loss.backward()
    assert wrapped.module.net.weight.grad is not None
    assert "forward" not in wrapped.module.__dict__  # the real forward is back
    assert torch.equal(wrapped(torch.ones(1, 4)), wrapped.module(torch.ones(1, 4)))


def test_mark_forward_method_rejects_bad_names(wrapped: DelegatingDistributedDataParallel) -> None:
    with pytest.raises(AttributeError, match="RunnerNet has no attribute 'nope'"):
        mark_forward_method(wrapped, "nope")
    with pytest.raises(ValueError, match="name a method other than forward"):
        mark_forward_method(wrapped, "forward")
    with pytest.raises(ValueError, match="has its own 'state_dict'"):
        mark_forward_method(wrapped, "state_dict")
    with pytest.raises(TypeError, match="RunnerNet.latent_seq_len is a int, not a method"):
        mark_forward_method(wrapped, "latent_seq_len")
    with pytest.raises(TypeError, match="must be strings, got int"):
        mark_forward_method(wrapped, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a DelegatingDistributedDataParallel"):
        mark_forward_method(DistributedDataParallel(RunnerNet()), "loss")
    assert wrapped.__dict__["_ddp_wrap_forward_methods"] == {}


def test_trainable_guard_names_changed_parameters(
    wrapped: DelegatingDistributedDataParallel,
) -> None:
    x = torch.ones(2, 4)
    wrapped(x)
    wrapped.module.empty_clip_feat.requires_grad_(False)
    wrapped.module.frozen.weight.requires_grad_(True)
    with pytest.raises(RuntimeError) as info:
        wrapped(x)
    message = str(info.value)
    assert "now trainable ['frozen.weight'], now frozen ['empty_clip_feat']" in message
    assert "Apply the trainable policy before wrapping" in message
    wrapped.module.empty_clip_feat.requires_grad_(True)
    wrapped.module.frozen.weight.requires_grad_(False)
    wrapped(x)  # back to the wrap-time set: fine again


def test_trainable_guard_can_be_turned_off() -> None:
    wrapped = wrap_module_ddp(RunnerNet(), device="cpu", check_trainable=False)
    wrapped.module.frozen.requires_grad_(True)
    wrapped(torch.ones(2, 4))


def test_tied_toy_net_trains_through_the_wrapper() -> None:
    torch.manual_seed(0)
    wrapped = wrap_module_ddp(ToyNet(), device="cpu")
    wrapped(torch.tensor([[1, 2, 3]])).sum().backward()
    assert wrapped.embed.weight.grad is not None
