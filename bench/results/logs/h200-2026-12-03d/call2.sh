#!/usr/bin/env bash
# Twenty-seventh session, call 2 (no engine change since 9a07fa1's gate): a kernel
# trace of longflow alone at 600 rows (where its step goes: issue #29's 5x), the
# 320-row ten-policy equality check on today's kernels, then streaming's trace.
set -u
source bench/device_prelude.sh
mkdir -p "$W/prof"
trace() {  # $1 policy, $2 deadline (seconds since the call began)
  pkill -9 -f "[m]ultiprocessing.spawn"; sleep 2
  timeout $(( $2 - SECONDS )) python3 bench/step_profile.py bench/models/r1-distill-qwen-7b "$W/prof" \
    --policy "$1" --budget 1024 --requests 600 --kv-tokens 786432 --gen-extra 256 --steps 16 \
    --ranges 1 --activities CPU,GPU --warmup 0 --out "profile-$1.json" > "$W/trace-$1.log" 2>&1
  echo "trace $1 rc $? at ${SECONDS}s" >> "$W/rc.txt"
  grep -E "^(split|per policy|kernel)" "$W/trace-$1.log" | head -16 | cut -c1-260
}
trace longflow 260
pkill -9 -f "[m]ultiprocessing.spawn"; sleep 2
timeout $(( 400 - SECONDS )) python3 bench/mixed_equality.py --out "$W/mixed-equality.json" --commit "$(cat .gpu/commit)" \
  --batch-check crystalcache,longflow --same-size full --deadline $(( 390 - SECONDS )) > "$W/equality.log" 2>&1
echo "equality rc $? at ${SECONDS}s" >> "$W/rc.txt"
python3 -c "import json; d = json.load(open('$W/mixed-equality.json')); print(d['totals']); print(d['verdict'])" 2>&1 | cut -c1-1500
[ $(( 575 - SECONDS )) -gt 150 ] && trace streaming 575
cat "$W/rc.txt"
cd $OUT && tar czf w.tgz w && rm -rf w
