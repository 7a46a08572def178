"""CPU model of the FP8 tensor-core kernel's accurate mode with a wgmma accumulator of limited precision.

    python benchmarks/fp8_accumulation_model.py [--keys 8192] [--rows 64] [--bits 24,16,14,13] [--promote-every 1]
        [--seed 0] [--out-bf16]

Why: on an H100 the accurate mode (q and P split into two e4m3 terms) measured 3.8e-3 against fp64 at b128 x 8192
keys, where a simulation with exact accumulation predicts about 7e-4 and the widening kernel measured 1.7e-3
(docs/perf/journal.md, 2026-11-26). The suspicion: Hopper's e4m3 wgmma keeps fewer bits in its accumulator than
fp32. This script replays the kernel's arithmetic in float64 except for the accumulator, which after every k32
chunk is truncated (toward zero) to B bits of precision (24 = fp32), and prints the output error against fp64 for
each B in three arrangements:
  chain     as the kernel did it then: S accumulates all 36 chunks of Q K^T (18 per q term) in one accumulator, O
            accumulates every block's P V (2 chunks x 2 P terms a block) in one accumulator over the whole split;
  pv-block  the same, but each block's P V goes into a fresh accumulator that is added to O in fp32 (promotion per
            block; needs a second output accumulator); `--promote-every N` promotes every N blocks instead (the
            kernel takes blocks in pairs, so 2 is a promotion per step);
  both      pv-block and Q K^T promoted per q term (each term's 18 chunks in a fresh accumulator);
  f16-pv    the accurate-mode design of docs/perf/journal.md (2026-11-27, "what is next"; the kernel's accurate mode
            since): Q K^T as in chain, P V on 16-bit tensor cores: P (x 2^8) rounded to fp16, V the exact e4m3
            values, an fp32 accumulator;
  f16-pv+qk f16-pv with Q K^T promoted per q term as in both.
`--out-bf16` rounds every output to bf16 first, as the kernels store it, and adds a column with that rounding alone
(the floor: the widening kernel, since removed, measured at it).
Data as the benchmark's: q bf16 ~ N(0, 1), the cache N(0, 1) stored as e4m3 with a per-tensor scale; one query
tile of `rows` rows against one split of `keys` keys (64-key blocks). P is taken against each row's final max (the
kernel's running max rescales O exactly in fp32, which this leaves out). The exact products of e4m3 values and the
sum of a k32 chunk are exact here; only the accumulator is rounded.
"""
import argparse

import torch

F8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
D, DV, BLOCK, CHUNK = 576, 512, 64, 32
P_SCALE = 256.0  # the kernel's 2^8 range factor of P (csrc/sm90/decode_fp8/config.h)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 (saturating), as float64."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(F8).double()


