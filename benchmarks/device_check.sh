#!/usr/bin/env bash
# One prepared device check, from the source tree: the CUDA/NCCL tests first, the CUDA
# benchmark second. Everything it writes goes under $OUT (default ./device-results):
#     probe.log, tests.log, tests.xml, fsdp_init_memory.log, bench.log,
#     bench/ (results.json, plots), summary.json
#
# For a GPU machine without nox or network (torch, matplotlib, pytest and numpy preinstalled):
#     OUT=/somewhere bash benchmarks/device_check.sh
# Checked on CPU with DEVICE=cpu, which runs the same steps (the CUDA tests skip, saying why;
# the bench runs the tiny preset on gloo).
#
# The whole script fits BUDGET seconds (default 540, under the 600 s one command may run on
# the lent machine): each step gets at most its own cap and never more than what is left.
# summary.json records every step's exit status and wall time; the script exits 1 if any
# step failed (a step's status is its own command's, never a pipe's last).
set -u
cd "$(dirname "$0")/.."
out="${OUT:-device-results}"
device="${DEVICE:-cuda}"
budget="${BUDGET:-540}"
mkdir -p "$out"
src=""
for dir in packages/*/src benchmarks/src; do src="$src:$PWD/$dir"; done
export PYTHONPATH="${src#:}:$PWD/tests/_support:$PWD/benchmarks/microbench:$PWD/docs/examples"
export PYTHONUNBUFFERED=1
steps_file="$out/.steps"
: > "$steps_file"
start=$SECONDS

# step NAME CAP_S COMMAND...: run COMMAND with its output in $out/NAME.log, for at most
# min(CAP_S, what is left of the budget minus a reserve for the summary).
step() {
  local name="$1" cap="$2"
  shift 2
  local left=$((budget - (SECONDS - start) - 10))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 5 ]; then
    echo "== $name: skipped, the budget is spent"
    printf '%s\t%s\t%s\t%s\n' "$name" "skipped" 0 0 >> "$steps_file"
    return
  fi
  echo "== $name (at most ${limit} s)"
  local t0=$SECONDS
  STEP_LIMIT="$limit" timeout --kill-after=5 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local took=$((SECONDS - t0))
  tail -n 15 "$out/$name.log"
  echo "== $name: exit $rc after ${took} s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$took" "$limit" >> "$steps_file"
}

step probe 60 python - <<'PY'
import torch
import torch.distributed as dist
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}", p.name, f"{p.total_memory / 2**30:.0f} GiB", f"sm{p.major}{p.minor}")
print("nccl", dist.is_nccl_available() and torch.cuda.nccl.version())
PY

# Every test that needs a GPU: the cuda-marked ones, and the NCCL variants (1-rank runs of
# every package's multi-rank worker on one GPU; the 2-rank ones where 2 GPUs are visible).
step tests 240 python -m pytest -q -rs -p no:cacheprovider --junitxml="$out/tests.xml" \
  tests -k "cuda or nccl"

# FSDP from rank 0 never holds the whole model on the device: the allocator's peak during
# prepare_model stays within this rank's shards + the largest unit + 10% (a 1.6 GiB model).
fsdp_width=4096
if [ "$device" = cpu ]; then fsdp_width=512; fi
step fsdp_init_memory 60 python benchmarks/fsdp_init_memory.py --device "$device" \
  --width "$fsdp_width" --depth 12

models="${MODELS:-small large}"
dtype="${DTYPE:-bf16}"
if [ "$device" = cpu ]; then
  models="${MODELS:-tiny}"
  dtype="${DTYPE:-fp32}"
fi
# shellcheck disable=SC2086  # $models is a list of names
step bench 300 bash -c 'python -m strategy_bench run --device "$0" --models $1 --dtype "$2" \
  --strategies ddp fsdp --steps "${STEPS:-20}" --warmup 5 --out "$3" \
  --timeout "$((STEP_LIMIT > 30 ? STEP_LIMIT - 10 : STEP_LIMIT))"' \
  "$device" "$models" "$dtype" "$out/bench"

python - "$steps_file" "$out/summary.json" "$device" "$budget" "$((SECONDS - start))" <<'PY'
import json
import sys

steps_file, summary, device, budget, total = sys.argv[1:]
steps = []
for line in open(steps_file, encoding="utf-8"):
    name, rc, seconds, limit = line.rstrip("\n").split("\t")
    steps.append({
        "name": name,
        "status": "skipped" if rc == "skipped" else ("ok" if rc == "0" else "failed"),
        "exit_code": None if rc == "skipped" else int(rc),
        "seconds": int(seconds),
        "limit_s": int(limit),
        "log": f"{name}.log",
    })
ok = all(s["status"] == "ok" for s in steps)
payload = {"device": device, "budget_s": int(budget), "total_s": int(total), "ok": ok,
           "steps": steps}
with open(summary, "w", encoding="utf-8") as f:
    json.dump(payload, f, indent=2)
    f.write("\n")
print(json.dumps(payload, indent=2))
sys.exit(0 if ok else 1)
PY
status=$?
rm -f "$steps_file"
exit $status
