"""wrap_module_fsdp on a one-rank gloo group, plus one two-rank run."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dist_harness import fresh_interpreter, run_ranks, two_rank_backends
from fsdp_wrap import (
    hsdp_mesh,
    mixed_precision_policy,
    select_shard_targets,
    torch_dtype,
    wrap_module_fsdp,
)
from fsdp_wrap._policy import describe_units, select_with_rule
from toy_models import Block, CausalLM, DecoderStack, Regressor, RunnerNet, SequentialViT, ToyNet


class TestShardPolicy:
    def test_default_is_each_module_list_member(self) -> None:
        model = ToyNet(depth=3)
        assert select_shard_targets(model, None) == list(reversed(list(model.blocks)))

    def test_default_follows_no_split_modules(self) -> None:
        model = DecoderStack()
        assert select_shard_targets(model, None) == list(reversed(list(model.layers)))
        wrapper = CausalLM()  # declared on a submodule
        assert select_shard_targets(wrapper, None) == list(reversed(list(wrapper.model.layers)))
        assert (
            select_with_rule(wrapper, None)[1]
            == "default policy: _no_split_modules ['DecoderLayer']"
        )

    def test_declared_names_matching_nothing_fall_back_to_repeated_blocks(self) -> None:
        model = DecoderStack()
        model._no_split_modules = ["GoneLayer"]
        chosen = select_shard_targets(model, None)
        assert chosen == list(reversed([*model.layers, *model.adapters]))

    def test_default_takes_repeated_blocks_of_a_sequential(self) -> None:
        model = SequentialViT()
        # The blocks; not the head's two Linears (one MLP), not the parameter-free GELUs.
        assert select_shard_targets(model, None) == list(reversed(list(model.blocks)))
        mixed = nn.ModuleList([Block(8), Block(8), nn.LayerNorm(8)])
        assert select_shard_targets(mixed, None) == [mixed[1], mixed[0]]  # the class that repeats

    def test_default_may_select_nothing(self) -> None:
        assert select_shard_targets(RunnerNet(), None) == []
        assert describe_units([]) == "none"
        assert describe_units([Block(2), Block(2), nn.Linear(1, 1)]) == "2 x Block, 1 x Linear"

    def test_classes_and_names(self) -> None:
        model = Regressor()
        by_class = select_shard_targets(model, [Block])
        by_name = select_shard_targets(model, ["Block"])
        assert by_class == by_name == list(reversed(list(model.blocks)))
        linears = select_shard_targets(model, [nn.Linear])
        assert model.encoder in linears and model.out in linears

    def test_children_come_before_parents(self) -> None:
        model = Regressor()
        order = select_shard_targets(model, ["Block", "Sequential"])
        for block in model.blocks:
            assert order.index(block.mlp) < order.index(block)

    def test_callable(self) -> None:
        model = Regressor()
        assert select_shard_targets(model, lambda m: m is model.out) == [model.out]
        assert model not in select_shard_targets(model, lambda m: True)  # never the root

    def test_unknown_class_name(self) -> None:
        with pytest.raises(ValueError) as info:
            select_shard_targets(Regressor(), ["Blok"])
        message = str(info.value)
        assert (
            "shard names class(es) that no submodule has: 'Blok' (did you mean 'Block'?)" in message
        )
        assert "Linear" in message

    @pytest.mark.parametrize("shard", ["Block", 3, Block])
    def test_bad_type(self, shard: object) -> None:
        with pytest.raises(TypeError, match="shard must be None, a callable"):
            select_shard_targets(Regressor(), shard)  # type: ignore[arg-type]

    def test_bad_entry(self) -> None:
        with pytest.raises(
            TypeError, match="shard entries must be nn.Module classes or class names, got int"
        ):
            select_shard_targets(Regressor(), ["Block", 3])  # type: ignore[list-item]


class TestPrecision:
    def test_names(self) -> None:
        assert torch_dtype("bf16") is torch.bfloat16
        assert torch_dtype("Float16") is torch.float16
        assert torch_dtype(torch.float32) is torch.float32
        assert torch_dtype(None) is None
        policy = mixed_precision_policy("bf16", "fp32")
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)

    def test_unknown_name_lists_the_valid_ones(self) -> None:
        with pytest.raises(ValueError) as info:
            mixed_precision_policy("bf61", None)
        message = str(info.value)
        assert message.startswith("param_dtype must be one of {")
        assert "bf16" in message and "fp16" in message and "fp32" in message
        assert "got 'bf61'" in message

    def test_bad_dtype(self) -> None:
        with pytest.raises(ValueError, match="reduce_dtype must be one of torch.bfloat16"):
            mixed_precision_policy(None, torch.float64)
        with pytest.raises(TypeError, match="param_dtype must be a dtype name"):
            mixed_precision_policy(16, None)  # type: ignore[arg-type]


@pytest.mark.usefixtures("process_group")
def test_wraps_share_one_default_mesh() -> None:
    """One mesh per default group: where CUDA is available and the default group is gloo,
    torch's init_device_mesh makes a new group for every mesh, one per wrap, never destroyed."""
    from torch.distributed.tensor import DTensor

    from toy_models import SequentialViT

    first = wrap_module_fsdp(SequentialViT(), device="cpu")
    second = wrap_module_fsdp(SequentialViT(), device="cpu")
    meshes = {
        id(p.device_mesh) for m in (first, second) for p in m.parameters() if isinstance(p, DTensor)
    }
    assert len(meshes) == 1


