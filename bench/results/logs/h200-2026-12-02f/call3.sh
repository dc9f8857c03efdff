#!/usr/bin/env bash
# Call 3 (2026-12-02, twenty-third session): the 320-row ten-policy equality check on COMMIT's kernels (issue #29 item 5), then the eight members and their mix with no profiled steps (--steps 0: the whole run clean) and the mix last (--mixed-first 0), with the step log cut by run and phase.
set -u
source bench/device_prelude.sh
timeout 330 python3 bench/mixed_equality.py --out $W/eq.json --commit $1 --same-size crystalcache,longflow,rkv --deadline 300 > $W/eq.log 2>&1
echo "equality rc $? at ${SECONDS}s" >> $W/rc.txt
pkill -9 -f "[m]ultiprocessing.spawn"; sleep 2
KVSIEVE_STEP_LOG=$W/steps.jsonl timeout $((540 - SECONDS)) python3 bench/step_profile.py \
    bench/models/r1-distill-qwen-7b "$W/prof" --policy h2o,rkv,streaming,skipkv,thinkv,crystal_kv,longflow,crystalcache \
    --mixed 1 --mixed-first 0 --budget 256 --requests 128 --kv-tokens 196608 --ranges 0 --activities GPU --gen-extra 320 \
    --steps 0 --window-steps 64 > "$W/prof.log" 2>&1
echo "profile rc $? at ${SECONDS}s" >> $W/rc.txt
[ -f $W/prof/step-profile.json ] && python3 bench/capture_churn.py $W/steps.jsonl --profile $W/prof/step-profile.json --out $W/churn.json > $W/churn.log 2>&1
cat $W/rc.txt; tail -16 $W/eq.log | cut -c1-220
python3 - <<'PY'
import json, os
w = os.environ["OUT"] + "/w"
d = json.load(open(w + "/prof/step-profile.json"))
print(json.dumps(d.get("comparison", {}))[:1800])
PY
cd $OUT && tar czf w.tgz w && rm -rf w
