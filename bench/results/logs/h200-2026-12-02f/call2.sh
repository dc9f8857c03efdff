#!/usr/bin/env bash
# Call 2 (2026-12-02, twenty-third session): the region store of c98746e (per row, heads in series, the table's whole width) against COMMIT's (per (row, head), each row's own columns) in one step of 28 layers, uniform and mixed widths; then the gate of COMMIT and the eight members + mix with the step log.
set -u
source bench/device_prelude.sh
python3 -m pip install -q --no-deps --target /tmp/site_old .gpu/old/kvsieve*.whl
for build in old new; do
  P=/tmp/site2:/tmp/kvdeps:/tmp/site; [ $build = old ] && P=/tmp/site_old:/tmp/kvdeps:/tmp/site
  PYTHONPATH=$P timeout 60 python3 bench/region_store.py $W/store-$build-uniform.json --rows 128,640 > $W/store-$build.log 2>&1
  PYTHONPATH=$P timeout 60 python3 bench/region_store.py $W/store-$build-wide36.json --rows 128,640 --wide-columns 36 >> $W/store-$build.log 2>&1
done
echo "store bench done at ${SECONDS}s" >> $W/rc.txt
grep -H "fused\|pytorch" $W/store-*.log
COMMIT=$1 STEP_LOG=$W/steps.jsonl LAST_S=500 source bench/gate_members_mix.sh
cat $W/rc.txt; tail -3 $W/gate.out
python3 - <<'PY'
import json, os
w = os.environ["OUT"] + "/w"
d = json.load(open(w + "/prof/step-profile.json"))
runs = d["runs"] if "runs" in d else d
for r in (runs if isinstance(runs, list) else runs.values()):
    for k in r.get("kernels", []):
        if isinstance(k, dict) and k.get("name") == "_store_kernel":
            print(r.get("name") or r.get("label"), k["per_step_ms"])
print(json.dumps(d.get("comparison", {}))[:1500])
PY
cd $OUT && tar czf w.tgz w && rm -rf w
