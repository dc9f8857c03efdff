#!/usr/bin/env bash
# Call 3 (2026-12-02, twenty-second session): gate of 83337d5 (4e05d39's split layout; the observation outputs in one zeroed allocation; the query loaded after the dead-split check); the issue's eight members and their mix at 128 rows; mixed_attention_ab at 128 rows with what is left.
set -u
source bench/device_prelude.sh
COMMIT=83337d5 SEEDS=" " GATE_S=${GATE_S:-250} OUT=$W/gate bash bench/gate_and_rate12.sh > $W/gate.out 2>&1
echo "gate done at ${SECONDS}s" >> $W/rc.txt
pkill -9 -f "[m]ultiprocessing.spawn"; sleep 2
M=bench/models/r1-distill-qwen-7b
LEFT=$((450 - SECONDS))
timeout $LEFT python3 bench/step_profile.py $M $W/prof --policy h2o,rkv,streaming,skipkv,thinkv,crystal_kv,longflow,crystalcache --mixed 1 --mixed-first 1 --budget 256 --requests 128 --kv-tokens 196608 --ranges 0 --activities GPU --gen-extra 320 --steps 16 --window-steps 64 > $W/prof.log 2>&1
echo "profile rc $? at ${SECONDS}s" >> $W/rc.txt
pkill -9 -f "[m]ultiprocessing.spawn"; sleep 1
LEFT=$((490 - SECONDS)); [ $LEFT -gt 25 ] && timeout $LEFT python3 bench/mixed_attention_ab.py $W/ab-128.json --rows 128 --iters 100 --split-keys 512 > $W/ab-128.log 2>&1; echo "ab rc $? at ${SECONDS}s" >> $W/rc.txt
cat $W/rc.txt; tail -4 $W/gate.out; grep -a "tok/s" $W/prof.log | cut -c1-200 | tail -12
grep -a "ms  mixed$\|members weighted" $W/ab-128.log
cd $OUT && tar czf w.tgz w && rm -rf w
