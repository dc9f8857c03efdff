#!/usr/bin/env bash
# redis-server (Debian package) for the shared store and its tests
# (tests/test_store_redis.py starts its own server on a free port).
# Idempotent: nothing to do when redis-server is already on PATH.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "[setup] 20-redis: not root, skipping apt-get; install the Debian package redis-server yourself" >&2
  exit 0
fi
echo "[setup] 20-redis: apt-get install redis-server" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends redis-server >/dev/null
# The package starts a system service on 6379; kvsieve's tests start their own.
if command -v systemctl >/dev/null 2>&1; then systemctl disable --now redis-server >/dev/null 2>&1 || true; fi
