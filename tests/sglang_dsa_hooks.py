"""The plugin's DSA decode hooks (flashmla_backend.sglang.dsa) applied by SGLang's HookRegistry to its real
DeepseekSparseAttnBackend while a block runs, and the class's methods, the registry and the environment restored after:
for tests/test_sglang_sparse_cpu.py and integration/test_sglang_sparse_layer_gpu.py. Import it once SGLang imports (the
CPU tests' stand-ins first)."""
from __future__ import annotations

import contextlib
import os

from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
from sglang.srt.plugins.hook_registry import HookRegistry

from flashmla_backend.sglang import dsa

HOOKED = ("__init__", "forward_decode", "_forward_flashmla_sparse")   # the class's methods the hooks wrap
TARGETS = (dsa.INIT_TARGET, dsa.DECODE_TARGET, dsa.KERNEL_TARGET)     # their names in SGLang's registry


@contextlib.contextmanager
def applied_dsa_hooks(env: dict[str, str]):
    """env set (FLASHMLA_BACKEND_DSA_DECODE=1, and on a GPU the sparse opt-in), the hooks registered and applied."""
    saved = {name: DeepseekSparseAttnBackend.__dict__[name] for name in HOOKED}
    old_env = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        assert dsa.register_hooks() is True
        HookRegistry.apply_hooks()
        yield
    finally:
        for name, fn in saved.items():
            setattr(DeepseekSparseAttnBackend, name, fn)
        for target in TARGETS:
            HookRegistry._hooks.pop(target, None)
            HookRegistry._patched.discard(target)
        for name, value in old_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
