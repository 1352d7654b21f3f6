#!/usr/bin/env bash
# Creates .venv (if missing) and installs ESS with its test extras. Idempotent; run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
