"""Checkpoints you can trust: reading runs none of their code and nothing outside them; a
well-kept digest; durable before anything older goes; stateful values load as saved."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from torch import nn

from checkpoint_io import (
    CheckpointError,
    CheckpointManager,
    consolidate_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from checkpoint_models import Small, checkpoint_cli, trained, wsum64


class Payload:
    """What a hostile checkpoint holds: unpickling it runs a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


class Holder:
    """A stateful object whose state is whatever it was given."""

    def __init__(self, state: Any = None) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def _rehash(path: Path, name: str) -> None:
    """Record ``name``'s current size and digest in the manifest (as an attacker would)."""
    manifest = json.loads((path / "checkpoint.json").read_text())
    data = (path / name).read_bytes()
    entry = manifest["files"].setdefault(name, {"rank": 0})
    entry.update({"bytes": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()})
    entry["records"] = [  # each record's digest too
        [o, n, xxhash.xxh3_128(data[o : o + n]).hexdigest()] for o, n, _ in entry.get("records", [])
    ]
    (path / "checkpoint.json").write_text(json.dumps(manifest))


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(model: nn.Module, snapshot: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, snapshot[k]) for k, v in model.state_dict().items())


def test_a_crafted_metadata_runs_nothing_anywhere(tmp_path: Path) -> None:
    model, optimizer = trained()
    path = save_checkpoint(tmp_path / "run" / "step-1", model, optimizer, step=1)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _rehash(path, ".metadata")
    fresh = Small()
    before = _snapshot(fresh)
    for verify in (True, False):
        with pytest.raises(
            CheckpointError, match="was refused as unsafe: it would load posix.system"
        ):
            load_checkpoint(path, fresh, verify=verify)
    with pytest.raises(CheckpointError, match="refused as unsafe"):
        consolidate_checkpoint(path, tmp_path / "one.pt")
    assert latest_checkpoint(tmp_path / "run") is None  # skipped as damaged, not read
    assert CheckpointManager(tmp_path / "run", every=1).resume(fresh) == 0
    done = checkpoint_cli("inspect", str(path))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "refused as unsafe" in done.stderr, done.stderr
    assert not marker.exists()  # the payload never ran
    assert _same(fresh, before) and not (tmp_path / "one.pt").exists()


def test_a_crafted_value_runs_nothing(tmp_path: Path) -> None:
    """A stateful file and a DCP value replaced by payloads: refused, nothing changed."""
    model, optimizer = trained()
    path = save_checkpoint(tmp_path / "c", model, optimizer, stateful={"sched": Holder({"a": 1})})
    marker = tmp_path / "pwned"
    torch.save({"sched": Payload(marker)}, path / "stateful" / "rank0.pt")
    _rehash(path, "stateful/rank0.pt")
    fresh, holder = Small(), Holder("untouched")
    before = _snapshot(fresh)
    for verify in (True, False):
        with pytest.raises(CheckpointError) as refused:
            load_checkpoint(path, fresh, stateful={"sched": holder}, verify=verify)
        assert "the stateful state of rank 0" in str(refused.value)
        assert "was refused as unsafe" in str(refused.value)
    # A non-tensor value inside DCP's own files (written by someone else's dcp.save).
    import torch.distributed.checkpoint as dcp

    other = tmp_path / "other"
    save_checkpoint(other, model, optimizer)
    state = {"model": model.state_dict(), "evil": Payload(marker)}
    with pytest.warns(UserWarning):
        dcp.save(state, checkpoint_id=str(other))
    for name in [".metadata", *(p.name for p in other.glob("*.distcp"))]:
        _rehash(other, name)
    assert _same(fresh, before) and holder.state == "untouched"
    # A load decodes only the records it needs: 'evil' is never read, the model loads.
    load_checkpoint(other, Small())
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="the checkpoint's value 'evil'.*refused as unsafe"):
        consolidate_checkpoint(other, tmp_path / "one.pt")  # reads every entry: refused
    assert not marker.exists()


def test_a_stateful_value_that_cannot_be_read_back_safely_is_refused_at_save(
    tmp_path: Path,
) -> None:
    model, _ = trained()
    with pytest.raises(TypeError, match=r"stateful\['odd'\] \(Holder\) holds a value that a"):
        save_checkpoint(tmp_path / "c", model, stateful={"odd": Holder({"x": Holder()})})
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("name", ["../outside.bin", "/etc/hostname"])
def test_names_outside_the_checkpoint_are_refused(tmp_path: Path, name: str) -> None:
    model, _ = trained()
    path = save_checkpoint(tmp_path / "c", model)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x" * 64)
    manifest = json.loads((path / "checkpoint.json").read_text())
    data = Path(name).read_bytes() if name.startswith("/") else outside.read_bytes()
    manifest["files"][name] = {"bytes": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
    (path / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"names the file '{name}', which is outside"):
        load_checkpoint(path, Small())


def test_a_symlink_out_of_the_checkpoint_is_refused(tmp_path: Path) -> None:
    model, _ = trained()
    path = save_checkpoint(tmp_path / "c", model)
    target = tmp_path / "elsewhere.pt"
    (path / "rng" / "rank0.pt").rename(target)
    (path / "rng" / "rank0.pt").symlink_to(target)
    with pytest.raises(CheckpointError, match="'rng/rank0.pt', which leads outside"):
        load_checkpoint(path, Small())


def _flip(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 1]) + data[offset + 1 :]


def _swap_words(data: bytes, offset: int) -> bytes:
    a, b = data[offset : offset + 8], data[offset + 8 : offset + 16]
    assert a != b
    return data[:offset] + b + a + data[offset + 16 :]


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: _flip(d, len(d) // 2),
        lambda d: _swap_words(d, 64),  # two 8-byte words of one block: a plain sum misses it
        lambda d: d[:-8],
    ],
    ids=["flipped-bit", "swapped-words", "truncated-tail"],
)
def test_the_digest_detects_damage(tmp_path: Path, damage: Any) -> None:
    from checkpoint_io._format.digest import file_entry

    model, _ = trained()
    path = save_checkpoint(tmp_path / "c", model)
    data_file = next(path.glob("*.distcp"))
    data = data_file.read_bytes()
    recorded = file_entry(data_file)
    data_file.write_bytes(damage(data))
    if len(damage(data)) == len(data):  # the size alone cannot tell
        assert file_entry(data_file)["xxh3_128"] != recorded["xxh3_128"]
    with pytest.raises(CheckpointError, match="verification failed|truncated or corrupt"):
        load_checkpoint(path, Small())


def test_format_2_still_loads_and_verifies(tmp_path: Path) -> None:
    model, _ = trained()
    path = save_checkpoint(tmp_path / "c", model, step=4)
    manifest = json.loads((path / "checkpoint.json").read_text())
    manifest["format_version"] = 2
    manifest.pop("stateful_state")
    for name, entry in manifest["files"].items():
        entry.pop("xxh3_128")
        entry["wsum64"] = wsum64((path / name).read_bytes())
    (path / "checkpoint.json").write_text(json.dumps(manifest))
    fresh = Small()
    assert load_checkpoint(path, fresh).step == 4
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True)
    )
    data_file = next(path.glob("*.distcp"))
    data_file.write_bytes(_flip(data_file.read_bytes(), 100))
    with pytest.raises(CheckpointError, match="verification failed"):
        load_checkpoint(path, Small())


