"""The FP8 KV cache kernel (sm_90a, FP8 tensor cores) against fp64 attention on the dequantized inputs (GPU only).

Accurate mode (bf16/fp16 q, e4m3 cache) and fast mode (e4m3 q and cache): NaN in every unused cache slot, huge ids
in unused block-table entries, lengths 0 and non-multiples of 64, s_q up to 16 causal, short prefills of 90 and 128
query tokens, h_kv 1 and 2; bitwise repeatability; CUDA-graph replays that read a descale_k changed after capture.
Descales per (request, KV head) ([b, h_kv], any strides): against fp64 and the reference, bitwise the per-tensor
result of each request's own scale, expanded stride-0 tensors bitwise the per-tensor ones, graph replays with the
tables changed. At most 32 query rows a KV head: both modes' two tiles (the accurate mode: keys on M or the stacked Q
tile up to 16 rows, the stacked or the 64-row tile at 17-32; the fast mode: keys on M or the 64-row tile up to 16),
each against fp64, with per-request descales and graph replays; the stacked Q tile at every row count in both its
P V forms (e4m3 P V with a two-term P, the default at up to 32 rows, and fp16 P V in both its plans;
FLASHMLA_BACKEND_FP8_DEBUG bit 16384 runs the other), the e4m3 form also over pieces longer than its promotion interval
of O. Both modes'
V-in-registers tiles (FLASHMLA_BACKEND_FP8_DEBUG bit 1024) at every case their 64-row tiles serve, with several
requests a CTA, per-request descales and graph replays. The removed kernel switch
FLASHMLA_BACKEND_FP8_KERNEL is refused.
"""
import pytest
import torch

import flashmla_backend as fb
from flashmla_backend import _ext, ops
from fp8kit import (ACCURATE_LSE, dequantized, descale_table, fp8_inputs, out_tolerance, quantize, rel_norm,
                    run_fp8_decode, sm90_fp8_problem)
from kit import D_V, Case, Inputs, brute_force_fp64, make_inputs

pytestmark = pytest.mark.gpu


def _out_tol(mode):
    return out_tolerance(mode == "e4m3q")


CASES = [
    Case(lengths=[100, 300], h_q=16),
    Case(lengths=[64, 1000, 0], h_q=128),
    Case(lengths=[1, 65, 700, 4000], s_q=2, h_q=128, h_kv=2),
    Case(lengths=[5, 16, 17, 640, 3000], s_q=16, h_q=32),
    Case(lengths=[0, 16, 129, 640, 3000], s_q=4, h_q=64, causal=False),
    Case(lengths=[8192], h_q=128),
    Case(lengths=[37 * i % 2100 for i in range(40)], h_q=16, seed=3),
    # short prefills on the decode kernel (the vLLM builder's threshold of 128): a fresh prompt and a chunk
    Case(lengths=[128, 1000], s_q=128, h_q=16, seed=128),
    Case(lengths=[90, 700], s_q=90, h_q=128, seed=90),
]


@pytest.fixture(autouse=True)
def _sm90():
    problem = sm90_fp8_problem()
    if problem:
        pytest.skip(problem)


def _matches_fp64(case, mode, label=""):
    """One FP8 decode (mode: bf16q / fp16q / e4m3q, with case.dtype q's 16-bit type) run twice: bitwise the same,
    out in its dtype without NaN, out and lse against fp64 attention on the dequantized inputs."""
    inp, dq, dk = fp8_inputs(case, "cuda", q_fp8=mode == "e4m3q", k_gain=0.7)
    out, lse = run_fp8_decode(inp, case, dq, dk)
    out2, lse2 = run_fp8_decode(inp, case, dq, dk)
    assert torch.equal(out.view(torch.int16), out2.view(torch.int16)) and torch.equal(lse, lse2), "not deterministic"
    assert out.dtype == (torch.bfloat16 if mode == "e4m3q" else case.dtype)
    assert not torch.isnan(out).any()
    ref_out, ref_lse = brute_force_fp64(dequantized(inp, dq, dk), case.causal)
    e_out, e_lse = rel_norm(out, ref_out), rel_norm(lse, ref_lse)
    print(f"{case} {mode}{label}: out {e_out:.2e} lse {e_lse:.2e}")
    assert e_out < _out_tol(mode)
    assert e_lse < ACCURATE_LSE
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(ref_lse.cpu()))


