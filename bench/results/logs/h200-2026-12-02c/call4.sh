#!/usr/bin/env bash
# Call 4 (2026-12-02, twentieth session): which members make a mixed step's attention dearer: the mixed batch without `full` rows (9 policies) and without `full` and thinkv (8), 128 rows each, with GPU-only kernel traces (--ranges 0 --activities GPU --steps 16).
set -u
W=$OUT/w; mkdir -p $W
[ -d /tmp/site/sglang ] || bash .whl/device-setup.sh > $W/setup.log 2>&1
python3 -m pip install -q --no-deps --upgrade --target /tmp/site2 .gpu/kvsieve*.whl
python3 -m pip install -q --no-deps --upgrade --target /tmp/kvdeps .kvdeps/*.whl
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PYTHONPATH=/tmp/site2:/tmp/kvdeps:/tmp/site
echo "setup done at ${SECONDS}s" > $W/rc.txt
M=bench/models/r1-distill-qwen-7b
A="--mixed-only 1 --budget 256 --requests 128 --kv-tokens 196608 --ranges 0 --activities GPU --gen-extra 320 --steps 16 --window-steps 64"
run() {  # name policies
  if [ $SECONDS -gt 240 ]; then echo "$1 skipped at ${SECONDS}s" >> $W/rc.txt; return; fi
  timeout $3 python3 bench/step_profile.py $M $W/$1 --policy $2 $A > $W/$1.log 2>&1
  echo "$1 rc $? at ${SECONDS}s" >> $W/rc.txt
  pkill -9 -f "[m]ultiprocessing.spawn"; sleep 2
}
run nofull h2o,rkv,streaming,snapkv,skipkv,thinkv,crystal_kv,longflow,crystalcache 200
run nofull-nothinkv h2o,rkv,streaming,snapkv,skipkv,crystal_kv,longflow,crystalcache 120
cat $W/rc.txt
for n in nofull nofull-nothinkv; do python3 -c "
import json; d=json.load(open('$W/$n/step-profile.json'))
for k,r in d['runs'].items(): print(k, r['tokens_per_s_unprofiled'], r['step_ms_unprofiled'], r['profile']['gpu_busy_ms']/r['profile']['steps'])" ; done
cd $OUT && tar czf w.tgz w && rm -rf w
