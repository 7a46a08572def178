#!/usr/bin/env python3
"""One vLLM engine run in its own process (so every run starts from a clean GPU and its own env).

    python integration/vllm_run.py --model DIR --backend CUSTOM --prompts prompts.json --out result.json \
        [--max-tokens 32] [--logprobs 5] [--enforce-eager] [--tp 2] [--mtp 2] [--block-size 64] \
        [--kv-cache-dtype fp8] [--calculate-kv-scales | --kv-scales-from-prompts] [--report-kv-scales]

prompts.json: a list of prompts, each a list of token ids. Greedy decoding (temperature 0, ignore_eos so
every run generates exactly --max-tokens tokens). result.json:
  {"backend", "vllm_version", "init_s", "generate_s", "kv_cache_dtype", "calculate_kv_scales",
   "kv_scales": {layer: {"k", "q", "k_float", "q_float", "k_range", "q_range"}} or null,
   "kv_scale_calibration": {layer: {"kv_c_amax", "k_pe_amax", "q_amax", "q_unabsorbed_amax", "k", "q"}} or null,
   "outputs": [{"token_ids": [...], "logprobs": [{"<token id>": logprob, ...} per generated token]}]}
Each position's dict has the top --logprobs tokens plus the chosen one.

FP8 KV cache (--kv-cache-dtype fp8): the query mode of our plugin comes from FLASHMLA_BACKEND_FP8_MODE in this
process's environment (the engine processes inherit it). KV scales:
  * default: 1.0 for every layer (the tiny checkpoint carries no KV-cache scales);
  * --calculate-kv-scales: vLLM's own (deprecated) calculation, CacheConfig.calculate_kv_scales: MLAAttention.forward
    sets k_scale = amax(kv_c_normed) / K_SCALE_CONSTANT and q_scale = amax(q before the W_UK absorption) /
    Q_SCALE_CONSTANT (both 200 by default) on the first forward that reaches it;
  * --kv-scales-from-prompts: scales measured on this run's prompts: after start-up, every MLA layer of the target
    model records the largest |value| of what its cache stores (kv_c_normed and k_pe) and of the query a decode kernel
    reads (W_UK-absorbed ql_nope and q_pe) during one prefill of all prompts (max_tokens 1); then k_scale = that
    amax / 448 and q_scale likewise (the e4m3 maximum; _k_scale, _v_scale, _q_scale, their _float twins and the CPU
    copies set in place, so captured CUDA graphs read them). Prefix caching is off in this mode: blocks written
    during the measurement (with scale 1.0) must not be reused. Not with --mtp (the drafter is not calibrated).
  * --report-kv-scales: reads every MLA layer's scales back after generation (into "kv_scales").
The last two send functions to the engine process (LLM.apply_model), which vLLM allows only with
VLLM_ALLOW_INSECURE_SERIALIZATION=1: this script sets it for its own engine when either is given.

The test harness (integration/conftest.py) runs this with VLLM_USE_FLASHINFER_SAMPLER=0 and
HF_HUB_OFFLINE=1, and with the plugin discoverable through the vllm.general_plugins entry point.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

E4M3_MAX = 448.0
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


# ---- KV scales: these functions run inside the engine's worker process (LLM.apply_model) ----------

def mla_layers(model) -> list:
    """(name, MLAAttention module) of every MLA attention layer of the model."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return [(name, m) for name, m in model.named_modules() if isinstance(m, MLAAttention)]


def latent_amax(layer, q, k_c_normed, k_pe):
    """Largest |value| of [kv_c_normed, k_pe, the decode query (W_UK-absorbed ql_nope and q_pe), the query before
    absorption] for one batch: a float32 tensor of 4 on the batch's device. q [T, N, nope + rope], k_c_normed
    [T, kv_lora_rank], k_pe [T, 1, rope]; the layer gives qk_nope_head_dim, qk_rope_head_dim and W_UK_T
    [N, nope, kv_lora_rank], the weight forward_impl multiplies q_nope by for the decode kernel."""
    import torch

    q_nope, q_pe = q.split([layer.qk_nope_head_dim, layer.qk_rope_head_dim], dim=-1)
    ql_nope = torch.bmm(q_nope.transpose(0, 1), layer.W_UK_T)   # [N, T, kv_lora_rank], as forward_impl computes it
    return torch.stack([k_c_normed.abs().amax(), k_pe.abs().amax(),
                        torch.maximum(ql_nope.abs().amax(), q_pe.abs().amax()), q.abs().amax()]).float()


