#!/usr/bin/env bash
# Twenty-seventh session, call 3: LongFlow's fused pass at a solo step's width
# (80 columns) alone, then the gate of this build (write-back kernel, route width),
# then longflow, rkv and the mix at 600 rows resumed into .gpu/prev.json.
set -u
source bench/device_prelude.sh
for wm in 16 4; do
  timeout 60 python3 bench/longflow_fused.py --out "$W/longflow-fused-w$wm.json" --rows 600 --iters 20 \
    --configs 128:4:fp32:2 --width-multiple $wm > "$W/longflow-fused-w$wm.log" 2>&1
  echo "longflow_fused w$wm rc $? at ${SECONDS}s" >> "$W/rc.txt"
  grep -E "^\{" "$W/longflow-fused-w$wm.log" | cut -c1-700
done
COMMIT=$(cat .gpu/commit) SEEDS=" " GATE_S=230 OUT=$W/gate bash bench/gate_and_rate12.sh > "$W/gate.out" 2>&1
echo "gate rc $? at ${SECONDS}s" >> "$W/rc.txt"
pkill -9 -f "[m]ultiprocessing.spawn"; sleep 2
mkdir -p "$W/prof"; cp .gpu/prev.json "$W/prof/step-profile.json"
timeout $(( ${LAST_S:-570} - SECONDS )) python3 bench/step_profile.py bench/models/r1-distill-qwen-7b "$W/prof" \
  --policy h2o,rkv,streaming,skipkv,thinkv,crystal_kv,longflow,crystalcache --mixed 1 \
  --budget 1024 --requests 600 --kv-tokens 786432 --gen-extra 256 --window-steps 64 --steps 0 --ranges 0 \
  --warmup 0 --resume 1 --solo longflow,rkv --log-level info --policy-params '{"crystal_kv": {"think_end": ""}}' > "$W/prof.log" 2>&1
echo "profile rc $? at ${SECONDS}s" >> "$W/rc.txt"
cat "$W/rc.txt"; tail -3 "$W/gate.out" | cut -c1-300
grep -E "^(longflow|rkv|mixed)" "$W/prof.log" | cut -c1-200 | tail -5
python3 - <<'PY'
import json, os
p = os.environ["OUT"] + "/w/prof/step-profile.json"
d = json.load(open(p)) if os.path.exists(p) else {"runs": {}}
for k, r in d["runs"].items():
    print(k[:24], r["tokens_per_s_unprofiled"], r["tokens_per_s_whole_run"], r["step_ms_unprofiled"], r["window_full"],
          json.dumps(r.get("first_tokens"))[:120])
print(json.dumps(d.get("comparison", {}))[:900])
PY
cd $OUT && tar czf w.tgz w && rm -rf w
