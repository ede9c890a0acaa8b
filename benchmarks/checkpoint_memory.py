"""A save's peak host memory beside raw DCP's, in fresh processes, one rank.

The microbench's 50 MB model with its AdamW state (150 MB in all). Each sample is a fresh
interpreter that builds the state, resets the kernel's peak-RSS mark (``/proc/self/clear_refs``)
and saves once, with checkpoint-io's ``save_checkpoint`` or with ``get_state_dict`` +
``dcp.save``; the growth of the peak over the RSS before the save is printed. The samples
alternate between the two, and the medians come out as JSON.

Usage: ``python benchmarks/checkpoint_memory.py [--samples 3]`` (Linux).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
sys.path.insert(0, "benchmarks/microbench")
from microbench_models import RunnerModel
from checkpoint_io import save_checkpoint

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
model = RunnerModel(width=512, depth=6)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
model(torch.randn(4, 512)).sum().backward()
optimizer.step()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = kib("VmRSS:")
if sys.argv[1] == "ours":
    save_checkpoint(sys.argv[2] + "/c", model, optimizer, step=1)
else:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=sys.argv[2] + "/c")
print((kib("VmHWM:") - before) / 1024)
dist.destroy_process_group()
"""


def main() -> None:
    """Alternate fresh-process samples of both saves; print the medians in MiB."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=3)
    args = parser.parse_args()
    grown: dict[str, list[float]] = {"ours": [], "raw": []}
    for sample in range(args.samples):
        for side in ("ours", "raw") if sample % 2 == 0 else ("raw", "ours"):
            with tempfile.TemporaryDirectory() as folder:
                done = subprocess.run(
                    [sys.executable, "-c", CHILD, side, folder],
                    capture_output=True, text=True, check=True, timeout=300,
                )  # fmt: skip
                grown[side].append(float(done.stdout.strip().splitlines()[-1]))
    summary = {side: {"median_mib": statistics.median(v), "all": v} for side, v in grown.items()}
    summary["ours_minus_raw_mib"] = summary["ours"]["median_mib"] - summary["raw"]["median_mib"]
    sys.stdout.write(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
