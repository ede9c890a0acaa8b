"""checkpoint-io: save and resume across DDP, FSDP2, world sizes and one process."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from torch import nn

import checkpoint_workers as workers
from checkpoint_io import (
    CheckpointError,
    CheckpointManager,
    async_save_checkpoint,
    consolidate_checkpoint,
    full_state_dict,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from checkpoint_models import Small, checkpoint_cli, trained
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
        "CheckpointError: preparing the save failed on rank(s) [1]"
    )
    # One agreement before DCP's first collective: the failures travel as data (a type name
    # and a message), so an error that cannot be pickled back reaches every rank too (it hung
    # the other rank when it travelled as the exception object), and rank 0's refusal is
    # raised everywhere.
    assert results[1]["failed_save_two_part"] == "TwoPartError: lost at rank 1"
    assert results[0]["failed_save_two_part"] == (
        "CheckpointError: preparing the save failed on rank(s) [1]; rank 1: lost at rank 1"
    )
    assert results[0]["failed_save_exists"].startswith("FileExistsError: '")
    assert results[1]["failed_save_exists"].startswith("FileExistsError: preparing the save")
    assert "failed on rank(s) [0]; rank 0: '" in results[1]["failed_save_exists"]
    # Under FSDP the failing rank plans no shard: DCP's own check of the merged plans would
    # have named rank 0 and a missing shard instead of rank 1 and its error.
    assert results[1]["failed_save_fsdp"] == results[1]["failed_save"]
    assert results[0]["failed_save_fsdp"] == results[0]["failed_save"]
    for rank in results:
        assert "already exists; pass overwrite=True" in rank["failed_save_exists"]
        assert rank["after_failed_save"] == [], rank  # no partial directory, old one intact
        assert rank["old_still_loads"] is True


@pytest.mark.multiprocess
def test_corrupt_load_changes_nothing(two_ranks: Any) -> None:
    results, _ = two_ranks
    for rank in results:
        assert "truncated or corrupt" in rank["corrupt"], rank["corrupt"]
        assert rank["unchanged"] is True


@pytest.mark.multiprocess
def test_per_rank_state_comes_back_to_its_own_rank(two_ranks: Any) -> None:
    """[100, 200] saved, [100, 200] loaded (DCP alone kept one rank's copy: [200, 200]),
    through save_checkpoint, async_save_checkpoint and CheckpointManager."""
    results, _ = two_ranks
    for how in ("sync", "async", "manager"):
        assert [r[f"per_rank_{how}"] for r in results] == [(100, True, 7), (200, True, 7)], how


@pytest.mark.multiprocess
def test_per_rank_state_at_another_world_size(two_ranks: Any) -> None:
    """2 ranks -> 1 process: a state equal on every rank loads; one that differed is refused
    before anything changes, naming the object, both world sizes and the way out."""
    results, _ = two_ranks
    path = Path(results[0]["per_rank_path"])
    same = workers.Counter()
    model = workers.Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    load_checkpoint(path, model, stateful={"same": same})
    assert same.value == 7
    fresh, offset = workers.Net(), workers.Counter("untouched")
    untouched = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(path, fresh, stateful={"same": workers.Counter(), "offset": offset})
    message = str(refused.value)
    assert "stateful['offset'] (Counter) held a different state on each of the 2 ranks" in message
    assert "is loaded on 1" in message and "Leave it out of stateful=" in message
    assert "sample-order" in message
    assert offset.value == "untouched"
    assert all(torch.equal(v, untouched[k]) for k, v in fresh.state_dict().items())
    assert before  # the first model was loaded, the second untouched


@pytest.mark.multiprocess
def test_rng_after_a_world_size_change_comes_from_the_checkpoint(
    two_ranks: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A 2-rank checkpoint resumed twice in one process, seeded differently before each
    load: the same dropout draws after both."""
    results, _ = two_ranks
    path = Path(results[0]["per_rank_path"])
    draws = []
    for seed in (1, 12345):
        torch.manual_seed(seed)
        model = workers.Net()
        load_checkpoint(path, model)
        draws.append(model.drop(torch.ones(64)))
    assert torch.equal(draws[0], draws[1])
    assert (
        "is loaded on 1: each rank's RNG streams are derived from the checkpoint's" in caplog.text
    )
    torch.manual_seed(1)
    assert not torch.equal(workers.Net().drop(torch.ones(64)), draws[0])  # not the seed's


@pytest.mark.multiprocess
def test_two_ranks_to_one_process(two_ranks: Any, tmp_path: Path) -> None:
    """No process group here: load the 2-rank DDP checkpoint into a plain model, consolidate."""
    results, _ = two_ranks
    path = Path(results[0]["saved_path"])
    model = workers.Net()
    info = load_checkpoint(path, model)
    assert (info.world_size, info.strategy, info.step) == (2, "ddp", 2)
    assert list(model.state_dict()) == list(workers.Net().state_dict())  # plain keys
    out = consolidate_checkpoint(path, tmp_path / "hf")  # Hugging Face's layout, via hf-io
    from safetensors.torch import load_file

    plain = workers.Net()
    plain.load_state_dict(load_file(out / "model.safetensors"))
    for key, value in plain.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key


class TestOneProcess:
    def test_round_trip_and_manifest(self, tmp_path: Path) -> None:
        model, optimizer = trained()
        path = save_checkpoint(tmp_path / "c", model, optimizer, step=3, extra={"a": [1]})
        manifest = json.loads((path / "checkpoint.json").read_text())
        assert manifest["strategy"] == "none" and manifest["world_size"] == 1
        assert manifest["parameters"] == 25 and manifest["model_class"].endswith("Small")
        fresh = Small()
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
        info = load_checkpoint(path, fresh, fresh_opt)
        assert info.step == 3 and info.extra == {"a": [1]}
        assert info.fingerprint is None  # format >= 2: no gathered fingerprint at save time
        assert manifest["format_version"] == 4
        assert sorted(manifest["files"]) == [
            "index.json",
            "rank0.safetensors",
            "rng/rank0.safetensors",
        ]
        for name, entry in manifest["files"].items():
            assert entry["bytes"] == (path / name).stat().st_size and entry["rank"] == 0
            assert entry["xxh3_128"] == xxhash.xxh3_128((path / name).read_bytes()).hexdigest()
        assert fresh_opt.param_groups[0]["lr"] == 0.1
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
            assert torch.equal(a, b)
        assert list(full_state_dict(model)) == [
            "body.weight",
            "body.bias",
            "head.weight",
            "head.bias",
        ]

    def test_every_file_opens_in_safetensors_and_torch_s_hf_reader_reads_it(
        self, tmp_path: Path
    ) -> None:
        """Format 4's data and side files are safetensors: safetensors' own ``safe_open``
        reads every one back to the saved values, and torch's ``HuggingFaceStorageReader``
        (DCP's sharding offsets in each header) loads the model with no code of ours; a
        failed write leaves the old checkpoint standing."""
        import torch.distributed.checkpoint as dcp
        from safetensors import safe_open
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        from checkpoint_io._storage import writer as storage

        model, optimizer = trained()
        path = save_checkpoint(tmp_path / "c", model, optimizer, step=1)
        with safe_open(path / "rank0.safetensors", framework="pt") as opened:
            for key, value in model.state_dict().items():
                assert torch.equal(opened.get_tensor(f"model.{key}"), value), key
            moments = optimizer.state[model.body.weight]["exp_avg"]
            assert torch.equal(opened.get_tensor("optim.state.body.weight.exp_avg"), moments)
        with safe_open(path / "rng" / "rank0.safetensors", framework="pt") as opened:
            assert opened.get_tensor("cpu").dtype == torch.uint8
        fresh = Small()
        state = {"model": fresh.state_dict()}
        with pytest.warns(UserWarning, match="single process"):
            dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)))
        for key, value in model.state_dict().items():
            assert torch.equal(value, state["model"][key]), key

        def full_disk(*args: Any, **kwargs: Any) -> Any:  # inside the write of a data file
            raise OSError("disk full (simulated)")

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(storage.StreamWriter, "write", full_disk)
            with pytest.raises(CheckpointError, match="disk full"):
                save_checkpoint(path, model, optimizer, step=2, overwrite=True)
        assert load_checkpoint(path, Small()).step == 1  # the old checkpoint stands
        assert [p.name for p in tmp_path.iterdir()] == ["c"]  # no temporary left

    def test_refusals(self, tmp_path: Path) -> None:
        model, optimizer = trained()
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
        model, optimizer = trained()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(TypeError, match=match):
            call(model, optimizer, tmp_path / "c")
        assert not (tmp_path / "c").exists()
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    def test_key_and_shape_mismatches(self, tmp_path: Path) -> None:
        model, _ = trained()
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
        model, _ = trained()
        path = save_checkpoint(tmp_path / "c", model)
        manifest = json.loads((path / "checkpoint.json").read_text())
        data = path / "rank0.safetensors"
        content = bytearray(data.read_bytes())
        weight = model.state_dict()["body.weight"].numpy().tobytes()
        assert content.count(weight) == 1
        content[content.find(weight) + 5] ^= 0x01  # one bit of a weight: the digest alone sees it
        data.write_bytes(bytes(content))
        target = Small()
        before = {k: v.clone() for k, v in target.state_dict().items()}
        with pytest.raises(
            CheckpointError,
            match=r"verification failed.*rank0.safetensors \(bytes \d+\.\.\d+\) has checksum",
        ):
            load_checkpoint(path, target)
        assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
        assert latest_checkpoint(tmp_path) is None  # not a step-<N> directory
        data.write_bytes(bytes(content) + b"x")  # DCP's index cannot tell; the table can
        with pytest.raises(CheckpointError, match="rank0.safetensors is .* bytes, .* were written"):
            load_checkpoint(path, target, verify=False)  # sizes are checked even so
        data.write_bytes(bytes(content))
        load_checkpoint(path, target, verify=False)  # in place, no digest
        (path / "checkpoint.json").write_text(json.dumps({**manifest, "format_version": 99}))
        with pytest.raises(CheckpointError, match="format version 99, which this checkpoint-io"):
            load_checkpoint(path, target)

    def test_rng_state_comes_back(self, tmp_path: Path) -> None:
        model, _ = trained()
        torch.manual_seed(123)
        path = save_checkpoint(tmp_path / "c", model)
        expected = torch.rand(3)
        torch.rand(100)
        load_checkpoint(path, Small())
        assert torch.equal(torch.rand(3), expected)