def test_everything_is_fsynced_before_the_old_checkpoint_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from checkpoint_io._write import publish as _publish

    events: list[str] = []
    fsync, rmtree = os.fsync, shutil.rmtree

    def spy_fsync(fd: int) -> None:
        events.append("fsync " + os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), tmp_path))
        fsync(fd)

    def spy_rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        events.append("rmtree " + os.path.relpath(str(path), tmp_path).split("-")[0])
        rmtree(path, *args, **kwargs)

    model, _ = trained()
    save_checkpoint(tmp_path / "c", model, stateful={"h": Holder({"a": 1})})
    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(_publish.shutil, "rmtree", spy_rmtree)
    save_checkpoint(tmp_path / "c", model, stateful={"h": Holder({"a": 2})}, overwrite=True)
    synced = [e.split(" ", 1)[1] for e in events if e.startswith("fsync")]
    partial = next(s for s in synced if s.startswith(".c.partial")).split("/")[0]
    for name in (  # DCP syncs .metadata under its temporary name, then renames it
        "__0_0.distcp",
        ".metadata.tmp",
        "rng/rank0.pt",
        "stateful/rank0.pt",
        "checkpoint.json",
    ):
        assert f"{partial}/{name}" in synced, (name, synced)
    for folder in (partial, f"{partial}/rng", f"{partial}/stateful", "."):
        assert folder in synced, (folder, synced)
    removal = events.index("rmtree .c.old")
    assert events.index("fsync .") < removal  # the rename is durable before the old one goes
    assert load_checkpoint(tmp_path / "c", Small(), stateful={"h": Holder()}).step is None


@pytest.mark.parametrize(
    ("saved", "fresh"),
    [
        ({"a": 1, "b": [1, 2]}, None),  # None now, a dict then
        ({"last_epoch": 3, "lr": [0.1]}, {}),  # a fresh {} got nothing back
        ([1, 2, 3], [9]),  # a shorter list
        (None, {"x": 1}),
        ({"t": torch.arange(3), "n": None}, {"t": torch.zeros(5)}),
    ],
    ids=["none-fresh", "empty-fresh", "shorter-list", "none-saved", "tensor-shape"],
)
def test_stateful_values_load_as_saved(tmp_path: Path, saved: Any, fresh: Any) -> None:
    model, _ = trained()
    path = save_checkpoint(tmp_path / "c", model, stateful={"s": Holder(saved)})
    holder = Holder(fresh)
    load_checkpoint(path, Small(), stateful={"s": holder})
    if isinstance(saved, dict) and "t" in saved:
        assert torch.equal(holder.state["t"], saved["t"]) and holder.state["n"] is None
    else:
        assert holder.state == saved


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_a_scheduler_and_a_fresh_stateful_dataloader_load_as_saved(tmp_path: Path) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    model, optimizer = trained()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    generator = torch.Generator().manual_seed(5)
    loader = StatefulDataLoader(list(range(20)), batch_size=3, shuffle=True, generator=generator)
    batches = iter(loader)
    seen = [next(batches).tolist() for _ in range(2)]
    path = save_checkpoint(
        tmp_path / "c", model, optimizer, stateful={"sched": scheduler, "loader": loader}
    )
    rest = [b.tolist() for b in batches]  # what the uninterrupted run reads next
    new_model = Small()
    new_opt = torch.optim.AdamW(new_model.parameters(), lr=0.1)
    new_sched = torch.optim.lr_scheduler.StepLR(new_opt, step_size=2)
    fresh = StatefulDataLoader(
        list(range(20)), batch_size=3, shuffle=True
    )  # before its first batch
    load_checkpoint(path, new_model, new_opt, stateful={"sched": new_sched, "loader": fresh})
    assert new_sched.state_dict() == scheduler.state_dict()
    assert [b.tolist() for b in fresh] == rest and seen


def test_an_object_of_another_kind_is_a_mismatch_not_corruption(tmp_path: Path) -> None:
    model, optimizer = trained()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    path = save_checkpoint(tmp_path / "c", model, optimizer, stateful={"sched": scheduler})
    other = Small()
    before = _snapshot(other)
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(path, other, stateful={"sched": Holder()})
    message = str(refused.value)
    assert "stateful['sched'] was saved from a torch.optim.lr_scheduler.StepLR" in message
    assert "a different object, not a different state" in message
    assert "corrupt" not in message and "partly loaded" not in message
    assert _same(other, before)


def test_a_metadata_that_changes_a_class_or_points_out_is_refused(tmp_path: Path) -> None:
    """BUILD on an admitted class (it would change the class for the whole process) and a
    storage entry whose file name is not a string (a Windows path joined outside)."""
    import pathlib

    model, _ = trained()
    path = save_checkpoint(tmp_path / "c", model)
    real = (path / ".metadata").read_bytes()
    # GLOBAL pathlib.PosixPath, {"name": 1}, BUILD: setattr on the class itself.
    (path / ".metadata").write_bytes(b"cpathlib\nPosixPath\n}X\x04\x00\x00\x00nameK\x01sb.")
    _rehash(path, ".metadata")
    with pytest.raises(CheckpointError, match="a change to the class pathlib.PosixPath"):
        load_checkpoint(path, Small())
    assert "name" not in vars(pathlib.PosixPath)  # the class was not changed
    metadata = pickle.loads(real)
    index = next(iter(metadata.storage_data))
    info = metadata.storage_data[index]
    info.relative_path = pathlib.PureWindowsPath("..\\..\\other\\x.distcp")  # type: ignore[assignment]
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    _rehash(path, ".metadata")
    with pytest.raises(CheckpointError, match="is not a file name with a non-negative offset"):
        load_checkpoint(path, Small())


def test_an_overwrite_killed_between_its_renames_is_restored(tmp_path: Path) -> None:
    model, _ = trained()
    run = tmp_path / "run"
    save_checkpoint(run / "step-2", model, step=2)
    (run / "step-2").rename(
        run / ".step-2.old-0123456789ab"
    )  # the old one moved aside, then killed
    assert CheckpointManager(run, every=1).resume(Small()) == 2
    assert sorted(p.name for p in run.iterdir()) == ["step-2"]


def test_stateful_keys_are_kept_apart_and_ordered_dicts_stay(tmp_path: Path) -> None:
    import collections

    model, _ = trained()
    with pytest.raises(TypeError, match="may not use the key '__checkpoint_io_sharded__'"):
        save_checkpoint(
            tmp_path / "a", model, stateful={"s": Holder({"__checkpoint_io_sharded__": 1})}
        )
    ordered = collections.OrderedDict([("b", 1), ("a", torch.ones(2))])
    path = save_checkpoint(tmp_path / "b", model, stateful={"s": Holder({"inner": ordered})})
    holder = Holder()
    load_checkpoint(path, Small(), stateful={"s": holder})
    assert type(holder.state["inner"]) is collections.OrderedDict
    assert list(holder.state["inner"]) == ["b", "a"]


SUPPORT = str(Path(__file__).parents[1] / "_support")


