#!/usr/bin/env bash
# Call 2 (2026-12-02, twenty-second session): 7938a59 (each row's own keys, prefix then region, in the fewest equal splits of at most 512) against 4e05d39 (prefix padded to whole splits of 512, the region from a split boundary) in one call: mixed_attention_ab at 128 rows on both builds, then the gate of 7938a59 and the eight members and their mix at 128 rows.
set -u
source bench/device_prelude.sh
python3 -m pip install -q --no-deps --upgrade --target /tmp/site_old .gpu/old/kvsieve*.whl
timeout 80 python3 bench/mixed_attention_ab.py $W/ab-128-7938a59.json --rows 128 --iters 100 --split-keys 384,448,640 > $W/ab-128-7938a59.log 2>&1; echo "ab new rc $? at ${SECONDS}s" >> $W/rc.txt
PYTHONPATH=/tmp/site_old:/tmp/kvdeps:/tmp/site timeout 70 python3 bench/mixed_attention_ab.py $W/ab-128-4e05d39.json --rows 128 --iters 100 --split-keys 384 > $W/ab-128-4e05d39.log 2>&1; echo "ab old rc $? at ${SECONDS}s" >> $W/rc.txt
COMMIT=7938a59 SEEDS=" " GATE_S=${GATE_S:-250} OUT=$W/gate bash bench/gate_and_rate12.sh > $W/gate.out 2>&1
echo "gate done at ${SECONDS}s" >> $W/rc.txt
pkill -9 -f "[m]ultiprocessing.spawn"; sleep 2
M=bench/models/r1-distill-qwen-7b
LEFT=$((585 - SECONDS))
timeout $LEFT python3 bench/step_profile.py $M $W/prof --policy h2o,rkv,streaming,skipkv,thinkv,crystal_kv,longflow,crystalcache --mixed 1 --mixed-first 1 --budget 256 --requests 128 --kv-tokens 196608 --ranges 0 --activities GPU --gen-extra 320 --steps 16 --window-steps 64 > $W/prof.log 2>&1
echo "profile rc $? at ${SECONDS}s" >> $W/rc.txt
cat $W/rc.txt; tail -4 $W/gate.out; grep -a "tok/s" $W/prof.log | cut -c1-200 | tail -12
grep -a "keys a split\|ms  mixed\|members weighted" $W/ab-128-*.log | head -40
cd $OUT && tar czf w.tgz w && rm -rf w
