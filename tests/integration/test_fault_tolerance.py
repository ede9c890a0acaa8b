"""torchft's replica groups on the real lighthouse (``torchft_lighthouse``, started and stopped here).

Three DDP replica groups of one rank each (one killed mid-step), and two HSDP groups of two
ranks under torchrun (one killed while saving), each group its own job: the others keep
committing without a restart, the group is started again, heals from a live peer and ends
bit-identical to them (``replica_drift`` across the groups finds nothing); the weights equal
one process trained on the samples the record names (the loss a mean over the samples that
count in the live groups, through ``global_count`` and ``count_mean``), and the samples lost
while the group was down are the ones the record names.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ft_worker import BATCH, DIE_STEP, MAX_NORM, SAVE_EVERY

SUPPORT = Path(__file__).parents[1] / "_support"
WORKER = SUPPORT / "ft_worker.py"
# float32 replay of ~20 AdamW steps: the groups sum 3 gradients over gloo and divide, the
# reference takes one mean over the 12 samples; measured differences are ~1e-7.
REFERENCE_BOUND = 1e-5


# A dead group is dropped after 1 s without a heartbeat. A live one that is slow to join (2
# cores shared by every rank) is waited for up to 2 s: with less, a quorum often formed
# without it, and the groups took turns.
_FAST = ("--join_timeout_ms", "2000", "--quorum_tick_ms", "50", "--heartbeat_timeout_ms", "1000")


@pytest.fixture(scope="module")
def lighthouse(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real lighthouse as its own process, ``localhost:PORT``; stopped by its PID."""
    with _lighthouse(tmp_path_factory.mktemp("lighthouse"), min_replicas=1) as address:
        yield address


