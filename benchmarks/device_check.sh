#!/usr/bin/env bash
# One prepared device check: the CUDA tests and the CUDA benchmark, from the source tree.
#
# For a GPU machine without nox or network (torch, matplotlib, pytest and numpy preinstalled):
#     bash benchmarks/device_check.sh            # results under $OUT (or ./device-results)
# Checked on CPU with DEVICE=cpu, which runs the same steps on gloo.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-device-results}"
device="${DEVICE:-cuda}"
mkdir -p "$out"
src=""
for dir in packages/*/src benchmarks/src; do src="$src:$PWD/$dir"; done
export PYTHONPATH="${src#:}:$PWD/tests/_support:$PWD/benchmarks/microbench:$PWD/docs/examples"
export PYTHONUNBUFFERED=1
status=0

{
  python - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY
  # Every test that needs a GPU, plus the suites whose behaviour differs on one.
  timeout 240 python -m pytest -q -p no:cacheprovider -m "cuda" tests/rng_fork tests/replica_init
  timeout 240 python -m pytest -q -p no:cacheprovider tests/ddp_wrap tests/fsdp_wrap \
      tests/distributed_strategy -x
} 2>&1 | tee "$out/tests.log" || status=1

models="${MODELS:-small medium large}"
[ "$device" = cpu ] && models="${MODELS:-tiny}"
timeout "${BENCH_TIMEOUT:-300}" python -m strategy_bench run --device "$device" \
    --models $models --dtype "${DTYPE:-bf16}" --steps "${STEPS:-20}" --warmup 5 \
    --out "$out/bench" 2>&1 | tee "$out/bench.log" || status=1
exit $status
