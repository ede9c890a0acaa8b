"""Who launched this process and where its peers are: torchrun's variables, else SLURM's.

torchrun (and any ``env://`` launcher) sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``. ``srun python train.py`` sets none of them, but SLURM's own:
``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_JOB_NODELIST``, ``SLURM_JOB_ID``.
From those, the rendezvous host is the first host of the step's node list (not
``SLURM_LAUNCH_NODE_IPADDR``, the login node, on which multi-node jobs hang) and the port is
derived from the job id, so every task of the job agrees without talking. torchrun's variables
win when both are present (torchrun started inside an allocation); ``MASTER_ADDR`` and
``MASTER_PORT`` in the environment override SLURM's derivation.

Every value is untrusted text: numbers are ASCII digits of bounded length, a rank must be below
its world size, and a node list or a tasks-per-node spec is measured before it is expanded.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_JOB_ID")
SLURM_STEP_VAR = "SLURM_STEP_ID"
"""Set by ``srun`` in each task of a step, absent in the batch script itself (where
``SLURM_NTASKS`` still says N, but only one process runs)."""
MAX_DIGITS = 18
"""The most digits a launcher's number may have (below 2**63): longer is malformed."""
MAX_HOSTS = 100_000
"""The most hosts a node list may expand to (the largest clusters have tens of thousands)."""
MAX_TEXT = 1 << 20
"""The longest node list or tasks-per-node spec read, in characters."""
PORT_BASE, PORT_SPAN = 20000, 40000
"""MASTER_PORT from a SLURM job id: ``PORT_BASE + job_id % PORT_SPAN``, in the unprivileged
range below the kernel's usual ephemeral ports (32768-60999 on Linux overlap it in part; a
collision is one job's failure to bind, said in the error, and ``MASTER_PORT`` overrides)."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """This process's place in the job.

    Attributes:
        launcher: ``"torchrun"`` (or any ``env://`` launcher) or ``"slurm"``.
        rank: Global rank.
        world_size: Ranks in the job.
        local_rank: Rank on this node (its GPU index).
        tasks_on_node: Ranks on this node (``None`` where the launcher does not say).
        master_addr: The rendezvous host.
        master_port: The rendezvous port.
        gpu_per_task: SLURM gives each task a GPU of its own (``--gpus-per-task``).
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    tasks_on_node: int | None
    master_addr: str
    master_port: int
    gpu_per_task: bool = False

    def export(self) -> None:
        """Set the ``env://`` variables from this launch (for torch's rendezvous and peers)."""
        os.environ.update(
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
        )


def detect_launch(environ: Mapping[str, str] | None = None) -> Launch:
    """Read the launcher's variables: torchrun's first, else SLURM's.

    Raises:
        ValueError: If neither launcher's variables are complete (the missing ones named), or a
            value is malformed.
    """
    env = os.environ if environ is None else environ
    if all(env.get(name) for name in TORCHRUN_VARS):
        local = env.get("LOCAL_RANK")
        nproc = env.get("LOCAL_WORLD_SIZE")
        launch = Launch(
            launcher="torchrun",
            rank=_natural(env, "RANK"),
            world_size=_natural(env, "WORLD_SIZE", least=1),
            local_rank=_natural(env, "LOCAL_RANK") if local is not None else -1,
            tasks_on_node=_natural(env, "LOCAL_WORLD_SIZE", least=1) if nproc else None,
            master_addr=env["MASTER_ADDR"],
            master_port=_port(env),
        )
        return _checked(launch, ("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    if all(env.get(name) for name in SLURM_VARS):
        if not env.get(SLURM_STEP_VAR):
            raise ValueError(
                "init_distributed: SLURM's job variables are set but not srun's "
                f"({SLURM_STEP_VAR} is missing): this is the batch script itself, one process "
                f"where SLURM_NTASKS={env['SLURM_NTASKS']} ranks would be awaited; start the "
                "ranks with `srun python train.py` (or torchrun) inside the script"
            )
        job = _natural(env, "SLURM_JOB_ID")
        world = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
        hosts = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
        launch = Launch(
            launcher="slurm",
            rank=_natural(env, "SLURM_PROCID"),
            world_size=_natural(env, world, least=1),
            local_rank=_natural(env, "SLURM_LOCALID"),
            tasks_on_node=_tasks_on_node(env),
            master_addr=env.get("MASTER_ADDR") or expand_nodelist(hosts, limit=1)[0],
            master_port=_port(env) if env.get("MASTER_PORT") else slurm_port(job),
            gpu_per_task=bool(env.get("SLURM_GPUS_PER_TASK"))
            or "gpu" in env.get("SLURM_TRES_PER_TASK", ""),
        )
        return _checked(launch, ("SLURM_PROCID", world), ("SLURM_LOCALID", "the node's tasks"))
    missing = [name for name in TORCHRUN_VARS if not env.get(name)]
    partial = [name for name in SLURM_VARS if env.get(name)]
    hint = (
        f"; SLURM's {', '.join(n for n in SLURM_VARS if not env.get(n))} are missing too"
        if partial
        else ""
    )
    raise ValueError(
        f"init_distributed: the environment lacks {', '.join(missing)}{hint}; start the "
        "processes with torchrun or srun (or set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE)"
    )


def _checked(launch: Launch, ranks: tuple[str, str], local: tuple[str, str]) -> Launch:
    """``launch`` if each rank is below its count, else a ValueError naming both variables."""
    if launch.rank >= launch.world_size:
        raise ValueError(
            f"init_distributed: {ranks[0]}={launch.rank} is not below "
            f"{ranks[1]}={launch.world_size}; the launcher's variables disagree (a rank must be "
            "in 0..world size - 1)"
        )
    if launch.tasks_on_node is not None and launch.local_rank >= launch.tasks_on_node:
        raise ValueError(
            f"init_distributed: {local[0]}={launch.local_rank} is not below "
            f"{local[1]} ({launch.tasks_on_node}); the launcher's variables disagree"
        )
    return launch


def _port(env: Mapping[str, str]) -> int:
    port = _natural(env, "MASTER_PORT", least=1)
    if port > 65535:
        raise ValueError(f"MASTER_PORT must be a TCP port (1-65535), got {port}")
    return port


def slurm_job_id(environ: Mapping[str, str] | None = None) -> int:
    """``SLURM_JOB_ID`` as a number (ASCII digits only: it is passed to ``scontrol``).

    Raises:
        ValueError: If it is unset or not 1 to :data:`MAX_DIGITS` ASCII digits.
    """
    env = os.environ if environ is None else environ
    if not env.get("SLURM_JOB_ID"):
        raise ValueError("SLURM_JOB_ID is not set: this process is not inside a SLURM job")
    return _natural(env, "SLURM_JOB_ID")


def slurm_port(job_id: int) -> int:
    """The rendezvous port of SLURM job ``job_id``: the same for every task of the job."""
    return PORT_BASE + job_id % PORT_SPAN


_GROUP = re.compile(r"([^,\[]*)(?:\[([^\]]*)\])?([^,\[]*)")


def expand_nodelist(nodelist: str, *, limit: int | None = None) -> list[str]:
    """The hosts of a SLURM node list in its compressed syntax, in order.

    ``gpu[01-03,07]`` -> ``gpu01 gpu02 gpu03 gpu07`` (zero padding kept); ``a1,b[2-3]`` ->
    ``a1 b2 b3``; ``node7`` -> ``node7``. Parsed here, without ``scontrol``. The whole list is
    measured before any host is made: at most :data:`MAX_HOSTS` hosts.

    Args:
        nodelist: The node list (``SLURM_JOB_NODELIST``).
        limit: Make only the first ``limit`` hosts (the list is still checked whole).

    Raises:
        ValueError: If it is empty, malformed (an unclosed bracket, a bad range, a number of
            more than :data:`MAX_DIGITS` digits) or longer than :data:`MAX_HOSTS` hosts.
    """
    if len(nodelist) > MAX_TEXT:
        raise ValueError(
            f"SLURM node list of {len(nodelist)} characters is longer than {MAX_TEXT}; it is "
            "not a node list"
        )
    text = nodelist.strip()
    groups: list[tuple[str, list[tuple[int, int, int]] | None, str]] = []
    count = 0
    position = 0
    while position < len(text):
        match = _GROUP.match(text, position)
        if match is None or match.end() == position:
            raise _malformed(nodelist, text[position:])
        prefix, ranges, suffix = match.groups()
        if ranges is None:
            if not prefix:
                raise ValueError(f"SLURM node list {nodelist!r} has an empty host name")
            groups.append((prefix, None, ""))
            count += 1
        else:
            spans = _spans(ranges, nodelist)
            groups.append((prefix, spans, suffix))
            count += sum(high - low + 1 for low, high, _ in spans)
        if count > MAX_HOSTS:
            raise ValueError(
                f"SLURM node list {_shown(nodelist)} expands to more than {MAX_HOSTS:,} hosts; "
                "it is malformed"
            )
        position = match.end()
        if position < len(text):
            if text[position] != ",":
                raise _malformed(nodelist, text[position:])
            position += 1
    if not groups:
        raise ValueError(f"SLURM node list {nodelist!r} names no host")
    wanted = count if limit is None else min(limit, count)
    hosts: list[str] = []
    for prefix, parts, suffix in groups:
        if parts is None:
            hosts.append(prefix)
        for low, high, width in parts or ():
            stop = min(high, low + (wanted - len(hosts)) - 1)
            hosts.extend(prefix + str(n).zfill(width) + suffix for n in range(low, stop + 1))
            if len(hosts) >= wanted:
                break
        if len(hosts) >= wanted:
            break
    return hosts


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 80 else repr(text[:77] + "...")


def _malformed(nodelist: str, rest: str) -> ValueError:
    return ValueError(f"SLURM node list {_shown(nodelist)} is malformed at {_shown(rest)}")


def _spans(ranges: str, nodelist: str) -> list[tuple[int, int, int]]:
    """``(low, high, zero-padded width)`` of each part of a bracket, checked, not expanded."""
    spans = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if (
            not _is_number(low)
            or (high and not _is_number(high))
            or (high and int(high) < int(low))
        ):
            raise ValueError(f"SLURM node list {_shown(nodelist)} has the bad range {part!r}")
        spans.append((int(low), int(high or low), len(low)))
    return spans


def _is_number(text: str) -> bool:
    """Whether ``text`` is 1 to MAX_DIGITS ASCII digits (``isdigit`` alone takes ``²``)."""
    return 0 < len(text) <= MAX_DIGITS and text.isascii() and text.isdigit()


def _tasks_on_node(env: Mapping[str, str]) -> int | None:
    """This node's task count from ``SLURM_TASKS_PER_NODE`` (``2(x3),1``) and ``SLURM_NODEID``.

    Read without expanding the repetitions (``2(x99999999999)`` is one number, not a list).
    """
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node = env.get("SLURM_NODEID")
    if not spec or node is None or not _is_number(node) or len(spec) > MAX_TEXT:
        return None
    index = int(node)
    for part in spec.split(","):
        match = re.fullmatch(r"([0-9]{1,18})(?:\(x([0-9]{1,18})\))?", part.strip())
        if match is None:
            return None
        repeat = int(match.group(2) or 1)
        if index < repeat:
            return int(match.group(1))
        index -= repeat
    return None


def _natural(env: Mapping[str, str], name: str, least: int = 0) -> int:
    value = env[name]
    if not _is_number(value) or int(value) < least:
        raise ValueError(
            f"{name} must be an integer >= {least} (at most {MAX_DIGITS} ASCII digits), got "
            f"{_shown(value)}"
        )
    return int(value)
