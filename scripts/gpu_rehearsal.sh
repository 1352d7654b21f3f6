#!/usr/bin/env bash
# The GPU server command rehearsed on this machine (docs/gpu-server.md), so that no device minute is spent on a
# missing import: a Python 3.12 venv copying the GPU image (scripts/gpu_image_requirements.txt: its torch 2.11 and
# the image's versions of what SGLang imports), the carry set (scripts/gpu_carry.sh), then benchmark/gpu/server.sh
# on the CPU path: stock, --enable-ess and SGLang's HiSparse on the tiny checkpoint, the same batch, tokens equal, and
# SGLang's serving benchmark; then the gain run (--gain) at the CPU's sizes; then MTP on the FP8 checkpoint (--mtp 1,
# 3). Everything lands in .rehearsal/ (git-ignored; about 3 GB: torch 2.11's CUDA libraries are the project venv's,
# linked). Exit 0 when the tokens are equal and the gain
# run benchmarked every server within the budget. CI runs it after the tests (.ci/run).
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
# torch 2.11's CUDA libraries (2.7 GB; the CPU path only loads them at import) are the project's venv's (cu13, same
# layout: torch's RPATH finds them through a link), so that the rehearsal needs about 3 GB of disk, not 6
MAIN_NVIDIA=$(ls -d "$PWD"/.venv/lib/python3*/site-packages/nvidia 2>/dev/null | head -n 1 || true)
if [ ! -x "$VENV/bin/python" ]; then
  need_gib=$([ -n "$MAIN_NVIDIA" ] && echo 5 || echo 9)
  free_gib=$(df -P -BG "$PWD" | awk 'NR == 2 {print int($4)}')
  if [ "$free_gib" -lt "$need_gib" ]; then
    echo "gpu_rehearsal: NOT REHEARSED: $free_gib GiB free on this disk, the venv needs about $need_gib (the tests ran; free space and rerun)" >&2
    exit 0
  fi
  echo "gpu_rehearsal: a Python 3.12 venv copying the GPU image in .rehearsal/venv ($("$PY312" --version))"
  "$PY312" -m venv "$VENV"
fi
export TMPDIR="$PWD/.rehearsal/tmp"  # pip unpacks torch's CUDA libraries: on this disk, not in a small /tmp
mkdir -p "$TMPDIR"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir)
TORCH_RE='^(torch|triton|torchvision)=='  # installed --no-deps beside the linked CUDA libraries
if [ -n "$MAIN_NVIDIA" ]; then
  grep -vE "$TORCH_RE" scripts/gpu_image_requirements.txt > "$TMPDIR/rest.txt"
  "${PIP[@]}" --no-deps $(grep -E "$TORCH_RE" scripts/gpu_image_requirements.txt) 2>&1 | { grep -v "is ignored" || true; }
  # torch's own requirements less its CUDA packages, as its metadata states them
  "$VENV/bin/python" -c "from importlib.metadata import requires
for r in requires('torch'):
    if 'extra ==' not in r and not r.startswith(('nvidia-', 'cuda-toolkit', 'triton')):
        print(r)" >> "$TMPDIR/rest.txt"
  # pip names the CUDA packages torch asks for and the venv lacks: they are the link below
  "${PIP[@]}" -r "$TMPDIR/rest.txt" 2>&1 | { grep -vE "is ignored|dependency (resolver|conflicts)|torch 2\.11\.0 requires" || true; }
  SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  [ -e "$SITE/nvidia" ] || ln -s "$MAIN_NVIDIA" "$SITE/nvidia"
else
  "${PIP[@]}" -r scripts/gpu_image_requirements.txt 2>&1 | { grep -v "is ignored" || true; }
fi
[ -f .whl/site.tar.xz ] || bash scripts/gpu_carry.sh
rm -rf .rehearsal/site .rehearsal/out "$TMPDIR"
PYTHON="$VENV/bin/python" ESS_SITE="$PWD/.rehearsal/site" ESS_MODEL="$PWD/.rehearsal/model" ESS_DEVICE=cpu \
  bash benchmark/gpu/server.sh .rehearsal/out --servers stock-eager,ess-none-eager,hisparse-eager --lengths 200,420 \
  --buffer-tokens 96 --requests 4 --bench stock-eager,ess-none-eager --bench-output 16
