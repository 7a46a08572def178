"""CPU tests of integration/bench_vllm_throughput.py, the vLLM engine benchmark: config parsing, the alternating order,
the engine environment and log checks, the capacity arithmetic and log parsing, the statistics and Markdown tables,
merging results files, and the driver loop with engine processes stood in for (no vLLM, no GPU)."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"


def _load():
    sys.path.insert(0, str(INTEGRATION))
    spec = importlib.util.spec_from_file_location("bench_vllm_throughput", INTEGRATION / "bench_vllm_throughput.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


bench = _load()
Config = bench.Config


# ---- configs ------------------------------------------------------------------------------------

def test_parse_config_forms():
    assert bench.parse_config("CUSTOM") == Config("CUSTOM", "auto", None)
    assert bench.parse_config("custom", "fp8") == Config("CUSTOM", "fp8", "fast")   # the plugin's default mode
    assert bench.parse_config("CUSTOM:fp8:fast") == Config("CUSTOM", "fp8", "fast")
    assert bench.parse_config("FLASHMLA:fp8") == Config("FLASHMLA", "fp8", None)
    assert bench.parse_config("FLASHMLA:auto", "fp8") == Config("FLASHMLA", "auto", None)  # explicit beats default
    assert bench.parse_config(" flash_attn_mla : FP8 ") == Config("FLASH_ATTN_MLA", "fp8", None)
    assert Config("CUSTOM", "fp8", "fast").label == "CUSTOM:fp8:fast"
    assert Config("FLASHMLA", "auto").label == "FLASHMLA:auto"
    assert Config("FLASH_ATTN_MLA", "fp8").slug == "flash-attn-mla-fp8"


@pytest.mark.parametrize("item, words", [
    ("FLASHMLA:fp8:fast", "only to CUSTOM with an fp8"),
    ("CUSTOM:auto:fast", "only to CUSTOM with an fp8"),
    ("CUSTOM:fp8:quick", "mode 'quick'"),
    ("CUSTOM:fp16", "KV-cache dtype 'fp16'"),
    ("CUSTOM:fp8:fast:x", "BACKEND[:KVDTYPE[:MODE]]"),
    ("CUSTOM::fast", "BACKEND[:KVDTYPE[:MODE]]"),
    (":fp8", "BACKEND[:KVDTYPE[:MODE]]"),
    ("FLASH-MLA", "not a vLLM backend name"),
])
def test_parse_config_refusals(item, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        bench.parse_config(item)


def test_parse_configs_list_and_duplicates():
    got = bench.parse_configs("CUSTOM:fp8:accurate,CUSTOM:fp8:fast,FLASHMLA:fp8,CUSTOM:auto,FLASHMLA:auto")
    assert [c.label for c in got] == ["CUSTOM:fp8:accurate", "CUSTOM:fp8:fast", "FLASHMLA:fp8", "CUSTOM:auto",
                                      "FLASHMLA:auto"]
    with pytest.raises(ValueError, match="given twice: CUSTOM:fp8:fast"):
        bench.parse_configs("CUSTOM:fp8,CUSTOM:fp8:fast")    # the same config, spelled twice
    with pytest.raises(ValueError, match="no configs"):
        bench.parse_configs(" , ")


def _args(argv):
    return bench.build_parser().parse_args(argv)


def test_backends_is_the_shorthand_with_the_global_kv_dtype():
    assert [c.label for c in bench.resolve(_args([]))] == ["CUSTOM:auto", "FLASHMLA:auto", "FLASH_ATTN_MLA:auto",
                                                           "TRITON_MLA:auto"]
    assert [c.label for c in bench.resolve(_args(["--backends", "CUSTOM,FLASHMLA", "--kv-cache-dtype", "fp8"]))] == \
        ["CUSTOM:fp8:fast", "FLASHMLA:fp8"]
    assert [c.label for c in bench.resolve(_args(["--configs", "CUSTOM,FLASHMLA:auto", "--kv-cache-dtype", "fp8"]))] \
        == ["CUSTOM:fp8:fast", "FLASHMLA:auto"]
    assert [c.label for c in bench.resolve(_args(["--capacity"]))] == ["CUSTOM:fp8:fast", "CUSTOM:auto"]


@pytest.mark.parametrize("argv, words", [
    (["--configs", "CUSTOM", "--backends", "FLASHMLA"], "not both"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--output-len", "1"], "at least 2"),
    (["--kv-cache-memory-bytes", "1000"], "belongs to --capacity"),
    (["--dcp", "0"], "--dcp must be at least 1"),
    (["--dcp", "-2"], "--dcp must be at least 1"),
    (["--dcp", "2", "--capacity"], "--dcp does not combine with --capacity"),
])
def test_resolve_refusals(argv, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        bench.resolve(_args(argv))


def test_main_reports_bad_options_as_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--configs", "FLASHMLA:fp8:fast", "--dry-run"])
    assert e.value.code == 2 and "only to CUSTOM" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--kv-cache-dtype", "fp16", "--dry-run"])


def test_round_orders_alternate():
    a, b, c = (Config(x) for x in "ABC")
    assert bench.round_orders([a, b, c], 3) == [(1, a), (1, b), (1, c), (2, c), (2, b), (2, a), (3, a), (3, b), (3, c)]
    assert bench.round_orders([a, b], 1, first_round=2) == [(2, b), (2, a)]    # round 2 of a split run: reversed
    assert bench.round_orders([a], 2) == [(1, a), (2, a)]


def test_config_env_sets_the_mode_only_for_custom_fp8():
    base = {"PATH": "/bin", bench.FP8_MODE_ENV: "fast"}     # a user's setting does not leak into other configs
    assert bench.config_env(Config("CUSTOM", "fp8", "accurate"), base)[bench.FP8_MODE_ENV] == "accurate"
    assert bench.config_env(Config("CUSTOM", "fp8", "fast"), base)[bench.FP8_MODE_ENV] == "fast"
    for cfg in (Config("CUSTOM", "auto"), Config("FLASHMLA", "fp8")):
        env = bench.config_env(cfg, base)
        assert bench.FP8_MODE_ENV not in env and env["PATH"] == "/bin"
    assert base[bench.FP8_MODE_ENV] == "fast"                # the base is not modified


OURS = "INFO [impl.py:88] flashmla_backend: MLA decode attention runs on flashmla_backend 0.4 (kernel 'sm90' on H100)"


def test_custom_log_problem():
    fp8_fast = Config("CUSTOM", "fp8", "fast")
    assert bench.custom_log_problem("nothing", Config("FLASHMLA", "fp8")) is None        # not ours: not checked
    assert "does not show flashmla_backend" in bench.custom_log_problem("INFO started", Config("CUSTOM"))
    assert bench.custom_log_problem(OURS + ", 16 heads", Config("CUSTOM")) is None
    assert bench.custom_log_problem(f"{OURS}, FP8 KV cache (e4m3), mode fast\n", fp8_fast) is None
    assert "mode fast" in bench.custom_log_problem(f"{OURS}, FP8 KV cache (e4m3), mode accurate\n", fp8_fast)
    assert "FP8 KV cache" in bench.custom_log_problem(f"{OURS}, mode fast\n", fp8_fast)
    assert "16-bit run" in bench.custom_log_problem(f"{OURS}, FP8 KV cache, mode accurate", Config("CUSTOM"))


# ---- sparse models (DeepSeek-V3.2) ----------------------------------------------------------------

V32 = str(INTEGRATION / "models" / "tiny-deepseek-v32-h128-8layer")
OURS_SPARSE = ("INFO [sparse_impl.py:86] flashmla_backend: sparse MLA attention (DeepSeek-V3.2 indexer) runs on "
               "flashmla_backend 0.1.0 (the Hopper sparse decode kernel, ...), 128 heads per rank, scale 0.07, KV cache "
               "fp8_ds_mla (656-byte tokens).")


def test_the_env_names_are_the_packages():
    from flashmla_backend._env import SPARSE_GPU_ENV

    assert bench.SPARSE_GPU_ENV == SPARSE_GPU_ENV
    assert bench.FP8_MODE_ENV == "FLASHMLA_BACKEND_FP8_MODE"
    from flashmla_backend.engine_support import DEFAULT_FP8_MODES

    assert bench.DEFAULT_FP8_MODE == DEFAULT_FP8_MODES["vllm"]


def test_a_v32_model_runs_the_sparse_configs():
    assert bench.is_sparse_model(V32) and not bench.is_sparse_model(str(bench.MODEL_DIR))
    assert [c.label for c in bench.resolve(_args(["--model", V32, "--configs", "CUSTOM:auto,FLASHMLA_SPARSE:auto"]))] \
        == ["CUSTOM:auto", "FLASHMLA_SPARSE:auto"]
    configs = bench.resolve(_args(["--model", V32]))
    assert [c.label for c in configs] == ["CUSTOM:fp8", "FLASHMLA_SPARSE:fp8"] and all(c.sparse for c in configs)
    assert [c.label for c in bench.resolve(_args(["--model", V32, "--backends", "CUSTOM,FLASHMLA_SPARSE",
                                                  "--kv-cache-dtype", "fp8"]))] == ["CUSTOM:fp8", "FLASHMLA_SPARSE:fp8"]


@pytest.mark.parametrize("argv, words", [
    (["--configs", "CUSTOM:fp8:fast"], "no FP8 query modes"),
    (["--capacity"], "no --capacity or --dcp"),
    (["--dcp", "2"], "no --capacity or --dcp"),
])
def test_a_v32_model_refuses_what_its_sparse_backend_cannot_run(argv, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        bench.resolve(_args(["--model", V32] + argv))


def test_an_unreadable_model_is_named(tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"--model {tmp_path}: cannot read")):
        bench.resolve(_args(["--model", str(tmp_path)]))


def test_sparse_env_and_log_check():
    ours, theirs = Config("CUSTOM", "fp8", sparse=True), Config("FLASHMLA_SPARSE", "fp8", sparse=True)
    base = {"PATH": "/bin", bench.SPARSE_GPU_ENV: "1", bench.FP8_MODE_ENV: "fast"}
    assert bench.config_env(ours, base)[bench.SPARSE_GPU_ENV] == "1" and bench.FP8_MODE_ENV not in bench.config_env(
        ours, base)
    assert bench.SPARSE_GPU_ENV not in bench.config_env(theirs, base)     # only our backend reads it
    assert bench.SPARSE_GPU_ENV not in bench.config_env(Config("CUSTOM", "fp8", "accurate"), base)   # dense model
    assert bench.custom_log_problem(OURS_SPARSE, ours) is None
    assert "sparse attention on the fp8_ds_mla cache" in bench.custom_log_problem(OURS, ours)   # the dense line only
    assert "sparse attention" in bench.custom_log_problem(OURS_SPARSE.replace("fp8_ds_mla", "bfloat16"), ours)
    # the bf16 cache (CUSTOM:auto): the plugin's line names it "auto (16-bit)"
    wide = Config("CUSTOM", "auto", sparse=True)
    ours_wide = OURS_SPARSE.replace("fp8_ds_mla (656-byte tokens)", "auto (16-bit)")
    assert bench.custom_log_problem(ours_wide, wide) is None
    assert "on the (16-bit) cache" in bench.custom_log_problem(OURS_SPARSE, wide)
    assert "on the fp8_ds_mla cache" in bench.custom_log_problem(ours_wide, ours)
    assert bench.custom_log_problem("nothing", theirs) is None


# ---- capacity -----------------------------------------------------------------------------------

def test_capacity_bytes_hold_the_batch_in_fp8_and_about_half_in_bf16():
    layers = bench.model_layers(str(bench.MODEL_DIR))
    assert layers == 8
    need = bench.batch_tokens(64, 7000, 2049)
    assert need == 64 * 9049
    kv = bench.capacity_kv_bytes(64, 7000, 2049, layers)
    fp8_tokens = kv // (layers * 576)
    bf16_tokens = kv // (layers * 1152)
    # vLLM allocates whole blocks (up to 256 tokens) per request and one null block: the FP8 cache must still hold all.
    per_request_blocks = -(-9049 // 256)
    assert fp8_tokens // 256 >= 64 * per_request_blocks + 1
    assert 0.45 * need < bf16_tokens < 0.6 * need      # clearly fewer than the batch needs
    assert bench.capacity_kv_bytes(64, 7000, 2049, layers, headroom=1.0) < kv


def test_parse_kv_capacity_reads_vllm_026_lines():
    log = ("(EngineCore pid=41) INFO 11-25 10:02:11 [kv_cache_utils.py:2177] GPU KV cache size: 309,632 tokens\n"
           "(EngineCore pid=41) INFO 11-25 10:02:11 [kv_cache_utils.py:2179] Maximum concurrency for 9,113 tokens "
           "per request: 33.98x\n")
    assert bench.parse_kv_capacity(log) == {"kv_tokens": 309632, "concurrency_tokens_per_request": 9113,
                                            "max_concurrency": 33.98}
    assert bench.parse_kv_capacity("no such lines") == {"kv_tokens": None, "concurrency_tokens_per_request": None,
                                                        "max_concurrency": None}
    cap = bench.capacity_of("nothing logged", {"kv_cache_size_tokens": 1000, "kv_cache_max_concurrency": 0.5})
    assert cap["kv_tokens"] == 1000 and cap["source"] == "cache_config" and cap["max_concurrency"] == 0.5


# ---- statistics and tables ----------------------------------------------------------------------

def _m(config, rate, rnd=1, **kw):
    return dict({"config": config, "round": rnd, "decode_tok_s": rate}, **kw)


def test_summarize_and_versus():
    ms = [_m("A", 100), _m("A", 110), _m("A", 90, 2), _m("B", 200), _m("B", 210), _m("C", 105), _m("C", 120),
          _m("D", 150)]
    stats = bench.summarize(ms, ["A", "B", "C", "D", "E"])
    assert stats["A"] == {"n": 3, "min": 90, "median": 100, "max": 110}
    assert "E" not in stats
    assert bench.versus(stats, "B", "A") == "2.050x, apart"
    assert bench.versus(stats, "C", "A") == "1.125x, overlap"
    assert bench.versus(stats, "A", "A") == "1.000x (ref)"
    assert bench.versus(stats, "D", "A") == "1.500x, no spread"      # one measurement: no range to compare
    assert bench.versus(stats, "A", "E") == "-"


def _results(measurements, kind="throughput", **meta):
    base = {"date": "2026-11-25 10:00 UTC", "command": "python integration/bench_vllm_throughput.py --rounds 2",
            "git": "abc1234", "model": "tiny-deepseek-v3-h128-8layer", "num_prompts": 64, "prompt_len": 7000,
            "output_len": 2049, "rounds": 2, "repeats": 2, "kv_cache_memory_bytes": None, "need_tokens": None,
            "configs": list(dict.fromkeys(m["config"] for m in measurements))}
    base.update(meta)
    runs = dict.fromkeys((m["config"], m["round"]) for m in measurements)
    procs = [{"config": c, "round": r, "gpu": "NVIDIA H100 80GB HBM3", "vllm_version": "0.26.0",
              "torch_version": "2.11.0+cu130"} for c, r in runs]
    return {"kind": kind, "meta": base, "processes": procs, "measurements": measurements, "failures": []}


def _rows(table: str) -> dict[str, list[str]]:
    rows = {}
    for line in table.splitlines():
        if line.startswith("| ") and not line.startswith("| config"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells
    return rows


def test_throughput_table():
    ms = [_m("CUSTOM:fp8:accurate", v, r, t_1=t) for v, r, t in ((15000, 1, 5.0), (15200, 1, 5.2), (14900, 2, 5.4),
                                                                  (15100, 2, 9.0))]
    ms += [_m("FLASHMLA:fp8", v, r) for v, r in ((14000, 1), (14200, 1), (14100, 2), (13900, 2))]
    ms += [_m("CUSTOM:auto", v, r) for v, r in ((12000, 1), (15000, 1), (12500, 2), (12600, 2))]
    table = bench.throughput_table(_results(ms))
    assert "GPU NVIDIA H100 80GB HBM3; vLLM 0.26.0" in table and "2026-11-25" in table
    assert "`python integration/bench_vllm_throughput.py --rounds 2`" in table
    assert "2048 decode steps" in table and "2 rounds" in table
    header = next(line for line in table.splitlines() if line.startswith("| config"))
    assert header.count("|") == 10 and "vs FLASHMLA:fp8" in header and "vs CUSTOM:auto" in header
    assert "t(1) s (median)" in header
    rows = _rows(table)
    acc = rows["CUSTOM:fp8:accurate"]
    assert acc[1:5] == ["4", "14,900", "15,050", "15,200"]
    assert acc[5] == f"{64e3 / 15050:.3f}"                               # ms per step at the median
    assert acc[6] == "5.30"                                              # the prefill time t(1), median of four
    assert rows["FLASHMLA:fp8"][6] == "-"                                 # measurements without t(1)
    assert acc[7] == f"{15050 / 14050:.3f}x, apart"
    assert acc[8] == f"{15050 / 12550:.3f}x, overlap"                    # CUSTOM:auto's range reaches 15,000
    assert rows["FLASHMLA:fp8"][7] == "1.000x (ref)"
    assert all(line.count("|") == 10 for line in table.splitlines() if line.startswith("|"))


def test_throughput_table_without_references_and_with_failures():
    res = _results([_m("TRITON_MLA:auto", 3000), _m("TRITON_MLA:auto", 3100)])
    res["failures"] = [{"config": "CUSTOM:auto", "round": 1, "why": "[bench-r1-custom-auto] exited 1"}]
    table = bench.throughput_table(res)
    assert "vs " not in table.split("| config", 1)[1].splitlines()[0]
    assert "FAILED: CUSTOM:auto (round 1): [bench-r1-custom-auto] exited 1" in table


def test_capacity_table():
    need = 64 * 9049
    ms = [_m("CUSTOM:fp8:accurate", 20000, e2e_tok_s=9000, preemptions=0.0),
          _m("CUSTOM:fp8:accurate", 20400, e2e_tok_s=9100, preemptions=0.0),
          _m("CUSTOM:auto", 5000, e2e_tok_s=4000, preemptions=30.0),
          _m("CUSTOM:auto", 5200, e2e_tok_s=4100, preemptions=34.0)]
    res = _results(ms, kind="capacity", kv_cache_memory_bytes=2853808128, need_tokens=need)
    for p in res["processes"]:
        fp8 = p["config"].startswith("CUSTOM:fp8")
        p["capacity"] = {"kv_tokens": 619264 if fp8 else 309632, "max_concurrency": 67.95 if fp8 else 33.98,
                         "concurrency_tokens_per_request": 9113}
    table = bench.render(res)
    assert "kv_cache_memory_bytes 2,853,808,128 (2.66 GiB)" in table and f"needs {need:,} tokens" in table
    rows = _rows(table)
    assert rows["CUSTOM:fp8:accurate"][1:4] == ["619,264", "yes", "67.95x for 9,113"]
    assert rows["CUSTOM:auto"][1:3] == ["309,632", f"no ({309632 / need:.0%})"]
    assert rows["CUSTOM:auto"][4] == "32" and rows["CUSTOM:fp8:accurate"][4] == "0"
    assert rows["CUSTOM:fp8:accurate"][5] == "20,200 [20,000, 20,400]"
    assert rows["CUSTOM:fp8:accurate"][7] == f"{20200 / 5100:.3f}x, apart"
    assert "not the speed of a decode step" in table


def test_merge_results_joins_rounds_and_refuses_other_shapes():
    r1 = _results([_m("A", 100), _m("B", 200)])
    r2 = _results([_m("B", 210, 2), _m("A", 95, 2)])
    r2["meta"]["command"] = "second"
    merged = bench.merge_results([r1, r2])
    assert bench.summarize(merged["measurements"], ["A"])["A"]["n"] == 2
    assert merged["meta"]["configs"] == ["A", "B"] and " + second" in merged["meta"]["command"]
    other = _results([_m("A", 1)], prompt_len=100)
    with pytest.raises(ValueError, match="different runs"):
        bench.merge_results([r1, other])


def test_table_from_prints_the_merged_table(tmp_path, capsys):
    paths = []
    for i, ms in enumerate(([_m("CUSTOM:auto", 100), _m("FLASHMLA:fp8", 120)],
                            [_m("FLASHMLA:fp8", 118, 2), _m("CUSTOM:auto", 104, 2)])):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(_results(ms)))
    assert bench.main(["--table-from"] + [str(p) for p in paths]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["CUSTOM:auto"][1:5] == ["2", "100", "102", "104"]


# ---- the driver, with engine processes stood in for -----------------------------------------------

class FakeEngines:
    """Stands in for harness.run_logged: writes the worker's JSON as the engine process would and returns a log."""

    def __init__(self, rates: dict[str, float], bad_log: str | None = None, crash: str | None = None):
        self.rates, self.bad_log, self.crash, self.calls = rates, bad_log, crash, []

    def __call__(self, name, cmd, env, timeout_s):
        label = cmd[cmd.index("--worker") + 1]
        out = Path(cmd[cmd.index("--worker-out") + 1])
        repeats = int(cmd[cmd.index("--repeats") + 1])
        self.calls.append((name, label, env.get(bench.FP8_MODE_ENV), "--kv-cache-memory-bytes" in cmd))
        if label == self.crash:
            raise bench.harness.RunFailed(f"[{name}] exited 1 after 3 s; log: x\nTraceback")
        rate = self.rates[label]
        out.write_text(json.dumps({
            "config": label, "vllm_version": "0.26.0", "torch_version": "2.11.0+cu130", "gpu": "NVIDIA H100",
            "init_s": 40.0, "cache_config": {"kv_cache_size_tokens": None},
            "measurements": [{"repeat": k + 1, "t_1": 3.0, "t_n": 3.0 + 64 * 2048 / (rate + k), "decode_s":
                              64 * 2048 / (rate + k), "decode_tok_s": rate + k, "ms_per_step": 1.0, "e2e_tok_s": 1.0,
                              "preemptions": None} for k in range(repeats)]}))
        cfg = bench.parse_config(label)
        log = "INFO loading\n"
        if cfg.backend == "CUSTOM" and label != self.bad_log:
            log += OURS + (f", FP8 KV cache, mode {cfg.mode}" if cfg.fp8 else "") + "\n"
        if "--kv-cache-memory-bytes" in cmd:
            tokens = 619264 if cfg.fp8 else 309632
            log += f"INFO GPU KV cache size: {tokens:,} tokens\nINFO Maximum concurrency for 9,113 tokens per " \
                   f"request: {tokens / 9113:.2f}x\n"
        return log