@pytest.mark.usefixtures("process_group")
def test_an_hsdp_mesh_that_is_not_the_world_is_refused() -> None:
    with pytest.raises(ValueError) as raised:
        hsdp_mesh("cpu", replicate=2, shard=2)
    assert str(raised.value) == (
        "hsdp_mesh: replicate * shard must equal the world size 1, got 2 * 2; e.g. "
        "replicate=1, shard=1"
    )


@pytest.mark.usefixtures("process_group")
class TestWrap:
    def test_shards_and_trains(self, caplog: pytest.LogCaptureFixture) -> None:
        torch.manual_seed(0)
        model = Regressor()
        reference = Regressor()
        reference.load_state_dict(model.state_dict())
        with caplog.at_level(logging.INFO, logger="fsdp_wrap"):
            wrapped = wrap_module_fsdp(model, device="cpu")
        assert wrapped is model
        assert all(isinstance(p, DTensor) for p in model.parameters())
        records = [r.getMessage() for r in caplog.records if r.name.startswith("fsdp_wrap")]
        assert len(records) == 1
        assert (
            "sharded Regressor with FSDP2 on cpu x 1 rank(s): 2 unit(s) (2 x Block; default "
            "policy: repeated blocks of nn.ModuleList / nn.Sequential) plus the root" in records[0]
        )
        x = torch.randn(3, 8)
        assert torch.allclose(model(x), reference(x))

    def test_mixed_precision_compute(self) -> None:
        model = wrap_module_fsdp(Regressor(), device="cpu", param_dtype="bf16", reduce_dtype="fp32")
        assert model(torch.randn(2, 8)).dtype == torch.bfloat16
        # the root keeps its gathered bf16 parameters from the forward to the backward, as raw
        # fully_shard does; its blocks were resharded at once
        assert next(iter(model.parameters())).dtype == torch.bfloat16
        assert all(p.dtype == torch.float32 for p in model.blocks.parameters())
        model.reshard()
        assert next(iter(model.parameters())).dtype == torch.float32  # sharded master weights

    def test_same_checks_as_ddp(self) -> None:
        with pytest.raises(TypeError, match="wrap_module_fsdp needs an nn.Module, got str"):
            wrap_module_fsdp("m", device="cpu")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="wrap_module_fsdp needs at least one parameter"):
            wrap_module_fsdp(Regressor().requires_grad_(False), device="cpu")
        with pytest.raises(ValueError, match="concrete CUDA device such as 'cuda:0'"):
            wrap_module_fsdp(Regressor(), device="cuda")
        # Unlike DDP, CPU parameters for an accelerator are accepted (dist-core's allow_host):
        # fully_shard moves each unit to the device as it shards it.

    def test_bad_arguments_leave_the_model_unsharded(self) -> None:
        model = RunnerNet()
        with pytest.raises(ValueError, match="param_dtype must be one of"):
            wrap_module_fsdp(model, device="cpu", param_dtype="int8")
        with pytest.raises(AttributeError, match="RunnerNet has no attribute 'odewrapper'"):
            wrap_module_fsdp(model, device="cpu", forward_methods=["odewrapper"])
        with pytest.raises(ValueError, match="name a method other than forward"):
            wrap_module_fsdp(model, device="cpu", forward_methods=["forward"])
        # The same mistake raises the same type under either wrapper (dist-core's check).
        with pytest.raises(TypeError, match="RunnerNet.latent_seq_len is a int, not a method"):
            wrap_module_fsdp(model, device="cpu", forward_methods=["latent_seq_len"])
        with pytest.raises(TypeError, match="reshard_after_forward must be a bool"):
            wrap_module_fsdp(model, device="cpu", reshard_after_forward="yes")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="shard names class"):
            wrap_module_fsdp(model, device="cpu", shard=["Nope"])
        with pytest.raises(TypeError, match=r"offload must be a bool, got str \('cpu'\)"):
            wrap_module_fsdp(model, device="cpu", offload="cpu")  # type: ignore[arg-type]
        assert not any(isinstance(p, DTensor) for p in model.parameters())

    def test_device_resident_optimizer_state_for_offloaded_parameters_is_refused(self) -> None:
        """Issue 47: offload=True keeps parameters, gradients and optimizer state in host
        memory. An optimizer with capturable=True (its step counts on the device), or with
        state on another device than its parameter (here "meta", the invariant checked on a
        CPU run), is refused at its first step, naming the option; no weight changes. A
        fused AdamW steps (torch runs it on host parameters)."""
        model = wrap_module_fsdp(Regressor(), device="cpu", offload=True)
        before = [p.detach().full_tensor().clone() for p in model.parameters()]
        model(torch.randn(4, 8)).pow(2).mean().backward()
        capturable = torch.optim.AdamW(model.parameters(), lr=0.1, capturable=True)
        with pytest.raises(ValueError, match=r"AdamW\(capturable=True\) keeps its step counts"):
            capturable.step()
        first = next(iter(model.parameters()))
        elsewhere = torch.optim.AdamW(model.parameters(), lr=0.1)
        elsewhere.state[first]["exp_avg"] = torch.empty(first.shape, device="meta")
        with pytest.raises(ValueError, match=r"state 'exp_avg' of an offloaded parameter .* meta"):
            elsewhere.step()
        after = [p.detach().full_tensor() for p in model.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
        torch.optim.AdamW(model.parameters(), lr=0.1, fused=True).step()
        assert not torch.equal(next(iter(model.parameters())).detach().full_tensor(), before[0])
        # The check holds no reference to a parameter, which would make torch refuse to swap
        # it: a model sharded on meta with offload still materializes (to_empty swaps).
        with torch.device("meta"):
            deferred = Regressor()
        wrap_module_fsdp(deferred, device="cpu", offload=True)
        deferred.to_empty(device="cpu")
        assert all(p.device.type == "cpu" for p in deferred.parameters())

    def test_a_model_on_meta_is_sharded_then_materialized(self) -> None:
        """FSDP2's deferred initialization: shard on meta, then ``to_empty`` and initialize."""
        torch.manual_seed(0)
        reference = Regressor()
        with torch.device("meta"):
            model = Regressor()
        wrap_module_fsdp(model, device="cpu")
        assert all(isinstance(p, DTensor) and p.device.type == "meta" for p in model.parameters())
        model.to_empty(device="cpu")
        full = StateDictOptions(full_state_dict=True)  # plain tensors in, local shards kept
        set_model_state_dict(model, reference.state_dict(), options=full)
        x = torch.randn(3, 8)
        assert torch.allclose(model(x), reference(x))

    def test_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (1,))
        model = wrap_module_fsdp(Regressor(), device="cpu", mesh=mesh, reshard_after_forward=False)
        assert next(iter(model.parameters())).device_mesh == mesh
        with pytest.raises(TypeError, match="mesh must be a DeviceMesh or None, got str"):
            wrap_module_fsdp(Regressor(), device="cpu", mesh="cpu")  # type: ignore[arg-type]


