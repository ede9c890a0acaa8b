"""A one-node SLURM cluster of SLURM's own daemons (munged, slurmctld, slurmd), for tests.

Debian's ``slurm-wlm`` and ``munge`` (installed by ``.ci/run``), configured in a temporary
folder: ``proctrack/linuxproc`` and ``task/none`` (no cgroups needed), free ports, this host as
the only node with its CPUs. Started by the test session and shut down after it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "scontrol", "scancel", "sinfo", "squeue")


class SlurmUnavailable(RuntimeError):
    """The daemons cannot run here (the reason said)."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")


@contextlib.contextmanager
def slurm_cluster(folder: Path) -> Iterator[dict[str, str]]:
    """Run the daemons under ``folder``; yield the environment for SLURM's commands.

    Raises:
        SlurmUnavailable: If a program is missing, this is not root (slurmd launches tasks as
            their user), or the node does not come up within 60 s.
    """
    missing = [name for name in (*DAEMONS, *CLIENTS) if _which(name) is None]
    if missing:
        raise SlurmUnavailable(
            f"not installed: {', '.join(missing)} (apt-get install slurmctld slurmd "
            "slurm-client munge; .ci/run does)"
        )
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurmd must run as root to launch tasks, and this is not root")
    for sub in ("munge", "state", "spool", "log", "run"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    key = folder / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    munge_socket = folder / "munge" / "socket"
    host = socket.gethostname().split(".")[0]
    conf = folder / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=tests",
                f"SlurmctldHost={host}",
                "AuthType=auth/munge",
                f"AuthInfo=socket={munge_socket}",
                "CredType=cred/munge",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                f"StateSaveLocation={folder / 'state'}",
                f"SlurmdSpoolDir={folder / 'spool'}",
                f"SlurmctldPidFile={folder / 'run' / 'slurmctld.pid'}",
                f"SlurmdPidFile={folder / 'run' / 'slurmd.pid'}",
                f"SlurmctldLogFile={folder / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={folder / 'log' / 'slurmd.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SchedulerType=sched/backfill",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "ReturnToService=2",
                "MpiDefault=none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "KillWait=30",
                f"NodeName={host} CPUs={os.cpu_count() or 1} State=UNKNOWN",
                f"PartitionName=tests Nodes={host} Default=YES MaxTime=INFINITE State=UP "
                "OverSubscribe=FORCE",
                "",
            ]
        )
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for name in [n for n in os.environ if n.startswith("SLURM_") and n != "SLURM_CONF"]:
        env.pop(name)  # a test session inside an allocation: these would leak into the jobs
    munge_pid = folder / "munge" / "pid"
    started: list[str] = []
    try:
        _start(
            [
                str(_which("munged")),
                "--force",
                f"--key-file={key}",
                f"--socket={munge_socket}",
                f"--pid-file={munge_pid}",
                f"--log-file={folder / 'munge' / 'log'}",
                f"--seed-file={folder / 'munge' / 'seed'}",
            ],
            env,
        )
        started.append("munged")
        _start([str(_which("slurmctld")), "-c"], env)
        started.append("slurmctld")
        _start([str(_which("slurmd"))], env)
        started.append("slurmd")
        _wait_idle(env, folder)
        yield {"SLURM_CONF": str(conf), "SLURM_TEST_LOGS": str(folder / "log")}
    finally:
        if "slurmctld" in started:
            subprocess.run(["scontrol", "shutdown"], env=env, capture_output=True, check=False)
            _wait_gone(folder / "run" / "slurmctld.pid")
            _wait_gone(folder / "run" / "slurmd.pid")
        if "munged" in started and munge_pid.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(munge_pid.read_text().strip()), signal.SIGTERM)
            _wait_gone(munge_pid)


def _start(command: list[str], env: dict[str, str]) -> None:
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SlurmUnavailable(f"{Path(command[0]).name} did not start: {done.stderr.strip()}")


def _wait_idle(env: dict[str, str], folder: Path) -> None:
    deadline = time.monotonic() + 60
    state = ""
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, check=False
        )
        state = out.stdout.strip()
        if state == "idle":
            return
        time.sleep(0.5)
    log = (folder / "log" / "slurmd.log").read_text()[-2000:] if (folder / "log").exists() else ""
    raise SlurmUnavailable(f"the node did not come up (state {state!r}); slurmd's log:\n{log}")


def _wait_gone(pid_file: Path) -> None:
    deadline = time.monotonic() + 20
    while pid_file.exists() and time.monotonic() < deadline:
        try:  # the daemon may remove its pid file between the check and the read
            os.kill(int(pid_file.read_text().strip() or "0"), 0)
        except (ProcessLookupError, ValueError, FileNotFoundError):
            return
        time.sleep(0.2)
