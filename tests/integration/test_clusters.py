"""Runs where clusters run, on the real engines: SLURM's own daemons, and torchrun agents.

The SLURM tests start munged, slurmctld and slurmd for this module (tests/_support/
slurm_cluster.py) and stop them after it. Where they cannot start they skip with the reason;
with ``REQUIRE_SLURM=1`` (set by ``.ci/run``) they fail instead.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from example_runs import EXAMPLE, example, final
from slurm_cluster import SlurmUnavailable, slurm_cluster

pytestmark = pytest.mark.multiprocess

COMMON = ("--strategy", "fsdp", "--global-batch", "8", "--micro-batch", "2", "--pg-timeout-s", "60")


@pytest.fixture(scope="module")
def slurm() -> Iterator[dict[str, str]]:
    # A short folder: munge's socket path must fit a UNIX socket name (108 bytes).
    with tempfile.TemporaryDirectory(prefix="slurm-", dir="/tmp") as folder:
        try:
            cluster = slurm_cluster(Path(folder))
            env = cluster.__enter__()
        except SlurmUnavailable as error:
            if os.environ.get("REQUIRE_SLURM"):
                pytest.fail(f"SLURM is required here (REQUIRE_SLURM) but: {error}")
            pytest.skip(f"no SLURM daemons: {error}")
        try:
            yield {**os.environ, **env, "OMP_NUM_THREADS": "1"}
        finally:
            cluster.__exit__(None, None, None)


def _slurm(*command: str, env: dict[str, str], timeout: float = 60) -> str:
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{shlex.join(command)}: {done.stderr[-3000:]}"
    return done.stdout


def _job_field(job: str, field: str, env: dict[str, str]) -> str:
    shown = _slurm("scontrol", "show", "job", job, env=env)
    match = re.search(rf"\b{field}=(\S+)", shown)
    return match.group(1) if match else ""


def _until(what: str, check: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


def test_srun_without_torchrun_trains_like_torchrun(slurm: dict[str, str]) -> None:
    """``srun -n 2 python train.py``: init_distributed reads SLURM's variables (rank, world,
    local rank, the node list's first host, the job's port) and ends bit for bit at the
    torchrun run's weights."""
    args = (*COMMON, "--steps", "3")
    torchrun = example(*args)
    srun = subprocess.run(
        ["srun", "-n", "2", "--kill-on-bad-exit=1", sys.executable, str(EXAMPLE), *args],
        env=slurm,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert srun.returncode == 0, srun.stderr[-3000:]
    assert final(srun, "fingerprint") == final(torchrun, "fingerprint")
    print("srun", final(srun, "fingerprint"), "torchrun", final(torchrun, "fingerprint"))


def test_a_rank_started_without_srun_in_a_batch_script_is_refused(
    slurm: dict[str, str], tmp_path: Path
) -> None:
    """``sbatch --ntasks=2`` running ``python train.py`` itself (no srun): SLURM's job
    variables say 2 tasks, but one process runs, and it waited for its peer until the timeout.
    init_distributed refuses it at once, naming srun."""
    log, script = tmp_path / "job.log", tmp_path / "job.sh"
    code = "from dist_core import init_distributed; init_distributed(timeout=30)"
    script.write_text("#!/bin/bash\n" + shlex.join([sys.executable, "-c", code]) + "\n")
    done = subprocess.run(
        ["sbatch", "--wait", "-n", "2", "-o", str(log), str(script)],
        env=slurm, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    text = log.read_text()
    assert done.returncode != 0, text  # the job failed, with the refusal, not the timeout's
    assert "SLURM_STEP_ID is missing" in text and "`srun python train.py`" in text, text


def test_usr1_saves_requeues_and_the_job_resumes_to_the_same_weights(
    slurm: dict[str, str], tmp_path: Path
) -> None:
    """``sbatch --requeue``, then ``scancel --signal=USR1`` mid-run (what ``--signal=USR1@N``
    sends before the time limit): every rank saves at the next step, rank 0 requeues the job
    after the publish, all exit 0; the requeued job resumes from that checkpoint and ends at
    the uninterrupted run's weights."""
    args = (*COMMON, "--steps", "6")
    straight = example(*args)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.log"
    train = [sys.executable, str(EXAMPLE), *args, "--ckpt-dir", str(ckpt), "--ckpt-every", "100"]
    train += ["--save-on-signal", "USR1", "--requeue"]
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n" + shlex.join(["srun", "-n", "2", "--kill-on-bad-exit=1", *train]) + "\n"
    )
    submitted = _slurm(
        "sbatch", "--requeue", "--open-mode=append", "-o", str(log), "-n", "2",
        "--export=ALL,TRAIN_TEST_STEP_SLEEP=1", str(script), env=slurm,
    )  # fmt: skip
    job = submitted.split()[-1]
    _until("step 1", lambda: log.exists() and "step 1:" in log.read_text(), 180)
    _slurm("scancel", "--signal=USR1", job, env=slurm)
    # Requeued: PENDING again. SLURM holds a requeued job back for about two minutes
    # (Reason=BeginTime) so that slurmd has forgotten the old run's revoked credential; the
    # test starts it sooner, once the node is idle and a few seconds have passed (started
    # within the revocation's second, it was killed: "Job credential revoked").
    _until("the requeued job to be pending", lambda: _job_field(job, "Restarts", slurm) == "1"
           and _job_field(job, "JobState", slurm) == "PENDING", 120)  # fmt: skip
    _until("the node to be idle", lambda: _slurm(
        "sinfo", "-h", "-o", "%T", env=slurm).strip() == "idle", 120)  # fmt: skip
    time.sleep(5)

    def started() -> bool:
        if _job_field(job, "JobState", slurm) == "PENDING":
            _slurm("scontrol", "update", f"JobId={job}", "StartTime=now", env=slurm)
            return False
        return True

    _until("the requeued job to start", started, 120)
    _until("the requeued job to finish", lambda: _job_field(job, "JobState", slurm) in (
        "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 300)  # fmt: skip
    text = log.read_text()
    logs = Path(slurm["SLURM_TEST_LOGS"])
    daemons = "".join((logs / n).read_text()[-1500:] for n in ("slurmctld.log", "slurmd.log"))
    shown = _slurm("scontrol", "show", "job", job, env=slurm)
    assert _job_field(job, "JobState", slurm) == "COMPLETED", f"{text[-3000:]}\n{shown}\n{daemons}"
    saved = re.findall(r"SIGUSR1: saved \S*/step-(\d+)", text)
    resumed = re.findall(r"resuming from \S*/step-(\d+)", text)
    assert len(saved) == 1 and resumed == saved, text[-3000:]
    assert "requeued SLURM job" in text
    assert 2 <= int(resumed[0]) < 6
    finals = [line for line in text.splitlines() if "final fingerprint" in line]
    assert len(finals) == 1 and finals[0].rsplit(" ", 1)[1] == final(straight, "fingerprint")
    print(f"job {job}: saved and resumed at step {resumed[0]}; {finals[0]}")


def _agent(port: int, args: tuple[str, ...], log: Path) -> subprocess.Popen[bytes]:
    """One torchrun agent: a "node" of one rank, elastic between 1 and 2 nodes."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2"]
    command += ["--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", "elastic"]
    command += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "3"]
    # The rendezvous store is the test's (is_host=0): a node that leaves takes nothing along.
    conf = "is_host=0,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
    command += ["--monitor-interval", "0.5", "--rdzv-conf", conf]
    # A slow step (1 s): the node that joins again needs its interpreter, torch and the
    # rendezvous (up to ~8 s while the other tests load both cores) before the single node's
    # remaining steps are done; at 0.5 s it once finished alone first.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAIN_TEST_STEP_SLEEP": "1"}
    # torch's opt-out of the shared rendezvous store: with it shared, rank 0's agent caches
    # its bootstrap address after the first round and never publishes it again, so a node
    # that joins later waits for MASTER_ADDR until it times out (dynamic_rendezvous.py,
    # next_rendezvous; seen here with torch 2.13). docs/clusters.md says to set it.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    with log.open("ab") as out:
        return subprocess.Popen(
            [*command, str(EXAMPLE), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


def _kill_node(agent: int) -> None:
    """SIGKILL a torchrun agent and every process under it (its workers have sessions of
    their own)."""
    family, found = {agent}, True
    while found:
        found = False
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) not in family:
                try:
                    parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                if parent in family:
                    family.add(int(entry.name))
                    found = True
    for pid in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_elastic_torchrun_keeps_the_global_batch_when_a_node_leaves_and_joins(
    tmp_path: Path,
) -> None:
    """Two torchrun agents on this machine (``--nnodes 1:2``): the second node is lost mid-run
    (its agent and worker SIGKILLed) and started again. The workers restart at world size 1, then 2, each resuming from the
    latest checkpoint with the accumulation re-planned (the same global batch of 8), and the
    run ends at the uninterrupted run's weights up to float reduction order."""
    import socket

    import torch.distributed as dist

    args = (*COMMON, "--steps", "12", "--ckpt-every", "1", "--ckpt-dir", str(tmp_path / "ckpt"))
    straight = example(*COMMON, "--steps", "12")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    first_log, second_log = tmp_path / "a.log", tmp_path / "b.log"
    first = _agent(port, args, first_log)
    second: subprocess.Popen[bytes] | None = None
    try:
        second = _agent(port, args, second_log)
        _until("2 nodes training", lambda: "step 2:" in first_log.read_text(), 120)
        _kill_node(second.pid)  # the node is lost: its agent and its worker, SIGKILLed
        second.wait(timeout=60)
        _until("training on 1 node", lambda: "world 1:" in first_log.read_text(), 120)
        _until("a step on 1 node", lambda: re.search(
            r"world 1:[\s\S]*step \d+:", first_log.read_text()) is not None, 120)  # fmt: skip
        second = _agent(port, args, second_log)  # the node joins again
        assert first.wait(timeout=240) == 0, first_log.read_text()[-3000:]
        assert second.wait(timeout=60) == 0, second_log.read_text()[-3000:]
    finally:
        for agent in (first, second):
            if agent is not None and agent.poll() is None:
                _kill_node(agent.pid)
        del store
    text = first_log.read_text()
    worlds = re.findall(r"^world (\d+): (\d+) micro-batch", text, re.MULTILINE)
    assert worlds[0] == ("2", "2") and ("1", "4") in worlds and worlds[-1] == ("2", "2"), worlds
    resumed = re.findall(r"resuming from \S*/step-(\d+)", text)
    assert len(resumed) >= 2, text[-3000:]
    finals = [line for line in text.splitlines() if "final weight sum" in line]
    assert len(finals) == 1, text[-3000:]
    expected = float(final(straight, "weight sum"))
    assert float(finals[0].rsplit(" ", 1)[1]) == pytest.approx(expected, rel=1e-6)
    print(f"elastic: worlds {worlds}, resumed at {resumed}")


def test_a_world_size_that_cannot_divide_the_global_batch_is_refused_before_training() -> None:
    refused = example("--global-batch", "6", "--micro-batch", "2", "--steps", "2", ok=False)
    assert "--global-batch 6 is not divisible by 2 rank(s) x --micro-batch 2" in refused.stderr
    assert "step 0:" not in refused.stdout