class TestHostileDirectories:
    """Issue 51 (4, 7, 8): what a planted or damaged directory under the root may do."""

    def _root(self, tmp_path: Path, steps: tuple[int, ...] = (1, 2)) -> Path:
        model, optimizer = trained()
        manager = CheckpointManager(tmp_path / "root", every=1)
        for step in steps:
            manager.maybe_save(step, model, optimizer, stateful={"holder": Holder({"k": step})})
        return tmp_path / "root"

    def test_fifos_and_links_are_refused_without_hanging(self, tmp_path: Path) -> None:
        """A FIFO named .metadata hung latest_checkpoint and resume; a FIFO RNG or stateful
        file hung load_checkpoint; a linked checkpoint.json was read from outside. Run in a
        child with a deadline: a hang fails the test instead of stopping the suite."""
        import shutil

        from dist_harness import fresh_interpreter

        root = self._root(tmp_path)
        for step, name in ((3, ".metadata"), (4, "rng/rank0.pt"), (5, "stateful/rank0.pt")):
            planted = root / f"step-{step}"
            shutil.copytree(root / "step-2", planted)
            (planted / name).unlink()
            os.mkfifo(planted / name)
        outside = tmp_path / "outside.json"
        shutil.copy(root / "step-2" / "checkpoint.json", outside)
        shutil.copytree(root / "step-2", root / "step-6")
        (root / "step-6" / "checkpoint.json").unlink()
        (root / "step-6" / "checkpoint.json").symlink_to(outside)
        out = fresh_interpreter(
            f"""
            from pathlib import Path
            from checkpoint_io import CheckpointError, latest_checkpoint, load_checkpoint
            from checkpoint_models import Small
            root = Path({str(root)!r})
            print(latest_checkpoint(root).name)
            for step in (4, 5):
                try:
                    load_checkpoint(root / f"step-{{step}}", Small())
                except CheckpointError as error:
                    print(step, "refused:", error)
            """,
            timeout=90,
            env={"PYTHONPATH": os.pathsep.join([SUPPORT, os.environ.get("PYTHONPATH", "")])},
        )
        lines = out.splitlines()
        assert lines[0] == "step-2"  # steps 3 (FIFO index) and 6 (linked manifest) skipped
        # Refused in the child's lifetime (the size check or the regular-file check), by name.
        assert lines[1].startswith("4 refused:") and "rng/rank0.pt" in lines[1]
        assert lines[2].startswith("5 refused:") and "stateful/rank0.pt" in lines[2]

    def test_malformed_manifests_are_skipped_not_crashed_on(self, tmp_path: Path) -> None:
        """A manifest whose file table is a list, and one nested 100,000 deep, crashed
        latest_checkpoint with TypeError / RecursionError: now each is skipped, with why."""
        import shutil

        root = self._root(tmp_path)
        for step, deep in ((3, False), (4, True)):
            shutil.copytree(root / "step-2", root / f"step-{step}")
            manifest = root / f"step-{step}" / "checkpoint.json"
            data = json.loads(manifest.read_text())
            data["files"] = ["not", "a", "table"]
            manifest.write_text("[" * 100_000 + "]" * 100_000 if deep else json.dumps(data))
        assert latest_checkpoint(root) == root / "step-2"

    def test_resume_falls_back_past_a_damaged_checkpoint(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """One flipped bit in the newest checkpoint made resume raise; a step saved as "7"
        came back as the step. Now each is named in a warning and the next older one loads."""
        import shutil

        root = self._root(tmp_path)
        shutil.copytree(root / "step-2", root / "step-3")
        manifest = json.loads((root / "step-3" / "checkpoint.json").read_text())
        manifest["step"] = "7"
        (root / "step-3" / "checkpoint.json").write_text(json.dumps(manifest))
        data = next((root / "step-2").glob("*.distcp"))
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
        model, optimizer = trained()
        holder = Holder()
        manager = CheckpointManager(root, every=1)
        with caplog.at_level("WARNING", logger="checkpoint_io"):
            assert manager.resume(model, optimizer, stateful={"holder": holder}) == 1
        assert holder.state == {"k": 1}
        assert "cannot resume from" in caplog.text and "step-3" in caplog.text
        assert "gives the step as '7'" in caplog.text and "step-2" in caplog.text


class TestBoundedValues:
    """Issue 51 (3): a value that a few bytes would expand into gigabytes is refused."""

    def test_lists_in_the_optimizer_state_load_back_and_crafted_paths_are_refused(
        self, tmp_path: Path
    ) -> None:
        """LBFGS keeps lists of tensors in its state (DCP writes an entry per index): they
        load back as lists and it steps on (they came back as dicts keyed 0, 1, ...; before
        that, the load failed). A dict with a key that is not a string is refused at save (DCP
        gives it back keyed '0'). A crafted index that puts a value under another value is
        refused by name, with the model unchanged (it was a TypeError from the template)."""
        torch.manual_seed(0)
        inputs, targets = torch.randn(8, 4), torch.randn(8, 2)

        def lbfgs() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
            model = nn.Linear(4, 2)
            optimizer = torch.optim.LBFGS(model.parameters(), history_size=3, max_iter=3)

            def closure() -> torch.Tensor:
                optimizer.zero_grad()
                loss = ((model(inputs) - targets) ** 2).mean()
                loss.backward()
                return loss

            return model, optimizer, closure

        model, optimizer, closure = lbfgs()
        for _ in range(2):
            optimizer.step(closure)
        save_checkpoint(tmp_path / "l", model, optimizer)
        saved = optimizer.state_dict()["state"][0]
        fresh, reloaded, step = lbfgs()
        load_checkpoint(tmp_path / "l", fresh, reloaded)
        loaded = reloaded.state_dict()["state"][0]
        for key in ("old_dirs", "old_stps", "ro", "al"):
            assert type(loaded[key]) is list and len(loaded[key]) == len(saved[key]), key
            for got, want in zip(loaded[key], saved[key], strict=True):
                assert (got is None and want is None) or torch.equal(got, want), key
        reloaded.step(step)  # appends to the lists
        # a dict keyed by numbers would come back keyed by strings
        model, adamw = trained()
        next(iter(adamw.state.values()))["by_layer"] = {0: torch.ones(2)}
        with pytest.raises(TypeError, match="a dict with the key 0 \\(int\\)"):
            save_checkpoint(tmp_path / "k", model, adamw)
        assert not (tmp_path / "k").exists()
        # crafted indexes (digests recomputed): exp_avg_sq's path under exp_avg (a tensor),
        # at a negative index, and below a container whose other key is a string
        del next(iter(adamw.state.values()))["by_layer"]
        save_checkpoint(tmp_path / "c", model, adamw)
        before = _snapshot(model)
        for label, (exp_avg, exp_avg_sq), refusal in (
            ("under a value", (("exp_avg",), ("exp_avg", "x")), "both as a value and as a"),
            ("negative", (("exp_avg",), ("h", -1)), "an index outside its"),
            ("mixed", (("h", "k"), ("h", 0)), "is both a dict and a list"),
        ):
            shutil.copytree(tmp_path / "c", tmp_path / label)
            index = pickle.loads((tmp_path / label / ".metadata").read_bytes())
            for fqn, path in list(index.planner_data.items()):
                if fqn.startswith("optim.state.") and path[-1] == "exp_avg":
                    index.planner_data[fqn] = (*path[:-1], *exp_avg)
                elif fqn.startswith("optim.state.") and path[-1] == "exp_avg_sq":
                    index.planner_data[fqn] = (*path[:-1], *exp_avg_sq)
            (tmp_path / label / ".metadata").write_bytes(pickle.dumps(index))
            _rehash(tmp_path / label, ".metadata")
            with pytest.raises(CheckpointError, match=refusal):
                load_checkpoint(tmp_path / label, model, adamw)
            assert _same(model, before), label

    def test_an_optimizer_value_a_load_would_refuse_is_refused_at_save(
        self, tmp_path: Path
    ) -> None:
        """An object in a parameter group or in the optimizer's state was saved (DCP pickles
        it), and every load of the checkpoint refused it: now the save refuses it, with
        nothing written, and plain values save and load (a dict of them too)."""
        model, optimizer = trained()
        optimizer.param_groups[0]["schedule"] = Holder()  # not a weights_only type
        refusal = r"the optimizer's param_groups \(AdamW\) holds a .*GLOBAL .*Holder was not an"
        with pytest.raises(TypeError, match=refusal):
            save_checkpoint(tmp_path / "c", model, optimizer)
        assert not (tmp_path / "c").exists()
        del optimizer.param_groups[0]["schedule"]
        first = next(iter(optimizer.state.values()))
        first["note"] = Holder()
        with pytest.raises(TypeError, match=r"the optimizer's state \(AdamW\) holds a value"):
            save_checkpoint(tmp_path / "c", model, optimizer)
        assert not (tmp_path / "c").exists()
        # A dict inside the state (DCP flattens it, a key each) loads back as saved: it was
        # templated as one value, and DCP found its keys missing.
        first["note"] = {"kept": [1, 2.5], "t": torch.arange(3.0)}
        save_checkpoint(tmp_path / "c", model, optimizer)
        first["note"] = None
        load_checkpoint(tmp_path / "c", model, optimizer)
        note = next(iter(optimizer.state.values()))["note"]
        assert note["kept"] == [1, 2.5] and torch.equal(note["t"], torch.arange(3.0))

    def test_a_bytearray_is_refused_at_save_and_at_load(self, tmp_path: Path) -> None:
        import io
        import zipfile

        from checkpoint_io._format.values import load_value

        model, _ = trained()
        with pytest.raises(TypeError, match="holds a bytearray"):
            save_checkpoint(tmp_path / "c", model, stateful={"h": Holder(bytearray(b"x"))})
        assert not (tmp_path / "c").exists()
        # What a load refuses, a save refuses: a byte buffer of raw bytes was saved, and every
        # load of the checkpoint refused it (it is not torch.save's format).
        raw = Holder(io.BytesIO(b"raw bytes"))
        with pytest.raises(TypeError, match="holds a byte buffer that holds data that is not"):
            save_checkpoint(tmp_path / "c", model, stateful={"h": raw})
        assert not (tmp_path / "c").exists()
        framed = Holder(io.BytesIO(_saved({"lr": 0.1})))  # torch.save's bytes: read back
        save_checkpoint(tmp_path / "c", model, stateful={"h": framed})
        loaded = Holder(None)
        load_checkpoint(tmp_path / "c", model, stateful={"h": loaded})
        assert torch.load(loaded.state, weights_only=True) == {"lr": 0.1}
        # As a crafted file would hold it (torch's weights_only loader admits it).
        buffer = io.BytesIO()
        torch.save({"blob": bytearray(16)}, buffer)
        with pytest.raises(CheckpointError, match="it holds a bytearray, which can make a few"):
            load_value(buffer.getvalue(), "the crafted value")
        # A deflated record (about 1,000:1) is refused before it is inflated.
        plain = io.BytesIO()
        torch.save({"lr": 0.1}, plain)
        squeezed = io.BytesIO()
        with zipfile.ZipFile(plain) as source, zipfile.ZipFile(squeezed, "w") as target:
            for item in source.infolist():
                target.writestr(item.filename, source.read(item), zipfile.ZIP_DEFLATED)
        with pytest.raises(CheckpointError, match="a compressed record"):
            load_value(squeezed.getvalue(), "the deflated value")
        assert load_value(plain.getvalue(), "a plain value") == {"lr": 0.1}

    def test_a_value_is_scanned_as_torch_reads_it(self) -> None:
        """Three values crafted so that Python's zipfile, which the scan read, and torch's
        reader see different pickles: torch loads a bytearray from each (checked here), and
        the scan, which now reads the archive as torch does, refuses each (found by reviews).
        Two central directories (zipfile shifts offsets by the bytes before the second); the
        pickle named DATA.PKL (torch finds it ignoring case); two zip64 end records (torch
        follows the locator, zipfile takes the one before it)."""
        import io

        from checkpoint_io._format.values import load_value

        bomb, benign = _members(bytearray(16)), _members({"x": 1})
        crafted = {
            "two directories": _two_directories(bomb, benign),
            "DATA.PKL": _archive([(n.replace("data.pkl", "DATA.PKL"), d) for n, d in bomb]),
            "two zip64 end records": _two_zip64_ends(bomb, benign),
        }
        for label, data in crafted.items():
            assert isinstance(torch.load(io.BytesIO(data), weights_only=True), bytearray), label
            with pytest.raises(CheckpointError, match="refused as unsafe: it holds"):
                load_value(data, label)
        assert load_value(_archive(benign), "the benign value") == {"x": 1}

    def test_a_zip64_archive_is_read_as_zipfile_reads_a_plain_one(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Where the end record and the entries defer to zip64 records (a value of 4 GiB or
        more), the members are read from them: the bytes zipfile reads; truncated, nothing."""
        import io
        import zipfile

        from checkpoint_io._format.archive import read_archive

        monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 16)  # zip64 records for a small archive
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            archive.writestr("archive/data.pkl", b"x" * 100)
            archive.writestr("archive/data/0", b"y" * 64)
        data = buffer.getvalue()
        assert data[-42:-38] == b"PK\x06\x07"  # the zip64 locator before the end record
        data = data[:-6] + b"\xff" * 4 + data[-2:]  # the end record defers to zip64's
        found = read_archive(data)
        assert found is not None and found.zip64
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for name, member in found.members.items():
                assert data[member.begin : member.begin + member.size] == archive.read(name)
        assert sorted(found.members) == ["archive/data.pkl", "archive/data/0"]
        assert read_archive(data[:-1]) is None


class TestRedTeamValues:
    """What a second red team found past the value scan and the tensor fast path (each was
    accepted, or built something torch.load refuses, before the fix)."""

    def test_an_old_format_pickle_before_a_zip_is_refused(self) -> None:
        """torch.load reads data that does not start with a zip header as its legacy format
        (pickles from the first byte): an old-format bytearray pickle followed by an end
        record, or by a whole benign zip, passed a scan that read the zip from its end."""
        import io

        from checkpoint_io._format.values import load_value

        legacy = io.BytesIO()
        torch.save(bytearray(16), legacy, _use_new_zipfile_serialization=False)
        benign = _archive(_members({"lr": 0.1}))
        for label, data in {
            "an end record": legacy.getvalue() + _end(0, 0, 0),
            "a benign zip": legacy.getvalue() + benign,
        }.items():
            assert isinstance(torch.load(io.BytesIO(data), weights_only=True), bytearray), label
            with pytest.raises(CheckpointError, match="not torch.save's format"):
                load_value(data, label)

    def test_tensor_constructors_are_refused(self) -> None:
        """torch.ByteTensor(n) under weights_only makes n bytes of a few (a 266-byte value,
        a 2 GB tensor); no torch.save pickle names a legacy tensor constructor. torch.Tensor,
        which torch.save names for a tensor with Python attributes, is refused where called."""
        import io
        import struct
        import warnings

        from checkpoint_io._format.values import load_value

        for module, name in (
            (b"torch", b"ByteTensor"),
            (b"torch", b"FloatTensor"),
            (b"torch.sparse", b"FloatTensor"),
            (b"torch", b"Tensor"),
        ):
            size = b"J" + struct.pack("<i", 16) + b"\x85"
            pickled = b"\x80\x02c" + module + b"\n" + name + b"\n" + size + b"R."
            data = _archive([("archive/data.pkl", pickled), ("archive/version", b"3\n")])
            with warnings.catch_warnings():  # torch.sparse's constructors are deprecated
                warnings.simplefilter("ignore")
                built = torch.load(io.BytesIO(data), weights_only=True)
            assert built.shape[0] == 16  # torch's view
            refusal = (
                "the class torch.Tensor, used other than as torch.save uses it, which"
                if name == b"Tensor"
                else f"it holds a {name.decode()}, which"
            )
            with pytest.raises(CheckpointError, match=refusal):
                load_value(data, name.decode())

    def test_shared_references_are_visited_once_and_sets_and_keys_looked_into(self) -> None:
        """Ten references per level made 10^depth visits (3 s for 1.4 KB at depth 7; depth 12
        would take days); a buffer in a set or used as a key was not checked."""
        import io
        import time

        from checkpoint_io._format.values import load_value

        nested: list[object] = []
        for _ in range(12):
            nested = [nested] * 10
        started = time.perf_counter()
        loaded = load_value(_saved(nested), "the nested value")
        assert isinstance(loaded, list) and len(loaded) == 10 and loaded[0] is loaded[1]
        assert time.perf_counter() - started < 5  # 10^12 visits without the fix
        bomb = io.BytesIO(_saved({"blob": bytearray(4)}))
        for label, value in (("in a set", {bomb}), ("as a key", {bomb: 1})):
            with pytest.raises(CheckpointError, match="holds a bytearray"):
                load_value(_saved(value), label)

    def test_the_fast_path_reads_records_as_torch_does_or_leaves_them(self) -> None:
        """A record whose storage is smaller than its tensor (empty, or copied when misaligned)
        grew to hold it, uninitialized, where torch.load refuses it; a member named
        BYTEORDER (torch finds it ignoring case: big-endian) was ignored, the tensor read
        little-endian. Now the first is refused and the second left to torch's own path."""
        import io

        from checkpoint_io._format.records import tensor_record

        empty = [
            ("archive/data.pkl", _tensor_pickle("0", 0, (1000,))),
            ("archive/data/0", b""),
            ("archive/version", b"3\n"),
        ]
        with pytest.raises(RuntimeError, match="not resizable"):
            torch.load(io.BytesIO(_archive(empty)), weights_only=True)
        with pytest.raises(CheckpointError, match="asks for more than its storage '0' holds"):
            tensor_record(memoryview(bytearray(_archive(empty))), "the empty record")
        swapped = [
            (name.replace("byteorder", "BYTEORDER"), b"big" if name.endswith("byteorder") else d)
            for name, d in _members(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        ]
        data = _archive(swapped)
        assert not torch.equal(torch.load(io.BytesIO(data), weights_only=True), torch.ones(4))
        assert tensor_record(memoryview(bytearray(data)), "the swapped record") is None

    def test_a_storage_class_is_never_called(self) -> None:
        """weights_only admits calling torch.storage.UntypedStorage and TypedStorage: n bytes,
        uninitialized, of a few (a tensor rebuilt over one holds freed memory, not saved
        values); so does torch.Tensor. torch.save names a storage class only as a storage
        reference's type, and torch.Tensor only as _rebuild_from_type_v2's new_type; a value
        that uses one otherwise (called, memoized then called, the rebuild's func) is refused,
        and the fast path leaves a tensor record that does (its hooks a called storage) to the
        value path; a tensor with Python attributes still loads."""
        import io
        import struct
        import warnings

        from checkpoint_io._format.records import tensor_record
        from checkpoint_io._format.values import load_value

        untyped, typed = b"ctorch.storage\nUntypedStorage\n", b"ctorch.storage\nTypedStorage\n"
        size = b"J" + struct.pack("<i", 1 << 20) + b"\x85"  # (2**20,)

        def over(storage: bytes) -> bytes:  # _rebuild_tensor_v2(storage(2**20), 0, (2**20,), ..)
            rebuild = b"ctorch._utils\n_rebuild_tensor_v2\n("
            hooks = b"K\x01\x85\x89ccollections\nOrderedDict\n)RtR"
            return rebuild + storage + size + b"RK\x00" + size + hooks

        crafted = {
            "a call": untyped + size + b"R",
            "a tensor over a call": over(typed),
            "a memoized class, called": untyped + b"q\x00h\x00" + size + b"R",
        }
        for label, body in crafted.items():
            pickled = b"\x80\x02" + body + b"."
            data = _archive([("archive/data.pkl", pickled), ("archive/version", b"3\n")])
            with warnings.catch_warnings():  # TypedStorage is deprecated
                warnings.simplefilter("ignore")
                built = torch.load(io.BytesIO(data), weights_only=True)
            storage = built.untyped_storage() if isinstance(built, torch.Tensor) else built
            assert storage.nbytes() >= 1 << 20, label  # allocated, not read from the record
            with pytest.raises(CheckpointError, match="used other than as torch.save uses it"):
                load_value(data, label)
        # a dense record whose backward hooks are UntypedStorage(2**20): the fast path built it
        saved = b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQ"
        hooks = untyped + size + b"R"
        rebuild = b"ctorch._utils\n_rebuild_tensor_v2\n(" + saved + b"K\x00K\x04\x85K\x01\x85\x89"
        record = [
            ("archive/data.pkl", b"\x80\x02" + rebuild + hooks + b"tR."),
            ("archive/data/0", bytes(16)),
            ("archive/version", b"3\n"),
        ]
        assert tensor_record(memoryview(bytearray(_archive(record))), "the record") is None
        # as torch.save writes them: a storage reference's type, and torch.Tensor as the type
        # of a tensor with Python attributes (_rebuild_from_type_v2's new_type), read back
        annotated = torch.ones(2)
        annotated.note = "kept"  # type: ignore[attr-defined]
        for value in (torch.arange(4).untyped_storage(), torch.nn.Parameter(annotated), annotated):
            expected = torch.load(io.BytesIO(_saved(value)), weights_only=True)
            assert type(load_value(_saved(value), "a saved value")) is type(expected)
        assert load_value(_saved(annotated), "the annotated tensor").note == "kept"
        # torch.Tensor as _rebuild_from_type_v2's func: it calls torch.Tensor(2**20)
        rebuild = b"ctorch._tensor\n_rebuild_from_type_v2\n("
        tensor = b"ctorch\nTensor\n"
        data = _archive(
            [
                ("archive/data.pkl", b"\x80\x02" + rebuild + tensor + tensor + size + b"}tR."),
                ("archive/version", b"3\n"),
            ]
        )
        assert torch.load(io.BytesIO(data), weights_only=True).numel() == 1 << 20
        with pytest.raises(CheckpointError, match="the class torch.Tensor, used other than"):
            load_value(data, "a called torch.Tensor")


def _saved(value: object) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _tensor_pickle(key: str, numel: int, size: tuple[int, ...]) -> bytes:
    """The pickle of a float tensor of ``size`` over storage ``key`` of ``numel`` elements."""
    import collections
    import io
    import pickle

    class Storage:
        pass

    class Tensor:
        def __reduce__(self) -> tuple[object, ...]:
            args = (Storage(), 0, size, (1,) * len(size), False, collections.OrderedDict())
            return (torch._utils._rebuild_tensor_v2, args)

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            if isinstance(obj, Storage):
                return ("storage", torch.FloatStorage, key, "cpu", numel)
            return None

    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump(Tensor())
    return buffer.getvalue()


def _members(value: object) -> list[tuple[str, bytes]]:
    """The members of ``torch.save(value)``, name and bytes."""
    import io
    import zipfile

    buffer = io.BytesIO()
    torch.save(value, buffer)
    with zipfile.ZipFile(buffer) as archive:
        return [(item.filename, archive.read(item)) for item in archive.infolist()]


def _local(name: str, data: bytes) -> bytes:
    import struct
    import zlib

    head = (0x04034B50, 20, 0, 0, 0, 0, zlib.crc32(data), len(data), len(data))
    return struct.pack("<IHHHHHIIIHH", *head, len(name), 0) + name.encode() + data


def _central(name: str, data: bytes, offset: int, comment: bytes = b"") -> bytes:
    import struct
    import zlib

    head = (0x02014B50, 20, 20, 0, 0, 0, 0, zlib.crc32(data), len(data), len(data))
    tail = (len(name), 0, len(comment), 0, 0, 0, offset)
    return struct.pack("<IHHHHHHIIIHHHHHII", *head, *tail) + name.encode() + comment


def _end(count: int, size: int, offset: int) -> bytes:
    import struct

    return struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, size, offset, 0)


def _archive(members: list[tuple[str, bytes]]) -> bytes:
    """A plain archive of ``members``, as torch.save lays one out."""
    out, offsets = b"", []
    for name, data in members:
        offsets.append(len(out))
        out += _local(name, data)
    directory = b"".join(_central(n, d, o) for (n, d), o in zip(members, offsets, strict=True))
    return out + directory + _end(len(members), len(directory), len(out))


def _two_directories(bomb: list[tuple[str, bytes]], benign: list[tuple[str, bytes]]) -> bytes:
    """The end record points at the bomb's directory; zipfile, shifting every offset by the
    length of that directory, reads the benign one after it."""
    out, at_bomb, at_benign = b"", [], []
    for name, data in bomb:
        at_bomb.append(len(out))
        out += _local(name, data)
    for name, data in benign:
        at_benign.append(len(out))
        out += _local(name, data)
    first = b"".join(_central(n, d, o) for (n, d), o in zip(bomb, at_bomb, strict=True))
    second = [_central(n, d, o - len(first)) for (n, d), o in zip(benign, at_benign, strict=True)]
    pad = len(first) - len(b"".join(second))
    assert pad >= 0
    (name, data), offset = benign[-1], at_benign[-1]
    second[-1] = _central(name, data, offset - len(first), b" " * pad)
    return out + first + b"".join(second) + _end(len(bomb), len(first), len(out))


def _two_zip64_ends(bomb: list[tuple[str, bytes]], benign: list[tuple[str, bytes]]) -> bytes:
    """The locator points at a zip64 end record giving the bomb's directory; the one just
    before the locator (zipfile's) gives it shifted onto the benign pickle."""
    import struct

    out, offsets = b"", []
    for name, data in bomb:
        offsets.append(len(out))
        out += _local(name, data)
    pickle_at = next(o for (n, _), o in zip(bomb, offsets, strict=True) if n.endswith("data.pkl"))
    size = len(next(d for n, d in bomb if n.endswith("data.pkl")))
    harmless = next(d for n, d in benign if n.endswith("data.pkl"))
    shift = len(out) - pickle_at
    out += _local("archive/data.pkl", harmless + b"\0" * max(0, size - len(harmless)))
    directory = b"".join(_central(n, d, o) for (n, d), o in zip(bomb, offsets, strict=True))

    def zip64_end(offset: int) -> bytes:
        n = len(bomb)
        return struct.pack(
            "<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, len(directory), offset
        )

    record = len(out)
    out += zip64_end(record + 56) + directory + zip64_end(record + 56 - shift)
    locator = struct.pack("<IIQI", 0x07064B50, 0, record, 1)
    saturated = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, *(2 * [0xFFFFFFFF]), 0)
    return out + locator + saturated


def test_a_new_root_is_durable_on_the_first_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 51 (8): the root's own directory entry (and a new parent's) is flushed."""
    synced: list[str] = []
    fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), tmp_path))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    model, _ = trained()
    CheckpointManager(tmp_path / "runs" / "root", every=1).maybe_save(1, model)
    assert synced.index(".") < synced.index("runs")  # runs/ in tmp, then root/ in runs/
    assert (tmp_path / "runs" / "root" / "step-1").is_dir()


def test_build_on_an_enum_member_or_a_function_is_refused(tmp_path: Path) -> None:
    """Issue 51 (2): BUILD on the enum member _MEM_FORMAT_ENCODING(0) set its _value_ to 7
    (every later save unreadable); BUILD on torch.serialization._get_layout changed its cache.
    Only instances the unpickling created of DCP's dataclasses may be built."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from checkpoint_io._format.metadata import read_metadata

    member = b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nK\x00\x85R"
    function = b"ctorch.serialization\n_get_layout\n"
    for name, target in (("enum", member), ("function", function)):
        folder = tmp_path / name
        folder.mkdir()
        state = b"}\x8c\x07_value_K\x07s" if name == "enum" else b"}\x8c\x05cacheK\x07s"
        (folder / ".metadata").write_bytes(b"\x80\x04" + target + state + b"b.")
        with pytest.raises(CheckpointError, match="a change to an object it did not create"):
            read_metadata(folder)
    assert _MEM_FORMAT_ENCODING(0).value == 0
    assert not hasattr(torch.serialization._get_layout, "cache") or not isinstance(
        torch.serialization._get_layout.cache, int
    )
    model, _ = trained()  # the process still saves and loads
    path = save_checkpoint(tmp_path / "c", model)
    load_checkpoint(path, Small())


