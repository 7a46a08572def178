"""The engine plugins where the engine is missing or unsupported: their messages say so, in words that read right.

Runs in any environment: the engine's modules are hidden (None in sys.modules) and its installed version is
replaced, so these hold whether or not vLLM / SGLang is installed here."""
import logging
import sys

import pytest

import flashmla_backend.sglang as sglang_plugin
import flashmla_backend.vllm as vllm_plugin
from flashmla_backend.sglang import _compat as sglang_compat
from flashmla_backend.vllm import _compat as vllm_compat


def hide(monkeypatch, package: str) -> None:
    """Make `import package` and every `import package.x` fail, as where it is not installed."""
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")] + [package]:
        monkeypatch.setitem(sys.modules, name, None)


def test_vllm_reason_when_vllm_is_missing():
    reason = vllm_compat.unsupported_reason("")
    assert "but vLLM is not installed." in reason and "(not installed)" not in reason
    assert vllm_compat.SUPPORTED_RANGE in reason
    assert "but vLLM 0.25.0 is installed." in vllm_compat.unsupported_reason("0.25.0")


def test_sglang_reason_when_sglang_is_missing():
    reason = sglang_compat.unsupported_reason("")
    assert "but SGLang is not installed." in reason and "(not installed)" not in reason
    assert sglang_compat.SUPPORTED_RANGE in reason
    assert "but SGLang 0.5.16 is installed." in sglang_compat.unsupported_reason("0.5.16")


def test_vllm_register_without_vllm_logs_that_it_is_missing(monkeypatch, caplog):
    hide(monkeypatch, "vllm")
    monkeypatch.setattr(vllm_compat, "installed_vllm_version", lambda: "")
    with caplog.at_level(logging.ERROR, logger="vllm.flashmla_backend"):
        vllm_plugin.register()
    text = caplog.text
    assert "cannot register the vLLM attention backend" in text and "but vLLM is not installed." in text, text


def test_sglang_register_without_sglang_raises_saying_so(monkeypatch):
    hide(monkeypatch, "sglang")
    monkeypatch.setattr(sglang_compat, "installed_sglang_version", lambda: "")
    with pytest.raises(ImportError, match=r"cannot register the SGLang attention backend: .* but SGLang is not "
                                          r"installed\. Install a supported SGLang"):
        sglang_plugin.register()


def test_sglang_register_with_a_broken_sglang_names_it(monkeypatch):
    hide(monkeypatch, "sglang")
    monkeypatch.setattr(sglang_compat, "installed_sglang_version", lambda: "0.5.23")
    with pytest.raises(ImportError, match=r"SGLang 0\.5\.23 is installed but "
                                          r"sglang\.srt\.layers\.attention\.attention_registry does not import"):
        sglang_plugin.register()
