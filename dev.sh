#!/usr/bin/env bash
# The two commands of the README:
#   ./dev.sh serve [kvsieve serve options]   set up if needed, serve the embedded default model
#   ./dev.sh test  [pytest options]          set up if needed, run the whole test suite
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
"$ROOT/scripts/setup.sh"
VENV="${KVSIEVE_VENV:-$ROOT/.venv}"
cmd="${1:-}"; shift || true
case "$cmd" in
  serve) exec "$VENV/bin/kvsieve" serve "$@" ;;
  # Two pytest-xdist workers (tests/conftest.py hands each a whole group of
  # tests that share servers); `-n 0` after it runs in one process.
  test)  cd "$ROOT" && exec "$VENV/bin/python" -m pytest -n 2 "$@" ;;
  *) echo "usage: ./dev.sh serve [options] | ./dev.sh test [pytest options]" >&2; exit 2 ;;
esac
