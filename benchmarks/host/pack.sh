#!/usr/bin/env bash
# Builds .hostpack/: what the e2e benchmark needs on a GPU machine that its image lacks (it has torch,
# numpy, yaml, matplotlib, safetensors, aiohttp, grpcio, transformers; no Ray, pydantic or SQLAlchemy), for
# Python 3.12, x86-64.
#
#   benchmarks/host/pack.sh            # then, on the GPU machine, with .hostpack/ copied beside the checkout:
#                                      # benchmarks/host/run.sh ...
#
# The pack travels with the checkout, whose untracked files may hold at most 64 MiB; the Ray wheel alone is
# 79 MB. Ray is therefore packed as a tar.xz of the wheel without the libraries a benchmark worker never imports
# (RLlib, Data, Serve, Tune, Train, LLM, the dashboard's web client, the Java jars): 28 MB. The version is
# pyproject's.
set -euo pipefail
cd "$(dirname "$0")/../.."
PACK=.hostpack
RAY_VERSION=$(sed -n 's/.*"ray\[default\]>=\([0-9.]*\),.*/\1/p' pyproject.toml)
rm -rf "$PACK" && mkdir -p "$PACK"
grep -qxF "/$PACK/" .git/info/exclude 2>/dev/null || echo "/$PACK/" >> .git/info/exclude
dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$1" "${@:2}"
}
# pydantic's and jsonschema's (Ray's) trees, versions as installed here so both machines run the same code
pin() { .venv/bin/python -c "import importlib.metadata as m; print('$1==' + m.version('$1'))"; }
dl "$PACK" $(for p in pydantic pydantic_core annotated-types typing-inspection jsonschema \
                       jsonschema-specifications referencing rpds-py sqlalchemy alembic mako; do pin "$p"; done)
tmp=$(mktemp -d)
dl "$tmp" "ray==$RAY_VERSION"
(cd "$tmp" && unzip -q ray-*.whl && rm ray-*.whl \
   && rm -rf ray/jars ray/rllib ray/data ray/serve ray/tune ray/train ray/llm ray/dashboard/client \
   && tar -cf - ray ray-*.dist-info | xz -T0 -6 > ray.tar.xz)
mv "$tmp/ray.tar.xz" "$PACK/"
rm -rf "$tmp"
du -sh "$PACK"
