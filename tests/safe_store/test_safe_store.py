"""safe-store: the JSON codec, the streaming safetensors writer, the header rules, publish."""

from __future__ import annotations

import collections
import json
import math
import struct
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors import safe_open

from safe_store import (
    MAX_ENTRIES,
    MAX_HEADER_BYTES,
    StreamWriter,
    begin,
    dumps,
    header_of,
    loads,
    output_dir,
    publish,
    read_header,
    record_digest,
    tensor_of,
)


def test_the_codec_carries_what_json_lacks_and_nothing_else() -> None:
    stored: dict[str, torch.Tensor] = {}

    def keep(tensor: torch.Tensor) -> str:
        stored[f"t{len(stored)}"] = tensor
        return f"t{len(stored) - 1}"

    value = {
        "tuple": (1, 2.5, None),
        3: b"\x00\xff",
        "$dollar": [None, True],
        "ordered": collections.OrderedDict([("b", 1), ("a", 2)]),
        "nan": [math.nan, math.inf, -math.inf],
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "tensor": torch.arange(3),
    }
    back = loads(dumps(value, what="v", tensors=keep), what="v", tensors=stored.__getitem__)
    assert back["tuple"] == (1, 2.5, None) and back[3] == b"\x00\xff"
    assert back["$dollar"] == [None, True] and type(back["ordered"]) is collections.OrderedDict
    assert list(back["ordered"]) == ["b", "a"] and math.isnan(back["nan"][0])
    assert back["nan"][1:] == [math.inf, -math.inf] and back["dtype"] is torch.bfloat16
    assert back["device"] == torch.device("cpu") and torch.equal(back["tensor"], torch.arange(3))
    for bad, where in (
        (bytearray(b"x"), "bytearray"),
        (object(), "object"),
        (torch.ones(1), "Tensor"),
    ):
        with pytest.raises(TypeError, match=f"v\\[0\\] holds a .*{where}"):
            dumps([bad], what="v")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[" * 100_000 + "]" * 100_000, "not JSON|deeper"),
        ('{"n": ' + "7" * 100 + "}", "an integer of 100 digits"),
        ('{"a": 1, "a": 2}', "the key 'a' appears twice"),
        ('{"a": NaN}', "NaN is not JSON"),
        ('{"$evil": 1}', "an unknown or malformed tag"),
        ('{"$tensor": "t0"}', "an unknown or malformed tag"),  # no tensors given
        ('{"$tuple": [1], "x": 2}', "a tag .* among other keys"),
    ],
)
def test_untrusted_json_is_refused_by_name(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        loads(text, what="the value")


def test_the_writer_streams_a_file_safetensors_reads(tmp_path: Path) -> None:
    tensors = {
        "a": torch.randn(3, 4),
        "b": torch.arange(5),
        "c": torch.tensor(2.0, dtype=torch.bfloat16),
        "empty": torch.empty(0, 2),
    }
    file = tmp_path / "x.safetensors"
    writer = StreamWriter(
        file, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], {"k": "v"}
    )
    with pytest.raises(ValueError, match="written out of order"):
        writer.write("b", tensors["b"])
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    entry = writer.close()
    data = file.read_bytes()
    assert entry["bytes"] == len(data) and entry["xxh3_128"] == xxhash.xxh3_128_hexdigest(data)
    head = 8 + struct.unpack("<Q", data[:8])[0]
    assert head % 8 == 0 and entry["records"][0] == [0, head, record_digest(data[:head])]
    for offset, length, digest in entry["records"]:
        assert record_digest(data[offset : offset + length]) == digest
    with safe_open(file, framework="pt") as opened:
        assert opened.metadata() == {"k": "v"}
        for name, tensor in tensors.items():
            assert torch.equal(opened.get_tensor(name), tensor)
    header = header_of(data, file)
    assert torch.equal(tensor_of(data, header.entries["a"]), tensors["a"])
    assert read_header(file).entries.keys() == tensors.keys()


def test_a_writer_that_is_not_finished_says_so(tmp_path: Path) -> None:
    writer = StreamWriter(tmp_path / "x.safetensors", [("a", torch.float32, (2,))], {})
    with pytest.raises(ValueError, match="8 planned bytes were not written"):
        writer.close()


def test_a_header_is_checked_by_safetensors_rules(tmp_path: Path) -> None:
    file = tmp_path / "x.safetensors"
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    for table, data, message in (
        ({"a": entry}, b"\0" * 12, "bytes past the last tensor"),
        ({"a": {**entry, "data_offsets": [4, 12]}}, b"\0" * 12, "a gap before"),
        ({"a": entry, "b": {**entry, "data_offsets": [4, 12]}}, b"\0" * 12, "an overlap at"),
    ):
        text = json.dumps(table).encode()
        file.write_bytes(struct.pack("<Q", len(text)) + text + data)
        with pytest.raises(ValueError, match=message):
            read_header(file)


def _zero_size_entries(names: list[bytes]) -> bytes:
    entry = b'{"dtype":"U8","shape":[0],"data_offsets":[0,0]}'
    return b"{" + b",".join(b'"%s":%s' % (name, entry) for name in names) + b"}"


def test_a_header_of_more_entries_than_the_cap_is_refused_before_it_is_parsed() -> None:
    """1.48 M zero-size entries (a 94 MB header) were parsed and accepted in about 16 s and
    1-2 GB; one past MAX_ENTRIES took 12 s. Now they are counted in the raw bytes first."""
    over = MAX_ENTRIES + 1
    text = _zero_size_entries([b"%d" % i for i in range(over)])
    assert len(text) < MAX_HEADER_BYTES  # within safetensors' own cap on the length
    data = struct.pack("<Q", len(text)) + text
    with pytest.raises(ValueError, match=r"crafted\.safetensors is not a valid") as refused:
        header_of(data, Path("crafted.safetensors"))
    assert f"more than the cap MAX_ENTRIES = {MAX_ENTRIES} entries ({over} counted" in str(
        refused.value
    )


def test_braces_inside_names_and_metadata_are_not_counted_as_entries() -> None:
    """Only objects outside strings are counted: a stateful object's tagged JSON in
    ``__metadata__`` (a million dicts, its quotes escaped) or a name of braces is no entry."""
    name = "{" * 10 + '"\\'
    state = json.dumps([{"i": i} for i in range(MAX_ENTRIES + 1)])
    table = {
        name: {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]},
        "__metadata__": {"state": state},
    }
    text = json.dumps(table).encode()
    assert text.count(b"{") > MAX_ENTRIES + 2
    header = header_of(struct.pack("<Q", len(text)) + text, Path("braces.safetensors"))
    assert list(header.entries) == [name] and header.metadata == {"state": state}


def test_publish_is_one_rename_or_replaces_only_its_own_files(tmp_path: Path) -> None:
    out = output_dir(tmp_path / "out")
    partial = begin(out)
    (partial / "model.safetensors").write_text("new")
    publish(partial, out, stale=lambda name: name.startswith("model"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    (out / "model-00001-of-00002.safetensors").write_text("stale")
    (out / "notes.txt").write_text("mine")
    partial = begin(out)
    (partial / "model.safetensors").write_text("newer")
    publish(partial, out, stale=lambda name: name.startswith("model"))
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "notes.txt"]
    assert (out / "model.safetensors").read_text() == "newer"
    with pytest.raises(ValueError, match="is the filesystem root"):
        output_dir("/")