@contextlib.contextmanager
def _lighthouse(folder: Path, *, min_replicas: int) -> Iterator[str]:
    executable = Path(sys.executable).parent / "torchft_lighthouse"
    with open(folder / "stderr", "wb") as err:
        process = subprocess.Popen(
            [str(executable), "--bind", "[::]:0", "--min_replicas", str(min_replicas), *_FAST],
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
@pytest.mark.parametrize(
    ("strategy", "groups", "ranks", "death"),
    [("ddp", 3, 1, "die-in-step"), ("hsdp", 2, 2, "die")],
    ids=["ddp-3x1-dies-mid-step", "hsdp-2x2-torchrun-dies-saving"],
)
def test_a_killed_group_stops_nobody_heals_and_matches(
    lighthouse: str,
    tmp_path: Path,
    process_group: None,
    strategy: str,
    groups: int,
    ranks: int,
    death: str,
) -> None:
    finish, checkpoints = tmp_path / "finish", tmp_path / "checkpoints"
    last = groups - 1  # the group that dies
    processes: list[subprocess.Popen[bytes]] = []
    env = {
        **os.environ,
        "FT_STRATEGY": strategy,
        "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]),
    }

    def start(replica: int, log: str, *extra: str) -> subprocess.Popen[bytes]:
        launch = [sys.executable]
        if ranks > 1:  # the group is a torchrun job of its own
            launch += ["-m", "torch.distributed.run", "--standalone", "--max-restarts", "0"]
            launch += ["--nproc-per-node", str(ranks)]
        args = [str(WORKER), lighthouse, str(replica), str(groups), str(tmp_path / f"{log}.log")]
        out = open(tmp_path / f"{log}.out", "wb")  # noqa: SIM115 (closed with the process)
        process = subprocess.Popen(
            [*launch, *args, str(finish), str(checkpoints), *extra],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
        out.close()
        processes.append(process)
        return process

    try:
        running = [start(g, f"g{g}") for g in range(last)] + [start(last, "gx", death)]
        _wait(lambda: running[last].poll() is not None, "the group's death", deadline_s=120)
        assert running[last].returncode != 0, _text(tmp_path / "gx.out")[-3000:]
        # The survivors commit on their own, with no restart.
        _wait(
            lambda: (
                sum(
                    s["committed"] and s["participants"] == groups - 1
                    for s in _steps(tmp_path / "g0.log")
                )
                >= 3
            ),
            "steps committed by the survivors",
            running[0],
        )
        restarted_at = time.time()
        restarted = start(last, "gy")
        _wait(
            lambda: any(s["participants"] == groups for s in _steps(tmp_path / "gy.log")),
            "a step of the healed group",
            restarted,
        )
        end = max(s["step"] for s in _steps(tmp_path / "g0.log"))
        finish.write_text(str(end + 4))
        for process in [*running[:last], restarted]:
            process.wait(timeout=60)
            assert process.returncode == 0, _text(tmp_path / "g0.out")[-3000:]
    finally:
        for process in processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()

    names = [f"g{g}" for g in range(last)] + ["gx", "gy"]
    logs = {name: _lines(tmp_path / f"{name}.log") for name in names}
    finals = {name: log[-1] for name, log in logs.items() if name != "gx"}
    # Healed: every group ends bit for bit the same (each rank its shards), at the same step.
    for rank in range(ranks):
        suffix = f".{rank}" if rank else ""
        ends = {_lines(tmp_path / f"{name}.log{suffix}")[-1]["final"] for name in finals}
        assert len(ends) == 1, (rank, ends)
    assert len({f["step"] for f in finals.values()}) == 1
    resumed = _lines(tmp_path / "gy.log")[0]["resumed"]
    if death == "die":
        # The killed group died in its second save, of step died_in: the save runs in the
        # commit of the step before (after the last step it logged); the restarted one
        # resumed from its last complete checkpoint, then healed to the others' step.
        died_in = max(s["step"] for s in _steps(tmp_path / "gx.log")) + 2
        assert died_in % SAVE_EVERY == 0 and resumed == died_in - SAVE_EVERY
        assert not (checkpoints / f"replica_{last}" / f"step-{died_in}").exists()
    else:
        # It died in step DIE_STEP between its two backwards, while its peers were in that
        # step's cross-group reduce: they discarded the step (torchft's commit said no), then
        # trained it again without it. The restarted group resumed from its last save.
        died_in = max(s["step"] for s in _steps(tmp_path / "gx.log")) + 1
        assert died_in == DIE_STEP and resumed == DIE_STEP // SAVE_EVERY * SAVE_EVERY
        tries = [s for s in _steps(tmp_path / "g0.log") if s["step"] == died_in]
        assert not tries[0]["committed"] and tries[0]["participants"] == groups, tries
        assert tries[-1]["committed"] and tries[-1]["participants"] == groups - 1, tries
    healed_first = _steps(tmp_path / "gy.log")[0]["step"]
    assert healed_first > died_in + 3

    # The RNG streams came with the heal: at every committed step, every group (the healed
    # one's first step included) drew the same from its CPU stream, rank by rank.
    for rank in range(ranks):
        suffix = f".{rank}" if rank else ""
        draws: dict[int, set[float]] = {}
        norms: dict[int, set[float]] = {}
        for name in names:
            for s in _steps(tmp_path / f"{name}.log{suffix}"):
                if s["committed"]:
                    draws.setdefault(s["step"], set()).add(s["probe"])
                    norms.setdefault(s["step"], set()).add(s["norm"])
        assert all(len(values) == 1 for values in draws.values()), (rank, draws)
        # clip_grad_norm: one norm per step on every live rank of every group.
        assert all(len(values) == 1 for values in norms.values()), (rank, norms)
    clipped = sum(s["norm"] > MAX_NORM for s in _steps(tmp_path / "g0.log"))
    assert 0 < clipped < len(_steps(tmp_path / "g0.log"))  # the clip acted at some steps

    # Healed and proven: at the end every group compared itself with the others
    # (replica_drift across the groups) and found nothing, on every rank.
    for name in finals:
        for rank in range(ranks):
            suffix = f".{rank}" if rank else ""
            report = _lines(tmp_path / f"{name}.log{suffix}")[-2]
            assert report["drifted"] is False and sorted(report["groups"]) == list(range(groups)), (
                report
            )

    # The record (sample-order's log, written by the library at each commit) names what
    # each committed step trained and lost; the workers' own logs say which groups
    # committed which step, and the two agree.
    from ft_worker import order
    from sample_order import read_sample_log

    the_order = order(groups, ranks)
    history = read_sample_log(tmp_path / "record", the_order)
    committed: dict[int, set[int]] = {}
    for name in names:
        for s in _steps(tmp_path / f"{name}.log"):
            if s["committed"]:
                committed.setdefault(s["step"], set()).add(s["replica"])
    if death == "die":  # the step it committed, then died saving: its worker never logged it
        assert f"replica_{last}" in history.trained[died_in - 1]
        committed.setdefault(died_in - 1, set()).add(last)
    assert sorted(history.trained) == sorted(committed)
    for step, in_ in committed.items():
        assert {int(w.split("_")[1]) for w in history.trained[step]} == in_, step
        shares = [the_order.shard(step, rank=g, world_size=groups) for g in range(groups)]
        assert history.lost[step] == sorted(i for g in set(range(groups)) - in_ for i in shares[g])
    # The dead group's samples were lost at every step the others committed while it was
    # down: from the step it died in to the step before its first healed one.
    lost_steps = sorted(step for step, lost in history.lost.items() if lost)
    # (a group slow to start may miss the first quorums too: those steps are lost as well)
    assert [s for s in lost_steps if s >= died_in][: healed_first - died_in] == list(
        range(died_in, healed_first)
    )
    absent = sum(groups - len(in_) for in_ in committed.values())
    assert history.lost_count == absent * BATCH * ranks > 0

    # One process trained on the record's samples (each writer's with its group's choices)
    # reaches the same weights.
    reference = _replay(history.trained, strategy)
    worst = max(
        (torch.tensor(value) - reference[key]).abs().max().item()
        for key, value in finals["g0"]["weights"].items()
    )
    assert worst <= REFERENCE_BOUND, worst
    _check_the_checkpoint_left(
        checkpoints / f"replica_{last}", resumed, history.trained, strategy, ranks
    )
    heal_s = _steps(tmp_path / "gy.log")[0]["t"] - restarted_at
    sys.stdout.write(
        f"fault tolerance, {strategy} {groups}x{ranks}: restart to first committed step "
        f"{heal_s:.1f} s, {len(lost_steps)} steps ({history.lost_count} samples) lost, "
        f"weights within {worst:.2e} of the replay\n"
    )


def _check_the_checkpoint_left(
    root: Path, latest: int, trained: dict[int, dict[str, list[int]]], strategy: str, ranks: int
) -> None:
    """The dead group's last complete checkpoint (the one its restart resumed from) loads
    without torchft, in one process, at its step, and matches the replay of the steps before."""
    from checkpoint_io import load_checkpoint

    model, optimizer = _plain_model()
    info = load_checkpoint(root / f"step-{latest}", model, optimizer)  # no manager's state
    assert info.world_size == ranks  # saved by the group's ranks, loaded by one process
    assert info.step == latest
    before = {step: shares for step, shares in trained.items() if step < latest}
    reference = _replay(before, strategy)
    worst = max((model.state_dict()[k] - v).abs().max().item() for k, v in reference.items())
    assert worst <= REFERENCE_BOUND, worst


def _plain_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The workers' model, built as they build it, in this process, with its AdamW."""
    from ft_worker import WIDTH, Gated
    from replica_init import build_replicated_model

    model = build_replicated_model(
        Gated, {"width": WIDTH}, device="cpu", default_dtype=torch.float32, seed=0
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _replay(trained: dict[int, dict[str, list[int]]], strategy: str) -> dict[str, torch.Tensor]:
    """The recorded steps in one process: each step's samples, writer by writer."""
    from ft_worker import data, loss_sum, uses_aux

    model, optimizer = _plain_model()
    for step in sorted(trained):
        parts = [
            (data(samples), uses_aux(strategy, int(writer.split("_")[1]), step))
            for writer, samples in sorted(trained[step].items())
        ]
        total = sum(loss_sum(model, *part, aux) for part, aux in parts)
        count = sum(float(part[2].sum()) for part, _ in parts)
        optimizer.zero_grad()
        (total / count).backward()  # over the samples that count
        if strategy == "ddp":  # what no DDP group used: zeros, as under the groups
            for param in model.parameters():
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
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


@pytest.fixture
def group_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """The group's store named as torchrun names it (this process's group has a HashStore)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")


@pytest.mark.usefixtures("group_store")
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


@pytest.mark.usefixtures("group_store")
def test_a_replica_id_in_use_is_refused_before_anything_is_built(
    lighthouse: str, process_group: None
) -> None:
    """A live group heartbeating as replica_0 (torchft's own client, as a Manager does)."""
    from torchft._torchft import LighthouseClient

    client = LighthouseClient(f"http://{lighthouse}", datetime.timedelta(seconds=5))
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            client.heartbeat("replica_0:a-live-group")
            stop.wait(0.1)

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    built: list[int] = []
    try:
        time.sleep(0.3)
        with pytest.raises(ValueError) as info:
            _prepare(_config(lighthouse), built)
    finally:
        stop.set()
        beating.join(timeout=10)
    text = str(info.value)
    assert "fault_tolerance.replica_id=0 is in use" in text and "replica_0" in text
    assert "give every group its own replica_id, 0 .. replica_groups - 1 = 1" in text
    assert not built
    time.sleep(1.5)  # the id is free once its heartbeats stop: the same config passes the check
    from distributed_strategy._lighthouse import check_lighthouse
    from strategy_config import FaultToleranceConfig

    check_lighthouse(FaultToleranceConfig.from_mapping(_config(lighthouse)["fault_tolerance"]))


@pytest.mark.usefixtures("process_group")
def test_a_group_without_torchft_or_its_store_is_refused_before_anything_is_built(
    lighthouse: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[int] = []
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError, match=r"needs this group's store at MASTER_ADDR/MASTER_PORT"):
        _prepare(_config(lighthouse), built)
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    with pytest.raises(ImportError) as info:
        _prepare(_config(lighthouse), built)
    assert "fault_tolerance needs torchft" in str(info.value)
    assert "pip install torchft==0.2.0" in str(info.value)
    assert not built


def test_a_model_prepared_without_it_has_no_fault_tolerance() -> None:
    from distributed_strategy.fault_tolerance import fault_tolerance_of
    from toy_models import Regressor

    with pytest.raises(ValueError, match="Regressor was not prepared with fault tolerance; set "):
        fault_tolerance_of(Regressor())


@pytest.mark.multiprocess
def test_the_example_trainer_runs_as_replica_groups(tmp_path: Path) -> None:
    """docs/examples/train.py --fault-tolerance: two groups, one torchrun each, train together
    (a lighthouse that waits for both before the first step) and end with the same weights."""
    from example_runs import EXAMPLE

    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    outs = [tmp_path / f"group{replica}.out" for replica in range(2)]
    with _lighthouse(tmp_path, min_replicas=2) as address:
        processes = []
        for replica, out in enumerate(outs):
            group = ["--fault-tolerance", address, "--replica-id", str(replica)]
            with open(out, "wb") as sink:
                processes.append(
                    subprocess.Popen(
                        [
                            *launch,
                            "--nproc-per-node",
                            "1",
                            str(EXAMPLE),
                            "--steps",
                            "4",
                            *group,
                            "--replica-groups",
                            "2",
                            "--ckpt-dir",
                            str(tmp_path / f"ckpt{replica}"),
                            "--ckpt-every",
                            "2",
                        ],
                        stdout=sink,
                        stderr=subprocess.STDOUT,
                    )
                )
        try:
            for process, out in zip(processes, outs, strict=True):
                assert process.wait(timeout=180) == 0, _text(out)[-3000:]
        finally:
            for process in processes:
                if process.poll() is None:
                    os.kill(process.pid, signal.SIGKILL)
                    process.wait()
    prints = [re.findall(r"ddp: final (?:fingerprint|weight sum) \S+", _text(o)) for o in outs]
    assert len(prints[0]) == 2 and prints[0] == prints[1], prints
    # Each group checkpointed through the commit, with the manager's state beside its own.
    for replica in range(2):
        saved = sorted(p.name for p in (tmp_path / f"ckpt{replica}").iterdir())
        assert saved == ["step-2", "step-4"], saved
        manifest = json.loads(
            (tmp_path / f"ckpt{replica}" / "step-4" / "checkpoint.json").read_text()
        )
        assert manifest["stateful"] == ["torchft"], manifest["stateful"]


def test_checkpointing_under_it_refuses_bad_input_before_anything_changes(tmp_path: Path) -> None:
    """save_on_commit / resume need the wrapped optimizer (its state is saved) and keep the
    name "torchft" for the manager's state: refused, naming the fix, with nothing saved."""
    from distributed_strategy import CheckpointManager
    from distributed_strategy.fault_tolerance import FaultTolerance
    from strategy_config import FaultToleranceConfig
    from toy_models import Regressor

    config = FaultToleranceConfig.from_mapping(_config("localhost:1")["fault_tolerance"])
    handle = FaultTolerance(config, None, None, Regressor(), torch.device("cpu"))  # no engine
    checkpoints = CheckpointManager(tmp_path / "ckpt", every=1)
    with pytest.raises(RuntimeError, match=r"call wrap_optimizer\(optimizer\) first"):
        handle.save_on_commit(checkpoints)
    with pytest.raises(RuntimeError, match=r"call wrap_optimizer\(optimizer\) first"):
        handle.resume(checkpoints)
    handle._optimizer = torch.optim.SGD(Regressor().parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"stateful=\{'torchft': ...\} names the manager's own"):
        handle.save_on_commit(checkpoints, stateful={"torchft": object()})
    assert handle._saving is None and not (tmp_path / "ckpt").exists()
