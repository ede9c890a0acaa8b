"""hf-io: safetensors in and out, ties and integer buffers, refusals, crafted headers."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dist_harness import run_ranks
from hf_io import export_tensors, load_pretrained, save_pretrained
from hf_io_workers import TiedNet, torch_wrapped


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_round_trip_keeps_ties_integer_buffers_and_leaves_out_non_persistent(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    source = TiedNet()
    out = save_pretrained(source, tmp_path / "out")
    stored = load_file(out / "model.safetensors")
    assert sorted(stored) == ["body.bias", "body.weight", "counts", "embed.weight"]  # tie once
    assert stored["counts"].dtype == torch.int64 and torch.equal(stored["counts"], source.counts)
    target = TiedNet()
    target.counts.zero_()
    info = load_pretrained(target, out)
    assert _same(_state(target), _state(source))
    assert target.head.weight is target.embed.weight
    assert info.tied == (("embed.weight", "head.weight"),) and not info.missing
    assert info.bytes_read == sum(t.numel() * t.element_size() for t in stored.values())


def test_values_are_cast_to_the_parameter_dtype(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = TiedNet()
    save_pretrained(source, tmp_path / "out")
    target = TiedNet().to(torch.bfloat16)
    target.counts = source.counts.clone()  # integer: stays int64
    load_pretrained(target, tmp_path / "out")
    assert torch.equal(target.body.weight, source.body.weight.to(torch.bfloat16))


def test_key_map_both_ways(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = TiedNet()
    save_pretrained(source, tmp_path / "out", key_map=lambda name: "model." + name)
    assert "model.embed.weight" in load_file(tmp_path / "out" / "model.safetensors")
    target = TiedNet()
    load_pretrained(target, tmp_path / "out", key_map=lambda name: name.removeprefix("model."))
    assert _same(_state(target), _state(source))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.pop("body.bias"), r"missing from the file: 'body.bias'"),
        (lambda s: s.update(extra=torch.zeros(2)), r"not in the model: 'extra'"),
        (lambda s: s.update({"body.weight": torch.zeros(6, 5)}), r"shape \(6, 5\) is not"),
        (lambda s: s.update(counts=s["counts"].int()), r"I32 for the model's torch.int64"),
        (lambda s: s.update({"body.weight": s["body.weight"].int()}), r"holds I32 for the model's"),
    ],
)
def test_a_mismatch_is_one_error_and_the_model_is_unchanged(
    tmp_path: Path, change: object, message: str
) -> None:
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in TiedNet().state_dict().items() if k != "head.weight"}
    change(state)  # type: ignore[operator]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    target = TiedNet()
    before = _state(target)
    with pytest.raises(ValueError, match=message) as raised:
        load_pretrained(target, tmp_path)
    assert "the model is unchanged" in str(raised.value) and "\n" not in str(raised.value)
    assert _same(_state(target), before)


def test_not_strict_lists_what_it_left(tmp_path: Path) -> None:
    state = {k: v for k, v in TiedNet().state_dict().items() if k not in ("head.weight", "counts")}
    state["extra"] = torch.ones(1)
    save_file(state, tmp_path / "model.safetensors")
    target = TiedNet()
    counts = target.counts.clone()
    info = load_pretrained(target, tmp_path, strict=False)
    assert info.missing == ("counts",) and info.unexpected == ("extra",)
    assert torch.equal(target.counts, counts)


def _crafted(
    path: Path, header: object, data: bytes = b"\0" * 8, length: int | None = None
) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


ENTRY = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("header", "kwargs", "message"),
    [
        ({"a": ENTRY}, {"length": 2**62}, "claims 4611686018427387904 bytes"),
        ([1, 2], {}, "JSON list, not an object"),
        ({"a": {**ENTRY, "dtype": "X99"}}, {}, "unknown dtype"),
        ({"a": {**ENTRY, "shape": [-2]}}, {}, "the dim -2, not an int >= 0"),
        ({"a": {**ENTRY, "data_offsets": [0, 10**12]}}, {}, "spans bytes"),
        ({"a": {**ENTRY, "shape": [3]}}, {}, "spans bytes \\[0, 8\\), but F32 x \\(3,\\) is 12"),
        (
            {"a": ENTRY, "b": {**ENTRY, "data_offsets": [4, 12]}},
            {"data": b"\0" * 16},
            "an overlap at the entry 'b'",
        ),
        ({"a": {**ENTRY, "data_offsets": [0, 8, 9]}}, {}, "not two u64"),
    ],
)
def test_a_crafted_header_is_one_line_naming_the_file(
    tmp_path: Path, header: object, kwargs: dict[str, int], message: str
) -> None:
    file = tmp_path / "bad.safetensors"
    _crafted(file, header, **kwargs)  # type: ignore[arg-type]
    model = torch.nn.Linear(2, 1)
    before = _state(model)
    with pytest.raises(ValueError, match=message) as raised:
        load_pretrained(model, file)
    assert str(file) in str(raised.value) and "\n" not in str(raised.value)
    assert _same(_state(model), before)


def test_fifos_links_and_names_outside_are_refused_without_hanging(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model.safetensors")  # opened non-blocking, refused: no hang
    with pytest.raises(ValueError, match="not a regular file \\(a FIFO\\)"):
        load_pretrained(TiedNet(), tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    save_pretrained(TiedNet(), outside / "real")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "model.safetensors").symlink_to(outside / "real" / "model.safetensors")
    with pytest.raises(ValueError, match="symbolic link"):
        load_pretrained(TiedNet(), linked)
    fake_cache = tmp_path / "models--a--b" / "snapshots" / "0123"
    fake_cache.mkdir(parents=True)  # a snapshot's link, but to a file outside its blobs/
    (fake_cache / "model.safetensors").symlink_to(outside / "real" / "model.safetensors")
    with pytest.raises(ValueError, match="symbolic link"):
        load_pretrained(TiedNet(), fake_cache)
    indexed = tmp_path / "indexed"
    indexed.mkdir()
    weight_map = {"embed.weight": "../outside/real/model.safetensors"}
    (indexed / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match="not a file name inside"):
        load_pretrained(TiedNet(), indexed)


def test_save_refuses_an_existing_directory_and_leaves_nothing_half_written(tmp_path: Path) -> None:
    out = tmp_path / "out"
    save_pretrained(TiedNet(), out)
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_pretrained(TiedNet(), out)
    assert (out / "model.safetensors").read_bytes() == before
    torch.manual_seed(5)
    replacement = TiedNet()
    save_pretrained(replacement, out, overwrite=True)
    assert torch.equal(load_file(out / "model.safetensors")["body.bias"], replacement.body.bias)
    complex_model = TiedNet()
    complex_model.register_buffer("phase", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="safetensors cannot store"):
        save_pretrained(complex_model, tmp_path / "complex")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging left behind


def test_sharded_output_and_export_tensors(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TiedNet(vocab=64, width=16)
    live = save_pretrained(model, tmp_path / "live", max_shard_size="2KB")
    index = json.loads((live / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for k, t in model.state_dict().items() if k != "head.weight"
    )
    assert len(set(index["weight_map"].values())) > 1
    state = model.state_dict()
    tensors = {k: (v.dtype, tuple(v.shape)) for k, v in state.items()}
    offline = export_tensors(
        tensors,
        lambda name: state[name],
        tmp_path / "offline",
        tied=[["embed.weight", "head.weight"]],
        max_shard_size="2KB",
    )
    files = sorted(p.name for p in live.iterdir())
    assert files == sorted(p.name for p in offline.iterdir())
    for name in files:  # the same bytes, one tensor read at a time
        assert (live / name).read_bytes() == (offline / name).read_bytes(), name


@pytest.mark.multiprocess
@pytest.mark.parametrize(("kind", "ranks"), [("fsdp", 2), ("ddp", 2), ("hsdp", 4)])
def test_torch_fully_shard_ddp_and_hsdp_load_and_save_their_parts(
    tmp_path: Path, kind: str, ranks: int
) -> None:
    """Each rank starts from other values; the file's values land on every rank, the tie holds,
    and the trained model written by every rank's part equals the gathered one."""
    torch.manual_seed(0)
    source = TiedNet()
    save_pretrained(source, tmp_path / "original")
    run_ranks(torch_wrapped, str(tmp_path), kind, world_size=ranks)
    result = torch.load(tmp_path / f"{kind}.pt", weights_only=True)
    assert _same(result["loaded"], _state(source))
    written = load_file(tmp_path / f"trained-{kind}" / "model.safetensors")
    for name, value in written.items():
        assert torch.equal(value, result["trained"][name]), name
    if kind != "ddp":  # each rank read its rows of the sharded tensors, not the whole file
        assert result["read"] < sum(t.numel() * t.element_size() for t in written.values())


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda m, d: save_pretrained(m, d, max_shard_size="5 parsecs"), ValueError, "'5 parsecs'"),
        (lambda m, d: save_pretrained(m, d, max_shard_size=0), ValueError, "must be positive"),
        (lambda m, d: save_pretrained(m, d, key_map=3), TypeError, "key_map must be a mapping"),
        (
            lambda m, d: save_pretrained(m, d, key_map={"body.bias": "body.weight"}),
            ValueError,
            "maps both 'body.weight' and 'body.bias' to 'body.weight'",
        ),
        (
            lambda m, d: save_pretrained(m, d, overwrite="yes"),
            TypeError,
            "overwrite must be a bool",
        ),
        (lambda m, d: load_pretrained(m, d, strict=1), TypeError, "strict must be a bool, got int"),
        (lambda m, d: load_pretrained(m, d / "nowhere"), FileNotFoundError, "does not exist"),
    ],
)
def test_bad_arguments_are_named_and_nothing_is_written(
    tmp_path: Path, call: object, error: type[Exception], message: str
) -> None:
    model = TiedNet()
    before = _state(model)
    save_pretrained(model, tmp_path / "ok")
    listed = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(error, match=message):
        call(model, tmp_path)  # type: ignore[operator]
    assert _same(_state(model), before)
    assert sorted(p.name for p in tmp_path.iterdir()) == listed  # nothing staged or left


