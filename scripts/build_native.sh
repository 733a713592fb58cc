#!/usr/bin/env bash
# Builds fedge's native device (clients/native) into build/native: fedge-native, fedge-native-train and
# vectors_test. Needs Debian's cmake, g++, pkg-config, libmosquitto-dev, libmsgpack-cxx-dev and
# nlohmann-json3-dev (installed here when run as root), and the executorch wheel's C++ runtime: found in $EXECUTORCH_DIR, else through the
# project's .venv (or $PYTHON) with `import executorch`. Torch is not needed: on a Pi,
# `pip install --no-deps executorch==1.5.1` brings the runtime alone.
#   bash scripts/build_native.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-build/native}"
if [ -z "${EXECUTORCH_DIR:-}" ]; then
  py="${PYTHON:-}"
  if [ -z "$py" ]; then
    if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
  fi
  # find the package without importing it (its __init__ may import torch)
  EXECUTORCH_DIR="$("$py" -c 'import importlib.util as u; s = u.find_spec("executorch"); print(list(s.submodule_search_locations)[0] if s else "")')"
fi
if [ -z "$EXECUTORCH_DIR" ] || [ ! -f "$EXECUTORCH_DIR/share/cmake/executorch-config.cmake" ]; then
  echo "build_native.sh: no executorch wheel found (pip install executorch==1.5.1, or set EXECUTORCH_DIR)" >&2
  exit 2
fi
pkgs=(cmake pkg-config g++ libmosquitto-dev libmsgpack-cxx-dev nlohmann-json3-dev)
if ! dpkg -s "${pkgs[@]}" >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "build_native.sh: installing ${pkgs[*]}" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pkgs[@]}" >/dev/null
  else
    echo "build_native.sh: needs Debian packages: sudo apt-get install ${pkgs[*]}" >&2
    exit 2
  fi
fi
cmake -S clients/native -B "$out" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$EXECUTORCH_DIR" >/dev/null
cmake --build "$out" -j"${JOBS:-2}"
echo "built $out/fedge-native"
