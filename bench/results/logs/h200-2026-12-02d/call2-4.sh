#!/usr/bin/env bash
# Call 2 (2026-12-02, twenty-first session): bench/mixed_attention_ab.py at 128 and 640 rows.
set -u
W=$OUT/w; mkdir -p $W
[ -d /tmp/site/sglang ] || bash .whl/device-setup.sh > $W/setup.log 2>&1
python3 -m pip install -q --no-deps --upgrade --target /tmp/site2 .gpu/kvsieve*.whl
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PYTHONPATH=/tmp/site2:/tmp/site
echo "setup done at ${SECONDS}s" > $W/rc.txt
timeout 200 python3 bench/mixed_attention_ab.py $W/ab-128.json --rows 128 > $W/ab-128.log 2>&1; echo "128 rc $? at ${SECONDS}s" >> $W/rc.txt

cat $W/rc.txt $W/ab-128.log $W/ab-640.log | tail -30
cd $OUT && tar czf w.tgz w && rm -rf w
