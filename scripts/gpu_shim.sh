#!/usr/bin/env bash
# Import shim for machines without our install (e.g. a GPU machine's image): builds /tmp/shim/tidal from the repository's
# top-level folders the way pyproject's package-dir maps them (tidal/ -> tidal, engine/ -> tidal.engine,
# workers/ -> tidal.workers) and puts it first on PYTHONPATH. Copies, not links, so the shim is a snapshot.
#
#   source scripts/gpu_shim.sh [SHIM_DIR]     # then: python3 -c "import tidal.engine.actor"
#
# Only torch (and the standard library) is needed by tidal.engine; tidal/*.py modules that import prefect, mlflow,
# sqlalchemy... are copied too but fail only if imported.
_shim_root="${1:-/tmp/shim}"
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rm -rf "$_shim_root/tidal"
mkdir -p "$_shim_root/tidal"
cp "$_repo"/tidal/*.py "$_shim_root/tidal/"
[ -d "$_repo/tidal/pipeline" ] && cp -r "$_repo/tidal/pipeline" "$_shim_root/tidal/pipeline"
for _sub in engine workers; do
  cp -r "$_repo/$_sub" "$_shim_root/tidal/$_sub"
done
find "$_shim_root/tidal" -name __pycache__ -prune -exec rm -rf {} +
export PYTHONPATH="$_shim_root${PYTHONPATH:+:$PYTHONPATH}"
echo "gpu_shim: tidal -> $_shim_root/tidal (PYTHONPATH=$PYTHONPATH)"
unset _shim_root _repo _sub