def _tamper(file: Path, change: object) -> None:
    """Rewrite ``file``'s header (and data) with ``change(header, data) -> (header, data)``."""
    raw = file.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header, data = change(json.loads(raw[8 : 8 + length]), raw[8 + length :])  # type: ignore[operator]
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _last_entry(header: dict[str, object]) -> str:
    entries = [k for k in header if k != "__metadata__"]
    return max(entries, key=lambda k: header[k]["data_offsets"])  # type: ignore[index]


def _gap(header: dict[str, object], data: bytes) -> tuple[object, bytes]:
    last = header[_last_entry(header)]
    begin, end = last["data_offsets"]  # type: ignore[index]
    last["data_offsets"] = [begin + 4, end + 4]  # type: ignore[index]
    return header, data[:begin] + b"\0" * 4 + data[begin:]


def _zero_inside(header: dict[str, object], data: bytes) -> tuple[object, bytes]:
    header["z"] = {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}
    return header, data


def _renamed(header: dict[str, object], new: str) -> dict[str, object]:
    last = _last_entry(header)
    return {new if k == last else k: v for k, v in header.items()}


def _dims(header: dict[str, object], shape: list[int]) -> dict[str, object]:
    header[_last_entry(header)]["shape"] = shape  # type: ignore[index]
    return header


