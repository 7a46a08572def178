"""Engine version checks shared by the vLLM and SGLang plugins (their _compat modules hold the ranges)."""
from __future__ import annotations

import re


def parse_version(text: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a release string such as '0.26.0', '0.33.0rc1', '0.5.21.post1',
    '0.26.1.dev5+g1234'; None when it does not start with major.minor."""
    m = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def format_version(v: tuple[int, ...]) -> str:
    return ".".join(str(x) for x in v)


def version_range(lo: tuple[int, ...], hi_exclusive: tuple[int, ...]) -> str:
    return f">={format_version(lo)},<{format_version(hi_exclusive)}"


def installed_version(distribution: str) -> str:
    """The installed distribution's version from package metadata ('' when absent); imports nothing."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return ""


def in_range(version: str, lo: tuple[int, ...], hi_exclusive: tuple[int, ...]) -> bool:
    parsed = parse_version(version)
    return parsed is not None and lo <= parsed < hi_exclusive
