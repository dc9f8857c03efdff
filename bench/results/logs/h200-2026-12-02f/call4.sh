#!/usr/bin/env bash
# Call 4 (2026-12-02, twenty-third session): the eight members and their mix on COMMIT's kernels twice, no profiled steps, longer windows (128 steps; 448 tokens past the budget): once with the mix last, once first, to see how much of the window's and the whole run's ratios is run order and noise.
set -u
source bench/device_prelude.sh
for first in 0 1; do
  timeout $(( (first == 0 ? 225 : 410) - SECONDS )) python3 bench/step_profile.py \
    bench/models/r1-distill-qwen-7b "$W/prof$first" --policy h2o,rkv,streaming,skipkv,thinkv,crystal_kv,longflow,crystalcache \
    --mixed 1 --mixed-first $first --budget 256 --requests 128 --kv-tokens 196608 --ranges 0 --activities GPU --gen-extra 448 \
    --steps 0 --window-steps 128 > "$W/prof$first.log" 2>&1
  echo "profile mixed-first $first rc $? at ${SECONDS}s" >> $W/rc.txt
  pkill -9 -f "[m]ultiprocessing.spawn"; sleep 2
done
cat $W/rc.txt
python3 - <<'PY'
import json, os
w = os.environ["OUT"] + "/w"
for first in (0, 1):
    p = f"{w}/prof{first}/step-profile.json"
    if os.path.exists(p):
        c = json.load(open(p)).get("comparison", {})
        wr = c.get("whole_run", {})
        print(first, c.get("mixed_tokens_per_s"), c.get("members_harmonic_mean_tokens_per_s"), c.get("ratio"), wr.get("ratio"), wr.get("ramp", {}).get("ratio"), wr.get("after_ramp", {}).get("ratio"))
PY
cd $OUT && tar czf w.tgz w && rm -rf w
