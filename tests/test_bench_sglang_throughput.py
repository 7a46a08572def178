"""CPU tests of integration/bench_sglang_throughput.py, the SGLang engine benchmark: config parsing, the engine
environment and log checks, the engine arguments, and the driver loop with engine processes stood in for (no SGLang,
no GPU)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
import bench_sglang_throughput as bench  # noqa: E402
Config = bench.Config
OURS_LINE = ("INFO flashmla_backend: MLA decode attention runs on flashmla_backend 0.1.0 (kernel 'sm90' on NVIDIA "
             "H200), 128 heads per rank, {cache}; prefill and extend stay with SGLang's Triton backend.")


def ours_log(mode=None) -> str:
    cache = ("FP8 (e4m3) KV cache read in place with each layer's k scale, 16-bit queries (mode "
             f"{mode}, FLASHMLA_BACKEND_FP8_MODE)" if mode else "torch.bfloat16 KV cache")
    return "INFO loading\n" + OURS_LINE.format(cache=cache) + "\n"


def test_parse_config_forms():
    assert bench.parse_config("flashmla") == Config("flashmla", "auto", None)
    assert bench.parse_config("FlashMLA_Backend:FP8_E4M3") == Config("flashmla_backend", "fp8_e4m3", "accurate")
    assert bench.parse_config("flashmla_backend:fp8_e4m3:fast").label == "flashmla_backend:fp8_e4m3:fast"
    assert bench.parse_config("flashmla_backend").label == "flashmla_backend:auto"
    assert bench.parse_config("triton:fp8_e4m3") == Config("triton", "fp8_e4m3", None)


def test_the_default_mode_is_the_plugins_sglang_default():
    from flashmla_backend.engine_support import DEFAULT_FP8_MODES, FP8_MODE_ENV, FP8_MODES

    assert bench.DEFAULT_FP8_MODE == DEFAULT_FP8_MODES["sglang"]
    assert bench.FP8_MODE_ENV == FP8_MODE_ENV and tuple(bench.FP8_MODES) == FP8_MODES


@pytest.mark.parametrize("item,words", [
    ("", "expected BACKEND"), ("a:b:c:d", "expected BACKEND"), ("flash-mla", "not an SGLang"),
    ("flashmla:fp8", "KV-cache dtype 'fp8'"), ("flashmla_backend:fp8_e4m3:turbo", "mode 'turbo'"),
    ("flashmla:fp8_e4m3:fast", "only to flashmla_backend"), ("flashmla_backend:auto:fast", "only to flashmla_backend"),
])
def test_parse_config_refusals(item, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        bench.parse_config(item)


def test_parse_configs_duplicates_and_empty():
    with pytest.raises(ValueError, match="given twice: flashmla_backend:fp8_e4m3:accurate"):
        bench.parse_configs("flashmla_backend:fp8_e4m3,flashmla_backend:fp8_e4m3:accurate")
    with pytest.raises(ValueError, match="no configs"):
        bench.parse_configs(" , ")


def test_config_env_sets_the_mode_only_where_asked():
    base = {"PATH": "/bin", bench.FP8_MODE_ENV: "fast"}
    assert bench.config_env(Config("flashmla_backend", "fp8_e4m3", "accurate"), base)[bench.FP8_MODE_ENV] == "accurate"
    assert bench.FP8_MODE_ENV not in bench.config_env(Config("flashmla", "fp8_e4m3"), base)
    assert base[bench.FP8_MODE_ENV] == "fast"


def test_log_problem():
    fp8_fast = Config("flashmla_backend", "fp8_e4m3", "fast")
    assert bench.log_problem(ours_log("fast"), fp8_fast) is None
    assert "mode fast" in bench.log_problem(ours_log("accurate"), fp8_fast)
    assert "does not show" in bench.log_problem("INFO nothing\n", fp8_fast)
    assert bench.log_problem(ours_log(), Config("flashmla_backend")) is None
    assert "16-bit run" in bench.log_problem(ours_log("accurate"), Config("flashmla_backend"))
    assert bench.log_problem("INFO nothing\n", Config("flashmla", "fp8_e4m3")) is None
    assert "in a flashmla run" in bench.log_problem(ours_log("fast"), Config("flashmla", "fp8_e4m3"))


def test_engine_kwargs():
    args = bench.build_parser().parse_args([])
    kw = bench.engine_kwargs(Config("flashmla_backend", "fp8_e4m3", "fast"), args)
    assert kw["attention_backend"] == "flashmla_backend" and kw["kv_cache_dtype"] == "fp8_e4m3"
    assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"] and kw["disable_radix_cache"]
    assert kw["max_running_requests"] == 64 and kw["context_length"] == 7000 + 2049 + 64
    assert "kv_cache_dtype" not in bench.engine_kwargs(Config("flashmla"), args)


class FakeEngines:
    """Stands in for harness.run_logged: writes the worker's JSON as the engine process would and returns a log."""

    def __init__(self, rates: dict[str, float], bad_log: str | None = None):
        self.rates, self.bad_log, self.calls = rates, bad_log, []

    def __call__(self, name, cmd, env, timeout_s):
        label = cmd[cmd.index("--worker") + 1]
        out = Path(cmd[cmd.index("--worker-out") + 1])
        repeats = int(cmd[cmd.index("--repeats") + 1])
        self.calls.append((name, label, env.get(bench.FP8_MODE_ENV)))
        rate = self.rates[label]
        out.write_text(json.dumps({
            "config": label, "sglang_version": "0.5.17", "torch_version": "2.11.0+cu130", "gpu": "NVIDIA H200",
            "init_s": 40.0,
            "measurements": [{"repeat": k + 1, "t_1": 3.0, "t_n": 3.0 + 64 * 2048 / (rate + k),
                              "decode_s": 64 * 2048 / (rate + k), "decode_tok_s": rate + k, "ms_per_step": 1.0}
                             for k in range(repeats)]}))
        cfg = bench.parse_config(label)
        if cfg.backend == bench.OURS and label != self.bad_log:
            return ours_log(cfg.mode)
        return "INFO loading\n"