class TestLongRuns:
    def test_keep_last_and_latest(self, tmp_path: Path) -> None:
        model, optimizer = trained()
        for async_save in (False, True):
            root = tmp_path / f"async-{async_save}"
            manager = CheckpointManager(root, every=2, keep_last=2, async_save=async_save)
            saved = [manager.maybe_save(step, model, optimizer) for step in range(1, 10)]
            manager.wait()
            assert [p.name if p else None for p in saved] == [
                None,
                "step-2",
                None,
                "step-4",
                None,
                "step-6",
                None,
                "step-8",
                None,
            ]
            assert manager.maybe_save(9, model, force=True) == root / "step-9"
            manager.wait()
            assert sorted(p.name for p in root.iterdir()) == ["step-8", "step-9"]
            assert manager.latest() == latest_checkpoint(root) == root / "step-9"

    def test_keep_last_after_a_roll_back_keeps_the_run_you_are_on(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Issue 51 (1): a save below the newest step removed itself and every older one."""
        model, optimizer = trained()
        for async_save in (False, True):
            root = tmp_path / f"async-{async_save}"
            first = CheckpointManager(root, every=100)
            for step in (500, 900, 1000):
                first.maybe_save(step, model, optimizer)
            # the loss spiked: roll back to step-500 and train on from there, keeping 2
            load_checkpoint(root / "step-500", model, optimizer)
            manager = CheckpointManager(root, every=100, keep_last=2, async_save=async_save)
            with caplog.at_level("WARNING", logger="checkpoint_io"):
                manager.maybe_save(600, model, optimizer)
                manager.wait()
            assert (root / "step-600").is_dir()  # the one just published survives
            assert "step-900, step-1000" in caplog.text and "roll-back" in caplog.text
            for step in (700, 800):
                manager.maybe_save(step, model, optimizer)
                manager.wait()
            names = sorted(p.name for p in root.iterdir())
            assert names == ["step-1000", "step-700", "step-800", "step-900"]

    def test_only_canonical_step_names_count(self, tmp_path: Path) -> None:
        """A hostile step-99999999 leaves the run alone; step-007 and Unicode digits are no steps."""
        import shutil

        model, optimizer = trained()
        manager = CheckpointManager(tmp_path, every=1, keep_last=1)
        manager.maybe_save(5, model, optimizer)
        for name in ("step-99999999", "step-007", "step-\u0669\u0669"):
            shutil.copytree(tmp_path / "step-5", tmp_path / name)
        manager.maybe_save(6, model, optimizer)
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == ["step-007", "step-6", "step-99999999", "step-\u0669\u0669"]
        shutil.rmtree(tmp_path / "step-99999999")
        assert latest_checkpoint(tmp_path) == tmp_path / "step-6"

    def test_latest_skips_partial_and_damaged(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        model, optimizer = trained()
        manager = CheckpointManager(tmp_path, every=1)
        for step in (1, 2, 3):
            manager.maybe_save(step, model, optimizer)
        assert manager.latest() == tmp_path / "step-3"
        data = tmp_path / "step-3" / "rank0.safetensors"
        data.write_bytes(data.read_bytes()[:100])  # truncated, as by a kill mid-copy
        (tmp_path / "step-2" / "checkpoint.json").unlink()  # never published
        (tmp_path / ".step-4.partial-0123abcd").mkdir()  # a save that never finished
        (tmp_path / "step-5").mkdir()  # an empty directory
        with caplog.at_level("WARNING", logger="checkpoint_io"):
            assert latest_checkpoint(tmp_path) == tmp_path / "step-1"
        assert "skipping" in caplog.text and "step-3" in caplog.text
        fresh = Small()
        assert CheckpointManager(tmp_path, every=1).resume(fresh) == 1
        assert torch.equal(fresh.body.weight, model.body.weight)
        assert not (tmp_path / ".step-4.partial-0123abcd").exists()  # resume removed it
        assert CheckpointManager(tmp_path / "none", every=1).resume(Small()) == 0

    def test_async_save_in_one_process(self, tmp_path: Path) -> None:
        model, optimizer = trained()
        staged = {k: v.clone() for k, v in model.state_dict().items()}
        pending = async_save_checkpoint(tmp_path / "a", model, optimizer, step=1)
        with torch.no_grad():
            model.body.weight.add_(1.0)  # the step after the call
        assert pending.wait() == tmp_path / "a" and pending.done()
        again = async_save_checkpoint(tmp_path / "b", model, step=2)
        save_checkpoint(tmp_path / "c", model, step=3)  # waits for the one in flight
        assert again.done() and (tmp_path / "b" / "checkpoint.json").is_file()
        loaded = Small()
        load_checkpoint(tmp_path / "a", loaded)
        assert all(torch.equal(staged[k], v) for k, v in loaded.state_dict().items())
        # "b" was staged into the buffers "a" used (kept between saves): it holds its own step
        load_checkpoint(tmp_path / "b", loaded)
        assert torch.equal(loaded.body.weight, model.body.weight)
        assert not torch.equal(loaded.body.weight, staged["body.weight"])

    @pytest.mark.parametrize(
        ("kwargs", "error", "match"),
        [
            ({"every": 0}, ValueError, "every must be >= 1, got 0"),
            ({"every": 2.5}, TypeError, "every must be an int, got float"),
            ({"every": 1, "keep_last": 0}, ValueError, "keep_last must be >= 1, got 0"),
            ({"every": 1, "async_save": "yes"}, TypeError, "async_save must be a bool"),
        ],
    )
    def test_bad_manager_arguments(
        self, tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], match: str
    ) -> None:
        with pytest.raises(error, match=match):
            CheckpointManager(tmp_path, **kwargs)

    def test_root_that_is_a_file(self, tmp_path: Path) -> None:
        file = tmp_path / "f"
        file.write_text("")
        with pytest.raises(NotADirectoryError, match="root=.* is a file; pass a directory"):
            CheckpointManager(file, every=1)
        with pytest.raises(NotADirectoryError, match="is a file"):
            latest_checkpoint(file)
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            CheckpointManager(tmp_path, every=1).maybe_save(-1, Small())

    def test_sigterm_in_one_process(self, tmp_path: Path) -> None:
        model, optimizer = trained()
        before = signal.getsignal(signal.SIGTERM)
        manager = CheckpointManager(tmp_path, every=100, on_sigterm=True)
        assert manager.maybe_save(1, model, optimizer) is None
        signal.raise_signal(signal.SIGTERM)  # caught: training goes on to the next save point
        with pytest.raises(SystemExit) as stop:
            manager.maybe_save(2, model, optimizer)
        assert stop.value.code == 0 and manager.latest() == tmp_path / "step-2"
        assert signal.getsignal(signal.SIGTERM) is before

    def test_usr1_saves_then_requeues_after_the_publish(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """sbatch --signal=USR1@120 --requeue: the save at the next step, then the requeue
        (rank 0, after the publish), then exit 0; the handler restored."""
        model, optimizer = trained()
        before = signal.getsignal(signal.SIGUSR1)
        seen: list[bool] = []
        manager = CheckpointManager(
            tmp_path,
            every=100,
            signals=("USR1",),
            requeue=lambda: seen.append((tmp_path / "step-3" / "checkpoint.json").is_file()),
        )
        assert manager.maybe_save(2, model, optimizer) is None and not seen
        signal.raise_signal(signal.SIGUSR1)
        with pytest.raises(SystemExit) as stop:
            manager.maybe_save(3, model, optimizer)
        assert stop.value.code == 0 and seen == [True]  # requeued once, after the publish
        assert signal.getsignal(signal.SIGUSR1) is before
        monkeypatch.delenv("SLURM_JOB_ID", raising=False)
        with pytest.raises(ValueError, match="SLURM_JOB_ID is not set"):
            CheckpointManager(tmp_path, every=1, signals=[signal.SIGUSR1], requeue=True)
        with pytest.raises(ValueError, match="SIGKILL cannot be caught"):
            CheckpointManager(tmp_path, every=1, signals=[signal.SIGKILL])
        with pytest.raises(ValueError, match="requeue needs a signal"):
            CheckpointManager(tmp_path, every=1, requeue=lambda: None)
        with pytest.raises(ValueError, match="'USR9' is not a signal"):
            CheckpointManager(tmp_path, every=1, signals=["USR9"])
        monkeypatch.setenv("SLURM_JOB_ID", "424242")
        monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol here: the failure is named
        manager = CheckpointManager(tmp_path / "r", every=100, signals=["USR1"], requeue=True)
        signal.raise_signal(signal.SIGUSR1)
        with pytest.raises(RuntimeError, match="scontrol is not on PATH to requeue job 424242"):
            manager.maybe_save(4, model, optimizer)
        assert (tmp_path / "r" / "step-4" / "checkpoint.json").is_file()  # saved before

    def test_closing_managers_in_any_order_keeps_usr1_handled(self, tmp_path: Path) -> None:
        """Two managers, ``a.close()`` first: ``b`` still gets USR1 (``a`` put the default
        handler back over ``b``'s and the process died); after ``b.close()`` the original
        handler is back."""
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "import os, signal\n"
                "from checkpoint_io import CheckpointManager\n"
                "signal.signal(signal.SIGUSR1, signal.SIG_IGN)\n"
                f"a = CheckpointManager({str(tmp_path / 'a')!r}, every=1, signals=['USR1'])\n"
                f"b = CheckpointManager({str(tmp_path / 'b')!r}, every=1, signals=['USR1'])\n"
                "a.close()\n"
                "os.kill(os.getpid(), signal.SIGUSR1)\n"
                "print('b got', b._stop.received.name)\n"
                "b.close()\n"
                "print('restored', signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN)\n",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["b", "got", "SIGUSR1", "restored", "True"]

    def test_requeue_refuses_a_job_id_that_is_not_a_number(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``SLURM_JOB_ID=--help`` ran ``scontrol requeue --help``: refused when the manager
        is made."""
        for job in ("--help", "\u00b2", "1 2"):
            monkeypatch.setenv("SLURM_JOB_ID", job)
            with pytest.raises(ValueError, match="SLURM_JOB_ID must be an integer"):
                CheckpointManager(tmp_path, every=1, signals=["USR1"], requeue=True)

    def test_a_dropped_manager_does_not_swallow_sigterm(self, tmp_path: Path) -> None:
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "import gc, os, signal\n"
                "from checkpoint_io import CheckpointManager\n"
                f"m = CheckpointManager({str(tmp_path)!r}, every=1, on_sigterm=True)\n"
                "del m; gc.collect()\n"
                "os.kill(os.getpid(), signal.SIGTERM)\n"
                "print('still running')\n",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == -signal.SIGTERM and "still running" not in out.stdout

    def test_an_older_format_is_refused_naming_the_import(self, tmp_path: Path) -> None:
        """Formats 1-3 hold pickles: the default path never reads them; the error names the
        import door (which runs their code) instead."""
        model, _ = trained()
        path = save_checkpoint(tmp_path / "c", model)
        manifest = json.loads((path / "checkpoint.json").read_text())
        for version in (1, 2, 3):
            (path / "checkpoint.json").write_text(
                json.dumps({**manifest, "format_version": version})
            )
            with pytest.raises(
                CheckpointError,
                match=f"format version {version}, whose files are pickles.*--trust-pickle",
            ):
                load_checkpoint(path, Small())
        assert latest_checkpoint(tmp_path) is None


def testcheckpoint_cli(tmp_path: Path) -> None:
    model, optimizer = trained()
    path = save_checkpoint(tmp_path / "c", model, optimizer, step=5)
    shown = checkpoint_cli("inspect", str(path))
    assert shown.returncode == 0, shown.stderr
    assert '"step": 5' in shown.stdout and "model.body.weight" in shown.stdout
    assert "4x4" in shown.stdout and "torch.float32" in shown.stdout
    bad = checkpoint_cli("inspect", str(tmp_path / "missing"))
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "no checkpoint at" in bad.stderr
    done = checkpoint_cli("consolidate", str(path), str(tmp_path / "hf"), "--max-shard-size", "64")
    assert done.returncode == 0, done.stderr
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(model.state_dict())
    (tmp_path / "not-a-ckpt").mkdir()
    refused = checkpoint_cli("consolidate", str(tmp_path / "not-a-ckpt"), str(tmp_path / "x"))
    assert refused.returncode == 2 and "is not a checkpoint" in refused.stderr


def _format_3(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    """A checkpoint laid out as format 3 wrote it (DCP's pickles, torch.save side files)."""
    import io

    import torch.distributed.checkpoint as dcp

    from rng_fork import capture_rng_state

    names = {id(p): n for n, p in model.named_parameters()}
    saved = optimizer.state_dict()
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    groups = [{**g, "params": [order[i] for i in g["params"]]} for g in saved["param_groups"]]
    buffer = io.BytesIO()
    torch.save(groups, buffer)
    buffer.seek(0)
    state = {
        "model": model.state_dict(),
        "optim": {
            "state": {order[i]: v for i, v in saved["state"].items()},
            "param_groups": buffer,
        },
    }
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, checkpoint_id=root)
    (root / "rng").mkdir()
    torch.save(capture_rng_state(), root / "rng" / "rank0.pt")
    (root / "stateful").mkdir()
    torch.save({"epoch": {"seen": 7, "t": torch.arange(3)}}, root / "stateful" / "rank0.pt")
    manifest = {
        "format": "checkpoint_io", "format_version": 3, "step": 4, "world_size": 1,
        "strategy": "none", "torch_version": torch.__version__, "model_class": "m.Small",
        "parameters": 25, "optimizer": True, "stateful": ["epoch"], "rng": True, "tied": [],
        "stateful_state": {"epoch": {"class": f"{__name__}._Holder", "sharded": [],
                                     "digests": ["0" * 32]}},
        "model_keys": list(model.state_dict()), "extra": {"lr": 0.1},
    }  # fmt: skip
    (root / "checkpoint.json").write_text(json.dumps(manifest))
    return root


class _Holder:
    def __init__(self) -> None:
        self.state: Any = None

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def test_the_import_door_runs_only_when_trusted(tmp_path: Path) -> None:
    """Formats 1-3 and raw dcp.save hold pickles: load_checkpoint refuses them naming the
    import; import_checkpoint refuses without trust_pickle=True; with it (or the CLI's
    --trust-pickle) the checkpoint is written again as format 4 and loads as it was saved:
    model, optimizer, step, stateful state and RNG."""
    import torch.distributed.checkpoint as dcp

    from checkpoint_io import import_checkpoint

    model, optimizer = trained()
    old = _format_3(tmp_path / "old", model, optimizer)
    with pytest.raises(CheckpointError, match="whose files are pickles.*--trust-pickle"):
        load_checkpoint(old, Small())
    with pytest.raises(ValueError, match="runs any code it holds; pass trust_pickle=True"):
        import_checkpoint(old, tmp_path / "new")
    refused = checkpoint_cli("import", str(old), str(tmp_path / "new"))
    assert refused.returncode == 2 and "trust_pickle" in refused.stderr
    assert not (tmp_path / "new").exists()
    done = checkpoint_cli("import", str(old), str(tmp_path / "new"), "--trust-pickle")
    assert done.returncode == 0, done.stderr
    fresh, holder = Small(), _Holder()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    info = load_checkpoint(tmp_path / "new", fresh, fresh_opt, stateful={"epoch": holder})
    assert info.step == 4 and info.extra == {"lr": 0.1}
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
    )
    assert fresh_opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert holder.state["seen"] == 7 and torch.equal(holder.state["t"], torch.arange(3))
    raw = tmp_path / "raw"
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": model.state_dict()}, checkpoint_id=raw)
    with pytest.raises(CheckpointError, match="a raw dcp.save checkpoint.*--trust-pickle"):
        load_checkpoint(raw, Small())
    imported = import_checkpoint(raw, tmp_path / "raw4", trust_pickle=True)
    load_checkpoint(imported, fresh)


@pytest.mark.multiprocess
def test_each_rank_hashes_its_own_files_and_a_damaged_shard_is_caught(two_ranks: Any) -> None:
    """Each rank hashes the bytes it reads; one flipped bit fails the load on every rank, and
    the model is unchanged (the load read into staging)."""
    results, _ = two_ranks
    for rank in results:
        assert rank["files"] == ["index.json", "rank0.safetensors", "rank1.safetensors"] + [
            f"rng/rank{r}.safetensors" for r in range(2)
        ]
        assert "verification failed" in rank["damaged"], rank["damaged"]
        assert rank["damaged_unchanged"]
    # rank 1 read the damaged record of rank1.safetensors and found it changed (its own digest);
    # rank 0 found it too, or learned it from rank 1
    assert re.search(r"rank1\.safetensors \(bytes \d+\.\.\d+\) has checksum", results[1]["damaged"])
    assert (
        "rank1.safetensors (bytes" in results[0]["damaged"]
        or "rank(s) [1]" in results[0]["damaged"]
    )


@pytest.mark.multiprocess
def test_async_save_stages_then_writes(two_ranks: Any) -> None:
    results, _ = two_ranks
    for rank in results:
        assert rank["async_path"] == "async"
        assert rank["async_is_staged_state"] is True  # the step after the call is not in it
        assert rank["async_moved_on"] is True
        assert rank["async_old_kept"] is True  # the failed save published nothing
        assert rank["async_leftovers"] == []  # nor left a temporary directory
    assert "disk full (simulated on rank 1)" in results[1]["async_failure"]
    for rank in results:
        assert "failed on rank(s) [1]; rank 1: OSError: disk full" in rank["async_failure"]
        assert "Traceback" not in rank["async_failure"]


@pytest.mark.multiprocess
def test_a_ddp_background_save_stages_each_rank_s_share(two_ranks: Any) -> None:
    """Each of 2 DDP ranks staged a share of the replicated state (together: all of it,
    once) and the checkpoint reads back exactly; a rank with another buffer is refused on
    every rank, naming it, before anything is written."""
    results, _ = two_ranks
    if len(results) != 2:
        pytest.skip("a 2-rank case")
    whole = results[0]["replicated_whole"]
    staged = [rank["replicated_staged"] for rank in results]
    assert sum(staged) == whole and max(staged) < 0.75 * whole, (staged, whole)
    for rank in results:
        assert rank["replicated_exact"] is True
        assert "rank(s) [1] hold other plain (replicated) tensors" in rank["replicated_differ"]
        assert rank["replicated_left"] == ["a"]


@pytest.mark.multiprocess
def test_sigterm_on_one_rank_saves_on_every_rank_and_exits_0(two_ranks: Any) -> None:
    results, _ = two_ranks
    for rank in results:
        assert rank["sigterm"] == (0, 5, "step-5")  # rank 1 got it after step 5; not a multiple
        assert rank["handler_restored"] is True


def test_staged_dtensor_stays_on_the_host_on_a_cuda_mesh() -> None:
    """What a background save hands DCP is on the host, whatever the mesh's device type.

    A DTensor over a CUDA mesh (built without a backend, so this runs on a CPU-only build):
    ``DTensor.from_local`` would move the staged shard to the mesh's device, i.e. a second
    device copy of the state on a GPU (here: "Torch not compiled with CUDA enabled").
    """
    code = """
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.testing._internal.distributed.fake_pg import FakeStore
from checkpoint_io._background.staging import pinned, require_host_only, stage

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
mesh = DeviceMesh("cuda", [0, 1], _init_backend=False)
spec = DTensorSpec(mesh, (Shard(0),), TensorMeta(torch.Size([4, 3]), (3, 1), torch.float32))
shard = DTensor(torch.arange(6.0).view(2, 3), spec, requires_grad=False)
staged = stage({"model": {"w": shard}, "optimizer": {"state": {"w": {"exp_avg": [shard]}}}})
for value in (staged["model"]["w"], staged["optimizer"]["state"]["w"]["exp_avg"][0]):
    assert isinstance(value, DTensor) and value.device_mesh.device_type == "cuda"
    assert value._local_tensor.device.type == "cpu"
    assert value._local_tensor.data_ptr() != shard._local_tensor.data_ptr()
    assert torch.equal(value._local_tensor, shard._local_tensor)
    assert value.placements == (Shard(0),) and value.shape == (4, 3)
host = {"w": torch.arange(4.0)}
first = stage(host)["w"]
assert not pinned(host["w"]) and not first.is_pinned()  # host sources: pageable buffers
assert stage(host)["w"].data_ptr() == first.data_ptr()  # the buffer is kept between saves
assert pinned(torch.empty(1, device="meta")) is False  # only CUDA sources are pinned
try:
    require_host_only({"a": [torch.empty(1, device="meta")]})
except RuntimeError as error:
    assert "state['a'][0] on meta" in str(error), error
else:
    raise AssertionError("a device tensor passed the host-only check")
print("ok")
"""
    from dist_harness import fresh_interpreter

    assert fresh_interpreter(code).strip().endswith("ok")


def test_staging_pins_exact_sizes_once_and_unpins_what_it_drops(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The pinning rule a CUDA run relies on, executed here: each staging buffer of a device
    tensor is registered at its storage's exact size (pin_memory=True went through CUDA's
    caching host allocator, which rounds every block up to a power of two and keeps it), once
    for as long as it is reused, and unregistered when a changed shape drops it."""
    import gc

    from checkpoint_io._background import staging

    registered: dict[int, int] = {}
    monkeypatch.setattr(staging, "pinned", lambda source: True)  # as if on a GPU
    monkeypatch.setattr(staging, "_REGISTER", registered.__setitem__)
    monkeypatch.setattr(staging, "_UNREGISTER", registered.pop)
    monkeypatch.setattr(staging, "_BUFFERS", {})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.Tensor, "pin_memory", None)  # never through the caching allocator
    state = {"a": torch.zeros(1000, 3), "b": torch.zeros(5, dtype=torch.bfloat16)}
    staging.stage(state)
    assert sorted(registered.values()) == [10, 12_000]  # 1000 x 3 x 4 bytes, not 16384
    staging.stage(state)
    assert len(registered) == 2  # kept buffers: nothing pinned again
    staging.stage({**state, "a": torch.zeros(7)})
    gc.collect()
    assert sorted(registered.values()) == [10, 28]  # the dropped buffer was unpinned
    staging._BUFFERS.clear()
    gc.collect()
    assert registered == {}

    def refused(address: int, size: int) -> None:  # a low ulimit -l: the driver refuses
        raise RuntimeError("could not pin (simulated)")

    monkeypatch.setattr(staging, "_REGISTER", refused)
    with caplog.at_level("WARNING", logger="checkpoint_io"):
        staged = staging.stage({"a": torch.arange(4.0)})
    assert torch.equal(staged["a"], torch.arange(4.0))  # pageable, and the save holds
    assert "staging in pageable memory instead" in caplog.text


def test_a_background_save_whose_directory_cannot_be_made_raises(tmp_path: Path) -> None:
    """The directory is made before the save's agreement: a failure there raises from the call
    itself (before anything is staged for the background), and nothing is left behind."""
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with pytest.raises(NotADirectoryError):
        async_save_checkpoint(blocked / "ckpt", nn.Linear(2, 2), rng=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
    assert save_checkpoint(tmp_path / "next", nn.Linear(2, 2), rng=False).is_dir()


def test_a_save_plans_on_the_device_its_group_is_bound_to(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """DCP's planning (the save's one agreement) gathers objects, which NCCL stages on the
    current device: the save enters the default group's bound device around DCP, so a rank
    whose current device is wrong still learns of a failure instead of hanging in it."""
    from checkpoint_io import _save as save
    from checkpoint_io._storage.writer import SafeWriter
    from fake_accelerator import FakeAccelerator, patch_device_module

    fake = FakeAccelerator(4)
    patch_device_module(monkeypatch, lambda kind: fake)
    monkeypatch.setattr(save, "bound_device", lambda: torch.device("cuda", 3))
    seen: list[int] = []
    plan = SafeWriter.prepare_local_plan

    def recording(self: SafeWriter, local: Any) -> Any:
        seen.append(fake.current)
        return plan(self, local)

    monkeypatch.setattr(SafeWriter, "prepare_local_plan", recording)
    save_checkpoint(tmp_path / "c", nn.Linear(2, 2), rng=False)
    assert seen == [3] and fake.current == 0


def test_the_writer_writes_on_this_ranks_device(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """DCP's writer thread starts on device 0; the writer enters the rank's device around it.

    A real DCP save from another thread (as a background save runs), with a fake accelerator
    whose current device the planner reads while DCP resolves the data it writes.
    """
    import threading
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from checkpoint_io._storage.writer import SafeWriter
    from fake_accelerator import FakeAccelerator, patch_device_module

    fake = FakeAccelerator(4)
    patch_device_module(monkeypatch, lambda kind: fake)
    seen: list[int] = []

    class Recording(DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            seen.append(fake.current)
            return super().resolve_data(write_item)

    def save(device: torch.device | None, folder: Path) -> None:
        writer = SafeWriter(folder, lambda root: {}, lambda tables: None, device=device)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"w": torch.ones(3)}, storage_writer=writer, planner=Recording(), no_dist=True)

    for device, expected in ((torch.device("cuda", 3), 3), (None, 0)):
        seen.clear()
        thread = threading.Thread(target=save, args=(device, tmp_path / str(expected)))
        thread.start()
        thread.join()
        assert seen and set(seen) == {expected}, (device, seen)
    assert fake.current == 0
