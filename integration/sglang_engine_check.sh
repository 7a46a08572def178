#!/usr/bin/env bash
# Engine-level check of the SGLang plugin on a GPU machine with SGLang 0.5.17 importable:
#   bash integration/sglang_engine_check.sh [OUT_DIR]
# 1. builds the tiny DeepSeek-V3 checkpoint (integration/make_tiny_checkpoint.py, no MTP layer),
# 2. runs the vLLM engine test's 10 prompts (1..3000 tokens, 48 greedy tokens, top-5 logprobs) through
#    sglang.Engine with --attention-backend flashmla_backend, with triton, and with ours broken on purpose
#    (FLASHMLA_BACKEND_DEBUG_BREAK_SCALE=1: softmax scale x1.5),
# 3. compares them with the vLLM engine test's criteria: ours vs triton must agree, broken vs triton must not.
# Each engine run has a time limit (SGLANG_RUN_TIMEOUT, default 240 s). Exit code 0 only if both hold.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=${1:-${OUT:-/tmp/flashmla_backend_sglang}}
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$ROOT/integration" || exit 1
T=${SGLANG_RUN_TIMEOUT:-240}

CKPT=$(python3 -c "import harness; print(harness.tiny_checkpoint(mtp=False))" | tail -1) || exit 1
python3 -c "
import random, json, test_vllm_engine_gpu as t
rng = random.Random(1234)
json.dump([[rng.randrange(2, 1024) for _ in range(n)] for n in t.PROMPT_LENS], open('$OUT/prompts.json', 'w'))
" || exit 1
echo "[sglang_engine_check] checkpoint $CKPT, prompts $OUT/prompts.json"

run() {  # name backend [env...]
  local name=$1 backend=$2; shift 2
  echo "[sglang_engine_check] run $name ($(date +%T))"
  env "$@" timeout "$T" python3 sglang_run.py run --model "$CKPT" --backend "$backend" --prompts "$OUT/prompts.json" \
    --out "$OUT/$name.json" --max-tokens 48 --logprobs 5 > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -E "sglang_run|attention backend|flashmla_backend|Error|error" "$OUT/$name.log" | grep -v "^\s*$" | tail -8
  [ $rc -eq 0 ] || { echo "[sglang_engine_check] $name failed (exit $rc); last lines:"; tail -30 "$OUT/$name.log"; }
  return $rc
}

status=0
run ours flashmla_backend FLASHMLA_BACKEND_DEBUG_BREAK_SCALE=0 || status=1
run triton triton || status=1
if [ $status -eq 0 ]; then
  python3 sglang_run.py compare "$OUT/ours.json" "$OUT/triton.json" --expect agree || status=1
  run broken flashmla_backend FLASHMLA_BACKEND_DEBUG_BREAK_SCALE=1 && \
    python3 sglang_run.py compare "$OUT/broken.json" "$OUT/triton.json" --expect disagree || status=1
fi
echo "[sglang_engine_check] exit $status"
exit $status
