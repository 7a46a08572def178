"""The KV-cache formats (flashmla_backend.kv_format): one named thing per format, which the rest of Python asks."""
import re
from pathlib import Path

import pytest
import torch

import flashmla_backend
from flashmla_backend import engine_support, kv_format, validate
from flashmla_backend.kv_format import BF16, FP8_DS_MLA, FP8_E4M3, FP16

PACKAGE = Path(flashmla_backend.__file__).resolve().parent


@pytest.mark.parametrize("dtype,width,want", [
    (torch.bfloat16, 576, BF16), (torch.float16, 576, FP16), (torch.float8_e4m3fn, 576, FP8_E4M3),
    (torch.uint8, 656, FP8_DS_MLA), (torch.int8, 656, FP8_DS_MLA), (torch.float8_e4m3fn, 656, FP8_DS_MLA),
    (torch.float32, 576, None), (torch.float8_e5m2, 576, None), (torch.uint8, 576, None), (torch.bfloat16, 656, None),
    (torch.bfloat16, 512, None),
], ids=str)
def test_of_tells_the_format_by_dtype_and_width(dtype, width, want):
    assert kv_format.of(torch.zeros(2, 4, 1, width, dtype=dtype)) is want


def test_bytes_per_token_follow_from_dtype_and_width():
    for fmt in kv_format.FORMATS:
        for dtype in fmt.dtypes:
            assert fmt.bytes_per_token == fmt.width * torch.empty((), dtype=dtype).element_size(), fmt
    assert [f.bytes_per_token for f in (BF16, FP16, FP8_E4M3, FP8_DS_MLA)] == [1152, 1152, 576, 656]


def test_which_kernels_read_which_formats():
    assert kv_format.read_by("portable") == (BF16, FP16)
    assert kv_format.read_by("sm90") == (BF16, FP16, FP8_E4M3)
    assert kv_format.read_by("sm90", sparse=True) == (FP8_DS_MLA,)
    assert kv_format.read_by("portable", sparse=True) == ()
    assert set(kv_format.SPARSE) == {FP8_DS_MLA, BF16, FP16}


def test_kernel_problem_sentences():
    assert FP8_E4M3.kernel_problem("sm90", sparse=False) is None
    assert BF16.kernel_problem("portable", sparse=False) is None
    assert FP8_E4M3.kernel_problem("portable", sparse=False) == (
        "the fp8_e4m3 KV cache is read in dense decode by the sm90 kernel only, not by the portable kernel")
    assert FP8_DS_MLA.kernel_problem("sm90", sparse=True) is None
    assert FP8_DS_MLA.kernel_problem("portable", sparse=True) == (
        "the fp8_ds_mla KV cache is read in sparse decode (indices) by the sm90 kernel only, not by the portable kernel")
    assert BF16.kernel_problem("sm90", sparse=True) == (
        "no compiled kernel reads the bf16 KV cache in sparse decode (indices) yet")
    assert FP8_DS_MLA.kernel_problem("sm90", sparse=False) == (
        "no compiled kernel reads the fp8_ds_mla KV cache in dense decode yet")


def test_named_and_describe():
    assert kv_format.named("fp8_ds_mla") is FP8_DS_MLA and str(FP8_DS_MLA) == "fp8_ds_mla"
    assert FP8_DS_MLA.describe() == "fp8_ds_mla (uint8 or int8 or float8_e4m3fn, 656 per token)"
    with pytest.raises(KeyError, match=r"no KV-cache format 'fp8_e5m2'; formats: bf16, fp16, fp8_e4m3, fp8_ds_mla"):
        kv_format.named("fp8_e5m2")


def test_the_fp8_dtype_is_defined_once():
    """torch.float8_e4m3fn is bound to a name in one module of the package; the others ask kv_format."""
    binders = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if re.search(r"^\s*\w+\s*=\s*torch\.float8_e4m3fn\b", p.read_text(), flags=re.M))
    assert binders == ["kv_format.py"], binders
    assert validate.FP8 is engine_support.FP8_DTYPE is kv_format.E4M3 is torch.float8_e4m3fn
