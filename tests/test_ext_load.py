"""flashmla_backend._ext refuses a compiled module built for other constants (a stand-in module on the CPU)."""
import sys
import types

import pytest

from flashmla_backend import _ext, geometry, scheduler


def _fake_module(**changes):
    constants = dict(geometry.EXPORTED, fixed_overhead_blocks=scheduler.FIXED_OVERHEAD_BLOCKS,
                     min_part_blocks=scheduler.MIN_PART_BLOCKS,
                     sparse_min_part_blocks=scheduler.SPARSE_MIN_PART_BLOCKS)
    constants.update(changes)
    return types.SimpleNamespace(__file__="/nowhere/_C.so", schedule_constants=constants, cuda_runtime_version=13000)


@pytest.fixture
def with_module(monkeypatch):
    import flashmla_backend

    def install(module):
        monkeypatch.setitem(sys.modules, "flashmla_backend._C", module)
        monkeypatch.setattr(flashmla_backend, "_C", module, raising=False)
        _ext._load.cache_clear()

    yield install
    _ext._load.cache_clear()


def test_matching_constants_load(with_module):
    with_module(_fake_module())
    assert _ext.available()


@pytest.mark.parametrize("name,value", [("head_dim_k", 656), ("page_size", 32), ("meta_ints", 16),
                                        ("fixed_overhead_blocks", 4), ("min_part_blocks", 1),
                                        ("sparse_min_part_blocks", 2)])
def test_other_constants_refused(with_module, name, value):
    with_module(_fake_module(**{name: value}))
    assert not _ext.available()
    with pytest.raises(_ext.ExtensionNotBuiltError, match=rf"{name}: compiled {value}, Python"):
        _ext.ext()