def scale_from_amax(amax: float, fp8_max: float = E4M3_MAX) -> float:
    """The per-tensor scale that maps amax onto the e4m3 maximum (1.0 when nothing was seen)."""
    if not math.isfinite(amax) or amax < 0:
        raise ValueError(f"cannot derive a KV scale from amax {amax}")
    return amax / fp8_max if amax > 0 else 1.0


def set_layer_scales(layer, k_scale: float, q_scale: float) -> None:
    """Sets an MLA layer's KV scale (K and V share the latent cache) and query scale everywhere vLLM keeps them,
    in place: the device tensors keep their addresses, so captured CUDA graphs read the new values."""
    layer._k_scale.fill_(k_scale)
    layer._v_scale.fill_(k_scale)
    layer._q_scale.fill_(q_scale)
    layer._k_scale_float = layer._v_scale_float = float(k_scale)
    layer._q_scale_float = float(q_scale)
    layer._k_scale_cpu.fill_(k_scale)
    layer._v_scale_cpu.fill_(k_scale)


def install_amax_recorders(model) -> list[str]:
    """Wraps every MLA layer's forward_impl (which vLLM calls eagerly, outside compiled graphs, for prefill batches)
    so that it accumulates latent_amax of each batch it sees; returns the layer names."""
    import torch

    names = []
    for name, m in mla_layers(model):
        m._calib_amax = torch.zeros(4, dtype=torch.float32, device=m._k_scale.device)
        original = m.forward_impl

        def recording(q, k_c_normed, k_pe, kv_cache, attn_metadata, *args, _m=m, _original=original, **kwargs):
            n = getattr(attn_metadata, "num_actual_tokens", 0) if attn_metadata is not None else 0
            if n > 0:
                torch.maximum(_m._calib_amax, latent_amax(_m, q[:n], k_c_normed[:n], k_pe[:n]), out=_m._calib_amax)
            return _original(q, k_c_normed, k_pe, kv_cache, attn_metadata, *args, **kwargs)

        m.forward_impl = recording
        names.append(name)
    return names


def apply_recorded_scales(model) -> dict:
    """Removes the recorders and sets each layer's scales from what they saw: k = max(kv_c, k_pe) amax / 448,
    q = absorbed-query amax / 448. Returns the amaxes and scales per layer."""
    out = {}
    for name, m in mla_layers(model):
        del m.forward_impl   # the instance attribute; the class's method again
        kv_c, k_pe, q, q_unabsorbed = (float(x) for x in m._calib_amax.tolist())
        del m._calib_amax
        k_scale, q_scale = scale_from_amax(max(kv_c, k_pe)), scale_from_amax(q)
        set_layer_scales(m, k_scale, q_scale)
        out[name] = {"kv_c_amax": kv_c, "k_pe_amax": k_pe, "q_amax": q, "q_unabsorbed_amax": q_unabsorbed,
                     "k": k_scale, "q": q_scale}
    return out


def read_kv_scales(model) -> dict:
    """Every MLA layer's scales as the kernels see them (device tensors) and as vLLM's floats hold them."""
    out = {}
    for name, m in mla_layers(model):
        out[name] = {"k": float(m._k_scale.item()), "q": float(m._q_scale.item()),
                     "k_float": float(m._k_scale_float), "q_float": float(m._q_scale_float),
                     "k_range": float(getattr(m, "k_range", float("nan"))),
                     "q_range": float(getattr(m, "q_range", float("nan")))}
    return out


def describe_scales(scales: dict | None) -> str:
    """One line: the range of k and q scales over the layers ("not reported" for None)."""
    if not scales:
        return "not reported"
    ks = [v["k"] for v in scales.values()]
    qs = [v["q"] for v in scales.values()]
    return (f"{len(scales)} MLA layers, k_scale {min(ks):.4g}..{max(ks):.4g}, q_scale {min(qs):.4g}..{max(qs):.4g}"
            f"{' (all 1.0: the default)' if set(ks) == {1.0} and set(qs) == {1.0} else ''}")


# ---- the run ------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", required=True, help="attention backend: CUSTOM, TRITON_MLA, FLASHMLA, ...")
    ap.add_argument("--prompts", required=True, help="JSON file: list of token-id lists")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--mtp", type=int, default=0, help="MTP speculative tokens (0: off)")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    scales = ap.add_mutually_exclusive_group()
    scales.add_argument("--calculate-kv-scales", action="store_true", help="vLLM's calculate_kv_scales")
    scales.add_argument("--kv-scales-from-prompts", action="store_true",
                        help="measure the scales on the prompts first (see the docstring)")
    ap.add_argument("--report-kv-scales", action="store_true", help="read every MLA layer's scales back")
    return ap


