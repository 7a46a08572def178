"""CPU model of the precision of a sparse (DeepSeek-V3.2) decode on e4m3 tensor cores, against FlashMLA's way.

    python benchmarks/sparse_fp8_precision_model.py [--topk 2048] [--rows 64] [--spread 2] [--bits 24,16]
        [--seed 0]

The fp8_ds_mla token (flashmla_backend/fp8_ds_mla.py) holds 512 e4m3 latent channels in four groups of 128, each
group with an fp32 scale, and 64 bf16 rope channels. FlashMLA's Hopper sparse kernel dequantizes the latent part to
bf16 (bf16(e4m3) x bf16(scale), rounded to bf16) and runs bf16 products with P rounded to bf16. The design this
project plans (docs/perf/journal.md, 2026-11-27: "a plan for the sparse kernel") never dequantizes: per group g,
an e4m3 product q_g k_g^T goes into a fresh accumulator that S takes times the token's scale s[t, g]; the rope is a
bf16 product; P V runs per group with P[:, t] s[t, g] cast to e4m3 as the A operand, times a power-of-two factor
per group that keeps it in e4m3's range (O_g rescaled by the same factor). This script replays both in float64,
rounding what each rounds, and prints each variant's relative error (Frobenius norm over the rows' outputs)
against the fp64 attention of the bf16 q over the dequantized tokens, the outputs rounded to bf16 as both kernels
write them:
  flashmla        FlashMLA's arithmetic as above;
  fold-qQ-pP      the fold design with q's latent part as Q e4m3 terms (a per-row power-of-two scale, hi + lo,
                  benchmarks/fp8_accumulation_model.py's split) and P as P e4m3 terms; the wgmma accumulator keeps
                  B bits after every k32 chunk (--bits; 24 is fp32's; an H100 measured like about 16:
                  docs/perf/journal.md, 2026-11-27), the per-group Q K^T accumulator is fresh every block and group,
                  the P V accumulator runs over the whole top-k (one CTA's piece);
  fold-q2-pv16    the dense kernel's accurate mode carried over: Q K^T as fold-q2 with the small q term first, P V on
                  fp16 tensor cores with A = fp16(P s[t, g] x factor) and V the stored e4m3 values (exact in fp16),
                  accumulated in fp32 (csrc/sm90/decode_fp8: Traits::kPvF16).
Data: q ~ N(0, 1) in bf16 (64 rows = one M tile of heads); latent channels ~ N(0, 1) x 2^u per (token, group), u
uniform in [-spread, spread] ("spread-out group scales"), quantized per group with scale = amax / 448; rope ~ N(0, 1)
in bf16; softmax scale 576^-0.5. P is taken against each row's final max (the running max's rescale is exact).
"""
import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from fp8_accumulation_model import CHUNK, P_SCALE, e4m3, keep_bits, split_rows  # noqa: E402

