#!/usr/bin/env bash
# A lease's first device call, prepared (docs/gpu.md, "The next GPU run"): what waits for a GPU, most valuable
# first, in one command under the device tool's 10-minute cap, each step under what is left of the budget and OUT
# packed into OUT/gpu.tgz after each (the device tool brings back 8 files at most).
#   bash benchmark/gpu/lease.sh OUT [--budget-min M] [--steps server,moe,resident,decode47,indexer] [--smoke]
# Steps, in order (the developers' guide's: the honest workload, the real layer mix and MTP, the resident step, the
# kernels):
#   server    the real server's gain with residency on (benchmark/gpu/server.sh --gain --gain-modes none): 32K in /
#             2K out, 24 prompts all at once to stock (8 at a time), ESS (as many as stock's bytes hold), ESS at
#             stock's 8 and SGLang's HiSparse under the same bytes; each server's device bytes checked first,
#             gain.json written after each (the 32K / 256 run with two servers took about 350 s on the H200; this
#             one has not run)
#             Both server steps write the checkpoint with a real model's top-k locality (ESS_LOCALITY, default the
#             fitted 0.125; empty: the random checkpoint, as every GPU figure before).
#   moe       DeepSeek-V3.2's layer mix at one GPU's share of EP8 in its FP8 format with the MTP layer (issue 57:
#             ESS_CHECKPOINT="--moe-layers 4 --fp8", the rig's MoE / FP8 / EAGLE stand-ins, ess_gpu_rig.rig_moe): stock
#             and ESS with EAGLE of 1 (eager too) then 3 draft steps, CUDA graphs, tokens compared, SGLang's
#             serving benchmark on each (moe-mtp1/, moe-mtp3/ server.json: layer_mix, mtp_tokens_identical; not yet
#             run: its kernels' first run on a GPU, each scheduler checking them first)
#   resident  every request resident at the workload's context length (issue 58): stock and ESS with C = the request's
#             reach (ess-fit), 8 prompts of 32K at --context-length 33088, tokens compared, SGLang's serving benchmark
#             on each (256 out) with CUDA graphs: server.json's resident_over_stock, the context length beside it
#   server128k  the same at 128K in / 2K out: stock holds 2 requests, ESS (C = 0.1 x context) 6, 6 prompts; only
#             with --steps (a second call: --steps moe,resident,server128k)
#   decode47  issue 47's decode reruns with the region map: 32K MTP verify, then 128K decode, baseline and none
#             (benchmark/decode_gpu.py --rest modelled, one decode.json; about 150 s on the H200)
#   indexer   the indexer's parts and its top-k paths (benchmark/indexer_kernels.py; what is left)
# Carry .whl/site.tar.xz and .whl/kernels (bash scripts/gpu_carry.sh): the site holds SGLang and sgl-flash-mla for
# every step. --budget-min (default 9.5) shares the minutes; --smoke runs the decode and indexer steps on the CPU at
# tiny sizes (the server step is rehearsed by scripts/gpu_rehearsal.sh), as CI checks this script.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="" budget=9.5 smoke="" steps="server,moe,resident,decode47,indexer"
while [ $# -gt 0 ]; do
  case "$1" in
    --budget-min) budget=${2:?--budget-min needs minutes}; shift ;;
    --steps) steps=${2:?--steps needs a comma-separated list}; shift ;;
    --smoke) smoke="--smoke" ;;
    -*) echo "lease.sh: unknown flag $1" >&2; exit 2 ;;
    *) [ -z "$OUT" ] || { echo "lease.sh: one OUT, got $OUT and $1" >&2; exit 2; }; OUT=$1 ;;
  esac
  shift
done
[ -n "$OUT" ] || { echo "usage: bash benchmark/gpu/lease.sh OUT [--budget-min M] [--steps LIST] [--smoke]" >&2; exit 2; }
for s in ${steps//,/ }; do
  case "$s" in server|resident|server128k|moe|decode47|indexer) ;; *) echo "lease.sh: --steps: unknown step $s (server, resident, server128k, moe, decode47, indexer)" >&2; exit 2 ;; esac
done
wanted() { [[ ",$steps," == *",$1,"* ]]; }
[[ "$budget" =~ ^[0-9]+([.][0-9]+)?$ ]] && awk "BEGIN{exit !($budget > 0)}" \
  || { echo "lease.sh: --budget-min must be a positive number of minutes, got $budget" >&2; exit 2; }
