"""Delegation through DelegatingDistributedDataParallel, on a one-rank gloo group."""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_wrap import DelegatingDistributedDataParallel, mark_forward_method, wrap_module_ddp
from toy_models import Nested, RunnerNet, ToyNet

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
    with torch.no_grad():
        assert torch.equal(clone(x), wrapped(x))
    with pytest.raises(RuntimeError, match="ran the forward of submodule 'net'"):
        clone.loss(x).backward()


def test_bypass_is_refused_and_names_the_fix(wrapped: DelegatingDistributedDataParallel) -> None:
    """A delegated method's backward with no DDP forward to reduce it: refused in backward,
    before any gradient reaches the submodule."""
    loss = wrapped.loss(torch.ones(2, 4))  # the forward itself is allowed
    with pytest.raises(RuntimeError) as info:
        loss.backward()
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

    before = dict(module_impl._global_forward_pre_hooks), dict(module_impl._global_forward_hooks)
    with pytest.raises(RuntimeError):
        wrapped.loss(torch.ones(2, 4)).backward()
    after = dict(module_impl._global_forward_pre_hooks), dict(module_impl._global_forward_hooks)
    assert after == before
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
    with torch.no_grad():
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


class TestSubmoduleBypass:
    """A trainable submodule reached through the wrapper and run under grad (issue 18)."""

    def test_refused_at_depth_one_and_two(self) -> None:
        wrapped = wrap_module_ddp(Nested(), device="cpu")
        x = torch.ones(2, 4)
        with pytest.raises(RuntimeError) as info:
            wrapped.body(x).sum().backward()
        message = str(info.value)
        assert "submodule 'body.layer2' (Linear) of the DDP-wrapped Nested" in message
        assert "the backward through its output follows no DDP forward" in message
        assert "detect_bypass=False" in message
        with pytest.raises(RuntimeError, match="submodule 'body.layer1' \\(Linear\\)"):
            wrapped.body.layer1(x).sum().backward()
        with pytest.raises(RuntimeError, match="submodule 'head'"):
            wrapped.module.head(x).sum().backward()  # the same object: the check follows it
        assert all(p.grad is None for p in wrapped.parameters())

    def test_outputs_fed_to_ddp_or_added_to_its_loss_are_allowed(self) -> None:
        """What raw DDP reduces: a submodule's output fed into the DDP forward, or added to
        the loss of one (an auxiliary loss); and no_sync micro-steps."""
        torch.manual_seed(0)
        wrapped = wrap_module_ddp(Nested(), device="cpu")
        x = torch.ones(2, 4)
        wrapped(wrapped.body(x)).sum().backward()  # fed into DDP's forward
        (wrapped(x).sum() + wrapped.body(x).sum()).backward()  # auxiliary loss
        with wrapped.no_sync():
            wrapped.body(x).sum().backward()  # DDP accumulates locally; next sync reduces
        assert wrapped.module.body.layer1.weight.grad is not None

    def test_allowed_without_grad_and_inside_ddp_forward(self) -> None:
        wrapped = wrap_module_ddp(Nested(), device="cpu")
        x = torch.ones(2, 4)
        with torch.no_grad():
            wrapped.body(x)
        with torch.inference_mode():
            wrapped.body.layer1(x)
        wrapped(x).sum().backward()
        assert wrapped.module.body.layer1.weight.grad is not None
        # Detached inside DDP's forward (no hook call in the step), attached again after.
        with torch.no_grad():
            wrapped.body(x)
        assert wrapped.module.body.hooks_seen == [1, 0, 1]

    def test_reads_and_identity_unchanged(self) -> None:
        wrapped = wrap_module_ddp(Nested(), device="cpu")
        inner = wrapped.module
        assert wrapped.body is inner.body
        assert wrapped.body.layer1 is inner.body.layer1
        assert wrapped.body.layer1.weight is inner.body.layer1.weight
        assert wrapped.head.weight.shape == (1, 4)

    @pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
    def test_activation_checkpointing_recompute_is_allowed(self, mode: str) -> None:
        torch.manual_seed(0)
        wrapped = wrap_module_ddp(Nested(checkpoint=mode), device="cpu")
        x = torch.ones(2, 4, requires_grad=mode == "reentrant")
        wrapped(x).sum().backward()  # body runs again in backward, outside DDP's forward
        assert wrapped.module.body.layer1.weight.grad is not None

    def test_copies_of_the_bare_model_are_not_checked(self) -> None:
        model = Nested()
        wrapped = wrap_module_ddp(model, device="cpu")
        x = torch.ones(2, 4)
        copy.deepcopy(model).body(x).sum().backward()  # an EMA copy
        pickle.loads(pickle.dumps(model)).body(x).sum().backward()  # torch.save(model)
        with pytest.raises(RuntimeError, match="submodule 'body.layer"):
            model.body(x).sum().backward()  # the original still is, while its wrapper lives
        del wrapped
        gc.collect()
        model.body(x).sum().backward()  # wrapper gone: the hooks do nothing

    def test_wrapping_again_keeps_one_hook_per_module(self) -> None:
        model = Nested()
        first = wrap_module_ddp(model, device="cpu")
        second = wrap_module_ddp(model, device="cpu")
        assert len(model.body.layer1._forward_hooks) == 1
        x = torch.ones(2, 4)
        with torch.no_grad():
            first(x)
            second(x)
        assert len(model.body.layer1._forward_hooks) == 1
        with pytest.raises(RuntimeError):
            model.body(x).sum().backward()

    def test_turned_off(self) -> None:
        model = Nested()
        wrap_module_ddp(model, device="cpu", detect_bypass=False)
        assert not model.body.layer1._forward_hooks
        model.body(torch.ones(2, 4))
