"""Benchmark harness for flashmla_backend's MLA decode (not part of the installed package).

Modules, by role:
  shapes   shape syntax, sequence lengths, random paged inputs, FLOP/byte accounting
  timing   timers, CUDA-graph capture, copy-bandwidth and matmul ceilings
  power    the GPU's power and SM clock over a timed window (NVML)
  check    the correctness guard against flashmla_backend.reference
  impls    the adapters of the timed implementations (ours, vLLM's FlashMLA / Triton / FA3, FlashInfer, naive PyTorch)
  flashinfer_peer  finding and importing FlashInfer (installed, or a prebuilt bundle) and planning its MLA decode
  run      one shape end to end: guard, timing, result rows
  report   results.json / results.csv / markdown table / roofline chart
  cli      the command line of benchmarks/bench.py

The scripts next to this package (bench.py, split_sweep.py, profile_ncu.py, ablation.py) import it as
`mla_bench`; the names they share are exported here. When flashmla_backend is not installed, the checkout
that holds this folder is put on sys.path so that its (in-place built) package is found.
"""
import importlib.util
import os
import sys

if importlib.util.find_spec("flashmla_backend") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from .shapes import make_inputs, make_seqlens, parse_shapes  # noqa: E402
from .timing import capture_graphs, time_with_events  # noqa: E402

__all__ = ["capture_graphs", "make_inputs", "make_seqlens", "parse_shapes", "time_with_events"]
