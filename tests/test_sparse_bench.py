"""The sparse-decode benchmark's inputs on the CPU: benchmarks/mla_bench/sparse.py (shapes, inputs, work count, the
fp64 reference of a few requests)."""
import math
import sys
from pathlib import Path

import pytest
import torch

from flashmla_backend import fp8_ds_mla
from flashmla_backend.reference import sparse_mla_decode_reference

import sparsekit

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from mla_bench import sparse  # noqa: E402

CPU = torch.device("cpu")


# ---- shapes -----------------------------------------------------------------------------------------------------

def test_parse_sparse_shape_forms():
    assert sparse.parse_sparse_shape("b128-sq1-h128-topk2048") == sparse.SparseShape(128, 1, 128, 2048, 8192)
    assert sparse.parse_sparse_shape(" B4-SQ2-H64-TOPK512-POOL1024 ") == sparse.SparseShape(4, 2, 64, 512, 1024)
    assert sparse.parse_sparse_shape("b2-sq1-h16-topk64", default_pool=128).pool == 128
    assert sparse.parse_sparse_shape("b2-sq1-h16-topk64-pool256", default_pool=128).pool == 256   # suffix wins
    assert sparse.parse_sparse_shape("b1-sq1-h1-topk64-pool64").topk == 64                       # topk == pool


def test_sparse_shape_name_and_sizes():
    shape = sparse.parse_sparse_shape("b3-sq2-h16-topk100-pool256")
    assert shape.name == "b3-sq2-h16-topk100-pool256"
    assert sparse.parse_sparse_shape(shape.name) == shape
    assert (shape.num_tokens, shape.num_pages) == (768, 12)


@pytest.mark.parametrize("text, words", [
    ("", "expected b<batch>-sq<q tokens>-h<heads>-topk<k>"),
    ("b128-sk8192-h128-sq1", "expected b<batch>-sq<q tokens>-h<heads>-topk<k>"),   # the dense syntax
    ("b128-h128-topk2048", "expected"),
    ("b128-sq1-h128-topk2048-pool", "expected"),
    ("b128-sq1-h128-topk2048-pool8192-x", "expected"),
    ("b1.5-sq1-h128-topk2048", "expected"),
    ("b-1-sq1-h128-topk2048", "expected"),
    ("b0-sq1-h128-topk2048", "b must be >= 1"),
    ("b1-sq0-h128-topk2048", "s_q must be >= 1"),
    ("b1-sq1-h0-topk2048", "h_q must be >= 1"),
    ("b1-sq1-h128-topk0", "topk must be >= 1"),
    ("b1-sq1-h128-topk64-pool100", "multiple of 64"),
    ("b1-sq1-h128-topk64-pool0", "multiple of 64"),
    ("b1-sq1-h128-topk2048-pool1024", "topk 2048 distinct tokens do not fit in a pool of 1024"),
    ("b65536-sq1-h128-topk64-pool32768", "cannot be named by int32 indices"),
])
def test_parse_sparse_shape_rejects_with_the_reason(text, words):
    with pytest.raises(ValueError, match="bad sparse shape") as e:
        sparse.parse_sparse_shape(text)
    assert words in str(e.value)


def test_parse_sparse_shapes_list():
    parsed = sparse.parse_sparse_shapes("b1-sq1-h16-topk64, b2-sq2-h128-topk64-pool128 b1-sq1-h16-topk64-pool8192")
    assert [s.name for s in parsed] == ["b1-sq1-h16-topk64-pool8192", "b2-sq2-h128-topk64-pool128"]  # duplicate
    with pytest.raises(ValueError, match="empty"):
        sparse.parse_sparse_shapes(" , ")
    with pytest.raises(ValueError, match="b2-xx"):
        sparse.parse_sparse_shapes("b1-sq1-h16-topk64,b2-xx")
    defaults = sparse.parse_sparse_shapes(sparse.DEFAULT_SPARSE_SHAPES)
    assert defaults[0] == sparse.SparseShape(128, 1, 128, 2048, 8192)
    assert len(defaults) == len(sparse.DEFAULT_SPARSE_SHAPES.split(","))


