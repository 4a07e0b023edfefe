#!/usr/bin/env bash
# The wheels the GPU machine's image lacks, written to .whl/ for bench/gpu_checks.sh to
# install there (it puts .whl/*.whl in /tmp/site before anything runs). The image holds
# torch, transformers, aiohttp, prometheus-client, jinja2, tokenizers, safetensors and
# nvidia-ml-py, but not pydantic, which `kvledger serve` imports for its request models:
# without it `bash bench/gpu_checks.sh serving` cannot start a server. Downloaded for the
# image's Python 3.12 on x86-64 Linux, at the pydantic version this venv runs, with what
# it needs (pydantic-core at its exact pin). Run it here, where PyPI answers:
#
#     bash bench/gpu_wheels.sh     # then the device call carries .whl (run's carry)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
version=$("$PY" -c 'import pydantic; print(pydantic.VERSION)')
rm -rf .whl
mkdir .whl
"$PY" -m pip download --quiet --disable-pip-version-check --dest .whl --only-binary=:all: \
    --implementation cp --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 "pydantic==$version"
# bench/weight_readers.py's rivals (`gpu_checks.sh load`): never the engine's dependencies.
"$PY" -m pip download --quiet --disable-pip-version-check --dest .whl --only-binary=:all: \
    --implementation cp --python-version 3.12 --no-deps \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
    fastsafetensors runai-model-streamer humanize
ls .whl
