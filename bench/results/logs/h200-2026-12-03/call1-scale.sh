#!/usr/bin/env bash
# Issue #29 at its own scale on one H200 (2026-12-03, twenty-fourth session): the eight decode-time
# policies alone and mixed at 600 rows, budget 1024, 786,432 KV tokens (the H100 headline's memory),
# resumed over calls (.gpu/prev.json: the earlier call's JSON); VANILLA=1 first runs vanilla SGLang's
# 16K generation at the same KV memory (bench/gpu_headline.py).
set -u
source bench/device_prelude.sh
if [ "${VANILLA:-0}" = 1 ]; then
  timeout 240 python3 bench/gpu_headline.py bench/models/r1-distill-qwen-7b "$W/headline" --parts vanilla \
    --generate 16384 --tail 128 --kv-tokens 786432 > "$W/vanilla.log" 2>&1
  echo "vanilla rc $? at ${SECONDS}s" >> "$W/rc.txt"
  pkill -9 -f "[m]ultiprocessing.spawn"; sleep 2
fi
mkdir -p "$W/prof"
[ -f .gpu/prev.json ] && cp .gpu/prev.json "$W/prof/step-profile.json"
timeout $(( ${LAST_S:-575} - SECONDS )) python3 bench/step_profile.py bench/models/r1-distill-qwen-7b "$W/prof" \
  --policy h2o,rkv,streaming,skipkv,thinkv,crystal_kv,longflow,crystalcache --mixed 1 --mixed-first 1 \
  --budget 1024 --requests 600 --kv-tokens 786432 --gen-extra 256 --window-steps 64 --steps 0 --ranges 0 \
  --warmup 0 --resume 1 --policy-params '{"crystal_kv": {"think_end": ""}}' > "$W/prof.log" 2>&1
echo "profile rc $? at ${SECONDS}s" >> "$W/rc.txt"
cat "$W/rc.txt"; grep -E "^(vanilla|check)" "$W/vanilla.log" 2>/dev/null | cut -c1-400
python3 - <<'PY'
import json, os
p = os.environ["OUT"] + "/w/prof/step-profile.json"
if os.path.exists(p):
    d = json.load(open(p))
    for k, r in d["runs"].items():
        print(k, r["tokens_per_s_unprofiled"], r["tokens_per_s_whole_run"], r["whole_run_s"], r["window_full"], r["ramp_s"])
    print(json.dumps(d.get("comparison", {}))[:1500])
PY
tail -5 "$W/prof.log"
cd $OUT && tar czf w.tgz w && rm -rf w
