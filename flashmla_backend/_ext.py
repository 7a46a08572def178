"""Loads the compiled module flashmla_backend._C once, with an error that says what to do."""
from __future__ import annotations

import functools


class ExtensionNotBuiltError(ImportError):
    pass


@functools.cache
def _load():
    try:
        from flashmla_backend import _C  # noqa: PLC0415
    except ImportError as e:  # not built, or built for another Python
        return None, e
    from flashmla_backend import geometry, scheduler  # noqa: PLC0415

    exported = dict(_C.schedule_constants)
    wrong = geometry.mismatches(exported)
    for name, value in (("fixed_overhead_blocks", scheduler.FIXED_OVERHEAD_BLOCKS),  # the CPU mirror's cost model
                        ("min_part_blocks", scheduler.MIN_PART_BLOCKS),
                        ("sparse_min_part_blocks", scheduler.SPARSE_MIN_PART_BLOCKS)):
        if exported.get(name) != value:
            wrong.append(f"{name}: compiled {exported.get(name)!r}, Python {value!r}")
    if wrong:  # a stale build from other sources: refuse it rather than compute with the wrong shapes
        return None, ImportError(f"{_C.__file__} was built for another MLA geometry ({'; '.join(wrong)}); rebuild it")
    return _C, None


def ext():
    """The compiled module; raises ExtensionNotBuiltError when it is missing."""
    module, error = _load()
    if module is None:
        raise ExtensionNotBuiltError(
            "flashmla_backend: the CUDA extension flashmla_backend._C is not available "
            f"({error}). GPU tensors need it: install the package with `pip install .` on a machine with "
            "nvcc (CUDA 12.8+), or `cmake -S . -B build -G Ninja && cmake --build build` for a source checkout (docs/build.md). "
            "CPU tensors work without it (pure-PyTorch reference)."
        ) from error
    return module


def available() -> bool:
    return _load()[0] is not None
