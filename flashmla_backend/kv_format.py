"""The KV-cache formats, each stated once: what validation, the API, the reference and the tests ask about a cache.

A format is how one token of one KV head is stored in k_cache [num_pages, page_size, num_heads_k, width]: the
torch dtypes such a tensor may have, its last dimension (`width`, in elements of that dtype), the bytes a token
takes, where its scales are, and which compiled kernels read it (flashmla_backend.device names them: "sm90",
"portable"), in dense decode (block_table + cache_seqlens) and in sparse decode (indices):

    name        dtypes                        width  bytes  scales                            dense kernels    sparse
    bf16        bfloat16                       576   1152   none                              sm90, portable   (gathered)
    fp16        float16                        576   1152   none                              sm90, portable   (gathered)
    fp8_e4m3    float8_e4m3fn                  576    576   descale_k (per tensor or per      sm90             -
                                                            request and KV head)
    fp8_ds_mla  uint8, int8 or float8_e4m3fn   656    656   four float32 in each token        -                sm90

A 576-wide token is 512 latent channels (also V) then 64 rope channels (flashmla_backend.geometry). The
fp8_ds_mla token (DeepSeek-V3.2's) has its own byte layout, written down with its codec in
flashmla_backend.fp8_ds_mla. Sparse decode reads fp8_ds_mla and the 16-bit formats: on CPU tensors the reference
reads all three; on CUDA tensors the sm90 sparse kernel reads fp8_ds_mla, and a 16-bit cache's named tokens are
gathered into a scratch cache that the format's dense kernels read (flashmla_backend.ops: _sparse_decode_gathered),
so no compiled kernel reads a 16-bit cache in sparse decode itself ("gathered" above, sparse_kernels empty).

E4M3 is the one definition of the FP8 element type in Python. A format is one identity from here to the kernels:
the compiled module knows it by the same name and code (csrc/params.h: KvFormat; KvFormat.code below), receives
it as DecodeParams' kv_format, and reports which of its kernels read which formats (csrc/launch.h; the module's
kernel_kv_formats), which tests/test_build.py compares with the kernel lists here.
"""
from __future__ import annotations

import dataclasses

import torch

from .geometry import HEAD_DIM_K, HEAD_DIM_V, ROPE_DIM

E4M3 = torch.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class KvFormat:
    name: str                            # as engines spell it (vLLM's --kv-cache-dtype fp8_ds_mla, ...)
    dtypes: tuple[torch.dtype, ...]      # dtypes a k_cache of this format may have
    width: int                           # k_cache's last dimension, in elements of that dtype
    bytes_per_token: int                 # per token and KV head
    scales: str                          # where the scales are, in words
    dense_kernels: tuple[str, ...]       # compiled kernels that read it in dense decode
    sparse_kernels: tuple[str, ...]      # ... in sparse decode (indices)
    code: int                            # its code in the compiled module (csrc/params.h: KvFormat)

    def __str__(self) -> str:
        return self.name

    def holds(self, k_cache: torch.Tensor) -> bool:
        """Whether a k_cache tensor is of this format (its dtype and last dimension)."""
        return k_cache.dtype in self.dtypes and k_cache.dim() >= 1 and k_cache.shape[-1] == self.width

    def describe(self) -> str:
        """The format in words: name, dtypes and width, for messages."""
        dtypes = " or ".join(str(d).replace("torch.", "") for d in self.dtypes)
        return f"{self.name} ({dtypes}, {self.width} per token)"

    def kernels(self, sparse: bool) -> tuple[str, ...]:
        return self.sparse_kernels if sparse else self.dense_kernels

    def kernel_problem(self, kernel: str | None, sparse: bool) -> str | None:
        """None when `kernel` reads this format in that mode, else a sentence saying which kernels do."""
        kernels = self.kernels(sparse)
        if kernel in kernels:
            return None
        mode = "sparse decode (indices)" if sparse else "dense decode"
        if not kernels:
            return f"no compiled kernel reads the {self.name} KV cache in {mode} yet"
        only = " and ".join(kernels)
        return (f"the {self.name} KV cache is read in {mode} by the {only} kernel{'s' if len(kernels) > 1 else ''} "
                f"only{'' if kernel is None else f', not by the {kernel} kernel'}")


_WIDE = 2 * HEAD_DIM_K   # bytes of a 16-bit token

BF16 = KvFormat("bf16", (torch.bfloat16,), HEAD_DIM_K, _WIDE, "none", ("sm90", "portable"), (), 0)
FP16 = KvFormat("fp16", (torch.float16,), HEAD_DIM_K, _WIDE, "none", ("sm90", "portable"), (), 1)
FP8_E4M3 = KvFormat("fp8_e4m3", (E4M3,), HEAD_DIM_K, HEAD_DIM_K,
                    "descale_k: one float32, or one per request and KV head", ("sm90",), (), 2)
# 512 e4m3 latent bytes, a float32 scale per 128 of them, 64 bf16 rope values (flashmla_backend.fp8_ds_mla).
_DS_MLA_BYTES = HEAD_DIM_V + 4 * (HEAD_DIM_V // 128) + 2 * ROPE_DIM
FP8_DS_MLA = KvFormat("fp8_ds_mla", (torch.uint8, torch.int8, E4M3), _DS_MLA_BYTES, _DS_MLA_BYTES,
                      "four float32 in each token, one per 128 latent channels", (), ("sm90",), 3)

FORMATS = (BF16, FP16, FP8_E4M3, FP8_DS_MLA)
SIXTEEN_BIT = (BF16, FP16)
SPARSE = (FP8_DS_MLA, BF16, FP16)        # the formats sparse decode (indices) reads


def of(k_cache: torch.Tensor) -> KvFormat | None:
    """The format a k_cache tensor holds (by dtype and last dimension), or None for none of them."""
    for fmt in FORMATS:
        if fmt.holds(k_cache):
            return fmt
    return None


def named(name: str) -> KvFormat:
    for fmt in FORMATS:
        if fmt.name == name:
            return fmt
    raise KeyError(f"flashmla_backend: no KV-cache format {name!r}; formats: {', '.join(f.name for f in FORMATS)}")


def read_by(kernel: str, sparse: bool = False) -> tuple[KvFormat, ...]:
    """The formats a compiled kernel reads in dense (or sparse) decode."""
    return tuple(fmt for fmt in FORMATS if kernel in fmt.kernels(sparse))
