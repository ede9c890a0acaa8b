#!/usr/bin/env bash
# One prepared device check, from the source tree: a probe, the CUDA/NCCL tests, FSDP's init
# memory, a single-process clip/save/load, the paths that act differently on CUDA on one NCCL
# rank (benchmarks/device_paths.py), the CUDA benchmark, the estimate's agreement with it (the
# peak included) and a short knob sweep.
#
# For a GPU machine without nox or network (torch, matplotlib, pytest and numpy preinstalled):
#     OUT=/somewhere bash benchmarks/device_check.sh
# Checked on CPU with DEVICE=cpu, which runs the same steps (the CUDA tests skip, saying why;
# the bench runs the tiny preset on gloo).
#
# What comes back: the device tool returns at most 8 files, 2 folders down. $OUT ends with
#     summary.json   every step's exit status and wall time
#     results.json   the benchmark's rows (unpacked)        report.md  its report
#     bench.tar.gz   the benchmark's folder (plots, report, results)
#     logs.tar.gz    every step's log, tests.xml, the sweep's folder
#
# The whole script fits BUDGET seconds (default 400, so that a 600 s command leaves room for
# the machine's start and a rerun): the steps' caps (CAPS below) add up to the budget less a
# 10 s reserve for the summary and the packing, the plan is printed first, each step gets at
# most its own cap and never more than what is left, and the bench and the sweep end cleanly
# (--time-budget) before their cap kills them (--timeout). The script exits 1 if any step
# failed or was skipped (a step's status is its own command's, never a pipe's last); a bench
# or sweep step that skipped points to keep to its time budget is "partial", not ok.
#
# At one GPU every run is world size 1: FSDP2 issues no collective and DDP's all-reduce of one
# rank moves nothing, so NCCL's all-gather and reduce-scatter are not exercised and no
# communication is measured. On a host with 2 or more GPUs, the 2-rank NCCL variants of the
# tests run with the same `tests` step, and the bench uses every visible GPU.
set -u
cd "$(dirname "$0")/.."
out="${OUT:-device-results}"
device="${DEVICE:-cuda}"
budget="${BUDGET:-400}"
py="${PYTHON:-python3}"
command -v "$py" > /dev/null 2>&1 || py=python
mkdir -p "$out"
work="$out/.work"
rm -rf "$work"
mkdir -p "$work"
src=""
for dir in packages/*/src benchmarks/src; do src="$src:$PWD/$dir"; done
export PYTHONPATH="${src#:}:$PWD/tests/_support:$PWD/benchmarks/microbench:$PWD/docs/examples"
export PYTHONUNBUFFERED=1 DEVICE="$device"
steps_file="$work/steps.tsv"
: > "$steps_file"
start=$SECONDS
reserve=10

# Each step's cap in seconds, in the order the steps run; they add up to at most
# BUDGET - reserve (400 - 10) so that a healthy device ends with every step ok.
CAPS="probe:25 tests:70 fsdp_init_memory:45 single_process:25 device_paths:40 bench:95 estimate_agreement:30 sweep:60"
cap_of() {
  local entry
  for entry in $CAPS; do
    if [ "${entry%%:*}" = "$1" ]; then echo "${entry#*:}"; return; fi
  done
  echo 0
}
planned=0
for entry in $CAPS; do planned=$((planned + ${entry#*:})); done
echo "== plan: $CAPS (sum ${planned} s of a ${budget} s budget, ${reserve} s reserved)"
if [ "$planned" -gt $((budget - reserve)) ]; then
  echo "== the caps exceed the budget: the last steps will get less than their cap or be skipped"
fi

# step NAME COMMAND...: run COMMAND with its output in $work/NAME.log, for at most
# min(NAME's cap, what is left of the budget minus the reserve for the summary and packing).
step() {
  local name="$1"
  local cap
  cap=$(cap_of "$name")
  shift 1
  local left=$((budget - (SECONDS - start) - reserve))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 5 ]; then
    echo "== $name: skipped, the budget is spent"
    printf '%s\t%s\t%s\t%s\n' "$name" "skipped" 0 0 >> "$steps_file"
    return
  fi
  echo "== $name (at most ${limit} s)"
  local t0=$SECONDS
  STEP_LIMIT="$limit" timeout --kill-after=5 "$limit" "$@" > "$work/$name.log" 2>&1
  local rc=$?
  local took=$((SECONDS - t0))
  tail -n 15 "$work/$name.log"
  echo "== $name: exit $rc after ${took} s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$took" "$limit" >> "$steps_file"
}

# The device, and on CUDA a 1-rank NCCL all_reduce and barrier under a 30 s timeout, so that an
# NCCL bootstrap failure is one clear line instead of a hang in every later step.
step probe "$py" - <<'PY'
import datetime
import os
import torch
import torch.distributed as dist
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}", p.name, f"{p.total_memory / 2**30:.0f} GiB", f"sm{p.major}{p.minor}")
if os.environ["DEVICE"] == "cuda":
    print("nccl", dist.is_nccl_available() and torch.cuda.nccl.version())
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30),
                            device_id=torch.device("cuda", 0))
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)
    dist.barrier()
    torch.cuda.synchronize()
    print("nccl all_reduce and barrier on 1 rank: ok", x.tolist())
    dist.destroy_process_group()
PY

# Every test that needs a GPU: the cuda-marked ones, and the NCCL variants (1-rank runs of
# every package's worker on one GPU, with their values checked; the 2-rank ones where 2 GPUs
# are visible).
# Selected by marker, not by name (-k "nccl" also picked the gloo worker of the module
# test_nccl_one_rank.py).
step tests "$py" -m pytest -q -rs -p no:cacheprovider -W default::DeprecationWarning \
  --junitxml="$work/tests.xml" tests -m "cuda or nccl"

# FSDP from rank 0 never holds the whole model on the device: on 2 ranks, every rank's
# allocator peak during prepare_model stays within its shards + the largest unit or bucket in
# transit + 10%, which is below the whole model (a 1.6 GiB model; fails where it is not).
fsdp_width=4096 fsdp_depth=12
if [ "$device" = cpu ]; then fsdp_width=2048 fsdp_depth=16; fi
step fsdp_init_memory "$py" benchmarks/fsdp_init_memory.py --device "$device" \
  --width "$fsdp_width" --depth "$fsdp_depth" --ranks 2

# A single process without a group: clip, save, load on the device (the trainer's
# one-GPU debugging run).
step single_process "$py" - <<'PY'
import os
import tempfile
import torch
from distributed_strategy import clip_grad_norm, load_checkpoint, save_checkpoint
device = torch.device(os.environ["DEVICE"])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(8, 64, device=device)).pow(2).mean().backward()
norm = clip_grad_norm(model, 0.5)
assert torch.isfinite(norm) and norm > 0, norm
optimizer.step()
before = {k: v.clone() for k, v in model.state_dict().items()}
with tempfile.TemporaryDirectory() as folder:
    save_checkpoint(f"{folder}/ckpt", model, optimizer, step=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    info = load_checkpoint(f"{folder}/ckpt", model, optimizer)
assert info.step == 1
assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
print(f"single process on {device}: clip norm {float(norm):.4f}, save and load exact")
PY

# The paths that act differently on CUDA, on one NCCL rank started by init_distributed:
# prepare_model(fsdp, offload=cpu, selective checkpointing, compile), a step and clip_grad_norm
# (the norm reduced on the mesh's device while the shards live on the host), a checkpoint whose
# RNG file holds the CUDA state, save_pretrained / load_pretrained on CUDA shards.
step device_paths "$py" benchmarks/device_paths.py

# small and medium: large (sixteen 5.4 GB wraps, four checkpoint operations of a 16 GB
# state) does not fit the bench's share of the budget.
models="${MODELS:-small medium}"
dtype="${DTYPE:-bf16}"
steps="${STEPS:-10}"
if [ "$device" = cpu ]; then
  models="${MODELS:-tiny}"
  dtype="${DTYPE:-fp32}"
  steps="${STEPS:-5}"
fi
# shellcheck disable=SC2086  # $models is a list of names
# One checkpoint sample per point (ours and raw DCP): three fsynced `medium` saves cost about
# 38 GB of writes, and put `medium fsdp` past its time cap.
step bench bash -c '"$0" -m strategy_bench run --device "$1" --models $2 --dtype "$3" \
  --strategies ddp fsdp --steps "$4" --warmup 3 --ckpt-samples 1 --out "$5" --overwrite \
  --time-budget "$((STEP_LIMIT > 60 ? STEP_LIMIT - 40 : STEP_LIMIT / 2))" \
  --timeout "$((STEP_LIMIT > 30 ? STEP_LIMIT - 10 : STEP_LIMIT))"' \
  "$py" "$device" "$models" "$dtype" "$steps" "$work/bench"

# The estimate's per-rank peak against the bench's tracked peak (on CUDA the allocator's
# max_memory_allocated over one more step): --compare exits 1 beyond the tolerance (peak 10%).
# On CUDA, --gpu also predicts each step from the datasheet (peak x --assumed-mfu): at one
# rank the compute part alone, against the bench's 1-GPU steps (the step error column).
gpu_args=""
if [ "$device" = cuda ]; then gpu_args="--gpu ${GPU:-H200}"; fi
# shellcheck disable=SC2086  # $models and $4 are lists of words
step estimate_agreement bash -c '"$0" -m strategy_bench estimate --models $1 --dtype "$2" \
  --strategies ddp fsdp --world-size 1 2 --jobs 2 --compare "$3/bench/results.json" \
  --out "$3/estimate" --overwrite $4' \
  "$py" "$models" "$dtype" "$work" "$gpu_args"

# The recipe's knob that acts differently on a device, on the smallest preset: CPU offload
# (FSDP2's CPUOffloadPolicy, pinned host memory: the row's host_bytes, step time and device
# peak beside plain FSDP's and DDP's), three points that fit the step's budget (a point the
# budget skips makes the step "partial"). Activation checkpointing, gradient accumulation and
# compile each outlast it (KNOBS="offload activation_checkpointing" with a larger BUDGET).
sweep_model=small
knobs="${KNOBS:-offload}"
if [ "$device" = cpu ]; then sweep_model=tiny; fi
# shellcheck disable=SC2086  # $knobs is a list of names
step sweep bash -c '"$0" -m strategy_bench sweep --device "$1" --models "$2" --dtype "$3" \
  --knobs $4 --steps 3 --warmup 2 --out "$5" --overwrite \
  --time-budget "$((STEP_LIMIT > 30 ? STEP_LIMIT - 20 : STEP_LIMIT / 2))" \
  --timeout "$((STEP_LIMIT > 30 ? STEP_LIMIT - 10 : STEP_LIMIT))"' \
  "$py" "$device" "$sweep_model" "$dtype" "$knobs" "$work/sweep"

"$py" - "$steps_file" "$out/summary.json" "$device" "$budget" "$((SECONDS - start))" "$CAPS" \
  "$work" <<'PY'
import json
import os
import sys

steps_file, summary, device, budget, total, caps, work = sys.argv[1:]
steps = []
for line in open(steps_file, encoding="utf-8"):
    name, rc, seconds, limit = line.rstrip("\n").split("\t")
    entry = {
        "name": name,
        "status": "skipped" if rc == "skipped" else ("ok" if rc == "0" else "failed"),
        "exit_code": None if rc == "skipped" else int(rc),
        "seconds": int(seconds),
        "limit_s": int(limit),
        "log": f"logs.tar.gz:{name}.log",
    }
    # A point the bench or the sweep skipped to keep to its time budget was not measured.
    results = os.path.join(work, name, "results.json")
    if entry["status"] == "ok" and os.path.isfile(results):
        with open(results, encoding="utf-8") as f:
            skipped = json.load(f).get("skipped", [])
        if skipped:
            entry["status"] = "partial"
            entry["skipped_points"] = len(skipped)
    steps.append(entry)
ok = all(s["status"] == "ok" for s in steps)
planned = {name: int(cap) for name, cap in (entry.split(":") for entry in caps.split())}
payload = {"device": device, "budget_s": int(budget), "planned_s": sum(planned.values()),
           "total_s": int(total), "ok": ok, "caps_s": planned, "steps": steps}
with open(summary, "w", encoding="utf-8") as f:
    json.dump(payload, f, indent=2)
    f.write("\n")
print(json.dumps(payload, indent=2))
sys.exit(0 if ok else 1)
PY
status=$?

# Pack what does not come back one by one: at most 8 files in $out, the two JSONs unpacked.
rm -f "$steps_file"
for name in results.json report.md; do
  if [ -f "$work/bench/$name" ]; then cp "$work/bench/$name" "$out/$name"; fi
done
if [ -d "$work/bench" ]; then tar -czf "$out/bench.tar.gz" -C "$work" bench; fi
(cd "$work" && tar -czf ../logs.tar.gz --exclude=bench ./*)
rm -rf "$work"
exit $status
