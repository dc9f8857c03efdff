#!/usr/bin/env bash
# The SmolLM2-135M-Instruct grid of docs/results.md, as it ran on the shared
# 2-core CPU machine: two pipelines side by side (math; needle + delayed
# association), one SGLang thread each, resumable (rerun to continue).
# Seed policies first, then the baselines; budgets in priority order.
# The long tasks' fractions are budget_ratio (rX: X of the private tokens so
# far; the whole context is compressed, so about X of the full run's KV):
# a budget a request can carry, so each cell is also a point for
# `kvsieve calibrate auto --from-results`.
# The long prompts are prefilled in 512-token chunks, two requests at a time:
# under the machine's load a whole 2K-token compressed prefill could pass
# SGLang's 300 s scheduler watchdog, which then kills the server.
#   bash bench/eval/grid_smollm2.sh math|long
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
PY=${PY:-.venv/bin/python}
# A server can die under the machine's load (SGLang's watchdog, the OOM
# killer): each run is resumable, so it is retried a few times.
retry() {
  for attempt in 1 2 3 4 5 6; do
    "$@" && return 0
    echo "grid_smollm2: attempt $attempt failed; resuming in 30 s" >&2
    sleep 30
  done
  return 1
}
SEED=thinkv,crystal_kv,skipkv,rkv
BASE=streaming,h2o
PROMPT_CUTTERS=snapkv,longflow
case "${1:-}" in
math)
  out=bench/results/eval-smollm2-grid-math.json
  common=(--out "$out" --tasks math --math 100 --concurrency 32 --serve-arg=--max-total-tokens=24576)
  retry $PY -m bench.eval run "${common[@]}" --policies full --budgets f0.2
  for budget in f0.2 128; do
    # crystalcache, snapkv and longflow compress the prompt: each group runs on
    # a fresh server before any decode-time policy has put the math prompts in
    # SGLang's radix cache (a cached prompt is kept whole, outside the budget).
    retry $PY -m bench.eval run "${common[@]}" --policies "crystalcache,$SEED" --budgets "$budget"
    retry $PY -m bench.eval run "${common[@]}" --policies "$PROMPT_CUTTERS,$BASE" --budgets "$budget"
  done
  ;;
long)
  out=bench/results/eval-smollm2-long.json
  retry $PY -m bench.eval run --out "$out" --tasks needle,da --needle-lengths 1024,2048 --needle-depths 0,0.5,1 \
    --da-distances 1024,2048 --da-samples 1 --concurrency 2 --serve-arg=--max-total-tokens=12288 \
    --serve-arg=--chunked-prefill-size=512 \
    --policies "crystalcache,$SEED,$PROMPT_CUTTERS,$BASE" --budgets r0.1,256,r0.4,128,r0.2,512,64,r0.05
  ;;
*)
  echo "usage: $0 math|long" >&2
  exit 2
  ;;
esac
