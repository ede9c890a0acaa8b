"""Checkpoints you can trust: reading runs none of their code and nothing outside them; a
well-kept digest; durable before anything older goes; stateful values load as saved."""

from __future__ import annotations

import json
import os
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
from checkpoint_models import Small, checkpoint_cli, trained


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


def test_a_stateful_value_the_json_cannot_carry_is_refused_at_save(
    tmp_path: Path,
) -> None:
    model, _ = trained()
    with pytest.raises(
        TypeError, match=r"stateful\['odd'\] \(Holder\)\['x'\] holds a .*Holder, which a"
    ):
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
    (path / "rng" / "rank0.safetensors").rename(target)
    (path / "rng" / "rank0.safetensors").symlink_to(target)
    with pytest.raises(CheckpointError, match="'rng/rank0.safetensors', which leads outside"):
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
        lambda d: _flip(d, len(d) - 5),  # a weight
        lambda d: _swap_words(d, 64),  # two 8-byte words of the header
        lambda d: d[:-8],
    ],
    ids=["flipped-bit", "swapped-words", "truncated-tail"],
)
def test_the_digest_detects_damage(tmp_path: Path, damage: Any) -> None:
    from checkpoint_io._storage.manifest import file_entry

    model, _ = trained()
    path = save_checkpoint(tmp_path / "c", model)
    data_file = next(path.glob("rank*.safetensors"))
    data = data_file.read_bytes()
    recorded = file_entry(data_file)
    data_file.write_bytes(damage(data))
    if len(damage(data)) == len(data):  # the size alone cannot tell
        assert file_entry(data_file)["xxh3_128"] != recorded["xxh3_128"]
    with pytest.raises(
        CheckpointError, match="verification failed|truncated or corrupt|not a valid"
    ):
        load_checkpoint(path, Small())


