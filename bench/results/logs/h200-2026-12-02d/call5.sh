#!/usr/bin/env bash
# Call 5 (2026-12-02, twenty-first session): gate of 32d1b77 (the observation pass computes per row what its policy reads); the eight decode-time policies (no full, no snapkv) and their mixed batch at 128 rows, each with a GPU-only kernel trace of 16 replayed steps.
set -u
W=$OUT/w; mkdir -p $W
[ -d /tmp/site/sglang ] || bash .whl/device-setup.sh > $W/setup.log 2>&1
python3 -m pip install -q --no-deps --upgrade --target /tmp/site2 .gpu/kvsieve*.whl
python3 -m pip install -q --no-deps --upgrade --target /tmp/kvdeps .kvdeps/*.whl
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PYTHONPATH=/tmp/site2:/tmp/kvdeps:/tmp/site
echo "setup done at ${SECONDS}s" > $W/rc.txt
COMMIT=32d1b77 SEEDS=" " GATE_S=${GATE_S:-290} OUT=$W/gate bash bench/gate_and_rate12.sh > $W/gate.out 2>&1
echo "gate done at ${SECONDS}s" >> $W/rc.txt
pkill -9 -f "[m]ultiprocessing.spawn"; sleep 2
M=bench/models/r1-distill-qwen-7b
LEFT=$((585 - SECONDS))
timeout $LEFT python3 bench/step_profile.py $M $W/prof --policy h2o,rkv,streaming,skipkv,thinkv,crystal_kv,longflow,crystalcache --mixed 1 --mixed-first 1 --budget 256 --requests 128 --kv-tokens 196608 --ranges 0 --activities GPU --gen-extra 320 --steps 16 --window-steps 64 > $W/prof.log 2>&1
echo "profile rc $? at ${SECONDS}s" >> $W/rc.txt
cat $W/rc.txt; tail -4 $W/gate.out; grep -a "tok/s" $W/prof.log | cut -c1-200 | tail -12
cd $OUT && tar czf w.tgz w && rm -rf w
