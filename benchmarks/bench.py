"""Run the MLA decode benchmark: same as `python -m flashmla_backend.bench` (see README.md here)."""
import importlib.util
import os
import sys

if importlib.util.find_spec("flashmla_backend") is None:   # not installed: use this checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flashmla_backend.bench import main

if __name__ == "__main__":
    sys.exit(main())