def test_build_on_an_index_class_or_a_dtype_is_refused_and_changes_nothing(
    tmp_path: Path,
) -> None:
    """The C unpickler reads the index, never handed an admitted class, enum or function:
    BUILD on DCP's MetadataIndex (a frozen dataclass) or on TensorProperties (its own
    ``__setstate__``) is refused by name; BUILD on a dtype cannot change it."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties

    from checkpoint_io._format.metadata import read_metadata

    module = b"ctorch.distributed.checkpoint.metadata\n"
    for name, target in (("index", b"MetadataIndex\n"), ("properties", b"TensorProperties\n")):
        folder = tmp_path / name
        folder.mkdir()
        for state in (b"}\x8c\x03fqnK\x07s", b"N}\x8c\x03fqnK\x07s\x86"):  # dict; (None, slots)
            (folder / ".metadata").write_bytes(b"\x80\x04" + module + target + state + b"b.")
            with pytest.raises(CheckpointError, match="a change to the class torch.distributed"):
                read_metadata(folder)
    assert "fqn" not in vars(MetadataIndex) and "fqn" not in vars(TensorProperties)
    folder = tmp_path / "dtype"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"\x80\x04ctorch\nfloat32\nN}\x8c\x01xK\x07s\x86b.")
    with pytest.raises(CheckpointError, match="cannot be read"):
        read_metadata(folder)
    assert not hasattr(torch.float32, "x")


def test_the_digests_recorded_as_written_are_those_of_the_files(tmp_path: Path) -> None:
    """A save hashes each data file from the page cache while it is flushed, its records at
    the positions DCP asked for: every entry equals one computed from the file on disk; and
    positions that miss the records (another torch could write otherwise) are read back."""
    from checkpoint_io._format.digest import file_entry
    from checkpoint_io._write.hashing import _HashingFileSystem

    model, optimizer = trained()
    path = save_checkpoint(tmp_path / "c", model, optimizer, step=1)
    files = json.loads((path / "checkpoint.json").read_text())["files"]
    data = [name for name in files if name.endswith(".distcp")]
    assert data
    for name in data:
        entry = {k: v for k, v in files[name].items() if k != "rank"}
        spans = [(offset, length) for offset, length, _ in entry["records"]]
        assert entry == file_entry(path / name, spans)
    name = data[0]
    spans = [(offset, length) for offset, length, _ in files[name]["records"]]
    system = _HashingFileSystem()
    system._start(path / name, [(0, 1)])  # positions that are not the records
    assert system.hashed(path / name, spans).result() == file_entry(path / name, spans)


def test_a_file_entry_is_the_digest_of_the_bytes_and_of_each_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-pass hashing (each piece fed to the file's digest and its record's) gives
    what hashing the bytes gives: across mapping windows and pieces, for gaps between
    records, a record overlapping the one before, and none for a record past the end."""
    import os

    import xxhash

    from checkpoint_io._format import digest

    data = os.urandom(3_000_000)
    (tmp_path / "f").write_bytes(data)
    spans = [(0, 100), (100, 1_500_000), (1_500_050, 100), (1_500_100, 10), (2_000_000, 999_999)]
    spans.append((2_999_999, 5))  # past the end: no digest
    expected = {
        "bytes": len(data),
        "xxh3_128": xxhash.xxh3_128(data).hexdigest(),
        "records": [
            [offset, length, xxhash.xxh3_128(data[offset : offset + length]).hexdigest()]
            for offset, length in sorted(spans)
            if offset + length <= len(data)
        ],
    }
    assert digest.file_entry(tmp_path / "f", spans) == expected
    monkeypatch.setattr(digest, "_WINDOW", 1 << 20)
    monkeypatch.setattr(digest, "_PIECE", 4096 * 3)
    assert digest.file_entry(tmp_path / "f", spans) == expected


