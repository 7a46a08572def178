"""Decode kernels against the reference over a matrix of shapes, lengths and head counts (GPU only).

Every case: shuffled block table, NaN in every unused cache slot, huge ids in unused block-table
entries, outputs poisoned with NaN before the call (every element must be written), two runs that
must agree bitwise. Each available kernel (portable, sm90) is tested on the same matrix.
"""
import random

import pytest
import torch

import flashmla_backend as fb
from flashmla_backend import device as fdevice
from flashmla_backend.reference import mla_decode_reference
from kit import D_K, D_V, PAGE, Case, compare, make_inputs

pytestmark = pytest.mark.gpu


def _kernels() -> list[str]:
    if not torch.cuda.is_available():
        return ["portable", "sm90"]  # collected, then skipped by the gpu marker
    ok, _ = fb.is_supported()
    if not ok:
        return ["portable"]
    from flashmla_backend import _ext
    props = fdevice.device_props(torch.cuda.current_device())
    kernels = ["portable"]
    if props.major == 9 and _ext.ext().sm90_compiled():
        kernels.append("sm90")
    return kernels


@pytest.fixture(params=_kernels())
def kernel(request, monkeypatch):
    monkeypatch.setenv(fdevice.KERNEL_ENV, request.param)
    assert fdevice.kernel_for(torch.device("cuda")) == request.param
    return request.param


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def poison_allocator() -> None:
    """Fills free cached blocks with NaN so that an output element the kernels forget stays NaN."""
    free = torch.cuda.mem_get_info()[0]
    big = torch.full((min(free // 4, 3 << 30) // 4,), float("nan"), device="cuda")
    small = [torch.full((1 << 17,), float("nan"), device="cuda") for _ in range(32)]  # small pool (< 1 MB)
    del big, small


def varlen(b: int, mean: int, seed: int, zeros: bool = True) -> list[int]:
    rng = random.Random(seed)
    lens = [max(1, int(rng.gauss(mean, mean / 2))) for _ in range(b)]
    if zeros and b > 2:
        lens[rng.randrange(b)] = 0
    return lens


def run_case(case: Case, record, kernel: str, check_repeat: bool = True):
    inp = make_inputs(case, "cuda")
    meta, num_splits = fb.get_mla_metadata(inp.cache_seqlens, case.s_q * case.h_q // case.h_kv, case.h_kv)

    def call():
        poison_allocator()
        return fb.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta,
                                         num_splits, softmax_scale=inp.scale, causal=case.causal)

    out, lse = call()
    torch.cuda.synchronize()
    ref_out, ref_lse = mla_decode_reference(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, inp.scale,
                                            case.causal)
    figures = compare(out, lse, ref_out, ref_lse, case.lengths, case.s_q, case.causal)
    record(kernel, figures)
    if check_repeat:
        out2, lse2 = call()
        assert torch.equal(out, out2), "two runs on the same inputs differ (out)"
        assert torch.equal(lse, lse2), "two runs on the same inputs differ (lse)"


LENGTHS = [1, 20, PAGE - 1, PAGE, PAGE + 1, 140, 4096]
MATRIX = (
    # key-length sweep, memory-bound (h_q 16) and compute-bound (h_q 128) head counts
    [Case(lengths=[n, max(1, n // 2 + 1)], h_q=16, seed=n) for n in LENGTHS]
    + [Case(lengths=[n, n], h_q=128, seed=n) for n in LENGTHS]
    # query tokens x heads (incl. non-multiples of BLOCK_M, more than one m-block), causal, varlen with a zero
    + [Case(lengths=varlen(6, 300, s_q * 1000 + h), s_q=s_q, h_q=h, seed=h + s_q)
       for s_q in (1, 2, 4) for h in (1, 16, 20, 64, 100, 128)]
    + [Case(lengths=varlen(3, 200, 7), s_q=16, h_q=h, seed=h) for h in (8, 128)]
    # short prefills on the decode kernel (the vLLM builder's threshold of 128): a fresh prompt (length = s_q) and
    # chunks after a context
    + [Case(lengths=[128, 129, 900], s_q=128, h_q=h, seed=h + 128) for h in (16, 128)]
    + [Case(lengths=[90, 2000], s_q=90, h_q=64, seed=90)]
    # causal off, several kv heads
    + [Case(lengths=varlen(6, 500, 11), s_q=2, h_q=32, causal=False),
       Case(lengths=varlen(6, 500, 12), s_q=1, h_q=32, h_kv=2),
       Case(lengths=varlen(6, 500, 13), s_q=2, h_q=128, h_kv=4),
       Case(lengths=varlen(4, 200, 14), s_q=1, h_q=8, h_kv=8, causal=False)]
    # causal rows that see nothing (fewer keys than query tokens), all-empty batch
    + [Case(lengths=[2, 0, 1, 3], s_q=4, h_q=16), Case(lengths=[0, 0, 0], s_q=1, h_q=128)]
    # batch sizes
    + [Case(lengths=[8192], h_q=128), Case(lengths=[8192], h_q=16),
       Case(lengths=varlen(64, 1000, 21), h_q=32), Case(lengths=varlen(133, 700, 22), h_q=128),
       Case(lengths=varlen(200, 300, 23), s_q=2, h_q=16)]
    # fp16
    + [Case(lengths=varlen(6, 900, 31), s_q=s_q, h_q=h, dtype=torch.float16) for s_q, h in ((1, 16), (2, 128), (4, 20))]
)
LONG = [Case(lengths=[32768, 32768], h_q=128), Case(lengths=[32768] * 16, h_q=16),
        Case(lengths=varlen(128, 4096, 41), h_q=128), Case(lengths=[4096] * 128, h_q=16, s_q=2)]


@pytest.mark.parametrize("case", MATRIX, ids=str)
def test_decode_matrix(case, kernel, record_errors):
    run_case(case, record_errors, kernel)


@pytest.mark.parametrize("case", LONG, ids=str)
def test_decode_long(case, kernel, record_errors):
    run_case(case, record_errors, kernel, check_repeat=True)


def test_strided_q_and_padded_pages(kernel, record_errors):
    """q as a slice of a wider tensor, cache pages with padding between them (strides, not copies)."""
    case = Case(lengths=varlen(5, 300, 51), s_q=2, h_q=16)
    inp = make_inputs(case, "cuda")
    pad = 32  # elements between rows and between pages (keeps 16-byte alignment)
    wide = torch.randn(case.b, case.s_q, case.h_q, D_K + pad, device="cuda", dtype=case.dtype)
    wide[..., :D_K] = inp.q
    q = wide[..., :D_K]
    pages = inp.k_cache.shape[0]
    page_elems = PAGE * D_K
    padded = torch.full((pages, page_elems + pad), float("nan"), device="cuda", dtype=case.dtype)
    padded[:, :page_elems] = inp.k_cache.reshape(pages, -1)
    k_cache = padded[:, :page_elems].view(pages, PAGE, 1, D_K)
    assert q.stride(2) == D_K + pad and k_cache.stride(0) == page_elems + pad
    meta, ns = fb.get_mla_metadata(inp.cache_seqlens, case.s_q * case.h_q, 1)
    out, lse = fb.flash_mla_with_kvcache(q, k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, ns,
                                         softmax_scale=inp.scale, causal=True)
    ref = mla_decode_reference(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, inp.scale, True)
    record_errors(kernel, compare(out, lse, *ref, case.lengths, case.s_q, True))


@pytest.mark.parametrize("parts,lengths", [(40, [5000]), (70, [9000]), (96, [3000, 6000]), (300, [13000]),
                                           (300, [20000, 700])], ids=str)
def test_combine_with_many_splits(parts, lengths, kernel, record_errors):
    """Metadata with more parts than the device's SM count would give, so the combine launcher picks each of its
    kernels: rows in parallel (40 parts: 40 splits, on the small grid's wide form: 32 splits' loads in the lse values'
    round trip, then 8), splits in parallel with 9 or 17 splits per warp (70 parts: 47 splits; 96 parts at b = 2: 24
    and 47), and in several rounds of 136 (300 parts: 204 splits at b = 1, 157 and 6 at b = 2)."""
    from flashmla_backend import ops
    case = Case(lengths=lengths, s_q=1, h_q=16, seed=parts)
    inp = make_inputs(case, "cuda")
    meta, ns = ops._metadata_impl(inp.cache_seqlens, parts)
    assert int(ns[1] - ns[0]) > 1, "the first request must be split"

    def call():
        poison_allocator()
        return fb.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, ns,
                                         softmax_scale=inp.scale, causal=True)

    out, lse = call()
    ref = mla_decode_reference(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, inp.scale, True)
    record_errors(kernel, compare(out, lse, *ref, case.lengths, case.s_q, True))
    out2, lse2 = call()
    assert torch.equal(out, out2) and torch.equal(lse, lse2), "two runs on the same inputs differ"


def _describe_row(out_row: torch.Tensor, lse_value: float) -> str:
    """What a kernel returned for one query row, in words (for the failure message)."""
    nan = int(torch.isnan(out_row).sum())
    if nan == out_row.numel():
        what = "out all NaN"
    elif nan:
        what = f"out NaN in {nan} of {out_row.numel()} columns"
    elif bool((out_row == 0).all()):
        what = "out all 0"
    else:
        what = f"out finite (max |out| {float(out_row.abs().max()):.3g})"
    return f"{what}, lse {lse_value}"


def test_nan_rows_in_q(kernel, record_errors):
    """NaN in a query row gives that row NaN out and lse, as the reference does, not the answer of a row that
    sees no key (out 0, lse +inf); a row that sees no key keeps out 0 / lse +inf, NaN in q or not; every other
    row is the same as without the NaN. The 5000-key request is split, so NaN also goes through the combine."""
    case = Case(lengths=[300, 3, 5000, 0], s_q=4, h_q=16, causal=True, seed=61)
    inp = make_inputs(case, "cuda")
    q = inp.q.clone()
    rows = [(0, 1, 3), (0, 3, 15), (1, 3, 0), (2, 0, 7), (2, 3, 8)]   # (request, token, head): rows that see keys
    empty = [(1, 0, 5), (3, 2, 2)]                                      # rows that see no key
    for i, s, h in rows + empty:
        q[i, s, h, (37 * h + 11 * s) % q.shape[-1]] = float("nan")
    q[2, 1, 4] = float("nan")                                           # a whole row
    rows.append((2, 1, 4))
    meta, ns = fb.get_mla_metadata(inp.cache_seqlens, case.s_q * case.h_q // case.h_kv, case.h_kv)
    poison_allocator()
    out, lse = fb.flash_mla_with_kvcache(q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, ns,
                                         softmax_scale=inp.scale, causal=True)
    torch.cuda.synchronize()
    ref_out, ref_lse = mla_decode_reference(q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, inp.scale, True)
    out, lse, ref_out, ref_lse = out.cpu().float(), lse.cpu(), ref_out.cpu().float(), ref_lse.cpu()
    assert int(torch.isnan(ref_lse).sum()) == len(rows), "the reference must give NaN exactly on the NaN rows"

    wrong = []
    for i, s, h in rows:
        if not (torch.isnan(out[i, s, h]).all() and torch.isnan(lse[i, h, s])):
            wrong.append(f"row (request {i}, token {s}, head {h}) sees keys, NaN in q: expected out all NaN, "
                         f"lse nan; kernel gave {_describe_row(out[i, s, h], float(lse[i, h, s]))}")
    for i, s, h in empty:
        if not ((out[i, s, h] == 0).all() and torch.isposinf(lse[i, h, s])):
            wrong.append(f"row (request {i}, token {s}, head {h}) sees no key, NaN in q: expected out all 0, lse inf; "
                         f"kernel gave {_describe_row(out[i, s, h], float(lse[i, h, s]))}")
    assert not wrong, f"{kernel} kernel on NaN query rows:\n" + "\n".join(wrong)

    # the other rows: compare with the NaN rows set alike on both sides (out 0, lse +inf)
    nan_rows = torch.zeros(lse.shape, dtype=torch.bool)                 # [b, h_q, s_q]
    for i, s, h in rows:
        nan_rows[i, h, s] = True
    for o, l in ((out, lse), (ref_out, ref_lse)):
        o[nan_rows.permute(0, 2, 1)] = 0.0
        l[nan_rows] = float("inf")
    stray = torch.nonzero(torch.isnan(out).any(-1))[:8].tolist()
    assert not stray, f"{kernel} kernel: NaN leaked into other rows (request, token, head): {stray}"
    record_errors(kernel, compare(out, lse, ref_out, ref_lse, case.lengths, case.s_q, True))


def test_cuda_graph_replay_with_new_lengths(kernel, record_errors):
    """Capture metadata + decode once; replays with other lengths (and other q) must be right."""
    b, s_q, h_q, max_len = 8, 2, 64, 3000
    case = Case(lengths=[max_len] * b, s_q=s_q, h_q=h_q)
    inp = make_inputs(case, "cuda")
    seqlens = inp.cache_seqlens.clone()
    q = inp.q.clone()

    def step():
        meta, ns = fb.get_mla_metadata(seqlens, s_q * h_q, 1)
        return fb.flash_mla_with_kvcache(q, inp.k_cache, inp.block_table, seqlens, D_V, meta, ns,
                                         softmax_scale=inp.scale, causal=True)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    rng = random.Random(5)
    for trial in range(4):
        new = [rng.choice([0, 1, PAGE - 1, PAGE, PAGE + 1, rng.randint(1, max_len)]) for _ in range(b)]
        seqlens.copy_(torch.tensor(new, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        ref = mla_decode_reference(q, inp.k_cache, inp.block_table, seqlens, D_V, inp.scale, True)
        record_errors(kernel, compare(out, lse, *ref, new, s_q, True))


def test_multi_gpu_device_guard(kernel):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    case = Case(lengths=[100, 7], s_q=1, h_q=16)
    inp = make_inputs(case, "cuda:1")
    meta, ns = fb.get_mla_metadata(inp.cache_seqlens, 16, 1)
    out, lse = fb.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, ns,
                                         softmax_scale=inp.scale, causal=True)
    ref = mla_decode_reference(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, inp.scale, True)
    compare(out, lse, *ref, case.lengths, 1, True)
