"""torchft's replica groups on the real lighthouse (``torchft_lighthouse``, started and stopped here).

Three DDP replica groups of one rank each, each its own process and job: one is SIGKILLed at a
step, the others keep committing without a restart, the group is started again, heals from a
live peer and ends bit-identical to them; the weights equal one process trained on the samples
the groups committed (the loss a mean over the samples that count in the live groups, through
``global_count`` and ``count_mean``), and the samples lost while the group was down are the
ones its record names.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

SUPPORT = Path(__file__).parents[1] / "_support"
WORKER = SUPPORT / "ft_worker.py"
DIE_AT = 6
# float32 replay of ~20 AdamW steps: the groups sum 3 gradients over gloo and divide, the
# reference takes one mean over the 12 samples; measured differences are ~1e-7.
REFERENCE_BOUND = 1e-5


# A dead group is dropped after 1 s without a heartbeat; a quorum waits 200 ms for stragglers.
_FAST = ("--join_timeout_ms", "200", "--quorum_tick_ms", "50", "--heartbeat_timeout_ms", "1000")


@pytest.fixture(scope="module")
def lighthouse(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real lighthouse as its own process, ``localhost:PORT``; stopped by its PID."""
    folder = tmp_path_factory.mktemp("lighthouse")
    executable = Path(sys.executable).parent / "torchft_lighthouse"
    with open(folder / "stderr", "wb") as err:
        process = subprocess.Popen(
            [str(executable), "--bind", "[::]:0", "--min_replicas", "1", *_FAST],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        found = _wait(
            lambda: re.search(r"listening on: http://\S+:(\d+)", _text(folder / "stderr")),
            "the lighthouse's address",
            process,
        )
        yield f"localhost:{found.group(1)}"
    finally:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _wait(
    condition: Callable[[], Any],
    what: str,
    process: subprocess.Popen[bytes] | None = None,
    deadline_s: float = 90,
) -> Any:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        found = condition()
        if found:
            return found
        if process is not None and process.poll() is not None:
            raise AssertionError(f"waiting for {what}: the process exited ({process.returncode})")
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {deadline_s} s")


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in _text(path).splitlines() if line.strip()]


def _steps(path: Path) -> list[dict[str, Any]]:
    return [line for line in _lines(path) if "digest" in line]


