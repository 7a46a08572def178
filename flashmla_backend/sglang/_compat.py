"""Which SGLang releases the plugin supports, and the interface differences between them.

Supported: SGLang >= 0.5.17, < 0.5.22. Checked with the CPU tests (tests/test_sglang_cpu.py) on each
release from 0.5.17 (the newest that pins torch 2.11, the GPU machines' torch) to 0.5.21 (the newest
that pins torch 2.13, CI's torch); on an H100 with 0.5.17 (integration/README.md). Releases 0.5.22 and
0.5.23 pin torch 2.14 and change what a backend meets
(`KVWriteLoc` write locations, `kv_loc_plan` page tables, `SharedReadEnds` read fences, metadata glue
graphs, the choice lists moved to `sglang.srt.arg_groups.choices`): they are refused until tested.

Differences inside the supported range that the plugin handles (read from the wheels):
  - 0.5.18+: `DraftBackendFactory` creators return `(stamp, backend)` (0.5.17: the backend alone);
  - 0.5.21+: `ModelRunner.kv_index_translator` (a unified KV pool translates req_to_token locations;
    the plugin refuses it), and `sglang.srt.utils.common` imports torchvision lazily.
"""
from __future__ import annotations

from .._versions import in_range, installed_version, parse_version, version_range

MIN_VERSION = (0, 5, 17)
MAX_VERSION_EXCLUSIVE = (0, 5, 22)
TESTED_VERSIONS = ("0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21")
# First release whose DraftBackendFactory creators return (stamp, backend).
DRAFT_CREATORS_RETURN_STAMP_SINCE = (0, 5, 18)


SUPPORTED_RANGE = version_range(MIN_VERSION, MAX_VERSION_EXCLUSIVE)


def installed_sglang_version() -> str:
    """The installed SGLang's version string from package metadata ('' when absent; does not import sglang)."""
    return installed_version("sglang")


def unsupported_reason(version: str) -> str | None:
    """None when `version` is supported, else a message naming the supported versions."""
    if in_range(version, MIN_VERSION, MAX_VERSION_EXCLUSIVE):
        return None
    shown = version if version else "(not installed)"
    return (
        f"flashmla_backend's SGLang plugin supports SGLang {SUPPORTED_RANGE} (tested: "
        f"{', '.join(TESTED_VERSIONS)}), but SGLang {shown} is installed. Install a supported SGLang "
        "(e.g. `pip install sglang==0.5.17` with torch 2.11, or sglang==0.5.21 with torch 2.13) "
        "or choose another attention backend."
    )


def draft_creators_return_stamp(version: str) -> bool:
    parsed = parse_version(version)
    return parsed is not None and parsed >= DRAFT_CREATORS_RETURN_STAMP_SINCE