@pytest.fixture
def driver(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.harness, "RUN_DIR", tmp_path)
    monkeypatch.setattr(bench.harness, "engine_env", lambda extra=None: {"PATH": "/bin"})
    monkeypatch.setattr(bench, "git_describe", lambda: "abc1234")

    def run(fake, argv):
        monkeypatch.setattr(bench.harness, "run_logged", fake)
        rc = bench.main(argv)
        return rc, json.loads((tmp_path / ("bench-capacity.json" if "--capacity" in argv else "bench.json"))
                              .read_text())
    return run


def test_driver_runs_each_config_in_alternating_order(driver, capsys):
    fake = FakeEngines({"CUSTOM:fp8:accurate": 15000, "CUSTOM:fp8:fast": 16000, "FLASHMLA:fp8": 14000,
                        "CUSTOM:auto": 12000})
    rc, res = driver(fake, ["--configs", "CUSTOM:fp8:accurate,CUSTOM:fp8:fast,FLASHMLA:fp8,CUSTOM:auto",
                            "--rounds", "2", "--repeats", "2"])
    assert rc == 0
    assert [(c[1], c[2]) for c in fake.calls] == [
        ("CUSTOM:fp8:accurate", "accurate"), ("CUSTOM:fp8:fast", "fast"), ("FLASHMLA:fp8", None), ("CUSTOM:auto", None),
        ("CUSTOM:auto", None), ("FLASHMLA:fp8", None), ("CUSTOM:fp8:fast", "fast"), ("CUSTOM:fp8:accurate", "accurate")]
    assert [c[0] for c in fake.calls][:2] == ["bench-r1-custom-fp8-accurate", "bench-r1-custom-fp8-fast"]
    assert len(res["measurements"]) == 4 * 2 * 2 and not res["failures"]
    assert {m["round"] for m in res["measurements"] if m["config"] == "FLASHMLA:fp8"} == {1, 2}
    out = capsys.readouterr().out
    assert "plan: 8 engine processes" in out and "process 8/8: round 2 (reversed order), CUSTOM:fp8:accurate" in out
    rows = _rows(out)
    assert rows["CUSTOM:fp8:accurate"][1] == "4" and rows["CUSTOM:fp8:accurate"][7].endswith("apart")
    assert res["meta"]["git"] == "abc1234" and res["meta"]["output_len"] == 2049


