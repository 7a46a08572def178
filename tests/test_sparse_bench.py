"""The sparse-decode benchmark on the CPU: benchmarks/mla_bench/sparse.py (shapes, inputs, work count, the fp64
reference of a few requests) and benchmarks/sparse_bench.py (its options, the errors for bad ones, the call it makes,
and the exit without a GPU). The timing itself needs a GPU and vLLM's FlashMLA; nothing here runs it."""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashmla_backend import fp8_ds_mla
from flashmla_backend.reference import sparse_mla_decode_reference

import sparsekit

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import sparse_bench  # noqa: E402
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
    assert sparse.gathered_bytes(two, "bf16") == 3 * 2 * 100 * 1152


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


def _reference_is_the_fp64_oracle(inp):
    """sparse_reference of the first two requests equals the kit's independent fp64 decode of the same inputs."""
    out, lse = sparse.sparse_reference(inp, 2)
    oracle = sparsekit.SparseInputs(q=inp.q, k_cache=inp.k_cache, indices=inp.indices, topk_length=None,
                                    attn_sink=None, scale=inp.softmax_scale, counted=set())
    want_out, want_lse = sparsekit.naive_sparse_fp64(oracle)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)


def test_reference_matches_an_independent_fp64_decode():
    _reference_is_the_fp64_oracle(_inputs("b2-sq1-h4-topk32-pool128", seed=7, spread=1.0))


def test_the_bf16_cache_holds_the_same_values_indices_and_q():
    """--cache bf16: the values of the fp8_ds_mla inputs rounded to bf16, the same indices and q for a seed, and the
    reference of its first requests equal to the fp64 oracle on those tokens."""
    ds = _inputs("b2-sq2-h4-topk32-pool128", seed=5, spread=1.0, keep_values=True)
    wide = _inputs("b2-sq2-h4-topk32-pool128", seed=5, spread=1.0, keep_values=True, cache="bf16")
    assert wide.cache == "bf16" and not wide.ds and ds.ds
    assert wide.k_cache.dtype == torch.bfloat16 and tuple(wide.k_cache.shape) == (4, 64, 1, 576)
    assert torch.equal(wide.values, ds.values) and torch.equal(wide.indices, ds.indices) and torch.equal(wide.q, ds.q)
    assert torch.equal(wide.k_cache.view(-1, 576), ds.values.to(torch.bfloat16))
    _reference_is_the_fp64_oracle(wide)
    with pytest.raises(ValueError, match="cache must be one of fp8_ds_mla, bf16, got 'fp16'"):
        _inputs("b1-sq1-h4-topk32-pool64", cache="fp16")


def test_relative_error():
    ref = torch.randn(2, 1, 4, 512, dtype=torch.float64)
    assert sparse.relative_error(ref.clone(), ref) == 0.0
    assert sparse.relative_error(ref * 1.01, ref) == pytest.approx(0.01)
    longer = torch.cat([ref, torch.full((3, 1, 4, 512), math.nan, dtype=torch.float64)])   # sliced to ref's rows
    assert sparse.relative_error(longer.bfloat16(), ref) < 4e-3
    assert math.isnan(sparse.relative_error(longer.flip(0), ref))
    with pytest.raises(ValueError, match="does not match the reference"):
        sparse.relative_error(ref[:, :, :2], ref)


# ---- benchmarks/sparse_bench.py -----------------------------------------------------------------------------------

