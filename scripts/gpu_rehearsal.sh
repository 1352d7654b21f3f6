#!/usr/bin/env bash
# The GPU server command rehearsed on this machine (docs/gpu-server.md), so that no device minute is spent on a
# missing import: a Python 3.12 venv copying the GPU image (scripts/gpu_image_requirements.txt: its torch 2.11 and
# the image's versions of what SGLang imports), the carry set (scripts/gpu_carry.sh), then benchmark/gpu/server.sh
# on the CPU path: stock and --enable-ess on the tiny checkpoint, the same batch, tokens equal, and SGLang's serving
# benchmark. Everything lands in .rehearsal/ (git-ignored; about 5 GB, most of it torch's CUDA libraries, which PyPI's
# torch 2.11 brings). Exit 0 when the tokens are equal. CI runs it after the tests (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
find_python312() {
  for c in "${PYTHON312:-}" "$(command -v python3.12 || true)" /root/.pyenv/versions/3.12*/bin/python3.12 \
           /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -n "$c" ] && [ -x "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$c"; return; }
  done
  return 1
}
PY312=$(find_python312) || { echo "gpu_rehearsal: no Python 3.12 here (the GPU image's); set PYTHON312" >&2; exit 2; }
VENV="$PWD/.rehearsal/venv"
if [ ! -x "$VENV/bin/python" ]; then
  echo "gpu_rehearsal: a Python 3.12 venv copying the GPU image in .rehearsal/venv ($("$PY312" --version))"
  "$PY312" -m venv "$VENV"
fi
export TMPDIR="$PWD/.rehearsal/tmp"  # pip unpacks torch's CUDA libraries: on this disk, not in a small /tmp
mkdir -p "$TMPDIR"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir -r scripts/gpu_image_requirements.txt \
  2>&1 | { grep -v "is ignored" || true; }
[ -f .whl/site.tar.xz ] || bash scripts/gpu_carry.sh
rm -rf .rehearsal/site .rehearsal/out "$TMPDIR"
PYTHON="$VENV/bin/python" ESS_SITE="$PWD/.rehearsal/site" ESS_MODEL="$PWD/.rehearsal/model" ESS_DEVICE=cpu \
  bash benchmark/gpu/server.sh .rehearsal/out --servers stock-eager,ess-none-eager --lengths 200,420 \
  --buffer-tokens 96 --requests 4 --bench stock-eager,ess-none-eager --bench-output 16
