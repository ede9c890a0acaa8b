"""Where a rank's peers are: torchrun's variables, else SLURM's (parsed here, no scontrol)."""

from __future__ import annotations

import pytest

from dist_core import detect_launch, expand_nodelist, names_nccl, slurm_port
from dist_harness import fresh_interpreter

SLURM = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_NODELIST": "gpu[07-08,11],cpu1",
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",  # srun's: absent in the batch script itself
    "SLURM_NODEID": "1",
    "SLURM_TASKS_PER_NODE": "3(x2),2",
    "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1",  # the login node: never the rendezvous
}
TORCHRUN = {
    "MASTER_ADDR": "host0",
    "MASTER_PORT": "29500",
    "RANK": "5",
    "WORLD_SIZE": "6",
    "LOCAL_RANK": "2",
    "LOCAL_WORLD_SIZE": "3",
}


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node7", ["node7"]),
        ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("r[9-11]x", ["r9x", "r10x", "r11x"]),
        ("n[008-010],m[1],login", ["n008", "n009", "n010", "m1", "login"]),
    ],
)
def test_node_lists(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "gpu[01-", "gpu[3-1]", "gpu[a-b]", ",x", "a,,b"])
def test_malformed_node_lists_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="SLURM node list"):
        expand_nodelist(bad)


def test_slurm_gives_rank_world_local_rank_first_host_and_port() -> None:
    launch = detect_launch(SLURM)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == (
        "slurm",
        3,
        8,
        1,
    )
    assert launch.master_addr == "gpu07" and launch.master_port == slurm_port(123456)
    assert launch.tasks_on_node == 3  # node 1 of "3(x2),2"
    assert 1024 < slurm_port(123456) < 65536 and slurm_port(1) != slurm_port(2)


def test_the_environment_overrides_slurm_and_torchrun_wins() -> None:
    overridden = detect_launch({**SLURM, "MASTER_ADDR": "ib-gpu07", "MASTER_PORT": "31000"})
    assert (overridden.master_addr, overridden.master_port) == ("ib-gpu07", 31000)
    both = detect_launch({**SLURM, **TORCHRUN})
    assert (both.launcher, both.rank, both.world_size, both.local_rank) == ("torchrun", 5, 6, 2)
    assert both.tasks_on_node == 3 and both.master_addr == "host0"


def test_refusals_name_what_is_missing_or_malformed() -> None:
    with pytest.raises(ValueError, match="lacks MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; "):
        detect_launch({})
    partial = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}
    with pytest.raises(ValueError, match="SLURM's SLURM_JOB_NODELIST are missing too"):
        detect_launch(partial)
    with pytest.raises(ValueError, match="SLURM_PROCID must be an integer >= 0 .*, got 'x'"):
        detect_launch({**SLURM, "SLURM_PROCID": "x"})
    with pytest.raises(ValueError, match="WORLD_SIZE must be an integer >= 1 .*, got '0'"):
        detect_launch({**TORCHRUN, "WORLD_SIZE": "0"})


def test_backend_strings_that_name_nccl() -> None:
    assert names_nccl("nccl") and names_nccl("cpu:gloo,cuda:nccl")
    assert names_nccl("NCCL") and names_nccl("cpu:gloo, cuda:Nccl")  # torch lowercases them
    assert not names_nccl("gloo") and not names_nccl("cpu:gloo")


def test_init_distributed_under_srun_variables_and_a_per_round_prefix() -> None:
    """SLURM's variables alone start a group and export the env:// ones; a second rendezvous
    round of the same attempt and world size gets a prefix of its own."""
    out = fresh_interpreter(
        """
import os, socket
import torch.distributed as dist
from dist_core import init_distributed
from dist_core._init import _round_prefix
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0",
                  SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="77", SLURM_STEP_ID="0",
                  MASTER_PORT=str(port))
device = init_distributed(timeout=30)
print("device:", device, dist.get_world_size(), os.environ["RANK"], os.environ["MASTER_ADDR"])
store = dist.distributed_c10d._get_default_store()._underlying_non_prefix_store
print("next round:", _round_prefix(store, 1))
dist.barrier()
dist.destroy_process_group()
"""
    )
    assert "device: cpu 1 0 localhost" in out
    assert "next round: world-1-round-1" in out


