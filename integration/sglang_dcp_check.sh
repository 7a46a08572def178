#!/usr/bin/env bash
# SGLang decode context parallelism on 2 GPUs (TP 2 + DCP 2, SGLang with --dcp-size, e.g. 0.5.17):
#   bash integration/sglang_dcp_check.sh MODEL_DIR PROMPTS_JSON
# MODEL_DIR: a random tiny DeepSeek-V3 checkpoint (integration/make_tiny_checkpoint.py), PROMPTS_JSON as for
# sglang_engine_check.sh. Steps (results in $OUT, default /tmp/flashmla_backend_sglang_dcp):
#   ours     prefill flashinfer, decode flashmla_backend, TP 2 + DCP 2
#   ref      prefill and decode flashinfer (SGLang's own MLA DCP decode), TP 2 + DCP 2
#   compare  ours vs ref must agree, judged with the fp32 model (sglang_run.py compare --fp32-model)
#   broken   ours with a 1.5x softmax scale (FLASHMLA_BACKEND_DEBUG_BREAK_SCALE=1) vs ref must NOT agree
#   serve    launch_server at TP 2 + DCP 2 with ours as the decode backend, 64 concurrent requests, every one
#            complete, the log showing our decode on the DCP path (sglang_run.py serve --dcp 2)
# Fewer than 2 GPUs, or an SGLang without --dcp-size: prints SKIP with the reason and exits 0.
set -uo pipefail
MODEL=${1:?model dir}; PROMPTS=${2:?prompts.json}
OUT=${OUT:-/tmp/flashmla_backend_sglang_dcp}; mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then echo "SKIP: SGLang DCP check needs 2 GPUs, $gpus visible"; exit 0; fi
run() { # NAME DECODE_BACKEND [ENV=...]
  local name=$1 dec=$2; shift 2
  env "$@" timeout "${SGLANG_RUN_TIMEOUT:-400}" python "$HERE/sglang_dcp_run.py" --dcp 2 --decode-backend "$dec" -- \
    run --model "$MODEL" --backend "$dec" --prompts "$PROMPTS" --out "$OUT/$name.json" --max-tokens 48 \
    >"$OUT/$name.log" 2>&1
}
fail=0
run ours flashmla_backend || { echo "ours: failed (log $OUT/ours.log)"; fail=1; }
grep -q "SKIP" "$OUT/ours.log" && { grep SKIP "$OUT/ours.log"; exit 0; }
grep -q "DeepSeek decode on flashmla_backend runs the DCP path" "$OUT/ours.log" \
  || { echo "ours: the log lacks the plugin's DCP routing line"; fail=1; }
run ref flashinfer || { echo "ref: failed (log $OUT/ref.log)"; fail=1; }
run broken flashmla_backend FLASHMLA_BACKEND_DEBUG_BREAK_SCALE=1 || { echo "broken: failed to run"; fail=1; }
python "$HERE/sglang_run.py" compare "$OUT/ours.json" "$OUT/ref.json" --fp32-model "$MODEL" --prompts "$PROMPTS" \
  || { echo "compare: ours vs flashinfer at DCP 2 disagree"; fail=1; }
python "$HERE/sglang_run.py" compare "$OUT/broken.json" "$OUT/ref.json" --expect disagree --fp32-model "$MODEL" \
  --prompts "$PROMPTS" || { echo "broken: the broken-scale run was not detected"; fail=1; }
python "$HERE/sglang_run.py" serve --model "$MODEL" --backend flashmla_backend --dcp 2 --requests 64 \
  --log "$OUT/serve.log" > "$OUT/serve-client.log" 2>&1 \
  || { echo "serve: launch_server at DCP 2 failed (logs $OUT/serve-client.log, $OUT/serve.log)"; fail=1; }
[ $fail = 0 ] && echo "SGLang DCP 2: ours agrees with flashinfer; the broken hook is detected; launch_server served 64 requests"
exit $fail
