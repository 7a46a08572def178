"""Which vLLM releases the plugin supports, and the few interface differences between them.

Checked with the CPU conformance tests (tests/test_vllm_cpu.py: registration, refusals, build(),
forward_mqa against the reference) on every release from 0.26.0 to 0.33.0 (0.26.0, 0.27.1, 0.28.0,
0.29.0, 0.30.0, 0.31.0, 0.32.0, 0.33.0, the newest when this was written); the later tests (vLLM's selector
with the named backends and the opt-in automatic choice, the builder's head count) on 0.26.0 and 0.33.0,
the two releases CI runs them on (tests/run.sh --engines). The GPU end-to-end tests run 0.26.0 (it pins
torch 2.11, which the GPU machines have; 0.27-0.29 pin torch 2.13, 0.33 torch 2.14).
Interface differences the plugin meets (read in the 0.26.0 and 0.33.0 wheels; "0.31-0.33" where the
0.31.0 and 0.32.0 sources were read too):
  - MLACommonBackend, MLACommonMetadataBuilder, MLACommonImpl and their metadata classes live in
    vllm.model_executor.layers.attention.mla_attention in 0.26 and 0.33 alike (the plugin imports them
    from there; 0.26 no longer has vllm/v1/attention/backends/mla/common.py);
  - 0.31-0.33 pass `max_query_len` to `MLACommonMetadataBuilder._build_decode`, by keyword, before
    `dcp_tot_seq_lens_device` (0.26 does not pass it): the plugin takes it as an optional keyword;
  - 0.33 calls `get_supported_kernel_block_sizes(kv_cache_spec)` with the spec (worker block-size
    selection) and without it (`supports_block_size`); 0.26 always without: the plugin's takes an
    optional argument;
  - 0.33 drops `get_kv_cache_shape`/`get_kv_cache_stride_order` from backends (the plugin defines neither;
    0.26 takes MLACommonBackend's) and moves the kernel-block split of block tables from BlockTable to
    AttentionGroup;
  - 0.31-0.33 count a KV-cache group's query heads on its layers in the MLA builder (`self.num_heads`),
    0.26 on the model: the plugin plans with the builder's count;
  - 0.33 reads the MLA dimensions from the layer object in the builder;
  - 0.33 asks `supports_device_cpu_query_lens_mismatch` (adaptive verification): the plugin says no;
  - 0.32+ `register_backend` also accepts a new string name (0.26-0.31 only enum members): the plugin
    adds FLASHMLA_BACKEND there;
  - `Platform.get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)` has the same
    signature in 0.26, 0.31, 0.32 and 0.33 (the opt-in automatic choice wraps it: default_choice.py);
  - decode context parallelism (DCP): both releases hand `_build_decode` the rank-local lengths
    (`CommonAttentionMetadata.dcp_local_seq_lens`) as `seq_lens_device` and the full ones as
    `dcp_tot_seq_lens_device`, gather the decode queries of the group by head before `forward_mqa`, and
    merge by lse (`cp_lse_ag_out_rs`: vllm/v1/attention/ops/common.py in 0.26, ops/dcp.py behind
    `MLADCPManager.combine` in 0.33) as [tokens, heads], base e unless the impl sets `lse_base_on_e`
    False. 0.26 asks for DCP through `can_return_lse_for_decode` only (`supports_dcp` defaults to True;
    a start-up check asserts `need_to_return_lse_for_decode`); 0.33 also asks `supports_dcp` (default
    False) when it selects the backend (`validate_configuration(use_dcp=...)`) and masks the lse of
    empty shards itself. Both force the decode threshold to 1 under DCP unless the builder passes
    `supports_dcp_with_varlen` (the plugin does not), and refuse MTP with an interleave size > 1 unless
    the impl sets `supports_mtp_with_cp_non_trivial_interleave_size`.
  - sparse MLA (DeepSeek-V3.2; the plugin's sparse backend, tests/test_vllm_sparse_cpu.py on 0.26.0 and 0.33.0):
    both releases put the indexer's top-k positions within each request in the impl's topk_indices_buffer and
    leave the translation to cache slots to the backend; both have SparseMLACommonMetadataBuilder and
    SparseMLACommonImpl in vllm.model_executor.layers.attention.sparse_mla_attention. 0.33 adds a common
    SparseMLACommonMetadata (keyword-only fields, decode_max_query_len) that 0.26 lacks (the plugin declares 0.26's
    fields itself: sparse_builder.py); 0.33 maps tokens to requests on the device
    (CommonAttentionMetadata.token_to_req_indices, a Triton kernel), 0.26 on the host; 0.33's impl registers each
    layer in an index group and reads the tensor-parallel size; 0.33 sizes the fp8_ds_mla page from the layer's
    KV-cache spec (state_content_bytes), 0.26 from the backend's get_kv_cache_shape (the plugin defines it).
    Both store `--kv-cache-dtype fp8` as fp8_ds_mla only for backends named FLASHMLA_SPARSE (and one other), in
    mla_attention._canonicalize_sparse_mla_kv_cache_dtype, which sparse_choice.py extends to the plugin's backend.
Releases outside [MIN_VERSION, MAX_VERSION_EXCLUSIVE) are refused when the backend is selected, with a
message naming the supported range (see flashmla_backend.vllm.unsupported).
"""
from __future__ import annotations

from .._versions import in_range, installed_version, version_range

MIN_VERSION = (0, 26, 0)
MAX_VERSION_EXCLUSIVE = (0, 34, 0)
TESTED_VERSIONS = ("0.26.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")


SUPPORTED_RANGE = version_range(MIN_VERSION, MAX_VERSION_EXCLUSIVE)


def installed_vllm_version() -> str:
    """The installed vLLM's version string, read from package metadata (does not import vllm)."""
    return installed_version("vllm")


def unsupported_reason(version: str) -> str | None:
    """None when `version` is in the supported range, else a message that names the supported versions."""
    if in_range(version, MIN_VERSION, MAX_VERSION_EXCLUSIVE):
        return None
    installed = f"vLLM {version} is installed" if version else "vLLM is not installed"
    return (
        f"flashmla_backend's vLLM plugin supports vLLM {SUPPORTED_RANGE} (tested on each minor release from "
        f"{TESTED_VERSIONS[0]} to {TESTED_VERSIONS[-1]}), but {installed}. Install a supported vLLM "
        f"(e.g. `pip install vllm==0.26.0`) or choose another attention backend."
    )


def selector_wrapped_by(platform, mark: str) -> bool:
    """True when a wrapper carrying attribute `mark` is on platform.get_attn_backend_cls, outermost or under other
    wrappers (the plugin's sparse MLA route and its opt-in automatic choice both wrap that method; each wrapper
    keeps the one it wraps as __wrapped__)."""
    fn = getattr(platform, "get_attn_backend_cls", None)
    while fn is not None:
        if getattr(fn, mark, False):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False
