"""checkpoint-io: save and resume across DDP, FSDP2, world sizes and one process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import checkpoint_workers as workers
from checkpoint_io import (
    CheckpointError,
    consolidate_checkpoint,
    full_state_dict,
    load_checkpoint,
    save_checkpoint,
)
from dist_harness import run_ranks, two_rank_backends


@pytest.fixture(scope="module", params=two_rank_backends())
def two_ranks(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> tuple[list[dict[str, Any]], Path]:
    backend, world_size = request.param
    folder = tmp_path_factory.mktemp("ckpt")
    return run_ranks(
        workers.everything, str(folder), world_size=world_size, backend=backend
    ), folder


@pytest.mark.multiprocess
def test_same_strategy_resume_is_bit_for_bit(two_ranks: Any) -> None:
    results, _ = two_ranks
    for rank in results:
        assert rank["ddp_resume_exact"] is True  # dropout too: every rank's RNG came back
        assert rank["info"] == (2, {"lr": pytest.approx(0.05 * 0.9**2)}, 2, "ddp")
        assert rank["state_after_2_missing"] is True  # sparse AdamW state saved and loaded


@pytest.mark.multiprocess
def test_cross_strategy_resume(two_ranks: Any) -> None:
    results, _ = two_ranks
    for rank in results:
        assert rank["fsdp_resume_close"] is True  # DDP -> FSDP2, then 2 more steps
        assert rank["sched_restored"] is True
        assert rank["fsdp_to_ddp_exact"] is True  # FSDP2 -> DDP: the saved bits
        assert all(all(moments.values()) for moments in rank["fsdp_to_ddp_optimizer"])
        assert rank["info4"] == ("fsdp", 2)
        assert rank["in_place_exact"] is True


@pytest.mark.multiprocess
def test_failed_save_raises_everywhere_and_keeps_the_old(two_ranks: Any) -> None:
    results, _ = two_ranks
    assert results[1]["failed_save"] == "OSError: disk quota exceeded (simulated on rank 1)"
    assert results[0]["failed_save"].startswith(
        "CheckpointError: collecting the state to save failed on rank(s) [1]"
    )
    for rank in results:
        assert rank["after_failed_save"] is True  # no partial directory, old one intact
        assert rank["old_still_loads"] is True


@pytest.mark.multiprocess
def test_corrupt_load_changes_nothing(two_ranks: Any) -> None:
    results, _ = two_ranks
    for rank in results:
        assert "truncated or corrupt" in rank["corrupt"], rank["corrupt"]
        assert rank["unchanged"] is True


@pytest.mark.multiprocess
def test_two_ranks_to_one_process(two_ranks: Any, tmp_path: Path) -> None:
    """No process group here: load the 2-rank DDP checkpoint into a plain model, consolidate."""
    results, _ = two_ranks
    path = Path(results[0]["saved_path"])
    model = workers.Net()
    info = load_checkpoint(path, model)
    assert (info.world_size, info.strategy, info.step) == (2, "ddp", 2)
    assert list(model.state_dict()) == list(workers.Net().state_dict())  # plain keys
    out = consolidate_checkpoint(path, tmp_path / "one.pt")
    obj = torch.load(out, weights_only=True)
    assert obj["step"] == 2 and obj["extra"] == {"lr": pytest.approx(0.0405)}
    plain = workers.Net()
    plain.load_state_dict(obj["model"])
    for key, value in plain.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key
    assert "empty_cond" not in obj["optimizer"]["state"]  # never had a gradient
    assert set(obj["optimizer"]["state"]) == {n for n, _ in plain.named_parameters()} - {
        "empty_cond"
    }


class Small(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.body = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _trained() -> tuple[Small, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Small()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


class TestOneProcess:
    def test_round_trip_and_manifest(self, tmp_path: Path) -> None:
        model, optimizer = _trained()
        path = save_checkpoint(tmp_path / "c", model, optimizer, step=3, extra={"a": [1]})
        manifest = json.loads((path / "checkpoint.json").read_text())
        assert manifest["strategy"] == "none" and manifest["world_size"] == 1
        assert manifest["parameters"] == 25 and manifest["model_class"].endswith("Small")
        fresh = Small()
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
        info = load_checkpoint(path, fresh, fresh_opt)
        assert info.step == 3 and info.extra == {"a": [1]}
        assert info.fingerprint == manifest["fingerprint"]
        assert fresh_opt.param_groups[0]["lr"] == 0.1
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
            assert torch.equal(a, b)
        assert list(full_state_dict(model)) == [
            "body.weight",
            "body.bias",
            "head.weight",
            "head.bias",
        ]

    def test_refusals(self, tmp_path: Path) -> None:
        model, optimizer = _trained()
        path = save_checkpoint(tmp_path / "c", model)
        with pytest.raises(FileExistsError, match="already exists; pass overwrite=True"):
            save_checkpoint(path, model)
        save_checkpoint(path, model, step=9, overwrite=True)
        assert load_checkpoint(path, Small()).step == 9
        assert [p.name for p in tmp_path.iterdir()] == ["c"]  # no temporary left
        with pytest.raises(FileNotFoundError, match="no checkpoint at"):
            load_checkpoint(tmp_path / "nope", model)
        with pytest.raises(CheckpointError, match="is not a checkpoint: it has no checkpoint.json"):
            load_checkpoint(tmp_path, model)
        with pytest.raises(CheckpointError, match="saved without one"):
            load_checkpoint(path, model, optimizer)
        with pytest.raises(
            CheckpointError, match="stateful object\\(s\\) \\['sched'\\] were not saved"
        ):
            load_checkpoint(
                path, model, stateful={"sched": torch.optim.lr_scheduler.StepLR(optimizer, 1)}
            )
        with pytest.raises(TypeError, match="extra must be JSON-serialisable"):
            save_checkpoint(tmp_path / "d", model, extra={"t": torch.ones(1)})
        with pytest.raises(TypeError, match="stateful\\['x'\\] is a int, which lacks state_dict"):
            save_checkpoint(tmp_path / "d", model, stateful={"x": 3})
        assert not (tmp_path / "d").exists()

    @pytest.mark.parametrize(
        ("call", "match"),
        [
            (lambda m, o, p: save_checkpoint(3, m), "path must be a str or os.PathLike, got int"),
            (lambda m, o, p: save_checkpoint(p, "m"), "model must be an nn.Module, got str"),
            (lambda m, o, p: save_checkpoint(p, m, 1), "optimizer must be a torch.optim.Optimizer"),
            (
                lambda m, o, p: save_checkpoint(p, m, step=1.5),
                "step must be an int or None, got float",
            ),
            (lambda m, o, p: save_checkpoint(p, m, stateful=[o]), "stateful must be a mapping"),
            (lambda m, o, p: load_checkpoint(p, "m"), "model must be an nn.Module, got str"),
            (lambda m, o, p: load_checkpoint(p, m, 1), "optimizer must be a torch.optim.Optimizer"),
            (lambda m, o, p: full_state_dict("m"), "model must be an nn.Module, got str"),
        ],
    )
    def test_bad_argument_types(self, tmp_path: Path, call: Any, match: str) -> None:
        model, optimizer = _trained()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(TypeError, match=match):
            call(model, optimizer, tmp_path / "c")
        assert not (tmp_path / "c").exists()
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    def test_key_and_shape_mismatches(self, tmp_path: Path) -> None:
        model, _ = _trained()
        path = save_checkpoint(tmp_path / "c", model)

        class Renamed(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.bodyy = nn.Linear(4, 4)
                self.head = nn.Linear(4, 1)

        with pytest.raises(CheckpointError) as info:
            load_checkpoint(path, Renamed())
        message = str(info.value)
        assert "missing from the checkpoint: 'bodyy.bias' (did you mean 'body.bias'?)" in message
        assert (
            "in the checkpoint but not in the model: 'body.bias' (did you mean 'bodyy.bias'?)"
            in message
        )
        partial = Renamed()
        load_checkpoint(path, partial, strict=False)
        assert torch.equal(partial.head.weight, model.head.weight)
        with pytest.raises(
            CheckpointError,
            match=r"shape mismatch for 'body.bias': the checkpoint has \(4,\), the model \(5,\)",
        ):
            load_checkpoint(path, Small(width=5), strict=False)
        double = Small().double()
        with pytest.raises(CheckpointError, match="dtype mismatch for 'body.bias'"):
            load_checkpoint(path, double)

    def test_verification_and_newer_format(self, tmp_path: Path) -> None:
        model, _ = _trained()
        path = save_checkpoint(tmp_path / "c", model)
        manifest = json.loads((path / "checkpoint.json").read_text())
        (path / "checkpoint.json").write_text(json.dumps({**manifest, "fingerprint": "0" * 64}))
        target = Small()
        before = {k: v.clone() for k, v in target.state_dict().items()}
        with pytest.raises(CheckpointError, match="verification failed"):
            load_checkpoint(path, target)
        assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
        load_checkpoint(path, target, verify=False)  # in place
        assert torch.equal(target.body.weight, model.body.weight)
        (path / "checkpoint.json").write_text(json.dumps({**manifest, "format_version": 99}))
        with pytest.raises(CheckpointError, match="newer than this checkpoint-io reads"):
            load_checkpoint(path, target)

    def test_rng_state_comes_back(self, tmp_path: Path) -> None:
        model, _ = _trained()
        torch.manual_seed(123)
        path = save_checkpoint(tmp_path / "c", model)
        expected = torch.rand(3)
        torch.rand(100)
        load_checkpoint(path, Small())
        assert torch.equal(torch.rand(3), expected)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "checkpoint_io", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_cli(tmp_path: Path) -> None:
    model, optimizer = _trained()
    path = save_checkpoint(tmp_path / "c", model, optimizer, step=5)
    shown = _cli("inspect", str(path))
    assert shown.returncode == 0, shown.stderr
    assert '"step": 5' in shown.stdout and "model.body.weight" in shown.stdout
    assert "4x4" in shown.stdout and "torch.float32" in shown.stdout
    bad = _cli("inspect", str(tmp_path / "missing"))
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "no checkpoint at" in bad.stderr
    done = _cli("consolidate", str(path), str(tmp_path / "one.pt"))
    assert done.returncode == 0, done.stderr
    assert torch.load(tmp_path / "one.pt", weights_only=True)["step"] == 5
