#!/usr/bin/env bash
# Call 1 (2026-12-02, twenty-second session): 111a0e1 (each row's region in equal splits of at most 320 keys; the observation scratch in one fill). mixed_attention_ab's region-cut sweep at 128 rows, the gate, the eight members and their mix at 128 rows, then the sweep at 640 rows with what is left.
set -u
source bench/device_prelude.sh
timeout 110 python3 bench/mixed_attention_ab.py $W/ab-128.json --rows 128 --iters 100 --split-keys 320,512 --region-keys 256,288,384,448,512 > $W/ab-128.log 2>&1; echo "ab128 rc $? at ${SECONDS}s" >> $W/rc.txt
COMMIT=111a0e1 SEEDS=" " GATE_S=${GATE_S:-250} OUT=$W/gate bash bench/gate_and_rate12.sh > $W/gate.out 2>&1
echo "gate done at ${SECONDS}s" >> $W/rc.txt
pkill -9 -f "[m]ultiprocessing.spawn"; sleep 2
M=bench/models/r1-distill-qwen-7b
LEFT=$((560 - SECONDS))
timeout $LEFT python3 bench/step_profile.py $M $W/prof --policy h2o,rkv,streaming,skipkv,thinkv,crystal_kv,longflow,crystalcache --mixed 1 --mixed-first 1 --budget 256 --requests 128 --kv-tokens 196608 --ranges 0 --activities GPU --gen-extra 320 --steps 16 --window-steps 64 > $W/prof.log 2>&1
echo "profile rc $? at ${SECONDS}s" >> $W/rc.txt
pkill -9 -f "[m]ultiprocessing.spawn"; sleep 1
LEFT=$((585 - SECONDS)); [ $LEFT -gt 20 ] && timeout $LEFT python3 bench/mixed_attention_ab.py $W/ab-640.json --rows 640 --iters 40 --split-keys 512 --region-keys 384,512 > $W/ab-640.log 2>&1; echo "ab640 rc $? at ${SECONDS}s" >> $W/rc.txt
cat $W/rc.txt; tail -4 $W/gate.out; grep -a "tok/s" $W/prof.log | cut -c1-200 | tail -12
grep -a "keys a split\|^  *[0-9.]* ms  mixed\|members weighted" $W/ab-128.log $W/ab-640.log | grep -v "^.*{" | head -40
cd $OUT && tar czf w.tgz w && rm -rf w