def test_options_parse():
    a = sparse_bench.parse_args([])
    assert [s.name for s in a.shapes][0] == "b128-sq1-h128-topk2048-pool8192"
    assert a.impls == ["flashmla", "ours"] and a.pool == 8192 and a.spread == 0.0 and a.check_requests == 2
    b = sparse_bench.parse_args(["--shapes", "b4-sq1-h16-topk64,b2-sq2-h64-topk128-pool512", "--pool", "256",
                                 "--spread", "2", "--impls", "ours, flashmla", "--check-requests", "1", "--seed",
                                 "9", "--warmup", "1", "--rep", "5"])
    assert [s.name for s in b.shapes] == ["b4-sq1-h16-topk64-pool256", "b2-sq2-h64-topk128-pool512"]
    assert b.impls == ["flashmla", "ours"] and b.spread == 2.0 and b.check_requests == 1 and b.seed == 9
    assert (b.warmup, b.rep) == (1.0, 5.0)
    assert sparse_bench.parse_args(["--impls", "ours"]).impls == ["ours"]
    assert a.debug is None
    assert sparse_bench.parse_args(["--debug", "0, 64,64 128"]).debug == [0, 64, 128]
    assert a.kernel_times is False and sparse_bench.parse_args(["--kernel-times"]).kernel_times is True
    assert a.cache == "fp8_ds_mla" and sparse_bench.parse_args(["--cache", "bf16"]).cache == "bf16"