def test_names_reach_the_terminal_escaped_and_buffers_nest_one_level(tmp_path: Path) -> None:
    """Issue 51 (8, 4): a key with terminal control bytes is printed escaped by inspect; a
    byte buffer inside a byte buffer is refused (K buffers D deep made K^D loads)."""
    import io

    from checkpoint_io._format.values import load_value

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_parameter("x\x1b[2Jy", nn.Parameter(torch.ones(2)))

    path = save_checkpoint(tmp_path / "c", Odd())
    done = checkpoint_cli("inspect", str(path))
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "x\\x1b[2Jy" in done.stdout
    inner = io.BytesIO()
    torch.save({"lr": 0.1}, inner)
    outer = io.BytesIO()
    torch.save({"groups": inner}, outer)
    assert load_value(outer.getvalue(), "one level")["groups"].getvalue() == inner.getvalue()
    deeper = io.BytesIO()
    torch.save({"groups": outer}, deeper)
    with pytest.raises(CheckpointError, match="a byte buffer inside a byte buffer"):
        load_value(deeper.getvalue(), "two levels")


def _edit_index(path: Path, change: Any) -> None:
    """Rewrite DCP's index with ``change(metadata)`` and record it, as an attacker would."""
    with open(path / ".metadata", "rb") as stream:
        metadata = pickle.load(stream)  # the test's own checkpoint: trusted here
    change(metadata)
    with open(path / ".metadata", "wb") as stream:
        pickle.dump(metadata, stream)
    _rehash(path, ".metadata")


