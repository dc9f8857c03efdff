#!/usr/bin/env bash
# One device call: the rate-12 trace that killed the engine in every
# uninstrumented run of 2026-11-28/29 (bench/SINGLE_GPU_CALLS.md), at full
# speed, with seeds 0 (the trace that crashed) and 1, after the GPU gate
# (tests_gpu and bench/gpu_smoke.py). Run after `bash .whl/device-setup.sh`
# and the wheel installed into /tmp/site2; writes under $OUT.
set -u
OUT=${OUT:-./gate-out}
KVDEPS=$([ -d /tmp/kvdeps ] && echo /tmp/kvdeps)
mkdir -p "$OUT"
# /tmp/kvdeps: pydantic-settings where the call installed .kvdeps there (thinkv's
# calibration store; without it thinkv runs on its fallback layers and thresholds).
export PYTHONPATH=/tmp/site2${KVDEPS:+:$KVDEPS}:/tmp/site PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
TRACE="--engines kvsieve --rates 12 --duration 20 --gen-min 128 --gen-max 4096 --budget 256 --kv-tokens 196608 --pool-share 0.6 --rate-timeout 30"
# The gate first: a cold machine spends ~90 s compiling Triton kernels in its
# first engine, which a timed traffic run would count.
timeout ${GATE_S:-250} python3 -P -m pytest tests_gpu/test_group_rows_cuda.py tests_gpu/test_region_pass_cuda.py \
    tests_gpu/test_graph_buckets_cuda.py tests_gpu/test_host_reads_cuda.py tests_gpu/test_rkv_paper_cuda.py \
    tests_gpu/test_graph_pool_alias_cuda.py tests_gpu/test_decode_slots_cuda.py tests_gpu/test_region_store_cuda.py tests_gpu/test_slot_view_cuda.py tests_gpu/test_kernel_alignment_cuda.py tests_gpu/test_kernel_warmup_cuda.py -q -p no:cacheprovider > "$OUT/tests-gpu.log" 2>&1 &
tests=$!
python3 bench/gpu_smoke.py --rows 64 --mem-fraction-static 0.7 --out "$OUT/gpu-smoke.json" --commit "$COMMIT" \
    --deadline $(( ${GATE_S:-250} - 10 )) > "$OUT/gate.log" 2>&1
echo "gpu_smoke: exit $?"; tail -16 "$OUT/gate.log"
wait $tests; echo "tests_gpu: exit $? ($(tail -1 "$OUT/tests-gpu.log"))"
pkill -9 -f "[m]ultiprocessing.spawn"; sleep 2
for seed in ${SEEDS:-0 1}; do
    name="rate12-seed$seed"
    KVSIEVE_STEP_LOG=$OUT/$name-steps.jsonl timeout ${RUN_S:-150} python3 bench/traffic.py $TRACE --seed "$seed" \
        --commit "$COMMIT" --deadline $(( ${RUN_S:-150} - 10 )) --out "$OUT/$name.json" 2>&1 \
        | grep -av "Capturing\|Loading\|Ignore import" > "$OUT/$name.log"
    echo "$name: $(grep -ac IndexKernel "$OUT/$name.log") index asserts"
    grep -a "rate    12/s:.*offered\|FAILED\|OK:" "$OUT/$name.log" | cut -c1-330
    pkill -9 -f "[m]ultiprocessing.spawn"; sleep 2
done
