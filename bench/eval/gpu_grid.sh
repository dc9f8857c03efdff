#!/usr/bin/env bash
# Qwen2.5-Coder-0.5B-Instruct on one GPU (docs/results.md, "The GPU grid"):
# math x 100 (up to 1,024 tokens of work each) for every policy at 20%, 40%
# and 10% of full's KV, 128 tokens and the no-eviction reference; needle +
# delayed association (30 + 24 items, 1-4K-token contexts compressed whole)
# at 64-512 tokens and the reference. 512 requests in flight, several cells
# per batch. Every phase resumes its results file (rerun to continue).
#
#   bash bench/eval/gpu_grid.sh MODEL_DIR RESULTS_DIR ITEMS_DIR PHASE...
#     PHASE: math-full | math-prompt | math-decode | long
#
# ITEMS_DIR holds items-qwen-math.json and items-qwen-long.json (the
# harness's --items-file): made where reasoning-gym is installed, read on a
# GPU host without it (a missing file is built, which needs reasoning-gym).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
model=$1 results=$2 items=$3
shift 3
MATH_BUDGETS=${MATH_BUDGETS:-f0.2,f0.4,f0.1,128,ref}
LONG_BUDGETS=${LONG_BUDGETS:-128,256,64,512,ref}
gpu=(--model "$model" --concurrency 512 --serve-arg=--device=cuda --serve-arg=--max-total-tokens=262144
     --serve-arg=--max-running-requests=512)
math=("${gpu[@]}" --out "$results/eval-qwen-coder-0.5b-gpu-math.json" --items-file "$items/items-qwen-math.json"
      --tasks math --math 100 --math-max-tokens 1024)
long=("${gpu[@]}" --out "$results/eval-qwen-coder-0.5b-gpu-long.json" --items-file "$items/items-qwen-long.json"
      --tasks needle,da --needle-lengths 1024,2048,4096 --needle-reps 2 --da-distances 1024,2048,4096
      --da-samples 4)
for phase in "$@"; do
  case $phase in
    math-full) $PY -m bench.eval run "${math[@]}" --policies full --budgets f0.2 ;;
    # crystalcache, longflow and snapkv compress the math prompt by default:
    # their server starts before any decode-time policy has put the prompts
    # in SGLang's radix cache (a prompt found there is kept whole).
    math-prompt) $PY -m bench.eval run "${math[@]}" --policies crystalcache,longflow,snapkv --budgets "$MATH_BUDGETS" ;;
    math-decode) $PY -m bench.eval run "${math[@]}" --policies thinkv,crystal_kv,skipkv,rkv,h2o,streaming \
                   --budgets "$MATH_BUDGETS" ;;
    long) $PY -m bench.eval run "${long[@]}" --policies all --budgets "$LONG_BUDGETS" ;;
    *) echo "unknown phase $phase (math-full, math-prompt, math-decode, long)" >&2; exit 2 ;;
  esac
done
