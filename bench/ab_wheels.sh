#!/usr/bin/env bash
# A/B of two builds of kvsieve in one device call: the same step profile of
# a mixed batch, alternating between the builds (A B A B ...), one engine per
# run, so that run-to-run spread (6,425-7,216 tok/s for one commit in two
# calls on 2026-11-29) shows beside the difference.
#
#   bash bench/ab_wheels.sh            (after `bash .whl/device-setup.sh`)
#
# Environment:
#   WHEEL_A, WHEEL_B  the two wheels (default: .gpu-a/*.whl, .gpu-b/*.whl;
#                     build them with `pip wheel --no-deps <tree> -w .gpu-a/`)
#   ROUNDS            rounds of A then B (default 2)
#   RUN_S             seconds one run may take (default 110)
#   COLD_S            more seconds for the call's first run (default 120): a
#                     cold machine compiles its Triton kernels and captures
#                     in it (2026-11-29: a first run of 150 s was cut)
#   PROFILE_ARGS      the step_profile options after MODEL and OUT (default:
#                     the ten-policy mixed batch alone, 128 rows, budget 256)
#   MODEL, DEVICE     default bench/models/r1-distill-qwen-7b, cuda (DEVICE=cpu
#                     runs the same on tests/tiny_models.py's Llama)
# Writes $OUT/ab.json: per build the runs' tok/s and their median.
set -u
OUT=${OUT:-./ab-out}
mkdir -p "$OUT"
WHEEL_A=${WHEEL_A:-$(ls .gpu-a/*.whl 2>/dev/null | head -1)}
WHEEL_B=${WHEEL_B:-$(ls .gpu-b/*.whl 2>/dev/null | head -1)}
ROUNDS=${ROUNDS:-2}
RUN_S=${RUN_S:-110}
COLD_S=${COLD_S:-120}
first=1
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-bench/models/r1-distill-qwen-7b}
MIX=full,h2o,rkv,streaming,snapkv,skipkv,thinkv,crystal_kv,longflow,crystalcache
if [ "$DEVICE" = cpu ]; then
    DEFAULT_ARGS="--device cpu --policy streaming,h2o --mixed-only 1 --budget 8 --requests 4"
else
    DEFAULT_ARGS="--policy $MIX --mixed-only 1 --budget 256 --requests 128 --kv-tokens 196608 --steps 0 --window-steps 128 --gen-extra 320"
fi
PROFILE_ARGS=${PROFILE_ARGS:-$DEFAULT_ARGS}
for label in a b; do
    wheel=$([ $label = a ] && echo "$WHEEL_A" || echo "$WHEEL_B")
    [ -f "$wheel" ] || { echo "no wheel for $label ($wheel)"; exit 2; }
    python3 -m pip install -q --no-deps --upgrade --target /tmp/site-$label "$wheel" || exit 2
done
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
BASE=${BASE_PYTHONPATH-/tmp/site}  # SGLang and torch (the device set-up's); set empty where they are installed
for round in $(seq 1 "$ROUNDS"); do
    for label in a b; do
        dir="$OUT/$label-$round"
        mkdir -p "$dir"
        # Each build's own kvsieve first on the path (the log's first line names it).
        export PYTHONPATH=/tmp/site-$label${BASE:+:$BASE}
        python3 -c "import kvsieve.kernels as k; print('kvsieve from', k.__path__[0])" > "$dir/run.log" 2>&1
        limit=$(( RUN_S + first * COLD_S )); first=0
        timeout "$limit" python3 bench/step_profile.py "$MODEL" "$dir" $PROFILE_ARGS >> "$dir/run.log" 2>&1
        echo "$label round $round: exit $? $(grep -ao '"tokens_per_s_unprofiled": [0-9.]*' "$dir/step-profile.json" 2>/dev/null | head -1)"
        pkill -9 -f "[m]ultiprocessing.spawn"; sleep 2
    done
done
python3 - "$OUT" "$WHEEL_A" "$WHEEL_B" <<'EOF'
import json, statistics, sys
from pathlib import Path

out, wheels = Path(sys.argv[1]), {"a": sys.argv[2], "b": sys.argv[3]}
result = {"wheels": wheels, "runs": {}, "median_tokens_per_s": {}}
for label in wheels:
    rates = []
    for path in sorted(out.glob(f"{label}-*/step-profile.json")):
        runs = json.loads(path.read_text())["runs"]
        rates += [r["tokens_per_s_unprofiled"] for r in runs.values()]
    result["runs"][label] = rates
    result["median_tokens_per_s"][label] = statistics.median(rates) if rates else None
(out / "ab.json").write_text(json.dumps(result, indent=1))
print(json.dumps(result))
EOF
