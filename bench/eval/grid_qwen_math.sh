#!/usr/bin/env bash
# Qwen2.5-Coder-0.5B-Instruct on GSM-style math (docs/results.md): `full`,
# then every policy at 20% and 40% of full's KV (BUDGETS to change), one
# server per group, 16 requests at a time, resumable (rerun to continue). SmolLM2 solves 1% of
# these problems, so its math cells cannot tell policies apart; this model
# solves some.
#   [BUDGETS=f0.2,f0.4] bash bench/eval/grid_qwen_math.sh [PROBLEMS]
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-$HOME/.cache/kvsieve/models/Qwen2.5-Coder-0.5B-Instruct}
N=${1:-32}
BUDGETS=${BUDGETS:-f0.2,f0.4}
out=bench/results/eval-qwen-coder-0.5b-math.json
common=(--model "$MODEL" --out "$out" --tasks math --math "$N" --concurrency 16
        --serve-arg=--max-total-tokens=24576)
$PY -m bench.eval run "${common[@]}" --policies full --budgets f0.2
# crystalcache, longflow and snapkv compress the prompt: their server
# starts before any decode-time policy has put the prompts in SGLang's
# radix cache (a prompt found there is kept whole, outside the budget;
# their own compressed prompts do not enter it).
$PY -m bench.eval run "${common[@]}" --policies crystalcache,longflow,snapkv --budgets "$BUDGETS"
$PY -m bench.eval run "${common[@]}" --policies thinkv,crystal_kv,skipkv,rkv,h2o,streaming --budgets "$BUDGETS"
