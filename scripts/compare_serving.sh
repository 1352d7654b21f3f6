#!/usr/bin/env bash
# Baseline vs --enable-hisparse vs --enable-ess on one GPU node, same model and flags, with SGLang's own benchmark.
# Each server is started in turn, benchmarked at several max-concurrency values, and stopped.
#   MODEL=/models/DeepSeek-V3.2 TP=8 bash scripts/compare_serving.sh
# Output: $OUT/results.jsonl, $OUT/compare.csv, $OUT/compare.png (output throughput, TPOT, ITL, TTFT).
#
# Environment (defaults in brackets): MODEL (required), TP [8], PORT [30000], INPUT_LEN [32768], OUTPUT_LEN [1024],
# CONCURRENCY ["8 16 32 64 128 256"], PROMPTS_PER_CLIENT [4], OUT [benchmark/results/serving/DATE],
# PY [the project's .venv/bin/python where it exists, else python3].
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  "") ;;
  *) echo "compare_serving.sh: no arguments (settings are environment variables; --help)" >&2; exit 2 ;;
esac
MODEL=${MODEL:?set MODEL to the DeepSeek-V3.2 checkpoint directory}
TP=${TP:-8}
PORT=${PORT:-30000}
INPUT_LEN=${INPUT_LEN:-32768}
OUTPUT_LEN=${OUTPUT_LEN:-1024}
CONCURRENCY=${CONCURRENCY:-"8 16 32 64 128 256"}
PROMPTS_PER_CLIENT=${PROMPTS_PER_CLIENT:-4}
OUT=${OUT:-benchmark/results/serving/$(date +%Y-%m-%d)}
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi  # the environment scripts/setup.sh made
fi
# --context-length: the longest request served; ESS's --ess-sparse-ratio is a share of it
COMMON=(--model-path "$MODEL" --tp-size "$TP" --kv-cache-dtype fp8_e4m3 --trust-remote-code --port "$PORT"
        --context-length $((INPUT_LEN + OUTPUT_LEN)))
declare -A SYSTEM_FLAGS=(
  [baseline]=""
  [hisparse]="--enable-hisparse --disable-radix-cache"  # HiSparse requires the radix cache off
  [ess]="--enable-ess --ess-sparse-ratio 0.2 --dsa-prefill-backend flashmla_kv --dsa-decode-backend flashmla_kv"
)
mkdir -p "$OUT"
: > "$OUT/results.jsonl"

for system in baseline hisparse ess; do
  # shellcheck disable=SC2086
  SGLANG_PLUGINS=ess $PY -m sglang.launch_server "${COMMON[@]}" ${SYSTEM_FLAGS[$system]} > "$OUT/server-$system.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
    if ! kill -0 $server 2>/dev/null; then
      echo "$system server died; the end of $OUT/server-$system.log:" >&2
      tail -n 20 "$OUT/server-$system.log" >&2
      exit 1
    fi
    sleep 10
  done
  for c in $CONCURRENCY; do
    echo "== $system, max concurrency $c" >&2
    $PY -m sglang.benchmark.serving --backend sglang --port "$PORT" --dataset-name random-ids \
      --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --random-range-ratio 1.0 \
      --num-prompts $((c * PROMPTS_PER_CLIENT)) --max-concurrency "$c" --seed 1 \
      --tag "$system" --output-file "$OUT/results.jsonl"
  done
  kill $server; wait $server 2>/dev/null || true
  trap - EXIT
done
$PY benchmark/serving_compare.py "$OUT/results.jsonl" --out "$OUT/compare"
