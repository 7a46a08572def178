"""Bad input gets a clear Python exception naming the argument (CPU tensors; GPU-only checks marked)."""
import unittest.mock

import pytest
import torch

import flashmla_backend as fb
from flashmla_backend import validate
from kit import Case, make_inputs


def args(case=None, device="cpu"):
    case = case or Case(lengths=[70, 5], s_q=2, h_q=16)
    inp = make_inputs(case, device)
    meta, num_splits = fb.get_mla_metadata(inp.cache_seqlens, case.s_q * case.h_q // case.h_kv, case.h_kv)
    return dict(q=inp.q, k_cache=inp.k_cache, block_table=inp.block_table, cache_seqlens=inp.cache_seqlens,
                head_dim_v=512, tile_scheduler_metadata=meta, num_splits=num_splits, softmax_scale=inp.scale,
                causal=True)


def call(**kw):
    return fb.flash_mla_with_kvcache(**kw)


def expect(exc, match, **changes):
    a = args()
    a.update(changes)
    with pytest.raises(exc, match=match):
        call(**a)


def test_valid_arguments_run():
    out, lse = call(**args())
    assert out.shape == (2, 2, 16, 512) and lse.shape == (2, 16, 2)


def test_q_dtype():
    a = args()
    expect(TypeError, r"q must have dtype torch.bfloat16 or torch.float16", q=a["q"].float())


def test_q_and_cache_dtypes_differ():
    a = args()
    expect(TypeError, r"q and k_cache must have the same dtype", q=a["q"].half())


def test_fp8_cache_refused():
    a = args()
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8")
    expect(NotImplementedError, r"FP8", k_cache=a["k_cache"].to(torch.float8_e4m3fn))
    with pytest.raises(NotImplementedError, match="FP8"):
        fb.flash_mla_with_kvcache(**a, is_fp8_kvcache=True)
    with pytest.raises(NotImplementedError, match="FP8"):
        fb.get_mla_metadata(a["cache_seqlens"], 32, 1, is_fp8_kvcache=True)


def test_q_shape():
    a = args()
    expect(ValueError, r"q must be \[batch, seqlen_q, num_heads_q, 576\]", q=a["q"][0])
    expect(ValueError, r"q's last dimension must be 576", q=a["q"][..., :512].contiguous())


def test_cache_rank_and_page_size():
    a = args()
    expect(ValueError, r"k_cache must be \[num_pages, page_size, num_heads_k, 576\].*unsqueeze",
           k_cache=a["k_cache"].squeeze(2))
    expect(ValueError, r"page size 32 .*only 64-token pages", k_cache=a["k_cache"].reshape(-1, 32, 1, 576))


def test_head_dim_v():
    expect(ValueError, r"head_dim_v must be 512", head_dim_v=128)


def test_heads_divisible():
    case = Case(lengths=[70, 5], s_q=1, h_q=3, h_kv=1)
    a = args(case)
    a["k_cache"] = a["k_cache"].expand(-1, -1, 2, -1)
    with pytest.raises(ValueError, match=r"num_heads_q \(3\) must be a multiple of num_heads_k \(2\)"):
        call(**a)


def test_last_dim_contiguous():
    a = args()
    q = torch.empty(a["q"].shape[:-1] + (576 * 2,), dtype=a["q"].dtype)[..., ::2]
    expect(ValueError, r"q must have a contiguous last dimension", q=q)


def test_block_table_dtype_and_shape():
    a = args()
    expect(TypeError, r"block_table must have dtype torch.int32", block_table=a["block_table"].long())
    expect(ValueError, r"block_table must be \[batch=2", block_table=a["block_table"][:1])


def test_seqlens_dtype_and_shape():
    a = args()
    expect(TypeError, r"cache_seqlens must have dtype torch.int32", cache_seqlens=a["cache_seqlens"].long())
    expect(ValueError, r"cache_seqlens must be \[batch=2\]", cache_seqlens=a["cache_seqlens"][:1])


def test_metadata_shapes():
    a = args()
    expect(ValueError, r"tile_scheduler_metadata must be \[num_sm_parts, 8\]",
           tile_scheduler_metadata=a["tile_scheduler_metadata"][:, :4].contiguous())
    expect(ValueError, r"num_splits must be \[batch \+ 1 = 3\]", num_splits=a["num_splits"][:2])


def test_negative_length():
    expect(ValueError, r"cache_seqlens must be >= 0.*\(1, -3\)", cache_seqlens=torch.tensor([70, -3], dtype=torch.int32))


def test_block_table_too_short():
    expect(ValueError, r"block_table is too short.*\(0, 1000\)", cache_seqlens=torch.tensor([1000, 5], dtype=torch.int32))


def test_page_id_out_of_range():
    a = args()
    bt = a["block_table"].clone()
    bt[0, 0] = 10**6
    expect(ValueError, r"block_table\[0\] holds page ids outside", block_table=bt)


def test_softmax_scale_and_causal():
    expect(ValueError, r"softmax_scale must be a positive float", softmax_scale=-1.0)
    expect(TypeError, r"causal must be a bool", causal=1)


def test_not_a_tensor():
    expect(TypeError, r"q must be a torch.Tensor, got list", q=[1, 2])


def _mutations():
    a = args()
    q, kc = a["q"], a["k_cache"]
    return {
        "valid": {},
        "q float32": dict(q=q.float()),
        "q fp16 vs bf16 cache": dict(q=q.half()),
        "q 3-D": dict(q=q[0]),
        "q last dim 512": dict(q=q[..., :512].contiguous()),
        "q strided last dim": dict(q=torch.empty(q.shape[:-1] + (1152,), dtype=q.dtype)[..., ::2]),
        "q list": dict(q=[1, 2]),
        "cache 3-D": dict(k_cache=kc.squeeze(2)),
        "page size 32": dict(k_cache=kc.reshape(-1, 32, 1, 576)),
        "cache h_kv 3 of 16": dict(k_cache=kc.expand(-1, -1, 3, -1)),
        "head_dim_v 128": dict(head_dim_v=128),
        "block_table int64": dict(block_table=a["block_table"].long()),
        "block_table short batch": dict(block_table=a["block_table"][:1]),
        "block_table 1-D": dict(block_table=a["block_table"][0]),
        "seqlens int64": dict(cache_seqlens=a["cache_seqlens"].long()),
        "seqlens short": dict(cache_seqlens=a["cache_seqlens"][:1]),
        "seqlens strided": dict(cache_seqlens=torch.zeros(4, dtype=torch.int32)[::2]),
        "meta 4 columns": dict(tile_scheduler_metadata=a["tile_scheduler_metadata"][:, :4].contiguous()),
        "meta strided": dict(tile_scheduler_metadata=a["tile_scheduler_metadata"].repeat(1, 2)[:, ::2]),
        "num_splits short": dict(num_splits=a["num_splits"][:2]),
        "scale negative": dict(softmax_scale=-1.0),
        "scale bool": dict(softmax_scale=True),
        "scale string": dict(softmax_scale="0.1"),
        "causal int": dict(causal=1),
        "causal None": dict(causal=None),
    }


@pytest.mark.parametrize("name", list(_mutations()))
def test_fast_path_never_accepts_what_the_checks_refuse(name):
    """validate_decode_args first tries one cheap combined test (_decode_args_ok); it may send valid
    calls to the step-by-step checks, but must never wave through a call those checks refuse."""
    a = dict(args(), **_mutations()[name])
    fast = validate._decode_args_ok(**a)  # must not raise, whatever it is given
    refused = None
    try:
        _step_by_step(**a)
    except (TypeError, ValueError, NotImplementedError) as e:
        refused = e
    assert not (fast and refused), f"fast path accepted what the checks refuse: {refused}"
    if name == "valid":
        assert fast and refused is None
    else:
        assert refused is not None, "every mutation is a bad input: the step-by-step checks must refuse it"


def _step_by_step(**a):
    with unittest.mock.patch.object(validate, "_decode_args_ok", return_value=False):
        validate.validate_decode_args(**a)


def test_stale_metadata_in_checked_mode(monkeypatch):
    a = args()
    monkeypatch.setenv(validate.CHECK_ENV, "1")
    call(**a)  # fresh metadata passes
    stale = a["tile_scheduler_metadata"].clone()
    stale[0, 3] += 64
    expect(ValueError, r"do not match cache_seqlens", tile_scheduler_metadata=stale)


def test_metadata_argument_errors():
    s = torch.tensor([5, 6], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"cache_seqlens must have dtype torch.int32"):
        fb.get_mla_metadata(s.long(), 16, 1)
    with pytest.raises(ValueError, match=r"num_heads_k must be a positive int"):
        fb.get_mla_metadata(s, 16, 0)
    with pytest.raises(NotImplementedError, match=r"topk"):
        fb.get_mla_metadata(s, 16, 1, topk=2048)


def test_sparse_indices_refused():
    a = args()
    with pytest.raises(NotImplementedError, match="sparse"):
        fb.flash_mla_with_kvcache(**a, indices=torch.zeros(1))


def test_empty_batch():
    case = Case(lengths=[5], s_q=1, h_q=16)
    a = args(case)
    empty = dict(a, q=a["q"][:0], block_table=a["block_table"][:0], cache_seqlens=a["cache_seqlens"][:0])
    meta, ns = fb.get_mla_metadata(empty["cache_seqlens"], 16, 1)
    out, lse = call(**dict(empty, tile_scheduler_metadata=meta, num_splits=ns))
    assert out.shape == (0, 1, 16, 512) and lse.shape == (0, 16, 1)


# ---- device checks (need a CUDA device; the CPU cannot produce them) -------------------------------

@pytest.mark.gpu
def test_device_mismatch():
    a = args(device="cuda")
    expect(ValueError, r"block_table is on cpu but q is on cuda", **dict(a, block_table=a["block_table"].cpu()))


@pytest.mark.gpu
def test_misaligned_q_pointer():
    a = args(device="cuda")
    flat = torch.empty(a["q"].numel() + 1, dtype=a["q"].dtype, device="cuda")
    q = flat[1:].view(a["q"].shape)
    q.copy_(a["q"])
    with pytest.raises(ValueError, match=r"q's data pointer must be 16-byte aligned"):
        call(**dict(a, q=q))


@pytest.mark.gpu
def test_checked_mode_on_gpu(monkeypatch):
    a = args(device="cuda")
    monkeypatch.setenv(validate.CHECK_ENV, "1")
    with pytest.raises(ValueError, match=r"block_table is too short"):
        call(**dict(a, cache_seqlens=torch.tensor([1000, 5], dtype=torch.int32, device="cuda")))


# ---- unsupported GPUs (the device properties are faked; needs the compiled module for its limits) ----

@pytest.mark.parametrize("major,minor,smem,name", [(8, 9, 101376, "NVIDIA GeForce RTX 4090"),
                                                   (7, 5, 65536, "Tesla T4")])
def test_unsupported_gpu_message_names_the_gpu(monkeypatch, major, minor, smem, name):
    from flashmla_backend import _ext, device

    if not _ext.available():
        pytest.skip("needs the compiled module (its shared-memory needs and build targets)")
    fake = device.DeviceProps(index=0, name=name, major=major, minor=minor, sm_count=128, smem_per_block_optin=smem)
    monkeypatch.setattr(device, "device_props", lambda index: fake)
    device._kernel_for.cache_clear()
    try:
        with pytest.raises(device.UnsupportedGPUError, match=rf"GPU 0 '{name}' \(sm_{major}{minor}.*Supported: Hopper"):
            device._kernel_for(0, "")
        with pytest.raises(device.UnsupportedGPUError, match=r"FLASHMLA_BACKEND_KERNEL=sm90"):
            device._kernel_for(0, "sm90")
    finally:
        device._kernel_for.cache_clear()


def test_supported_gpu_kernel_choice(monkeypatch):
    from flashmla_backend import _ext, device

    if not _ext.available():
        pytest.skip("needs the compiled module")
    C = _ext.ext()
    hopper = device.DeviceProps(index=0, name="NVIDIA H100", major=9, minor=0, sm_count=132,
                                smem_per_block_optin=232448)
    monkeypatch.setattr(device, "device_props", lambda index: hopper)
    device._kernel_for.cache_clear()
    try:
        assert device._kernel_for(0, "") == ("sm90" if C.sm90_compiled() else "portable")
        assert device._kernel_for(0, "portable") == "portable"
        with pytest.raises(ValueError, match=r"expected 'auto', 'portable' or 'sm90'"):
            device._kernel_for(0, "fast")
    finally:
        device._kernel_for.cache_clear()
