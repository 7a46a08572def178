"""CPU tests of the FP8 pieces of the vLLM GPU integration tests (integration/): vllm_run.py's KV-scale functions
(what they compute, that they set every copy of a scale in place, that the amax recorders see only real tokens and
are removed again) and its option checks; the engine test's run names, log checks and the fp32 criterion for FP8
runs. No vLLM and no GPU needed: the layers are stand-ins with the attributes vLLM's MLAAttention has."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"
sys.path.insert(0, str(INTEGRATION))

import fp32_oracle  # noqa: E402
import vllm_run  # noqa: E402


def _load_engine_test():
    spec = importlib.util.spec_from_file_location("vllm_engine_test_under_cpu_test",
                                                  INTEGRATION / "test_vllm_engine_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


eng = _load_engine_test()

HEADS, NOPE, ROPE, LATENT = 4, 128, 64, 512


class FakeMLALayer(torch.nn.Module):
    """The attributes of vLLM's MLAAttention that vllm_run.py's scale functions use."""

    def __init__(self, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.qk_nope_head_dim, self.qk_rope_head_dim = NOPE, ROPE
        self.W_UK_T = torch.randn((HEADS, NOPE, LATENT), generator=gen) * 3 / NOPE ** 0.5  # absorbed q > q
        for name in ("_k_scale", "_v_scale", "_q_scale"):
            self.register_buffer(name, torch.tensor(1.0))
        self._k_scale_float = self._v_scale_float = self._q_scale_float = 1.0
        self._k_scale_cpu, self._v_scale_cpu = torch.tensor(1.0), torch.tensor(1.0)
        self.k_range, self.q_range = torch.tensor(200.0), torch.tensor(200.0)
        self.calls = []

    def forward_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, output_scale=None):
        self.calls.append((q.shape[0], attn_metadata, output_scale))
        return output


def _batch(t: int, seed: int, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((t, HEADS, NOPE + ROPE), generator=gen) * scale
    return q, torch.randn((t, LATENT), generator=gen) * scale, torch.randn((t, 1, ROPE), generator=gen) * 2 * scale


def _expected_amax(layer, q, kv_c, k_pe):
    ql = torch.einsum("thp,hpl->thl", q[..., :NOPE], layer.W_UK_T)
    decode_q = max(ql.abs().max().item(), q[..., NOPE:].abs().max().item())
    return [kv_c.abs().max().item(), k_pe.abs().max().item(), decode_q, q.abs().max().item()]


def test_latent_amax_measures_the_cached_values_and_the_absorbed_query():
    layer = FakeMLALayer(0)
    q, kv_c, k_pe = _batch(9, 1)
    got = vllm_run.latent_amax(layer, q, kv_c, k_pe)
    assert got.dtype == torch.float32 and got.shape == (4,)
    assert got.tolist() == pytest.approx(_expected_amax(layer, q, kv_c, k_pe), rel=1e-5)
    # the absorbed query is what a decode kernel reads: its amax is not the amax of q itself
    assert got[2].item() != pytest.approx(got[3].item(), rel=1e-2)


def test_scale_from_amax():
    assert vllm_run.scale_from_amax(448.0) == 1.0
    assert vllm_run.scale_from_amax(4.48) == pytest.approx(0.01)
    assert vllm_run.scale_from_amax(0.0) == 1.0              # nothing seen: keep the default
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError):
            vllm_run.scale_from_amax(bad)


def test_set_layer_scales_sets_every_copy_in_place():
    layer = FakeMLALayer(0)
    ptrs = {n: getattr(layer, n).data_ptr() for n in ("_k_scale", "_v_scale", "_q_scale")}
    vllm_run.set_layer_scales(layer, 0.05, 0.02)
    assert {n: getattr(layer, n).data_ptr() for n in ptrs} == ptrs      # captured CUDA graphs keep reading them
    assert layer._k_scale.item() == pytest.approx(0.05) and layer._v_scale.item() == pytest.approx(0.05)
    assert layer._q_scale.item() == pytest.approx(0.02)
    assert (layer._k_scale_float, layer._v_scale_float, layer._q_scale_float) == (0.05, 0.05, 0.02)
    assert layer._k_scale_cpu.item() == pytest.approx(0.05) and layer._v_scale_cpu.item() == pytest.approx(0.05)


def test_recorders_measure_real_tokens_then_set_the_scales(monkeypatch):
    layers = [("model.layers.0.self_attn.mla_attn", FakeMLALayer(0)), ("model.layers.1.self_attn.mla_attn",
                                                                       FakeMLALayer(1))]
    monkeypatch.setattr(vllm_run, "mla_layers", lambda model: layers)
    assert vllm_run.install_amax_recorders(object()) == [n for n, _ in layers]
    seen = {n: [0.0] * 4 for n, _ in layers}
    for step, (t, n_real) in enumerate([(16, 16), (12, 7), (5, 5)]):
        for name, layer in layers:
            q, kv_c, k_pe = _batch(t, 10 * step + len(name))
            q[n_real:] *= 1e4   # CUDA-graph padding past num_actual_tokens: must not count
            kv_c[n_real:] *= 1e4
            md = SimpleNamespace(num_actual_tokens=n_real)
            out = torch.empty(1)
            assert layer.forward_impl(q, kv_c, k_pe, None, md, output=out, output_scale="s") is out
            assert layer.calls[-1] == (t, md, "s")              # the original ran with every argument
            seen[name] = [max(a, b) for a, b in zip(seen[name], _expected_amax(layer, q[:n_real], kv_c[:n_real],
                                                                              k_pe[:n_real]))]
    for _, layer in layers:   # the profiling run: no metadata, nothing recorded, the original still runs
        q, kv_c, k_pe = _batch(4, 99, scale=1e4)
        layer.forward_impl(q, kv_c, k_pe, None, None, output=None)
        assert layer.calls[-1][1] is None
    got = vllm_run.apply_recorded_scales(object())
    for name, layer in layers:
        kv_c, k_pe, qa, qu = seen[name]
        c = got[name]
        measured = [c["kv_c_amax"], c["k_pe_amax"], c["q_amax"], c["q_unabsorbed_amax"]]
        assert measured == pytest.approx(seen[name], rel=1e-5)
        assert c["k"] == pytest.approx(max(kv_c, k_pe) / 448) and c["q"] == pytest.approx(qa / 448)
        assert layer._k_scale.item() == pytest.approx(c["k"]) and layer._q_scale_float == pytest.approx(c["q"])
        assert "forward_impl" not in vars(layer) and not hasattr(layer, "_calib_amax")   # the class's method again
    reported = vllm_run.read_kv_scales(object())
    assert reported[layers[0][0]]["k"] == pytest.approx(got[layers[0][0]]["k"])
    assert reported[layers[0][0]]["k_range"] == 200.0
    assert "2 MLA layers" in vllm_run.describe_scales(reported)


def test_describe_scales():
    assert vllm_run.describe_scales(None) == "not reported"
    ones = {"a": {"k": 1.0, "q": 1.0}, "b": {"k": 1.0, "q": 1.0}}
    assert vllm_run.describe_scales(ones).endswith("(all 1.0: the default)")
    mixed = {"a": {"k": 0.01, "q": 0.02}, "b": {"k": 0.03, "q": 0.005}}
    assert vllm_run.describe_scales(mixed) == "2 MLA layers, k_scale 0.01..0.03, q_scale 0.005..0.02"


@pytest.mark.parametrize("argv, words", [
    (["--calculate-kv-scales"], "only to an FP8 KV cache"),
    (["--kv-scales-from-prompts"], "only to an FP8 KV cache"),
    (["--kv-cache-dtype", "fp8", "--kv-scales-from-prompts", "--mtp", "2"], "does not combine with --mtp"),
])
def test_vllm_run_refuses_scale_options_that_cannot_work(argv, words):
    args = vllm_run.build_parser().parse_args(["--model", "m", "--backend", "CUSTOM", "--prompts", "p", "--out", "o"]
                                              + argv)
    assert words in vllm_run.check_args(args)


def test_vllm_run_accepts_fp8_options():
    base = ["--model", "m", "--backend", "CUSTOM", "--prompts", "p", "--out", "o", "--kv-cache-dtype", "fp8"]
    for extra in ([], ["--calculate-kv-scales"], ["--kv-scales-from-prompts", "--report-kv-scales"], ["--mtp", "2"]):
        assert vllm_run.check_args(vllm_run.build_parser().parse_args(base + extra)) is None
    with pytest.raises(SystemExit):
        vllm_run.build_parser().parse_args(base + ["--calculate-kv-scales", "--kv-scales-from-prompts"])


# ---- the engine test's helpers --------------------------------------------------------------------

def test_run_names():
    assert eng.run_name("CUSTOM") == "custom-graphs"                        # the bf16 names are unchanged
    assert eng.run_name("TRITON_MLA", tp=2) == "triton_mla-graphs-tp2"
    assert eng.run_name("CUSTOM", eager=True, broken=True) == "custom-eager-BROKEN"
    assert eng.run_name("CUSTOM", mtp=2) == "custom-graphs-mtp2"
    assert eng.run_name("CUSTOM", kv="fp8", mode="fast", mtp=2) == "custom-fp8-fast-graphs-mtp2"
    assert eng.run_name("FLASHMLA", kv="fp8", scales="calculated") == "flashmla-fp8-graphs-calc-scales"
    assert eng.run_name("CUSTOM", kv="fp8", mode="accurate", scales="prompts") == \
        "custom-fp8-accurate-graphs-prompt-scales"
    assert eng.run_name("CUSTOM", vllm_kernel=True) == "custom-graphs-vllm-kernel"
    for bad in (dict(backend="FLASHMLA", kv="fp8", mode="fast"), dict(backend="CUSTOM", kv="fp8"),
                dict(backend="CUSTOM", mode="fast"), dict(backend="FLASHMLA", scales="prompts"),
                dict(backend="FLASHMLA", kv="fp8", scales="other"), dict(backend="FLASHMLA", vllm_kernel=True),
                dict(backend="CUSTOM", kv="fp8", mode="accurate", vllm_kernel=True)):
        with pytest.raises(ValueError):
            eng.run_name(**bad)


OURS = "INFO [impl.py:90] flashmla_backend: MLA decode attention runs on flashmla_backend 0.4 (kernel 'sm90')"
DEFAULT = "WARNING flashmla_backend: FP8 KV cache with the default scale 1.0: the checkpoint carries no KV-cache scales"


def test_the_engine_tests_name_the_packages_fp8_modes():
    from flashmla_backend import engine_support

    assert eng.FP8_MODE_ENV == engine_support.FP8_MODE_ENV and eng.FP8_MODES == engine_support.FP8_MODES
    assert eng.DEFAULT_FP8_MODE == engine_support.DEFAULT_FP8_MODES["vllm"]   # what the serve tests expect in the log


def test_run_log_problems():
    f = eng.run_log_problems
    assert f("anything", "FLASHMLA", kv="fp8") == []
    assert f(OURS + ", 16 heads", "CUSTOM") == []
    assert f("nothing", "CUSTOM")[0].startswith("the log does not show")
    fp8_line = OURS + ", FP8 KV cache (e4m3), mode fast"
    assert f(f"{fp8_line}\n{DEFAULT}", "CUSTOM", kv="fp8", mode="fast") == []
    assert "mode accurate" in f(f"{fp8_line}\n{DEFAULT}", "CUSTOM", kv="fp8", mode="accurate")[0]
    assert "default scale" in f(fp8_line, "CUSTOM", kv="fp8", mode="fast")[0]
    assert f(fp8_line, "CUSTOM", kv="fp8", mode="fast", scales="calculated") == []   # not required then
    assert "16-bit run" in f(fp8_line, "CUSTOM")[0]
    assert "missing" in f(OURS, "CUSTOM", broken=True)[0]
    assert "present unasked" in f(OURS + "\nWARNING ... WRONG softmax scale (x1.5)", "CUSTOM")[0]
    assert f(OURS + "\nWARNING ... WRONG softmax scale (x1.5)", "CUSTOM", broken=True) == []
    hook = OURS + "\nWARNING flashmla_backend: FLASHMLA_BACKEND_DEBUG_VLLM_DECODE_KERNEL is set: " \
        "decode attention runs on vLLM's FlashMLA kernel, not on flashmla_backend's."
    assert f(hook, "CUSTOM", vllm_kernel=True) == []
    assert "ablation hook's warning is present unasked" in f(hook, "CUSTOM")[0]
    assert "ablation hook's warning is missing" in f(OURS, "CUSTOM", vllm_kernel=True)[0]


def test_all_default_scales():
    assert eng._all_default({"a": {"k": 1.0, "q": 1.0}})
    assert not eng._all_default({"a": {"k": 1.0, "q": 1.0}, "b": {"k": 0.5, "q": 1.0}})
    assert not eng._all_default(None) and not eng._all_default({})


def test_fp8_no_worse(capsys):
    assert fp32_oracle.fp8_no_worse("ours", 0.080, "ref", 0.080)
    assert fp32_oracle.fp8_no_worse("ours", 0.05 * 1.05 + 0.005, "ref", 0.05)
    assert not fp32_oracle.fp8_no_worse("ours", 0.05 * 1.05 + 0.0051, "ref", 0.05)
    assert not fp32_oracle.fp8_no_worse("broken", 1.09, "ref", 0.08)
    out = capsys.readouterr().out
    assert "ours mean |logprob - fp32| 0.0800 vs ref 0.0800 (+0.0 %)" in out and "-> WORSE" in out
    assert fp32_oracle.mean_error([0.1, 0.3]) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        fp32_oracle.mean_error([])


def _run(name, token_lists, lp=-1.0):
    return {"name": name, "outputs": [{"token_ids": t, "logprobs": [{str(x): lp} for x in t]} for t in token_lists]}


class _Oracle(fp32_oracle.Fp32Oracle):
    """fp32 logprob -1.0 + 0.01 * position for every token: a run reporting -1.0 is off by 0.01 * position."""

    def __init__(self):
        self.calls = 0

    def logprobs(self, i, tokens):
        self.calls += 1
        return (-1.0 + 0.01 * torch.arange(len(tokens), dtype=torch.float64)).view(-1, 1).expand(-1, 16).clone()


def test_prompt_errors_and_the_tokens_two_runs_share():
    oracle = _Oracle()
    a = _run("a", [[1, 2, 3, 4], [], [5, 6]])
    b = _run("b", [[1, 2, 7, 4], [3], [5, 6]], lp=-0.99)
    ea, eb = oracle.prompt_errors(a), oracle.prompt_errors(b)
    assert [len(x) for x in ea] == [4, 0, 2] and oracle.calls == 2 + 3   # no fp32 pass for an empty output
    assert ea[0] == pytest.approx([0.0, 0.01, 0.02, 0.03]) and eb[0] == pytest.approx([0.01, 0.0, 0.01, 0.02])
    assert oracle.run_error(a) == pytest.approx([0.0, 0.01, 0.02, 0.03, 0.0, 0.01])
    # prompt 0 shares two tokens (first difference at 2), prompt 1 none (a generated nothing), prompt 2 both
    xa, xb = fp32_oracle.shared_prefix_errors(a, b, ea, eb)
    assert xa == pytest.approx([0.0, 0.01, 0.0, 0.01]) and xb == pytest.approx([0.01, 0.0, 0.01, 0.0])


def test_engine_test_prints_the_shared_token_errors(monkeypatch, capsys):
    oracle = _Oracle()
    monkeypatch.setattr(eng, "_fp32_oracle", lambda checkpoint, prompts_file: oracle)
    monkeypatch.setattr(eng, "_fp32_errors", {})
    monkeypatch.setattr(eng, "_fp32_prompt_errors", {})
    monkeypatch.setattr(eng.torch.cuda, "empty_cache", lambda: None)
    a = _run("ours-x", [[1, 2, 3], [4, 5]])
    b = _run("ref-x", [[1, 9, 3], [4, 5]], lp=-0.98)
    ma, mb, n = eng.shared_prefix_fp32_errors(a, b, None, None)
    assert n == 3 and ma == pytest.approx(0.01 / 3) and mb == pytest.approx((0.02 + 0.02 + 0.01) / 3)
    assert eng.fp32_error(a, None, None) == pytest.approx((0.0 + 0.01 + 0.02 + 0.0 + 0.01) / 5)
    assert oracle.calls == 4   # each run's fp32 pass once, reused by fp32_error
    assert "the 3 tokens ours-x and ref-x share" in capsys.readouterr().out


# ---- the layer test's FP8 references --------------------------------------------------------------

def _load_layer_test():
    spec = importlib.util.spec_from_file_location("vllm_layer_test_under_cpu_test",
                                                  INTEGRATION / "test_vllm_layer_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # its dataclasses look the module up there
    spec.loader.exec_module(mod)
    return mod


def test_absorbed_form_reference_matches_the_mha_form():
    """The layer test's second reference (absorbed form, used for the e4m3 query) must equal its MHA-form reference
    for the same query and rows; the e4m3 query must be the absorbed one rounded, clamped at 448 x q_scale."""
    lt = _load_layer_test()
    heads, nope, v, latent = 4, lt.NOPE, lt.V_DIM, lt.LATENT
    gen = torch.Generator().manual_seed(3)
    w = torch.randn((heads * (nope + v), latent), generator=gen) / latent ** 0.5
    layer = SimpleNamespace(W_UK_T=w.view(heads, nope + v, latent)[:, :nope].contiguous())   # [H, nope, latent]
    query_lens, seq_lens = [1, 3, 2], [5, 40, 70]
    rows = [torch.randn((n, latent + lt.ROPE), generator=gen) for n in seq_lens]
    q = torch.randn((sum(query_lens), heads, nope + lt.ROPE), generator=gen) * 0.5
    batch = SimpleNamespace(case=SimpleNamespace(query_lens=query_lens), rows=rows, q=q)
    scale = lt._scale()
    mha = lt.Batch.reference(batch, w, scale, heads)
    absorbed = lt.latent_reference(batch, lt.absorbed_query(layer, q), rows, w, scale, heads)
    assert absorbed.shape == mha.shape == (sum(query_lens), heads * v)
    torch.testing.assert_close(absorbed, mha, atol=1e-5, rtol=1e-4)
    # causal: request 1 (3 query tokens: rows 1-3 of the output, 40 keys) sees its last key only from its last token
    rows_changed = [r.clone() for r in rows]
    rows_changed[1][-1] += 5
    changed = lt.latent_reference(batch, lt.absorbed_query(layer, q), rows_changed, w, scale, heads)
    assert torch.equal(changed[1:3], absorbed[1:3]) and not torch.allclose(changed[3], absorbed[3])
    assert torch.equal(changed[[0, 4, 5]], absorbed[[0, 4, 5]])

    exact = lt.absorbed_query(layer, q)
    for q_scale in (1.0, 0.01):
        q8 = lt.decode_query_e4m3(layer, q, q_scale)
        small = exact.abs() < 2 ** -6 * q_scale            # e4m3 subnormals: absolute, not relative, precision
        rel = ((q8 - exact).abs() / exact.abs().clamp_min(1e-30))[~small]
        assert rel.max() <= 1 / 16 + 1e-6 and rel.max() > 0       # rounded to 3 mantissa bits, not exact
    q8 = lt.decode_query_e4m3(layer, q * 1000, 1.0)
    assert q8.abs().max().item() == 448.0                  # saturates like vLLM's QuantFP8
    assert lt.errors(torch.ones(0), torch.ones(0)) == (0.0, 0.0)
    err = lt.errors(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0]))
    assert err[0] == 1.0 and err[1] == pytest.approx(1 / 2 ** 0.5)


# ---- SGLang's engine comparison of two FP8 runs (integration/sglang_run.py compare) ------------------------

def _sglang_run_file(tmp_path, name, kv, tokens):
    import json

    run = {"backend": name, "options": {"kv_cache_dtype": kv} if kv else {},
           "outputs": [{"token_ids": t, "logprobs": [{str(x): -0.5} for x in t]} for t in tokens]}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(run))
    return str(path)


@pytest.mark.parametrize("ours_err,expect,rc", [(0.10, "agree", 0), (0.30, "agree", 1), (0.30, "disagree", 0)])
def test_sglang_fp8_runs_are_judged_by_the_fp32_distance(tmp_path, monkeypatch, ours_err, expect, rc):
    """Two FP8 runs that part early (as two correct FP8 engines do) are judged only by mean |logprob - fp32|."""
    import sglang_run

    class Oracle:
        def __init__(self, model_dir, prompts):
            pass

        def run_error(self, run):
            return [ours_err if run["backend"] == "ours" else 0.12] * 4

    monkeypatch.setattr(fp32_oracle, "Fp32Oracle", Oracle)
    ours = _sglang_run_file(tmp_path, "ours", "fp8_e4m3", [[5, 6, 7, 8]])
    ref = _sglang_run_file(tmp_path, "triton", "fp8_e4m3", [[5, 9, 9, 9]])  # parts at the second token
    (tmp_path / "prompts.json").write_text("[[1, 2, 3]]")
    args = SimpleNamespace(ours=ours, ref=ref, tie_gap_from=None, fp32_model="unused", expect=expect,
                           prompts=str(tmp_path / "prompts.json"), min_accept_ratio=None)
    assert sglang_run.compare(args) == rc