def keep_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x truncated toward zero to `bits` bits of precision (24: fp32's, except for its rounding mode)."""
    m, e = torch.frexp(x)
    return torch.ldexp(torch.trunc(m * 2.0 ** bits) / 2.0 ** bits, e)


def split_rows(x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The kernel's split of a 16-bit q (csrc/sm90/decode_fp8/q_tile.cuh): per row a power-of-two inv with
    max |x| inv in (224, 448], hi = e4m3(x inv), lo = e4m3(x inv - hi); returns (inv [rows, 1], [hi, lo])."""
    amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    inv = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    hi = e4m3(x * inv)
    return inv, [hi, e4m3(x * inv - hi)]


def p_terms(p: torch.Tensor) -> list[torch.Tensor]:
    """P x 2^8 as two e4m3 terms (mainloop.cuh: p_words)."""
    x = p * P_SCALE
    hi = e4m3(x)
    return [hi, e4m3(x - hi)]


def model(q, k_stored, dk, scale, bits, pv_block, qk_term, every=1, f16_pv=False):
    inv, q_terms = split_rows(q)
    # Q K^T in the stored units: S_stored = sum over terms and k32 chunks, accumulated with `bits` bits.
    s_acc = torch.zeros(q.shape[0], k_stored.shape[0], dtype=torch.float64)
    for t in q_terms:
        term_acc = torch.zeros_like(s_acc) if qk_term else s_acc
        for c in range(0, D, CHUNK):
            term_acc = keep_bits(term_acc + t[:, c:c + CHUNK] @ k_stored[:, c:c + CHUNK].T, bits)
        s_acc = s_acc + term_acc if qk_term else term_acc
    s = s_acc * (dk / inv) * scale
    p = torch.exp(s - s.max(-1, keepdim=True).values)
    l = p.sum(-1, keepdim=True) * P_SCALE
    v = k_stored[:, :DV]
    if f16_pv:  # one fp16 term, exact products, fp32 accumulation (16-bit wgmma)
        o = torch.zeros(q.shape[0], DV, dtype=torch.float64)
        p16 = (p * P_SCALE).to(torch.float16).double()
        for c in range(0, k_stored.shape[0], 16):
            o = (o + p16[:, c:c + 16] @ v[c:c + 16]).float().double()
        return o * dk / l
    terms = p_terms(p)
    o = torch.zeros(q.shape[0], DV, dtype=torch.float64)
    span = BLOCK * (every if pv_block else 1)
    for b in range(0, k_stored.shape[0], span):
        blk = torch.zeros_like(o) if pv_block else o
        for bb in range(b, min(b + span, k_stored.shape[0]), BLOCK):
            for t in terms:
                for c in range(bb, bb + BLOCK, CHUNK):
                    blk = keep_bits(blk + t[:, c:c + CHUNK] @ v[c:c + CHUNK], bits)
        o = keep_bits(o + blk, 24) if pv_block else blk
    return o * dk / l


def make_inputs(keys: int, rows: int, seed: int):
    """(q, the stored e4m3 cache as float64, its descale, the softmax scale, the fp64 reference output): q bf16 ~
    N(0, 1), the cache N(0, 1) stored as e4m3 with a per-tensor scale, as the benchmark's data."""
    torch.manual_seed(seed)
    q = torch.randn(rows, D).to(torch.bfloat16).double()
    real = torch.randn(keys, D, dtype=torch.float64)
    dk = real.abs().max().item() / E4M3_MAX
    k_stored = e4m3(real / dk)
    scale = D ** -0.5
    ref = torch.softmax(q @ (k_stored * dk).T * scale, -1) @ (k_stored[:, :DV] * dk)
    return q, k_stored, dk, scale, ref


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=8192, help="keys of the split, a multiple of 64 (default 8192)")
    ap.add_argument("--rows", type=int, default=64, help="query rows (default 64: one M tile)")
    ap.add_argument("--bits", default="24,16,14,13", help="accumulator precisions to model, bits (24 = fp32)")
    ap.add_argument("--promote-every", type=int, default=1,
                    help="blocks per fresh P V accumulator in the pv-block and both columns (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-bf16", action="store_true", help="round the outputs to bf16 (and print that floor)")
    args = ap.parse_args(argv)
    if args.keys <= 0 or args.keys % BLOCK:
        ap.error(f"--keys must be a positive multiple of {BLOCK}, got {args.keys}")
    if args.promote_every <= 0:
        ap.error(f"--promote-every must be positive, got {args.promote_every}")
    if args.rows <= 0:
        ap.error(f"--rows must be positive, got {args.rows}")
    try:
        bits = [int(b) for b in args.bits.split(",") if b]
    except ValueError:
        ap.error(f"--bits must be comma-separated integers, got {args.bits!r}")
    if not bits or any(b < 4 or b > 52 for b in bits):
        ap.error(f"--bits: each between 4 and 52, got {args.bits!r}")
    q, k_stored, dk, scale, ref = make_inputs(args.keys, args.rows, args.seed)
    print(f"rows {args.rows}, keys {args.keys}, P V promoted every {args.promote_every} block(s) where promoted: "
          "relative norm of the output error against fp64 (bf16 q, dequantized cache)")
    out = (lambda o: o.to(torch.bfloat16).double()) if args.out_bf16 else (lambda o: o)
    floor = f" | {((out(ref) - ref).norm() / ref.norm()).item():.1e}" if args.out_bf16 else ""
    print("| accumulator bits | chain (the kernel) | pv-block | both | f16-pv | f16-pv+qk |" +
          (" bf16 rounding alone |" if args.out_bf16 else ""))
    print("|---|---|---|---|---|---|" + ("---|" if args.out_bf16 else ""))
    for b in bits:
        errs = []
        for pv_block, qk_term, f16 in ((False, False, False), (True, False, False), (True, True, False),
                                       (False, False, True), (False, True, True)):
            o = out(model(q, k_stored, dk, scale, b, pv_block, qk_term, args.promote_every, f16))
            errs.append(((o - ref).norm() / ref.norm()).item())
        print(f"| {b} | " + " | ".join(f"{e:.1e}" for e in errs) + floor + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