def _half(chunk: Any) -> Any:
    """The first half of ``chunk``'s rows: twice, it covers the tensor's count but overlaps."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    sizes = torch.Size([chunk.sizes[0] // 2, *chunk.sizes[1:]])
    return ChunkStorageMetadata(offsets=chunk.offsets, sizes=sizes)


class TestTheIndexIsCheckedBeforeAnythingIsRead:
    """Issue 51 (3, 5): nothing checked that a tensor's chunks cover it (emptied chunks loaded
    "successfully" and kept the old values; consolidate wrote freed memory), that its size fits
    its bytes (a 40 KB checkpoint asked for 80 GB), that a data file is in the manifest, or
    (in consolidate and inspect --fingerprint) any size or digest."""

    def _saved(self, tmp_path: Path) -> tuple[Path, str]:
        model, optimizer = trained()
        path = save_checkpoint(tmp_path / "c", model, optimizer, step=1)
        return path, "model.body.weight"

    @pytest.mark.parametrize(
        ("change", "message"),
        [
            (lambda t: setattr(t, "chunks", []), "cover 0 of its 16 elements"),
            (lambda t: setattr(t, "size", torch.Size([10**10, 4])), "cover 16 of its 40000000000"),
            (lambda t: setattr(t, "chunks", [_half(t.chunks[0])] * 2), "overlap"),
        ],
    )
    def test_chunks_that_do_not_tile_are_refused_everywhere(
        self, tmp_path: Path, change: Any, message: str
    ) -> None:
        path, fqn = self._saved(tmp_path)
        _edit_index(path, lambda m: change(m.state_dict_metadata[fqn]))
        fresh = Small()
        before = _snapshot(fresh)
        for verify in (True, False):
            with pytest.raises(CheckpointError, match=message):
                load_checkpoint(path, fresh, verify=verify)
        assert _same(fresh, before)  # model unchanged
        with pytest.raises(CheckpointError, match=message):
            consolidate_checkpoint(path, tmp_path / "out.pt")
        assert not (tmp_path / "out.pt").exists()
        shown = checkpoint_cli("inspect", str(path), "--fingerprint")
        assert shown.returncode == 2 and message.split(maxsplit=1)[0] in shown.stderr

    def test_a_data_file_the_manifest_did_not_record_is_refused(self, tmp_path: Path) -> None:
        path, fqn = self._saved(tmp_path)
        data = sorted(p.name for p in path.iterdir() if p.suffix == ".distcp")[0]
        (path / "planted.distcp").write_bytes((path / data).read_bytes())

        def plant(metadata: Any) -> None:
            for index, info in metadata.storage_data.items():
                if index.fqn == fqn:
                    info.relative_path = "planted.distcp"

        _edit_index(path, plant)
        with pytest.raises(CheckpointError, match="'planted.distcp', which the manifest did not"):
            load_checkpoint(path, Small(), verify=False)
        with pytest.raises(CheckpointError, match="which the manifest did not record"):
            consolidate_checkpoint(path, tmp_path / "out.pt")

    def test_consolidate_and_the_fingerprint_check_digests(self, tmp_path: Path) -> None:
        """One flipped bit came out as -3.5e37 where -0.10 was saved."""
        path, _ = self._saved(tmp_path)
        data = sorted(p for p in path.iterdir() if p.suffix == ".distcp")[0]
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        data.write_bytes(bytes(raw))
        with pytest.raises(CheckpointError, match="verification failed"):
            consolidate_checkpoint(path, tmp_path / "out.pt")
        shown = checkpoint_cli("inspect", str(path), "--fingerprint")
        assert shown.returncode == 2 and "verification failed" in shown.stderr


def test_other_param_groups_or_a_manifest_field_missing_change_nothing(tmp_path: Path) -> None:
    """Issue 51 (6): an optimizer with other parameter groups raised after the weights changed;
    a manifest without torch_version raised after model, optimizer and RNG all changed."""
    model, optimizer = trained()
    path = save_checkpoint(tmp_path / "c", model, optimizer, step=1)
    fresh = Small()
    torch.manual_seed(3)
    split = torch.optim.AdamW(
        [{"params": fresh.body.parameters()}, {"params": fresh.head.parameters()}]
    )
    before, rng = _snapshot(fresh), torch.random.get_rng_state()
    with pytest.raises(CheckpointError, match="parameter groups differ from the saved ones"):
        load_checkpoint(path, fresh, split)
    assert _same(fresh, before) and not split.state
    manifest = json.loads((path / "checkpoint.json").read_text())
    del manifest["torch_version"]
    (path / "checkpoint.json").write_text(json.dumps(manifest))
    whole = torch.optim.AdamW(fresh.parameters())
    with pytest.raises(CheckpointError, match="manifest is malformed .*torch_version"):
        load_checkpoint(path, fresh, whole, verify=False)
    assert _same(fresh, before) and not whole.state
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_a_load_that_fails_mid_read_changes_nothing(tmp_path: Path) -> None:
    """Issue 51 (6): the tensors were read in place, so a record that failed after others had
    landed left the model partly loaded. Proves: the last record of the data file zeroed (and
    re-hashed, so only decoding can tell), the load raises and the model, the optimizer and
    the RNG are bit-identical to before, verified or not."""
    from checkpoint_io._format.metadata import read_metadata

    model, optimizer = trained()
    path = save_checkpoint(tmp_path / "c", model, optimizer, step=1)
    records = sorted(
        (int(info.offset), int(info.length), str(info.relative_path))
        for info in read_metadata(path).storage_data.values()
    )
    offset, length, name = records[-1]  # read last: every other record lands before it
    assert any(n == name for _, _, n in records[:-1])
    data = bytearray((path / name).read_bytes())
    data[offset : offset + length] = bytes(length)
    (path / name).write_bytes(bytes(data))
    _rehash(path, name)
    fresh = Small()
    torch.manual_seed(5)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    fresh(torch.randn(3, 4)).sum().backward()
    fresh_optimizer.step()
    before, rng = _snapshot(fresh), torch.random.get_rng_state()
    moments = {k: v.clone() for k, v in fresh_optimizer.state[fresh.body.weight].items()}
    for verify in (True, False):
        with pytest.raises(CheckpointError, match="torch.save's format"):
            load_checkpoint(path, fresh, fresh_optimizer, verify=verify)
        assert _same(fresh, before)
        now = fresh_optimizer.state[fresh.body.weight]
        assert all(torch.equal(now[k], v) for k, v in moments.items())
        assert torch.equal(torch.random.get_rng_state(), rng)


def test_each_file_is_opened_once_per_load(tmp_path: Path) -> None:
    """Issue 51 (8): every file was read twice (hashed, then loaded). Proves, by Python's own
    audit events: a verified load with an optimizer, stateful objects and the RNG opens each
    file of the checkpoint exactly once, and only files the manifest recorded (plus itself)."""
    import sys

    model, optimizer = trained()
    saved = Holder({"epoch": 3})
    path = save_checkpoint(tmp_path / "c", model, optimizer, step=1, stateful={"s": saved})
    recorded = set(json.loads((path / "checkpoint.json").read_text())["files"])
    opened: list[str] = []
    watching = [False]
    base = os.path.realpath(path)

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if watching[0] and event == "open" and isinstance(args[0], str | bytes | os.PathLike):
            real = os.path.realpath(os.fsdecode(args[0]))
            if real.startswith(base + os.sep):
                opened.append(os.path.relpath(real, base))

    sys.addaudithook(hook)  # cannot be removed: it records only while watching
    fresh, holder = Small(), Holder(None)
    watching[0] = True
    try:
        load_checkpoint(path, fresh, torch.optim.AdamW(fresh.parameters()), stateful={"s": holder})
    finally:
        watching[0] = False
    assert sorted(opened) == sorted(recorded | {"checkpoint.json"}), opened
    assert holder.state == {"epoch": 3} and _same(fresh, _snapshot(model))


def test_a_tensor_record_is_a_view_checked_against_its_members() -> None:
    """The load's fast path (no copy of a record): a record decodes to a view of the bytes read;
    a storage member shorter than its pickle claims is refused without an allocation; a
    deflated record or one building a bytearray leaves the fast path, and the slow path refuses
    it (proves: no size is taken from the pickle, nothing is inflated)."""
    import io
    import zipfile

    from checkpoint_io._format.records import tensor_record
    from checkpoint_io._format.values import load_value

    def record(value: Any) -> bytes:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        return buffer.getvalue()

    def rezip(data: bytes, change: Any, method: int = zipfile.ZIP_STORED) -> bytes:
        out = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(out, "w") as target:
            for item in source.infolist():
                target.writestr(item.filename, change(item.filename, source.read(item)), method)
        return out.getvalue()

    good = bytearray(record(torch.arange(6.0).view(2, 3)))
    view = tensor_record(memoryview(good), "the record")
    assert view is not None and torch.equal(view, torch.arange(6.0).view(2, 3))
    start = torch.frombuffer(good, dtype=torch.uint8).data_ptr()
    assert start <= view.data_ptr() < start + len(good)  # a view of the bytes read: no copy
    short = rezip(bytes(good), lambda name, data: data[:8] if "/data/" in name else data)
    with pytest.raises(CheckpointError, match="needs 24 bytes, its member has 8"):
        tensor_record(memoryview(bytearray(short)), "the short record")
    deflated = rezip(bytes(good), lambda name, data: data, zipfile.ZIP_DEFLATED)
    assert tensor_record(memoryview(bytearray(deflated)), "the deflated record") is None
    with pytest.raises(CheckpointError, match="a compressed record"):
        load_value(deflated, "the deflated record")
    builds = record({"blob": bytearray(4)})
    assert tensor_record(memoryview(bytearray(builds)), "the crafted record") is None
    sparse = record(torch.eye(3).to_sparse())  # torch.load's own path, with its checks
    assert tensor_record(memoryview(bytearray(sparse)), "the sparse record") is None
    with pytest.raises(CheckpointError, match="holds a bytearray"):
        load_value(builds, "the crafted record")


def test_a_malformed_record_table_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """A manifest whose per-record digests are not [offset, length, digest] triples is refused
    by name before anything is read; the model is unchanged."""
    model, optimizer = trained()
    path = save_checkpoint(tmp_path / "c", model, optimizer, step=1)
    manifest = json.loads((path / "checkpoint.json").read_text())
    manifest["files"]["__0_0.distcp"]["records"] = [[0, -1, "x"]]
    (path / "checkpoint.json").write_text(json.dumps(manifest))
    fresh = Small()
    before = _snapshot(fresh)
    with pytest.raises(CheckpointError, match="file table is malformed"):
        load_checkpoint(path, fresh)
    assert _same(fresh, before)
