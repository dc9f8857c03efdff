#!/usr/bin/env bash
# One device call (issue #29): where kvsieve's host time goes under traffic,
# a mixed batch against one policy alone. A 128-row batch of the ten
# policies took 23.7 ms a step with 13.1 ms of GPU work, while a batch of
# one policy took about its GPU work (bench/results/logs/h200-2026-11-29c/):
# either the host does more than the GPU in a mixed step, or something in
# it waits for the GPU. py-spy samples SGLang's scheduler process (every
# thread, idle ones too, Python frames) while bench/traffic.py
# replays the rate-4 trace, once with the ten-policy mix and once with h2o
# alone (PROBES picks the runs, default "mixed h2o"); bench/pyspy_summary.py
# says which functions hold the samples and which of them wait.
#
# Needs py-spy on the device: put its wheel beside the project's
# (`pip download py-spy==0.4.3 --no-deps -d .gpu/`), so the recipe's
# `pip install --target /tmp/site2 .gpu/*.whl` installs it. Run after
# `bash .whl/device-setup.sh` and that install; writes under $OUT. On CPU
# (a logic check of the whole pipeline): DEVICE=cpu bash bench/host_probe.sh
set -u
OUT=${OUT:-./probe-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-/tmp/site2:/tmp/site} PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
SPY=${SPY:-$(command -v py-spy || echo /tmp/site2/bin/py-spy)}
PY=${PY:-python3}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [ "${DEVICE:-cuda}" = cpu ]; then
    TRACE="--quick --rates 4 --duration 6 --rate-timeout 30"
    WAIT_S=${WAIT_S:-1} RECORD_S=${RECORD_S:-5}
else
    TRACE="--rates 4 --duration 20 --gen-min 128 --gen-max 4096 --budget 256 --kv-tokens 196608 --pool-share 0.6 --rate-timeout 30"
    WAIT_S=${WAIT_S:-8} RECORD_S=${RECORD_S:-15}
fi
TEN="streaming,h2o,rkv,skipkv,thinkv,crystal_kv,longflow,crystalcache,snapkv,full"

probe() {  # name, then the traffic mix
    local name=$1 mix=$2
    $PY bench/traffic.py --engines kvsieve $TRACE --mix "$mix" --seed 0 --commit "$COMMIT" \
        --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1 &
    local main=$!
    # The rate starts once the engine is up and warmed ("kvsieve: up in ...").
    until grep -aqs "kvsieve: up in" "$OUT/$name.log" || ! kill -0 $main 2>/dev/null; do sleep 1; done
    sleep "$WAIT_S"
    local pid kids
    kids=$(pgrep -P "$main")  # this run's engine processes, not another engine's
    pid=$(pgrep -P "$main" -f "sglang::scheduler" | head -1)
    if [ -n "$pid" ]; then
        # Python frames, without pausing the process: the blocking native
        # sampler slowed this trace ~10x (2026-11-29), so it measured itself.
        "$SPY" record --pid "$pid" --duration "$RECORD_S" --rate 250 --format raw --idle --threads --nonblocking \
            -o "$OUT/$name-pyspy.txt" > "$OUT/$name-pyspy.log" 2>&1
    else
        echo "$name: no scheduler process to sample" | tee -a "$OUT/$name-pyspy.log"
    fi
    wait $main
    grep -a "rate .*offered\|FAILED\|OK:" "$OUT/$name.log" | cut -c1-300
    if [ -s "$OUT/$name-pyspy.txt" ]; then
        $PY bench/pyspy_summary.py "$OUT/$name-pyspy.txt" --thread MainThread --top 30 --out "$OUT/$name-pyspy.json" > "$OUT/$name-pyspy-summary.txt"
        head -75 "$OUT/$name-pyspy-summary.txt"
    else
        tail -5 "$OUT/$name-pyspy.log"
    fi
    kill -9 $kids 2>/dev/null; sleep 2  # any left behind by the engine's shutdown
}

for name in ${PROBES:-mixed h2o}; do
    if [ "$name" = mixed ]; then probe mixed "$TEN"; else probe "$name" "$name"; fi
done