@pytest.mark.parametrize("mode", ["bf16q", "fp16q", "e4m3q"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_fp8_decode_matches_fp64(case, mode):
    q_dtype = torch.float16 if mode == "fp16q" else torch.bfloat16
    _matches_fp64(Case(**{**case.__dict__, "dtype": q_dtype}), mode)


def test_graph_replay_reads_the_current_descale():
    case = Case(lengths=[300, 1500], s_q=2, h_q=128)
    inp, _, dk = fp8_inputs(case, "cuda")
    descale = dk.clone()
    run_fp8_decode(inp, case, None, descale)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run_fp8_decode(inp, case, None, descale)
        with torch.cuda.graph(g, stream=s):
            out, lse = run_fp8_decode(inp, case, None, descale)
    torch.cuda.current_stream().wait_stream(s)
    descale.mul_(1.75)
    g.replay()
    torch.cuda.synchronize()
    want_out, want_lse = run_fp8_decode(inp, case, None, descale)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


# ---- descales per (request, KV head) ------------------------------------------------------------------------------
PER_REQUEST_CASES = [
    Case(lengths=[100, 0, 300, 64], s_q=2, h_q=16),                       # h_kv 1, a zero length, s_q > 1
    Case(lengths=[1, 65, 0, 700, 4000], s_q=2, h_q=128, h_kv=2),           # h_kv 2, two M tiles, split requests
    Case(lengths=[37 * i % 2100 for i in range(40)], s_q=4, h_q=32, seed=3),  # several requests per CTA
    Case(lengths=[8192, 3, 0, 129], h_q=64, h_kv=2, causal=False),
]


def _tables(case, inp, dq, dk, seed=0):
    """[b, h_kv] descales differing per request and head (strides (1, b): not contiguous)."""
    return (descale_table(dq, case.b, case.h_kv, seed + 1) if dq is not None else None,
            descale_table(dk, case.b, case.h_kv, seed + 2))


@pytest.mark.parametrize("mode", ["bf16q", "e4m3q"])
@pytest.mark.parametrize("case", PER_REQUEST_CASES, ids=str)
def test_per_request_descales_match_fp64_and_the_reference(case, mode):
    inp, dq, dk = fp8_inputs(case, "cuda", q_fp8=mode == "e4m3q", k_gain=0.7)
    dq, dk = _tables(case, inp, dq, dk)
    out, lse = run_fp8_decode(inp, case, dq, dk)
    out2, lse2 = run_fp8_decode(inp, case, dq, dk)
    assert torch.equal(out.view(torch.int16), out2.view(torch.int16)) and torch.equal(lse, lse2), "not deterministic"
    assert not torch.isnan(out).any()
    ref_out, ref_lse = brute_force_fp64(dequantized(inp, dq, dk), case.causal)
    e_out, e_lse = rel_norm(out, ref_out), rel_norm(lse, ref_lse)
    print(f"{case} {mode} per-request descales: out {e_out:.2e} lse {e_lse:.2e}")
    assert e_out < _out_tol(mode)
    assert e_lse < ACCURATE_LSE
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(ref_lse.cpu()))
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    r_out, r_lse = fb.mla_decode_reference(inp.q.cpu(), inp.k_cache.cpu(), inp.block_table.cpu(),
                                           inp.cache_seqlens.cpu(), D_V, inp.scale, case.causal, descale_q=cpu(dq),
                                           descale_k=cpu(dk))
    assert rel_norm(out, r_out.double()) < _out_tol(mode)
    assert rel_norm(lse, r_lse.double()) < ACCURATE_LSE


@pytest.mark.parametrize("case", PER_REQUEST_CASES[:3], ids=str)
def test_each_request_reads_its_own_descales(case):
    """Rows of request i and KV head j are bitwise those of a per-tensor call with the scales of (i, j): the kernel
    indexes the tables by (request, kv head), and folds them in the per-tensor order."""
    inp, dq, dk = fp8_inputs(case, "cuda", q_fp8=True, k_gain=0.7)
    dq, dk = _tables(case, inp, dq, dk, seed=5)
    out, lse = run_fp8_decode(inp, case, dq, dk)
    g = case.h_q // case.h_kv
    for i in sorted({0, 1, case.b - 1}):
        for j in range(case.h_kv):
            o1, l1 = run_fp8_decode(inp, case, dq[i, j].reshape(1).contiguous(), dk[i, j].reshape(1).contiguous())
            heads = slice(j * g, (j + 1) * g)
            assert torch.equal(out[i, :, heads].view(torch.int16), o1[i, :, heads].view(torch.int16)), (i, j)
            assert torch.equal(lse[i, heads], l1[i, heads]), (i, j)


@pytest.mark.parametrize("case", [PER_REQUEST_CASES[0], PER_REQUEST_CASES[1]], ids=str)
def test_expanded_descales_are_bitwise_the_per_tensor_ones(case):
    """scale.expand(b, h_kv) (strides 0, 0), a [b, 1] column expanded over the heads (strides 1, 0) and a
    contiguous table of one value all give the per-tensor output bit for bit."""
    inp, dq, dk = fp8_inputs(case, "cuda", q_fp8=True, k_gain=0.7)
    b, h = case.b, case.h_kv
    want_out, want_lse = run_fp8_decode(inp, case, dq, dk)
    variants = {
        "expand": (dq.expand(b, h), dk.expand(b, h)),
        "column expand": (dq.reshape(1, 1).repeat(b, 1).expand(b, h), dk.reshape(1, 1).repeat(b, 1).expand(b, h)),
        "contiguous": (dq.reshape(1, 1).repeat(b, h), dk.reshape(1, 1).repeat(b, h)),
    }
    assert variants["expand"][1].stride()[0] == 0 and (h == 1 or variants["expand"][1].stride() == (0, 0))
    assert h == 1 or variants["column expand"][1].stride() == (1, 0)
    for name, (q_scale, k_scale) in variants.items():
        out, lse = run_fp8_decode(inp, case, q_scale, k_scale)
        assert torch.equal(out.view(torch.int16), want_out.view(torch.int16)) and torch.equal(lse, want_lse), name


def _graph_replay_follows_descale_tables(case, mode, table_seed, replay_seed):
    """Replays of a captured decode read the [b, h_kv] tables' current values, changed differently per request and
    head between replays: bitwise an eager call with the new tables, and within the mode's error of fp64."""
    inp, dq, dk = fp8_inputs(case, "cuda", q_fp8=mode == "e4m3q", k_gain=0.7)
    dq, dk = _tables(case, inp, dq, dk, seed=table_seed)
    dk = dk.contiguous()  # updated in place below
    dq = dq.contiguous() if dq is not None else None
    run_fp8_decode(inp, case, dq, dk)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run_fp8_decode(inp, case, dq, dk)
        with torch.cuda.graph(g, stream=s):
            out, lse = run_fp8_decode(inp, case, dq, dk)
    torch.cuda.current_stream().wait_stream(s)
    gen = torch.Generator().manual_seed(replay_seed)
    for _ in range(2):
        dk.mul_(torch.exp2(torch.rand(dk.shape, generator=gen) - 0.5).cuda())
        if dq is not None:
            dq.mul_(torch.exp2(torch.rand(dq.shape, generator=gen) - 0.5).cuda())
        g.replay()
        torch.cuda.synchronize()
        want_out, want_lse = run_fp8_decode(inp, case, dq, dk)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
        ref_out, ref_lse = brute_force_fp64(dequantized(inp, dq, dk), case.causal)
        assert rel_norm(out, ref_out) < _out_tol(mode)
        assert rel_norm(lse, ref_lse) < ACCURATE_LSE


@pytest.mark.parametrize("mode", ["bf16q", "e4m3q"])
def test_graph_replay_reads_the_current_descale_tables(mode):
    _graph_replay_follows_descale_tables(Case(lengths=[300, 0, 1500, 70], s_q=2, h_q=128, h_kv=2), mode, 7, 11)


# ---- the accurate mode's tiles for at most 32 query rows a KV head -------------------------------------------------
# s_q h_q / h_kv <= 16 rows run on the keys-on-M tile (csrc/sm90/decode_fp8/keys_on_m.h) or the stacked Q tile,
# 17..32 rows on the stacked Q tile or the two-term 64-row tile; FLASHMLA_BACKEND_FP8_DEBUG=16 runs the one that is not
# the default. Both are tested here, whichever is the default.
OTHER_ACCURATE_TILE = "16"
FEW_ROW_CASES = [
    Case(lengths=[100, 300], h_q=16),                                    # 16 rows
    Case(lengths=[37 * i % 2100 for i in range(40)], h_q=16, seed=3),   # zero lengths, several requests a CTA
    Case(lengths=[1, 65, 700, 4000], s_q=2, h_q=16),                     # 32 rows, causal, split requests
    Case(lengths=[5, 16, 17, 640, 3000], s_q=4, h_q=8, seed=4),          # causal over 4 query tokens
    Case(lengths=[0, 16, 129, 640, 3000], s_q=2, h_q=16, causal=False),
    Case(lengths=[8192], h_q=32),                                        # b = 1: one request in many splits
    Case(lengths=[5000], h_q=16, seed=5),                                # b = 1, 16 rows (the fast mode's keys on M)
    Case(lengths=[1, 65, 700, 4000], h_q=32, h_kv=2),                    # 16 rows a KV head, two KV heads
    Case(lengths=[300, 2000], h_q=20, seed=20),                          # 20 rows: a 32-row tile, 12 rows padded
    Case(lengths=[70, 2500], h_q=1, seed=1),                             # 1 row
    Case(lengths=[16, 40, 1000], s_q=16, h_q=2, seed=16),                # s_q 16 causal
]


@pytest.mark.parametrize("tile", ["default", "other"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16q", "fp16q"])
@pytest.mark.parametrize("case", FEW_ROW_CASES, ids=str)
def test_accurate_few_rows_both_tiles(monkeypatch, case, dtype, tile):
    if tile == "other":
        monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", OTHER_ACCURATE_TILE)
    _matches_fp64(Case(**{**case.__dict__, "dtype": dtype}), "fp16q" if dtype == torch.float16 else "bf16q",
                  f", {tile} tile")


# The accurate mode's stacked Q tile (both q terms in one tile of 32 query rows; csrc/sm90/decode_fp8/traits.h:
# kStackedTerms): the default at 17..32 rows a KV head and at 33..64 with one (request, KV head) pair; at <= 16 rows
# with FLASHMLA_BACKEND_FP8_DEBUG bit 16, at other shapes past 32 rows with bit 512 (several 32-row tiles); with its
# fp16 P V (STACKED_OTHER_PV below at up to 32 rows, the default past that) bit 256 runs that form's other plan (3 KV
# stages, or 2 with two left fp16 V slots).
STACKED_OTHER_PLAN, STACKED_MANY_ROWS = 256, 512


def _stacked_debug(case, other_plan):
    """The FLASHMLA_BACKEND_FP8_DEBUG value that runs the case on the stacked tile (csrc/sm90/decode_fp8/
    dispatch.cu)."""
    rows = case.s_q * case.h_q // case.h_kv
    one_pair = len(case.lengths) * case.h_kv == 1
    if rows <= 16:
        debug = int(OTHER_ACCURATE_TILE)
    elif rows <= 32 or (rows <= 64 and one_pair):
        debug = 0
    else:
        debug = STACKED_MANY_ROWS
    return debug | (STACKED_OTHER_PLAN if other_plan else 0)


# The stacked tile's other P V form than the shape's (FLASHMLA_BACKEND_FP8_DEBUG bit 16384): by default P V runs on e4m3
# tensor cores with P in two e4m3 terms (csrc/sm90/decode_fp8/traits.h: kPTerms2) at up to 32 rows and on fp16 ones past
# that (csrc/sm90/decode_fp8/dispatch.cu: stacked_e4m3_pv_by_default).
STACKED_OTHER_PV = 16384


def test_accurate_stacked_terms_by_default_at_b1_h64():
    """One request with 64 rows: two stacked tiles by default."""
    _matches_fp64(Case(lengths=[5000], h_q=64, seed=64), "bf16q", ", stacked terms by default")


@pytest.mark.parametrize("plan", ["default", "other"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16q", "fp16q"])
@pytest.mark.parametrize("case", FEW_ROW_CASES + [c for c in CASES if c.s_q <= 16], ids=str)
def test_accurate_stacked_terms(monkeypatch, case, dtype, plan):
    """Every row count through the stacked tile in its other P V form (FEW_ROW_CASES: 1-32 rows, fp16 P V in both
    plans; CASES: up to 256 rows in tiles of 32, e4m3 P V), against fp64."""
    monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", str(_stacked_debug(case, plan == "other") | STACKED_OTHER_PV))
    _matches_fp64(Case(**{**case.__dict__, "dtype": dtype}), "fp16q" if dtype == torch.float16 else "bf16q",
                  f", stacked terms, {plan} plan")


@pytest.mark.parametrize("plan", ["default", "other"])
def test_accurate_stacked_terms_many_requests(monkeypatch, plan):
    """32 rows over 24 requests: several requests a CTA, zero lengths, odd block counts (a virtual block), split
    requests."""
    case = Case(lengths=[(211 * i) % 3100 for i in range(24)], s_q=2, h_q=16, seed=7)
    monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", str(_stacked_debug(case, plan == "other") | STACKED_OTHER_PV))
    _matches_fp64(case, "bf16q", f", stacked terms, {plan} plan")


@pytest.mark.parametrize("rows", [32, 128])
def test_accurate_stacked_terms_per_request_descales_and_graph_replay(monkeypatch, rows):
    case = Case(lengths=[300, 0, 1500, 70], s_q=rows // 16, h_q=32, h_kv=2)
    monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", str(_stacked_debug(case, False) | STACKED_OTHER_PV))
    _graph_replay_follows_descale_tables(case, "bf16q", 9, 13)


# The stacked tile in its default P V form (e4m3 P V with two P terms at up to 32 rows) wherever it runs.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16q", "fp16q"])
@pytest.mark.parametrize("case", FEW_ROW_CASES + [c for c in CASES if c.s_q <= 16], ids=str)
def test_accurate_stacked_p2(monkeypatch, case, dtype):
    monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", str(_stacked_debug(case, False)))
    _matches_fp64(Case(**{**case.__dict__, "dtype": dtype}), "fp16q" if dtype == torch.float16 else "bf16q",
                  ", stacked terms, two-term P")


def test_accurate_stacked_p2_many_requests(monkeypatch):
    case = Case(lengths=[(211 * i) % 3100 for i in range(24)], s_q=2, h_q=16, seed=7)
    monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", str(_stacked_debug(case, False)))
    _matches_fp64(case, "bf16q", ", stacked terms, two-term P")


@pytest.mark.parametrize("rows", [32, 128])
def test_accurate_stacked_p2_per_request_descales_and_graph_replay(monkeypatch, rows):
    case = Case(lengths=[300, 0, 1500, 70], s_q=rows // 16, h_q=32, h_kv=2)
    monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", str(_stacked_debug(case, False)))
    _graph_replay_follows_descale_tables(case, "bf16q", 9, 13)


# Pieces longer than the promotion interval of the two-term-P tile's O (csrc/sm90/decode_fp8/config.h:
# kPromoteBlocks, 32 blocks): the scheduler's own part counts keep pieces short at test sizes, so these run with
# fewer parts (pieces of up to 128 blocks: the first promotion stores O's fp32 copy, later ones add to it), split and
# unsplit. Keys from token 4000 of request 0 scaled by `late_gain` raise the running max after the first promotion:
# by a few units (3: the copy added to at a small scale) or past 2^64 (50: the copy negligible, stored again). Scores
# that large are past what two e4m3 q terms resolve (the Q K^T error grows with the scores: 7.6e-3 against fp64 at
# gain 50), so there the tile is held to the stacked tile with fp16 P V (the same Q K^T) instead of fp64.
@pytest.mark.parametrize("late_gain", [1.0, 3.0, 50.0])
@pytest.mark.parametrize("parts", [1, 2, 5])
def test_accurate_stacked_p2_long_pieces(monkeypatch, parts, late_gain):
    case = Case(lengths=[8192, 6000, 2100], h_q=32, seed=11)
    f32 = make_inputs(Case(**{**case.__dict__, "dtype": torch.float32}), "cuda")
    k = f32.k_cache.clone()
    for t in range(4000 // 64, 8192 // 64):
        k[int(f32.block_table[0, t])] *= late_gain
    k8, dk = quantize(k * 0.7)
    inp = Inputs(q=f32.q.to(torch.bfloat16), k_cache=k8, block_table=f32.block_table,
                 cache_seqlens=f32.cache_seqlens, scale=f32.scale)
    meta, splits = ops._metadata_impl(inp.cache_seqlens, parts)

    def run(debug):
        monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", str(debug))
        return fb.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, splits,
                                         softmax_scale=inp.scale, causal=True, descale_k=dk)

    stacked = _stacked_debug(case, False)
    (out, lse), (out2, lse2) = run(stacked), run(stacked)
    assert torch.equal(out.view(torch.int16), out2.view(torch.int16)) and torch.equal(lse, lse2), "not deterministic"
    assert not torch.isnan(out).any()
    if late_gain <= 3:
        ref_out, ref_lse = brute_force_fp64(dequantized(inp, None, dk), True)
    else:
        ref_out, ref_lse = run(stacked | STACKED_OTHER_PV)
    e_out, e_lse = rel_norm(out, ref_out), rel_norm(lse, ref_lse)
    print(f"{case} parts {parts} late gain {late_gain:g}: out {e_out:.2e} lse {e_lse:.2e}")
    assert e_out < _out_tol("bf16q")
    assert e_lse < ACCURATE_LSE


# The fast mode's two tiles for at most 16 query rows a KV head: the keys-on-M tile is its default with one (request,
# KV head) pair (csrc/sm90/decode_fp8/dispatch.cu), the 64-row tile otherwise; FLASHMLA_BACKEND_FP8_DEBUG=32 runs the
# one that is not the default. Past 16 rows the fast mode has the 64-row tile only.
OTHER_FAST_TILE = "32"
FAST_FEW_ROW_CASES = [c for c in FEW_ROW_CASES if c.s_q * c.h_q // c.h_kv <= 16]


@pytest.mark.parametrize("tile", ["default", "other"])
@pytest.mark.parametrize("case", FAST_FEW_ROW_CASES, ids=str)
def test_fast_few_rows_both_tiles(monkeypatch, case, tile):
    if tile == "other":
        monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", OTHER_FAST_TILE)
    _matches_fp64(case, "e4m3q", f", {tile} tile")


@pytest.mark.parametrize("mode,debug,rows", [("bf16q", None, 16), ("bf16q", OTHER_ACCURATE_TILE, 16),
                                             ("bf16q", None, 32), ("bf16q", OTHER_ACCURATE_TILE, 32),
                                             ("e4m3q", None, 16), ("e4m3q", OTHER_FAST_TILE, 16), ("e4m3q", None, 32)],
                         ids=["accurate-default-16", "accurate-other-16", "accurate-default-32", "accurate-other-32",
                              "fast-default-16", "fast-other-16", "fast-32"])
def test_few_rows_per_request_descales_and_graph_replay(monkeypatch, mode, debug, rows):
    """Every tile at <= 32 rows reads [b, h_kv] descale tables per (request, KV head), and a captured graph reads
    their current values at each replay."""
    if debug is not None:
        monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", debug)
    _graph_replay_follows_descale_tables(Case(lengths=[300, 0, 1500, 70], s_q=rows // 16, h_q=32, h_kv=2), mode, 9,
                                         13)


# The fast mode's 64-row tile has two pipeline plans (csrc/sm90/decode_fp8/dispatch.cu): 3 KV stages, the default at
# every M-tile count, and 2 KV stages with deeper V^T rings (FLASHMLA_BACKEND_FP8_DEBUG bit 4). Only the buffering
# differs, so the other plan gives the default's bits: at two, four, eight and 180 M tiles per (request, KV head),
# splits included.
OTHER_FAST_PLAN = "4"


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3], CASES[4], CASES[8]], ids=str)
def test_fast_other_plan_is_bitwise_the_default(monkeypatch, case):
    inp, dq, dk = fp8_inputs(case, "cuda", q_fp8=True)
    want_out, want_lse = run_fp8_decode(inp, case, dq, dk)
    monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", OTHER_FAST_PLAN)
    out, lse = run_fp8_decode(inp, case, dq, dk)
    assert torch.equal(out.view(torch.int16), want_out.view(torch.int16)), f"{case}: out differs"
    assert torch.equal(lse, want_lse), f"{case}: lse differs"


# ---- the removed kernel switch ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["widen", "fast"])
@pytest.mark.parametrize("mode", ["bf16q", "e4m3q"])
def test_the_removed_kernel_switch_is_refused(monkeypatch, value, mode):
    """FLASHMLA_BACKEND_FP8_KERNEL chose between the FP8 kernels; with one kernel left, a value that asked for
    another one fails naming the variable, rather than run another kernel than the one a script forced."""
    case = Case(lengths=[100, 300], h_q=16)
    inp, dq, dk = fp8_inputs(case, "cuda", q_fp8=mode == "e4m3q")
    monkeypatch.setenv("FLASHMLA_BACKEND_FP8_KERNEL", value)
    with pytest.raises(RuntimeError) as e:
        run_fp8_decode(inp, case, dq, dk)
    msg = str(e.value)
    assert f"FLASHMLA_BACKEND_FP8_KERNEL is '{value}'" in msg
    assert "widening FP8 kernel was removed" in msg and "runs both modes" in msg
    assert "Unset FLASHMLA_BACKEND_FP8_KERNEL" in msg
    monkeypatch.delenv("FLASHMLA_BACKEND_FP8_KERNEL")
    out, _ = run_fp8_decode(inp, case, dq, dk)
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("value", ["2048", "4096", "6144", str(1 << 20)])
@pytest.mark.parametrize("mode", ["bf16q", "e4m3q"])
def test_undefined_debug_bits_are_refused(monkeypatch, value, mode):
    """A FLASHMLA_BACKEND_FP8_DEBUG bit that selects nothing (2048 and 4096 named measurements since removed) fails
    naming the bits, rather than run the default while a script believes it measures something else."""
    case = Case(lengths=[100, 300], h_q=16)
    inp, dq, dk = fp8_inputs(case, "cuda", q_fp8=mode == "e4m3q")
    monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", str(int(value) | 4))
    with pytest.raises(RuntimeError, match=f"sets bit\\(s\\) {value}, which select nothing"):
        run_fp8_decode(inp, case, dq, dk)


@pytest.mark.parametrize("mode", ["bf16q", "e4m3q"])
def test_the_in_kernel_switch_needs_a_measurement_build(monkeypatch, mode):
    """Bit 1 (V not moved) is read inside the kernel: a default build compiled it out and refuses it, naming the build
    setting, rather than time a kernel that ignores it; a measurement build runs it (its results are wrong by design)
    and with the bit cleared gives the default's bits."""
    case = Case(lengths=[100, 300], h_q=16)
    inp, dq, dk = fp8_inputs(case, "cuda", q_fp8=mode == "e4m3q")
    want_out, want_lse = run_fp8_decode(inp, case, dq, dk)
    monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", "17")  # bit 1 beside a host-side bit (16: the other tile)
    if _ext.ext().measure_build():
        run_fp8_decode(inp, case, dq, dk)
        torch.cuda.synchronize()
    else:
        with pytest.raises(RuntimeError, match=r"FLASHMLA_BACKEND_FP8_DEBUG=17 sets bit\(s\) 1, .*"
                                               r"FLASHMLA_BACKEND_MEASURE=1"):
            run_fp8_decode(inp, case, dq, dk)
    monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", "0")
    out, lse = run_fp8_decode(inp, case, dq, dk)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("value", ["tensorcore", "auto", ""])
def test_the_removed_kernel_switch_asking_for_this_kernel_changes_nothing(monkeypatch, value):
    case = Case(lengths=[100, 300], h_q=16)
    inp, dq, dk = fp8_inputs(case, "cuda")
    want_out, want_lse = run_fp8_decode(inp, case, dq, dk)
    monkeypatch.setenv("FLASHMLA_BACKEND_FP8_KERNEL", value)
    out, lse = run_fp8_decode(inp, case, dq, dk)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_accurate_mode_with_tiny_q_rows():
    """A 16-bit q row with max |q| below 448 x 2^-127 took an infinite split scale (a NaN row) before the scale's
    exponent was capped (q_tile.cuh); its scores are ~0, so attention is about uniform over the row's keys."""
    case = Case(lengths=[100, 300], h_q=16)
    inp, dq, dk = fp8_inputs(case, "cuda")
    inp.q[0].mul_(1e-37)  # request 0: rows of about 1e-37, far below the cap; request 1 unchanged
    out, lse = run_fp8_decode(inp, case, dq, dk)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    ref_out, ref_lse = brute_force_fp64(dequantized(inp, dq, dk), case.causal)
    assert rel_norm(out, ref_out) < _out_tol("bf16q")
    assert rel_norm(lse, ref_lse) < ACCURATE_LSE


# The accurate mode's V-in-registers tile (csrc/sm90/decode_fp8/vregs.h: P V as O^T = V^T P^T, V widened in the
# consumers' registers) in place of the two-term 64-row tile: FLASHMLA_BACKEND_FP8_DEBUG bit 1024, at every case the
# 64-row tile serves (more than 32 query rows a KV head, or more than 64 with one (request, KV head) pair).
VREGS = "1024"


def _runs_the_64_row_tile(case):
    rows = case.s_q * case.h_q // case.h_kv
    return rows > 32 and not (rows <= 64 and len(case.lengths) * case.h_kv == 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16q", "fp16q"])
@pytest.mark.parametrize("case", [c for c in CASES if _runs_the_64_row_tile(c)], ids=str)
def test_accurate_vregs_tile(monkeypatch, case, dtype):
    monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", VREGS)
    _matches_fp64(Case(**{**case.__dict__, "dtype": dtype}), "fp16q" if dtype == torch.float16 else "bf16q",
                  ", V in registers")


# Both modes' V-in-registers tiles (the accurate mode's here, the fast mode's below).
@pytest.mark.parametrize("mode", ["bf16q", "e4m3q"])
def test_vregs_tile_many_requests(monkeypatch, mode):
    """48 rows a KV head over 24 requests: several requests a CTA, zero lengths, odd block counts (a virtual block),
    split requests."""
    monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", VREGS)
    _matches_fp64(Case(lengths=[(211 * i) % 3100 for i in range(24)], s_q=3, h_q=16, seed=7), mode,
                  ", V in registers")


@pytest.mark.parametrize("mode", ["bf16q", "e4m3q"])
def test_vregs_tile_per_request_descales_and_graph_replay(monkeypatch, mode):
    monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", VREGS)
    _graph_replay_follows_descale_tables(Case(lengths=[300, 0, 1500, 70], s_q=2, h_q=128, h_kv=2), mode, 9, 13)


# The fast mode's V-in-registers tile (vregs.h with an e4m3 q: O^T = V^T P^T on e4m3 wgmma, V's bytes permuted in the
# consumers' registers, no transposition) in place of the fast 64-row tile: bit 1024, at every case that tile serves
# (all but at most 16 rows with one (request, KV head) pair, which keep the keys-on-M tile).
def _runs_the_fast_64_row_tile(case):
    return not (case.s_q * case.h_q // case.h_kv <= 16 and len(case.lengths) * case.h_kv == 1)


@pytest.mark.parametrize("case", [c for c in CASES if _runs_the_fast_64_row_tile(c)], ids=str)
def test_fast_vregs_tile(monkeypatch, case):
    monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", VREGS)
    _matches_fp64(case, "e4m3q", ", V in registers")
