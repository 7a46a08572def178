"""CPU tests of integration/profile_vllm_decode.py (where a vLLM decode step's GPU time goes): the kernel totals of a
profile, the decode window (with vLLM's engine stood in for), the names and tables it prints, and the driver with the
engine processes stood in for (no vLLM, no GPU)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"


def _load():
    sys.path.insert(0, str(INTEGRATION))
    spec = importlib.util.spec_from_file_location("profile_vllm_decode", INTEGRATION / "profile_vllm_decode.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


prof = _load()


def event(key, us, count, device="DeviceType.CUDA"):
    return SimpleNamespace(key=key, self_device_time_total=us, count=count, device_type=device)


def test_kernel_totals_keeps_device_events_and_adds_repeated_keys():
    fake = SimpleNamespace(key_averages=lambda: [
        event("sm90_decode_kernel", 300.0, 4), event("cudaLaunchKernel", 0.0, 9, "DeviceType.CPU"),
        event("combine_kernel", 40.0, 4), event("sm90_decode_kernel", 100.0, 2), event("idle", 0.0, 0)])
    assert prof.kernel_totals(fake) == {"sm90_decode_kernel": (400.0, 6), "combine_kernel": (40.0, 4)}


def test_per_step_divides_by_the_steps():
    got = prof.per_step({"decode": (1280.0, 128), "combine": (256.0, 128), "idle": (0.0, 0)}, 128)
    assert got == {"decode": {"us": 10.0, "launches": 1.0}, "combine": {"us": 2.0, "launches": 1.0}}


class FakeEngine:
    """engine.step() as vLLM's in-process LLMEngine gives it: RequestOutputs with cumulative token ids, for the
    requests that got tokens in the step. `plan` lists, per step, how many tokens each request gets (the prefill:
    nothing for a while, then one a step); finished_at makes a request finish at that many tokens."""

    def __init__(self, ids, prefill_steps, finished_at=None, skip=None):
        self.ids, self.prefill_steps, self.finished_at, self.skip = ids, prefill_steps, finished_at, skip or {}
        self.n = dict.fromkeys(ids, 0)
        self.calls = 0

    def step(self):
        self.calls += 1
        outs = []
        for i, rid in enumerate(self.ids):
            if self.calls <= self.prefill_steps[i] or self.calls in self.skip.get(rid, ()):
                continue
            self.n[rid] += 1
            done = self.finished_at is not None and self.n[rid] >= self.finished_at
            outs.append(SimpleNamespace(request_id=rid, finished=done,
                                        outputs=[SimpleNamespace(token_ids=list(range(self.n[rid])))]))
        outs.append(SimpleNamespace(request_id="someone-else", finished=True, outputs=[SimpleNamespace(token_ids=[1])]))
        return outs


class Window:
    def __init__(self, engine):
        self.engine, self.calls_at = engine, []

    def __enter__(self):
        self.calls_at.append(self.engine.calls)

    def __exit__(self, *exc):
        self.calls_at.append(self.engine.calls)


def test_decode_window_profiles_only_steps_of_the_whole_batch_decoding():
    ids = ["a", "b", "c"]
    engine = FakeEngine(ids, prefill_steps=[1, 5, 9])   # requests finish their prefill at different steps
    window, syncs = Window(engine), []
    wall, tokens = prof.decode_window(engine, ids, 16, window, lambda: syncs.append(engine.calls), warm_steps=4)
    assert tokens == 16 and wall >= 0
    # The last request's first token came at step 10, its 5th at step 14: the window is steps 15-30.
    assert window.calls_at == [14, 30] and syncs == [14, 30]


def test_decode_window_fails_when_the_requests_gain_different_counts():
    ids = ["a", "b"]
    engine = FakeEngine(ids, prefill_steps=[0, 0], skip={"b": {9}})   # b misses a step inside the window
    with pytest.raises(RuntimeError, match=r"gained \[7, 8\] tokens"):
        prof.decode_window(engine, ids, 8, Window(engine), lambda: None, warm_steps=0)


def test_decode_window_fails_when_a_request_finishes_inside_it():
    ids = ["a"]
    engine = FakeEngine(ids, prefill_steps=[0], finished_at=10)
    with pytest.raises(RuntimeError, match="finished while being profiled"):
        prof.decode_window(engine, ids, 16, Window(engine), lambda: None, warm_steps=2)


def test_short_name_drops_templates_and_arguments():
    name = ("void flashmla_backend::sm90::decode::sm90_decode_kernel<flashmla_backend::sm90::decode::Traits<"
            "cutlass::bfloat16_t> >(flashmla_backend::DecodeParams, CUtensorMap_st)")
    assert prof.short_name(name) == "flashmla_backend::sm90::decode::sm90_decode_kernel"
    assert prof.short_name("x" * 100, 20) == "x" * 17 + "..."


def records():
    return {"CUSTOM:auto": {"wall_ms_per_step": 4.0, "kernels": {"a": {"us": 3000.0, "launches": 8.0},
                                                                   "b": {"us": 500.0, "launches": 8.0}}},
            "FLASHMLA:auto": {"wall_ms_per_step": 3.6, "kernels": {"a2": {"us": 2900.0, "launches": 8.0},
                                                                     "b": {"us": 450.0, "launches": 8.0}}}}


def test_report_and_side_by_side():
    r = records()
    text = prof.report("CUSTOM:auto", r["CUSTOM:auto"], 1)
    assert "4.000 ms per decode step" in text and "kernels 3.500 ms per step (88% of it)" in text
    assert "3000.0 us" in text and "500.0 us" not in text   # top 1
    table = prof.side_by_side(r, 2).splitlines()
    assert table[0] == "| kernel | CUSTOM:auto µs/step | FLASHMLA:auto µs/step |"
    assert "| `a` | 3000.0 | - |" in table and "| `a2` | - | 2900.0 |" in table and "| `b` | 500.0 | 450.0 |" in table
    assert table[-2] == "| all kernels | 3500.0 | 3350.0 |" and table[-1] == "| wall per step | 4000.0 | 3600.0 |"


@pytest.fixture
def driver(tmp_path, monkeypatch):
    """The driver's surroundings stood in for: results under tmp_path, a fixed engine environment and git stamp."""
    monkeypatch.setattr(prof.harness, "RUN_DIR", tmp_path)
    monkeypatch.setattr(prof.harness, "engine_env", lambda extra=None: {"PATH": "/bin"})
    monkeypatch.setattr(prof.bench, "git_describe", lambda: "abc1234")
    return tmp_path


