"""checkpoint-io validates first (issue 62, items 17-20): every malformed checkpoint is one
CheckpointError before anything changes, so latest_checkpoint skips it and resume falls back
to the next older one; a load is all or nothing, the RNG and user objects included."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from checkpoint_io import CheckpointError, CheckpointManager, latest_checkpoint, load_checkpoint
from checkpoint_io._cli import main
from checkpoint_io._storage.index import MAX_PATH_INDEX
from checkpoint_models import Small, checkpoint_cli, trained
from safe_store import record_digest


class Holder:
    def __init__(self, state: Any = None, fail: bool = False) -> None:
        self.state, self.fail = state, fail

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state
        if self.fail:
            raise RuntimeError("this object's load_state_dict raised")


def _rehash(path: Path, name: str) -> None:
    manifest = json.loads((path / "checkpoint.json").read_text())
    data = (path / name).read_bytes()
    entry = manifest["files"][name]
    entry.update(bytes=len(data), xxh3_128=xxhash.xxh3_128_hexdigest(data))
    if "records" in entry:
        head = 8 + struct.unpack("<Q", data[:8])[0]
        entry["records"] = [[0, head, record_digest(data[:head])]] + [
            [o, n, record_digest(data[o : o + n])] for o, n, _ in entry["records"][1:]
        ]
    (path / "checkpoint.json").write_text(json.dumps(manifest))


def _root(tmp_path: Path) -> Path:
    model, optimizer = trained()
    manager = CheckpointManager(tmp_path / "root", every=1)
    for step in (1, 2):
        manager.maybe_save(step, model, optimizer, stateful={"h": Holder({"k": step})})
    return tmp_path / "root"


def _edit(path: Path, name: str, change: Any) -> None:
    body = json.loads((path / name).read_text())
    change(body)
    (path / name).write_text(json.dumps(body))
    if name != "checkpoint.json":
        _rehash(path, name)


def _three_byte_rng(path: Path) -> None:
    from safe_store import StreamWriter

    file = path / "rng" / "rank0.safetensors"
    with open(file, "rb") as stream:
        length = struct.unpack("<Q", stream.read(8))[0]
        metadata = json.loads(stream.read(length))["__metadata__"]
    file.unlink()
    writer = StreamWriter(file, [("cpu", torch.uint8, (3,))], metadata)
    writer.write("cpu", torch.zeros(3, dtype=torch.uint8))
    writer.close()
    _rehash(path, "rng/rank0.safetensors")


def _optim_path_past_the_cap(path: Path) -> None:
    """An optimizer-state value whose key, path and entry all agree: only the cap refuses it."""
    key = f"optim.x.{10**10}"

    def change(body: dict[str, Any]) -> None:
        body["values"][key] = 0
        body["paths"][key] = ["optim", "x", 10**10]

    _edit(path, "index.json", change)


MALFORMED = {
    "a path that is an int": (
        lambda p: _edit(p, "index.json", lambda b: b["paths"].update({"model.body.weight": 5})),
        r"paths\['model.body.weight'\] is malformed \(5\)",
    ),
    "a path int of 10**10": (
        lambda p: _edit(
            p, "index.json", lambda b: b["paths"].update({"model.body.weight": ["model", 10**10]})
        ),
        r"paths\['model.body.weight'\] is malformed",
    ),
    "an optimizer path int of 10**10": (
        _optim_path_past_the_cap,
        r"paths\['optim.x.10000000000'\] holds the list position 10000000000, past the cap "
        r"MAX_PATH_INDEX",
    ),
    "world_size 3 without the RNG files": (
        lambda p: _edit(p, "checkpoint.json", lambda b: b.update(world_size=3)),
        "a table holding the RNG file of each of 3 ranks",
    ),
    "empty stateful digests": (
        lambda p: _edit(
            p, "checkpoint.json", lambda b: b["stateful_state"]["h"].update(digests=[])
        ),
        r"stateful_state\['h'\]\['digests'\] is \[\], not 1 digests",
    ),
    "a short stateful digest": (
        lambda p: _edit(
            p, "checkpoint.json", lambda b: b["stateful_state"]["h"].update(digests=["ab"])
        ),
        r"\['digests'\] is \['ab'\]",
    ),
    "a 3-byte CPU RNG state": (_three_byte_rng, r"state\['cpu'\]"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_resume_falls_back_and_latest_skips(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each was a raw TypeError, FileNotFoundError, KeyError, IndexError or ValueError, and
    latest_checkpoint called the checkpoint complete."""
    change, message = MALFORMED[case]
    root = _root(tmp_path)
    change(root / "step-2")
    assert latest_checkpoint(root) == root / "step-1"
    assert any("skipping" in r.message and "step-2" in r.message for r in caplog.records), (
        caplog.text
    )
    model, optimizer = trained()
    holder = Holder()
    assert CheckpointManager(root, every=1).resume(model, optimizer, stateful={"h": holder}) == 1
    assert holder.state == {"k": 1}
    fresh = Small()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    rng = torch.get_rng_state()
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(root / "step-2", fresh, stateful={"h": Holder()})
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_path_int_of_10_10_is_refused_by_consolidate_and_inspect(tmp_path: Path) -> None:
    """One planner-data int of 10**10 ran consolidate and inspect --fingerprint to
    MemoryError (an 80 GB allocation from a small checkpoint)."""
    from checkpoint_io import consolidate_checkpoint

    root = _root(tmp_path)
    MALFORMED["a path int of 10**10"][0](root / "step-2")
    with pytest.raises(CheckpointError, match="is malformed"):
        consolidate_checkpoint(root / "step-2", tmp_path / "hf")
    assert main(["inspect", str(root / "step-2"), "--fingerprint"]) == 2


