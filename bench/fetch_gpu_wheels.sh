#!/usr/bin/env bash
# Wheels for the GPU machine, which has torch but no PyPI: pydantic and PyYAML with their
# dependencies, at this project's pins, for CPython 3.10-3.13 on x86-64 Linux, into out/wheels
# (ignored by git). Carry that folder to the device and point bench/gpu_check.sh at it:
#
#   bash bench/fetch_gpu_wheels.sh            # here, once
#   run: ADAPTIS_WHEELS=out/wheels bash bench/gpu_check.sh   (carry: ["out/wheels"])
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-out/wheels}"
mkdir -p "$dest"
PY="${PYTHON:-python3}"
for version in 3.10 3.11 3.12 3.13; do
  "$PY" -m pip download -q --only-binary=:all: --platform manylinux2014_x86_64 --implementation cp \
    --python-version "$version" -c constraints.txt -d "$dest" pydantic pyyaml
done
echo "fetch_gpu_wheels: $(ls "$dest" | wc -l) wheels, $(du -sh "$dest" | cut -f1) in $dest"
