"""flashmla_backend.engine_support: the one statement of what the engine plugins accept (no engine needed)."""
import pytest
import torch

from flashmla_backend import engine_support as es


@pytest.mark.parametrize("engine,name", [("vllm", "fp8"), ("vllm", "fp8_e4m3"), ("sglang", "fp8_e4m3")])
def test_fp8_names(engine, name):
    assert es.is_fp8(engine, name) and es.kv_cache_dtype_problem(engine, name, torch.bfloat16) is None


@pytest.mark.parametrize("engine,name", [("vllm", "fp8_e5m2"), ("vllm", "fp8_ds_mla"), ("vllm", "nvfp4"),
                                         ("sglang", "fp8_e5m2"), ("sglang", "mxfp8"), ("sglang", "float16")])
def test_refusals_name_what_works(engine, name):
    problem = es.kv_cache_dtype_problem(engine, name)
    assert problem and repr(name) in problem and all(n in problem for n in es.accepted_names(engine))
    assert not es.is_fp8(engine, name)


def test_16bit_cache_must_match_the_model():
    assert es.kv_cache_dtype_problem("vllm", "float16", torch.float16) is None
    assert "model dtype" in es.kv_cache_dtype_problem("vllm", "float16", torch.bfloat16)
    assert es.kv_cache_dtype_problem("vllm", None, torch.float16) is None  # None is "auto"
    assert es.cache_dtype_problem(torch.float8_e4m3fn, torch.float16) is None
    assert "model dtype" in es.cache_dtype_problem(torch.float16, torch.bfloat16)
    assert "float8_e5m2" in es.cache_dtype_problem(torch.float8_e5m2, torch.bfloat16)


def test_block_sizes():
    assert es.block_size_problem(None) is None and es.block_size_problem(256) is None
    assert "32 does not" in es.block_size_problem(32)


# The engines' defaults (README, "FP8 KV cache in the engines", says why): vLLM fast, SGLang accurate.
@pytest.mark.parametrize("raw,vllm,sglang,requested", [(None, "fast", "accurate", None), ("", "fast", "accurate", None),
                                                       ("fast", "fast", "fast", "fast"),
                                                       (" Accurate ", "accurate", "accurate", "accurate")])
def test_fp8_mode(monkeypatch, raw, vllm, sglang, requested):
    if raw is None:
        monkeypatch.delenv(es.FP8_MODE_ENV, raising=False)
    else:
        monkeypatch.setenv(es.FP8_MODE_ENV, raw)
    assert es.fp8_mode("vllm") == vllm and es.fp8_mode("sglang") == sglang and es.requested_fp8_mode() == requested
    assert es.DEFAULT_FP8_MODES == {"vllm": "fast", "sglang": "accurate"}


@pytest.mark.parametrize("read", [lambda: es.fp8_mode("vllm"), lambda: es.fp8_mode("sglang"), es.requested_fp8_mode])
def test_fp8_mode_refuses_other_values(monkeypatch, read):
    monkeypatch.setenv(es.FP8_MODE_ENV, "1")
    with pytest.raises(ValueError, match=r"FLASHMLA_BACKEND_FP8_MODE='1'.*accurate, fast \(unset: fast in vllm, "
                                         r"accurate in sglang\)"):
        read()


def test_fp8_mode_of_an_unknown_engine():
    with pytest.raises(ValueError, match="engine must be one of vllm, sglang"):
        es.fp8_mode("trt")


def test_unknown_engine():
    with pytest.raises(ValueError, match="engine must be one of vllm, sglang"):
        es.kv_cache_dtype_problem("trt", "auto")


def test_default_scale_message_says_how_to_calibrate():
    assert "--calculate-kv-scales" in es.default_scale_message("vllm")
    assert "k_scale" in es.default_scale_message("sglang")


@pytest.mark.parametrize("engine,name,model_dtype", [
    ("vllm", "fp8_ds_mla", torch.bfloat16), ("vllm", "auto", torch.float16), ("sglang", "fp8_e4m3", torch.bfloat16),
    ("sglang", "bf16", torch.bfloat16), ("sglang", "bfloat16", torch.bfloat16), ("sglang", "auto", torch.bfloat16)])
def test_sparse_caches_served(engine, name, model_dtype):
    assert es.sparse_kv_cache_dtype_problem(engine, name, model_dtype) is None


@pytest.mark.parametrize("engine,name,model_dtype,fp8_name", [
    ("vllm", "float16", torch.bfloat16, "fp8_ds_mla"), ("sglang", "bf16", torch.float16, "fp8_e4m3")])
def test_sparse_16bit_cache_must_match_the_model(engine, name, model_dtype, fp8_name):
    problem = es.sparse_kv_cache_dtype_problem(engine, name, model_dtype)
    assert "model dtype" in problem and problem.endswith(f"auto or {fp8_name}")


@pytest.mark.parametrize("engine,name", [("sglang", "fp8_e5m2"), ("sglang", "fp8_ds_mla"), ("sglang", "float16"),
                                         ("vllm", "bf16")])
def test_sparse_refusals_name_what_works(engine, name):
    problem = es.sparse_kv_cache_dtype_problem(engine, name)
    assert problem and repr(name) in problem and all(n in problem for n in es.SPARSE_KV_CACHE_DTYPES[engine])


def test_sparse_heads():
    assert es.sparse_heads_problem(64) is None and es.sparse_heads_problem(128) is None
    problem = es.sparse_heads_problem(16)
    assert "got 16" in problem and "64 or 128" in problem


@pytest.mark.parametrize("cuda, opt_in, ds_mla, capability, words", [
    (False, False, False, None, None),                     # CPU tensors: the reference
    (True, False, True, (9, 0), "KERNEL MISSING"),         # a GPU without the opt-in: the engine's message
    (True, True, True, (9, 0), None),                      # the opt-in, a Hopper GPU, fp8_ds_mla: the kernel
    (True, True, True, None, None),                        # capability unknown: the kernel's own check decides
    (True, True, False, (9, 0), None),                     # a 16-bit cache: gathered for the dense kernel
    (True, True, True, (8, 0), "this one is sm_80"),
    (True, True, False, (10, 0), "(a 16-bit cache), this one is sm_100"),
])
def test_sparse_device_problem(cuda, opt_in, ds_mla, capability, words, monkeypatch):
    from flashmla_backend._env import SPARSE_GPU_ENV

    if opt_in:
        monkeypatch.setenv(SPARSE_GPU_ENV, "1")
    else:
        monkeypatch.delenv(SPARSE_GPU_ENV, raising=False)
    got = es.sparse_device_problem("KERNEL MISSING", cuda=cuda, ds_mla=ds_mla, capability=capability)
    if words is None:
        assert got is None
    else:
        assert words in got
        assert words == "KERNEL MISSING" or SPARSE_GPU_ENV in got


def test_sparse_device_problem_asks_the_device_only_past_the_opt_in(monkeypatch):
    from flashmla_backend._env import SPARSE_GPU_ENV

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or (8, 9))
    monkeypatch.delenv(SPARSE_GPU_ENV, raising=False)
    assert es.sparse_device_problem("KERNEL MISSING", cuda=True, ds_mla=True, device="cuda") == "KERNEL MISSING"
    assert not asked
    monkeypatch.setenv(SPARSE_GPU_ENV, "1")
    assert "this one is sm_89" in es.sparse_device_problem("KERNEL MISSING", cuda=True, ds_mla=True, device="cuda")
    assert asked == ["cuda"]