def test_work_counts():
    shape = sparse.parse_sparse_shape("b128-sq1-h128-topk2048")
    assert sparse.sparse_flops(shape) == 73_014_444_032          # 2 * 128 * 1 * 128 * 2048 * (576 + 512)
    assert sparse.gathered_bytes(shape) == 171_966_464           # 128 * 1 * 2048 * 656
    two = sparse.parse_sparse_shape("b3-sq2-h16-topk100-pool256")
    assert sparse.sparse_flops(two) == 2 * 3 * 2 * 16 * 100 * 1088
    assert sparse.gathered_bytes(two) == 3 * 2 * 100 * 656


# ---- inputs ------------------------------------------------------------------------------------------------------

def _inputs(text, **kw):
    return sparse.make_sparse_inputs(sparse.parse_sparse_shape(text), CPU, **kw)


@pytest.mark.parametrize("text", ["b3-sq2-h16-topk100-pool256", "b2-sq3-h4-topk128-pool128", "b1-sq1-h2-topk1-pool64"])
def test_indices_name_distinct_tokens_of_the_requests_own_pool(text):
    inp = _inputs(text, seed=3)
    shape = inp.shape
    assert inp.indices.dtype == torch.int32 and tuple(inp.indices.shape) == (shape.b, shape.s_q, shape.topk)
    assert inp.k_cache.dtype == torch.uint8 and tuple(inp.k_cache.shape) == (shape.num_pages, 64, 1, 656)
    # The pools: each request owns pool / 64 pages, together every page of the cache once.
    assert inp.pages.dtype == torch.int32 and tuple(inp.pages.shape) == (shape.b, shape.pool // 64)
    assert sorted(inp.pages.flatten().tolist()) == list(range(shape.num_pages))
    idx = inp.indices.long()
    assert int(idx.min()) >= 0 and int(idx.max()) < shape.num_tokens
    for i in range(shape.b):
        own = set(inp.pages[i].tolist())
        pool_tokens = {p * 64 + o for p in own for o in range(64)}
        for s in range(shape.s_q):
            row = idx[i, s].tolist()
            assert len(set(row)) == shape.topk, "a token named twice in one row"
            assert {v // 64 for v in row} <= own, "an index outside the request's pool"
            assert set(row) <= pool_tokens
            if shape.topk == shape.pool:
                assert set(row) == pool_tokens


def test_indices_are_spread_and_shuffled():
    """Not one contiguous run: the rows name tokens of several pages, not in ascending order, and differ."""
    inp = _inputs("b2-sq2-h4-topk256-pool1024", seed=0)
    rows = inp.indices.view(-1, 256)
    for row in rows.tolist():
        assert len({v // 64 for v in row}) > 4
        assert row != sorted(row)
    assert not torch.equal(rows[0], rows[1])


def test_inputs_depend_on_the_seed_only():
    a, b = _inputs("b2-sq1-h4-topk64-pool128", seed=5), _inputs("b2-sq1-h4-topk64-pool128", seed=5)
    c = _inputs("b2-sq1-h4-topk64-pool128", seed=6)
    for name in ("q", "k_cache", "indices", "pages"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.equal(a.k_cache, c.k_cache) and not torch.equal(a.indices, c.indices)


@pytest.mark.parametrize("spread", [0.0, 3.0])
def test_cache_decodes_to_the_encoded_values_within_e4m3_precision(spread):
    inp = _inputs("b2-sq1-h4-topk64-pool256", seed=1, spread=spread, keep_values=True, chunk_tokens=100)
    values = inp.values.double()                                             # [512, 576], in cache token order
    decoded = fp8_ds_mla.dequantize(inp.k_cache.view(-1, 656), torch.float64)
    latent, got = values[:, :512].view(-1, 4, 128), decoded[:, :512].view(-1, 4, 128)
    group_scale = latent.abs().amax(dim=-1, keepdim=True) / 448
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of a normal value; below 2^-6 (subnormals) steps are 2^-9.
    bound = torch.maximum(latent.abs() * 2.0 ** -4, group_scale * 2.0 ** -10)
    assert bool(((got - latent).abs() <= bound * (1 + 1e-6)).all())
    # The rope part is stored as bf16: 8 significant bits.
    rope, rope_got = values[:, 512:], decoded[:, 512:]
    assert bool(((rope_got - rope).abs() <= rope.abs() * 2.0 ** -8).all())
    # A decoder that shares no code with the package reads the same values from the bytes of a few tokens.
    flat = inp.k_cache.view(-1, 656)
    for t in (0, 63, 64, 300, 511):
        assert torch.equal(sparsekit.decode_token_fp64(bytes(flat[t].tolist())), decoded[t])
    # The gains: one magnitude for every group with spread 0, magnitudes 2^-3 .. 2^3 apart with spread 3.
    rms = latent.pow(2).mean(dim=-1).sqrt().log2()
    if spread == 0:
        assert float(rms.abs().max()) < 0.5
    else:
        assert float(rms.min()) < -2 and float(rms.max()) > 2 and float(rms.abs().max()) < spread + 0.5


@pytest.mark.parametrize("spread", [0.0, 2.0])
def test_q_scale_gives_unit_variance_scores(spread):
    inp = _inputs("b2-sq2-h32-topk64-pool512", seed=2, spread=spread)
    assert inp.q.dtype == torch.bfloat16 and tuple(inp.q.shape) == (2, 2, 32, 576)
    assert inp.softmax_scale == 576 ** -0.5
    keys = fp8_ds_mla.dequantize(inp.k_cache.view(-1, 656), torch.float64)
    scores = torch.einsum("bshd,nd->bshn", inp.q.double(), keys) * inp.softmax_scale
    assert 0.9 < float(scores.std()) < 1.1
    assert sparse.q_std(0.0) == pytest.approx(1.0)                      # unit keys: q ~ N(0, 1)
    assert sparse.q_std(spread) == pytest.approx(float(inp.q.double().std()), rel=0.05)


def test_make_sparse_inputs_rejects_a_bad_spread():
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="spread must be a finite number >= 0"):
            _inputs("b1-sq1-h4-topk64-pool64", spread=bad)


# ---- the reference and the error ---------------------------------------------------------------------------------

def test_reference_of_the_first_requests_matches_the_whole_cache():
    inp = _inputs("b3-sq2-h8-topk100-pool256", seed=4, spread=2.0)
    out, lse = sparse.sparse_reference(inp, 2)
    assert out.dtype == torch.float64 and tuple(out.shape) == (2, 2, 8, 512) and tuple(lse.shape) == (2, 8, 2)
    full_out, full_lse = sparse_mla_decode_reference(inp.q[:2].double(), inp.k_cache, inp.indices[:2],
                                                     softmax_scale=inp.softmax_scale, compute_dtype=torch.float64)
    torch.testing.assert_close(out, full_out, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(lse, full_lse, rtol=0, atol=0)
    assert sparse.sparse_reference(inp, 10)[0].shape[0] == 3        # at most the batch


def test_reference_matches_an_independent_fp64_decode():
    inp = _inputs("b2-sq1-h4-topk32-pool128", seed=7, spread=1.0)
    out, lse = sparse.sparse_reference(inp, 2)
    oracle = sparsekit.SparseInputs(q=inp.q, k_cache=inp.k_cache, indices=inp.indices, topk_length=None,
                                    attn_sink=None, scale=inp.softmax_scale, counted=set())
    want_out, want_lse = sparsekit.naive_sparse_fp64(oracle)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)


def test_relative_error():
    ref = torch.randn(2, 1, 4, 512, dtype=torch.float64)
    assert sparse.relative_error(ref.clone(), ref) == 0.0
    assert sparse.relative_error(ref * 1.01, ref) == pytest.approx(0.01)
    longer = torch.cat([ref, torch.full((3, 1, 4, 512), math.nan, dtype=torch.float64)])   # sliced to ref's rows
    assert sparse.relative_error(longer.bfloat16(), ref) < 4e-3
    assert math.isnan(sparse.relative_error(longer.flip(0), ref))
    with pytest.raises(ValueError, match="does not match the reference"):
        sparse.relative_error(ref[:, :, :2], ref)
