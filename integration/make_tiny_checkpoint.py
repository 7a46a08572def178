#!/usr/bin/env python3
"""Build a random-weight DeepSeek-V3-architecture checkpoint whose outputs depend on attention.

    python integration/make_tiny_checkpoint.py --config integration/models/tiny-deepseek-v3/config.json \
        --out /tmp/flashmla_backend_ckpt/tiny-deepseek-v3 [--mtp] [--check]

Writes config.json, model.safetensors (bf16; HF/DeepSeek tensor names, which vLLM's DeepSeek-V3 loader
reads) and an offline word-level tokenizer (tokenizer.json: tokens "<s>", "</s>", "w2" ... "w{V-1}",
split on whitespace; built with the `tokenizers` library, no download).

Why not load_format="dummy": vLLM's dummy weights give uniform logits, so every backend "agrees" and a
comparison proves nothing. Here the weights are scaled so that
  - attention is selective (queries are scaled up, so scores spread over several units),
  - the residual stream carries comparable embedding, attention and MLP parts,
  - the LM head makes the next-token distribution peaked (entropy well below ln(vocab)).
--check (needs transformers with DeepSeek-V3) loads the checkpoint with transformers, verifies that
every tensor was used, and prints the mean next-token entropy next to ln(vocab), plus how much the
logits move when the attention softmax scale is multiplied by 1.5 (the test hook the engine tests
use): the checkpoint is rejected if the entropy is not well below uniform or attention barely matters.

A DeepSeek-V3.2 config (model_type deepseek_v32: DeepSeek Sparse Attention, index_topk / index_n_heads /
index_head_dim) also gets each layer's indexer (self_attn.indexer: wq_b from the query LoRA, wk and weights_proj
from the hidden state, k_norm a LayerNorm), the tensors vLLM's and transformers' DeepSeek-V3.2 models load.

--mtp adds one multi-token-prediction layer (num_nextn_predict_layers = 1: enorm, hnorm, eh_proj,
shared_head and a full MoE decoder block at index num_hidden_layers), which vLLM's DeepSeek MTP
drafter loads for speculative decoding.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

SEED = 20240531
# Gains (multiples of 1/sqrt(fan_in)) chosen for the properties listed above; see --check.
GAIN_Q = 2.5  # q_b_proj: sharper attention
GAIN_ATTN_OUT = 1.5  # o_proj: attention's share of the residual stream
GAIN_MLP = 0.5  # dense MLP, experts, shared experts
GAIN_LM_HEAD = 4.0  # peaked next-token distributions
ENTROPY_LIMIT = 0.6  # reject if mean entropy >= 0.6 * ln(vocab)
ATTENTION_MIN_KL = 0.05  # reject if scale x1.5 moves the next-token distribution less than this (nats)


def linear(gen, out_features: int, in_features: int, gain: float = 1.0) -> torch.Tensor:
    return torch.randn((out_features, in_features), generator=gen) * (gain / math.sqrt(in_features))


def decoder_block(gen, cfg: dict, prefix: str, layer_idx: int) -> dict[str, torch.Tensor]:
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kv_lora, q_lora = cfg["kv_lora_rank"], cfg.get("q_lora_rank")
    t = {
        f"{prefix}.input_layernorm.weight": torch.ones(h),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(h),
        f"{prefix}.self_attn.kv_a_proj_with_mqa.weight": linear(gen, kv_lora + rope, h),
        f"{prefix}.self_attn.kv_a_layernorm.weight": torch.ones(kv_lora),
        f"{prefix}.self_attn.kv_b_proj.weight": linear(gen, heads * (nope + v), kv_lora),
        f"{prefix}.self_attn.o_proj.weight": linear(gen, h, heads * v, GAIN_ATTN_OUT),
    }
    if "index_topk" in cfg:  # DeepSeek-V3.2: the layer's indexer, which picks the tokens attention reads
        n_idx, d_idx = cfg["index_n_heads"], cfg["index_head_dim"]
        t[f"{prefix}.self_attn.indexer.wq_b.weight"] = linear(gen, n_idx * d_idx, q_lora)
        t[f"{prefix}.self_attn.indexer.wk.weight"] = linear(gen, d_idx, h)
        t[f"{prefix}.self_attn.indexer.k_norm.weight"] = torch.ones(d_idx)
        t[f"{prefix}.self_attn.indexer.k_norm.bias"] = torch.zeros(d_idx)
        t[f"{prefix}.self_attn.indexer.weights_proj.weight"] = linear(gen, n_idx, h)
    if q_lora:
        t[f"{prefix}.self_attn.q_a_proj.weight"] = linear(gen, q_lora, h)
        t[f"{prefix}.self_attn.q_a_layernorm.weight"] = torch.ones(q_lora)
        t[f"{prefix}.self_attn.q_b_proj.weight"] = linear(gen, heads * (nope + rope), q_lora, GAIN_Q)
    else:
        t[f"{prefix}.self_attn.q_proj.weight"] = linear(gen, heads * (nope + rope), h, GAIN_Q)

    dense = layer_idx < cfg.get("first_k_dense_replace", 0) or cfg.get("n_routed_experts") is None
    if dense:
        inter = cfg["intermediate_size"]
        t[f"{prefix}.mlp.gate_proj.weight"] = linear(gen, inter, h, GAIN_MLP)
        t[f"{prefix}.mlp.up_proj.weight"] = linear(gen, inter, h, GAIN_MLP)
        t[f"{prefix}.mlp.down_proj.weight"] = linear(gen, h, inter, GAIN_MLP)
        return t
    n_exp, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    t[f"{prefix}.mlp.gate.weight"] = linear(gen, n_exp, h)
    if cfg.get("topk_method") == "noaux_tc":
        t[f"{prefix}.mlp.gate.e_score_correction_bias"] = torch.zeros(n_exp)  # kept in fp32, as DeepSeek ships it
    for e in range(n_exp):
        t[f"{prefix}.mlp.experts.{e}.gate_proj.weight"] = linear(gen, inter, h, GAIN_MLP)
        t[f"{prefix}.mlp.experts.{e}.up_proj.weight"] = linear(gen, inter, h, GAIN_MLP)
        t[f"{prefix}.mlp.experts.{e}.down_proj.weight"] = linear(gen, h, inter, GAIN_MLP)
    shared = cfg.get("n_shared_experts") or 0
    if shared:
        s_inter = inter * shared
        t[f"{prefix}.mlp.shared_experts.gate_proj.weight"] = linear(gen, s_inter, h, GAIN_MLP)
        t[f"{prefix}.mlp.shared_experts.up_proj.weight"] = linear(gen, s_inter, h, GAIN_MLP)
        t[f"{prefix}.mlp.shared_experts.down_proj.weight"] = linear(gen, h, s_inter, GAIN_MLP)
    return t


def make_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, vocab, n_layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    embed = torch.randn((vocab, h), generator=gen)
    lm_head = linear(gen, vocab, h, GAIN_LM_HEAD)
    t = {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(h), "lm_head.weight": lm_head}
    for i in range(n_layers):
        t.update(decoder_block(gen, cfg, f"model.layers.{i}", i))
    for j in range(cfg.get("num_nextn_predict_layers", 0) or 0):
        i = n_layers + j
        p = f"model.layers.{i}"
        t.update(decoder_block(gen, cfg, p, i))
        t[f"{p}.embed_tokens.weight"] = embed.clone()  # DeepSeek MTP shares the main embedding
        t[f"{p}.enorm.weight"] = torch.ones(h)
        t[f"{p}.hnorm.weight"] = torch.ones(h)
        t[f"{p}.eh_proj.weight"] = linear(gen, h, 2 * h)
        t[f"{p}.shared_head.norm.weight"] = torch.ones(h)
        t[f"{p}.shared_head.head.weight"] = lm_head.clone()
    out = {}
    for name, x in t.items():
        out[name] = x.float().contiguous() if name.endswith("e_score_correction_bias") else x.to(torch.bfloat16)
    return out


def write_tokenizer(out: Path, vocab_size: int, bos_id: int, eos_id: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    special = {bos_id: "<s>", eos_id: "</s>"}
    vocab = {special.get(i, f"w{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "w2", "model_max_length": 1 << 20, "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "w2"}))


def check_with_transformers(out: Path, cfg: dict, num_prompts: int, prompt_len: int) -> dict:
    """Loads the checkpoint with transformers; returns entropy and attention-sensitivity figures."""
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, output_loading_info=True)
    mtp_prefix = f"model.layers.{cfg['num_hidden_layers']}."
    missing = [k for k in info.get("missing_keys", [])]
    unexpected = [k for k in info.get("unexpected_keys", []) if not k.startswith(mtp_prefix)]
    if missing or unexpected or info.get("mismatched_keys"):
        raise SystemExit(f"checkpoint does not match transformers' {cfg['model_type']}: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}, mismatched {info.get('mismatched_keys')}")
    model = model.to(device).eval()
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(2, cfg["vocab_size"], (num_prompts, prompt_len), generator=gen).to(device)

    def logprobs():
        with torch.no_grad():
            return torch.log_softmax(model(ids).logits.float(), dim=-1)

    lp = logprobs()
    entropy = float(-(lp.exp() * lp).sum(-1).mean())
    attn = [m for m in model.modules() if hasattr(m, "scaling") and hasattr(m, "kv_b_proj")]
    for m in attn:
        m.scaling *= 1.5
    lp_broken = logprobs()
    for m in attn:
        m.scaling /= 1.5
    kl = float((lp.exp() * (lp - lp_broken)).sum(-1).mean())
    top1_same = float((lp.argmax(-1) == lp_broken.argmax(-1)).float().mean())
    return {"entropy": entropy, "uniform_entropy": math.log(cfg["vocab_size"]), "kl_scale_x1.5": kl,
            "top1_agreement_scale_x1.5": top1_same, "attention_layers": len(attn), "device": device}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, type=Path, help="a DeepSeek-V3 or -V3.2 config.json")
    ap.add_argument("--out", required=True, type=Path, help="output directory (created)")
    ap.add_argument("--mtp", action="store_true", help="add one MTP layer (num_nextn_predict_layers = 1)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--check", action="store_true", help="load with transformers and check entropy/attention")
    ap.add_argument("--check-prompts", type=int, default=4)
    ap.add_argument("--check-len", type=int, default=128)
    args = ap.parse_args(argv)

    t0 = time.time()
    cfg = json.loads(args.config.read_text())
    model_type = cfg.get("model_type")
    if model_type not in ("deepseek_v3", "deepseek_v32"):
        raise SystemExit(f"{args.config}: model_type {model_type!r}, expected 'deepseek_v3' or 'deepseek_v32'")
    if model_type == "deepseek_v32":
        missing = [k for k in ("index_topk", "index_n_heads", "index_head_dim", "q_lora_rank") if not cfg.get(k)]
        if missing:
            raise SystemExit(f"{args.config}: a deepseek_v32 config needs {', '.join(missing)} (the indexer's shape)")
    cfg["num_nextn_predict_layers"] = 1 if args.mtp else 0
    cfg["torch_dtype"] = "bfloat16"
    args.out.mkdir(parents=True, exist_ok=True)

    from safetensors.torch import save_file

    weights = make_weights(cfg, args.seed)
    save_file(weights, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    (args.out / "config.json").write_text(json.dumps(cfg, indent=1))
    (args.out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.get("bos_token_id", 0), "eos_token_id": cfg.get("eos_token_id", 1)}))
    write_tokenizer(args.out, cfg["vocab_size"], cfg.get("bos_token_id", 0), cfg.get("eos_token_id", 1))
    n_params = sum(x.numel() for x in weights.values())
    print(f"[make_tiny_checkpoint] wrote {args.out}: {len(weights)} tensors, {n_params / 1e6:.1f} M parameters, "
          f"{cfg['num_hidden_layers']} layers{' + 1 MTP layer' if args.mtp else ''}, "
          f"{time.time() - t0:.1f} s", flush=True)

    if args.check:
        r = check_with_transformers(args.out, cfg, args.check_prompts, args.check_len)
        print(f"[make_tiny_checkpoint] transformers check on {r['device']}: mean next-token entropy "
              f"{r['entropy']:.3f} nats (uniform: {r['uniform_entropy']:.3f}); attention scale x1.5 moves it by "
              f"KL {r['kl_scale_x1.5']:.3f} nats, top-1 agreement {r['top1_agreement_scale_x1.5']:.1%} "
              f"({r['attention_layers']} attention layers)", flush=True)
        if r["entropy"] >= ENTROPY_LIMIT * r["uniform_entropy"]:
            print("[make_tiny_checkpoint] FAIL: entropy not well below uniform", file=sys.stderr)
            return 1
        if r["kl_scale_x1.5"] < ATTENTION_MIN_KL:
            print("[make_tiny_checkpoint] FAIL: logits barely depend on attention", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
