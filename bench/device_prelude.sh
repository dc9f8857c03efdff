# Sourced first by a device call's script (`source bench/device_prelude.sh`,
# see bench/SINGLE_GPU_CALLS.md): SGLang's wheels set up once a machine
# (`.whl`, from ../shared/gpu/fetch-wheels.sh), this checkout's wheel
# (`.gpu`) and kvsieve's extra dependencies (`.kvdeps`: pydantic-settings,
# python-dotenv) installed, and the environment every bench reads. Sets W,
# the call's output folder under $OUT, and starts W/rc.txt, where the
# script appends what finished when.
W=$OUT/w
mkdir -p "$W"
[ -d /tmp/site/sglang ] || bash .whl/device-setup.sh > "$W/setup.log" 2>&1
python3 -m pip install -q --no-deps --upgrade --target /tmp/site2 .gpu/kvsieve*.whl
if [ -d .kvdeps ]; then
    python3 -m pip install -q --no-deps --upgrade --target /tmp/kvdeps .kvdeps/*.whl
fi
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PYTHONPATH=/tmp/site2:/tmp/kvdeps:/tmp/site
echo "setup done at ${SECONDS}s" > "$W/rc.txt"
