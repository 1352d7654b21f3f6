#!/usr/bin/env bash
# The real server on the GPU machine (docs/gpu-server.md): unpack the carried packages (scripts/gpu_carry.sh made
# them here), register the plugin and the GPU rig, write the full-width checkpoint, then run benchmark/gpu/server.py.
#   bash benchmark/gpu/server.sh OUT [server.py arguments]
# Env: PYTHON (python3), ESS_SITE (where the packages are unpacked; /tmp/ess-site), ESS_MODEL (the checkpoint
# directory, written if missing; /tmp/dsv32-full, or /tmp/dsv32-full-locality-X), ESS_DEVICE (cuda; cpu rehearses on
# the CPU path with a tiny model), ESS_LOCALITY (a checkpoint with a real model's top-k locality at this noise share:
# ess tiny-checkpoint --locality; the fitted 0.125, benchmark/results/locality/fit.json; unset: the random one),
# ESS_CHECKPOINT (tiny-checkpoint's flags beyond --full-width and the device's: on the GPU "--no-mtp" unless set, e.g.
# "--moe-layers 4 --fp8" for DeepSeek-V3.2's layer mix in its FP8 format with the MTP layer; on the CPU none).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: bash benchmark/gpu/server.sh OUT [server.py arguments]}
shift
PY=${PYTHON:-python3}
LOCALITY=${ESS_LOCALITY:-}
CKPT_TAG=$(echo "${ESS_CHECKPOINT-}" | sed 's/--//g; s/ \+/-/g')  # the checkpoint's flags in its directory's name
MODEL=${ESS_MODEL:-/tmp/dsv32-full${CKPT_TAG:+-$CKPT_TAG}${LOCALITY:+-locality-$LOCALITY}}
read -ra ckpt_gpu <<< "${ESS_CHECKPOINT---no-mtp}"
read -ra ckpt_cpu <<< "${ESS_CHECKPOINT-}"
locality=(${LOCALITY:+--locality "$LOCALITY"})
DEVICE=${ESS_DEVICE:-cuda}
t0=$(date +%s)
say() { echo "[server.sh +$(( $(date +%s) - t0 ))s] $*"; }
mkdir -p "$OUT"
source benchmark/gpu/site.sh || exit 2  # SITE: the carried packages, unpacked
# SGLang finds plugins by entry point: the ESS plugin and the rig, from the source tree
dist="$SITE/ess_gpu_server-0.dist-info"
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: ess-gpu-server\nVersion: 0\n' > "$dist/METADATA"
printf '[sglang.srt.plugins]\ness = sglang_ess:register\ness_gpu_rig = ess_gpu_rig:register\n' > "$dist/entry_points.txt"
export PYTHONPATH="$PWD/python/sglang_ess/cpu/standin:$SITE:$PWD/benchmark/gpu/stubs:$PWD:$PWD/python"
export SGLANG_PLUGINS=ess,ess_gpu_rig PYTHONUNBUFFERED=1
eval "$("$PY" -c 'import ess_gpu_rig as r; print("".join(f"export {k}={v}; " for k, v in r.SETTINGS.items()))')" || exit 2
# the CUDA LRU step built here beforehand (scripts/gpu_carry.sh), if carried: no nvcc build in the timed run
[ -d .whl/kernels ] && export ESS_KERNEL_CACHE="$PWD/.whl/kernels"
if [ "$DEVICE" = cuda ]; then
  "$PY" -c 'import sglang, torch, flash_mla; print(f"sglang {sglang.__version__}, torch {torch.__version__}")' 2>&1 | tail -1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  if [ ! -f "$MODEL/model.safetensors" ]; then
    "$PY" -m ess.cli tiny-checkpoint "$MODEL" --full-width "${ckpt_gpu[@]}" --device cuda "${locality[@]}" || exit 2
    say "wrote the full-width checkpoint: $(du -sh "$MODEL" | cut -f1)"
  fi
else
  "$PY" -c 'import sglang, torch; print(f"sglang {sglang.__version__}, torch {torch.__version__} (the CPU path)")' 2>&1 | tail -1
  [ -f "$MODEL/model.safetensors" ] || "$PY" -m ess.cli tiny-checkpoint "$MODEL" "${ckpt_cpu[@]}" "${locality[@]}" \
    || exit 2
fi
(nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 5 > "$OUT/nvidia-smi.csv" 2>/dev/null &)
"$PY" benchmark/gpu/server.py "$OUT" --model "$MODEL" --device "$DEVICE" "$@"
rc=$?
pkill -f "nvidia-smi --query-gpu=timestamp" 2>/dev/null
say "server.py exited $rc"
exit $rc
