#!/usr/bin/env bash
# Call 1 (2026-12-02, twentieth session): traffic rates 4/8 on d432a32 with the group cache's counters in the step log.
set -u
W=$OUT/w; mkdir -p $W
[ -d /tmp/site/sglang ] || bash .whl/device-setup.sh > $W/setup.log 2>&1
python3 -m pip install -q --no-deps --upgrade --target /tmp/site2 .gpu/kvsieve*.whl
python3 -m pip install -q --no-deps --upgrade --target /tmp/kvdeps .kvdeps/*.whl
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PYTHONPATH=/tmp/site2:/tmp/kvdeps:/tmp/site
echo "setup done at ${SECONDS}s" > $W/rc.txt
timeout 200 python3 bench/traffic.py --engines kvsieve --rates 4,8 --duration 20 --gen-min 128 --gen-max 4096 --budget 256 --kv-tokens 196608 --pool-share 0.6 --rate-timeout 30 --seed 0 --deadline 180 --commit d432a32 --baseline bench/results/traffic-h200-2026-11-29b.json --out $W/traffic.json 2>&1 | grep -av "Capturing\|Loading\|Ignore import" > $W/traffic.log
echo "traffic rc $? at ${SECONDS}s" >> $W/rc.txt
python3 bench/capture_churn.py $W/traffic-steps.jsonl --out $W/churn.json > $W/churn.log 2>&1
cat $W/rc.txt; grep -a "rate .*offered" $W/traffic.log | cut -c1-300; tail -3 $W/churn.log
python3 - <<PY
import json
L=[json.loads(l) for l in open('$W/traffic-steps.jsonl') if l.strip()]
c=[x['counters'] for x in L if 'counters' in x]
print('steps', len(L), 'with counters', len(c))
if c: print({k: c[-1].get(k,0)-c[0].get(k,0) for k in c[-1]})
prev=None
for i,x in enumerate(L):
    k=x.get('counters')
    if not k: continue
    if prev is not None:
        d={a:k[a]-prev.get(a,0) for a in k if k[a]!=prev.get(a,0)}
        if d and any(a in d for a in ('table_version','group_stale','group_evictions')): print(i, x.get('kind'), x.get('rows'), d)
    prev=k
PY
gzip -f $W/*.jsonl; cd $OUT && tar czf w.tgz w && rm -rf w