def test_which_gpu_a_rank_binds() -> None:
    """The device rule init_distributed applies under NCCL, run without CUDA."""
    from dist_core._init import gpu_index

    slurm = detect_launch(SLURM)  # local rank 1, 3 tasks on this node
    assert gpu_index(slurm, 1, 4) == 1
    per_task = detect_launch({**SLURM, "SLURM_GPUS_PER_TASK": "1"})
    assert gpu_index(per_task, 1, 1) == 0  # srun --gpus-per-task=1: its own one GPU
    with pytest.raises(ValueError, match="3 ranks run on this node but 1 GPU.*--gpus-per-task"):
        gpu_index(slurm, 1, 1)  # --gres=gpu:1: three tasks would share one GPU
    with pytest.raises(ValueError, match="3 ranks run on this node but 2 GPU\\(s\\) are visible"):
        gpu_index(slurm, 1, 2)
    torchrun = detect_launch(TORCHRUN)  # local rank 2, 3 per node
    with pytest.raises(ValueError, match="3 ranks run on this node but 1 GPU"):
        gpu_index(torchrun, 2, 1)
    unknown = detect_launch({**TORCHRUN, "LOCAL_WORLD_SIZE": ""})
    with pytest.raises(ValueError, match="LOCAL_RANK=2 but 2 GPU\\(s\\) are visible"):
        gpu_index(unknown, 2, 2)


def test_one_gpu_per_task_binds_cuda0_on_every_local_rank() -> None:
    """``srun --ntasks-per-node=3 --gpus-per-task=1``: each task sees one GPU; every local
    rank, 0 included, takes cuda:0 (local rank 0 was refused: "3 ranks run on this node but
    1 GPU(s) are visible", and without global rank 0 every other rank waited 10 minutes)."""
    from dist_core._init import gpu_index

    for local in range(3):
        env = {**SLURM, "SLURM_LOCALID": str(local), "SLURM_PROCID": str(3 + local)}
        env["SLURM_GPUS_PER_TASK"] = "1"  # what srun --gpus-per-task=1 sets
        launch = detect_launch(env)
        assert launch.tasks_on_node == 3
        assert gpu_index(launch, local, 1) == 0


def test_the_batch_script_itself_is_not_a_rank() -> None:
    """A plain ``python train.py`` in ``sbatch --ntasks=2`` (no srun) has the job's variables
    but no step: refused at once (it waited for 2 ranks)."""
    batch = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    with pytest.raises(ValueError, match="SLURM_STEP_ID is missing.*`srun python train.py`"):
        detect_launch(batch)


def test_the_step_sets_the_world_and_the_first_host() -> None:
    """``srun -n 2`` inside a 4-node job: the step's task count and node list win."""
    step = {**SLURM, "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}
    step.update(SLURM_STEP_NODELIST="gpu[08,11]", SLURM_LOCALID="0", SLURM_NODEID="0")
    launch = detect_launch(step)
    assert (launch.world_size, launch.master_addr) == (2, "gpu08")


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"SLURM_JOB_NODELIST": "a[0-99999999999]"}, "expands to more than 100,000 hosts"),
        ({"SLURM_JOB_NODELIST": "a[0-9]," * 200_000}, "longer than 1048576"),
        ({"SLURM_JOB_NODELIST": "a[1-" + "9" * 5000 + "]"}, "has the bad range"),
        ({"SLURM_PROCID": "8"}, "SLURM_PROCID=8 is not below SLURM_NTASKS=8"),
        ({"SLURM_LOCALID": "3"}, "SLURM_LOCALID=3 is not below the node's tasks \\(3\\)"),
        ({"SLURM_JOB_ID": "\u00b2"}, "SLURM_JOB_ID must be an integer"),
        ({"SLURM_JOB_ID": "1" * 5000}, "SLURM_JOB_ID must be an integer .*\\.\\.\\.'$"),
        ({"SLURM_JOB_ID": "\u0661\u0662\u0663"}, "SLURM_JOB_ID must be an integer"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT must be a TCP port"),
    ],
)
def test_red_team_slurm_strings_are_refused_cheaply(changes: dict[str, str], match: str) -> None:
    """Each is a clear ValueError, found without expanding anything (they ran to
    MemoryError, waited for the timeout, or read Arabic-Indic digits as 123)."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=match):
            detect_launch({**SLURM, **changes})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 * 2**20 + 4 * len("".join(changes.values()))


def test_tasks_per_node_repetitions_are_counted_not_expanded() -> None:
    import tracemalloc

    tracemalloc.start()
    try:
        env = {**SLURM, "SLURM_TASKS_PER_NODE": "2(x99999999999)", "SLURM_NODEID": "7"}
        assert detect_launch(env).tasks_on_node == 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20


def test_a_torchrun_rank_past_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match="RANK=6 is not below WORLD_SIZE=6"):
        detect_launch({**TORCHRUN, "RANK": "6"})
    with pytest.raises(ValueError, match="LOCAL_RANK=3 is not below LOCAL_WORLD_SIZE \\(3\\)"):
        detect_launch({**TORCHRUN, "LOCAL_RANK": "3"})