@pytest.fixture
def driver(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.harness, "RUN_DIR", tmp_path)
    monkeypatch.setattr(bench.harness, "engine_env", lambda extra=None: {"PATH": "/bin"})
    monkeypatch.setattr(bench.vbench, "git_describe", lambda: "abc1234")

    def run(fake, argv):
        monkeypatch.setattr(bench.harness, "run_logged", fake)
        rc = bench.main(argv)
        return rc, json.loads((tmp_path / "bench-sglang.json").read_text())
    return run


def _rows(out: str) -> dict[str, list[str]]:
    return {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
                                          for line in out.splitlines() if line.startswith("| ") and ":" in line)}


def test_driver_alternates_the_order_and_tabulates(driver, capsys):
    fake = FakeEngines({"flashmla_backend:fp8_e4m3:accurate": 17000, "flashmla_backend:fp8_e4m3:fast": 24000,
                        "flashmla:fp8_e4m3": 22000})
    rc, res = driver(fake, ["--rounds", "2", "--repeats", "2"])
    assert rc == 0 and not res["failures"] and len(res["measurements"]) == 3 * 2 * 2
    assert [(c[1], c[2]) for c in fake.calls] == [
        ("flashmla_backend:fp8_e4m3:accurate", "accurate"), ("flashmla_backend:fp8_e4m3:fast", "fast"),
        ("flashmla:fp8_e4m3", None), ("flashmla:fp8_e4m3", None), ("flashmla_backend:fp8_e4m3:fast", "fast"),
        ("flashmla_backend:fp8_e4m3:accurate", "accurate")]
    rows = _rows(capsys.readouterr().out)
    assert rows["flashmla_backend:fp8_e4m3:fast"][1:5] == ["4", "24,000", "24,000", "24,001"]
    assert rows["flashmla_backend:fp8_e4m3:fast"][7] == "1.091x, apart"
    assert rows["flashmla:fp8_e4m3"][7] == "1.000x (ref)"
    assert rows["flashmla_backend:fp8_e4m3:accurate"][5] == f"{64 / 17000.5 * 1e3:.3f}"
    assert res["meta"]["git"] == "abc1234" and res["meta"]["sglang_version"] == "0.5.17"


def test_driver_records_a_run_whose_log_is_wrong(driver, capsys):
    fake = FakeEngines({"flashmla_backend:fp8_e4m3:fast": 24000, "flashmla:fp8_e4m3": 22000},
                       bad_log="flashmla_backend:fp8_e4m3:fast")
    rc, res = driver(fake, ["--configs", "flashmla_backend:fp8_e4m3:fast,flashmla:fp8_e4m3", "--repeats", "1"])
    assert rc == 1 and [f["config"] for f in res["failures"]] == ["flashmla_backend:fp8_e4m3:fast"]
    assert {m["config"] for m in res["measurements"]} == {"flashmla:fp8_e4m3"}
    assert "FAILED: flashmla_backend:fp8_e4m3:fast" in capsys.readouterr().out


def test_dry_run_starts_nothing(driver, monkeypatch, capsys):
    def refuse(*a, **k):
        raise AssertionError("an engine process was started")

    monkeypatch.setattr(bench.harness, "run_logged", refuse)
    assert bench.main(["--dry-run", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "plan: 6 engine processes (3 configs x 2 rounds" in out
    assert "6. round 2: flashmla_backend:fp8_e4m3:accurate" in out


@pytest.mark.parametrize("argv,words", [(["--rounds", "0"], "--rounds must be at least 1"),
                                        (["--output-len", "1"], "--output-len must be at least 2"),
                                        (["--configs", "flashmla:fp8"], "KV-cache dtype 'fp8'")])
def test_bad_arguments_are_refused_naming_them(argv, words):
    with pytest.raises(SystemExit, match=re.escape(words)):
        bench.main(argv + ["--dry-run"])