def check_args(args) -> str | None:
    """Why the combination is refused, or None."""
    fp8 = args.kv_cache_dtype != "auto"
    if (args.calculate_kv_scales or args.kv_scales_from_prompts) and not fp8:
        return "KV scales apply only to an FP8 KV cache: add --kv-cache-dtype fp8"
    if args.kv_scales_from_prompts and args.mtp:
        return "--kv-scales-from-prompts calibrates the target model's layers only; it does not combine with --mtp"
    return None


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    problem = check_args(args)
    if problem:
        ap.error(problem)

    for var in ("VLLM_USE_FLASHINFER_SAMPLER", "HF_HUB_OFFLINE"):
        if var not in os.environ:
            print(f"[vllm_run] warning: {var} is not set", file=sys.stderr, flush=True)
    if args.kv_scales_from_prompts or args.report_kv_scales:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"   # LLM.apply_model sends functions to the engine

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.load(open(args.prompts))
    kwargs = dict(
        model=args.model, attention_backend=args.backend, enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tp, max_model_len=args.max_model_len, seed=0,
        gpu_memory_utilization=args.gpu_memory_utilization, load_format=args.load_format,
        max_logprobs=max(20, args.logprobs), kv_cache_dtype=args.kv_cache_dtype,
    )
    if args.block_size:
        kwargs["block_size"] = args.block_size
    if args.mtp:
        kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": args.mtp}
    if args.calculate_kv_scales:
        kwargs["calculate_kv_scales"] = True
    if args.kv_scales_from_prompts:
        kwargs["enable_prefix_caching"] = False
    mode = os.environ.get("FLASHMLA_BACKEND_FP8_MODE")
    print(f"[vllm_run] vLLM {vllm.__version__}: {json.dumps({k: v for k, v in kwargs.items() if k != 'model'})}"
          f"{f'; FLASHMLA_BACKEND_FP8_MODE={mode}' if mode else ''}", flush=True)
    t0 = time.time()
    llm = LLM(**kwargs)
    init_s = time.time() - t0
    token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    calibration = None
    if args.kv_scales_from_prompts:
        layers = llm.apply_model(install_amax_recorders)[0]
        t = time.time()
        llm.generate(token_prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        calibration = llm.apply_model(apply_recorded_scales)[0]
        if sorted(calibration) != sorted(layers):
            raise RuntimeError(f"calibrated layers {sorted(calibration)} differ from the recorded ones "
                               f"{sorted(layers)}")
        print(f"[vllm_run] KV scales from the prompts ({time.time() - t:.1f} s): {describe_scales(calibration)}",
              flush=True)
        for name, c in calibration.items():
            print(f"[vllm_run]   {name}: amax kv_c {c['kv_c_amax']:.4g}, k_pe {c['k_pe_amax']:.4g}, decode q "
                  f"{c['q_amax']:.4g} (q before absorption {c['q_unabsorbed_amax']:.4g}) -> k_scale {c['k']:.4g}, "
                  f"q_scale {c['q']:.4g}", flush=True)

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=args.logprobs, ignore_eos=True)
    t1 = time.time()
    results = llm.generate(token_prompts, params, use_tqdm=False)
    generate_s = time.time() - t1

    scales = None
    if args.report_kv_scales:
        scales = llm.apply_model(read_kv_scales)[0]
        print(f"[vllm_run] KV scales after generation: {describe_scales(scales)}", flush=True)

    outputs = []
    for r in results:
        c = r.outputs[0]
        positions = []
        for pos in range(len(c.token_ids)):
            lp = c.logprobs[pos]
            positions.append({str(tok): float(v.logprob) for tok, v in lp.items()})
        outputs.append({"token_ids": list(c.token_ids), "logprobs": positions})
    with open(args.out, "w") as f:
        json.dump({"backend": args.backend, "vllm_version": vllm.__version__, "init_s": init_s,
                   "generate_s": generate_s, "kv_cache_dtype": args.kv_cache_dtype,
                   "calculate_kv_scales": args.calculate_kv_scales, "kv_scales": scales,
                   "kv_scale_calibration": calibration, "outputs": outputs}, f)
    print(f"[vllm_run] {args.backend}: {len(prompts)} prompts, init {init_s:.1f} s, generate {generate_s:.1f} s",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
