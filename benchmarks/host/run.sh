#!/usr/bin/env bash
# Runs a command of this repo on a machine with torch preinstalled and no package registry (e.g. a GPU
# machine's image: torch 2.11 and the rest), with .hostpack/ installed (pack.sh).
#
#   benchmarks/host/run.sh python benchmarks/e2e.py --quick --device-cores 8-15 --share 0.03125 --json $OUT/e2e.json
#
# Makes a virtual environment that sees the image's packages (torch 2.11 and the rest), installs the pack into it
# and this checkout in editable mode, as ./scripts/setup does here, then runs "$@" with it first on PATH.
# Editable, not a plain install: Ray workers start in the driver's folder, the repo root, whose source folders
# (`tidal/`, `scheduler/`, ...) are then the code that runs, on the driver and on every worker alike.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=/tmp/tidal-venv
if [ ! -f "$VENV/.ready" ]; then
  rm -rf "$VENV" && python3 -m venv "$VENV"
  # The image's python3 is itself a venv (/opt/torch/.venv): --system-site-packages would reach past it to the
  # base interpreter. A .pth file adds its site-packages, after ours.
  purelib=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  python3 -c 'import site; print("\n".join(site.getsitepackages()))' > "$purelib/_image.pth"
  "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .hostpack/*.whl
  tar -xJf .hostpack/ray.tar.xz -C "$purelib"
  "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e .
  touch "$VENV/.ready"
fi
export PATH="$VENV/bin:$PATH" PYTHONUNBUFFERED=1
exec "$@"
