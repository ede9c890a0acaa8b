"""On a single GPU: every package's multi-rank worker once as a 1-rank NCCL run.

The two-rank NCCL variants need 2 GPUs. With one, this exercises the NCCL process group bound
to the device, collectives over one rank on CUDA tensors (object collectives, broadcasts,
DDP's all-reduce) and every package's CUDA code path; it does not exercise NCCL's all-gather
or reduce-scatter between ranks (FSDP2 issues no collective at world size 1) or any byte
moved between GPUs: those need a host with 2 or more GPUs, where the two-rank NCCL variants
of each package's tests run (``pytest tests -m nccl``).
Each worker's result is checked with the assertions of its two-rank test that do not depend
on the world size, adapted to one rank: a collective over one rank is the identity, so the
synchronised gradients are the rank's own, every shard is the whole tensor, a rank-dependent
seed or a bit flipped on rank 1 is no mismatch, and rank 1's failures do not happen. Where a
two-rank test compared two ranks, the single rank is compared with a reference computed in
this process (on the CPU, so with a tolerance where the run was on the GPU).

The same checks run at world size 1 on gloo (CPU, no GPU needed), so that every CI run
exercises them.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
import torch
from torch import nn

from dist_harness import cuda_count, run_ranks

Result = dict[str, Any]
Check = Callable[[Result, Path], None]
ModuleT = TypeVar("ModuleT", bound=nn.Module)


def _seeded(factory: Callable[[], ModuleT], seed: int) -> ModuleT:
    """``torch.manual_seed(seed); factory()`` on the CPU, leaving this process's RNG alone."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return factory()


def _assert_close(
    actual: Any, expected: Any, name: str, *, rtol: float = 1e-4, atol: float = 1e-6
) -> None:
    """``actual`` and ``expected`` (nested lists or tensors) agree elementwise.

    The default tolerance is for a rank's values against a reference computed here on the
    CPU: under NCCL the rank computed on the GPU, the same arithmetic with other kernels.
    """
    got = torch.as_tensor(actual, dtype=torch.float32)
    want = torch.as_tensor(expected, dtype=torch.float32).reshape(got.shape)
    assert torch.allclose(got, want, rtol=rtol, atol=atol), (name, got, want)


def _grads(model: nn.Module) -> dict[str, list[float]]:
    return {n: p.grad.flatten().tolist() for n, p in model.named_parameters() if p.grad is not None}


def _runner_reference() -> tuple[dict[str, list[float]], float]:
    """RunnerNet from seed 0 on rank 0's data, in this process: ``loss``'s gradients, value."""
    from toy_models import RunnerNet

    model = _seeded(RunnerNet, 0)
    data = torch.full((2, 4), 1.0)
    with torch.no_grad():
        value = model.loss(data).item()
    model.loss(data).backward()
    return _grads(model), value


def check_ddp_wrap(r: Result, _folder: Path) -> None:
    """ddp-wrap's ``gradient_sync``: the routed methods synchronise, the bypasses are refused."""
    # Two ranks: plain forward, marked method and late-marked method agree and are the mean of
    # the ranks' local gradients. One rank: the mean of one is the rank's own gradient.
    assert set(r["forward_grads"]) == {"net.weight", "empty_clip_feat"}  # frozen: no grad
    for key in ("marked_grads", "late_marked_grads"):
        assert r[key] == r["forward_grads"], key
    assert r["local_grads"].keys() == r["marked_grads"].keys()
    for name, grad in r["marked_grads"].items():
        assert grad == pytest.approx(r["local_grads"][name], rel=1e-5, abs=1e-7), name
    # (Left out: local_grads differing between ranks, which needs a second rank.)
    reference, loss = _runner_reference()
    for name, grad in r["forward_grads"].items():
        _assert_close(grad, reference[name], name)
    # The refused bypasses: the same on every rank, whatever the world size.
    assert "RunnerNet.loss() ran the forward of submodule 'net'" in r["bypass_error"]
    assert "mark_forward_method(model, 'loss')" in r["bypass_error"]
    assert r["bypass_left_grads"] == {}
    assert r["no_grad_ok"] == pytest.approx(loss, rel=1e-4)
    assert r["normalize_ok"] == 8.0  # (ones - zero buffer).sum() over a (2, 4) batch
    assert r["encode_ok"] == 4
    assert r["submodule_errors"] == [
        "submodule 'body.layer2' (Linear) of the DDP-wrapped Nested",  # first in backward
        "submodule 'body.layer1' (Linear) of the DDP-wrapped Nested",
    ]
    assert r["submodule_left_grads"] == {}
    # Allowed as under raw DDP: inputs_embeds through the wrapper gets raw DDP's gradients;
    # a no_sync bypass micro-step then a synced step: at one rank, the local gradients.
    assert r["embeds_grads_ours"] == r["embeds_grads_raw"]
    for name, grad in r["no_sync_grads"].items():
        _assert_close(grad, r["no_sync_local_grads"][name], name)
    # Two ranks: both ranks' nested gradients agree. One rank: they are one process's.
    from toy_models import Nested

    nested = _seeded(Nested, 0)
    nested(torch.full((2, 4), 1.0)).sum().backward()
    expected = _grads(nested)
    assert r["nested_grads"].keys() == expected.keys()
    for name, grad in r["nested_grads"].items():
        _assert_close(grad, expected[name], name)
    # Rank 0 fills its buffer with 0.0: it keeps it without broadcast and is the source with.
    # (Left out: rank 1 keeping its own 1.0s, which needs a second rank.)
    assert r["mean_after_broadcast_False"] == [0.0] * 4
    assert r["mean_after_broadcast_True"] == [0.0] * 4


