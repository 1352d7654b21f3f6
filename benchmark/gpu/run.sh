#!/usr/bin/env bash
# The GPU kit (docs/gpu.md): bash benchmark/gpu/run.sh [--smoke] OUT_DIR
# On a GPU: the suite's tests that need no SGLang (JUnit XML in OUT_DIR), then benchmark/gpu/kit.py, which writes
# OUT_DIR/kit.json and plots. --smoke: kit.py alone, on the CPU, tiny sizes, FlashMLA replaced by its reference.
set -euo pipefail
cd "$(dirname "$0")/../.."
smoke=""
if [ "${1:-}" = "--smoke" ]; then smoke="--smoke"; shift; fi
out=${1:?usage: benchmark/gpu/run.sh [--smoke] OUT_DIR}
mkdir -p "$out"
PY=${PYTHON:-python3}
export PYTHONPATH=".:python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
tests=()
if [ -z "$smoke" ]; then
  # SGLang is not on the GPU machine: the plugin tests (test/plugin) run in CI. The kit's own smoke test would run the
  # kit twice.
  "$PY" -m pytest -q -p no:cacheprovider --junitxml="$out/tests.xml" test/core test/reference test/analysis \
    --ignore=test/analysis/test_gpu_kit.py > "$out/tests.log" 2>&1 || true
  tail -n 3 "$out/tests.log"
  tests=(--tests "$out/tests.xml")
fi
"$PY" benchmark/gpu/kit.py $smoke "${tests[@]}" "$out" 2>&1 | tee "$out/kit.log"
