#!/usr/bin/env bash
# Issue #29 at its own scale on one H200 (twenty-fifth session): GATE=1 first gates the build
# (tests_gpu + gpu_smoke, bench/gate_and_rate12.sh), then the eight decode-time policies alone at
# 600 rows, budget 1024, 786,432 KV tokens, resumed into .gpu/prev.json (the mix's run kept from
# 2026-12-03; the three solo runs of then re-run: SGLang's stale batch-full flag held one row back).
set -u
source bench/device_prelude.sh
if [ "${VIEW:-0}" = 1 ]; then
  timeout 60 python3 bench/view_gather.py "$W/view-gather.json" > "$W/view.log" 2>&1
  echo "view rc $? at ${SECONDS}s" >> "$W/rc.txt"; cat "$W/view.log" | tail -5
fi
if [ "${GATE:-0}" = 1 ]; then
  COMMIT=$(cat .gpu/commit) SEEDS=" " GATE_S=${GATE_S:-250} OUT=$W/gate bash bench/gate_and_rate12.sh > "$W/gate.out" 2>&1
  echo "gate rc $? at ${SECONDS}s" >> "$W/rc.txt"
  pkill -9 -f "[m]ultiprocessing.spawn"; sleep 2
fi
mkdir -p "$W/prof"
[ -f .gpu/prev.json ] && cp .gpu/prev.json "$W/prof/step-profile.json"
timeout $(( ${LAST_S:-575} - SECONDS )) python3 bench/step_profile.py bench/models/r1-distill-qwen-7b "$W/prof" \
  --policy h2o,rkv,streaming,skipkv,thinkv,crystal_kv,longflow,crystalcache --mixed 1 --mixed-first 1 \
  --budget 1024 --requests 600 --kv-tokens 786432 --gen-extra 256 --window-steps 64 --steps 0 --ranges 0 \
  --warmup 0 --resume 1 ${SOLO:+--solo $SOLO} --log-level info --policy-params '{"crystal_kv": {"think_end": ""}}' > "$W/prof.log" 2>&1
echo "profile rc $? at ${SECONDS}s" >> "$W/rc.txt"
# PROFILE_POLICY=streaming: then a kernel trace of that policy alone at the same scale, with the
# split by named range (attention, region writes, views, decisions, model layers, host).
if [ -n "${PROFILE_POLICY:-}" ] && [ $(( ${PROFILE_END:-590} - SECONDS )) -gt 100 ]; then
  pkill -9 -f "[m]ultiprocessing.spawn"; sleep 2
  timeout $(( ${PROFILE_END:-590} - SECONDS )) python3 bench/step_profile.py bench/models/r1-distill-qwen-7b "$W/prof" \
    --policy "$PROFILE_POLICY" --budget 1024 --requests 600 --kv-tokens 786432 --gen-extra 256 --steps 16 \
    --ranges 1 --activities CPU,GPU --warmup 0 --out "profile-$PROFILE_POLICY.json" > "$W/prof-trace.log" 2>&1
  echo "trace rc $? at ${SECONDS}s" >> "$W/rc.txt"
  grep -E "^(split|per policy|kernel|\{)" "$W/prof-trace.log" | head -20 | cut -c1-300
fi
cat "$W/rc.txt"; tail -3 "$W/gate.out" 2>/dev/null | cut -c1-300
python3 - <<'PY'
import json, os
p = os.environ["OUT"] + "/w/prof/step-profile.json"
d = json.load(open(p)) if os.path.exists(p) else {"runs": {}}
for k, r in d["runs"].items():
    print(k, r["tokens_per_s_unprofiled"], r["tokens_per_s_whole_run"], r["whole_run_s"], r["window_full"], r["ramp_s"],
          json.dumps(r.get("first_tokens"))[:300])
print(json.dumps(d.get("comparison", {}))[:1200])
PY
grep -E "Prefill batch" "$W/prof.log" | grep -v "#queue-req: 0," | tail -5 | cut -c1-220
tail -3 "$W/prof.log" | cut -c1-300
cd $OUT && tar czf w.tgz w && rm -rf w