def check_fsdp_wrap(r: Result, _folder: Path) -> None:
    """fsdp-wrap's ``sharded_step``: the warning on rank 0, the units, one rank's 'shards'."""
    assert len(r["warnings"]) == 1  # RunnerNet has no blocks: one warning, rank 0 logs it
    assert "selected no submodule of RunnerNet: FSDP will hold the whole model" in r["warnings"][0]
    assert "shard=['Block']" in r["warnings"][0]
    assert r["vit_units"] == 3  # timm-like Sequential of blocks: each its own unit
    assert r["sharded"] is True
    assert r["local_rows"] == 4  # the (4, 4) weight split by rows over one rank: all of it
    # Two ranks: the synchronised gradients are the mean of the local ones; one rank: its own.
    assert set(r["grads"]) == set(r["local_grads"]) == {"net.weight", "empty_clip_feat"}
    for name, grad in r["grads"].items():
        _assert_close(grad, r["local_grads"][name], name, rtol=1e-5, atol=1e-7)
    reference, _ = _runner_reference()
    for name, grad in r["grads"].items():
        _assert_close(grad, reference[name], name)


def check_replica_init(r: Result, _folder: Path) -> None:
    """replica-init's ``replica_checks``: the builds equal the official order, bit for bit."""
    from replica_init import model_fingerprint
    from replica_init_workers import PARAMS
    from toy_models import ToyNet

    reference = model_fingerprint(_seeded(lambda: ToyNet(**PARAMS), 3))
    assert r["sharded_reference"] == reference  # the rank's own reference is this process's
    assert r["fp_local"] == reference
    assert r["rng_unchanged"] is True
    # seed=100 + rank and a bit flipped on rank 1 differ from nothing on one rank: no
    # (false) mismatch is raised. (Left out: the two-rank messages, ranks and tensor names.)
    for key in ("seed_mismatch", "bit_mismatch", "sharded_seed_mismatch", "sharded_bit_mismatch"):
        assert key not in r, (key, r.get(key))
    assert r["fp_rank0"] == r["fp_local"]
    assert r["rank0_tied"] is True
    assert r["rank0_meta_left"] is False
    assert r["rank0_rng_unchanged"] is True
    # Rank 0's own failure is re-raised on rank 0 (the "ranks [0] failed" message is rank 1's).
    assert r["rank0_failure"] == "ValueError: constructor failed on rank 0"
    assert r["sharded_rank0_failure"] == "ValueError: constructor failed on rank 0"
    # A broadcast from rank 0 over one rank leaves rank 0's tensors as they were.
    assert r["coalesced"] == [
        [0.5] * 3,
        list(range(40)),
        [True, False],
        [0.0, 0.0],
        [0.25] * 4,
        torch.arange(12.0).reshape(3, 4).t().tolist(),
        [],
    ]
    for source in ("local", "rank0"):
        built = r[f"sharded_{source}"]
        assert built["full"] == reference, source
        assert built["dtensors"] is True and built["tied"] is True, source
        assert built["rng_unchanged"] is True and built["dtype"] is True, source
        # One rank's shards are the whole tensors: the verified digest is the full model's.
        assert built["verified"] == reference, source
        assert built["noise"] == r["rank0_noise"], source
    assert r["sharded_local"]["verified"] == r["sharded_rank0"]["verified"]


