"""Issue 47: the recipe applied by prepare_model (checkpointing, compile, offload), per block."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_harness import run_ranks
from distributed_strategy import apply_block_recipe, prepare_model
from distributed_strategy.recipe import recipe_blocks
from toy_models import Block, Regressor, RunnerNet


@pytest.mark.multiprocess
def test_checkpointing_and_offload_change_no_bit_of_the_gradients(tmp_path: Path) -> None:
    """Full and selective checkpointing (DDP and FSDP) and CPU offload (FSDP) on 2 gloo ranks:
    every gradient equals the plain model's bit for bit, on every rank, after one backward and
    after two micro-batches accumulated with grad-sync's no_sync, and so does grad-sync's
    global clip norm; checkpoint-io's checkpoint of each loads into a fresh model with the
    same recipe and into a plain one, equal to the saved weights (the recipe changes no key);
    prepare_model's replica check ran for each; and checkpointing is really on (each block's
    norm runs again in backward: 4 runs for 2 blocks, not 2)."""
    import recipe_workers

    run_ranks(recipe_workers.recipes, str(tmp_path))
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        runs = {k: found.pop(k) for k in list(found) if k.endswith("-norm-runs")}
        assert found and all(found.values()), found
        for strategy in ("ddp", "fsdp"):
            assert runs[f"{strategy}-plain-norm-runs"] == 2, runs
            assert runs[f"{strategy}-full-norm-runs"] == 4, runs
            assert runs[f"{strategy}-selective-norm-runs"] == 4, runs
        assert runs["fsdp-offload-norm-runs"] == 2, runs


@pytest.mark.multiprocess
def test_checkpointing_changes_no_bit_under_hsdp_2x2(tmp_path: Path) -> None:
    """HSDP on 4 gloo ranks, 2 replicas of 2 shards: full and selective checkpointing leave
    every gradient and grad-sync's global clip norm bit-identical to the plain model's."""
    import recipe_workers

    run_ranks(recipe_workers.hsdp_recipes, str(tmp_path), world_size=4)
    for rank in range(4):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found.pop("mesh") == [2, 2]
        runs = {k: found.pop(k) for k in list(found) if k.endswith("-norm-runs")}
        assert runs == {
            "hsdp-plain-norm-runs": 2,
            "hsdp-full-norm-runs": 4,
            "hsdp-selective-norm-runs": 4,
        }, runs
        assert found and all(found.values()), found


@pytest.mark.usefixtures("process_group")
@pytest.mark.parametrize(
    "recipe",
    [{"checkpointing": "full"}, {"checkpointing": "selective"}, {"offload": True}],
    ids=["full", "selective", "offload"],
)
def test_the_stale_optimizer_check_holds_with_each_knob(recipe: dict[str, Any]) -> None:
    """fsdp-wrap's refusal of an optimizer built before the wrap still fires with the block
    recipe applied first (checkpointing) and with offload, before any weight changes."""
    from fsdp_wrap import wrap_module_fsdp

    model = Regressor()
    stale = torch.optim.AdamW(model.parameters(), lr=0.1)
    apply_block_recipe(model.blocks, checkpointing=recipe.get("checkpointing", "none"))
    wrap_module_fsdp(model, device="cpu", offload=recipe.get("offload", False))
    model(torch.randn(4, 8)).sum().backward()
    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="was created before the model was sharded"):
        stale.step()
    after = [p.detach().full_tensor() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_the_blocks_are_the_shard_units_or_the_whole_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = Regressor()
    blocks = {id(block) for block in model.blocks}
    assert {id(b) for b in recipe_blocks(model)} == blocks
    assert {id(b) for b in recipe_blocks(model, [Block])} == blocks
    lonely = RunnerNet()
    with caplog.at_level(logging.INFO, logger="distributed_strategy"):
        assert recipe_blocks(lonely) == [lonely]
    assert "has no repeated block" in caplog.text and "whole model" in caplog.text


def test_bad_recipe_values_are_named_and_change_nothing() -> None:
    model = Regressor()
    forwards = [block.forward for block in model.blocks]
    with pytest.raises(ValueError, match=r"checkpointing must be one of none, full, selective"):
        apply_block_recipe(model.blocks, checkpointing="some")
    with pytest.raises(TypeError, match=r"compile must be a bool or a backend name, got 3"):
        apply_block_recipe(model.blocks, compile=3)  # type: ignore[arg-type]
    assert [block.forward for block in model.blocks] == forwards


@pytest.mark.usefixtures("process_group")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_compile_per_block_matches_eager(caplog: pytest.LogCaptureFixture) -> None:
    """compile: true compiles each block (before the wrap): the same loss and gradients within
    float tolerance, the recipe named in prepare_model's summary line."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    results = []
    for compiled in (False, True):
        with caplog.at_level(logging.INFO, logger="distributed_strategy"):
            model = prepare_model(
                Regressor,
                None,
                config={
                    "strategy": "fsdp",
                    "compile": compiled,
                    "activation_checkpointing": "full",
                },
                device="cpu",
                default_dtype=torch.float32,
                seed=5,
            )
        torch.manual_seed(1)
        loss = model(torch.randn(6, 8)).pow(2).mean()
        loss.backward()
        grads = [p.grad.full_tensor() for p in model.parameters()]  # type: ignore[union-attr]
        results.append((loss.detach(), grads))
        assert all(block._compiled_call_impl is not None for block in model.blocks) == compiled
    assert counters["stats"]["unique_graphs"] >= 1  # the blocks were traced, not just wrapped
    torch.testing.assert_close(results[0][0], results[1][0])
    for eager, compiled_grad in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(eager, compiled_grad)
    assert "checkpointing=full, compile=True, offload=none" in caplog.text


@pytest.mark.usefixtures("process_group")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_ddp_refuses_a_bypass_under_compile() -> None:
    """ddp-wrap's bypass refusal still fires when the blocks are compiled (inductor on CPU):
    a block's Linear run outside the wrapper's forward is refused at its backward, and its
    parameters get no gradient."""
    torch._dynamo.reset()
    model = prepare_model(
        Regressor,
        None,
        config={"strategy": "ddp", "compile": True},
        device="cpu",
        default_dtype=torch.float32,
        seed=5,
    )
    block = model.module.blocks[0]
    assert block._compiled_call_impl is not None  # the block runs compiled
    with pytest.raises(RuntimeError, match=r"submodule 'blocks\.0\..*' .* of the DDP-wrapped"):
        block(torch.randn(6, 8)).sum().backward()
    assert all(p.grad is None for p in block.mlp[2].parameters())
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compile_traces_blocks_of_torch_nn_classes() -> None:
    """nn.Module.compile traced nothing for a block whose forward is torch.nn's own (dynamo
    skips both _call_impl and torch.nn: pytorch/pytorch 150915); the recipe compiles its bound
    forward instead. Proves: a graph is captured for an nn.Sequential block, with and without
    checkpointing."""
    from torch._dynamo.utils import counters

    for checkpointing in ("none", "full"):
        torch._dynamo.reset()
        counters.clear()
        block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
        apply_block_recipe([block], checkpointing=checkpointing, compile="eager")
        block(torch.randn(2, 4, requires_grad=True)).sum().backward()
        assert counters["stats"]["unique_graphs"] >= 1, checkpointing
    torch._dynamo.reset()