RED_TEAM = {
    "trailing bytes": (lambda h, d: (h, d + b"\0" * 4), "bytes past the last tensor"),
    "a 4-byte gap": (_gap, "a gap before the entry"),
    "a zero-size entry inside another": (_zero_inside, "an overlap at the entry 'z'"),
    "a lone-surrogate name": (
        lambda h, d: (json.dumps(_renamed(h, "\ud800")).encode(), d),
        "a name that is not UTF-8",
    ),
    "dims overflowing u64": (
        lambda h, d: (_dims(h, [2**64, 0]), d),
        "the dim 18446744073709551616",
    ),
    "a product overflowing u64": (
        lambda h, d: (_dims(h, [2**32, 2**32, 0]), d),
        "whose size overflows 64 bits",
    ),
    "__metadata__ []": (lambda h, d: ({**h, "__metadata__": []}, d), "not a mapping of strings"),
    "__metadata__ 0": (lambda h, d: ({**h, "__metadata__": 0}, d), "not a mapping of strings"),
    "100,000 dims": (lambda h, d: (_dims(h, [10**18 + 7] * 99_999 + [0]), d), "100000 dims"),
    "a duplicate key": (
        lambda h, d: (json.dumps(h).encode()[:-1] + b', "__metadata__": {}}', d),
        "holds the key '__metadata__' twice",
    ),
    "JSON nested 100,000 deep": (
        lambda h, d: (b"[" * 100_000 + b"]" * 100_000, d),
        "is not JSON|JSON list",
    ),
    "an integer of a million digits": (
        lambda h, d: (json.dumps(h).encode()[:-1] + b', "n": ' + b"7" * 10**6 + b"}", d),
        "an integer of 1000000 digits",
    ),
    "NaN where a count belongs": (
        lambda h, d: (json.dumps(_dims(h, [float("nan")])).encode(), d),
        "holds NaN, which is not JSON",
    ),
    "an unknown dtype": (
        lambda h, d: ({**h, _last_entry(h): {**h[_last_entry(h)], "dtype": "Q7"}}, d),
        "unknown dtype 'Q7'",
    ),
}


