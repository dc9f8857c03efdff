#!/usr/bin/env bash
# Call 3 (2026-12-02, twentieth session): the members and the ten-policy mixed batch at 128 rows on 2125d55, each with a GPU-only kernel trace of 16 replayed steps (--ranges 0 --activities GPU): what a mixed step's GPU runs that its members' do not.
set -u
W=$OUT/w; mkdir -p $W
[ -d /tmp/site/sglang ] || bash .whl/device-setup.sh > $W/setup.log 2>&1
python3 -m pip install -q --no-deps --upgrade --target /tmp/site2 .gpu/kvsieve*.whl
python3 -m pip install -q --no-deps --upgrade --target /tmp/kvdeps .kvdeps/*.whl
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PYTHONPATH=/tmp/site2:/tmp/kvdeps:/tmp/site
echo "setup done at ${SECONDS}s" > $W/rc.txt
M=bench/models/r1-distill-qwen-7b
timeout 540 python3 bench/step_profile.py $M $W/prof --policy h2o,rkv,streaming,snapkv,skipkv,thinkv,crystal_kv,longflow,crystalcache,full --mixed 1 --mixed-first 1 --budget 256 --requests 128 --kv-tokens 196608 --ranges 0 --activities GPU --gen-extra 320 --steps 16 --window-steps 64 > $W/prof.log 2>&1
echo "profile rc $? at ${SECONDS}s" >> $W/rc.txt
cat $W/rc.txt; grep -a "tok/s" $W/prof.log | cut -c1-200 | tail -14
python3 - <<PY
import json
d=json.load(open('$W/prof/step-profile.json'))
print(json.dumps(d.get('comparison'))[:800])
for r in d['runs']:
    print(r.get('label'), r.get('tokens_per_s_unprofiled'), r.get('step_ms_unprofiled'), r.get('gpu_busy_ms_per_step', r.get('busy_share')))
PY
cd $OUT && tar czf w.tgz w && rm -rf w