PY=${PYTHON:-python3}
RUN="$OUT/lease"  # everything but the archive, which alone sits at OUT's top
mkdir -p "$RUN"
deadline=$(awk "BEGIN{printf \"%d\", $(date +%s) + $budget * 60}")
if [ -z "$smoke" ]; then
  source benchmark/gpu/site.sh || exit 2
  export PYTHONPATH=".:python:$SITE" ESS_KERNEL_CACHE="$PWD/.whl/kernels"  # flash_mla from the site
else
  export PYTHONPATH=".:python"
fi
export PYTHONUNBUFFERED=1
status=0

# step NAME CAP_SECONDS COMMAND...: the command under min(CAP, what is left), its output in RUN/NAME.log
step() {
  local name=$1 cap=$2 left rc start
  shift 2
  left=$(( deadline - $(date +%s) ))
  if [ "$left" -le 10 ]; then
    echo "$name: not run (the budget of $budget min was spent)" | tee -a "$RUN/steps.log"
    status=1
    return
  fi
  [ "$cap" -ge "$left" ] || left=$cap
  start=$(date +%s)
  timeout "$left" "$@" > "$RUN/$name.log" 2>&1
  rc=$?
  tail -n 3 "$RUN/$name.log"
  if [ "$rc" -eq 124 ]; then
    echo "$name: cut after $(( $(date +%s) - start )) s (its share: $left s)" | tee -a "$RUN/steps.log"
  else
    echo "$name: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$RUN/steps.log"
  fi
  [ "$rc" -eq 0 ] || status=1
  tar czf "$OUT/gpu.tgz" -C "$OUT" lease
}

decode47() {  # 32K MTP verify, then 128K decode appended: baseline and none, as call 3 of 2026-11-27 ran them
  local common=(--modes baseline,none --rest modelled --out "$RUN/decode47")
  if [ -n "$smoke" ]; then
    "$PY" benchmark/decode_gpu.py --smoke "${common[@]}" && "$PY" benchmark/decode_gpu.py --smoke --append "${common[@]}"
  else
    "$PY" benchmark/decode_gpu.py --contexts 32768 --ratios 0.2 --query-rows 3 "${common[@]}" \
      && "$PY" benchmark/decode_gpu.py --contexts 131072 --ratios 0.1 --query-rows 1 --append "${common[@]}"
  fi
}

# the server steps' checkpoint: a real model's top-k locality (the CPU fit, benchmark/results/locality/fit.json);
# ESS_LOCALITY= (empty) for the random checkpoint
LOCALITY=${ESS_LOCALITY-0.125}
moe() {  # the FP8 MoE checkpoint with MTP: EAGLE of 1 then 3 draft steps, stock against ESS (one checkpoint, written once)
  local n rc=0 servers
  for n in 1 3; do  # the second runs whatever the first found: each is its own result
    servers=stock,ess-none
    [ "$n" = 1 ] && servers=stock-eager,ess-none-eager,$servers  # eager beside: tells a graph-only difference
    env PYTHON="$PY" ESS_LOCALITY="$LOCALITY" ESS_CHECKPOINT="--moe-layers 4 --fp8" bash benchmark/gpu/server.sh \
      "$RUN/moe-mtp$n" --servers "$servers" --bench stock,ess-none --mtp "$n" || rc=1
  done
  return $rc
}

for name in server moe resident server128k; do
  wanted "$name" || continue
  if [ -n "$smoke" ]; then
    echo "$name: not run with --smoke (scripts/gpu_rehearsal.sh rehearses it)" | tee -a "$RUN/steps.log"
  elif [ "$name" = server ]; then
    step server 540 env PYTHON="$PY" ESS_LOCALITY="$LOCALITY" bash benchmark/gpu/server.sh "$RUN/server" --gain \
      --gain-modes none
  elif [ "$name" = resident ]; then
    step resident 240 env PYTHON="$PY" ESS_LOCALITY="$LOCALITY" bash benchmark/gpu/server.sh "$RUN/resident" \
      --servers stock,ess-fit --bench stock,ess-fit --requests 8 --lengths 32768,32768 --context-length 33088 \
      --new-tokens 32 --bench-output 256
  elif [ "$name" = moe ]; then
    export -f moe
    export PY LOCALITY RUN
    step moe 540 bash -c moe
  else
    step server128k 540 env PYTHON="$PY" ESS_LOCALITY="$LOCALITY" bash benchmark/gpu/server.sh "$RUN/server128k" \
      --gain --gain-modes none \
      --gain-input 131072 --gain-stock-requests 2 --gain-ratio 0.1
  fi
done
export -f decode47
export PY smoke RUN
! wanted decode47 || step decode47 200 bash -c "set -o pipefail; decode47"
! wanted indexer || step indexer 600 "$PY" benchmark/indexer_kernels.py $smoke "$RUN/indexer"
exit $status