def test_uninitialized_process_group_is_refused() -> None:
    out = fresh_interpreter(
        """
        import torch
        from fsdp_wrap import wrap_module_fsdp
        try:
            wrap_module_fsdp(torch.nn.Linear(2, 2), device="cpu")
        except RuntimeError as error:
            print(error)
        """
    )
    assert "wrap_module_fsdp requires an initialized process group" in out


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", two_rank_backends())
def test_two_ranks_shard_and_synchronise(variant: tuple[str, int]) -> None:
    backend, world_size = variant
    from fsdp_wrap_workers import sharded_step

    r0, r1 = run_ranks(sharded_step, world_size=world_size, backend=backend)
    # RunnerNet has no blocks: one warning, on rank 0 only, naming the fix.
    assert len(r0["warnings"]) == 1 and r1["warnings"] == []
    assert "selected no submodule of RunnerNet: FSDP will hold the whole model" in r0["warnings"][0]
    assert "shard=['Block']" in r0["warnings"][0]
    for r in (r0, r1):
        assert r["vit_units"] == 3  # timm-like Sequential of blocks: each its own unit
        assert r["sharded"]
        assert r["local_rows"] == 2  # the (4, 4) weight split by rows over two ranks
    assert r0["grads"] == r1["grads"]
    for name, grad in r0["grads"].items():
        mean = (torch.tensor(r0["local_grads"][name]) + torch.tensor(r1["local_grads"][name])) / 2
        assert torch.allclose(torch.tensor(grad), mean), name
    # An optimizer made before the wrap (FSDP and HSDP): refused at every step, naming the
    # cause and the fix, before any weight changed; one made after trains every parameter.
    for r in (r0, r1):
        for kind, stale in r["stale"].items():
            assert len(stale["errors"]) == 2, kind
            n = stale["parameters"]
            assert stale["errors"][0].startswith(
                f"AdamW was created before the model was sharded: it holds {n} of its {n} "
                "parameter(s) that wrap_module_fsdp replaced"
            ), (kind, stale["errors"][0])
            assert (
                "Create the optimizer after the wrap, from model.parameters()"
                in (stale["errors"][0])
            )
            assert stale["unchanged"] and stale["early_state"] == 0, kind
        if r is r0:  # the wrap already says so, once, on rank 0
            (warning,) = r["stale"]["fsdp"]["warnings"]
            assert warning.startswith(
                f"{r['stale']['fsdp']['parameters']} parameter(s) of SequentialViT that the wrap "
                "replaced are still held elsewhere (an optimizer created before the wrap?)"
            )
        else:
            assert r["stale"]["fsdp"]["warnings"] == []
            assert stale["trained"] == n, kind
            assert stale["other"] == [0.5, 0.5], kind
