# Sourced by a device call's script after bench/device_prelude.sh (see
# bench/SINGLE_GPU_CALLS.md): the body the calls of issue #29 repeat.
#   1. the GPU gate of COMMIT (bench/gate_and_rate12.sh without its
#      traffic seeds: tests_gpu and gpu_smoke), under $W/gate (GATE=0: none,
#      for a call whose build was gated before);
#   2. the eight decode-time policies alone and mixed at REQUESTS
#      rows, budget BUDGET (bench/step_profile.py, after its warm-up batch),
#      under $W/prof, ending by LAST_S seconds into the call;
#   3. with STEPS > 0 (kernel traces), the mix's GPU over its members'
#      (bench/mixed_kernel_parts.py); with STEP_LOG set, the step log cut
#      by run and phase (bench/capture_churn.py --profile).
# Knobs: COMMIT, GATE (1), GATE_S (250), LAST_S (585), STEPS (16),
# MIXED_FIRST (1), STEP_LOG (unset: no step log), POLICIES (the eight),
# REQUESTS (128), BUDGET (256), KV_TOKENS (196608), GEN_EXTRA (320),
# WINDOW_STEPS (64). The issue's own scale: REQUESTS=640 BUDGET=1024
# KV_TOKENS=786432.
: "${W:?source bench/device_prelude.sh first}"
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
POLICIES=${POLICIES:-h2o,rkv,streaming,skipkv,thinkv,crystal_kv,longflow,crystalcache}
if [ "${GATE:-1}" = 1 ]; then
    COMMIT=$COMMIT SEEDS=" " GATE_S=${GATE_S:-250} OUT=$W/gate bash bench/gate_and_rate12.sh > "$W/gate.out" 2>&1
    echo "gate done at ${SECONDS}s" >> "$W/rc.txt"
    pkill -9 -f "[m]ultiprocessing.spawn"; sleep 2
fi
KVSIEVE_STEP_LOG=${STEP_LOG:-} timeout $(( ${LAST_S:-585} - SECONDS )) python3 bench/step_profile.py \
    bench/models/r1-distill-qwen-7b "$W/prof" --policy "$POLICIES" --mixed 1 --mixed-first "${MIXED_FIRST:-1}" \
    --budget "${BUDGET:-256}" --requests "${REQUESTS:-128}" --kv-tokens "${KV_TOKENS:-196608}" --ranges 0 \
    --activities GPU --gen-extra "${GEN_EXTRA:-320}" --steps "${STEPS:-16}" --window-steps "${WINDOW_STEPS:-64}" \
    > "$W/prof.log" 2>&1
echo "profile rc $? at ${SECONDS}s" >> "$W/rc.txt"
PROFILE=$W/prof/step-profile.json
if [ "${STEPS:-16}" != 0 ] && [ -f "$PROFILE" ]; then
    python3 bench/mixed_kernel_parts.py "$PROFILE" "$PROFILE" --out "$W/mixed-kernel-parts.json" > "$W/parts.log" 2>&1
fi
if [ -n "${STEP_LOG:-}" ] && [ -f "$STEP_LOG" ] && [ -f "$PROFILE" ]; then
    python3 bench/capture_churn.py "$STEP_LOG" --profile "$PROFILE" --out "$W/churn.json" > "$W/churn.log" 2>&1
fi
