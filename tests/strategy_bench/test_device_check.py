"""benchmarks/device_check.sh keeps to its time budget and records every step's outcome."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "device_check.sh"


def test_budget_is_kept_and_each_step_is_recorded(tmp_path: Path) -> None:
    """A 16 s budget (10 of them reserved for the summary): the tests step gets what the
    probe left, no time is left for the bench (skipped), and the script says so with exit
    code 1."""
    # This interpreter, not whichever python3 is first on PATH (a system one without torch
    # fails every step at once, and the budget is never spent).
    env = {**os.environ, "OUT": str(tmp_path), "DEVICE": "cpu", "BUDGET": "16"}
    env["PYTHON"] = sys.executable
    done = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert done.returncode == 1, done.stdout + done.stderr
    assert summary["budget_s"] == 16 and summary["device"] == "cpu"
    assert summary["total_s"] <= 16 + 2
    assert not summary["ok"]
    assert done.stdout.startswith("== plan: probe:"), done.stdout[:200]  # the plan comes first
    # The caps fit the default budget (400 s less the 10 s reserve): a healthy device ends ok.
    assert summary["planned_s"] == sum(summary["caps_s"].values()) <= 400 - 10
    names = [s["name"] for s in summary["steps"]]
    assert names == list(summary["caps_s"])
    assert names == [
        "probe",
        "tests",
        "fsdp_init_memory",
        "single_process",
        "device_paths",
        "bench",
        "estimate_agreement",
        "sweep",
    ]
    with tarfile.open(tmp_path / "logs.tar.gz") as logs:
        packed = {Path(name).name for name in logs.getnames()}
    for entry in summary["steps"]:
        assert entry["status"] in ("ok", "failed", "skipped", "partial")
        assert entry["seconds"] <= entry["limit_s"] + 6
        if entry["status"] != "skipped":
            assert entry["log"] == f"logs.tar.gz:{entry['name']}.log"
            assert f"{entry['name']}.log" in packed
    assert summary["steps"][-1]["status"] == "skipped"  # the budget was spent
    # What comes back from the device tool: at most 8 files, summary.json unpacked.
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
    assert all(p.parent == tmp_path for p in files)
    assert {"summary.json", "logs.tar.gz"} <= {p.name for p in files}


def test_a_step_whose_points_were_skipped_is_partial_not_ok(tmp_path: Path) -> None:
    """The bench's --time-budget skips points and exits 0: the summary said ok while points
    went unmeasured. Only the summary runs here (the steps' records given)."""
    text = SCRIPT.read_text()
    summary_code = text[text.index("<<'PY'\nimport json\nimport os") + 6 : text.rindex("\nPY\n")]
    work = tmp_path / "work"
    (work / "bench").mkdir(parents=True)
    (work / "bench" / "results.json").write_text(json.dumps({"skipped": [{"model": "medium"}]}))
    steps = work / "steps.tsv"
    steps.write_text("device_paths\t0\t12\t45\nbench\t0\t80\t95\n")
    done = subprocess.run(
        [sys.executable, "-", str(steps), str(tmp_path / "s.json"), "cuda", "400", "92",
         "device_paths:45 bench:95", str(work)],
        input=summary_code, capture_output=True, text=True, check=False,
    )  # fmt: skip
    summary = json.loads((tmp_path / "s.json").read_text())
    assert done.returncode == 1 and summary["ok"] is False
    assert [s["status"] for s in summary["steps"]] == ["ok", "partial"]
    assert summary["steps"][1]["skipped_points"] == 1


def test_the_bench_step_takes_one_checkpoint_sample() -> None:
    """Three fsynced checkpoint samples of `medium` per point (~38 GB of writes) put
    `medium fsdp` past the bench step's cap on a lent GPU (issue 51)."""
    text = SCRIPT.read_text()
    bench = text[text.index("step bench ") : text.index("step estimate_agreement")]
    assert "--ckpt-samples 1" in bench
