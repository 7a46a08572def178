"""Which SGLang releases the plugin supports, and the interface differences between them.

Supported: SGLang >= 0.5.17, < 0.5.24. Checked with the CPU tests (tests/test_sglang_cpu.py) on each
release from 0.5.17 (the newest that pins torch 2.11, the GPU machines' torch) to 0.5.23 (the newest,
which pins torch 2.14.1); 0.5.18-0.5.21 pin torch 2.13, CI's torch. On a GPU only with 0.5.17
(integration/README.md); the other releases are checked on CPU against SGLang's real classes.

Differences inside the supported range that the plugin handles (read from the wheels):
  - 0.5.17: the server-argument choice lists live in `sglang.srt.server_args`; later releases define
    them in `sglang.srt.arg_groups.choices` (server_args re-exports them). The plugin adds its name
    where the release defines them.
  - 0.5.18+: `DraftBackendFactory` creators return `(stamp, backend)` (0.5.17: the backend alone).
  - 0.5.21+: `ModelRunner.kv_index_translator` (a unified KV pool translates req_to_token locations;
    the plugin refuses it), and `sglang.srt.utils.common` imports torchvision lazily.
  - 0.5.22+: the KV pools' write door, `set_kv_buffer(layer, loc, k, v)`, takes a `KVWriteLoc`
    (`sglang.srt.mem_cache.memory_pool`): `KVWriteLoc.for_batch(forward_batch)` carries the batch's
    `out_cache_loc` and its `out_cache_loc_is_physical` mark, and pools with
    `requires_physical_write_loc` (the unified pools) refuse a bare location tensor. The plugin writes
    through `KVWriteLoc.for_batch` there, a bare `out_cache_loc` before.
  - 0.5.22+: read page tables of translating pools come from the batch's `kv_loc_plan`
    (`KVIndexTranslator.copy_page_table`, `reads_are_translated`); the plugin reads `req_to_token`
    directly and still refuses translating pools (`is_translating`, present in every release).
  - CPU test environments (not the plugin): 0.5.22+ import `tvm_ffi` with ForwardBatch
    (`sglang.kernels.ops.communication.all_reduce`), 0.5.17 and 0.5.20 import xgrammar (0.5.18 and
    0.5.19 run with it too), 0.5.17-0.5.19 register a "qwen3_asr" config that transformers 5.18+ ship:
    tests/requirements-sglang-*-cpu.txt and tests/test_sglang_cpu.py.
  - 0.5.23: backends may opt in to the metadata glue graph (`glue_target_verify_metadata`,
    `glue_draft_metadata`; off by default, as the plugin leaves them). Whenever a glue graph runs
    (also with `SGLANG_ENABLE_METADATA_GLUE_GRAPH=1`, in 0.5.19+; 0.5.17 and 0.5.18 have no glue graph),
    SGLang snapshots and reinstalls each backend's `forward_metadata` per replay key, so the plugin keeps
    its per-batch metadata there.
  - DSA decode (flashmla_backend.sglang.dsa, FLASHMLA_BACKEND_DSA_DECODE): DeepseekSparseAttnBackend and the
    three methods hooked exist in 0.5.17, 0.5.21 and 0.5.23 (the releases read; 0.5.18-0.5.20 and 0.5.22 not
    checked); the backend's `dsa_index_kpool` (0.5.21, 0.5.23; not 0.5.17) and `dcp_size` (0.5.23 only) are read
    as 1 where absent; attention sinks (`attn_sink`) reach the decode in 0.5.21 and 0.5.23, not 0.5.17.
  - Unchanged from 0.5.17 to 0.5.23 and relied on: the attention registry, `HookRegistry` and the
    hook targets (flashmla_backend.sglang.hooks), `SharedReadEnds` and the default read ends
    (decode / target verify: IN_REPLAY; the plugin reads req_to_token and seq_lens only while building
    metadata), `init_forward_metadata_out_graph` / `_in_graph`, `init_cuda_graph_state`, the
    multi-step draft backend's interface, `MLATokenToKVPool`'s per-layer `[slots, 1, 576]` buffers.
"""
from __future__ import annotations

from .._versions import in_range, installed_version, parse_version, version_range

MIN_VERSION = (0, 5, 17)
MAX_VERSION_EXCLUSIVE = (0, 5, 24)
TESTED_VERSIONS = ("0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
# First release whose DraftBackendFactory creators return (stamp, backend).
DRAFT_CREATORS_RETURN_STAMP_SINCE = (0, 5, 18)
# First release whose KV pools take a KVWriteLoc (KVWriteLoc.for_batch) at set_kv_buffer.
KV_WRITE_LOC_FOR_BATCH_SINCE = (0, 5, 22)


SUPPORTED_RANGE = version_range(MIN_VERSION, MAX_VERSION_EXCLUSIVE)


def installed_sglang_version() -> str:
    """The installed SGLang's version string from package metadata ('' when absent; does not import sglang)."""
    return installed_version("sglang")


def unsupported_reason(version: str) -> str | None:
    """None when `version` is supported, else a message naming the supported versions."""
    if in_range(version, MIN_VERSION, MAX_VERSION_EXCLUSIVE):
        return None
    installed = f"SGLang {version} is installed" if version else "SGLang is not installed"
    return (
        f"flashmla_backend's SGLang plugin supports SGLang {SUPPORTED_RANGE} (tested: "
        f"{', '.join(TESTED_VERSIONS)}), but {installed}. Install a supported SGLang "
        "(e.g. `pip install sglang==0.5.17` with torch 2.11, sglang==0.5.21 with torch 2.13, or "
        "sglang==0.5.23 with torch 2.14.1) or choose another attention backend."
    )


def _since(version: str, first: tuple[int, int, int]) -> bool:
    parsed = parse_version(version)
    return parsed is not None and parsed >= first


def draft_creators_return_stamp(version: str) -> bool:
    return _since(version, DRAFT_CREATORS_RETURN_STAMP_SINCE)


def writes_take_kv_write_loc(version: str) -> bool:
    return _since(version, KV_WRITE_LOC_FOR_BATCH_SINCE)
