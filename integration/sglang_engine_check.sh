#!/usr/bin/env bash
# Engine-level check of the SGLang plugin on a GPU machine with SGLang 0.5.17 importable:
#   bash integration/sglang_engine_check.sh [STEP ...]        (default: all steps, in this order)
# Steps (results and logs in $OUT, default /tmp/flashmla_backend_sglang; a step reuses earlier steps' runs):
#   ours      sglang.Engine --attention-backend flashmla_backend: the vLLM engine test's 10 prompts
#             (1..3000 tokens), 48 greedy tokens, top-5 logprobs, CUDA graphs on
#   triton    the same with SGLang's triton backend (the reference)
#   baseline  two more correct configurations of triton (16 KV splits instead of 8; CUDA graphs off); each is
#             compared with `triton`, and the largest gap at which two correct runs diverge sets the tie gap
#             (never below the vLLM test's 0.3 nats) -> $OUT/calibration.json
#   compare   ours vs triton: must agree, judged with the fp32 model (sglang_run.py compare --fp32-model: each
#             run's logprobs vs the checkpoint in fp32, plus the vLLM engine test's pairwise figures; see
#             integration/README.md)
#   broken    ours with a 1.5x softmax scale (FLASHMLA_BACKEND_DEBUG_BREAK_SCALE=1) vs triton: must NOT agree
#             under the same criteria (proves they can fail)
#   mtp       speculative decoding with the MTP layer of the 512-wide tiny model (SGLang's NextN needs hidden
#             > 256; EAGLE, 3 draft steps, topk 1, 4 draft tokens): ours vs triton without speculation must
#             agree; ours' mean accept length must be at least 0.9x triton's with the same speculation (a wrong
#             draft attention lowers acceptance, the verified tokens stay right), and ours with only the draft
#             model's scale broken (FLASHMLA_BACKEND_DEBUG_BREAK_SCALE=draft) must fail that check; when
#             triton accepts almost no drafts (mean accept length < 1.3) the acceptance check says undecided
#   serve     python -m sglang.launch_server --attention-backend flashmla_backend + 64 concurrent requests
# FP8 (e4m3) KV cache: each step above with the suffix -fp8 runs the same with --kv-cache-dtype fp8_e4m3 on both
# sides (ours-fp8, triton-fp8, baseline-fp8, compare-fp8, broken-fp8, mtp-fp8, serve-fp8; results *-fp8.json, the
# tie gap from the FP8 baseline in calibration-fp8.json): ours FP8 vs SGLang's triton FP8 judged by the fp32 model as
# the bf16 steps are, the broken-scale run must fail that judgment, serve-fp8 also checks the server log for the
# plugin's FP8 line and its default-scale line (the tiny checkpoints carry no KV-cache scales). Step groups:
# "fp8" (the FP8 steps), "all" (the default steps, then the FP8 steps). Our FP8 query mode is the plugin's for SGLang
# (accurate) unless FLASHMLA_BACKEND_FP8_MODE is exported (fast: q quantized with the k scale, as SGLang's FlashMLA
# backend does); give such a run an OUT of its own, e.g. OUT=/tmp/sg-fast FLASHMLA_BACKEND_FP8_MODE=fast bash
# integration/sglang_engine_check.sh ours-fp8 triton-fp8 compare-fp8 broken-fp8.
# DeepSeek-V3.2 (group "dsa", not in "all"): the tiny V3.2 checkpoint (integration/models/tiny-deepseek-v32-topk2048:
# SGLang 0.5.17's indexer asserts a top-k of 2048; SGLang's own indexer) on SGLang's DSA backend with --kv-cache-dtype
# fp8_e4m3 (656-byte fp8_ds_mla tokens), both sides, on prompts of 1..4000 tokens (prompts-dsa.json: five of them
# longer than 2048, so read sparsely):
#   dsa-ours     FLASHMLA_BACKEND_DSA_DECODE=1 FLASHMLA_BACKEND_SPARSE_GPU=1: flashmla_backend's sparse decode in
#                SGLang's decode (the log must show the plugin's DSA line)
#   dsa-ref      SGLang's own DSA decode, --dsa-decode-backend flashmla_kv (its FlashMLA; needs sgl_kernel's
#                flashmla_ops); the plugin's DSA line must be absent
#   dsa-compare  dsa-ours vs dsa-ref judged by the fp32 model as the FP8 steps are
#   dsa-broken   dsa-ours with a 1.5x softmax scale: must fail that judgment
#   dsa-serve    launch_server with our DSA decode + 64 concurrent requests, the DSA line in its log
# and with the bfloat16 cache (--kv-cache-dtype bfloat16, 576 values a token; group "dsa-bf16", not in "dsa"):
#   dsa-ours-bf16     our sparse decode (the tokens gathered for the dense kernel), the DSA line in the log
#   dsa-ref-bf16      SGLang's own, --dsa-decode-backend flashmla_sparse (its FlashMLA's bf16 sparse kernel)
#   dsa-compare-bf16  the two judged by the fp32 model as dsa-compare
# Each engine run has a time limit (SGLANG_RUN_TIMEOUT, default 240 s; 480 s for the DSA runs: on an H200 the first
# V3.2 start of a machine took 212 s, 164 of them capturing the prefill CUDA graphs, the next start 42 s, which
# reads as first-use compilation). Exit code 0 only if every step held.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=${OUT:-/tmp/flashmla_backend_sglang}
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$ROOT/integration" || exit 1
T=${SGLANG_RUN_TIMEOUT:-240}
T_DSA=${SGLANG_RUN_TIMEOUT:-480}
BF16_STEPS=(ours triton baseline compare broken mtp serve)
FP8_STEPS=("${BF16_STEPS[@]/%/-fp8}")
DSA_STEPS=(dsa-ours dsa-ref dsa-compare dsa-broken dsa-serve)
DSA_BF16_STEPS=(dsa-ours-bf16 dsa-ref-bf16 dsa-compare-bf16)
STEPS=()
for s in "$@"; do
  case $s in
    fp8) STEPS+=("${FP8_STEPS[@]}") ;;
    dsa) STEPS+=("${DSA_STEPS[@]}") ;;
    dsa-bf16) STEPS+=("${DSA_BF16_STEPS[@]}") ;;
    all) STEPS+=("${BF16_STEPS[@]}" "${FP8_STEPS[@]}") ;;
    *) STEPS+=("$s") ;;
  esac