@pytest.mark.parametrize("case", sorted(RED_TEAM))
def test_a_bad_last_shard_changes_nothing(tmp_path: Path, case: str) -> None:
    """Each header safetensors itself refuses is refused before any parameter changes, in the
    last of several shards (4 of 6 parameters had changed before the raw SafetensorError);
    100,000 dims are refused at once (30-48 s before: the cost grew with their square)."""
    change, message = RED_TEAM[case]
    torch.manual_seed(0)
    out = save_pretrained(TiedNet(vocab=64, width=16), tmp_path / "out", max_shard_size="2KB")
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1
    _tamper(shards[-1], change)
    torch.manual_seed(1)
    target = TiedNet(vocab=64, width=16)
    before = _state(target)
    with pytest.raises(ValueError, match=message) as raised:
        load_pretrained(target, out, strict=False)
    assert str(shards[-1]) in str(raised.value) and "\n" not in str(raised.value)
    assert _same(_state(target), before)


def test_every_header_accepted_here_is_one_safetensors_reads(tmp_path: Path) -> None:
    """The rules are safetensors' own: what it refuses is refused (above); a valid file with a
    zero-size tensor at its end, JSON padding and a null __metadata__ reads in both."""
    from safetensors import safe_open

    from safe_store import read_header

    file = tmp_path / "ok.safetensors"
    header = {
        "__metadata__": None,
        "a": ENTRY,
        "z": {"dtype": "F32", "shape": [0, 3], "data_offsets": [8, 8]},
    }
    text = json.dumps(header).encode() + b"   "
    file.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 8)
    assert sorted(read_header(file).entries) == ["a", "z"]
    with safe_open(file, framework="pt") as opened:
        assert sorted(opened.keys()) == ["a", "z"]


