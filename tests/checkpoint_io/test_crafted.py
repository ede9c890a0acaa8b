"""Crafted format-4 checkpoints: each is refused by name, in bounded time and memory, and the
model, the optimizer, the stateful objects and the RNG are bit-identical afterwards.

The cases run in one child process (a hang or a blow-up fails the test, not the suite): a data
file's safetensors header, the index and the manifest rewritten as an attacker would (every
digest recomputed, so only the format's own rules can refuse them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dist_harness import fresh_interpreter

SUPPORT = str(Path(__file__).parents[1] / "_support")

CHILD = r"""
import json, os, resource, struct, sys, time
from pathlib import Path
import torch, xxhash
from checkpoint_io import CheckpointError, load_checkpoint, save_checkpoint
from checkpoint_models import Small, trained
from safe_store import record_digest

root = Path(sys.argv[1])
ENTRY = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


class Holder:
    def __init__(self, state=None):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


model, optimizer = trained()
base = save_checkpoint(root / "base", model, optimizer, step=1, stateful={"h": Holder({"k": 1})})


def rehash(path, name):
    manifest = json.loads((path / "checkpoint.json").read_text())
    data = (path / name).read_bytes()
    entry = manifest["files"].get(name)
    if entry is None:  # the manifest itself
        return
    entry.update(bytes=len(data), xxh3_128=xxhash.xxh3_128_hexdigest(data))
    if "records" in entry:
        length = struct.unpack("<Q", data[:8])[0]
        entry["records"][0] = [0, 8 + length, record_digest(data[: 8 + length])]
    (path / "checkpoint.json").write_text(json.dumps(manifest))


def header_case(change):
    def apply(path):
        file = path / "rank0.safetensors"
        raw = file.read_bytes()
        length = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8 : 8 + length])
        text, data = change(header, raw[8 + length :])
        text = text if isinstance(text, bytes) else json.dumps(text).encode()
        text += b" " * max(0, length - len(text))  # the same size: only the header's rules
        file.write_bytes(struct.pack("<Q", len(text)) + text + data)
        rehash(path, "rank0.safetensors")
    return apply


def first(header):
    return next(k for k in header if k != "__metadata__" and header[k]["data_offsets"][0] == 0)


def last(header):
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def shifted(header, data, by):
    entry = header[last(header)]
    entry["data_offsets"] = [o + by for o in entry["data_offsets"]]
    return header, data


def json_case(name, text):
    def apply(path):
        (path / name).write_bytes(text(path / name))
        rehash(path, name)
    return apply


def edited(name, change):
    def text(file):
        body = json.loads(file.read_text())
        change(body)
        return json.dumps(body).encode()
    return json_case(name, text)


def bumped(body):
    body["world_size"] = float("nan")


CASES = {
    "overlap": (header_case(lambda h, d: shifted(h, d, -4)), "overlap at the entry"),
    "gap": (header_case(lambda h, d: shifted(h, d[:-4] + b"\0" * 4, 4)), "a gap before the entry"),
    "trailing bytes": (header_case(lambda h, d: (h, d + b"\0" * 8)), "bytes past the last tensor"),
    "offsets past the end": (header_case(lambda h, d: shifted(h, d[:-8], 0)), "of a .*-byte data section"),
    "huge shape": (header_case(lambda h, d: ({**h, first(h): {**h[first(h)], "shape": [2**40, 2**30]}}, d)), "overflows 64 bits"),
    "100,000 dims": (header_case(lambda h, d: ({**h, first(h): {**h[first(h)], "shape": [1] * 100_000}}, d)), "100000 dims"),
    "unknown dtype": (header_case(lambda h, d: ({**h, first(h): {**h[first(h)], "dtype": "Q9"}}, d)), "unknown dtype 'Q9'"),
    "name not UTF-8": (header_case(lambda h, d: (json.dumps({**{k: v for k, v in h.items() if k != first(h)}, "\ud800": h[first(h)]}).encode(), d)), "not UTF-8"),
    "__metadata__ not a map": (header_case(lambda h, d: ({**h, "__metadata__": [1]}, d)), "not a mapping of strings"),
    "index nested 100,000 deep": (json_case("index.json", lambda f: b"[" * 100_000 + b"]" * 100_000), "not JSON|malformed"),
    "an integer of a million digits": (json_case("index.json", lambda f: f.read_bytes()[:-1] + b',"n":' + b"7" * 10**6 + b"}"), "an integer of 1000001 digits|an integer of 1000000 digits"),
    "index wrong types": (edited("index.json", lambda b: b["tensors"]["model.body.weight"].update(chunks="all")), "malformed"),
    "index duplicate keys": (json_case("index.json", lambda f: f.read_bytes()[:-1] + b',"paths":{}}'), "appears twice"),
    "manifest NaN count": (edited("checkpoint.json", bumped), "NaN is not JSON"),
    "manifest duplicate keys": (json_case("checkpoint.json", lambda f: f.read_bytes().rstrip()[:-1] + b',"step":3}'), "appears twice"),
}
CASES["manifest NaN count"] = (json_case("checkpoint.json", lambda f: f.read_bytes().replace(b'"world_size": 1', b'"world_size": NaN')), "NaN is not JSON")


