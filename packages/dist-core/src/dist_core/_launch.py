"""Who launched this process and where its peers are: torchrun's variables, else SLURM's.

torchrun (and any ``env://`` launcher) sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``. ``srun python train.py`` sets none of them, but SLURM's own:
``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_JOB_NODELIST``, ``SLURM_JOB_ID``.
From those, the rendezvous host is the first host of the job's node list (not
``SLURM_LAUNCH_NODE_IPADDR``, the login node, on which multi-node jobs hang) and the port is
derived from the job id, so every task of the job agrees without talking. torchrun's variables
win when both are present (torchrun started inside an allocation); ``MASTER_ADDR`` and
``MASTER_PORT`` in the environment override SLURM's derivation.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_JOB_ID")
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
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    tasks_on_node: int | None
    master_addr: str
    master_port: int

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
        return Launch(
            launcher="torchrun",
            rank=_natural(env, "RANK"),
            world_size=_natural(env, "WORLD_SIZE", least=1),
            local_rank=_natural(env, "LOCAL_RANK") if local is not None else -1,
            tasks_on_node=_natural(env, "LOCAL_WORLD_SIZE", least=1) if nproc else None,
            master_addr=env["MASTER_ADDR"],
            master_port=_natural(env, "MASTER_PORT"),
        )
    if all(env.get(name) for name in SLURM_VARS):
        job = _natural(env, "SLURM_JOB_ID")
        return Launch(
            launcher="slurm",
            rank=_natural(env, "SLURM_PROCID"),
            world_size=_natural(env, "SLURM_NTASKS", least=1),
            local_rank=_natural(env, "SLURM_LOCALID"),
            tasks_on_node=_tasks_on_node(env),
            master_addr=env.get("MASTER_ADDR") or expand_nodelist(env["SLURM_JOB_NODELIST"])[0],
            master_port=_natural(env, "MASTER_PORT") if env.get("MASTER_PORT") else slurm_port(job),
        )
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


def slurm_port(job_id: int) -> int:
    """The rendezvous port of SLURM job ``job_id``: the same for every task of the job."""
    return PORT_BASE + job_id % PORT_SPAN


_GROUP = re.compile(r"([^,\[]*)(?:\[([^\]]*)\])?([^,\[]*)")


def expand_nodelist(nodelist: str) -> list[str]:
    """The hosts of a SLURM node list in its compressed syntax, in order.

    ``gpu[01-03,07]`` -> ``gpu01 gpu02 gpu03 gpu07`` (zero padding kept); ``a1,b[2-3]`` ->
    ``a1 b2 b3``; ``node7`` -> ``node7``. Parsed here, without ``scontrol``.

    Raises:
        ValueError: If it is empty or malformed (an unclosed bracket, a bad range).
    """
    text = nodelist.strip()
    hosts: list[str] = []
    position = 0
    while position < len(text):
        match = _GROUP.match(text, position)
        if match is None or match.end() == position:
            raise _malformed(nodelist, text[position:])
        prefix, ranges, suffix = match.groups()
        if ranges is None:
            if not prefix:
                raise ValueError(f"SLURM node list {nodelist!r} has an empty host name")
            hosts.append(prefix)
        else:
            hosts.extend(prefix + number + suffix for number in _numbers(ranges, nodelist))
        position = match.end()
        if position < len(text):
            if text[position] != ",":
                raise ValueError(
                    f"SLURM node list {nodelist!r} is malformed at {text[position:]!r}"
                )
            position += 1
    if not hosts:
        raise ValueError(f"SLURM node list {nodelist!r} names no host")
    return hosts


def _malformed(nodelist: str, rest: str) -> ValueError:
    return ValueError(f"SLURM node list {nodelist!r} is malformed at {rest!r}")


def _numbers(ranges: str, nodelist: str) -> list[str]:
    numbers = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()) or (high and int(high) < int(low)):
            raise ValueError(f"SLURM node list {nodelist!r} has the bad range {part!r}")
        width = len(low)
        numbers += [str(n).zfill(width) for n in range(int(low), int(high or low) + 1)]
    return numbers


def _tasks_on_node(env: Mapping[str, str]) -> int | None:
    """This node's task count from ``SLURM_TASKS_PER_NODE`` (``2(x3),1``) and ``SLURM_NODEID``."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node = env.get("SLURM_NODEID")
    if not spec or node is None or not node.isdigit():
        return None
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[int(node)] if int(node) < len(counts) else None


def _natural(env: Mapping[str, str], name: str, least: int = 0) -> int:
    value = env[name]
    if not value.isdigit() or int(value) < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return int(value)