# lease.sh's resident step at the CPU's sizes: every request resident at the workload's context length. One request:
# two 300-token prompts fit one of stock's prefill batches but not ESS's staging of one context (384), and the CPU's
# kernels are not batch-invariant (on the GPU, 32K prompts in 8K chunks make one request's chunk a batch for both)
rm -rf .rehearsal/resident
PYTHON="$VENV/bin/python" ESS_SITE="$PWD/.rehearsal/site" ESS_MODEL="$PWD/.rehearsal/model" ESS_DEVICE=cpu \
  bash benchmark/gpu/server.sh .rehearsal/resident --servers stock,ess-fit --bench stock,ess-fit --requests 1 \
  --lengths 300,300 --context-length 384 --new-tokens 16 --bench-output 16
"$VENV/bin/python" - <<'EOF'
import json

report = json.load(open(".rehearsal/resident/server.json"))
fit = report["servers"]["ess-fit"]
assert report["tokens_identical"], report["pairs"]
assert fit["residency"]["offloaded_requests"] == 0 and fit["ess"]["resident_forwards"] > 0, fit
assert report["resident_over_stock"]["context_length"] == 384, report.get("resident_over_stock")
print("gpu_rehearsal: resident step", report["resident_over_stock"])
EOF
# the gain run (lease.sh's server step) at the CPU's sizes: each server's device bytes checked against the plan's one
# budget, then benchmarked with the same prompts (3x stock's requests), gain.json written after each with ESS's
# counters; ESS at stock's concurrency too
rm -rf .rehearsal/gain
PYTHON="$VENV/bin/python" ESS_SITE="$PWD/.rehearsal/site" ESS_MODEL="$PWD/.rehearsal/model" ESS_DEVICE=cpu \
  bash benchmark/gpu/server.sh .rehearsal/gain --gain --gain-input 256 --gain-output 16 --gain-stock-requests 2
"$VENV/bin/python" - <<'EOF'
import json

gain = json.load(open(".rehearsal/gain/gain.json"))["gain"]
for name, entry in gain["servers"].items():
    assert entry.get("bench", {}).get("completed"), f"gain {name}: {entry.get('error') or entry.get('bench')}"
assert list(gain["servers"]) == ["stock", "ess-none", "ess-none-at-stock", "hisparse"], list(gain["servers"])
assert gain["device_faults"] == [], gain["device_faults"]  # ESS's measured device bytes within stock's
ess = gain["servers"]["ess-none"]["ess"]
assert ess["layer_steps"] > 0 and ess["device_bytes"] > 0, ess
ratios = {k: v for k, v in gain.items() if k.split("_")[0] in ("whole", "decode", "overhead")}
assert "whole_run_gain_ess-none" in ratios and "overhead_ess-none-at-stock" in ratios, ratios
print("gpu_rehearsal: gain run", ratios, "ESS", ess)
EOF
# lease.sh's moe step at the CPU's sizes (issue 57): DeepSeek's FP8 format with the MTP layer, stock and ESS with EAGLE
# (1 then 3 draft steps, top-1), tokens compared; server.json's layer_mix and mtp_tokens_identical (the CPU's checkpoint
# is the tiny one: its MoE layer routes as DeepSeek-V3.2's, at CPU widths)
for n in 1 3; do
  rm -rf ".rehearsal/mtp$n"
  PYTHON="$VENV/bin/python" ESS_SITE="$PWD/.rehearsal/site" ESS_MODEL="$PWD/.rehearsal/model-fp8" ESS_DEVICE=cpu \
    ESS_CHECKPOINT=--fp8 bash benchmark/gpu/server.sh ".rehearsal/mtp$n" --servers stock-eager,ess-none-eager \
    --mtp "$n" --lengths 200,420 --buffer-tokens 96 --requests 4 --bench ''
  "$VENV/bin/python" - "$n" <<'EOF'
import json
import sys

n = int(sys.argv[1])
report = json.load(open(f".rehearsal/mtp{n}/server.json"))
assert report["mtp_tokens_identical"] and report["mtp_draft_steps"] == n, report["pairs"]
assert report["layer_mix"]["fp8"] and report["layer_mix"]["mtp_layers"] == 1, report["layer_mix"]
assert report["servers"]["ess-none-eager"]["ess"]["forwards"] > 0, report["servers"]["ess-none-eager"]
print(f"gpu_rehearsal: MTP {n} on the FP8 checkpoint", report["layer_mix"], report["pairs"])
EOF
done
