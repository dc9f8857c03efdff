#!/usr/bin/env bash
# ThinKV with and without TBQ on SmolLM2-135M-Instruct (CPU): the same
# needle + delayed-association items and GSM-style math problems, the same
# budgets, one server each; the only difference is whether the region has
# quantized pages (KVSIEVE_REGION_QUANT_SHARE=0: none, so thinkv runs
# without TBQ and says so in kv_usage.tbq). Resumable (rerun to continue).
#   bash bench/eval/thinkv_tbq_smollm2.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
PY=${PY:-.venv/bin/python}
run() {  # $1: results file; the rest: environment for the server
  local out=$1; shift
  env "$@" $PY -m bench.eval run --out "$out" --tasks needle,da --needle-lengths 1024,2048 \
    --needle-depths 0,0.5,1 --da-distances 1024,2048 --da-samples 1 --concurrency 2 \
    --serve-arg=--max-total-tokens=12288 --serve-arg=--chunked-prefill-size=512 \
    --policies thinkv --budgets r0.1,r0.2
  env "$@" $PY -m bench.eval run --out "${out%.json}-math.json" --tasks math --math 12 --concurrency 4 \
    --serve-arg=--max-total-tokens=12288 --policies full,thinkv --budgets 128
}
run bench/results/eval-smollm2-thinkv-tbq.json KVSIEVE_REGION_QUANT_SHARE=0.5
run bench/results/eval-smollm2-thinkv-notbq.json KVSIEVE_REGION_QUANT_SHARE=0
