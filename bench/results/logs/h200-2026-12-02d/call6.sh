#!/usr/bin/env bash
# Call 6 (2026-12-02, twenty-first session): the keys-a-split sweep of bench/mixed_attention_ab.py at 128 and 640 rows (no code change: 32d1b77's kernels).
set -u
source bench/device_prelude.sh
timeout 90 python3 bench/mixed_attention_ab.py $W/ab-split-128.json --rows 128 --iters 100 --split-keys 192,256,320,384,448,512,640,768 > $W/ab-split-128.log 2>&1; echo "128 rc $? at ${SECONDS}s" >> $W/rc.txt
timeout 70 python3 bench/mixed_attention_ab.py $W/ab-split-640.json --rows 640 --iters 50 --split-keys 256,384,512,768,1024 > $W/ab-split-640.log 2>&1; echo "640 rc $? at ${SECONDS}s" >> $W/rc.txt
cat $W/rc.txt; grep -a "keys a split\|^  *[0-9.]* ms  mixed$\|members weighted" $W/ab-split-128.log $W/ab-split-640.log
cd $OUT && tar czf w.tgz w && rm -rf w