def missing(path):
    (path / "rng" / "rank0.safetensors").unlink()


def planted(path):
    (path / "extra.safetensors").write_bytes((path / "rank0.safetensors").read_bytes())
    index = json.loads((path / "index.json").read_text())
    index["tensors"]["model.body.weight"]["chunks"][0]["file"] = "extra.safetensors"
    (path / "index.json").write_text(json.dumps(index))
    rehash(path, "index.json")


CASES["a missing file"] = (missing, "truncated or corrupt: rng/rank0.safetensors is missing")
CASES["a file not in the manifest"] = (planted, "'extra.safetensors', which the manifest did not record")

import shutil

fresh = Small()
fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
fresh(torch.randn(3, 4)).sum().backward()
fresh_opt.step()
holder = Holder({"k": 0})
weights = {k: v.clone() for k, v in fresh.state_dict().items()}
moments = {k: v.clone() for k, v in fresh_opt.state[fresh.body.weight].items()}
rng = torch.get_rng_state()
start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for label, (craft, expected) in CASES.items():
    case = root / label.replace(" ", "_").replace(",", "")
    shutil.copytree(base, case)
    craft(case)
    began = time.perf_counter()
    try:
        load_checkpoint(case, fresh, fresh_opt, stateful={"h": holder})
        outcome = "loaded"
    except CheckpointError as error:
        outcome = str(error)
    took = time.perf_counter() - began
    unchanged = (
        all(torch.equal(v, weights[k]) for k, v in fresh.state_dict().items())
        and all(torch.equal(v, moments[k]) for k, v in fresh_opt.state[fresh.body.weight].items())
        and holder.state == {"k": 0}
        and torch.equal(torch.get_rng_state(), rng)
    )
    print(json.dumps({"case": label, "expected": expected, "outcome": outcome[:400],
                      "seconds": took, "unchanged": unchanged}))
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start_rss
print(json.dumps({"grown_kib": grown}))
"""


def test_crafted_checkpoints_are_refused_by_name_and_change_nothing(tmp_path: Path) -> None:
    import re

    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = fresh_interpreter(
        f"import runpy, sys; sys.argv = ['child', {str(tmp_path)!r}]; "
        f"runpy.run_path({str(script)!r}, run_name='__main__')",
        timeout=300,
        env={"PYTHONPATH": os.pathsep.join([SUPPORT, os.environ.get("PYTHONPATH", "")])},
    )
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    *cases, memory = lines
    assert len(cases) == 17, cases
    for case in cases:
        assert re.search(case["expected"], case["outcome"]), case
        assert case["unchanged"], case
        assert case["seconds"] < 30, case  # a bound on a crafted input, not a speed target
    assert memory["grown_kib"] < 512 * 1024, memory  # no allocation follows a claim
