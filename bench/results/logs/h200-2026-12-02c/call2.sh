#!/usr/bin/env bash
# Call 2 (2026-12-02, twentieth session): gate of 2125d55 (CrystalCache's keep step captured); traffic 4/8 with counters; the ten-policy mixed batch with its step log.
set -u
W=$OUT/w; mkdir -p $W
[ -d /tmp/site/sglang ] || bash .whl/device-setup.sh > $W/setup.log 2>&1
python3 -m pip install -q --no-deps --upgrade --target /tmp/site2 .gpu/kvsieve*.whl
python3 -m pip install -q --no-deps --upgrade --target /tmp/kvdeps .kvdeps/*.whl
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PYTHONPATH=/tmp/site2:/tmp/kvdeps:/tmp/site
echo "setup done at ${SECONDS}s" > $W/rc.txt
COMMIT=2125d55 SEEDS=" " GATE_S=${GATE_S:-290} OUT=$W/gate bash bench/gate_and_rate12.sh > $W/gate.out 2>&1
echo "gate done at ${SECONDS}s" >> $W/rc.txt
pkill -9 -f "[m]ultiprocessing.spawn"; sleep 2
if [ $SECONDS -lt 330 ]; then
  timeout 170 python3 bench/traffic.py --engines kvsieve --rates 4,8 --duration 20 --gen-min 128 --gen-max 4096 --budget 256 --kv-tokens 196608 --pool-share 0.6 --rate-timeout 30 --seed 0 --deadline 165 --commit 2125d55 --baseline bench/results/traffic-h200-2026-11-29b.json --out $W/traffic.json 2>&1 | grep -av "Capturing\|Loading\|Ignore import" > $W/traffic.log
  echo "traffic rc $? at ${SECONDS}s" >> $W/rc.txt
  python3 bench/capture_churn.py $W/traffic-steps.jsonl --out $W/churn-traffic.json > $W/churn-traffic.log 2>&1
  pkill -9 -f "[m]ultiprocessing.spawn"; sleep 2
fi
M=bench/models/r1-distill-qwen-7b
A="--policy h2o,rkv,streaming,snapkv,skipkv,thinkv,crystal_kv,longflow,crystalcache,full --mixed-only 1 --budget 256 --requests 128 --kv-tokens 196608 --ranges 0 --gen-extra 320 --steps 0 --window-steps 64"
if [ $SECONDS -lt 480 ]; then
  KVSIEVE_STEP_LOG=$W/steps-mixed.jsonl timeout 110 python3 bench/step_profile.py $M $W/prof-mixed $A > $W/prof-mixed.log 2>&1
  echo "mixed rc $? at ${SECONDS}s" >> $W/rc.txt
  python3 bench/capture_churn.py $W/steps-mixed.jsonl --out $W/churn-mixed.json > $W/churn-mixed.log 2>&1
fi
cat $W/rc.txt; tail -4 $W/gate.out; grep -a "rate .*offered" $W/traffic.log | cut -c1-300; tail -3 $W/churn-traffic.log; grep -a "tok/s" $W/prof-mixed.log | tail -3; tail -12 $W/churn-mixed.log 2>/dev/null
python3 - <<PY
import json
for f in ('$W/traffic-steps.jsonl','$W/steps-mixed.jsonl'):
    try: L=[json.loads(l) for l in open(f) if l.strip()]
    except OSError: continue
    c=[x['counters'] for x in L if 'counters' in x]
    if c: print(f.split('/')[-1], {k: c[-1].get(k,0)-c[0].get(k,0) for k in c[-1]})
PY
gzip -f $W/*.jsonl; cd $OUT && tar czf w.tgz w && rm -rf w