done
[ ${#STEPS[@]} -gt 0 ] || STEPS=("${BF16_STEPS[@]}")
for s in "${STEPS[@]}"; do
  case ${s%-fp8} in ours|triton|baseline|compare|broken|mtp|serve|dsa-ours|dsa-ref|dsa-compare|dsa-broken|dsa-serve) ;;
    dsa-ours-bf16|dsa-ref-bf16|dsa-compare-bf16) ;;
    *) echo "unknown step '$s'" >&2; exit 2;; esac
  case $s in dsa-*-fp8) echo "unknown step '$s' (the DSA steps run the FP8 cache already)" >&2; exit 2;; esac
done

say() { echo "[sglang_engine_check] $* ($(date +%T))"; }
CKPT=$(python3 -c "import harness; print(harness.tiny_checkpoint(mtp=True))" | tail -1) || exit 1
# A prompts file (made once): random token ids, one prompt of each length of the Python expression $2.
write_prompts() {
  [ -f "$1" ] || python3 -c "
import random, json, test_vllm_engine_gpu as t
rng = random.Random(1234)
json.dump([[rng.randrange(2, 1024) for _ in range(n)] for n in $2], open('$1', 'w'))
"
}
write_prompts "$OUT/prompts.json" t.PROMPT_LENS || exit 1
say "checkpoint $CKPT (with its MTP layer), prompts $OUT/prompts.json, steps ${STEPS[*]}"

