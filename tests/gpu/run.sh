#!/usr/bin/env bash
# The GPU proof (issue 24), in one go, on the device machine: Python 3.12 with torch (CUDA),
# numpy and anyio, and no network. Installs the rest offline from tests/gpu/wheels (made by
# tests/gpu/fetch_wheels.sh, carried along), runs tests/gpu, and writes to $OUT:
#
#   gpu_summary.json  environment, counts, each test's outcome (with the skip or failure
#                     message), the figures; written even if pytest could not start
#   junit.xml         pytest's JUnit report (figures as properties)
#   gpu_run.log       everything this script printed
#
# Exit status: pytest's (0: all passed or skipped). Bounded: pytest gets GPU_PYTEST_TIMEOUT_S
# (default 240 s), the whole script stays well under 5 minutes.
#
# Environment: PYTHON (default python3), OUT (default a fresh temp dir), GPU_VENV (default
# /tmp/llmdd-gpu-venv), WHEELS (default tests/gpu/wheels), GPU_PYTEST_TIMEOUT_S, and
# GPU_PYTEST_ARGS (extra pytest arguments, e.g. "-k cuda").
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
out="${OUT:-$(mktemp -d /tmp/llmdd-gpu-out.XXXXXX)}"
venv="${GPU_VENV:-/tmp/llmdd-gpu-venv}"
wheels="${WHEELS:-$root/tests/gpu/wheels}"
limit="${GPU_PYTEST_TIMEOUT_S:-240}"
mkdir -p "$out"
summary="$out/gpu_summary.json"
rm -f "$summary"

main() {
    echo "== llmdd_async GPU proof: $(date -u +%FT%TZ) on $(hostname)"
    command -v nvidia-smi >/dev/null && nvidia-smi -L
    "$py" -c 'import sys, numpy, anyio, torch; print("python", sys.version.split()[0],
"| numpy", numpy.__version__, "| torch", torch.__version__, "| cuda", torch.version.cuda,
"| cuda available:", torch.cuda.is_available())' \
        || { echo "the image lacks python/numpy/anyio/torch" >&2; return 3; }

    # 1. What the image lacks, offline, into a venv that still sees the image's torch.
    status=0
    if [[ ! -d "$wheels" ]]; then
        echo "no wheel directory $wheels: run tests/gpu/fetch_wheels.sh first and carry it" >&2
        status=4
    elif "$py" -m venv --system-site-packages "$venv" \
        && "$venv/bin/python" -c 'import numpy, anyio, torch' 2>/dev/null; then
        # (an image whose python is itself a venv: a venv made from it does not see that
        # venv's packages, so the check above sends it to the --target route below)
        vpy="$venv/bin/python"
        PIP_DISABLE_PIP_VERSION_CHECK=1 "$vpy" -m pip install --quiet --no-index \
            --find-links "$wheels" -r tests/gpu/requirements.txt || status=5
    else  # no ensurepip, or a venv that lacks the image's packages: install next to the tests
        echo "a venv over the image's packages failed; installing with --target" >&2
        vpy="$py"
        target="$venv-site"
        rm -rf "$target"
        PIP_DISABLE_PIP_VERSION_CHECK=1 "$py" -m pip install --quiet --no-index \
            --find-links "$wheels" --target "$target" -r tests/gpu/requirements.txt || status=5
        export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
    fi

    # 2. The tests, with the checkout first on the path (no install: no build backend needed).
    if (( status == 0 )); then
        export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
        export LLMDD_GPU_SUMMARY="$summary" PYTHONUNBUFFERED=1
        # -p no:llmdd_async: the checkout's own pytest plugin is not installed here anyway;
        # pyproject's pytest-asyncio settings only warn (pytest-asyncio is not needed here);
        # -o addopts=: one process (pyproject's -n 2 needs pytest-xdist, not installed here).
        # shellcheck disable=SC2086
        timeout -k 10 "$limit" "$vpy" -m pytest tests/gpu -q -rA -o addopts= --strict-markers \
            -p no:cacheprovider -p no:llmdd_async -W ignore::pytest.PytestConfigWarning \
            --timeout 120 --junitxml "$out/junit.xml" ${GPU_PYTEST_ARGS:-}
        status=$?
        (( status == 124 || status == 137 )) && echo "pytest ran past ${limit} s" >&2
    fi

    return "$status"
}

main 2>&1 | tee "$out/gpu_run.log"
status=${PIPESTATUS[0]}

# 3. A summary whatever happened (pytest writes the full one when it gets that far).
if [[ ! -s "$summary" ]]; then
    "$py" - "$summary" "$status" "$out/gpu_run.log" <<'PY'
import json, sys
path, status, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(log, errors="replace") as f:
    tail = f.read()[-6000:]
json.dump({"exitstatus": status, "error": "pytest did not write a summary", "log_tail": tail},
          open(path, "w"), indent=2)
PY
fi
echo "== exit status $status; summary: $summary" | tee -a "$out/gpu_run.log"
exit "$status"