def test_everything_is_fsynced_before_the_old_checkpoint_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib
    import shutil

    _publish = importlib.import_module("safe_store.publish")

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
    for name in (
        "rank0.safetensors",
        "index.json",
        "rng/rank0.safetensors",
        "stateful/rank0.safetensors",
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


def _edit_index(path: Path, change: Any) -> None:
    """Rewrite ``index.json`` with ``change(index)`` and record it in the manifest."""
    index = json.loads((path / "index.json").read_text())
    change(index)
    (path / "index.json").write_text(json.dumps(index))
    _rehash(path, "index.json")


def test_an_index_that_points_out_or_is_not_json_is_refused(tmp_path: Path) -> None:
    """A chunk's file outside the checkpoint (or not recorded), a path int of 10**10, a
    field of the wrong type, JSON nested 100,000 deep: each one CheckpointError naming it."""
    model, _ = trained()
    path = save_checkpoint(tmp_path / "c", model)
    real = (path / "index.json").read_text()

    def outside(index: dict[str, Any]) -> None:
        index["tensors"]["model.body.weight"]["chunks"][0]["file"] = "../other/x.safetensors"

    def huge_path(index: dict[str, Any]) -> None:
        index["paths"]["model.body.weight"] = ["model", 10**10]

    def wrong_type(index: dict[str, Any]) -> None:
        index["tensors"]["model.body.weight"]["size"] = "4x4"

    for change, message in (
        (outside, "'../other/x.safetensors', which the manifest did not record"),
        (huge_path, r"paths\['model.body.weight'\] is malformed"),
        (wrong_type, r"\['size'\] is malformed \('4x4'\)"),
    ):
        (path / "index.json").write_text(real)
        _edit_index(path, change)
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint(path, Small())
    (path / "index.json").write_text("[" * 100_000 + "]" * 100_000)
    _rehash(path, "index.json")
    with pytest.raises(CheckpointError, match="not JSON|malformed"):
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
        """A FIFO named index.json (.metadata) hung latest_checkpoint and resume; a FIFO RNG or stateful
        file hung load_checkpoint; a linked checkpoint.json was read from outside. Run in a
        child with a deadline: a hang fails the test instead of stopping the suite."""
        import shutil

        from dist_harness import fresh_interpreter

        root = self._root(tmp_path)
        for step, name in (
            (3, "index.json"),
            (4, "rng/rank0.safetensors"),
            (5, "stateful/rank0.safetensors"),
        ):
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
        assert lines[1].startswith("4 refused:") and "rng/rank0.safetensors" in lines[1]
        assert lines[2].startswith("5 refused:") and "stateful/rank0.safetensors" in lines[2]

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
        data = next((root / "step-2").glob("rank*.safetensors"))
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
        assert "step is '7', not an int" in caplog.text and "step-2" in caplog.text


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
        for label, (exp_avg, exp_avg_sq) in (
            ("under a value", (("exp_avg",), ("exp_avg", "x"))),
            ("negative", (("exp_avg",), ("h", -1))),
            ("mixed", (("h", "k"), ("h", 0))),
        ):
            shutil.copytree(tmp_path / "c", tmp_path / label)

            def craft(index: dict[str, Any], a: Any = exp_avg, b: Any = exp_avg_sq) -> None:
                for fqn, path in list(index["paths"].items()):
                    if fqn.startswith("optim.state.") and path[-1] == "exp_avg":
                        index["paths"][fqn] = [*path[:-1], *a]
                    elif fqn.startswith("optim.state.") and path[-1] == "exp_avg_sq":
                        index["paths"][fqn] = [*path[:-1], *b]

            _edit_index(tmp_path / label, craft)
            # a path must be the one its key says (DCP joins a path's parts with dots)
            with pytest.raises(CheckpointError, match=r"paths\[.*\] is malformed"):
                load_checkpoint(tmp_path / label, model, adamw)
            assert _same(model, before), label

    def test_an_optimizer_value_a_load_would_refuse_is_refused_at_save(
        self, tmp_path: Path
    ) -> None:
        """An object in a parameter group or in the optimizer's state has no JSON: the save
        refuses it, naming where it sits, with nothing written; plain values save and load
        (a dict of them too)."""
        model, optimizer = trained()
        optimizer.param_groups[0]["schedule"] = Holder()
        refusal = r"the optimizer's param_groups \(AdamW\)\[0\]\['schedule'\] holds a .*Holder"
        with pytest.raises(TypeError, match=refusal):
            save_checkpoint(tmp_path / "c", model, optimizer)
        assert not (tmp_path / "c").exists()
        del optimizer.param_groups[0]["schedule"]
        first = next(iter(optimizer.state.values()))
        first["note"] = Holder()
        with pytest.raises(TypeError, match=r"the optimizer's state \(AdamW\) for .* holds a"):
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

    def test_a_bytearray_or_a_buffer_is_refused_at_save(self, tmp_path: Path) -> None:
        """JSON carries bytes, not a mutable buffer: refused by name, nothing written."""
        import io

        model, _ = trained()
        for value, kind in ((bytearray(b"x"), "bytearray"), (io.BytesIO(b"raw"), "BytesIO")):
            with pytest.raises(TypeError, match=f"stateful\\['h'\\] .*holds a .*{kind}"):
                save_checkpoint(tmp_path / "c", model, stateful={"h": Holder(value)})
            assert not (tmp_path / "c").exists()
        save_checkpoint(tmp_path / "c", model, stateful={"h": Holder({"b": b"\x00\xff"})})
        loaded = Holder(None)
        load_checkpoint(tmp_path / "c", model, stateful={"h": loaded})
        assert loaded.state == {"b": b"\x00\xff"}


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


def test_the_digests_recorded_as_written_are_those_of_the_files(tmp_path: Path) -> None:
    """A save hashes each file as it streams it: every entry equals one computed from the
    file on disk, the whole file's digest and each record's."""
    from safe_store import record_digest

    model, optimizer = trained()
    path = save_checkpoint(tmp_path / "c", model, optimizer, step=1, stateful={"h": Holder(1)})
    files = json.loads((path / "checkpoint.json").read_text())["files"]
    assert sorted(files) == [
        "index.json",
        "rank0.safetensors",
        "rng/rank0.safetensors",
        "stateful/rank0.safetensors",
    ]
    for name, entry in files.items():
        data = (path / name).read_bytes()
        assert entry["bytes"] == len(data) and entry["xxh3_128"] == xxhash.xxh3_128_hexdigest(data)
        for offset, length, digest in entry.get("records", []):
            assert digest == record_digest(data[offset : offset + length]), name


def test_names_reach_the_terminal_escaped(tmp_path: Path) -> None:
    """Issue 51 (8): a key with terminal control bytes is printed escaped by inspect, and a
    CheckpointError names untrusted text escaped (no ESC or BEL reaches a terminal)."""

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_parameter("x\x1b[2Jy", nn.Parameter(torch.ones(2)))

    path = save_checkpoint(tmp_path / "c", Odd())
    done = checkpoint_cli("inspect", str(path))
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "x\\x1b[2Jy" in done.stdout
    manifest = json.loads((path / "checkpoint.json").read_text())
    manifest["files"]["rng/\x1b]0;pwned\x07"] = {"bytes": 1, "xxh3_128": "0" * 32}
    (path / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(path, Odd())
    assert "\x1b" not in str(refused.value) and "\x07" not in str(refused.value)


def _rows(offset: int, rows: int) -> dict[str, Any]:
    """A chunk of ``rows`` rows of a 4x4 float tensor starting at row ``offset``."""
    return {"offsets": [offset, 0], "sizes": [rows, 4], "file": "rank0.safetensors", "at": 0,
            "bytes": rows * 16}  # fmt: skip


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
            (lambda t: t.update(chunks=[]), "cover 0 of its 16 elements"),
            (lambda t: t.update(size=[10**10, 4]), "cover 16 of its 40000000000"),
            (lambda t: t.update(chunks=[_rows(0, 3), _rows(2, 1)]), "overlap"),
        ],
    )
    def test_chunks_that_do_not_tile_are_refused_everywhere(
        self, tmp_path: Path, change: Any, message: str
    ) -> None:
        path, fqn = self._saved(tmp_path)
        _edit_index(path, lambda index: change(index["tensors"][fqn]))
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
        (path / "planted.safetensors").write_bytes((path / "rank0.safetensors").read_bytes())

        def plant(index: dict[str, Any]) -> None:
            index["tensors"][fqn]["chunks"][0]["file"] = "planted.safetensors"

        _edit_index(path, plant)
        with pytest.raises(CheckpointError, match="'planted.safetensors', which the manifest did"):
            load_checkpoint(path, Small(), verify=False)
        with pytest.raises(CheckpointError, match="which the manifest did not record"):
            consolidate_checkpoint(path, tmp_path / "out.pt")

    def test_consolidate_and_the_fingerprint_check_digests(self, tmp_path: Path) -> None:
        """One flipped bit came out as -3.5e37 where -0.10 was saved."""
        path, _ = self._saved(tmp_path)
        data = path / "rank0.safetensors"
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
    with pytest.raises(CheckpointError, match="torch_version is None, not a string; the manifest"):
        load_checkpoint(path, fresh, whole, verify=False)
    assert _same(fresh, before) and not whole.state
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_a_load_that_fails_mid_read_changes_nothing(tmp_path: Path) -> None:
    """Issue 51 (6): the tensors were read in place, so a record that failed after others had
    landed left the model partly loaded. Proves: the last record read fails (an I/O error
    injected in the reader), the load raises and the model, the optimizer and the RNG are
    bit-identical to before, verified or not."""
    from checkpoint_io._storage.files import CheckpointFiles

    model, optimizer = trained()
    path = save_checkpoint(tmp_path / "c", model, optimizer, step=1)
    fresh = Small()
    torch.manual_seed(5)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    fresh(torch.randn(3, 4)).sum().backward()
    fresh_optimizer.step()
    before, rng = _snapshot(fresh), torch.random.get_rng_state()
    moments = {k: v.clone() for k, v in fresh_optimizer.state[fresh.body.weight].items()}
    read_records = CheckpointFiles.read_records
    count = len(json.loads((path / "index.json").read_text())["tensors"])
    delivered: list[int] = []

    def failing(self: CheckpointFiles, name: str, spans: Any, each: Any, *rest: Any) -> None:
        def counting(index: int, data: memoryview) -> None:  # after the record was read
            delivered.append(1)
            if len(delivered) == count:  # every other record has landed
                raise CheckpointError("the disk went away (simulated)")
            each(index, data)

        read_records(self, name, spans, counting, *rest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CheckpointFiles, "read_records", failing)
        for verify in (True, False):
            delivered.clear()
            with pytest.raises(CheckpointError, match="the disk went away"):
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


def test_a_malformed_record_table_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """A manifest whose per-record digests are not [offset, length, digest] triples is refused
    by name before anything is read; the model is unchanged."""
    model, optimizer = trained()
    path = save_checkpoint(tmp_path / "c", model, optimizer, step=1)
    manifest = json.loads((path / "checkpoint.json").read_text())
    manifest["files"]["rank0.safetensors"]["records"] = [[0, -1, "x"]]
    (path / "checkpoint.json").write_text(json.dumps(manifest))
    fresh = Small()
    before = _snapshot(fresh)
    with pytest.raises(CheckpointError, match="file table is malformed"):
        load_checkpoint(path, fresh)
    assert _same(fresh, before)