run() {  # name backend [sglang_run options...] [-- env...]
  local name=$1 backend=$2; shift 2
  local opts=() envs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do opts+=("$1"); shift; done
  [ $# -gt 0 ] && shift && envs=("$@")
  say "run $name ($backend ${opts[*]} ${envs[*]})"
  env "${envs[@]}" timeout "$T" python3 sglang_run.py run --model "${MODEL:-$CKPT}" --backend "$backend" \
    --prompts "${PROMPTS:-$OUT/prompts.json}" --out "$OUT/$name.json" --max-tokens 48 --logprobs 5 "${opts[@]}" \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -E "sglang_run|MLA decode attention runs on|FP8 KV cache with the default scale" "$OUT/$name.log" | tail -5
  [ $rc -eq 0 ] || { say "$name failed (exit $rc); last lines:"; tail -30 "$OUT/$name.log"; }
  return $rc
}
need() { for f in "$@"; do [ -f "$OUT/$f.json" ] || { say "missing $OUT/$f.json (run its step first)"; return 1; }; done; }
cmp() { python3 sglang_run.py compare "$@"; }
# Tie gap: calibrated by the baseline step (of the same KV-cache format) when it ran; divergences beyond it are
# judged by the fp32 model.
tie() { [ -f "$OUT/calibration$X.json" ] && echo --tie-gap-from "$OUT/calibration$X.json"; }
ADJ=(--fp32-model "$CKPT" --prompts "$OUT/prompts.json")

# DeepSeek-V3.2: its checkpoint (made on first use), its prompts, the environments of our decode and of SGLang's own.
ck32() {
  python3 -c "import harness; print(harness.tiny_checkpoint(harness.MODELS / 'tiny-deepseek-v32-topk2048' / 'config.json', mtp=False))" |
    tail -1
}
DSA_PROMPTS=$OUT/prompts-dsa.json
DSA_PROMPT_LENS="[1, 17, 64, 300, 1000, 2047, 2049, 2500, 3000, 4000]"
DSA_OURS_ENV=(FLASHMLA_BACKEND_DSA_DECODE=1 FLASHMLA_BACKEND_SPARSE_GPU=1)
DSA_KV=(--kv-cache-dtype fp8_e4m3)
DSA_KV_BF16=(--kv-cache-dtype bfloat16)
dsa_run() {  # name [sglang_run options...] [-- env...]: a V3.2 run, then its log checked for whose decode ran
  local name=$1; shift
  local envs=() a
  for a in "$@"; do [ "$a" = -- ] && envs=() && continue; envs+=("$a"); done
  T=$T_DSA MODEL=$CK32 PROMPTS=$DSA_PROMPTS run "$name" dsa "$@" &&
    env "${envs[@]}" python3 sglang_run.py logcheck --backend dsa "$OUT/$name.log"
}

status=0
for s in "${STEPS[@]}"; do
  case $s in
    dsa-*)
      CK32=${CK32:-$(ck32)} && write_prompts "$DSA_PROMPTS" "$DSA_PROMPT_LENS" || { status=1; continue; }
      case $s in
        dsa-ours) dsa_run dsa-ours "${DSA_KV[@]}" -- "${DSA_OURS_ENV[@]}" FLASHMLA_BACKEND_DEBUG_BREAK_SCALE=0 ||
                    status=1 ;;
        dsa-ref) dsa_run dsa-ref "${DSA_KV[@]}" --dsa-decode-backend flashmla_kv -- FLASHMLA_BACKEND_DSA_DECODE=0 ||
                   status=1 ;;
        dsa-compare)
          { need dsa-ours dsa-ref &&
            cmp "$OUT/dsa-ours.json" "$OUT/dsa-ref.json" --fp32-model "$CK32" --prompts "$DSA_PROMPTS"; } ||
            status=1 ;;
        dsa-broken)
          { dsa_run dsa-broken "${DSA_KV[@]}" -- "${DSA_OURS_ENV[@]}" FLASHMLA_BACKEND_DEBUG_BREAK_SCALE=1 &&
            need dsa-ref && cmp "$OUT/dsa-broken.json" "$OUT/dsa-ref.json" --expect disagree --fp32-model "$CK32" \
              --prompts "$DSA_PROMPTS"; } || status=1 ;;
        dsa-ours-bf16)
          dsa_run dsa-ours-bf16 "${DSA_KV_BF16[@]}" -- "${DSA_OURS_ENV[@]}" FLASHMLA_BACKEND_DEBUG_BREAK_SCALE=0 ||
            status=1 ;;
        dsa-ref-bf16)
          dsa_run dsa-ref-bf16 "${DSA_KV_BF16[@]}" --dsa-decode-backend flashmla_sparse -- \
            FLASHMLA_BACKEND_DSA_DECODE=0 || status=1 ;;
        dsa-compare-bf16)
          { need dsa-ours-bf16 dsa-ref-bf16 &&
            cmp "$OUT/dsa-ours-bf16.json" "$OUT/dsa-ref-bf16.json" --fp32-model "$CK32" --prompts "$DSA_PROMPTS"; } ||
            status=1 ;;
        dsa-serve)
          # DSA prefills a batch whose sequences are all at most 2048 tokens (outside its prefill CUDA graphs) on
          # SGLang's dense MHA path, which calls sgl_kernel's FA3 library; the GPU machine's SGLang set leaves that
          # library out (1.1 GB). The server's warmup is such a batch (one short prompt); the engine runs above,
          # all prompts at once, up to 4000 tokens, did not take the path. A threshold of 0 keeps the server's
          # prefill on DSA's sparse MLA path; the decode under test is the same either way.
          say "dsa-serve"
          env "${DSA_OURS_ENV[@]}" SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD=0 timeout $((T_DSA + 360)) python3 sglang_run.py serve --model "$CK32" --backend dsa \
            --start-timeout "$T_DSA" --log "$OUT/dsa-serve.log" "${DSA_KV[@]}" || status=1 ;;
      esac
      continue ;;
  esac
  # X: the result-name suffix of the step's KV-cache format, KV: the sglang_run.py options that select it.
  if [ "$s" != "${s%-fp8}" ]; then X=-fp8; KV=(--kv-cache-dtype fp8_e4m3); else X=; KV=(); fi
  case ${s%-fp8} in
    ours) run ours$X flashmla_backend "${KV[@]}" -- FLASHMLA_BACKEND_DEBUG_BREAK_SCALE=0 || status=1 ;;
    triton) run triton$X triton "${KV[@]}" || status=1 ;;
    baseline)
      { run triton-splits16$X triton --kv-splits 16 "${KV[@]}" &&
        run triton-eager$X triton --disable-cuda-graph "${KV[@]}" && need triton$X &&
        python3 sglang_run.py calibrate "$OUT/triton-splits16$X.json,$OUT/triton$X.json" \
          "$OUT/triton-eager$X.json,$OUT/triton$X.json" --out "$OUT/calibration$X.json"; } || status=1 ;;
    compare)
      { need ours$X triton$X && cmp "$OUT/ours$X.json" "$OUT/triton$X.json" $(tie) "${ADJ[@]}"; } || status=1 ;;
    broken)
      { run broken$X flashmla_backend "${KV[@]}" -- FLASHMLA_BACKEND_DEBUG_BREAK_SCALE=1 && need triton$X &&
        cmp "$OUT/broken$X.json" "$OUT/triton$X.json" --expect disagree $(tie) "${ADJ[@]}"; } || status=1 ;;
    mtp)
      # SGLang's NextN drafter needs hidden_size > 256 (fused_eh_norm): the 512-wide variant of the tiny model.
      CK512=$(python3 -c "import harness; print(harness.tiny_checkpoint(harness.MODELS / 'tiny-deepseek-v3-h512' / 'config.json', mtp=True))" | tail -1)
      ADJ512=(--fp32-model "$CK512" --prompts "$OUT/prompts.json")
      { MODEL=$CK512 run triton-h512$X triton "${KV[@]}" &&
        MODEL=$CK512 run ours-mtp$X flashmla_backend --mtp 3 "${KV[@]}" -- FLASHMLA_BACKEND_DEBUG_BREAK_SCALE=0 &&
        MODEL=$CK512 run triton-mtp$X triton --mtp 3 "${KV[@]}" &&
        say "baseline: triton with speculation vs triton without" &&
        { cmp "$OUT/triton-mtp$X.json" "$OUT/triton-h512$X.json" $(tie) "${ADJ512[@]}" || true; } &&
        say "ours with speculation (target verify, draft extend and draft decode on our kernel) vs triton without" &&
        cmp "$OUT/ours-mtp$X.json" "$OUT/triton-h512$X.json" $(tie) "${ADJ512[@]}"; } || status=1
      if [ -f "$OUT/ours-mtp$X.json" ] && [ -f "$OUT/triton-mtp$X.json" ]; then
        say "draft acceptance: ours vs triton, both speculative"
        cmp "$OUT/ours-mtp$X.json" "$OUT/triton-mtp$X.json" --min-accept-ratio 0.9 $(tie) "${ADJ512[@]}"; rc=$?
        if [ $rc -eq 2 ]; then
          say "acceptance check undecided (drafts of this random MTP layer are almost never accepted)"
        elif [ $rc -ne 0 ]; then
          status=1
        else
          { MODEL=$CK512 run ours-mtp-broken-draft$X flashmla_backend --mtp 3 "${KV[@]}" -- FLASHMLA_BACKEND_DEBUG_BREAK_SCALE=draft &&
            say "the acceptance check must fail when only the draft model's attention is wrong" &&
            cmp "$OUT/ours-mtp-broken-draft$X.json" "$OUT/triton-mtp$X.json" --min-accept-ratio 0.9 --expect disagree \
              $(tie); } || status=1
        fi
      fi ;;
    serve)
      say "serve$X"
      timeout $((T + 360)) python3 sglang_run.py serve --model "$CKPT" --log "$OUT/serve$X.log" "${KV[@]}" || status=1 ;;
  esac
done
say "exit $status"
exit $status
