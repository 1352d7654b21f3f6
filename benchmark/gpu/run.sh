#!/usr/bin/env bash
# The GPU runs (docs/gpu.md):
#   bash benchmark/gpu/run.sh [--smoke] OUT_DIR [--all | PHASE[:SECONDS] ...] [--budget-min M] [--tests all|gpu|none]
#                             [--decode-args "ARGS"] [--tar FILE]
# Phases, in order (--all: every one; no phase named: kit):
#   kit          the suite's tests that need no SGLang (JUnit XML in OUT_DIR), then benchmark/gpu/kit.py (kit.json, plots)
#   decode32k    benchmark/decode_gpu.py at 32K (decode.json, decode.png)
#   decode128k   the same at 128K, appended to decode.json
#   bookkeeping  benchmark/bookkeeping.py (bookkeeping.json)
#   indexer      benchmark/indexer_kernels.py (indexer.json): the indexer kernel and its top-k part by part
# --smoke: every phase on the CPU at tiny sizes (FlashMLA replaced by its reference, no tests run), as CI checks it.
# --budget-min M (default 20): the phases share M minutes in order; each runs under what is left, and one the budget
# cuts is named in OUT_DIR/phases.log (its results are whatever it wrote). PHASE:SECONDS caps that phase as well.
# --tests (kit): all (default) runs test/core, test/reference and test/analysis; gpu only the files with CUDA paths
# (the LRU kernels, the miss kernel, FlashTrans, the overlap layer, the whole layer's rest, the indexer and its top-k
# selects); none skips them.
# --decode-args: more arguments for decode_gpu.py (e.g. "--query-rows 1 --ratios 0.1,0.2").
# --tar FILE: after every phase, OUT_DIR packed into FILE (the device tool brings back 8 files at most).
# The device tool caps a command at 10 minutes: there, give the phases caps that fit (docs/gpu.md, "Running it", has
# each phase's time on an H200).
set -euo pipefail
cd "$(dirname "$0")/../.."
ALL=(kit decode32k decode128k bookkeeping indexer)
smoke="" out="" budget=20 phases=() tests=all decode_args="" tar=""
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) smoke="--smoke" ;;
    --all) phases=("${ALL[@]}") ;;
    --budget-min) budget=${2:?--budget-min needs minutes}; shift ;;
    --tests) tests=${2:?--tests needs all, gpu or none}; shift
      case "$tests" in all|gpu|none) ;; *) echo "run.sh: --tests must be all, gpu or none, got $tests" >&2; exit 2 ;; esac ;;
    --decode-args) decode_args=${2?--decode-args needs arguments}; shift ;;
    --tar) tar=${2:?--tar needs a file}; shift ;;
    kit|decode32k|decode128k|bookkeeping|indexer) phases+=("$1") ;;
    kit:*|decode32k:*|decode128k:*|bookkeeping:*|indexer:*)
      [[ "${1#*:}" =~ ^[0-9]+$ ]] || { echo "run.sh: $1: the cap must be whole seconds" >&2; exit 2; }
      phases+=("$1") ;;
    -*) echo "run.sh: unknown flag $1" >&2; exit 2 ;;
    *) if [ -n "$out" ]; then echo "run.sh: unknown phase $1 (phases: ${ALL[*]})" >&2; exit 2; fi; out=$1 ;;
  esac
  shift
done
[ -n "$out" ] || { echo "usage: benchmark/gpu/run.sh [--smoke] OUT_DIR [--all | PHASE ...] [--budget-min M]" >&2; exit 2; }
[[ "$budget" =~ ^[0-9]+([.][0-9]+)?$ ]] && awk "BEGIN{exit !($budget > 0)}" \
  || { echo "run.sh: --budget-min must be a positive number of minutes, got $budget" >&2; exit 2; }