def test_driver_runs_each_config_and_writes_the_results(driver, monkeypatch, capsys):
    calls = []

    def fake(name, cmd, env, timeout_s):
        label = cmd[cmd.index("--worker") + 1]
        calls.append((name, label, cmd[cmd.index("--steps") + 1]))
        rec = dict(records()[label], config=label, steps=64, gpu="NVIDIA H200")
        Path(cmd[cmd.index("--worker-out") + 1]).write_text(json.dumps(rec))
        return "INFO MLA decode attention runs on flashmla_backend 0.1.0\n" if label.startswith("CUSTOM") else "INFO\n"

    monkeypatch.setattr(prof.harness, "run_logged", fake)
    assert prof.main(["--configs", "CUSTOM:auto,FLASHMLA:auto", "--steps", "64"]) == 0
    assert [c[:2] for c in calls] == [("profile-decode-custom-auto", "CUSTOM:auto"),
                                      ("profile-decode-flashmla-auto", "FLASHMLA:auto")]
    assert all(c[2] == "64" for c in calls)
    res = json.loads((driver / "profile-decode.json").read_text())
    assert sorted(res["records"]) == ["CUSTOM:auto", "FLASHMLA:auto"] and not res["failures"]
    out = capsys.readouterr().out
    assert "| wall per step | 4000.0 | 3600.0 |" in out


def test_driver_reports_a_custom_run_without_our_decode_line(driver, monkeypatch):

    def fake(name, cmd, env, timeout_s):
        label = cmd[cmd.index("--worker") + 1]
        Path(cmd[cmd.index("--worker-out") + 1]).write_text(json.dumps(dict(records()[label], config=label)))
        return "INFO\n"

    monkeypatch.setattr(prof.harness, "run_logged", fake)
    assert prof.main(["--configs", "CUSTOM:auto,FLASHMLA:auto"]) == 1
    res = json.loads((driver / "profile-decode.json").read_text())
    assert [f["config"] for f in res["failures"]] == ["CUSTOM:auto"] and list(res["records"]) == ["FLASHMLA:auto"]


@pytest.mark.parametrize("argv, words", [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--configs", "CUSTOM:bf8"], "KV-cache dtype 'bf8'"),
])
def test_bad_options_name_the_option(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        prof.main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_a_deepseek_v32_model_runs_the_sparse_configs(driver, monkeypatch, capsys):
    """--model of a DeepSeek-V3.2 config: the benchmark's sparse configs by default, CUSTOM's process with the GPU
    opt-in of the plugin's sparse backend, its log checked for the sparse line; a dense-only mode is refused."""
    model = driver / "v32"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "deepseek_v32"}))
    seen = []

    def fake(name, cmd, env, timeout_s):
        label = cmd[cmd.index("--worker") + 1]
        seen.append((label, env.get(prof.bench.SPARSE_GPU_ENV), cmd[cmd.index("--model") + 1]))
        rec = dict(records()["CUSTOM:auto"], config=label, steps=128, gpu="NVIDIA H200")
        Path(cmd[cmd.index("--worker-out") + 1]).write_text(json.dumps(rec))
        return (f"INFO {prof.bench.OUR_SPARSE_LOG_LINE} ..., KV cache fp8_ds_mla\n" if label.startswith("CUSTOM")
                else "INFO\n")

    monkeypatch.setattr(prof.harness, "run_logged", fake)
    assert prof.main(["--model", str(model)]) == 0
    assert seen == [("CUSTOM:fp8", "1", str(model)), ("FLASHMLA_SPARSE:fp8", None, str(model))]
    with pytest.raises(SystemExit) as e:
        prof.main(["--model", str(model), "--configs", "CUSTOM:fp8:fast"])
    assert e.value.code == 2 and "no FP8 query modes" in capsys.readouterr().err