@pytest.mark.multiprocess
def test_a_killed_group_stops_nobody_heals_and_matches(
    lighthouse: str, tmp_path: Path, process_group: None
) -> None:
    finish = tmp_path / "finish"
    processes: list[subprocess.Popen[bytes]] = []
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]),
    }

    def start(replica: int, log: str, *extra: str) -> subprocess.Popen[bytes]:
        args = [sys.executable, str(WORKER), lighthouse, str(replica), "3"]
        out = open(tmp_path / f"{log}.out", "wb")  # noqa: SIM115 (closed with the process)
        process = subprocess.Popen(
            [*args, str(tmp_path / f"{log}.log"), str(finish), *extra],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
        out.close()
        processes.append(process)
        return process

    try:
        groups = [start(0, "g0"), start(1, "g1"), start(2, "g2", str(DIE_AT))]
        _wait(lambda: groups[2].poll() is not None, "group 2's death", deadline_s=120)
        assert groups[2].returncode == -signal.SIGKILL, _text(tmp_path / "g2.out")[-3000:]
        # The survivors commit on their own, with no restart.
        _wait(
            lambda: (
                sum(s["committed"] and s["participants"] == 2 for s in _steps(tmp_path / "g0.log"))
                >= 3
            ),
            "steps committed by the two survivors",
            groups[0],
        )
        restarted_at = time.time()
        restarted = start(2, "g2b")
        _wait(
            lambda: any(s["participants"] == 3 for s in _steps(tmp_path / "g2b.log")),
            "a step of the healed group",
            restarted,
        )
        last = max(s["step"] for s in _steps(tmp_path / "g0.log"))
        finish.write_text(str(last + 4))
        for process in (groups[0], groups[1], restarted):
            process.wait(timeout=60)
            assert process.returncode == 0, _text(tmp_path / "g0.out")[-3000:]
    finally:
        for process in processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()

    logs = {name: _lines(tmp_path / f"{name}.log") for name in ("g0", "g1", "g2", "g2b")}
    finals = {name: log[-1] for name, log in logs.items() if name != "g2"}
    # Healed: the three groups end bit for bit the same, at the same step.
    assert len({f["final"] for f in finals.values()}) == 1, finals
    assert len({f["step"] for f in finals.values()}) == 1
    # The killed group died at DIE_AT; the restarted one joined later, at the others' step
    # (it received their state: it did not start again from step 0).
    assert max(s["step"] for s in _steps(tmp_path / "g2.log")) == DIE_AT
    healed_first = _steps(tmp_path / "g2b.log")[0]["step"]
    assert healed_first > DIE_AT + 3

    # The record: which groups trained each committed step (every group logs its own).
    trained: dict[int, set[int]] = {}
    for name in ("g0", "g1", "g2", "g2b"):
        for s in _steps(tmp_path / f"{name}.log"):
            if s["committed"]:
                trained.setdefault(s["step"], set()).add(s["replica"])
    for s in _steps(tmp_path / "g0.log"):
        if s["committed"]:
            assert len(trained[s["step"]]) == s["participants"], s  # the record is complete
    # Group 2's samples lost while it was down: every step the others committed without it.
    lost = sorted(step for step, groups_ in trained.items() if 2 not in groups_ and step > DIE_AT)
    assert lost == list(range(DIE_AT + 1, healed_first))

    # One process over the committed samples reaches the same weights.
    reference = _replay(trained)
    worst = max(
        (torch.tensor(value) - reference[key]).abs().max().item()
        for key, value in finals["g0"]["weights"].items()
    )
    assert worst <= REFERENCE_BOUND, worst
    heal_s = _steps(tmp_path / "g2b.log")[0]["t"] - restarted_at
    sys.stdout.write(
        f"fault tolerance: restart to first committed step {heal_s:.1f} s, "
        f"{len(lost)} steps lost, weights within {worst:.2e} of the replay\n"
    )


def _replay(trained: dict[int, set[int]]) -> dict[str, torch.Tensor]:
    """The committed steps in one process: each step's batches of the groups that trained it."""
    sys.path.insert(0, str(SUPPORT))
    try:
        from ft_worker import WIDTH, Gated, batch, loss_sum, uses_aux
        from replica_init import build_replicated_model
    finally:
        sys.path.remove(str(SUPPORT))
    model = build_replicated_model(
        Gated, {"width": WIDTH}, device="cpu", default_dtype=torch.float32, seed=0
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in sorted(trained):
        parts = {replica: batch(replica, step) for replica in sorted(trained[step])}
        total = sum(loss_sum(model, *p, uses_aux(replica, step)) for replica, p in parts.items())
        count = sum(float(p[2].sum()) for p in parts.values())
        optimizer.zero_grad()
        (total / count).backward()  # over the samples that count
        for param in model.parameters():  # what no group used: zeros, as under the groups
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _config(lighthouse: str, strategy: str = "ddp") -> dict[str, Any]:
    section = {"lighthouse": lighthouse, "replica_id": 0, "replica_groups": 2}
    return {"strategy": strategy, "fault_tolerance": {**section, "connect_timeout_s": 1}}


def _prepare(config: dict[str, Any], built: list[int]) -> None:
    from distributed_strategy import prepare_model
    from toy_models import Regressor

    def factory() -> torch.nn.Module:
        built.append(1)
        return Regressor()

    prepare_model(factory, None, config=config, device="cpu", default_dtype=torch.float32, seed=0)


def test_an_unreachable_lighthouse_is_named_before_anything_is_built(process_group: None) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    built: list[int] = []
    started = time.monotonic()
    with pytest.raises(ConnectionError) as info:
        _prepare(_config(f"127.0.0.1:{port}"), built)
    assert time.monotonic() - started < 30  # refused, or at most the connect timeout
    text = str(info.value)
    assert f"lighthouse at http://127.0.0.1:{port}" in text
    assert "connect_timeout_s=1" in text and "torchft_lighthouse --bind" in text
    assert not built


def test_fault_tolerance_beyond_ddp_is_refused_before_anything_is_built(
    process_group: None,
) -> None:
    built: list[int] = []
    with pytest.raises(ValueError, match="strategy 'hsdp' is not built into prepare_model yet"):
        _prepare(_config("127.0.0.1:1", strategy="hsdp"), built)
    assert not built
