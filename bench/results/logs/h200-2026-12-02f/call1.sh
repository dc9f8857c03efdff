#!/usr/bin/env bash
# Call 1 (2026-12-02, twenty-third session): gate of COMMIT (the region store scans each row's own columns); the issue's eight members and their mix at 128 rows with the step log cut by run and phase.
set -u
source bench/device_prelude.sh
COMMIT=$1 STEP_LOG=$W/steps.jsonl LAST_S=470 source bench/gate_members_mix.sh
cat $W/rc.txt; tail -4 $W/gate.out; grep -a "tok/s" $W/prof.log | cut -c1-200 | tail -12
python3 - <<'PY'
import json, os
w = os.environ["OUT"] + "/w"
p = json.load(open(w + "/mixed-kernel-parts.json")) if os.path.exists(w + "/mixed-kernel-parts.json") else {}
print({k: v for k, v in p.items() if not isinstance(v, (dict, list))})
PY
grep -a "_store_kernel" -r $W/parts.log | head -5
cd $OUT && tar czf w.tgz w && rm -rf w