GROUP, GROUPS, ROPE, BLOCK = 128, 4, 64, 64
LATENT = GROUP * GROUPS
E4M3_MAX = 448.0


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def make_data(topk: int, rows: int, spread: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    gain = torch.exp2((torch.rand(topk, GROUPS, generator=g, dtype=torch.float64) * 2 - 1) * spread)
    latent = torch.randn(topk, GROUPS, GROUP, generator=g, dtype=torch.float64) * gain[..., None]
    scale = latent.abs().amax(-1) / E4M3_MAX                                   # [topk, groups]
    stored = e4m3(latent / scale[..., None])                                   # [topk, groups, 128]
    rope = bf16(torch.randn(topk, ROPE, generator=g, dtype=torch.float64))
    q = bf16(torch.randn(rows, LATENT + ROPE, generator=g, dtype=torch.float64))
    return q, stored, scale, rope


def reference(q, stored, scale, rope, sm_scale):
    k = torch.cat([(stored * scale[..., None]).reshape(stored.shape[0], LATENT), rope], -1)
    s = (q @ k.T) * sm_scale
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return (p @ k[:, :LATENT]) / p.sum(-1, keepdim=True)


def flashmla(q, stored, scale, rope, sm_scale):
    lat = bf16(stored * bf16(scale)[..., None]).reshape(stored.shape[0], LATENT)   # bf16(e4m3) is exact
    k = torch.cat([lat, rope], -1)
    s = (q @ k.T) * sm_scale
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return bf16((bf16(p) @ lat) / p.sum(-1, keepdim=True))


def fold(q, stored, scale, rope, sm_scale, q_terms: int, p_terms: int, bits: int, pv16: bool = False):
    topk = stored.shape[0]
    inv, qt = split_rows(q[:, :LATENT])
    qt = qt[:q_terms]
    if pv16:
        qt = qt[::-1]  # the small term first
    # Q K^T: per block and group a fresh accumulator over q_terms x 4 chunks, then S += s[t, g] x it (fp32).
    s = (q[:, LATENT:] @ rope.T)                                               # the bf16 rope product
    for b in range(0, topk, BLOCK):
        for grp in range(GROUPS):
            acc = torch.zeros(q.shape[0], min(BLOCK, topk - b), dtype=torch.float64)
            kg = stored[b:b + BLOCK, grp]                                      # [block, 128]
            for t in qt:
                tg = t[:, grp * GROUP:(grp + 1) * GROUP]
                for c in range(0, GROUP, CHUNK):
                    acc = keep_bits(acc + tg[:, c:c + CHUNK] @ kg[:, c:c + CHUNK].T, bits)
            s[:, b:b + BLOCK] += acc * scale[b:b + BLOCK, grp] / inv
    s = s * sm_scale
    p = torch.exp(s - s.amax(-1, keepdim=True))
    out = torch.zeros(q.shape[0], LATENT, dtype=torch.float64)
    for grp in range(GROUPS):
        # A power-of-two factor per group keeps P s x factor within e4m3's range (largest value in (224, 448]).
        a = p * scale[:, grp] * P_SCALE
        factor = torch.exp2(torch.floor(torch.log2(E4M3_MAX / a.amax().clamp_min(1e-300))))
        a = a * factor
        v = stored[:, grp]                                                     # [topk, 128] stored e4m3 values
        o = torch.zeros(q.shape[0], GROUP, dtype=torch.float64)
        if pv16:  # one fp16 term, fp32 accumulation in k16 steps
            a16 = a.to(torch.float16).double()
            for c in range(0, topk, 16):
                o = (o + a16[:, c:c + 16] @ v[c:c + 16]).float().double()
            out[:, grp * GROUP:(grp + 1) * GROUP] = o / (factor * P_SCALE)
            continue
        terms = [e4m3(a)]
        if p_terms == 2:
            terms.append(e4m3(a - terms[0]))
        for b in range(0, topk, BLOCK):
            for t in terms:
                for c in range(b, min(b + BLOCK, topk), CHUNK):
                    o = keep_bits(o + t[:, c:c + CHUNK] @ v[c:c + CHUNK], bits)
        out[:, grp * GROUP:(grp + 1) * GROUP] = o / (factor * P_SCALE)
    return bf16(out / p.sum(-1, keepdim=True))


def rel(a, b):
    return float((a - b).norm() / b.norm())


def errors(topk: int, rows: int, spread: float, bits: list[int], seed: int = 0) -> dict:
    """The relative errors: "floor" (the output's bf16 rounding alone), "flashmla", and ("fold-qQ-pP", B)."""
    q, stored, scale, rope = make_data(topk, rows, spread, seed)
    sm = (LATENT + ROPE) ** -0.5
    ref = reference(q, stored, scale, rope, sm)
    out = {"floor": rel(bf16(ref), ref), "flashmla": rel(flashmla(q, stored, scale, rope, sm), ref)}
    for qn in (1, 2):
        for pn in (1, 2):
            for b in bits:
                out[f"fold-q{qn}-p{pn}", b] = rel(fold(q, stored, scale, rope, sm, qn, pn, b), ref)
    for b in bits:
        out["fold-q2-pv16", b] = rel(fold(q, stored, scale, rope, sm, 2, 1, b, pv16=True), ref)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--spread", type=float, default=2.0, help="group gains 2^u, u uniform in [-spread, spread]")
    ap.add_argument("--bits", default="24,16", help="comma-separated accumulator precisions (24 = fp32)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.topk < 1 or args.rows < 1 or args.spread < 0:
        ap.error("--topk and --rows must be positive and --spread non-negative")
    try:
        bits = [int(b) for b in args.bits.split(",") if b]
    except ValueError:
        ap.error(f"--bits: {args.bits!r} is not a comma-separated list of integers")
    if not bits or any(b < 4 or b > 53 for b in bits):
        ap.error("--bits: each value in 4..53")
    r = errors(args.topk, args.rows, args.spread, bits, args.seed)
    print(f"top-k {args.topk}, {args.rows} rows, group gains 2^[-{args.spread}, {args.spread}]: relative error "
          f"against fp64 (bf16 rounding of the output alone: {r['floor']:.2e})")
    print(f"  {'flashmla':<14} {r['flashmla']:.2e}")
    for qn in (1, 2):
        for pn in (1, 2):
            errs = "  ".join(f"{b} bits {r[f'fold-q{qn}-p{pn}', b]:.2e}" for b in bits)
            print(f"  fold-q{qn}-p{pn}      {errs}")
    errs = "  ".join(f"{b} bits {r['fold-q2-pv16', b]:.2e}" for b in bits)
    print(f"  fold-q2-pv16    {errs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