def test_a_path_past_the_cap_is_refused_by_consolidate_and_inspect(tmp_path: Path) -> None:
    """Key, path and entry agree (``optim.x.10000000000``, ``["optim", "x", 10**10]``), so
    only MAX_PATH_INDEX refuses it: without the cap, consolidate wrote the model and
    inspect --fingerprint rebuilt a list of 10**10 entries (an 80 GB allocation)."""
    from checkpoint_io import consolidate_checkpoint

    root = _root(tmp_path)
    _optim_path_past_the_cap(root / "step-2")
    cap = f"past the cap MAX_PATH_INDEX = {MAX_PATH_INDEX}"
    with pytest.raises(CheckpointError, match=r"paths\['optim.x.10000000000'\]") as refused:
        consolidate_checkpoint(root / "step-2", tmp_path / "hf")
    assert cap in str(refused.value)
    assert not (tmp_path / "hf").exists()
    done = checkpoint_cli("inspect", str(root / "step-2"), "--fingerprint")
    assert done.returncode == 2, done.stderr
    assert "optim.x.10000000000" in done.stderr and cap in done.stderr, done.stderr


def _optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A deep copy of ``optimizer.state_dict()`` (its tensors cloned)."""
    state = optimizer.state_dict()
    return {
        "state": {
            k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
            for k, s in state["state"].items()
        },
        "param_groups": json.loads(json.dumps(state["param_groups"])),
    }


def _same_optimizer_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a["param_groups"] == b["param_groups"]
        and a["state"].keys() == b["state"].keys()
        and all(
            a["state"][k].keys() == b["state"][k].keys()
            and all(torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][k][n]))
                    for n, v in a["state"][k].items())
            for k in a["state"]
        )
    )  # fmt: skip


def test_a_3_byte_rng_state_leaves_the_model_and_an_optimizer_with_state_unchanged(
    tmp_path: Path,
) -> None:
    """The RNG state of the wrong size was found after the model and the optimizer were
    written: loaded with an optimizer that has state, both stay as they were."""
    root = _root(tmp_path)
    _three_byte_rng(root / "step-2")
    torch.manual_seed(1)  # other weights and other optimizer state than the checkpoint's
    model = Small()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
    assert optimizer.state  # exp_avg, exp_avg_sq and step for every parameter
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer_before = _optimizer_state(optimizer)
    holder = Holder({"k": "mine"})
    rng = torch.get_rng_state()
    with pytest.raises(CheckpointError, match=r"state\['cpu'\]"):
        load_checkpoint(root / "step-2", model, optimizer, stateful={"h": holder})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert _same_optimizer_state(_optimizer_state(optimizer), optimizer_before)
    assert optimizer.param_groups[0]["lr"] == 0.5  # the checkpoint's is 0.1
    assert holder.state == {"k": "mine"}
    assert torch.equal(torch.get_rng_state(), rng)
    # An intact checkpoint does change both: the comparisons above can see a load.
    load_checkpoint(root / "step-1", model, optimizer, stateful={"h": holder})
    assert not _same_optimizer_state(_optimizer_state(optimizer), optimizer_before)


def test_a_stateful_object_that_raises_changes_nothing(tmp_path: Path) -> None:
    """A stateful object whose load_state_dict raised left the model and optimizer changed:
    now the objects load first, and those loaded before it are put back."""
    model, optimizer = trained()
    path = CheckpointManager(tmp_path / "r", every=1).maybe_save(
        1, model, optimizer, stateful={"a": Holder({"a": 1}), "b": Holder({"b": 1})}
    )
    assert path is not None
    fresh = Small()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    first, failing = Holder({"a": 0}), Holder({"b": 0}, fail=True)
    with pytest.raises(RuntimeError, match="load_state_dict raised"):
        load_checkpoint(path, fresh, fresh_opt, stateful={"a": first, "b": failing})
    assert first.state == {"a": 0} and failing.state == {"b": 0}
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    assert not fresh_opt.state


def test_a_padded_manifest_is_skipped_unread(tmp_path: Path) -> None:
    """A checkpoint.json sparse-padded to 1 GiB took 12 s and 2.3 GB to skip."""
    root = _root(tmp_path)
    with open(root / "step-2" / "checkpoint.json", "r+b") as stream:
        stream.truncate(1 << 30)  # sparse: no disk used
    began = time.perf_counter()
    assert latest_checkpoint(root) == root / "step-1"
    assert time.perf_counter() - began < 10  # refused by its size, not read


def test_after_a_roll_back_resume_takes_the_rolled_back_run(tmp_path: Path) -> None:
    """A loss spike: the run went back to step-1 and saved step-2 again... as step-3 under
    another name here: the abandoned run's step-5 is the highest step, but the rolled-back
    run saved last, and resume continues it (it picked step-5)."""
    model, optimizer = trained()
    manager = CheckpointManager(tmp_path / "root", every=1)
    for step in (1, 5):
        manager.maybe_save(step, model, optimizer, stateful={"h": Holder({"k": step})})
    CheckpointManager(tmp_path / "root", every=1).resume(model, optimizer)  # at step 5
    load_checkpoint(tmp_path / "root" / "step-1", model, optimizer)  # the roll-back
    manager.maybe_save(3, model, optimizer, stateful={"h": Holder({"k": 3})})
    assert latest_checkpoint(tmp_path / "root") == tmp_path / "root" / "step-3"
    holder = Holder()
    assert (
        CheckpointManager(tmp_path / "root", every=1).resume(
            model, optimizer, stateful={"h": holder}
        )
        == 3
    )
    assert holder.state == {"k": 3}


def test_error_messages_carry_no_terminal_control_bytes(tmp_path: Path) -> None:
    root = _root(tmp_path)
    _edit(
        root / "step-2", "checkpoint.json", lambda b: b.update(strategy=5, world_size="\x1b[2J\x07")
    )
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(root / "step-2", Small())
    assert "\x1b" not in str(refused.value) and "\x07" not in str(refused.value)
    done = subprocess.run(
        [sys.executable, "-m", "checkpoint_io", "inspect", str(root / "step-2")],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ},
    )  # fmt: skip
    assert done.returncode == 2 and "\x1b" not in done.stderr


def test_a_read_that_fails_midway_is_one_line_and_an_interrupt_stays_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP wraps what a read raises with every rank's traceback: the load says it in one
    line; a KeyboardInterrupt inside the read is raised as itself, not as damage."""
    from checkpoint_io import save_checkpoint
    from checkpoint_io._storage.files import CheckpointFiles

    model, optimizer = trained()
    save_checkpoint(tmp_path / "ck", model, optimizer)
    fresh, fresh_optimizer = Small(), torch.optim.AdamW(Small().parameters())
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    for raised, expected in (
        (OSError("the disk went away"), CheckpointError),
        (KeyboardInterrupt(), KeyboardInterrupt),
    ):

        def fail(*args: Any, raised: BaseException = raised, **kwargs: Any) -> None:
            raise raised

        monkeypatch.setattr(CheckpointFiles, "read_records", fail)
        with pytest.raises(expected) as info:
            load_checkpoint(tmp_path / "ck", fresh)
        if expected is CheckpointError:
            text = str(info.value)
            assert "\n" not in text and "(OSError: the disk went away)" in text, text
        assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    assert not fresh_optimizer.state


def test_a_failure_after_the_directory_is_made_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 makes the save's directory before the agreement: a failure collecting the
    manifest (before), or starting the background write (after), leaves no directory."""
    from checkpoint_io import _save as save
    from checkpoint_io import async_save_checkpoint, save_checkpoint
    from checkpoint_io._background import async_save

    model, optimizer = trained()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the manifest could not be built")

    monkeypatch.setattr(save, "new_manifest", broken)
    with pytest.raises(RuntimeError, match="the manifest could not be built"):
        save_checkpoint(tmp_path / "ck", model, optimizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setattr(async_save, "async_save_staged", broken)
    with pytest.raises(RuntimeError, match="the manifest could not be built"):
        async_save_checkpoint(tmp_path / "ck", model, optimizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
