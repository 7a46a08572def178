"""CPU tests of the benchmark harness's pure parts (benchmarks/mla_bench, run as benchmarks/bench.py).

Timing and the vLLM kernels need a GPU; the last test runs the --quick benchmark when one is present.
The harness is not part of the installed package: it is imported from the checkout's benchmarks/ folder.
"""
from __future__ import annotations

import builtins
import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashmla_backend.reference import mla_decode_reference, naive_mla_decode

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from mla_bench import check, cli, impls, report, run, shapes, timing  # noqa: E402

CPU = torch.device("cpu")
CEILINGS = timing.Ceilings(copy_gbs=3000.0, matmul_tflops=700.0, copy_bytes=1 << 30, matmul_n=8192, dtype="bf16")


# ---- shapes -----------------------------------------------------------------------------------

def test_parse_shape_forms():
    assert shapes.parse_shape("b128-sk8192-h128-sq1") == shapes.Shape(128, 8192, 128, 1, False)
    assert shapes.parse_shape(" B128-VARLEN4096-h16-sq2 ") == shapes.Shape(128, 4096, 16, 2, True)
    assert shapes.parse_shape("b1-sk64-h128") == shapes.Shape(1, 64, 128, 1, False)   # s_q defaults to 1


@pytest.mark.parametrize("text", ["", "b128", "128-8192-128-1", "b128-sk8192-h128-sq1-x", "b128-sk-h1",
                                  "b0-sk8192-h128-sq1", "b1-sk0-h1-sq1", "b1-sk8-h0-sq1", "b1-sk8-h1-sq0",
                                  "b-1-sk8-h1-sq1", "b1.5-sk8-h1-sq1"])
def test_parse_shape_rejects(text):
    with pytest.raises(ValueError, match="bad shape"):
        shapes.parse_shape(text)


def test_shape_name_round_trips():
    for shape in shapes.DEFAULT_SHAPES + shapes.QUICK_SHAPES:
        assert shapes.parse_shape(shape.name) == shape


def test_parse_shapes_list_and_errors():
    parsed = shapes.parse_shapes("b1-sk64-h16, b2-varlen100-h128-sq2 b1-sk64-h16-sq1")
    assert [s.name for s in parsed] == ["b1-sk64-h16-sq1", "b2-varlen100-h128-sq2"]   # duplicate dropped
    with pytest.raises(ValueError, match="empty"):
        shapes.parse_shapes(" , ")
    with pytest.raises(ValueError, match="b2-xx"):
        shapes.parse_shapes("b1-sk64-h16,b2-xx")


def test_default_shapes_start_with_the_main_shapes():
    names = [s.name for s in shapes.DEFAULT_SHAPES]
    main_shapes = ["b128-sk8192-h128-sq1", "b128-sk8192-h128-sq2", "b128-sk8192-h16-sq1", "b64-sk8192-h32-sq1",
               "b1-sk8192-h128-sq1", "b128-varlen4096-h128-sq1", "b128-varlen4096-h16-sq1"]
    more = ["b128-sk4096-h16-sq1", "b128-sk4096-h128-sq1", "b128-sk8192-h64-sq2", "b16-sk32768-h128-sq1",
             "b8-sk2048-h16-sq1"]
    assert names[:len(main_shapes)] == main_shapes
    assert set(more) <= set(names)
    assert len(names) == len(set(names))


def test_make_seqlens():
    assert shapes.make_seqlens(shapes.Shape(3, 100, 16), seed=5) == [100, 100, 100]
    shape = shapes.Shape(4096, 4096, 16, 1, True)
    lens = shapes.make_seqlens(shape, seed=0)
    assert lens == shapes.make_seqlens(shape, seed=0)                       # deterministic
    assert lens != shapes.make_seqlens(shape, seed=1)
    assert shapes.make_seqlens(shapes.Shape(4096, 4096, 128, 2, True), seed=0) == lens   # same for other heads
    assert min(lens) >= 1 and all(isinstance(n, int) for n in lens)
    t = torch.tensor(lens, dtype=torch.float64)
    assert abs(t.mean().item() - 4096) < 0.05 * 4096                    # N(4096, 2048) clipped at 1
    assert abs(t.std().item() - 2048) < 0.1 * 2048
    assert len(set(lens)) > 1000


# ---- accounting -------------------------------------------------------------------------------

def test_visible_keys():
    # n=5, s_q=2 causal: token 0 sees 4 keys, token 1 sees 5. n=1: token 0 sees none, token 1 one.
    assert shapes.visible_keys([5, 1], 2, causal=True) == 10
    assert shapes.visible_keys([5, 1], 2, causal=False) == 12
    assert shapes.visible_keys([7, 0], 1, causal=True) == 7
    assert shapes.visible_keys([3], 4, causal=True) == 0 + 1 + 2 + 3


def test_count_work_by_hand():
    w = shapes.count_work([100, 28], h_q=16, s_q=1, causal=True, elem_size=2)
    assert w.flops == 2 * 16 * 1088 * 128
    assert w.kv_bytes == 128 * 576 * 2
    assert w.bytes == 128 * 576 * 2 + 2 * 16 * 576 * 2 + 2 * 16 * 512 * 2 + 2 * 16 * 4
    assert w.sum_seqlen == 128 and w.visible_keys == 128
    assert w.intensity == pytest.approx(w.flops / w.bytes)
    w2 = shapes.count_work([8192] * 128, h_q=128, s_q=2, causal=True, elem_size=2)
    assert w2.flops == 2 * 128 * 1088 * 128 * (8191 + 8192)                 # causal keys counted exactly
    assert w2.kv_bytes == 128 * 8192 * 576 * 2                             # KV read once, not per token


def test_derive_metrics_and_bound():
    w = shapes.Work(flops=10 ** 12, bytes=10 ** 9, kv_bytes=10 ** 9, visible_keys=1, sum_seqlen=1)
    m = timing.derive_metrics(w, 2000.0, CEILINGS)                           # 2 ms
    assert m["tflops"] == pytest.approx(500.0)
    assert m["gbs"] == pytest.approx(500.0)
    assert m["bound"] == "compute"                                          # 1000 FLOP/B > ridge 233
    assert m["frac_ceiling"] == pytest.approx(500 / 700)
    assert m["frac_bw"] == pytest.approx(500 / 3000)
    assert m["roofline_us"] == pytest.approx(1e12 / 700e12 * 1e6)
    w = shapes.Work(flops=16 * 10 ** 9, bytes=10 ** 9, kv_bytes=10 ** 9, visible_keys=1, sum_seqlen=1)
    m = timing.derive_metrics(w, 400.0, CEILINGS)
    assert m["bound"] == "memory" and m["frac_ceiling"] == pytest.approx(2500 / 3000)
    assert timing.derive_metrics(w, 400.0, None)["frac_ceiling"] is None
    assert CEILINGS.ridge == pytest.approx(700e12 / 3000e9)


# ---- inputs -----------------------------------------------------------------------------------

