#!/usr/bin/env python3
"""The MLA decode benchmark: `python benchmarks/bench.py --help`; options and method in benchmarks/README.md.

Times flashmla_backend against vLLM's MLA decode kernels (bundled FlashMLA, Triton MLA, FA3 MLA) and a naive
PyTorch decode on the same inputs, with the GPU's copy bandwidth and matmul rate measured in the same run.
The harness lives in benchmarks/mla_bench/.
"""
import sys

from mla_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
