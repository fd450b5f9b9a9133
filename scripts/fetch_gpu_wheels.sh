#!/usr/bin/env bash
# Fetch, on a machine with a package registry, the wheels the embedded backend (agl-plugin-torch) needs on a
# GPU machine that has none: Python 3.12, x86-64 Linux, with torch, transformers, peft, accelerate, numpy, httpx,
# rich, tqdm, uvloop and pluggy already installed (the bare image of docs/status.md's GPU section). They go to
# gpu_wheels/ (git-ignored; carry it with the run), and scripts/gpu_smoke_embedded.sh installs from there with
# `pip install --no-index`.
#
# Usage:  scripts/fetch_gpu_wheels.sh            # into gpu_wheels/
#         WHEELS=/some/dir scripts/fetch_gpu_wheels.sh
#
# The versions are those this repository is tested with here. The list is the closure of their dependencies
# minus torch's own (torch, triton, the nvidia-* libraries, numpy, sympy, ...: the image has them, and they
# weigh gigabytes), so it is fetched without dependency resolution; the GPU script installs the distributions
# the image lacks or has older than these.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-gpu_wheels}
PIP=${PIP:-python -m pip}
mkdir -p "$WHEELS"

# What the core, the torch/sqlite/traces plugins and the guess_number agent import that the image lacks, with
# everything those need (the image's own dependencies of transformers and httpx among them, should it lack one).
REQUIREMENTS=(
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0
    omegaconf==2.3.1 pyyaml==6.0.4
    tensordict==0.10.0 cloudpickle==3.1.3 orjson==3.13.0 pyvers==0.1.0 lazy_importer==0.1.0
    importlib-metadata==10.2.0 zipp==4.1.2 packaging==25.0
    starlette==1.10.0 anyio==4.16.0 idna==3.20 sniffio==1.3.1
    uvicorn==0.55.0 click==8.5.1 h11==0.16.0 httptools==0.9.0
    openai==3.60.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 distro==1.9.0 jiter==0.19.0
)

# omegaconf's parser runtime is published as a source archive only: build its (pure-Python) wheel here.
if ! ls "$WHEELS"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1; then
    $PIP wheel --no-deps --no-build-isolation -q -w "$WHEELS" "antlr4-python3-runtime==4.9.3" \
        || $PIP wheel --no-deps -q -w "$WHEELS" "antlr4-python3-runtime==4.9.3"
fi
# Binary wheels only, for CPython 3.12 on x86-64 manylinux; the antlr4 wheel above is found in $WHEELS.
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --find-links "$WHEELS" -d "$WHEELS" "${REQUIREMENTS[@]}"

total=$(du -cb "$WHEELS"/*.whl | tail -1 | cut -f1)
echo "$(ls "$WHEELS"/*.whl | wc -l) wheels in $WHEELS/, $((total / 1024)) KiB"