def test_driver_records_failures_and_wrong_logs(driver, capsys):
    fake = FakeEngines({"CUSTOM:fp8:fast": 15000, "FLASHMLA:fp8": 14000, "CUSTOM:auto": 1},
                       bad_log="CUSTOM:fp8:fast", crash="CUSTOM:auto")
    rc, res = driver(fake, ["--configs", "CUSTOM:fp8,FLASHMLA:fp8,CUSTOM:auto", "--repeats", "1"])
    assert rc == 1
    why = {f["config"]: f["why"] for f in res["failures"]}
    assert "does not show flashmla_backend" in why["CUSTOM:fp8:fast"] and "exited 1" in why["CUSTOM:auto"]
    assert {m["config"] for m in res["measurements"]} == {"FLASHMLA:fp8"}
    assert "FAILED: CUSTOM:auto" in capsys.readouterr().out


def test_driver_capacity_run(driver, capsys):
    fake = FakeEngines({"CUSTOM:fp8:fast": 20000, "CUSTOM:auto": 5000})
    rc, res = driver(fake, ["--capacity", "--repeats", "2"])
    assert rc == 0 and all(c[3] for c in fake.calls)
    assert res["kind"] == "capacity" and res["meta"]["need_tokens"] == 64 * 9049
    assert res["meta"]["kv_cache_memory_bytes"] == bench.capacity_kv_bytes(64, 7000, 2049, 8)
    caps = {p["config"]: p["capacity"] for p in res["processes"]}
    assert caps["CUSTOM:auto"]["kv_tokens"] == 309632 and caps["CUSTOM:fp8:fast"]["source"] == "log"
    rows = _rows(capsys.readouterr().out)
    assert rows["CUSTOM:fp8:fast"][2] == "yes" and rows["CUSTOM:auto"][2].startswith("no (")


