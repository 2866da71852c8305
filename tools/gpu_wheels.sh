#!/usr/bin/env bash
# The wheels a lent GPU machine lacks, fetched where the package registries are reachable, for
# `tools/gpu_check.py --wheels DIR` there (docs/quickstart.md, "GPU check").
#
#   bash tools/gpu_wheels.sh [DIR]        # default DIR: .whl (ignored by git; carry it)
#
# A GPU machine without network whose Python (3.12, x86-64) already has a CUDA torch, numpy,
# pyarrow, pandas, sentencepiece, tiktoken, tokenizers, safetensors, tensorboard, transformers,
# peft, accelerate, pytest and pytest-xdist needs the rest of `pip install -e .`: the wheels
# below, one version of each, fetched without their dependencies (those are named too).
# hatchling and its own dependencies let pip build the editable project offline. A machine that
# lacks more: add names here (`pip download` without `--no-deps` fetches a whole closure).
set -euo pipefail

dir="${1:-.whl}"
python="${PYTHON:-python3}"
mkdir -p "$dir"
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$dir" \
    torchtune==0.6.1 torchao==0.15.0 torchdata==0.11.0 omegaconf datasets dill \
    multiprocess kagglehub kagglesdk blobfile pycryptodomex hatchling editables packaging \
    pathspec pluggy trove-classifiers tomlkit
du -sh "$dir"
ls "$dir"