def test_block_table_is_a_shuffled_partition():
    lens = [1, 64, 65, 300, 0, 1000]
    table, num_pages = shapes.make_block_table(lens, torch.Generator().manual_seed(3))
    pages = [-(-n // 64) for n in lens]
    assert num_pages == sum(pages) and table.dtype == torch.int32
    assert table.shape == (len(lens), max(pages))
    used = torch.cat([table[i, :p] for i, p in enumerate(pages)])
    assert sorted(used.tolist()) == list(range(num_pages))                  # every page once
    assert used.tolist() != list(range(num_pages))                          # shuffled
    assert int(table.min()) >= 0 and int(table.max()) < num_pages           # padding entries valid


def test_make_inputs_random_independent_copies():
    shape = shapes.Shape(3, 100, 16, 2, True)
    lens = shapes.make_seqlens(shape, 0)
    copies = shapes.make_inputs(shape, lens, torch.bfloat16, CPU, seed=0, copies=2)
    assert len(copies) == 2
    a, b = copies
    assert a.q.shape == (3, 2, 16, 576) and a.q.dtype == torch.bfloat16
    assert a.k_cache.shape == (sum(-(-n // 64) for n in lens), 64, 1, 576)
    assert (a.k_cache == 0).float().mean() < 0.01 and (a.q == 0).float().mean() < 0.01   # never zeros
    assert not torch.equal(a.k_cache, b.k_cache) and not torch.equal(a.q, b.q)
    assert a.nbytes() == shapes.bytes_per_copy(shape, lens, 2)
    again = shapes.make_inputs(shape, lens, torch.bfloat16, CPU, seed=0, copies=1)[0]
    assert torch.equal(again.k_cache, a.k_cache) and torch.equal(again.block_table, a.block_table)


def test_rotation_copies():
    l2 = 50 << 20
    assert shapes.rotation_copies(2 << 30, l2, 4 << 30) == 1                 # one copy >> L2
    assert shapes.rotation_copies(10 << 20, l2, 4 << 30) == 20               # 4 x L2 in total
    assert shapes.rotation_copies(10 << 20, l2, 50 << 20) == 5               # memory cap
    assert shapes.rotation_copies(1, l2, 4 << 30) == shapes.MAX_COPIES
    assert shapes.rotation_copies(10 << 30, l2, 1 << 30) == 1                # never zero


# ---- naive baseline ---------------------------------------------------------------------------

def _oracle(q, k_cache, block_table, lens, causal, scale):
    """Per-request fp64 loop, independent of both the reference and the naive code."""
    b, s_q, h_q, _ = q.shape
    out = torch.zeros(b, s_q, h_q, 512, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float64)
    for i, n in enumerate(lens):
        rows = torch.cat([k_cache[int(block_table[i, t // 64]), t % 64, 0].double()[None] for t in range(n)]) \
            if n else torch.zeros(0, 576, dtype=torch.float64)
        for j in range(s_q):
            m = n - s_q + j + 1 if causal else n
            if m <= 0:
                continue
            s = q[i, j].double() @ rows[:m].T * scale                       # [h_q, m]
            lse[i, :, j] = torch.logsumexp(s, -1)
            out[i, j] = torch.softmax(s, -1) @ rows[:m, :512]
    return out, lse


def _inputs(lens, s_q, h_q, dtype, seed=0):
    shape = shapes.Shape(len(lens), max(lens), h_q, s_q)
    inp = shapes.make_inputs(shape, lens, dtype, CPU, seed, 1)[0]
    return inp, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("s_q", [1, 2, 3])
@pytest.mark.parametrize("h_q", [1, 16])
def test_naive_matches_reference_and_oracle_fp32(causal, s_q, h_q):
    lens = [0, 1, 2, 63, 64, 65, 140]
    inp, seqlens = _inputs(lens, s_q, h_q, torch.float32)
    scale = 0.07
    out, lse = naive_mla_decode(inp.q, inp.k_cache, inp.block_table, seqlens, 512, max(lens),
                                      softmax_scale=scale, causal=causal)
    ref_out, ref_lse = mla_decode_reference(inp.q, inp.k_cache, inp.block_table, seqlens, 512,
                                            softmax_scale=scale, causal=causal)
    ora_out, ora_lse = _oracle(inp.q, inp.k_cache, inp.block_table, lens, causal, scale)
    assert out.shape == (len(lens), s_q, h_q, 512) and out.dtype == torch.float32
    assert lse.shape == (len(lens), h_q, s_q) and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ora_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse.double(), ora_lse, rtol=1e-5, atol=1e-5)
    assert torch.all(out[0] == 0) and torch.all(torch.isposinf(lse[0]))   # zero-length request
    if causal and s_q > 1:
        assert torch.all(out[1, 0] == 0) and torch.all(torch.isposinf(lse[1, :, 0]))   # n=1: token 0 sees none


def test_naive_bf16_within_guard_tolerance_and_default_scale():
    lens = [1, 100, 700, 64]
    inp, seqlens = _inputs(lens, 2, 16, torch.bfloat16, seed=4)
    out, lse = naive_mla_decode(inp.q, inp.k_cache, inp.block_table, seqlens, 512, max(lens), causal=True)
    ref_out, ref_lse = mla_decode_reference(inp.q, inp.k_cache, inp.block_table, seqlens, 512, causal=True)
    assert out.dtype == torch.bfloat16
    res = check.compare_outputs(out, lse, ref_out, ref_lse, check.visible_rows(seqlens, 2, True))
    assert res.ok, res.detail
    # a different scale is not within tolerance: the guard sees it
    bad, bad_lse = naive_mla_decode(inp.q, inp.k_cache, inp.block_table, seqlens, 512, max(lens),
                                          softmax_scale=1.3 * 576 ** -0.5, causal=True)
    assert not check.compare_outputs(bad, bad_lse, ref_out, ref_lse, check.visible_rows(seqlens, 2, True)).ok


def test_naive_all_empty_and_bad_heads():
    inp, seqlens = _inputs([1, 1], 1, 4, torch.float32)
    out, lse = naive_mla_decode(inp.q, inp.k_cache, inp.block_table, torch.zeros(2, dtype=torch.int32),
                                      512, 0)
    assert torch.all(out == 0) and torch.all(torch.isposinf(lse))
    with pytest.raises(ValueError, match="one KV head"):
        naive_mla_decode(inp.q, inp.k_cache.expand(-1, -1, 2, -1), inp.block_table, seqlens, 512, 1)


# ---- correctness guard ------------------------------------------------------------------------

def _guard_case():
    torch.manual_seed(0)
    out = torch.randn(3, 2, 4, 512)
    lse = torch.randn(3, 4, 2).abs() + 5
    rows = check.visible_rows(torch.tensor([5, 1, 0]), 2, causal=True)
    return out, lse, rows


def test_visible_rows():
    rows = check.visible_rows(torch.tensor([5, 1, 0]), 2, causal=True)
    assert rows.tolist() == [[True, True], [False, True], [False, False]]
    assert check.visible_rows(torch.tensor([5, 0]), 2, causal=False).tolist() == [[True, True], [False, False]]


def test_compare_outputs_accepts_equal_and_small_noise():
    out, lse, rows = _guard_case()
    assert check.compare_outputs(out, lse, out.clone(), lse.clone(), rows).ok
    noisy = out * (1 + 4e-3 * torch.randn_like(out))
    res = check.compare_outputs(noisy.bfloat16(), lse + 1e-3, out, lse, rows)
    assert res.ok and res.max_row_err < 1e-2


def test_compare_outputs_flags_errors():
    out, lse, rows = _guard_case()
    bad = out.clone()
    bad[1, 1, 2] *= 1.1                                                     # one visible row 10% off
    assert not check.compare_outputs(bad, lse, out, lse, rows).ok
    bad = out.clone()
    bad[0, 0, 0, 7] = float("nan")
    res = check.compare_outputs(bad, None, out, None, rows)
    assert not res.ok and "non-finite" in res.detail
    bad_lse = lse.clone()
    bad_lse[0, 3, 1] += 0.1
    assert not check.compare_outputs(out, bad_lse, out, lse, rows).ok
    low = lse.bfloat16()                                                    # bf16 lse: looser tolerance
    assert check.compare_outputs(out, low, out, lse, rows).ok
    assert not check.compare_outputs(out[:2], lse[:2], out, lse, rows).ok  # shape mismatch


def test_agreement_bound_is_twice_the_reference_bound():
    # Two results 2.5e-2 off the reference in opposite directions: each passes against it, and against each other
    # they pass the agreement bound only (a 5e-2 difference).
    out, lse, rows = _guard_case()
    a, b = out * 1.025, out * 0.975
    assert check.compare_outputs(a, None, out, None, rows).ok and check.compare_outputs(b, None, out, None, rows).ok
    assert not check.compare_outputs(a, None, b, None, rows).ok
    assert check.compare_outputs(a, None, b, None, rows, row_tol=check.AGREE_ROW_REL_TOL).ok
    assert not check.compare_outputs(out * 1.07, None, out, None, rows, row_tol=check.AGREE_ROW_REL_TOL).ok


def test_compare_outputs_ignores_rows_without_keys():
    out, lse, rows = _guard_case()
    bad = out.clone()
    bad[2] = float("nan")                                                   # request with 0 keys
    bad[1, 0] = 123.0                                                       # token that sees no key
    assert check.compare_outputs(bad, None, out, None, rows).ok


def test_check_indices():
    assert check.check_indices([5, 9, 1, 7]) == [0, 1, 2, 3]
    assert check.check_indices([3]) == [0]
    assert check.check_indices([4, 4, 4, 4, 4]) == [0, 4]


# ---- one shape end to end on the CPU (fake timer) ---------------------------------------------

def _fake_timer(fn, warmup_ms, rep_ms):
    fn()                                                                    # the call must run
    return timing.Timing(100.0, 90.0, 110.0, "fake")


def _broken_flashmla(ctx):
    """Stands in for vLLM's FlashMLA: correct shapes, wrong softmax scale."""
    def make(inp):
        return lambda: naive_mla_decode(inp.q, inp.k_cache, inp.block_table, ctx.cache_seqlens, 512,
                                              ctx.max_seqlen, softmax_scale=2 * ctx.scale, causal=ctx.causal)
    return [impls.Variant("", [make(i) for i in ctx.inputs], impls.standard)]


def _missing(ctx):
    raise impls.ImplUnavailable("not installed here")


def test_run_shape_on_cpu(monkeypatch, capsys):
    monkeypatch.setitem(impls.ADAPTERS, "flashmla", _broken_flashmla)
    monkeypatch.setitem(impls.ADAPTERS, "fa3", _missing)
    cfg = run.Config(shapes=[], impls=["ours", "flashmla", "fa3", "naive"], l2_bytes=1 << 16)
    shape = shapes.parse_shape("b3-varlen100-h16-sq2")
    rows = run.run_shape(shape, cfg, CEILINGS, _fake_timer, CPU, 1, 1)
    by = {r["impl"]: r for r in rows}
    assert set(by) == {"ours", "get_mla_metadata", "flashmla", "fa3", "naive"}
    assert by["ours"]["check"] == "ok" and by["naive"]["check"] == "ok"
    assert by["naive"]["vs_ours_max_row_err"] < check.OUT_ROW_REL_TOL
    assert by["flashmla"]["check"] == "WRONG"
    assert by["fa3"]["status"] == "unavailable" and "not installed" in by["fa3"]["reason"]
    assert by["flashmla"]["speedup_vs_flashmla"] is None                   # a wrong baseline gives no ratio
    assert by["ours"]["speedup_vs_flashmla"] is None
    work = shapes.count_work(shapes.make_seqlens(shape, 0), 16, 2, True, 2)
    assert by["ours"]["us"] == 100.0 and by["ours"]["flops"] == work.flops
    assert by["ours"]["tflops"] == pytest.approx(work.flops / 100e-6 / 1e12)
    assert by["ours"]["copies"] == 1
    printed = capsys.readouterr().out
    assert "b3-varlen100-h16-sq2" in printed and "WRONG" in printed and "unavailable: not installed" in printed


def test_speedups_use_same_shape_and_mode():
    rows = [dict(shape="s", mode="plain", impl="flashmla", status="ok", check="ok", us=200.0),
            dict(shape="s", mode="plain", impl="ours", status="ok", check="ok", us=100.0),
            dict(shape="s", mode="graph", impl="ours", status="ok", check="ok", us=50.0),
            dict(shape="t", mode="plain", impl="ours", status="ok", check="WRONG", us=1.0)]
    for r in rows:
        r["speedup_vs_flashmla"] = None
    run.add_speedups(rows)
    assert rows[0]["speedup_vs_flashmla"] == pytest.approx(1.0)
    assert rows[1]["speedup_vs_flashmla"] == pytest.approx(2.0)
    assert rows[2]["speedup_vs_flashmla"] is None and rows[3]["speedup_vs_flashmla"] is None


# ---- outputs ----------------------------------------------------------------------------------

def _rows():
    cfg = run.Config(shapes=[], impls=list(impls.IMPLS))
    work = shapes.count_work([8192] * 4, 16, 1, True, 2)
    rows = []
    for impl, us, verdict in (("ours", 50.0, "ok"), ("flashmla", 60.0, "ok"), ("naive", 900.0, "WRONG")):
        r = run.base_row(shapes.Shape(4, 8192, 16), cfg, work, 3, impl, "plain")
        run.fill_timing(r, timing.Timing(us, us - 1, us + 1, "fake"), work, CEILINGS)
        r.update(check=verdict, max_row_err=float("nan") if verdict == "WRONG" else 1e-3)
        rows.append(r)
    fa3 = run.base_row(shapes.Shape(4, 8192, 16), cfg, work, 3, "fa3", "plain")
    fa3.update(status="unavailable", reason="no vllm")
    rows.append(fa3)
    run.add_speedups(rows)
    return cfg, rows


def test_write_json_and_csv(tmp_path):
    cfg, rows = _rows()
    env = {"date_utc": "2026-01-01T00:00:00+00:00", "command": "python benchmarks/bench.py --quick",
           "gpu": "H100"}
    report.write_json(str(tmp_path / "r.json"), env, cfg, CEILINGS, rows)
    report.write_csv(str(tmp_path / "r.csv"), CEILINGS, rows)
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["environment"]["command"].endswith("--quick")
    assert doc["ceilings"]["copy_gbs"] == 3000.0 and doc["config"]["impls"] == list(impls.IMPLS)
    assert [r["impl"] for r in doc["results"]] == ["ours", "flashmla", "naive", "fa3"]
    assert doc["results"][2]["max_row_err"] is None                        # NaN written as null
    assert doc["results"][0]["speedup_vs_flashmla"] == pytest.approx(60 / 50)
    with open(tmp_path / "r.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4 and list(table[0]) == report.CSV_FIELDS
    assert float(table[0]["us"]) == 50.0 and float(table[0]["copy_gbs"]) == 3000.0
    assert float(table[0]["tflops"]) == pytest.approx(rows[0]["tflops"])
    assert table[3]["status"] == "unavailable" and table[3]["us"] == ""


def test_markdown_report():
    cfg, rows = _rows()
    md = report.markdown_report({"date_utc": "d", "command": "c", "gpu": "H100", "driver": "580"}, cfg, CEILINGS, rows)
    line = next(l for l in md.splitlines() if l.startswith("| b4-sk8192-h16-sq1"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "50.0" and cells[5] == "60.0" and cells[7] == "n/a"
    assert cells[8] == "900.0 (WRONG)" and cells[9] == "1.20x"
    assert "3000 GB/s" in md and "700 TFLOP/s" in md and "no vllm" in md


def test_write_outputs_without_matplotlib(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib here")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    cfg, rows = _rows()
    with pytest.warns(UserWarning, match="matplotlib"):
        paths = report.write_outputs(str(tmp_path / "out"), {"date_utc": "d", "command": "c"}, cfg, CEILINGS, rows)
    assert set(paths) == {"json", "csv", "md"}
    assert all(os.path.getsize(p) > 0 for p in paths.values())


def test_write_chart(tmp_path):
    pytest.importorskip("matplotlib")
    cfg, rows = _rows()
    path = tmp_path / "chart.png"
    assert report.write_chart(str(path), rows, CEILINGS)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- command line -----------------------------------------------------------------------------

def test_parse_args_defaults_and_quick():
    cfg = cli.config_from_args(cli.parse_args([]))
    assert cfg.shapes == shapes.DEFAULT_SHAPES and cfg.impls == list(impls.IMPLS)
    assert cfg.causal and cfg.dtype == torch.bfloat16 and cfg.modes == ["plain"]
    assert (cfg.warmup_ms, cfg.rep_ms, cfg.triton_splits) == (25.0, 100.0, [4, 8, 16, 32])
    q = cli.config_from_args(cli.parse_args(["--quick", "--graph", "--no-causal", "--dtype", "fp16",
                                                 "--impls", "naive,ours", "--rep", "7"]))
    assert q.shapes == shapes.QUICK_SHAPES and q.impls == ["ours", "naive"] and q.modes == ["plain", "graph"]
    assert not q.causal and q.dtype == torch.float16 and q.rep_ms == 7.0 and q.warmup_ms == 5.0
    assert q.triton_splits == []
    s = cli.config_from_args(cli.parse_args(["--quick", "--shapes", "b2-sk10-h16", "--triton-splits", "2,4",
                                                 "--impls", "all", "--max-rotation-gib", "0.5", "--seed", "3"]))
    assert [x.name for x in s.shapes] == ["b2-sk10-h16-sq1"] and s.triton_splits == [2, 4]
    assert s.impls == list(impls.IMPLS) and s.max_rotation_bytes == 1 << 29 and s.seed == 3


@pytest.mark.parametrize("argv, message", [
    (["--impls", "ours,bogus"], "bogus"),
    (["--impls", ""], "empty"),
    (["--shapes", "b128-sk8192"], "bad shape"),
    (["--warmup", "0"], "must be > 0"),
    (["--rep", "abc"], "not a number"),
    (["--dtype", "fp64"], "invalid choice"),
    (["--triton-splits", "4,0"], ">= 1"),
    (["--triton-splits", "4,x"], "integers"),
    (["--seed", "-1"], ">= 0"),
    (["--max-rotation-gib", "-2"], "must be > 0"),
    (["--frobnicate"], "unrecognized"),
])
def test_parse_args_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_out_dir_must_be_a_folder(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SystemExit):
        cli.parse_args(["--out-dir", str(f)])
    assert "not a folder" in capsys.readouterr().err


def test_command_line():
    assert cli.command_line(["--quick", "--shapes", "b1-sk64-h16"]) == \
        "python benchmarks/bench.py --quick --shapes b1-sk64-h16"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_main_without_gpu(capsys, tmp_path):
    assert cli.main(["--quick", "--out-dir", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quick_benchmark_on_gpu(tmp_path):
    assert cli.main(["--quick", "--graph", "--out-dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    rows = doc["results"]
    assert doc["ceilings"]["copy_gbs"] > 100 and doc["ceilings"]["matmul_tflops"] > 10
    ours = [r for r in rows if r["impl"] == "ours"]
    assert len(ours) == 2 * len(shapes.QUICK_SHAPES)
    assert all(r["status"] == "ok" and r["check"] == "ok" and r["us"] > 0 for r in ours)
    assert all(r["check"] != "WRONG" for r in rows), [r for r in rows if r["check"] == "WRONG"]
    assert (tmp_path / "results.csv").exists() and (tmp_path / "results.md").exists()


def test_vllm_impls_degrade_to_unavailable_on_cpu():
    """With vLLM installed (tests/run.sh installs it on CPU machines), its kernels cannot run on CPU
    tensors: every vLLM implementation must come back as a row with a reason, not an exception."""
    pytest.importorskip("vllm")
    shape = shapes.parse_shape("b2-sk100-h16-sq1")
    lens = shapes.make_seqlens(shape, 0)
    inputs = shapes.make_inputs(shape, lens, torch.bfloat16, CPU, 0, 1)
    ctx = impls.ShapeContext(shape, lens, inputs, torch.tensor(lens, dtype=torch.int32), max(lens), 576 ** -0.5,
                             True, torch.bfloat16, CPU, [4], 8)
    cfg = run.Config(shapes=[shape], impls=["flashmla", "triton", "fa3"])
    work = shapes.count_work(lens, 16, 1, True, 2)
    for impl in ("flashmla", "triton", "fa3"):
        rows, result = run.run_impl(impl, ctx, cfg, work, CEILINGS, _fake_timer, None, None, 1)
        assert result is None and len(rows) == 1
        assert rows[0]["status"] == "unavailable" and rows[0]["reason"], (impl, rows[0])


# ---- FP8 (e4m3) KV cache ----------------------------------------------------------------------

def test_parse_args_kv_dtype():
    a = cli.parse_args(["--kv-dtype", "bf16,fp8"])
    assert a.kv_dtype == ["bf16", "fp8"] and a.impls == list(impls.ALL_IMPLS)
    cfg = cli.config_from_args(a)
    assert cfg.kv_dtypes == ["bf16", "fp8"] and cfg.impls[-4:] == ["ours-fp8", "ours-fp8q", "flashmla-fp8",
                                                                     "flashinfer-fp8"]
    assert cli.parse_args(["--kv-dtype", "FP8"]).impls == list(impls.FP8_IMPLS)          # e4m3 rows only
    assert cli.parse_args(["--kv-dtype", "e4m3 bf16", "--impls", "all"]).kv_dtype == ["bf16", "fp8"]
    # without --kv-dtype: the dtypes of the implementations named (run order kept)
    a = cli.parse_args(["--impls", "flashmla-fp8,ours-fp8q,ours"])
    assert a.impls == ["ours", "ours-fp8q", "flashmla-fp8"] and a.kv_dtype == ["bf16", "fp8"]
    assert cli.parse_args(["--impls", "ours-fp8"]).kv_dtype == ["fp8"]
    assert cli.parse_args([]).kv_dtype == ["bf16"] and cli.parse_args([]).impls == list(impls.IMPLS)
    a = cli.parse_args(["--dtype", "fp16", "--kv-dtype", "fp16,fp8", "--impls", "ours,ours-fp8"])
    assert a.kv_dtype == ["fp16", "fp8"] and cli.config_from_args(a).dtype == torch.float16


@pytest.mark.parametrize("argv, message", [
    (["--kv-dtype", "int4"], "unknown KV dtype"),
    (["--kv-dtype", ""], "empty"),
    (["--kv-dtype", "fp16"], "needs --dtype fp16"),                 # the 16-bit cache is in --dtype
    (["--kv-dtype", "bf16", "--impls", "ours,ours-fp8q"], "ours-fp8q need(s) a fp8 cache"),
    (["--kv-dtype", "fp8", "--impls", "ours"], "ours need(s) a bf16 cache"),
    (["--impls", "ours-fp9"], "unknown implementation"),
])
def test_parse_args_kv_dtype_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_count_work_e4m3_by_hand():
    lens, h_q, s_q = [100, 28], 16, 2
    w8 = shapes.count_work(lens, h_q, s_q, True, 2, kv_elem_size=1)                # 16-bit q, e4m3 cache
    q16, q8, out, lse = 2 * s_q * h_q * 576 * 2, 2 * s_q * h_q * 576, 2 * s_q * h_q * 512 * 2, 2 * h_q * s_q * 4
    assert w8.kv_bytes == 128 * 576 and w8.bytes == 128 * 576 + q16 + out + lse
    w8q = shapes.count_work(lens, h_q, s_q, True, 2, kv_elem_size=1, q_elem_size=1)  # e4m3 q too
    assert w8q.bytes == 128 * 576 + q8 + out + lse
    w16 = shapes.count_work(lens, h_q, s_q, True, 2)
    assert w8.flops == w8q.flops == w16.flops and w16.bytes == 128 * 576 * 2 + q16 + out + lse
    # the harness picks the count by implementation
    assert run.work_of("ours-fp8", lens, shapes.Shape(2, 100, h_q, s_q), True, 2) == w8
    assert run.work_of("ours-fp8q", lens, shapes.Shape(2, 100, h_q, s_q), True, 2) == w8q
    assert run.work_of("flashmla-fp8", lens, shapes.Shape(2, 100, h_q, s_q), True, 2) == w8q
    assert run.work_of("ours", lens, shapes.Shape(2, 100, h_q, s_q), True, 2) == w16
    # % of the copy ceiling: the e4m3 bytes over the time (b128-sk8192-h128-sq1 by hand)
    big = shapes.count_work([8192] * 128, 128, 1, True, 2, kv_elem_size=1)
    assert big.bytes == 128 * 8192 * 576 + 128 * 128 * 576 * 2 + 128 * 128 * 512 * 2 + 128 * 128 * 4
    m = timing.derive_metrics(big, 300.0, CEILINGS)
    assert m["frac_bw"] == pytest.approx(big.bytes / 300e-6 / 1e9 / 3000)


def test_quantize_e4m3():
    x = torch.randn(7, 64, 1, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    x8, descale = shapes.quantize_e4m3(x)
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == x.shape
    assert descale.shape == (1,) and descale.dtype == torch.float32
    want = float(x.abs().max()) / 448
    assert want <= float(descale) <= want * (1 + 2 ** -7)                          # rounded up to bf16
    assert float(descale) == float(descale.to(torch.bfloat16))
    assert float(x8.float().abs().max()) == 448.0                                 # amax still maps to e4m3's max
    back = x8.float() * descale
    big = x.float().abs() > 2 ** -6 * float(descale)                              # normal e4m3 range
    assert ((back - x.float()).abs()[big] <= 2 ** -4 * x.float().abs()[big] + 1e-12).all()   # half an ulp
    rel = float((back - x.float()).norm() / x.float().norm())
    assert 5e-3 < rel < 4e-2                                                      # e4m3 is coarse
    chunked, d2 = shapes.quantize_e4m3(x, chunk_elems=2 * 64 * 576)               # 4 chunks: same bytes
    assert torch.equal(chunked.view(torch.uint8), x8.view(torch.uint8)) and torch.equal(d2, descale)


def test_one_fp8_case_is_the_first_copy_and_its_e4m3_twin():
    shape = shapes.Shape(3, 100, 16, 2, True)
    seqlens, inp, f8, lens = shapes.one_fp8_case(shape, CPU)
    assert seqlens == shapes.make_seqlens(shape, 0) and lens.dtype == torch.int32 and lens.tolist() == seqlens
    want = shapes.make_inputs(shape, seqlens, torch.bfloat16, CPU, seed=0, copies=1)[0]
    assert torch.equal(inp.q, want.q) and torch.equal(inp.k_cache, want.k_cache)
    twin = shapes.make_fp8_inputs([want])[0]
    assert torch.equal(f8.k_cache.view(torch.uint8), twin.k_cache.view(torch.uint8))
    assert torch.equal(f8.descale_k, twin.descale_k) and torch.equal(f8.descale_q, twin.descale_q)


def test_make_fp8_inputs_and_rotation():
    shape = shapes.Shape(3, 100, 16, 2, True)
    lens = shapes.make_seqlens(shape, 0)
    inputs = shapes.make_inputs(shape, lens, torch.bfloat16, CPU, seed=0, copies=2)
    f8 = shapes.make_fp8_inputs(inputs)
    assert len(f8) == 2 and f8[0].k_cache.shape == inputs[0].k_cache.shape and f8[0].q.shape == inputs[0].q.shape
    assert f8[0].nbytes() == shapes.fp8_bytes_per_copy(shape, lens)
    for inp, f in zip(inputs, f8):                      # each copy's descales come from its own amax
        for x, d in ((inp.k_cache, f.descale_k), (inp.q, f.descale_q)):
            want = float(x.abs().amax().float()) / shapes.E4M3_MAX
            assert want <= float(d) <= want * (1 + 2 ** -7)                       # rounded up to bf16
            assert float(d) == float(d.to(torch.bfloat16))
    # Each copy quantized with its own descale, whatever the random maxima: a copy with twice the data of
    # another gets exactly twice its descales and the same e4m3 bytes.
    a = inputs[0]
    twice = shapes.make_fp8_inputs([a, shapes.DecodeInputs(a.q * 2, a.k_cache * 2, a.block_table)])
    assert float(twice[1].descale_k) == 2 * float(twice[0].descale_k)
    assert float(twice[1].descale_q) == 2 * float(twice[0].descale_q)
    assert torch.equal(twice[1].k_cache.view(torch.uint8), twice[0].k_cache.view(torch.uint8))
    assert torch.equal(twice[1].q.view(torch.uint8), twice[0].q.view(torch.uint8))
    l2 = 50 << 20
    # e4m3 copies are half the size: twice as many copies, capped by the memory of both sets
    assert shapes.rotation_copies_for([10 << 20, 5 << 20], 15 << 20, l2, 4 << 30) == 40
    assert shapes.rotation_copies_for([10 << 20, 5 << 20], 15 << 20, l2, 150 << 20) == 10
    assert shapes.rotation_copies_for([10 << 20], 10 << 20, l2, 4 << 30) == shapes.rotation_copies(10 << 20, l2, 4 << 30)


def test_dequantized_reference_matches_oracle():
    lens = [1, 64, 65, 140, 7]
    inp, seqlens = _inputs(lens, 2, 16, torch.bfloat16, seed=2)
    f8 = shapes.make_fp8_inputs([inp])[0]
    k = f8.k_cache.double() * f8.descale_k.double()
    for q, dq in ((inp.q, None), (f8.q, f8.descale_q)):
        want, want_lse = _oracle(q.double() * (dq.double() if dq is not None else 1), k, inp.block_table, lens,
                                 True, 0.05)
        for chunk in (1 << 28, 1):                                                 # one group; one request each
            out, lse = check.dequantized_reference(q, f8.k_cache, inp.block_table, lens, 0.05, True, f8.descale_k,
                                                   descale_q=dq, chunk_bytes=chunk)
            assert out.dtype == torch.float64
            torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)


def test_rel_norm_error():
    out, _, rows = _guard_case()
    assert check.rel_norm_error(out, out, rows) == 0.0
    noisy = out.clone()
    noisy[rows.unsqueeze(-1).expand(out.shape[:3])] *= 1.01
    assert check.rel_norm_error(noisy, out, rows) == pytest.approx(0.01)
    noisy[2] = float("nan")                                                        # a row without keys: ignored
    assert check.rel_norm_error(noisy, out, rows) == pytest.approx(0.01)
    assert check.rel_norm_error(out, out, torch.zeros_like(rows)) is None


def _stub_fp8(fast: bool, scale_factor: float = 1.0):
    """Stands in for an FP8 implementation: the fp32 naive decode of the dequantized inputs."""
    def prepare(ctx):
        assert len(ctx.fp8) == len(ctx.inputs)

        def make(inp, f8):
            q = f8.q.float() * f8.descale_q if fast else inp.q.float()
            k = f8.k_cache.float() * f8.descale_k
            return lambda: naive_mla_decode(q, k, inp.block_table, ctx.cache_seqlens, 512, ctx.max_seqlen,
                                            softmax_scale=scale_factor * ctx.scale, causal=ctx.causal)
        return [impls.Variant("", [make(i, f) for i, f in zip(ctx.inputs, ctx.fp8)], impls.standard)]
    return prepare


def test_run_shape_fp8_on_cpu(monkeypatch, capsys):
    monkeypatch.setitem(impls.ADAPTERS, "ours-fp8", _stub_fp8(False))
    monkeypatch.setitem(impls.ADAPTERS, "ours-fp8q", _stub_fp8(True))
    monkeypatch.setitem(impls.ADAPTERS, "flashmla-fp8", _stub_fp8(True, 1.5))     # wrong scale
    cfg = run.Config(shapes=[], impls=["ours", "ours-fp8", "ours-fp8q", "flashmla-fp8"], l2_bytes=1 << 16,
                     kv_dtypes=["bf16", "fp8"])
    shape = shapes.parse_shape("b3-varlen100-h16-sq2")
    rows = run.run_shape(shape, cfg, CEILINGS, _fake_timer, CPU, 1, 1)
    by = {r["impl"]: r for r in rows}
    lens = shapes.make_seqlens(shape, 0)
    for impl in ("ours-fp8", "ours-fp8q"):
        r = by[impl]
        assert r["status"] == "ok" and r["check"] == "ok" and r["kv_dtype"] == "fp8_e4m3", r
        assert r["bytes"] == run.work_of(impl, lens, shape, True, 2).bytes
        assert r["frac_bw"] == pytest.approx(r["bytes"] / 100e-6 / 1e9 / 3000)
    assert by["ours-fp8"]["q_dtype"] == "bf16" and by["ours-fp8q"]["q_dtype"] == "fp8_e4m3"
    # each mode is exact (fp32) against its own reference and off by e4m3's q rounding against the other
    assert by["ours-fp8"]["err_vs_bf16q"] < 1e-5 < 1e-3 < by["ours-fp8"]["err_vs_fp8q"] < 5e-2
    assert by["ours-fp8q"]["err_vs_fp8q"] < 1e-5 < 1e-3 < by["ours-fp8q"]["err_vs_bf16q"] < 5e-2
    bad = by["flashmla-fp8"]
    assert bad["check"] == "WRONG" and bad["err_vs_fp8q"] > 5e-2 and bad["speedup_vs_flashmla"] is None
    assert by["ours-fp8q"]["speedup_vs_flashmla"] is None                          # baseline WRONG: no ratio
    assert by["ours"]["kv_dtype"] == "bf16" and by["ours"]["err_vs_bf16q"] is None
    printed = capsys.readouterr().out
    assert "e4m3 inputs: descale_k" in printed and "err vs fp64 ref" in printed
    assert "FP8 (plain): ours-fp8q vs FlashMLA-FP8 n/a" in printed and "ours-fp8 vs ours bf16 1.000x" in printed


def test_accuracy_figures_read_the_checked_result_not_a_reused_buffer(monkeypatch):
    """An adapter that writes every call into one output buffer (as the Triton and FlashInfer adapters may):
    the timed calls after the check overwrite it, and the figures must still be those of the checked call."""
    def shared_buffer(ctx):
        calls = {"n": 0}
        good = _stub_fp8(False)(ctx)[0]
        buf = {}

        def call(c):
            out, lse = good.calls[c]()
            calls["n"] += 1
            if "out" not in buf:
                buf["out"], buf["lse"] = out.clone(), lse.clone()
            buf["out"].copy_(out if calls["n"] == 1 else torch.full_like(out, 7.0))   # later calls: garbage
            buf["lse"].copy_(lse)
            return buf["out"], buf["lse"]
        return [impls.Variant("", [lambda c=c: call(c) for c in range(len(ctx.inputs))], impls.standard)]
    monkeypatch.setitem(impls.ADAPTERS, "flashinfer-fp8", shared_buffer)
    monkeypatch.setitem(impls.ADAPTERS, "ours-fp8", _stub_fp8(False))
    cfg = run.Config(shapes=[], impls=["ours-fp8", "flashinfer-fp8"], l2_bytes=1 << 16, kv_dtypes=["fp8"])
    rows = run.run_shape(shapes.parse_shape("b2-sk70-h16-sq1"), cfg, CEILINGS, _fake_timer, CPU)
    r = {x["impl"]: x for x in rows}["flashinfer-fp8"]
    assert r["check"] == "ok" and r["err_vs_bf16q"] < 1e-5, r


def test_run_shape_fp8_peer_is_ours_fp8q(monkeypatch):
    """flashmla-fp8 is compared with ours-fp8q (same e4m3 q and cache) on the whole batch."""
    monkeypatch.setitem(impls.ADAPTERS, "ours-fp8q", _stub_fp8(True, 1.5))        # wrong: no peer comparison
    monkeypatch.setitem(impls.ADAPTERS, "flashmla-fp8", _stub_fp8(True))
    cfg = run.Config(shapes=[], impls=["ours-fp8q", "flashmla-fp8"], l2_bytes=1 << 16)
    rows = run.run_shape(shapes.parse_shape("b2-sk70-h16-sq1"), cfg, CEILINGS, _fake_timer, CPU)
    by = {r["impl"]: r for r in rows}
    assert by["ours-fp8q"]["check"] == "WRONG" and by["flashmla-fp8"]["check"] == "ok"
    assert by["flashmla-fp8"]["vs_ours_max_row_err"] is None
    monkeypatch.setitem(impls.ADAPTERS, "ours-fp8q", _stub_fp8(True))
    rows = run.run_shape(shapes.parse_shape("b2-sk70-h16-sq1"), cfg, CEILINGS, _fake_timer, CPU)
    assert {r["impl"]: r for r in rows}["flashmla-fp8"]["vs_ours_max_row_err"] == 0.0
    assert not any(r["impl"] == "get_mla_metadata" for r in rows)


def test_fp8_impls_degrade_cleanly(monkeypatch):
    """The real FP8 adapters on the CPU: each row is ok (an API with the FP8 cache runs its CPU path) or
    unavailable with a reason (no FP8 in the API yet, no vLLM, no CUDA); never an exception."""
    cfg = run.Config(shapes=[], impls=list(impls.FP8_IMPLS), l2_bytes=1 << 16, kv_dtypes=["fp8"])
    rows = run.run_shape(shapes.parse_shape("b2-sk100-h16-sq1"), cfg, CEILINGS, _fake_timer, CPU)
    assert [r["impl"] for r in rows] == list(impls.FP8_IMPLS)
    for r in rows:
        assert (r["status"] == "ok" and r["check"] == "ok") or (r["status"] == "unavailable" and r["reason"]), r
    assert rows[2]["status"] == "unavailable"                                     # vLLM's kernels need CUDA
    # without e4m3 inputs (a context built for 16-bit rows only) the adapters refuse by name
    shape = shapes.parse_shape("b2-sk100-h16-sq1")
    lens = shapes.make_seqlens(shape, 0)
    ctx = impls.ShapeContext(shape, lens, shapes.make_inputs(shape, lens, torch.bfloat16, CPU, 0, 1),
                             torch.tensor(lens, dtype=torch.int32), max(lens), 576 ** -0.5, True, torch.bfloat16,
                             CPU, [], 8)
    for impl in impls.FP8_IMPLS:
        with pytest.raises(impls.ImplUnavailable, match="e4m3 inputs"):
            impls.ADAPTERS[impl](ctx)
    # vLLM absent: the reason says so
    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("no vllm here")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_vllm)
    monkeypatch.setattr("importlib.import_module", lambda name, package=None: no_vllm(name))
    rows = run.run_shape(shape, run.Config(shapes=[], impls=["flashmla-fp8"], l2_bytes=1 << 16), CEILINGS,
                         _fake_timer, CPU)
    assert rows[0]["status"] == "unavailable" and "vllm import failed" in rows[0]["reason"]


def test_ours_fp8_runs_when_the_api_has_it():
    """Once flash_mla_with_kvcache takes descale_k, the CPU path of ours-fp8 / ours-fp8q passes the guard."""
    import inspect
    import flashmla_backend
    if "descale_k" not in inspect.signature(flashmla_backend.flash_mla_with_kvcache).parameters:
        pytest.skip("this flashmla_backend has no FP8 KV cache yet")
    cfg = run.Config(shapes=[], impls=["ours-fp8", "ours-fp8q"], l2_bytes=1 << 16, kv_dtypes=["fp8"])
    rows = run.run_shape(shapes.parse_shape("b3-varlen100-h16-sq2"), cfg, CEILINGS, _fake_timer, CPU)
    by = {r["impl"]: r for r in rows}
    assert by["ours-fp8"]["check"] == "ok" and by["ours-fp8"]["err_vs_bf16q"] < 1e-2
    assert by["ours-fp8q"]["check"] == "ok" and by["ours-fp8q"]["err_vs_fp8q"] < 1e-2


def _fp8_rows():
    """Synthetic results of one shape: ours 100 µs, ours-fp8 60, ours-fp8q 50, flashmla-fp8 55 (plain)."""
    cfg = run.Config(shapes=[], impls=["ours", "flashmla", "ours-fp8", "ours-fp8q", "flashmla-fp8"],
                     kv_dtypes=["bf16", "fp8"])
    shape = shapes.Shape(128, 8192, 128)
    lens = [8192] * 128
    rows = []
    for impl, us in (("ours", 100.0), ("ours-fp8", 60.0), ("ours-fp8q", 50.0), ("flashmla-fp8", 55.0)):
        work = run.work_of(impl, lens, shape, True, 2)
        r = run.base_row(shape, cfg, work, 1, impl, "plain")
        run.fill_timing(r, timing.Timing(us, us - 1, us + 1, "fake"), work, CEILINGS)
        r.update(check="ok")
        if impl in impls.FP8_IMPLS:
            r.update(err_vs_bf16q=2.0e-3 if impl == "ours-fp8" else 1.5e-2,
                     err_vs_fp8q=1.5e-2 if impl == "ours-fp8" else 2.5e-3)
        rows.append(r)
    fm = run.base_row(shape, cfg, run.work_of("flashmla", lens, shape, True, 2), 1, "flashmla", "plain")
    fm.update(status="unavailable", reason="no vllm")
    rows.append(fm)
    run.add_speedups(rows)
    return cfg, rows


def test_fp8_summary_and_speedups():
    cfg, rows = _fp8_rows()
    s = run.fp8_summary(rows, "b128-sk8192-h128-sq1", "plain")
    assert s["fp8q_vs_flashmla_fp8"] == pytest.approx(55 / 50)
    assert s["fp8_over_fp8q"] == pytest.approx(60 / 50)
    assert s["fp8_vs_16bit"] == pytest.approx(100 / 60)
    ours8 = next(r for r in rows if r["impl"] == "ours-fp8")
    assert s["fp8_frac_copy"] == pytest.approx(ours8["bytes"] / 60e-6 / 1e9 / 3000)
    assert ours8["speedup_vs_flashmla"] == pytest.approx(55 / 60)                 # FP8 rows: vs FlashMLA-FP8
    assert next(r for r in rows if r["impl"] == "ours")["speedup_vs_flashmla"] is None   # FlashMLA unavailable
    assert run.fp8_summary(rows, "b128-sk8192-h128-sq1", "graph")["fp8_over_fp8q"] is None


def test_markdown_report_fp8_from_results_json(tmp_path):
    cfg, rows = _fp8_rows()
    report.write_json(str(tmp_path / "r.json"), {"date_utc": "d", "command": "c"}, cfg, CEILINGS, rows)
    doc = json.loads((tmp_path / "r.json").read_text())
    got = doc["results"]
    assert {r["impl"]: r["err_vs_fp8q"] for r in got}["ours-fp8q"] == 2.5e-3
    assert {r["impl"]: r["kv_dtype"] for r in got}["flashmla-fp8"] == "fp8_e4m3"
    cfg2 = run.Config(shapes=[], impls=doc["config"]["impls"], kv_dtypes=doc["config"]["kv_dtypes"])
    md = report.markdown_report(doc["environment"], cfg2, CEILINGS, got)
    assert "KV cache bf16,fp8" in md and "FP8 (e4m3) KV cache, plain calls" in md
    lines = [l for l in md.splitlines() if l.startswith("| b128-sk8192-h128-sq1")]
    assert len(lines) == 3                                                        # 16-bit, FP8 timing, accuracy
    timing_cells = [c.strip() for c in lines[1].strip("|").split("|")]
    frac = 100 * next(r for r in got if r["impl"] == "ours-fp8")["frac_bw"]
    frac_q = 100 * next(r for r in got if r["impl"] == "ours-fp8q")["frac_bw"]
    assert timing_cells == ["b128-sk8192-h128-sq1", "60.0", "50.0", "55.0", "100.0", "1.10x", "1.20x", "1.67x",
                            f"{frac:.0f}%", f"{frac_q:.0f}%"]
    acc_cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert acc_cells == ["b128-sk8192-h128-sq1", "2.0e-03", "1.5e-02", "1.5e-02", "2.5e-03", "1.5e-02", "2.5e-03"]
    # FP8 rows only: no 16-bit table, the FP8 ones still there
    only8 = [r for r in got if r["impl"] in impls.FP8_IMPLS]
    md8 = report.markdown_report({}, cfg2, CEILINGS, only8)
    assert "ours TFLOP/s" not in md8 and "| ours-fp8 µs |" in md8
    # no FP8 rows: no FP8 tables
    assert "FP8" not in "".join(report.fp8_tables(cfg2, [r for r in got if r["impl"] == "ours"]))


def test_write_chart_with_fp8_rows(tmp_path):
    pytest.importorskip("matplotlib")
    cfg, rows = _fp8_rows()
    assert report.write_chart(str(tmp_path / "c.png"), rows, CEILINGS)
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(set(report.CHART_COLORS.values())) == len(impls.ALL_IMPLS)
    assert {report.CHART_MARKERS[i] for i in impls.FP8_IMPLS}.isdisjoint({report.CHART_MARKERS[i] for i in impls.IMPLS})


# ---- where the harness lives --------------------------------------------------------------------

def test_harness_is_not_in_the_installed_package():
    import importlib.util
    assert importlib.util.find_spec("flashmla_backend.bench") is None


def test_scripts_share_the_names_they_import():
    """benchmarks/split_sweep.py, profile_ncu.py and ablation.py take these from the package itself."""
    import mla_bench
    assert mla_bench.parse_shapes is shapes.parse_shapes and mla_bench.make_inputs is shapes.make_inputs
    assert mla_bench.make_seqlens is shapes.make_seqlens and mla_bench.capture_graphs is timing.capture_graphs
    assert mla_bench.time_with_events is timing.time_with_events


@pytest.mark.parametrize("script", ["bench.py", "split_sweep.py", "profile_ncu.py"])
def test_scripts_start_from_any_folder(script, tmp_path):
    """Each script finds its harness (and this checkout's package when none is installed) by itself."""
    res = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "usage:" in res.stdout


def test_profile_ncu_options():
    """benchmarks/profile_ncu.py: the FP8 cache's modes and the implementations, and what it refuses."""
    import profile_ncu

    a = profile_ncu.parse_args(["b1-sk8192-h128-sq1", "--kv-dtype", "fp8", "--fp8-modes", "accurate", "--impls",
                                "ours,flashmla"])
    assert a.shapes == ["b1-sk8192-h128-sq1"] and a.kv_dtype == "fp8" and a.fp8_modes == ["accurate"]
    assert a.impls == ["ours", "flashmla"]
    d = profile_ncu.parse_args([])
    assert d.kv_dtype == "bf16" and d.fp8_modes == ["accurate", "fast"] and d.impls == ["ours"]
    for argv in (["--fp8-modes", "quick"], ["--impls", "triton"], ["--kv-dtype", "fp16"]):
        with pytest.raises(SystemExit):
            profile_ncu.parse_args(argv)


def test_bench_script_without_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the error without a GPU")
    res = subprocess.run([sys.executable, str(BENCHMARKS / "bench.py"), "--quick", "--out-dir", str(tmp_path / "o")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "needs a CUDA GPU" in res.stderr


# ---- FlashInfer as a peer ---------------------------------------------------------------------

def test_bf16_ceil():
    x = torch.tensor([1.0, 1.0 + 2 ** -20, 3.1e-3, 448.0, 1e-30], dtype=torch.float32)
    y = shapes.bf16_ceil(x)
    assert torch.equal(y.to(torch.bfloat16).float(), y) and bool((y >= x).all())
    assert y.tolist()[0] == 1.0 and y.tolist()[1] == 1.0 + 2 ** -7 and y.tolist()[3] == 448.0
    assert bool((y <= x * (1 + 2 ** -7)).all())


def test_flashinfer_csr_pages():
    from mla_bench import flashinfer_peer
    table = torch.tensor([[5, 9, 7], [3, 0, 0], [8, 2, 0], [1, 4, 6]], dtype=torch.int32)
    lens = torch.tensor([130, 0, 64, 129], dtype=torch.int32)           # 3, 0, 1, 3 pages of 64
    indptr, indices = flashinfer_peer.csr_pages(table, lens, 64)
    assert indptr.tolist() == [0, 3, 3, 4, 7] and indptr.dtype == torch.int32
    assert indices.tolist() == [5, 9, 7, 8, 1, 4, 6] and indices.dtype == torch.int32


def test_flashinfer_missing_is_one_clear_reason(monkeypatch, tmp_path):
    from mla_bench import flashinfer_peer
    if importlib_find("flashinfer"):
        pytest.skip("flashinfer is installed here")
    monkeypatch.setattr(flashinfer_peer, "_state", {})
    monkeypatch.setenv(flashinfer_peer.ENV_DIR, str(tmp_path))
    inputs = shapes.make_inputs(shapes.Shape(2, 64, 16), [64, 64], torch.bfloat16, CPU, seed=0, copies=1)
    ctx = impls.ShapeContext(shapes.Shape(2, 64, 16), [64, 64], inputs, torch.tensor([64, 64]), 64, 0.1, True,
                             torch.bfloat16, CPU, [], 132)
    with pytest.raises(flashinfer_peer.FlashInferMissing, match=f"no bundle at {tmp_path}.*--flashinfer-dir"):
        flashinfer_peer.load()
    with pytest.raises(flashinfer_peer.FlashInferMissing, match=f"no bundle at {tmp_path}"):
        flashinfer_peer.load()                                                     # the reason is kept
    with pytest.raises(impls.ImplUnavailable, match="runs on a CUDA device"):
        impls.ADAPTERS["flashinfer"](ctx)
    with pytest.raises(impls.ImplUnavailable, match="no e4m3 inputs"):
        impls.ADAPTERS["flashinfer-fp8"](ctx)
    ctx.dtype = torch.float16
    with pytest.raises(impls.ImplUnavailable, match="bf16 q"):
        impls.ADAPTERS["flashinfer"](ctx)


def test_flashinfer_bundle_digest_checked(monkeypatch, tmp_path):
    import tarfile
    from mla_bench import flashinfer_peer
    src = tmp_path / "src" / "site" / "flashinfer_probe_pkg"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("X = 1\n")
    with tarfile.open(tmp_path / "site.tar.xz", "w:xz") as tar:
        tar.add(tmp_path / "src" / "site", arcname="site")
    monkeypatch.setattr(flashinfer_peer.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "site.tar.xz.sha256").write_text("0" * 64 + "  site.tar.xz\n")
    with pytest.raises(flashinfer_peer.FlashInferMissing, match="differs from"):
        flashinfer_peer._unpack(str(tmp_path))
    (tmp_path / "site.tar.xz.sha256").unlink()
    root = flashinfer_peer._unpack(str(tmp_path))
    assert (Path(root) / "site" / "flashinfer_probe_pkg" / "__init__.py").read_text() == "X = 1\n"
    assert flashinfer_peer._unpack(str(tmp_path)) == root                      # unpacked once


def test_flashinfer_dir_argument(tmp_path, monkeypatch):
    from mla_bench import flashinfer_peer
    with pytest.raises(SystemExit):
        cli.parse_args(["--flashinfer-dir", str(tmp_path)])                        # no site.tar.xz there
    (tmp_path / "site.tar.xz").write_bytes(b"")
    monkeypatch.delenv(flashinfer_peer.ENV_DIR, raising=False)
    cli.parse_args(["--flashinfer-dir", str(tmp_path)])
    assert os.environ[flashinfer_peer.ENV_DIR] == str(tmp_path)
    assert flashinfer_peer.bundle_dir() == str(tmp_path)


def importlib_find(name):
    import importlib.util
    return importlib.util.find_spec(name) is not None