def test_dry_run_starts_nothing(driver, tmp_path, monkeypatch, capsys):
    def refuse(*a, **k):
        raise AssertionError("an engine process was started")

    monkeypatch.setattr(bench.harness, "run_logged", refuse)
    assert bench.main(["--dry-run", "--configs", "CUSTOM:fp8,FLASHMLA:fp8", "--rounds", "3"]) == 0
    out = capsys.readouterr().out
    assert "plan: 6 engine processes (2 configs x 3 rounds" in out
    assert re.search(r"6\. round 3: FLASHMLA:fp8", out) and not (tmp_path / "bench.json").exists()


# ---- decode context parallelism (--dcp) -----------------------------------------------------------

def test_dcp_zero_is_a_usage_error_naming_the_option(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--dcp", "0", "--dry-run"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--dcp must be at least 1" in err and "got 0" in err


def test_dcp_needs_as_many_gpus_outside_dry_run(driver, monkeypatch, capsys):
    def refuse(*a, **k):
        raise AssertionError("an engine process was started")

    monkeypatch.setattr(bench.harness, "run_logged", refuse)
    monkeypatch.setattr(bench, "visible_cuda_devices", lambda: 1)
    with pytest.raises(SystemExit) as e:
        bench.main(["--dcp", "2", "--configs", "CUSTOM:auto,FLASHMLA:auto"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--dcp 2 needs 2 CUDA devices" in err and "device_count() is 1" in err
    # --dry-run does not look at the GPUs
    monkeypatch.setattr(bench, "visible_cuda_devices", lambda: 0)
    assert bench.main(["--dcp", "2", "--dry-run"]) == 0


def test_dcp_dry_run_plan_names_the_dcp_size(driver, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench.harness, "run_logged", lambda *a, **k: pytest.fail("an engine process was started"))
    assert bench.main(["--dry-run", "--dcp", "2", "--configs", "CUSTOM:auto,FLASHMLA:auto", "--rounds", "4"]) == 0
    out = capsys.readouterr().out
    assert "plan: 8 engine processes (2 configs x 4 rounds" in out
    assert "tensor_parallel_size 2 + decode_context_parallel_size 2, on 2 GPUs" in out
    assert re.search(r"1\. round 1: CUSTOM:auto \(DCP 2\)", out)
    assert re.search(r"8\. round 4: CUSTOM:auto \(DCP 2\)", out)
    assert re.search(r"3\. round 2: FLASHMLA:auto \(DCP 2\)", out)          # the order still alternates
    assert bench.main(["--dry-run", "--configs", "CUSTOM:auto"]) == 0
    assert "DCP" not in capsys.readouterr().out                             # default: off, plan as before


def test_custom_log_problem_with_dcp():
    dcp_line = f"{OURS}, KV cache auto, decode context parallelism (rank 1 of its DCP group: attends its share)"
    assert bench.custom_log_problem(dcp_line, Config("CUSTOM"), 2) is None
    assert "decode context parallelism" in bench.custom_log_problem(OURS + ", KV cache auto", Config("CUSTOM"), 2)
    assert bench.custom_log_problem(OURS + ", KV cache auto", Config("CUSTOM"), 1) is None
    assert bench.custom_log_problem("nothing", Config("FLASHMLA"), 2) is None


def test_driver_with_dcp_records_the_size_and_passes_it_to_the_engines(driver, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "visible_cuda_devices", lambda: 2)
    seen = []

    class DcpEngines(FakeEngines):
        def __call__(self, name, cmd, env, timeout_s):
            seen.append(cmd[cmd.index("--dcp") + 1])
            log = super().__call__(name, cmd, env, timeout_s)
            return log.replace(OURS, OURS + ", decode context parallelism (rank 0 of its DCP group)")

    fake = DcpEngines({"CUSTOM:auto": 24000, "FLASHMLA:auto": 22000})
    monkeypatch.setattr(bench.harness, "run_logged", fake)
    rc = bench.main(["--dcp", "2", "--configs", "CUSTOM:auto,FLASHMLA:auto", "--rounds", "2", "--repeats", "2"])
    assert rc == 0 and seen == ["2"] * 4
    res = json.loads((tmp_path / "bench-dcp2.json").read_text())      # not bench.json: a DCP 1 run's file stays
    assert [c[1] for c in fake.calls] == ["CUSTOM:auto", "FLASHMLA:auto", "FLASHMLA:auto", "CUSTOM:auto"]
    assert [c[0] for c in fake.calls][0] == "bench-r1-custom-auto-dcp2"
    assert res["meta"]["dcp"] == 2 and res["meta"]["tensor_parallel_size"] == 2
    assert all(r["dcp"] == 2 for r in res["measurements"] + res["processes"]) and len(res["measurements"]) == 8
    out = capsys.readouterr().out
    assert "DCP 2 for every config" in out
    rows = _rows(out)
    assert rows["CUSTOM:auto (DCP 2)"][1] == "4"
    assert rows["FLASHMLA:auto (DCP 2)"][7].startswith(f"{22000.5 / 24000.5:.3f}x")    # against ours at DCP 2


def test_driver_with_dcp_fails_a_custom_run_without_dcp_in_its_log(driver, monkeypatch):
    monkeypatch.setattr(bench, "visible_cuda_devices", lambda: 4)
    monkeypatch.setattr(bench.harness, "run_logged", FakeEngines({"CUSTOM:auto": 1, "FLASHMLA:auto": 2}))
    assert bench.main(["--dcp", "2", "--configs", "CUSTOM:auto,FLASHMLA:auto", "--repeats", "1"]) == 1
    res = json.loads((bench.harness.RUN_DIR / "bench-dcp2.json").read_text())
    assert [(f["config"], f["dcp"]) for f in res["failures"]] == [("CUSTOM:auto", 2)]
    assert "decode context parallelism" in res["failures"][0]["why"]
    assert "FAILED: CUSTOM:auto (DCP 2) (round 1)" in bench.render(res)


def test_tables_keep_dcp_sizes_apart_and_read_older_files_as_dcp_1(tmp_path, capsys):
    old = _results([_m("CUSTOM:auto", 15000), _m("CUSTOM:auto", 15400), _m("FLASHMLA:auto", 16000)])
    assert "dcp" not in old["meta"] and all("dcp" not in m for m in old["measurements"])
    table = bench.throughput_table(old)
    assert "decode context parallel: none" in table and "CUSTOM:auto" in _rows(table)
    new = _results([_m("CUSTOM:auto", 24000, dcp=2), _m("CUSTOM:auto", 24600, dcp=2), _m("FLASHMLA:auto", 22000, dcp=2),
                    _m("FLASHMLA:auto", 22500, dcp=2)], dcp=2)
    for p in new["processes"]:
        p["dcp"] = 2
    paths = [tmp_path / "old.json", tmp_path / "new.json"]
    paths[0].write_text(json.dumps(old))
    paths[1].write_text(json.dumps(new))
    assert bench.main(["--table-from"] + [str(p) for p in paths]) == 0
    out = capsys.readouterr().out
    assert "DCP sizes 1, 2" in out
    rows = _rows(out)
    assert rows["CUSTOM:auto"][1:5] == ["2", "15,000", "15,200", "15,400"]           # not mixed with DCP 2
    assert rows["CUSTOM:auto (DCP 2)"][1:5] == ["2", "24,000", "24,300", "24,600"]
    assert rows["CUSTOM:auto (DCP 2)"][7] == "1.000x (ref)"
    assert rows["FLASHMLA:auto (DCP 2)"][7] == f"{22250 / 24300:.3f}x, apart"      # against the DCP 2 reference
    assert rows["FLASHMLA:auto"][7] == f"{16000 / 15200:.3f}x, no spread"          # against the DCP 1 reference


def test_the_fast_mode_bound_of_the_layer_tests_is_the_kernel_tests_one():
    # integration/harness.py states the bound the vLLM layer tests hold the FP8 fast mode to; it must stay the one
    # tests/test_fp8_gpu.py holds the kernel's fast mode to.
    import fp8kit

    assert bench.harness.FAST_MODE_REL == fp8kit.FAST_OUT
