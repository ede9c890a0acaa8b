"""wrap_module_ddp's checks and arguments, unwrap helpers, and the two-rank behaviour."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from ddp_wrap import (
    DelegatingDistributedDataParallel,
    unwrap_ddp_module,
    unwrap_model,
    wrap_module_ddp,
)
from dist_harness import fresh_interpreter, run_ranks, two_rank_backends
from toy_models import RunnerNet


@pytest.mark.usefixtures("process_group")
class TestChecks:
    def test_not_a_module(self) -> None:
        with pytest.raises(TypeError, match="wrap_module_ddp needs an nn.Module, got str"):
            wrap_module_ddp("model", device="cpu")  # type: ignore[arg-type]

    def test_no_trainable_parameter(self) -> None:
        model = RunnerNet().requires_grad_(False)
        with pytest.raises(ValueError, match="RunnerNet has 4 parameter tensor\\(s\\) and none"):
            wrap_module_ddp(model, device="cpu")

    def test_trainable_check_comes_before_the_device_check(self) -> None:
        model = RunnerNet().requires_grad_(False)
        with pytest.raises(ValueError, match="at least one parameter with requires_grad"):
            wrap_module_ddp(model, device="cuda")

    def test_cuda_needs_an_index(self) -> None:
        with pytest.raises(ValueError, match="concrete CUDA device such as 'cuda:0'.*got 'cuda'"):
            wrap_module_ddp(RunnerNet(), device="cuda")

    def test_parameters_must_be_on_device(self) -> None:
        with pytest.raises(ValueError, match="parameter 'empty_clip_feat' of RunnerNet is on cpu"):
            wrap_module_ddp(RunnerNet(), device="cuda:0")
        with pytest.raises(ValueError, match="parameter 'empty_clip_feat' of RunnerNet is on cpu"):
            wrap_module_ddp(RunnerNet(), device=0)

    @pytest.mark.parametrize(
        ("device", "error", "match"),
        [
            (1.5, TypeError, "device must be a torch.device, a string .* got float"),
            (True, TypeError, "got bool"),
            (-1, ValueError, "device index must be >= 0, got -1"),
            ("gpu0", ValueError, "device='gpu0' is not a device string"),
        ],
    )
    def test_bad_device(self, device: object, error: type[Exception], match: str) -> None:
        with pytest.raises(error, match=match):
            wrap_module_ddp(RunnerNet(), device=device)  # type: ignore[arg-type]

    @pytest.mark.parametrize("key", ["device_ids", "output_device", "forward_sync_buffers"])
    def test_reserved_kwargs(self, key: str) -> None:
        with pytest.raises(TypeError, match=f"wrap_module_ddp sets '{key}' itself"):
            wrap_module_ddp(RunnerNet(), device="cpu", **{key: None})

    def test_broadcast_buffers_must_be_bool(self) -> None:
        with pytest.raises(TypeError, match="broadcast_buffers must be a bool, got 'no'"):
            wrap_module_ddp(RunnerNet(), device="cpu", broadcast_buffers="no")  # type: ignore[arg-type]

    def test_bad_forward_method_fails_before_wrapping(self) -> None:
        model = RunnerNet()
        with pytest.raises(AttributeError, match="RunnerNet has no attribute 'odewrapper'"):
            wrap_module_ddp(model, device="cpu", forward_methods=["odewrapper"])
        assert "forward" not in model.__dict__


@pytest.mark.usefixtures("process_group")
class TestWrap:
    def test_cpu_kwargs_and_extra_kwargs(self) -> None:
        wrapped = wrap_module_ddp(
            RunnerNet(), device=torch.device("cpu"), bucket_cap_mb=1, gradient_as_bucket_view=True
        )
        assert isinstance(wrapped, DelegatingDistributedDataParallel)
        assert wrapped.device_ids is None
        assert wrapped.output_device is None
        assert wrapped.bucket_bytes_cap == 1024 * 1024
        assert wrapped.gradient_as_bucket_view is True

    def test_reference_buffer_semantics_without_warning(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            wrapped = wrap_module_ddp(RunnerNet(), device="cpu")
            synced = wrap_module_ddp(RunnerNet(), device="cpu", broadcast_buffers=True)
        assert wrapped.will_sync_module_buffers() is False
        assert synced.will_sync_module_buffers() is True

    def test_one_log_line(self, caplog: pytest.LogCaptureFixture) -> None:
        with caplog.at_level(logging.INFO, logger="ddp_wrap"):
            wrap_module_ddp(RunnerNet(), device="cpu", forward_methods=["loss"])
        records = [r for r in caplog.records if r.name.startswith("ddp_wrap")]
        assert len(records) == 1
        message = records[0].getMessage()
        assert "wrapped RunnerNet in DDP on cpu x 1 rank(s)" in message
        assert "8 of 28 parameters trainable" in message
        assert "forward methods ['loss']" in message


@pytest.mark.usefixtures("process_group")
class TestUnwrap:
    def test_unwrap_ddp_module(self) -> None:
        model = RunnerNet()
        assert unwrap_ddp_module(wrap_module_ddp(model, device="cpu")) is model
        assert unwrap_ddp_module(DistributedDataParallel(model)) is model
        assert unwrap_ddp_module(model) is model
        dp = DataParallel(model)
        assert unwrap_ddp_module(dp) is dp  # reference semantics: DDP only

    @pytest.mark.filterwarnings("ignore::DeprecationWarning")
    @pytest.mark.filterwarnings("ignore::UserWarning")
    def test_unwrap_model_any_nesting(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = RunnerNet()
        compiled = torch.compile(model, backend="eager")
        assert unwrap_model(compiled) is model
        assert unwrap_model(DataParallel(compiled)) is model
        assert unwrap_model(wrap_module_ddp(DataParallel(compiled), device="cpu")) is model
        inner = nn.Linear(2, 2)
        fsdp1 = FullyShardedDataParallel(inner, device_id=torch.device("cpu"))
        assert unwrap_model(torch.compile(fsdp1, backend="eager")) is inner
        assert unwrap_model(model) is model


def test_uninitialized_process_group_is_refused() -> None:
    """In a fresh interpreter, where no process group exists."""
    out = fresh_interpreter(
        """
        import torch
        from ddp_wrap import wrap_module_ddp
        try:
            wrap_module_ddp(torch.nn.Linear(2, 2), device="cpu")
        except RuntimeError as error:
            print(error)
        """
    )
    assert "wrap_module_ddp requires an initialized process group" in out
    assert "init_process_group()" in out


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", two_rank_backends())
def test_two_ranks(variant: tuple[str, int]) -> None:
    backend, world_size = variant
    from ddp_wrap_workers import gradient_sync

    results = run_ranks(gradient_sync, world_size=world_size, backend=backend)
    r0, r1 = results
    # Gradients are synchronised: both ranks agree, and equal the mean of the local ones.
    assert r0["forward_grads"] == r1["forward_grads"]
    for key in ("marked_grads", "late_marked_grads"):
        assert r0[key] == r1[key] == r0["forward_grads"], key
    for name, grad in r0["marked_grads"].items():
        mean = [
            (a + b) / 2
            for a, b in zip(r0["local_grads"][name], r1["local_grads"][name], strict=True)
        ]
        assert grad == pytest.approx(mean), name
    assert r0["local_grads"] != r1["local_grads"]  # what a silent bypass would have left
    for r in results:
        assert "RunnerNet.loss() ran the forward of submodule 'net'" in r["bypass_error"]
        assert r["bypass_left_grads"] == {}
        assert r["encode_ok"] == 4
        assert r["submodule_errors"] == [
            "submodule 'body.layer2' (Linear) of the DDP-wrapped Nested",  # first in backward
            "submodule 'body.layer1' (Linear) of the DDP-wrapped Nested",
        ]
        assert r["submodule_left_grads"] == {}
        # Allowed, as raw DDP reduces them: inputs_embeds through the wrapper (raw DDP's
        # gradients exactly), an auxiliary loss.
        assert r["embeds_grads_ours"] == r["embeds_grads_raw"]
    assert r0["nested_grads"] == r1["nested_grads"]  # the step after a refusal is in sync
    assert r0["embeds_grads_ours"] == r1["embeds_grads_ours"]
    assert r0["aux_grads"] == r1["aux_grads"]
    # no_sync bypass micro-step + synced step: the global batch's gradients on every rank.
    assert r0["no_sync_grads"] == r1["no_sync_grads"]
    for name, grad in r0["no_sync_grads"].items():
        local = zip(r0["no_sync_local_grads"][name], r1["no_sync_local_grads"][name], strict=True)
        assert grad == pytest.approx([(a + b) / 2 for a, b in local]), name
    # broadcast_buffers=False: each rank keeps its own buffer; True: rank 0's everywhere.
    assert r0["mean_after_broadcast_False"] == [0.0] * 4
    assert r1["mean_after_broadcast_False"] == [1.0] * 4
    assert r0["mean_after_broadcast_True"] == r1["mean_after_broadcast_True"] == [0.0] * 4
