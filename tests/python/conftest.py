# The tests import the installed package (`pip install .` at the repository
# root, which scripts/test.sh runs; `pip install -e .` while editing): the
# native module kvq._native exists only once built, so the source tree
# is not put on the path.
import os
import sys

# The tests' own helpers (live_server.py, vllm_trace_model.py).
sys.path.insert(0, os.path.dirname(__file__))
