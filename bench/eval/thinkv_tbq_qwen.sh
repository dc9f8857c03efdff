#!/usr/bin/env bash
# ThinKV without TBQ on Qwen2.5-Coder-0.5B-Instruct's GSM-style math (CPU):
# the grid's problems (bench/eval/grid_qwen_math.sh: seed 0, 32 problems,
# greedy, 16 at a time), `full` again and thinkv at 20% and 40% of full's KV,
# on a server whose region has no quantized pages
# (KVSIEVE_REGION_QUANT_SHARE=0: thinkv then runs without TBQ and says so in
# kv_usage.tbq). The grid's thinkv cells are the same with TBQ (the default).
# `full` runs again here, so the file also shows how much `full` moves
# between two servers. Resumable (rerun to continue).
#   bash bench/eval/thinkv_tbq_qwen.sh [PROBLEMS]
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-$HOME/.cache/kvsieve/models/Qwen2.5-Coder-0.5B-Instruct}
N=${1:-32}
KVSIEVE_REGION_QUANT_SHARE=0 $PY -m bench.eval run --model "$MODEL" \
  --out bench/results/eval-qwen-coder-0.5b-thinkv-notbq-math.json --tasks math --math "$N" --concurrency 16 \
  --serve-arg=--max-total-tokens=24576 --policies full,thinkv --budgets f0.2,f0.4