[ ${#phases[@]} -gt 0 ] || phases=(kit)
mkdir -p "$out"
PY=${PYTHON:-python3}
export PYTHONPATH=".:python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
deadline=$(awk "BEGIN{printf \"%d\", $(date +%s) + $budget * 60}")
echo "run.sh: phases ${phases[*]}${smoke:+ (smoke)}, $budget min in all, into $out"

phase_kit() {
  local tests=()
  if [ -z "$smoke" ]; then
    # the CUDA LRU step (sgl-kernel/) from source with this machine's nvcc, then its self-check on the GPU; where it
    # does not build, `auto` serves the Triton kernel and the log says why
    "$PY" -m ess.core.kernels.lru_step_cuda --check > "$out/lru_cuda.log" 2>&1 || true
    tail -n 2 "$out/lru_cuda.log"
    # SGLang is not on the GPU machine: the plugin tests (test/plugin) run in CI. The kit's own smoke test, and the
    # benchmarks' smoke tests, would run the kit and the benchmarks again.
    local files=(test/core test/reference test/analysis --ignore=test/analysis/test_gpu_kit.py
                 --ignore=test/analysis/test_decode_gpu.py)
    [ "$test_set" = gpu ] && files=(test/core/test_lru_cuda.py test/core/test_lru_kernel.py test/core/test_miss_attention.py
                                    test/core/test_flashtrans.py test/reference/test_overlap.py
                                    test/reference/test_layer_rest.py test/core/test_indexer_kernel.py
                                    test/core/test_topk_select.py)
    if [ "$test_set" != none ]; then
      "$PY" -m pytest -q -p no:cacheprovider --junitxml="$out/tests.xml" "${files[@]}" > "$out/tests.log" 2>&1 || true
      tail -n 3 "$out/tests.log"
      tests=(--tests "$out/tests.xml")
    fi
  fi
  "$PY" benchmark/gpu/kit.py $smoke "${tests[@]}" "$out" 2>&1 | tee "$out/kit.log"
}
phase_decode32k() {
  if [ -n "$smoke" ]; then "$PY" benchmark/decode_gpu.py --smoke --out "$out"
  else "$PY" benchmark/decode_gpu.py --contexts 32768 $decode_args --out "$out"; fi 2>&1 | tee "$out/decode32k.log"
}
phase_decode128k() {
  if [ -n "$smoke" ]; then "$PY" benchmark/decode_gpu.py --smoke --append --out "$out"
  else "$PY" benchmark/decode_gpu.py --contexts 131072 $decode_args --append --out "$out"; fi 2>&1 | tee "$out/decode128k.log"
}
phase_bookkeeping() {
  "$PY" benchmark/bookkeeping.py $smoke "$out" 2>&1 | tee "$out/bookkeeping.log"
}
phase_indexer() {
  "$PY" benchmark/indexer_kernels.py $smoke "$out" 2>&1 | tee "$out/indexer.log"
}

status=0
test_set=$tests
for spec in "${phases[@]}"; do
  phase=${spec%%:*}
  left=$(( deadline - $(date +%s) ))
  if [ "$left" -le 0 ]; then
    echo "$phase: not run (the budget of $budget min was spent)" | tee -a "$out/phases.log"
    status=1
    continue
  fi
  [ "$spec" = "$phase" ] || [ "${spec#*:}" -ge "$left" ] || left=${spec#*:}
  start=$(date +%s)
  export -f "phase_$phase"
  export smoke out PY test_set decode_args
  set +e
  timeout "$left" bash -c "set -euo pipefail; phase_$phase"
  rc=$?
  set -e
  took=$(( $(date +%s) - start ))
  if [ "$rc" -eq 124 ]; then
    echo "$phase: cut by the budget after ${took} s${left:+ (its share: $left s)}" | tee -a "$out/phases.log"
    status=1
  else
    echo "$phase: exit $rc after ${took} s" | tee -a "$out/phases.log"
    [ "$rc" -eq 0 ] || status=1
  fi
  [ -z "$tar" ] || tar czf "$tar" -C "$(dirname "$out")" "$(basename "$out")"
done
exit $status
