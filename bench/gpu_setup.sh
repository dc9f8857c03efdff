# Device-side set-up for the multi-GPU calls (bench/MULTI_GPU_CALLS.md).
# Source it from the project root on the GPU host:
#
#   . bench/gpu_setup.sh          SGLang + kvsieve (+ .kvdeps)
#   . bench/gpu_setup.sh ray      the same and Ray Serve
#
# Installs whatever the call carried, once per machine (a warm machine keeps
# /tmp between calls): .whl/ -> /tmp/site (SGLang, through .whl/device-setup.sh),
# .kvdeps/ -> /tmp/kvdeps (pydantic-settings, python-dotenv), .raywhl/ ->
# /tmp/ray-site (ray 2.60.0, grpcio-reflection), and always .gpu/*.whl (the
# project's wheel) -> /tmp/site2. Exports PYTHONPATH. Returns non-zero, saying
# what is missing, when SGLang (or, with `ray`, Ray) is neither carried nor
# already installed: then the machine went cold between calls (see the
# fallback in bench/MULTI_GPU_CALLS.md).
_kv_setup() {
  local want_ray=${1:-} t0=$SECONDS r=${KV_SETUP_ROOT:-/tmp}  # KV_SETUP_ROOT: for a dry run elsewhere
  # NVLink multicast stays off (KINDS.md); the image sets these, keep them for every child.
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  # A `python3 -c`/`-m` child run from the repo root imports the installed wheel,
  # not the checkout's kvsieve/ (which kvsieve/__init__.py would map to the
  # checkout's folders): the call measures what it installed.
  export PYTHONSAFEPATH=1
  if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    bash .whl/device-setup.sh || return 1
  fi
  if [ ! -d $r/site/sglang ]; then
    echo "gpu_setup: SGLang is not in /tmp/site and .whl was not carried: carry .whl (this machine is a fresh one)" >&2
    return 3
  fi
  if [ -d .kvdeps ] && [ ! -f $r/kvdeps/.done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $r/kvdeps \
      .kvdeps/*.whl && touch $r/kvdeps/.done || return 1
  fi
  if [ -d .raywhl ] && [ ! -f $r/ray-site/.done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $r/ray-site \
      .raywhl/*.whl && touch $r/ray-site/.done || return 1
  fi
  if [ "$want_ray" = ray ] && [ ! -f $r/ray-site/.done ]; then
    echo "gpu_setup: Ray is not in $r/ray-site and .raywhl was not carried: carry .raywhl" >&2
    return 4
  fi
  if ! ls .gpu/*.whl >/dev/null 2>&1; then
    echo "gpu_setup: no project wheel: build it here (pip wheel --no-deps . -w .gpu/) and carry .gpu" >&2
    return 5
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $r/site2 \
    .gpu/*.whl || return 1
  export PYTHONPATH=$r/site2:$r/ray-site:$r/kvdeps:$r/site
  export PYTHONUNBUFFERED=1
  export PATH=$r/site2/bin:$PATH
  python3 - "$want_ray" <<'EOF' || return 6
import sys, torch, sglang, kvsieve.service.config  # noqa: F401  (pydantic-settings)
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
line = f"gpu_setup: sglang {sglang.__version__}, torch {torch.__version__}, {len(names)} GPU(s) {names}"
if sys.argv[1] == "ray":
    import ray
    from ray import serve  # noqa: F401
    line += f", ray {ray.__version__} (serve imports)"
print(line, flush=True)
EOF
  echo "gpu_setup: ready in $((SECONDS - t0)) s; PYTHONPATH=$PYTHONPATH"
}
_kv_setup "$@"