def check_integration(r: Result, _folder: Path) -> None:
    """The composed pipeline's ``train_both``: DDP and FSDP from one seed to the same weights."""
    from distributed_strategy import derive_seed
    from integration_workers import SEED, STEPS
    from toy_models import Regressor

    seeded = _seeded(lambda: Regressor(width=8), SEED)
    official = {name: t.tolist() for name, t in seeded.state_dict().items()}
    for strategy in ("ddp", "fsdp"):
        a = r[strategy]
        assert a["initial"] == official, strategy  # one seed, one replica: the official bits
        # The frozen encoder stayed frozen and untouched; the rest trained.
        for key in ("encoder.weight", "encoder.bias"):
            assert a["final"][key] == a["initial"][key], (strategy, key)
        assert a["frozen_grad_is_none"] is True
        assert a["final"]["out.weight"] != a["initial"]["out.weight"]
    assert r["ddp"]["final"].keys() == r["fsdp"]["final"].keys() == official.keys()
    for name, ddp_weight in r["ddp"]["final"].items():
        _assert_close(r["fsdp"]["final"][name], ddp_weight, name, rtol=1e-5, atol=1e-6)
    # One rank trains on its own data: the same steps in one process without a wrapper.
    # (Left out: both ranks ending bit for bit equal, which needs a second rank.)
    model = _seeded(lambda: Regressor(width=8), SEED)
    model.encoder.requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    data = torch.Generator().manual_seed(derive_seed(SEED, "data", 0))
    for _ in range(STEPS):
        x = torch.randn(4, 8, generator=data)
        (model(x) - x.sum(1, keepdim=True)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, weight in model.state_dict().items():
        for strategy in ("ddp", "fsdp"):
            _assert_close(r[strategy]["final"][name], weight, name, rtol=1e-4, atol=1e-5)


def check_grad_sync(r: Result, _folder: Path) -> None:
    """grad-sync's ``everything``: accumulation equals the global batch, clipping the same."""
    import grad_sync_workers as workers
    from grad_sync import clip_grad_norm

    for variant in ("ddp", "ddp_bucket_view", "ddp_static"):
        assert r[variant]["match"] == [True, True], variant  # both optimizer steps
    # DDP's reducer calls the comm hook once per ready bucket whatever the world size.
    assert r["ddp"]["counts"] == [[0, 0, 1], [1, 1, 2]]
    assert r["ddp_bucket_view"]["counts"] == [[0, 0, 1], [1, 1, 2]]
    assert r["ddp_static"]["counts"] == [[1, 1, 2], [2, 2, 3]]
    message = r["ddp_outside"]
    assert message.startswith("no_sync(model) did not take effect")
    assert "run the forward and the backward inside the context" in message
    fsdp = r["fsdp"]
    assert fsdp["match"] == [True, True]
    assert fsdp["restored"] == [True, True, True]  # also after an exception
    # Nothing is reduced in a no_sync micro-step. On the last one the 3 units (2 blocks and
    # the root) reduce-scatter once each on 2 ranks; on one rank torch 2.13 copies instead of
    # calling reduce_scatter (0), another torch may call it (3).
    per_step = fsdp["counts"][0][2]
    assert per_step in (0, 3), fsdp["counts"]
    assert fsdp["counts"] == [[0, 0, per_step], [per_step, per_step, 2 * per_step]]
    clip = r["clip"]
    for norm, norm_type in (("2", 2.0), ("inf", math.inf)):
        expected = clip[f"single_{norm}"]
        for strategy in ("ddp", "fsdp"):
            assert clip[f"{strategy}_{norm}"] == pytest.approx(expected, rel=1e-5), strategy
            assert clip[f"{strategy}_{norm}_clipped"] is True, strategy
        assert expected > 0.05, norm  # so clipping really changed the gradients
        # The rank's one-process reference is this process's: rank 0's batch, one backward.
        single = _seeded(workers.Blocks, 0)
        workers.loss_fn(single(torch.cat(workers.batches(0, 0)))).backward()
        here = float(clip_grad_norm(single, 0.05, norm_type))
        assert expected == pytest.approx(here, rel=1e-4), norm


def check_checkpoint_io(r: Result, folder: Path) -> None:
    """checkpoint-io's ``everything``: exact resumes, cross-strategy loads, all-or-nothing."""
    import checkpoint_workers as workers
    from checkpoint_io import consolidate_checkpoint, load_checkpoint

    assert r["ddp_resume_exact"] is True  # dropout too: the CPU and device RNG came back
    assert r["info"] == (2, {"lr": pytest.approx(0.05 * 0.9**2)}, 1, "ddp")
    assert r["state_after_2_missing"] is True  # sparse AdamW state saved and loaded
    assert r["fsdp_resume_close"] is True  # DDP -> FSDP2, then 2 more steps
    assert r["sched_restored"] is True
    assert r["fsdp_to_ddp_exact"] is True  # FSDP2 -> DDP: the saved bits
    # Every parameter with AdamW state (the blocks and the head; empty_cond never has any).
    assert len(r["fsdp_to_ddp_optimizer"]) == 6
    assert all(all(moments.values()) for moments in r["fsdp_to_ddp_optimizer"])
    assert r["info4"] == ("fsdp", 1)
    assert r["in_place_exact"] is True
    # The save "failing on rank 1" has no rank 1: it succeeds and replaces ddp-2 atomically,
    # leaving no partial or old directory. (Left out: the OSError and the CheckpointError
    # naming rank [1], which need a second rank.)
    assert r["failed_save"] == "no error"
    assert r["after_failed_save"] == []  # the listing's difference: none
    assert r["old_still_loads"] is True
    assert "truncated or corrupt" in r["corrupt"], r["corrupt"]
    assert r["unchanged"] is True  # model, optimizer moments and RNG
    # That replacement (step None, no extra), in this process: loads verified, consolidates.
    path = Path(r["saved_path"])
    assert path == folder / "ddp-2"
    model = _seeded(workers.Net, 0)
    info = load_checkpoint(path, model, rng=False)
    assert (info.world_size, info.strategy, info.step) == (1, "ddp", None)
    plain = _seeded(workers.Net, 1)
    assert list(model.state_dict()) == list(plain.state_dict())  # plain keys
    out = consolidate_checkpoint(path, folder / "hf")  # Hugging Face's layout, via hf-io
    from safetensors.torch import load_file

    plain.load_state_dict(load_file(out / "model.safetensors"))
    for key, value in plain.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key


WORKERS: list[tuple[str, str, Check]] = [
    ("ddp_wrap_workers", "gradient_sync", check_ddp_wrap),
    ("fsdp_wrap_workers", "sharded_step", check_fsdp_wrap),
    ("replica_init_workers", "replica_checks", check_replica_init),
    ("integration_workers", "train_both", check_integration),
    ("grad_sync_workers", "everything", check_grad_sync),
    ("checkpoint_workers", "everything", check_checkpoint_io),
]
IDS = [module for module, _, _ in WORKERS]


def _run_one_rank(module: str, name: str, backend: str, tmp_path: Path) -> Result:
    worker = getattr(importlib.import_module(module), name)
    args: tuple[Any, ...] = (str(tmp_path),) if module == "checkpoint_workers" else ()
    (result,) = run_ranks(worker, *args, world_size=1, backend=backend)
    return cast(Result, result)


@pytest.mark.multiprocess
@pytest.mark.nccl
@pytest.mark.skipif(cuda_count() < 1, reason="1-rank NCCL run: needs a CUDA device, none visible")
@pytest.mark.parametrize(("module", "name", "check"), WORKERS, ids=IDS)
def test_one_rank_nccl(module: str, name: str, check: Check, tmp_path: Path) -> None:
    check(_run_one_rank(module, name, "nccl", tmp_path), tmp_path)


@pytest.mark.multiprocess
def test_one_rank_gloo(tmp_path: Path) -> None:
    """The same checks on CPU, so that they run where no GPU is: every worker in one rank
    process, one after the other (a process start each cost ~5 s of the suite)."""
    from integration_workers import every_worker

    named = [(module, name) for module, name, _ in WORKERS]
    (results,) = run_ranks(every_worker, named, str(tmp_path), world_size=1, backend="gloo")
    for (module, _, check), result in zip(WORKERS, results, strict=True):
        try:
            check(cast(Result, result), tmp_path)
        except AssertionError as error:
            raise AssertionError(f"{module}: {error}") from error