def test_a_hub_cache_snapshot_loads(tmp_path: Path) -> None:
    """Every file of a hub cache snapshot is a link into ../../blobs: followed there (and only
    there), so the weights and --config-from read from the cache."""
    torch.manual_seed(0)
    source = TiedNet()
    saved = save_pretrained(source, tmp_path / "saved", max_shard_size="1KB")
    (saved / "config.json").write_text('{"model_type": "tied"}')
    repo = tmp_path / "hub" / "models--org--tied"
    snapshot = repo / "snapshots" / "4b825dc642cb6eb9a060e54bf8d69288fbee4904"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for number, file in enumerate(sorted(saved.iterdir())):
        blob = repo / "blobs" / f"{number:064x}"
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    target = TiedNet()
    load_pretrained(target, snapshot)
    assert _same(_state(target), _state(source))
    state = source.state_dict()
    exported = export_tensors(
        {k: (v.dtype, tuple(v.shape)) for k, v in state.items()},
        state.__getitem__,
        tmp_path / "exp",
        tied=[["embed.weight", "head.weight"]],
        config_from=snapshot,
    )
    assert (exported / "config.json").read_text() == '{"model_type": "tied"}'


def test_overwrite_replaces_only_what_save_pretrained_writes(tmp_path: Path) -> None:
    """A run directory with step-100/ and a log: overwrite=True deleted it whole; now only the
    earlier output's files are replaced (stale shards removed), as transformers does."""
    run = tmp_path / "run"
    (run / "step-100").mkdir(parents=True)
    (run / "step-100" / "checkpoint.json").write_text("{}")
    (run / "train.log").write_text("step 100")
    save_pretrained(TiedNet(vocab=64, width=16), run, max_shard_size="1KB", overwrite=True)
    assert len(list(run.glob("model-*-of-*.safetensors"))) > 1
    torch.manual_seed(3)
    replacement = TiedNet()
    save_pretrained(replacement, run, overwrite=True)  # one file now: the shards are stale
    assert sorted(p.name for p in run.iterdir()) == ["model.safetensors", "step-100", "train.log"]
    assert (run / "step-100" / "checkpoint.json").read_text() == "{}"
    target = TiedNet()
    load_pretrained(target, run)
    assert _same(_state(target), _state(replacement))


def test_a_tie_stored_twice_with_different_values_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in TiedNet().state_dict().items()}
    state["head.weight"] = state["embed.weight"] + 1  # the tie, stored twice, not equal
    save_file(state, tmp_path / "model.safetensors")
    target = TiedNet()
    before = _state(target)
    with pytest.raises(ValueError, match="holds the two with different values"):
        load_pretrained(target, tmp_path)
    assert _same(_state(target), before)
    state["head.weight"] = state["embed.weight"].clone()  # stored twice, equal: loads
    save_file(state, tmp_path / "model.safetensors")
    load_pretrained(target, tmp_path)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda m, d: save_pretrained(m, d / "o", key_map={"body.bias": "__metadata__"}),
            ValueError,
            "the key safetensors reserves",
        ),
        (lambda m, d: save_pretrained(m, "/"), ValueError, "out_dir='/' is the filesystem root"),
        (lambda m, d: save_pretrained(m, ""), ValueError, "out_dir is empty"),
    ],
)
def test_output_names_that_no_reader_opens_are_refused(
    tmp_path: Path, call: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        call(TiedNet(), tmp_path)  # type: ignore[operator]
    assert list(tmp_path.iterdir()) == []


def test_out_dir_dot_is_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``out_dir='.'`` had no test: it is the working directory, refused by name while it
    exists and overwrite is false, and written into (its other files kept) with overwrite."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text("step 1\n")
    monkeypatch.chdir(run)
    model = TiedNet()
    where = re.escape(repr(os.getcwd()))
    with pytest.raises(FileExistsError, match=rf"^out_dir {where} already exists; pass overwrite"):
        save_pretrained(model, ".")
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no staging directory left
    assert [p.name for p in run.iterdir()] == ["train.log"]
    assert save_pretrained(model, ".", overwrite=True) == Path(os.getcwd())
    assert sorted(p.name for p in run.iterdir()) == ["model.safetensors", "train.log"]
    assert [p.name for p in tmp_path.iterdir()] == ["run"]
    assert (run / "train.log").read_text() == "step 1\n"
    target = TiedNet()
    load_pretrained(target, ".")
    assert _same(_state(target), _state(model))