@pytest.mark.parametrize("argv, words", [
    (["--shapes", "b128-sk8192-h128"], "argument --shapes: bad sparse shape 'b128-sk8192-h128'"),
    (["--shapes", "b1-sq1-h16-topk2048", "--pool", "1024"], "do not fit in a pool of 1024"),
    (["--shapes", ","], "argument --shapes: empty sparse shape list"),
    (["--pool", "100"], "argument --pool: '100': the pool must be a positive multiple of 64"),
    (["--pool", "0"], "argument --pool: '0' must be >= 1"),
    (["--pool", "8k"], "argument --pool: '8k' is not an integer"),
    (["--spread", "-1"], "argument --spread: '-1' must be a finite number >= 0"),
    (["--spread", "nan"], "argument --spread: 'nan' must be a finite number >= 0"),
    (["--spread", "x"], "argument --spread: 'x' is not a number"),
    (["--impls", "flashinfer"], "argument --impls: unknown implementation(s) 'flashinfer'; choose from flashmla, ours"),
    (["--impls", " "], "argument --impls: empty implementation list"),
    (["--check-requests", "0"], "argument --check-requests: '0' must be >= 1"),
    (["--seed", "-1"], "argument --seed: '-1' must be >= 0"),
    (["--warmup", "0"], "argument --warmup: '0' must be > 0"),
    (["--rep", "inf"], "argument --rep: 'inf' must be > 0"),
    (["--debug", "x"], "argument --debug: 'x' is not an integer"),
    (["--debug", "0,-1"], "argument --debug: '-1' must be >= 0"),
    (["--debug", " , "], "argument --debug: empty list of FLASHMLA_BACKEND_SPARSE_DEBUG values"),
    (["--cache", "fp16"], "argument --cache: invalid choice: 'fp16'"),
])
def test_bad_options_name_the_option(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        sparse_bench.parse_args(argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_help_runs_without_a_gpu():
    env = dict(os.environ, COLUMNS="400")     # one line per option: the syntax is not wrapped
    res = subprocess.run([sys.executable, str(BENCHMARKS / "sparse_bench.py"), "--help"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert "b<batch>-sq<q tokens>-h<heads>-topk<k>[-pool<tokens per request>]" in res.stdout
    assert "--spread" in res.stdout and "--pool" in res.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit on a machine without a GPU")
def test_exits_2_without_a_gpu(capsys):
    assert sparse_bench.main(["--shapes", "b1-sq1-h16-topk64-pool64"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


class _RecordingApi:
    """Stands in for FlashMLA's interface: records the sparse call's arguments."""

    def __init__(self):
        self.calls = []

    def get_mla_metadata(self, *args, **kwargs):
        assert not args and not kwargs
        return "sched-meta", None

    def flash_mla_with_kvcache(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "out", "lse"


def test_the_call_is_flashmlas_sparse_convention():
    inp = _inputs("b2-sq1-h4-topk64-pool128")
    api = _RecordingApi()
    fn = sparse_bench.sparse_call(api, inp)
    assert fn() == ("out", "lse")
    (args, kwargs), = api.calls
    assert args[0] is inp.q and args[1] is inp.k_cache and args[2:] == (None, None, 512, "sched-meta", None)
    assert kwargs == {"softmax_scale": inp.softmax_scale, "causal": False, "is_fp8_kvcache": True,
                      "indices": inp.indices}


class _PrefillApi:
    """Stands in for FlashMLA's sparse prefill kernel: records its arguments, answers with our CPU reference."""

    def __init__(self):
        self.calls = []

    def flash_mla_sparse_fwd(self, q, kv, indices, sm_scale, d_v):
        import flashmla_backend
        self.calls.append((q.shape, kv.shape, indices.shape, sm_scale, d_v))
        s, h_q, d = q.shape
        out, lse = flashmla_backend.reference.sparse_mla_decode_reference(
            q.view(s, 1, h_q, d), kv.view(-1, 1, 1, d), indices.view(s, 1, -1), softmax_scale=sm_scale)
        return out.view(s, h_q, d_v), "max_logits", "lse in FlashMLA's convention"


def test_the_bf16_calls_are_ours_with_a_16_bit_cache_and_flashmlas_prefill_kernel():
    inp = _inputs("b2-sq2-h4-topk64-pool128", seed=6, cache="bf16")
    api = _RecordingApi()
    assert sparse_bench.sparse_call(api, inp)() == ("out", "lse")
    (args, kwargs), = api.calls
    assert args[1] is inp.k_cache and kwargs["is_fp8_kvcache"] is False and kwargs["indices"] is inp.indices
    peer = _PrefillApi()
    out, lse = sparse_bench.sparse_call(peer, inp, prefill_kernel=True)()
    assert peer.calls == [((4, 4, 576), (inp.k_cache.shape[0] * 64, 1, 576), (4, 1, 64), inp.softmax_scale, 512)]
    assert lse is None and tuple(out.shape) == (2, 2, 4, 512)   # its lse is not compared
    ref_out, _ = sparse.sparse_reference(inp, 2)
    assert sparse.relative_error(out, ref_out) < 4e-3


def test_the_call_runs_our_cpu_reference_within_bf16_of_fp64():
    """The same call through flashmla_backend on CPU tensors (its sparse reference, bf16 out) against the fp64
    reference of the first requests: what the script prints as ours' error once a kernel runs it on the GPU."""
    import flashmla_backend

    inp = _inputs("b3-sq2-h16-topk128-pool256", seed=8, spread=2.0)
    out, lse = sparse_bench.sparse_call(flashmla_backend, inp)()
    ref_out, ref_lse = sparse.sparse_reference(inp, 2)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (3, 2, 16, 512)
    err = sparse.relative_error(out, ref_out)
    assert 1e-4 < err < 4e-3          # the bf16 rounding of the output, nothing more
    assert float((lse[:2].double() - ref_lse.double()).abs().max()) < 1e-4


# ---- one shape end to end, on the CPU: stand-in timer, our CPU API in the place of a GPU implementation -------------

class _Api:
    """A FlashMLA-style API whose sparse call runs flashmla_backend on the CPU, scales its output, or raises."""

    def __init__(self, raises=None, out_factor=1.0):
        self.raises, self.out_factor = raises, out_factor

    def get_mla_metadata(self):
        import flashmla_backend
        return flashmla_backend.get_mla_metadata()

    def flash_mla_with_kvcache(self, *args, **kwargs):
        import flashmla_backend
        if self.raises is not None:
            raise self.raises
        out, lse = flashmla_backend.flash_mla_with_kvcache(*args, **kwargs)
        return out * self.out_factor, lse


def _run_shape(modules, reasons=None, impls=("flashmla", "ours"), us=None, extra=()):
    args = sparse_bench.parse_args(["--shapes", "b3-sq1-h16-topk64-pool128", "--impls", ",".join(impls), *extra])
    times = dict(us or {})
    calls = []

    def timer(fn, warmup_ms, rep_ms):
        calls.append((warmup_ms, rep_ms))
        return times.pop(next(iter(times))) if times else 50.0, fn()

    line = sparse_bench.run_shape(args.shapes[0], CPU, modules, reasons or {}, args, copy_gbs=2000.0, timer=timer,
                                  sync=lambda: None)
    return line, calls


def test_run_shape_reports_the_timed_and_the_refusing_implementation(capsys):
    refusal = NotImplementedError("flashmla_backend: no compiled kernel reads a sparse cache yet\nmore")
    line, calls = _run_shape({"flashmla": _Api(), "ours": _Api(raises=refusal)})
    printed = capsys.readouterr().out
    assert calls == [(10.0, 50.0)]                      # ours was tried once and not timed
    shape = sparse.parse_sparse_shape("b3-sq1-h16-topk64-pool128")
    flops, nbytes = sparse.sparse_flops(shape), sparse.gathered_bytes(shape)
    assert line["shape"] == shape.name and line["flops"] == flops and line["gathered_bytes"] == nbytes
    assert line["gather_floor_us"] == round(nbytes / 2000e9 * 1e6, 2) and line["check_requests"] == 2
    assert line["flashmla_us"] == 50.0 and line["flashmla_tflops"] == round(flops / 50e-6 / 1e12, 2)
    assert 1e-4 < line["flashmla_err"] < 4e-3 and line["flashmla_lse_err"] < 1e-4
    assert line["ours_status"] == sparse_bench.NO_KERNEL
    assert line["ours_reason"] == "NotImplementedError: flashmla_backend: no compiled kernel reads a sparse cache yet"
    assert "  ours: no sparse kernel for these inputs\n" in printed
    assert "  flashmla: 50.0 us" in printed and "WRONG" not in printed
    assert "speedup_vs_flashmla" not in line


def test_run_shape_with_the_bf16_cache(capsys):
    """--cache bf16 end to end: ours through flashmla_backend's 16-bit sparse decode (the CPU reference here),
    FlashMLA through its prefill kernel (a stand-in), the bytes of 1152-byte tokens, the peer's lse not compared."""
    import flashmla_backend

    line, _ = _run_shape({"flashmla": _PrefillApi(), "ours": flashmla_backend}, extra=("--cache", "bf16"))
    printed = capsys.readouterr().out
    shape = sparse.parse_sparse_shape("b3-sq1-h16-topk64-pool128")
    assert line["cache"] == "bf16" and line["gathered_bytes"] == sparse.gathered_bytes(shape, "bf16")
    assert line["flashmla_lse_err"] is None and line["ours_lse_err"] < 1e-4
    assert line["flashmla_err"] < 4e-3 and line["ours_err"] < 4e-3 and "WRONG" not in printed
    assert "max lse error n/a" in printed and "bf16 cache" in printed


def test_run_shape_flags_a_wrong_output_and_a_failing_peer(capsys):
    peer = _Api(raises=RuntimeError("h_q 16 is not supported"))
    line, _ = _run_shape({"flashmla": peer, "ours": _Api(out_factor=1.1)})
    printed = capsys.readouterr().out
    assert line["flashmla_status"] == "unavailable"
    assert line["flashmla_reason"] == "RuntimeError: h_q 16 is not supported"
    assert "  flashmla: unavailable: RuntimeError: h_q 16 is not supported" in printed
    assert line["ours_err"] == pytest.approx(0.1, rel=0.05)
    assert "(WRONG: above 0.03)" in printed


def test_run_shape_prints_each_kernels_time_with_kernel_times(monkeypatch, capsys):
    """--kernel-times: each implementation's kernels of one call (mla_bench.timing.kernel_times, torch.profiler on a
    GPU; a stand-in here), printed and in the JSON; without the option, none."""
    from mla_bench import timing

    seen = []

    def fake_kernel_times(fn, n=20):
        seen.append(fn)
        return {"decode_kernel": 20.04, "combine_kernel": 3.5}

    monkeypatch.setattr(timing, "kernel_times", fake_kernel_times)
    line, _ = _run_shape({"flashmla": _Api(), "ours": _Api()}, extra=["--kernel-times"])
    printed = capsys.readouterr().out
    assert len(seen) == 2
    assert line["ours_kernels_us"] == {"decode_kernel": 20.04, "combine_kernel": 3.5} == line["flashmla_kernels_us"]
    assert "    ours kernels: decode_kernel 20.0 us, combine_kernel 3.5 us" in printed
    line, _ = _run_shape({"flashmla": _Api(), "ours": _Api()})
    assert "ours_kernels_us" not in line and len(seen) == 2


def test_run_shape_compares_the_two_times_and_names_a_missing_peer(capsys):
    line, _ = _run_shape({"flashmla": _Api(), "ours": _Api()}, us={"flashmla": 90.0, "ours": 60.0})
    assert (line["flashmla_us"], line["ours_us"], line["speedup_vs_flashmla"]) == (90.0, 60.0, 1.5)
    assert "ours vs FlashMLA: 1.50x" in capsys.readouterr().out
    line, _ = _run_shape({"flashmla": None, "ours": _Api()}, reasons={"flashmla": "cannot import it"},
                         impls=["flashmla"])
    assert line["flashmla_status"] == "unavailable" and line["flashmla_reason"] == "cannot import it"
    assert "ours_us" not in line and "ours_status" not in line       # not asked for


def test_load_flashmla_says_what_to_put_on_the_path(monkeypatch):
    monkeypatch.setattr(sparse_bench, "PEER_MODULE", "flashmla_backend_no_such_module.interface")
    module, reason = sparse_bench.load_flashmla()
    assert module is None
    assert "cannot import flashmla_backend_no_such_module.interface (ModuleNotFoundError" in reason
    assert ".peers/flashmla, on PYTHONPATH" in reason


class _EnvRecordingApi(_Api):
    """_Api that records FLASHMLA_BACKEND_SPARSE_DEBUG at each call."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def flash_mla_with_kvcache(self, *args, **kwargs):
        self.seen.append(os.environ.get("FLASHMLA_BACKEND_SPARSE_DEBUG"))
        return super().flash_mla_with_kvcache(*args, **kwargs)


@pytest.mark.parametrize("before", [None, "16"])
def test_run_shape_times_ours_once_per_debug_value(before, monkeypatch, capsys):
    if before is None:
        monkeypatch.delenv("FLASHMLA_BACKEND_SPARSE_DEBUG", raising=False)
    else:
        monkeypatch.setenv("FLASHMLA_BACKEND_SPARSE_DEBUG", before)
    ours, peer = _EnvRecordingApi(), _EnvRecordingApi()
    line, calls = _run_shape({"flashmla": peer, "ours": ours}, us={"flashmla": 90.0, "a": 60.0, "b": 45.0},
                             extra=["--debug", "0,64"])
    printed = capsys.readouterr().out
    assert len(calls) == 3                                        # FlashMLA once, ours twice
    assert set(peer.seen) == {before}                             # FlashMLA under the environment as it was
    assert ours.seen[0] == "0" and ours.seen[-1] == "64" and set(ours.seen) == {"0", "64"}
    assert os.environ.get("FLASHMLA_BACKEND_SPARSE_DEBUG") == before   # restored
    assert (line["ours_d0_us"], line["ours_d64_us"]) == (60.0, 45.0) and "ours_us" not in line
    assert (line["speedup_vs_flashmla_d0"], line["speedup_vs_flashmla_d64"]) == (1.5, 2.0)
    assert "  ours[0]: 60.0 us" in printed and "  ours[64] vs FlashMLA: 2.00x" in printed


def test_kernel_times_add_a_calls_launches_of_one_name():
    """mla_bench.timing.per_call_kernel_times: a kernel launched twice a call counts twice (the 16-bit sparse path
    runs the dense kernels once per chunk of rows), instantiations sharing a name add up, one-off kernels drop out."""
    from types import SimpleNamespace

    from mla_bench.timing import per_call_kernel_times

    cuda, cpu = SimpleNamespace(name="CUDA"), SimpleNamespace(name="CPU")
    ev = [SimpleNamespace(key="void ns::sm90_decode_kernel<T>(P)", device_type=cuda, count=40, device_time_total=4000.0),
          SimpleNamespace(key="void at::native::elementwise_kernel<1, F>(int)", device_type=cuda, count=20,
                          device_time_total=100.0),
          SimpleNamespace(key="void at::native::elementwise_kernel<2, G>(int)", device_type=cuda, count=20,
                          device_time_total=60.0),
          SimpleNamespace(key="setup_kernel", device_type=cuda, count=1, device_time_total=9.0),
          SimpleNamespace(key="aten::copy_", device_type=cpu, count=20, device_time_total=0.0)]
    assert per_call_kernel_times(ev, 20) == {"sm90_decode_kernel": 200.0, "elementwise_kernel": 8.0}


# ---- benchmarks/sparse_timeline.py --------------------------------------------------------------------------------

def test_sparse_timeline_decodes_and_orders_the_records(capsys):
    """read() unpacks the kernel's records (timeline.cuh: code << 24 | cycles, counts a CTA and role, three global
    times a CTA) and report() prints a CTA's events of every role merged in time order, in µs at the CTA's own clock
    (the lead's cycles over its ns), with the spread of starts and ends."""
    import sparse_timeline

    ctas, roles, events = 3, 4, 8
    words = [0] * (ctas * roles * events)
    counts = [0] * (ctas * roles)
    ns = [0] * (ctas * 3)

    def put(c, r, recs):
        for i, (code, cyc) in enumerate(recs):
            words[(c * roles + r) * events + i] = code << 24 | cyc
        counts[c * roles + r] = len(recs)

    # CTA 0: lead 2000 cycles over 1000 ns (2 GHz); CTA 2: a later start; CTA 1 had no work (no records).
    put(0, 0, [(0, 100), (3, 1000), (99, 2000)])
    put(0, 1, [(0, 120), (10, 1500), (99, 1900)])
    put(0, 2, [(20, 400)])
    put(2, 0, [(0, 100), (99, 4000)])
    ns[0:3] = [5000, 6000, 5950]
    ns[6:9] = [5500, 7500, 7600]

    class FakeExt:
        def sparse_timeline(self, device):
            return {"max_ctas": ctas, "roles": roles, "events": events, "words": words, "counts": counts, "ns": ns}

    recs = sparse_timeline.read(FakeExt(), 0)
    assert sorted(recs) == [0, 2]
    assert recs[0][0][0] == [(0, 100), (3, 1000), (99, 2000)] and recs[0][0][1] == [(0, 120), (10, 1500), (99, 1900)]
    sparse_timeline.report(recs, [0, 1], 40)
    out = capsys.readouterr().out
    assert "2 CTAs with records; start spread 0.50 µs; lead end 1.00-2.50 µs, follower end 0.95-2.60 µs" in out
    assert "clock 2.000 GHz" in out and "CTA 1: no records" in out
    lines = [line.split() for line in out.splitlines() if line.startswith("    ")]
    assert [(float(t), role, ev) for t, role, ev in lines] == [
        (0.05, "lead", "start"), (0.06, "follow", "start"), (0.2, "gather", "stage_free"), (0.5, "lead", "qk_done"),
        (0.75, "follow", "p_full"), (0.95, "follow", "end"), (1.0, "lead", "end")]


def test_sparse_timeline_keeps_the_ends_of_long_lists(capsys):
    import sparse_timeline

    recs = {0: ([[(2, 10 * i) for i in range(1, 11)], [], [], []], [0, 100, 0])}
    sparse_timeline.report(recs, [0], 2)
    out = capsys.readouterr().out
    lead = [line.split() for line in out.splitlines() if line.startswith("    ")]
    assert [x[-1] for x in lead] == ["full", "full", "...", "full", "full"]
