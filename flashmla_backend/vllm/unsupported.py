"""Stand-in backend registered when the installed vLLM is outside the supported range.

It imports nothing from vLLM (whose classes may have moved in that release). vLLM's selector calls
`validate_configuration` on the selected backend at start-up and raises
"Selected backend CUSTOM is not valid for this configuration. Reason: [...]" with the list it
returns, so selecting the backend fails at once with a message naming the supported versions,
and vLLM keeps working with every other backend.
"""
from __future__ import annotations

from . import _compat


class UnsupportedVLLMVersionBackend:
    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @classmethod
    def reason(cls) -> str:
        return _compat.unsupported_reason(_compat.installed_vllm_version()) or (
            "flashmla_backend: vLLM's version could not be checked"
        )

    @classmethod
    def validate_configuration(cls, *args, **kwargs) -> list[str]:
        return [cls.reason()]

    @classmethod
    def is_mla(cls) -> bool:
        return True
