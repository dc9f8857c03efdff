#!/usr/bin/env bash
# The built-in `-paper` presets beside their fast defaults (docs/results.md,
# "Paper presets against the fast defaults"): the same model, problems,
# server arguments and concurrency as grid_qwen_math.sh, into the same
# results file, so each preset cell sits beside its policy's cell at the same
# budget. Run grid_qwen_math.sh first (`full` and the fast defaults).
#   [BUDGETS=f0.4] [DECODE=...] [PROMPT=...] [BETA=...] bash bench/eval/grid_qwen_math_presets.sh [PROBLEMS]
# DECODE: presets of the decode-time policies, run at BUDGETS (the cell's
# budget replaces the preset's 1024); PROMPT: presets of the policies that
# compress the prompt, run at BUDGETS on a fresh server (a prompt found in
# SGLang's radix cache is kept whole); BETA: crystalcache's presets, run at
# their own budget_ratio (`preset` budget: beta is what defines them), on a
# fresh server. An empty list skips its group.
# thinkv-paper and longflow-paper(-2400) set nothing but their budget beyond
# their policy's defaults, so at a cell's budget they are their fast default
# again; crystalcache-paper-b30 and -b50 hold the same B = max(132, beta n)
# on prompts under 264 tokens.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-$HOME/.cache/kvsieve/models/Qwen2.5-Coder-0.5B-Instruct}
N=${1:-32}
BUDGETS=${BUDGETS:-f0.4}
DECODE=${DECODE-rkv-paper,skipkv-paper,crystal_kv-paper,thinkv-paper}
PROMPT=${PROMPT-longflow-paper,longflow-paper-2400}
BETA=${BETA-crystalcache-paper-b30,crystalcache-paper-b50}
out=${OUT:-bench/results/eval-qwen-coder-0.5b-math.json}
common=(--model "$MODEL" --out "$out" --tasks math --math "$N" --concurrency 16
        --serve-arg=--max-total-tokens=24576)
$PY -m bench.eval run "${common[@]}" --policies full --budgets f0.4  # done already: starts nothing
[ -z "$DECODE" ] || $PY -m bench.eval run "${common[@]}" --policies "$DECODE" --budgets "$BUDGETS"
[ -z "$BETA" ] || $PY -m bench.eval run "${common[@]}" --policies "$BETA" --budgets preset
[ -z "$PROMPT" ] || $PY -m bench.eval run "${common[@]}" --policies "$PROMPT" --budgets "$BUDGETS"
