"""FlashInfer's Hopper MLA decode (BatchMLAPagedAttentionWrapper, backend "fa3") as a timed peer.

FlashInfer is not a dependency of this project. The harness times it when one of these is true:
  * `import flashinfer` works in this Python (a FlashInfer installed beside torch), or
  * a prebuilt bundle folder is present: a folder holding `site.tar.xz` (FlashInfer's Python files and the
    sm_90a MLA modules compiled ahead of time, unpacked as `site/` and `fallback/`) and optionally
    `site.tar.xz.sha256`. Where: `--flashinfer-dir DIR` (benchmarks/bench.py), else the environment variable
    FLASHMLA_BENCH_FLASHINFER_DIR, else `.peers/flashinfer` in this checkout.
Otherwise its rows say "unavailable" with the reason, and every other implementation runs as before.

The bundle is unpacked once into a folder under $TMPDIR named by the archive's digest; its `site/` goes first on
sys.path (its packages win) and `fallback/` last (the machine's win). Nothing is compiled: JIT compilation is
left to FlashInfer's own settings.

Two variants, on exactly the inputs the other peers get:
  flashinfer      bf16 q and cache (FlashInfer's prebuilt modules cover bf16 only; fp16 rows say unavailable)
  flashinfer-fp8  the e4m3 cache of shapes.make_fp8_inputs with the 16-bit q (per-tensor scale, as our
                  accurate mode); FlashInfer multiplies by bf16(scale), which is why make_fp8_inputs picks
                  bf16-representable descales: every FP8 peer then dequantizes to the same values.
The page table is FlashInfer's CSR form of each input copy's block table, one plan per copy (a plan holds its
pages), made once per shape.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import sys
import tarfile
import tempfile
from typing import Any, Optional

ENV_DIR = "FLASHMLA_BENCH_FLASHINFER_DIR"
DEFAULT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           ".peers", "flashinfer")
WORKSPACE_BYTES = 128 << 20

_state: dict[str, Any] = {}


class FlashInferMissing(Exception):
    """FlashInfer cannot be imported here; the message says where it was looked for."""


def bundle_dir() -> str:
    return os.environ.get(ENV_DIR) or DEFAULT_DIR


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _unpack(folder: str) -> str:
    """Unpacks folder/site.tar.xz once (checked against site.tar.xz.sha256 when present); returns the root."""
    archive = os.path.join(folder, "site.tar.xz")
    digest = _digest(archive)
    recorded = os.path.join(folder, "site.tar.xz.sha256")
    if os.path.exists(recorded):
        with open(recorded) as f:
            want = f.read().split()[0]
        if want != digest:
            raise FlashInferMissing(f"{archive}: sha256 {digest[:12]}... differs from {recorded} ({want[:12]}...)")
    root = os.path.join(tempfile.gettempdir(), f"flashmla_bench_flashinfer_{digest[:12]}")
    done = os.path.join(root, ".unpacked")
    if not os.path.exists(done):
        print(f"[flashinfer] unpacking {archive} -> {root}", file=sys.stderr, flush=True)
        partial = f"{root}.part{os.getpid()}"
        with tarfile.open(archive, "r:xz") as tar:
            tar.extractall(partial, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        if not os.path.exists(done):
            os.makedirs(os.path.dirname(root), exist_ok=True)
            if os.path.exists(root):
                import shutil
                shutil.rmtree(root)
            os.rename(partial, root)
            with open(done, "w") as f:
                f.write(digest + "\n")
    return root


def load() -> Any:
    """flashinfer.mla, importing FlashInfer from this Python or from the bundle; FlashInferMissing if neither."""
    if "mla" in _state:
        return _state["mla"]
    if "error" in _state:
        raise FlashInferMissing(_state["error"])
    try:
        try:
            mla = importlib.import_module("flashinfer.mla")
            how = "installed"
        except ImportError as installed_error:
            folder = bundle_dir()
            if not os.path.isfile(os.path.join(folder, "site.tar.xz")):
                raise FlashInferMissing(
                    f"flashinfer is not importable ({installed_error}) and no bundle at {folder} "
                    f"(a folder with site.tar.xz: --flashinfer-dir or ${ENV_DIR})") from None
            root = _unpack(folder)
            sys.path.insert(0, os.path.join(root, "site"))
            fallback = os.path.join(root, "fallback")
            if os.path.isdir(fallback):
                sys.path.append(fallback)
            tmp = tempfile.gettempdir()
            os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", os.path.join(tmp, "flashmla_bench_fi_ws"))
            os.environ.setdefault("TVM_FFI_CACHE_DIR", os.path.join(tmp, "flashmla_bench_fi_tvm"))
            for name in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
                del sys.modules[name]       # a failed import above may have left parts behind
            mla = importlib.import_module("flashinfer.mla")
            how = f"bundle {folder}"
        version = getattr(sys.modules.get("flashinfer"), "__version__", "?")
        print(f"[flashinfer] flashinfer {version} ({how})", file=sys.stderr, flush=True)
    except FlashInferMissing as e:
        _state["error"] = str(e)
        raise
    except Exception as e:   # the bundle's import failing (a missing library, an ABI mismatch)
        _state["error"] = f"flashinfer import failed: {type(e).__name__}: {e}"
        raise FlashInferMissing(_state["error"]) from e
    _state["mla"] = mla
    return mla


def workspace(device: Any) -> Any:
    """One float workspace for every plan (runs are sequential on one stream)."""
    import torch
    key = f"ws:{device}"
    if key not in _state:
        _state[key] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _state[key]


def csr_pages(block_table: Any, cache_seqlens: Any, page_size: int) -> tuple[Any, Any]:
    """(kv_indptr [b + 1], kv_indices) of FlashInfer's CSR page table: each request's first ceil(len / page)
    block-table entries, concatenated."""
    import torch
    pages = (cache_seqlens.long() + page_size - 1) // page_size
    indptr = torch.zeros(block_table.shape[0] + 1, dtype=torch.int32, device=block_table.device)
    indptr[1:] = torch.cumsum(pages, 0).to(torch.int32)
    width = torch.arange(block_table.shape[1], device=block_table.device)
    used = width.unsqueeze(0) < pages.unsqueeze(1)
    return indptr, block_table[used].to(torch.int32).contiguous()


def plan(mla: Any, device: Any, block_table: Any, cache_seqlens: Any, s_q: int, h_q: int, d_ckv: int, d_kpe: int,
         page_size: int, causal: bool, scale: float, q_dtype: Any, kv_dtype: Any) -> Any:
    """A planned BatchMLAPagedAttentionWrapper for one copy's page table (natural-log lse returned)."""
    import torch
    b = block_table.shape[0]
    qo_indptr = torch.arange(b + 1, dtype=torch.int32, device=device) * s_q
    kv_indptr, kv_indices = csr_pages(block_table, cache_seqlens, page_size)
    w = mla.BatchMLAPagedAttentionWrapper(workspace(device), backend="fa3")
    meta = mla.MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, cache_seqlens.to(torch.int32))
    fp8 = kv_dtype == torch.float8_e4m3fn
    w.plan(metadata=meta, num_heads=h_q, head_dim_ckv=d_ckv, head_dim_kpe=d_kpe, page_size=page_size,
           causal=causal, sm_scale=scale, q_data_type=q_dtype, kv_data_type=kv_dtype, lse_mode="basee",
           scale_mode="kv-per-tensor" if fp8 else "default")
    return w


def run_kwargs(descale_k: Optional[float]) -> dict:
    return {} if descale_k is None else {"ckv_scale": descale_k, "kpe_scale": descale_k}
