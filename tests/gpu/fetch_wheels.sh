#!/usr/bin/env bash
# Download, on a machine with network access, the wheels tests/gpu/run.sh installs on the GPU
# machine (CPython 3.12, manylinux x86_64, offline) into tests/gpu/wheels (git-ignored: pass it
# to the device run with carry ["tests/gpu/wheels"]). Re-running replaces the directory.
#
#   bash tests/gpu/fetch_wheels.sh            # then check the size it prints (limit 64 MiB)
#   PYTHON_VERSION=3.11 WHEELS=/tmp/w bash tests/gpu/fetch_wheels.sh   # e.g. to simulate here
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py_version="${PYTHON_VERSION:-3.12}"
wheels="${WHEELS:-$here/wheels}"
pip="${PIP:-python -m pip}"

rm -rf "$wheels"
mkdir -p "$wheels"
# --only-binary: nothing is built on the GPU machine; the platform tags are those of its image
# (glibc >= 2.17, x86_64). Dependencies are resolved for that interpreter, not this one.
$pip download --quiet --disable-pip-version-check \
    --only-binary=:all: \
    --python-version "$py_version" --implementation cp --abi "cp${py_version/./}" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
    -r "$here/requirements.txt" -d "$wheels"
ls -1 "$wheels"
size_kib=$(du -sk "$wheels" | cut -f1)
echo "wheels: $(ls -1 "$wheels" | wc -l) files, ${size_kib} KiB in $wheels"
if (( size_kib > 60 * 1024 )); then
    echo "too large for the device tool's carry (64 MiB with the working tree)" >&2
    exit 1
fi
